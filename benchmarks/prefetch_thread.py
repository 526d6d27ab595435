"""Where ``prefetch`` packs a batch: on its own thread, or in the caller's ``next()``.

``python -m devicectx.testing.emulate --devices 1 benchmarks/prefetch_thread.py`` (or on a
GPU machine, without the runner). A training loop whose step waits for its device work
(``loss.item()``: the host blocked, the GIL released) for about as long as one batch's
move takes, over pageable detection batches (a ``DataLoader`` without ``pin_memory``):

- ``prefetch``: the moves on the prefetcher's thread (what devicectx does);
- ``prefetch, moves in next()``: the same prefetcher with its thread replaced by one that
  runs each move at once, in the caller's thread (what it did before);
- ``to_device in the step``, and the bound ``max(step, move)``, what perfect overlap gives.

The subjects alternate epoch by epoch, so that drift and bursts of load hit each alike;
per step, medians of the epochs. The host's wait stands for the device's work: the
emulated accelerator computes with the host's own cores, which would share them with the
packing and hide what overlaps (its figures show the shape of the work, not a device's
speed; its copies are made undelayed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _devices import script_accelerator
from _timing import fmt_ns
from _transfer import _megabytes
from _trees import detection

from devicectx import prefetch, to_device
from devicectx.move._background import Ticket


class _InCaller:
    """A stand-in for the prefetcher's thread that runs each move at once, in the caller's."""

    def submit(self, job: Callable[..., Any], *args: Any) -> Ticket:
        ticket = Ticket()
        try:
            ticket._value = job(*args)
        except Exception as error:
            ticket._error = error
        ticket._done.set()
        return ticket

    def stop(self) -> None:
        pass

    def here(self) -> bool:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15, help="epochs of each subject")
    parser.add_argument("--steps", type=int, default=16, help="steps an epoch")
    parser.add_argument("--images", type=int, default=8, help="images of 3x512x512 a batch")
    args = parser.parse_args(argv)
    device = script_accelerator()
    if device is None:
        return 1
    tree = detection(images=args.images)
    batch = tree.tree
    loader = [batch] * args.steps
    sync = torch.accelerator.synchronize

    def epoch_of(batches: Any, move: Callable[[Any], Any]) -> float:
        start = time.perf_counter_ns()
        for item in batches:
            step(move(item))
        sync()
        return (time.perf_counter_ns() - start) / args.steps

    def moves_only() -> float:
        start = time.perf_counter_ns()
        for item in loader:
            to_device(item, device, non_blocking=True)
        sync()
        return (time.perf_counter_ns() - start) / args.steps

    moves_only()
    move_ns = statistics.median(moves_only() for _ in range(5))

    def step(moved: Any) -> None:
        moved["images"].flatten()[:16].sum()  # reads the batch on the device
        time.sleep(move_ns / 1e9)  # the device's work, waited for (loss.item())

    def threaded() -> float:
        return epoch_of(prefetch(loader, device), lambda item: item)

    def in_caller() -> float:
        batches = prefetch(loader, device)
        assert batches._streams is not None
        batches._streams.worker = _InCaller()  # type: ignore[assignment]
        return epoch_of(batches, lambda item: item)

    def in_step() -> float:
        return epoch_of(loader, lambda item: to_device(item, device, non_blocking=True))

    subjects = {
        "prefetch": threaded,
        "prefetch, moves in next()": in_caller,
        "to_device in the step": in_step,
    }
    times: dict[str, list[float]] = {name: [] for name in subjects}
    for _ in range(args.epochs):
        for name, run in subjects.items():
            times[name].append(run())
    medians = {name: statistics.median(values) for name, values in times.items()}
    bound = move_ns  # the step waits as long as a move takes: max(step, move)
    print(
        f"{device}, torch {torch.__version__}, {torch.get_num_threads()} torch threads; "
        f"{args.images} images a batch ({_megabytes(tree)}, pageable), {args.steps} steps "
        f"an epoch, {args.epochs} epochs each, alternating"
    )
    print(f"one batch's move (moves alone, per batch): {fmt_ns(move_ns)}; the step waits as long")
    print("| subject | per step | against the bound max(step, move) |")
    print("| --- | --- | --- |")
    for name, value in medians.items():
        print(f"| {name} | {fmt_ns(value)} | {value / bound:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
