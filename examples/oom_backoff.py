"""Out-of-memory back-off: evaluate with the largest batch size that fits.

    python examples/oom_backoff.py

``@shrink_batch_on_oom`` calls the function with the batch size it is given; when the
device runs out of memory it frees the allocator's cache, halves the batch size and tries
again, down to ``minimum``. Later calls start at the size that worked.

So that this runs anywhere, a pretend device with a small memory budget raises the same
``torch.OutOfMemoryError`` that CUDA raises when a batch does not fit.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import nn

from devicectx import BatchTooLargeError, shrink_batch_on_oom

BYTES_PER_SAMPLE = 3 * 2**20  # activations of one sample in the pretend model: 3 MiB


class PretendDevice:
    """Stands in for a GPU: an allocation over the budget raises torch's own error."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def allocate(self, samples: int) -> None:
        needed = samples * BYTES_PER_SAMPLE
        if needed > self.budget:
            msg = (
                f"CUDA out of memory. Tried to allocate {needed / 2**20:.2f} MiB. GPU 0 has a "
                f"total capacity of {self.budget / 2**20:.2f} MiB"
            )
            raise torch.OutOfMemoryError(msg)


@shrink_batch_on_oom(minimum=8)
def evaluate(
    model: nn.Module, data: torch.Tensor, device: PretendDevice, batch_size: int = 256
) -> tuple[float, int]:
    """Mean model output over ``data``, in batches of ``batch_size``; also the size used."""
    total = torch.zeros(())
    with torch.inference_mode():
        for start in range(0, len(data), batch_size):
            batch = data[start : start + batch_size]
            device.allocate(len(batch))
            total += model(batch).sum()
    return total.item() / len(data), batch_size


def main() -> None:
    # The shrinks are logged as warnings; show them next to the prints.
    logging.basicConfig(level=logging.WARNING, format="  log: %(message)s", stream=sys.stdout)
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    data = torch.randn(1000, 16)
    gpu = PretendDevice(budget=100 * 2**20)  # 100 MiB: fits 33 samples

    print("first call, batch_size=256:")
    mean, used = evaluate(model, data, gpu)
    print(f"  mean output {mean:.4f} with batch_size={used}")

    print("second call, batch_size=512: starts at the size that worked")
    mean, used = evaluate(model, data, gpu, batch_size=512)
    print(f"  mean output {mean:.4f} with batch_size={used}")

    print("a device too small for the minimum batch of 8:")
    try:
        evaluate(model, data, PretendDevice(budget=10 * 2**20), batch_size=16)
    except BatchTooLargeError as error:
        print(f"  BatchTooLargeError: {error}".replace("\n", "\n  "))
        print(f"  sizes tried: {error.tried}")


if __name__ == "__main__":
    main()
