"""A soak: many steps of ``prefetch`` and ``to_device``, pinned and device memory kept flat.

``python -m devicectx.testing.emulate --devices 1 benchmarks/soak.py`` (or on a GPU machine,
without the runner). Each step takes a batch from ``prefetch`` over a list of detection-like
batches (pageable) and moves a batch of small leaves with ``to_device``; every ``--every``
steps it reads the pinned staging memory devicectx holds (``staging_memory()``) and the
device memory the caching allocator has allocated, and prints both. The pinned pool grows
with need up to its bound (``Thresholds.pool_bytes``) and keeps what it has: it passes
where it never holds more than that; device memory passes where the last reading is no
more than the one after the warm-up. The script exits 1 where either fails.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from _devices import script_accelerator
from _trees import detection, many_leaves

from devicectx import prefetch, staging_memory, to_device
from devicectx.move._staging import THRESHOLDS


def _allocated(device: torch.device) -> int | None:
    """Device memory allocated now, where the accelerator's module reports it."""
    reader = getattr(torch.accelerator, "memory_allocated", None)  # torch >= 2.9
    if reader is None:
        reader = getattr(getattr(torch, device.type, None), "memory_allocated", None)
    if reader is None:
        return None
    try:
        return int(reader(device))
    except Exception:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=1_000, help="steps between readings")
    parser.add_argument("--warmup", type=int, default=50)
    args = parser.parse_args(argv)
    device = script_accelerator()
    if device is None:
        return 0
    sources = [detection(images=2, side=64, seed=i).tree for i in range(8)]
    leaves = many_leaves(200).tree
    readings: list[tuple[int, int, int | None]] = []
    batches: Any = iter(())
    for step in range(args.steps):
        batch = next(batches, None)
        if batch is None:
            batches = iter(prefetch(sources, device))
            batch = next(batches)
        moved = to_device(leaves, device, non_blocking=True)
        del batch, moved
        if step + 1 == args.warmup or (step + 1) % args.every == 0:
            torch.accelerator.synchronize()
            readings.append((step + 1, staging_memory(), _allocated(device)))
            print(f"step {step + 1}: pinned {readings[-1][1]:,} B, device {readings[-1][2]} B")
    first, last = readings[0], readings[-1]
    pinned = max(reading[1] for reading in readings)
    over = pinned > THRESHOLDS.pool_bytes
    grew = first[2] is not None and last[2] is not None and last[2] > first[2]
    print(
        f"pinned: at most {pinned:,} B, bound {THRESHOLDS.pool_bytes:,} B"
        f" ({'over' if over else 'within'}); device: {first[2]} B at step {first[0]},"
        f" {last[2]} B at step {last[0]} ({'grew' if grew else 'flat'})"
    )
    return 1 if grew or over else 0


if __name__ == "__main__":
    sys.exit(main())
