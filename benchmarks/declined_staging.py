"""What a declined staging costs a move to the accelerator, call by call.

``python -m devicectx.testing.emulate --devices 1 benchmarks/declined_staging.py`` (or on a
GPU machine, without the runner). The transfer section's row for this case (the nested
batch x128, all pinned: 3 small tensors, too few to stage, and 3 larger pinned ones, which
``.to`` copies as they are) compares medians of 25 interleaved trials of about ten calls
each; on the emulated accelerator those scatter by more than the 5% the target allows
(its copies are made by threads of the same two cores). Here the two subjects alternate
call by call (``to_device`` then ``to_device(coalesce=False)``, each waited for), so drift
and bursts of load hit both alike, and the medians of many calls are compared. It also
times the staging's look at the batch (``_staging.stage``, which declines) inside those
calls: right after a wait for the device it runs with cold caches, unlike in a tight loop.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from _devices import script_accelerator
from _timing import fmt_ns
from _transfer import _pinned
from _trees import nested

from devicectx import to_device
from devicectx.move import _staging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=600, help="calls of each, alternating")
    args = parser.parse_args(argv)
    device = script_accelerator()  # the emulated copies undelayed, as the benchmark's
    if device is None:
        return 1
    torch.set_num_threads(1)
    batch = _pinned(nested(128).tree)
    looks: list[int] = []
    stage = _staging.stage

    def timed_stage(*args: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return stage(*args)
        finally:
            looks.append(time.perf_counter_ns() - start)

    def call(coalesce: bool) -> int:
        start = time.perf_counter_ns()
        to_device(batch, device, non_blocking=True, coalesce=coalesce)
        torch.accelerator.synchronize()
        return time.perf_counter_ns() - start

    _staging.stage = timed_stage
    try:
        for _ in range(20):  # warm-up: the pool's probe, the allocator's blocks
            call(True), call(False)
        looks.clear()
        staged, per_tensor = [], []
        for _ in range(args.pairs):
            staged.append(call(True))
            per_tensor.append(call(False))
    finally:
        _staging.stage = stage
    ours, theirs = statistics.median(staged), statistics.median(per_tensor)
    print(
        f"{device}, torch {torch.__version__}, {args.pairs} alternating pairs of calls of the "
        f"nested batch x128 (13.8 MB, pinned), each waited for:"
    )
    print(f"to_device (staging declines): median {fmt_ns(ours)}")
    print(f"to_device(coalesce=False): median {fmt_ns(theirs)}")
    print(f"ratio: {ours / theirs:.3f}x (target <= 1.05x)")
    look = fmt_ns(statistics.median(looks))
    print(f"staging's look at the batch, inside those calls: median {look}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
