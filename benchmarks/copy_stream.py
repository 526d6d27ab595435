"""What the copy stream gives a training loop that moves each batch in the step.

``python -m devicectx.testing.emulate --devices 1 benchmarks/copy_stream.py`` (or on a GPU
machine, without the runner). A non-blocking staged move to an accelerator whose current
stream has work queued queues its copies on the device's copy stream
(``devicectx.move._streams``), and the caller's stream waits on an event after them;
``devicectx.move.STATE.copy_stream = False`` queues them on the caller's stream, as
before (as a move to an idle stream still does). In ``for b in loader: step(to_device(b, d,
non_blocking=True))``, with the host ahead of the device, the copies then start at once,
beside the device work queued before them, and the staging chunks (at most 64 MiB of
pinned memory, in 4 MiB chunks) are free again when the copies land, not when the caller's
stream has also run that work. A step should take about max(compute, copy), not their sum.

Each epoch is ``--steps`` steps, each ``moved = to_device(batch, d, non_blocking=True)``
then the step's device work queued on the current stream, then one
``torch.accelerator.synchronize()``; per step is the epoch's time over its steps. Four
subjects, one epoch each per round, many rounds (the two moves in alternating order), so
that drift and bursts of load hit them alike; medians of the rounds are compared:

- ``copy stream on`` and ``copy stream off``: the loop, ``STATE.copy_stream`` True and False;
- ``copy only``: the moves alone (the copy stream on, the default);
- ``compute only``: the device work alone, on a batch moved once, before the loop;
- the bound: ``max(compute only, copy only)``, what perfect overlap gives (an epoch's
  first copy and last compute overlap nothing: the bound plus the lesser of the two over
  the steps is printed too).

The device work is calibrated to take, in a loop, about one batch's copy time in a loop of
copies. On a GPU: square matmuls (1024 x 1024) after a read of a little of the batch. On
the emulated accelerator ops queue no work on streams (each runs on the host once the
current stream drains), so a unit of work is a non_blocking copy of one element from the
device into pinned memory, queued on the current stream, done ``--delay-ms`` after the
stream reaches it; the step reads nothing of the batch (a read would wait for the stream).
The delay is 2 ms by default, the emulator's own: at 1 ms the delays were a third of a
batch's copy, the rest the host's packing and page faults, on the same two cores.
Its copies are delayed too (not undelayed as in ``bench.py``), and it does not poison
freed device memory (a memset that its streams would run, which a GPU does not): its
figures show overlap, not a device's speed.

Two batches: the detection batch (48 images 3x512x512 on a GPU, 151 MB, over twice the
staging pool, so that chunks are reused within a step; 24 images on the emulated
accelerator, 75.5 MB, to keep the run short), from pageable memory, then pinned. Pinned,
its larger tensors (over 64 KiB: the images) are sent directly with ``.to``, never
staged, and its small ones are staged only while the caller's stream is idle (a pinned
source may be the target of a copy still queued there): with the host ahead, the copy
stream has little or nothing to move. The lines "tensors staged per move" say how much
went through the staging in each loop.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _devices import accelerator
from _prefetch import _median_ns, copy_stream_set
from _timing import fmt_ns
from _transfer import _pinned, _threads
from _trees import Tree, detection, load, tensors_in

from devicectx import set_repeated_move_warning, to_device
from devicectx.move import _staging
from devicectx.move._staging._state import STATE

ON = "copy stream on"
OFF = "copy stream off"
COPY = "copy only"
COMPUTE = "compute only"
WARM_UP = 2  # rounds: the pool's chunks, the allocators' blocks, the copy stream


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12, help="epochs of each subject")
    parser.add_argument("--steps", type=int, help="steps an epoch (32 on a GPU, else 8)")
    parser.add_argument("--delay-ms", type=float, default=2.0, help="emulated copies' delay")
    args = parser.parse_args(argv)
    device = accelerator()
    if device is None:
        print("no accelerator: run it under python -m devicectx.testing.emulate")
        return 1
    emulated = device.type == "emu"
    if emulated:
        load("devicectx.testing.emulated", "configure")(delay_ms=args.delay_ms, poison=False)
    steps = args.steps or (8 if emulated else 32)
    set_repeated_move_warning(False)  # the same batch every step, on purpose
    warnings.simplefilter("ignore")
    tree = detection(images=24 if emulated else 48)
    delay = f", copies delayed {args.delay_ms:g} ms, no poison" if emulated else ""
    with _threads():
        print(
            f"{device}, torch {torch.__version__}, {torch.get_num_threads()} torch threads"
            f"{delay}; {steps} steps an epoch, {args.rounds} rounds of the 4 subjects:"
        )
        for pinned in (False, True):
            _case(tree, device, emulated, pinned, steps, args.rounds)
    return 0


def _case(
    tree: Tree, device: torch.device, emulated: bool, pinned: bool, steps: int, rounds: int
) -> None:
    batch = _pinned(tree.tree) if pinned else tree.tree
    sync = torch.accelerator.synchronize
    megabytes = sum(t.nbytes for t in tensors_in(batch)) / 1e6

    def moved() -> Any:
        return to_device(batch, device, non_blocking=True)

    resident = to_device(batch, device)
    copy_ns = _median_ns(lambda: _loop(moved, steps, sync)) / steps
    unit, unit_text, reads = _device_work(device, emulated)
    units = max(1, round(copy_ns / _median_ns(lambda: _loop(unit, 20, sync)) * 20))

    def step(batch: Any) -> Any:
        seen = reads(batch)
        for _ in range(units):
            unit()
        return seen

    loops: dict[str, tuple[Callable[[], Any], bool]] = {
        ON: (lambda: step(moved()), True),
        OFF: (lambda: step(moved()), False),
        COPY: (moved, STATE.copy_stream),
        COMPUTE: (lambda: step(resident), STATE.copy_stream),
    }
    per_step: dict[str, list[float]] = {name: [] for name in loops}
    staged: dict[str, list[float]] = {name: [] for name in loops}
    with _counted() as counts:
        for round_ in range(WARM_UP + rounds):
            order = [ON, OFF] if round_ % 2 else [OFF, ON]
            for name in [*order, COPY, COMPUTE]:
                run, copy_stream = loops[name]
                counts.clear()
                elapsed = _epoch(run, steps, sync, copy_stream)
                if round_ >= WARM_UP:
                    per_step[name].append(elapsed / steps)
                    staged[name].append(sum(counts) / steps)
    median = {name: statistics.median(times) for name, times in per_step.items()}
    bound = max(median[COPY], median[COMPUTE])
    source = "pinned" if pinned else "pageable"
    print()
    print(
        f"{source}: {tree.label}, {megabytes:.1f} MB in {tree.leaves} tensors; the step's "
        f"device work: {units} {unit_text}:"
    )
    print(
        "tensors staged per move: "
        + ", ".join(f"{statistics.median(staged[name]):g} ({name})" for name in (ON, OFF, COPY))
    )
    for name in (COPY, COMPUTE):
        print(f"{name}: {fmt_ns(median[name])} per step ({_spread(per_step[name])})")
    # An epoch's first copy and last compute overlap nothing: perfect overlap gives this.
    filled = bound + min(median[COPY], median[COMPUTE]) / steps
    print(
        f"bound max(compute, copy): {fmt_ns(bound)} per step; with the epoch's first copy "
        f"and last compute, which nothing overlaps: {fmt_ns(filled)}"
    )
    for name in (ON, OFF):
        print(
            f"{name}: {fmt_ns(median[name])} per step ({_spread(per_step[name])}), "
            f"{median[name] / bound:.3f}x the bound"
        )
    ratios = [on / off for on, off in zip(per_step[ON], per_step[OFF], strict=True)]
    print(
        f"ratio on / off: {median[ON] / median[OFF]:.3f}x "
        f"(round by round {min(ratios):.3f}-{max(ratios):.3f}x)"
    )


def _device_work(
    device: torch.device, emulated: bool
) -> tuple[Callable[[], Any], str, Callable[[Any], Any]]:
    """One unit of the step's device work, queued on the current stream; what it is; and
    the step's read of the batch."""
    if emulated:
        source = torch.zeros(1, device=device)
        target = torch.empty(1).pin_memory()

        def copy() -> Any:
            return target.copy_(source, non_blocking=True)

        return copy, "copies from the device into pinned memory", _nothing

    side = 1024 if device.type == "cuda" else 128
    a = torch.randn(side, side, device=device)
    out = torch.empty_like(a)

    def matmul() -> Any:
        return torch.mm(a, a, out=out)

    def reads(batch: Any) -> Any:
        return batch["images"].flatten()[:4096].sum()  # after the copy, on the device

    return matmul, f"matmuls {side}x{side}", reads


def _nothing(batch: Any) -> None:
    return None


def _loop(run: Callable[[], Any], count: int, sync: Callable[[], None]) -> None:
    for _ in range(count):
        run()
    sync()


def _epoch(run: Callable[[], Any], steps: int, sync: Callable[[], None], copy_stream: bool) -> int:
    """The epoch's time in ns, with ``STATE.copy_stream`` set to ``copy_stream`` in it."""
    with copy_stream_set(copy_stream):
        start = time.perf_counter_ns()
        _loop(run, steps, sync)
        return time.perf_counter_ns() - start


@contextlib.contextmanager
def _counted() -> Iterator[list[int]]:
    """The tensors each staged move to the accelerator staged, in a list, for the block."""
    counts: list[int] = []
    to_accelerator = _staging.to_accelerator

    def counted(*args: Any) -> Any:
        results = to_accelerator(*args)
        counts.append(len(results))
        return results

    _staging.to_accelerator = counted
    try:
        yield counts
    finally:
        _staging.to_accelerator = to_accelerator


def _spread(times: list[float]) -> str:
    return f"epochs {fmt_ns(min(times))}-{fmt_ns(max(times))}"


if __name__ == "__main__":
    sys.exit(main())
