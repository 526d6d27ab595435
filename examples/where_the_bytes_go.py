"""Where the bytes go: a constant copied to the device on every step, found and fixed.

A training step takes a batch and a class-weight table made once on the CPU. Decorated
with ``@device_agnostic``, the step works, but the table crosses to the device at every
call: devicectx warns (``RepeatedMoveWarning``) and ``track_transfers`` shows the bytes.
Moved once before the loop, it no longer appears. Then an audited block finds a tensor
made off the device (``torch.frombuffer``, as ``torch.from_numpy`` would) where it is
made, not where it fails later.

Run it: ``python examples/where_the_bytes_go.py``. On a machine without a GPU the
``meta`` device plays the GPU (it has shapes and no data).
"""

from __future__ import annotations

import array
import warnings

import torch

from devicectx import (
    RepeatedMoveWarning,
    StrayTensorError,
    device_agnostic,
    on_device,
    resolve_device,
    track_transfers,
)

DEVICE = resolve_device("auto")
if DEVICE.type == "cpu":
    DEVICE = torch.device("meta")
STEPS = 5


@device_agnostic(device=DEVICE)
def loss_step(
    logits: torch.Tensor, labels: torch.Tensor, class_weights: torch.Tensor
) -> torch.Tensor:
    """Weighted cross-entropy on the device the decorator moves everything to."""
    return torch.nn.functional.cross_entropy(logits, labels, weight=class_weights)


def train(class_weights: torch.Tensor) -> None:
    """A few steps, each with a new batch from the 'loader' (on the CPU)."""
    for _ in range(STEPS):
        logits, labels = torch.randn(64, 3), torch.randint(0, 3, (64,))
        loss_step(logits, labels, class_weights)


def main() -> None:
    class_weights = torch.tensor([1.0, 2.0, 5.0])  # made once, on the CPU

    print(f"1. the class weights stay on the CPU ({DEVICE} plays the GPU)")
    with warnings.catch_warnings(record=True) as caught, track_transfers() as log:
        warnings.simplefilter("always")
        train(class_weights)
    for warning in caught:
        if issubclass(warning.category, RepeatedMoveWarning):
            print(f"warning: {warning.message}")
    print(log.table())

    print("\n2. moved once, before the loop")
    class_weights = class_weights.to(DEVICE)
    with warnings.catch_warnings(record=True) as caught, track_transfers() as log:
        warnings.simplefilter("always")
        train(class_weights)
    repeats = [w for w in caught if issubclass(w.category, RepeatedMoveWarning)]
    print(f"repeated-move warnings: {len(repeats)}")
    print(log.table())

    print(f"\n3. an audited block on {DEVICE}")
    table = array.array("f", range(4))  # a buffer read from a file, a NumPy array, ...
    try:
        with on_device(DEVICE, audit="raise"):
            positions = torch.frombuffer(table, dtype=torch.float32)
            print(positions.device)  # not reached
    except StrayTensorError as error:
        print(f"StrayTensorError: {error}")


if __name__ == "__main__":
    main()
