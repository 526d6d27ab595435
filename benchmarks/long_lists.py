"""The walks of a batch that holds a long Python list beside its tensors, each timed once.

``python -m devicectx.testing.emulate --devices 1 benchmarks/long_lists.py`` (or on a GPU
machine, without the runner). The batch: three tensors and a list of ``--items`` ints (the
samples' token ids, or file names, as a loader passes them). Each line is one call, in
seconds: ``to_device`` to ``meta``, a decorated call to the accelerator, ``find_devices``,
and ``prefetch`` up to its first batch (whose look at the batch, for tensors the move cannot
see, reads every item it walks). A walk that takes the list item by item costs a few
tenths of a microsecond an item in each; one that passes over a list of numbers whole, a
C-speed look.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from _devices import script_accelerator

from devicectx import device_agnostic, find_devices, prefetch, to_device


def timed(label: str, call: Callable[[], Any]) -> None:
    """Print how long one call of ``call`` took, in seconds."""
    started = time.perf_counter()
    call()
    print(f"{label}: {time.perf_counter() - started:.2f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=10**6, help="ints in the batch's list")
    args = parser.parse_args()
    device = script_accelerator()
    if device is None:
        return 1
    batch = {"x": torch.ones(3), "ids": list(range(args.items)), "y": [torch.ones(2)] * 8}

    @device_agnostic(device=device)
    def first(given: dict[str, Any]) -> torch.Tensor:
        return given["x"]  # type: ignore[no-any-return]

    timed("to_device to meta", lambda: to_device(batch, "meta"))
    timed(f"decorated call to {device}", lambda: first(batch))
    timed("find_devices", lambda: find_devices(batch))
    timed("prefetch, first batch", lambda: next(iter(prefetch([batch], device))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
