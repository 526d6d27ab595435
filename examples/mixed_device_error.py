"""A mixed-device call: PyTorch's kernel message, then devicectx's, then the fix.

    python examples/mixed_device_error.py

The everyday bug: the model went to the GPU, one input stayed on the CPU. This machine may
have no GPU, so the ``meta`` device plays the GPU: PyTorch refuses to mix it with the CPU
just as it refuses to mix ``cuda`` with it.
"""

from __future__ import annotations

import torch
from torch import nn

from devicectx import DeviceMismatchError, device_agnostic


def loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the model on one batch."""
    return nn.functional.mse_loss(model(inputs), targets)


# The same function, decorated two ways. move=False only checks, and stops a bad call
# before PyTorch sees it; the default, move=True, moves every input to the model's device.
checked_loss = device_agnostic(move=False)(loss)
moved_loss = device_agnostic(loss)


def main() -> None:
    model = nn.Linear(4, 2, device="meta")  # "on the GPU"
    batch = {"inputs": torch.randn(8, 4), "targets": torch.randn(8, 2, device="meta")}

    print("PyTorch alone:")
    try:
        loss(model, batch["inputs"], batch["targets"])
    except RuntimeError as error:
        print(f"  RuntimeError: {error}")

    print()
    print("with @device_agnostic(move=False):")
    try:
        checked_loss(model, batch["inputs"], batch["targets"])
    except DeviceMismatchError as error:
        print(f"  DeviceMismatchError: {error}".replace("\n", "\n  "))

    print()
    print("with @device_agnostic (move=True, the default):")
    result = moved_loss(model, batch["inputs"], batch["targets"])
    print(f"  loss on {result.device}, shape {tuple(result.shape)}")
    print(f"  the caller's inputs are still on {batch['inputs'].device}")


if __name__ == "__main__":
    main()
