"""Where a staged move of a pageable batch spends its time on an accelerator.

``python benchmarks/staged_breakdown.py`` on a GPU machine (or under ``python -m
devicectx.testing.emulate --devices 1``, where the figures show the shape of the work, not a
device's speed). The transfer section of ``bench.py`` times the whole move; this script
takes it apart, for the pageable detection batch (16 images 3x512x512, boxes, labels:
50 MB), with every core the process has:

- ``staged, blocking``: ``to_device(batch, d)``, the copies waited for;
- ``staged, host's share``: ``to_device(batch, d, non_blocking=True)`` until it returns
  (collecting, packing into pinned chunks, queueing the copies), a synchronize before each
  call, untimed (the median of the calls' own times); what is left of the blocking move is
  the link's tail that the host did not overlap;
- ``packing alone``: each tensor copied into its place in a pinned buffer of the batch's
  size, as the staging packs them, no device involved;
- ``one host copy``: the batch's bytes as one copy into pinned memory (the host's bound);
- ``link, a copy per tensor``: from that pinned buffer, one copy per tensor to the device,
  waited for; ``link, one copy``: the batch's bytes in one copy (the link's bound);
- ``packed and sent by hand``: each piece of 4 (or 16) MiB of each tensor copied into its
  place in that pinned buffer, then its copy to the device queued, the next packed
  meanwhile: the pipeline a staged move makes, without its chunks, pool or bookkeeping;
- ``per tensor``: ``to_device(batch, d, coalesce=False)``;
- the same batch pinned: ``per tensor``, and the staged move blocking and its host share.

The staged rows are timed for staging chunks of 4 MiB (the default), 16 MiB and 64 MiB
(the pool four times the batch, so that no chunk is waited for), and with a quarter of the
cores: if the host's share is near packing alone and the blocking move near the sum of
packing and the link, the two do not overlap; if packing alone is far above one host
copy, the per-copy cost of the packing is what to cut.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _devices import script_accelerator
from _timing import Config, Subject, fmt_ns, measure_group
from _trees import detection

from devicectx import to_device
from devicectx.move._staging import Thresholds
from devicectx.move._staging._state import STATE, swapped

_MIB = 1024 * 1024


def _pinned(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.pin_memory()
    return {key: _pinned(value) for key, value in tree.items()}


def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    return [leaf for value in tree.values() for leaf in _leaves(value)]


def _chunks(chunk_mib: int | None) -> Callable[[], Any]:
    """The scope of a subject staging with chunks of ``chunk_mib`` (a pool of its own, made
    at the subject's first call and kept across its loops, at least four times the batch);
    None: the default pool."""
    if chunk_mib is None:
        return contextlib.nullcontext
    thresholds = Thresholds(
        chunk_bytes=chunk_mib * _MIB, pool_bytes=max(256, 16 * chunk_mib) * _MIB
    )
    state = STATE.replace(thresholds=thresholds, hosts={}, backoff={})
    return functools.partial(swapped, state)


def _synced(fn: Callable[[], Any]) -> Callable[[], None]:
    sync = torch.accelerator.synchronize

    def call() -> None:
        fn()
        sync()

    return call


class _HostShare:
    """A non-blocking move that times itself: a synchronize first (untimed), then the call
    until it returns; ``spent`` holds each call's seconds (the loop's time would count the
    synchronize, which waits for the last call's copies)."""

    def __init__(self, batch: Any, device: torch.device) -> None:
        self.batch, self.device = batch, device
        self.spent: list[float] = []

    def __call__(self) -> None:
        torch.accelerator.synchronize()
        start = time.perf_counter()
        to_device(self.batch, self.device, non_blocking=True)
        self.spent.append(time.perf_counter() - start)


def run(device: torch.device, config: Config, threads: int, quick: bool) -> dict[str, Any]:
    """Every subject's measurement with ``threads`` torch threads."""
    torch.set_num_threads(threads)
    batch = (detection(images=2, side=64) if quick else detection()).tree
    leaves = _leaves(batch)
    nbytes = sum(leaf.nbytes for leaf in leaves)
    flat = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    source = torch.ones(nbytes, dtype=torch.uint8)
    places = []
    at = 0
    for leaf in leaves:
        places.append(flat[at : at + leaf.nbytes].view(leaf.dtype).view(leaf.shape))
        at += leaf.nbytes
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    device_places = []
    at = 0
    for leaf in leaves:
        device_places.append(on_device[at : at + leaf.nbytes])
        at += leaf.nbytes

    def packing() -> None:
        for place, leaf in zip(places, leaves, strict=True):
            place.copy_(leaf)

    def link_per_tensor() -> None:
        for target, place in zip(device_places, places, strict=True):
            target.copy_(place.view(torch.uint8).view(-1), non_blocking=True)

    def by_hand(piece_mib: int) -> Callable[[], None]:
        # Each piece of at most piece_mib packed, then its copy queued: the next piece is
        # packed while it is on its way; no chunks, no pool, nothing of devicectx.
        pieces = []
        step = piece_mib * _MIB
        for target, place, leaf in zip(device_places, places, leaves, strict=True):
            raw_place, raw_leaf = place.view(torch.uint8).view(-1), leaf.view(torch.uint8).view(-1)
            for at in range(0, leaf.nbytes, step):
                size = min(step, leaf.nbytes - at)
                pieces.append(
                    (target[at : at + size], raw_place[at : at + size], raw_leaf[at : at + size])
                )

        def send() -> None:
            for target, place, piece in pieces:
                place.copy_(piece)
                target.copy_(place, non_blocking=True)

        return _synced(send)

    subjects: dict[str, Subject] = {
        "packing alone": Subject(lambda: packing),
        "packed and sent by hand, 4 MiB pieces": Subject(lambda: by_hand(4)),
        "packed and sent by hand, 16 MiB pieces": Subject(lambda: by_hand(16)),
        "one host copy": Subject(lambda: functools.partial(flat.copy_, source)),
        "link, a copy per tensor": Subject(lambda: _synced(link_per_tensor)),
        "link, one copy": Subject(
            lambda: _synced(functools.partial(on_device.copy_, flat, non_blocking=True))
        ),
        "per tensor": Subject(
            lambda: _synced(functools.partial(to_device, batch, device, coalesce=False))
        ),
    }
    pinned = _pinned(batch)
    subjects["per tensor, pinned"] = Subject(
        lambda: _synced(functools.partial(to_device, pinned, device, coalesce=False))
    )
    subjects["staged, blocking, pinned"] = Subject(
        lambda: functools.partial(to_device, pinned, device)
    )
    shares: dict[str, _HostShare] = {"staged, host's share, pinned": _HostShare(pinned, device)}
    subjects["staged, host's share, pinned"] = Subject(
        lambda: shares["staged, host's share, pinned"]
    )
    for chunk_mib in (None, 16, 64):
        name = "4 MiB chunks" if chunk_mib is None else f"{chunk_mib} MiB chunks"
        scope = _chunks(chunk_mib)
        subjects[f"staged, blocking, {name}"] = Subject(
            lambda: functools.partial(to_device, batch, device), scope
        )
        share = shares[f"staged, host's share, {name}"] = _HostShare(batch, device)
        subjects[f"staged, host's share, {name}"] = Subject(lambda share=share: share, scope)
    measured = measure_group(subjects, config)
    for name, share in shares.items():  # each call's own time, not its loop's
        if measured[name].ok:
            measured[name].median_ns = statistics.median(share.spent) * 1e9
    return {"threads": threads, "bytes": nbytes, "tensors": len(leaves), "measured": measured}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=7, help="timed loops a subject")
    parser.add_argument(
        "--quick", action="store_true", help="a small batch, one short loop: a smoke run"
    )
    args = parser.parse_args(argv)
    device = script_accelerator()
    if device is None:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    config = Config(min_time=0.002, trials=1) if args.quick else Config(0.02, args.trials)
    print(f"{device}, torch {torch.__version__}, {cores} cores; medians of {config.trials} trials")
    for threads in sorted({cores or 1, max(1, (cores or 1) // 4)}, reverse=True):
        out = run(device, config, threads, args.quick)
        print(f"\n{threads} torch threads, {out['tensors']} tensors, {out['bytes'] / 1e6:.1f} MB")
        print("| subject | median | GB/s |\n| --- | --- | --- |")
        for name, measurement in out["measured"].items():
            if not measurement.ok:
                print(f"| {name} | {measurement.status}: {measurement.detail} | |")
                continue
            rate = out["bytes"] / measurement.median_ns
            print(f"| {name} | {fmt_ns(measurement.median_ns)} | {rate:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
