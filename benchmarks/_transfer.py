"""Section 5: batches from the host to an accelerator, staged or tensor by tensor.

With an accelerator, for each batch (detection, many leaves, tiles, nested)
and each kind of source memory (pageable,
as a ``DataLoader`` without ``pin_memory`` gives it, and pinned): ``to_device`` (staged),
``to_device(coalesce=False)``, accelerate's ``send_to_device``, ``TensorDict.to``,
``TensorDict.consolidate()`` then ``.to``, torch's own C++ ops through pinned memory (see
``THROUGH_PINNED``), and the bounds: one contiguous pinned tensor of the same bytes (the
link's), and for pageable batches one host copy of the bytes into pinned memory (the
host's, ``HOST_COPY``). Every move is ``non_blocking=True`` and followed by
``torch.accelerator.synchronize()``, so it is timed until it has landed. Rates are printed
in a unit that fits (GB/s, MB/s or kB/s); ``--nominal-gbps`` adds the fraction of the
datasheet figure, which torch cannot query.

With an accelerator, for the batch of many small leaves: the host's share of a staged move
per leaf, beside a floor made of torch's own C++ ops on the same leaves
(``torch._utils._flatten_dense_tensors``, one copy to the device,
``_unflatten_dense_tensors``, as torch's coalesced collectives move many tensors), timed in
the same rounds; the target is at most twice the floor. On the emulated accelerator (its
copies a memcpy) the whole move is host time.

Everywhere, accelerator or not: the host side of a staged move (collecting, packing into
the staging buffer, unpacking), measured as a move to ``meta`` through the staging seam
(:func:`devicectx.move._staging.forced`, with the real thresholds and ordinary host memory),
beside the per-tensor move to ``meta``: what staging costs the host.

The moves to the accelerator run with torch's intra-op threads set to the machine's cores
(a staged move packs with torch's multi-threaded copies, as in a training process), then
the benchmark's one thread is put back. The host side runs on that one thread: on a small
shared machine a second thread only adds noise (a parallel copy waits for a descheduled
thread), and the per-thread cost is what it shows.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _devices import accelerator
from _report import Row, judge
from _timing import Config, Measurement, Subject, as_json, bind, fmt_ns, measure_group
from _trees import Tree, as_tensordict, detection, load, many_leaves, nested, tensors_in, tiles

from devicectx import to_device
from devicectx.move import _staging

META = torch.device("meta")
STAGED = "to_device"
PER_TENSOR = "to_device(coalesce=False)"
REFERENCE = "one pinned copy"
SUBJECTS = (STAGED, PER_TENSOR, "send_to_device", "TensorDict.to", "TensorDict.consolidate().to")

# The staging targets, as the staged time over the per-tensor time, from pageable memory
# (the detection batch 3x faster, many leaves and tiles 4x, the nested batch 2x); from
# pinned memory, never slower.
_TARGETS = {"detection": 1 / 3, "leaves": 1 / 4, "tiles": 1 / 4, "nested": 1 / 2}


def batches(quick: bool) -> list[Tree]:
    """The batches: detection, many leaves, tiles, nested (scaled down in quick mode)."""
    if quick:
        return [detection(images=2, side=64), many_leaves(1_000), tiles(100), nested(scale=8)]
    return [detection(), many_leaves(10_000), tiles(1_000), nested(scale=128)]


def section_transfer(
    config: Config, quick: bool, nominal_gbps: float | None
) -> tuple[dict[str, Any], list[Row]]:
    """(5) the host side of staging, everywhere; with an accelerator, host-to-device moves
    of each batch, pinned or not, in ms and a rate. ``{"skipped": "no accelerator"}`` (and
    the host-side rows) without one."""
    trees = batches(quick)
    host_cases, rows = _host_side(config, trees)
    device = accelerator()
    if device is None:
        return {"skipped": "no accelerator"}, rows
    with _threads():
        out: dict[str, Any] = {
            "device": str(device),
            "nominal_gbps": nominal_gbps,
            "threads": torch.get_num_threads(),
            "cases": {},
            "host_side": host_cases,
        }
        for tree in trees:
            if tree.key.startswith("leaves"):
                out["per_leaf"], row = _per_leaf(config, tree, device)
                rows.append(row)
            reference = _reference(config, tree, device)
            host_copy = _host_copy(config, tree)
            for pinned in (False, True):
                references = {REFERENCE: reference}
                if not pinned:
                    references[HOST_COPY] = host_copy
                case = _case(config, tree, device, pinned, references, nominal_gbps)
                out["cases"][f"{tree.key}/{'pinned' if pinned else 'pageable'}"] = case
                rows.append(_row(tree, device, pinned, case))
    return out, rows


@contextlib.contextmanager
def _threads() -> Iterator[None]:
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(cores or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _host_side(config: Config, trees: list[Tree]) -> tuple[dict[str, Any], list[Row]]:
    """Staged and per-tensor moves to meta: the host's share of each, no device involved."""
    cases: dict[str, Any] = {}
    rows = []
    for tree in trees:
        subjects = {
            "per tensor": Subject(functools.partial(_to_meta, tree.tree, False)),
            "staged": Subject(
                functools.partial(_to_meta, tree.tree, True),
                lambda: _staging.forced(_staging.THRESHOLDS),
            ),
        }
        measured = measure_group(subjects, config)
        cases[tree.key] = {"label": tree.label, "subjects": as_json(measured)}
        rows.append(
            judge(
                "5 transfer",
                f"{tree.label} ({_megabytes(tree)}), cpu->meta: host side of a staged move "
                f"(collect, pack, unpack)",
                measured["staged"].median_ns,
                f"per tensor {_shown(measured['per tensor'])}",
                measured["per tensor"].median_ns,
                "per tensor",
                None,
            )
        )
    return cases, rows


FLOOR = "C++ floor (flatten, one copy, unflatten)"


def _per_leaf(config: Config, tree: Tree, device: torch.device) -> tuple[dict[str, Any], Row]:
    """A staged move of many small leaves, per leaf, against the C++ floor on the same leaves."""
    leaves = list(tensors_in(tree.tree))
    flatten = load("torch._utils", "_flatten_dense_tensors")
    unflatten = load("torch._utils", "_unflatten_dense_tensors")
    sync = torch.accelerator.synchronize

    def floor() -> Callable[[], Any]:
        return lambda: unflatten(flatten(leaves).to(device, non_blocking=True), leaves)

    makers: dict[str, Callable[[], Callable[[], Any]]] = {
        FLOOR: floor,
        STAGED: lambda: bind(to_device, tree.tree, device, non_blocking=True),
        PER_TENSOR: lambda: bind(to_device, tree.tree, device, non_blocking=True, coalesce=False),
    }
    subjects = {
        name: Subject(functools.partial(_synced, make, sync)) for name, make in makers.items()
    }
    measured = measure_group(subjects, config)
    count = len(leaves)
    per_leaf = {
        name: None if m.median_ns is None else m.median_ns / count for name, m in measured.items()
    }
    shown = {name: "n/a" if ns is None else fmt_ns(ns) for name, ns in per_leaf.items()}
    row = judge(
        "5 transfer",
        f"{tree.label} cpu->{device}: a staged move's host side per leaf, against the C++ floor",
        per_leaf[STAGED],
        f"{FLOOR} {shown[FLOOR]}; per tensor {shown[PER_TENSOR]} (a leaf)",
        per_leaf[FLOOR],
        "floor",
        2.0,
        ours_text=f"{shown[STAGED]} a leaf",
        target_text="<= 2x the floor",
    )
    return {"leaves": count, "per_leaf_ns": per_leaf, "subjects": as_json(measured)}, row


def _to_meta(tree: Any, staged: bool) -> Callable[[], Any]:
    return lambda: to_device(tree, META, coalesce=staged)


def _case(
    config: Config,
    tree: Tree,
    device: torch.device,
    pinned: bool,
    references: dict[str, Measurement],
    nominal_gbps: float | None,
) -> dict[str, Any]:
    source = _pinned(tree.tree) if pinned else tree.tree
    nbytes = _nbytes(tree)
    sync = torch.accelerator.synchronize
    makers: dict[str, Callable[[], Callable[[], Any]]] = {
        STAGED: lambda: bind(to_device, source, device, non_blocking=True),
        PER_TENSOR: lambda: bind(to_device, source, device, non_blocking=True, coalesce=False),
        "send_to_device": lambda: bind(
            load("accelerate.utils", "send_to_device"), source, device, non_blocking=True
        ),
        "TensorDict.to": lambda: bind(as_tensordict(source).to, device, non_blocking=True),
        "TensorDict.consolidate().to": lambda: _consolidated(as_tensordict(source), device),
        THROUGH_PINNED: lambda: _through_pinned(source, device),
    }
    subjects = {
        name: Subject(functools.partial(_synced, make, sync)) for name, make in makers.items()
    }
    measured = measure_group(subjects, config)
    measured.update(references)
    subjects_json = as_json(measured)
    rates = {}
    for name, m in measured.items():
        rates[name] = None if m.median_ns is None else nbytes / m.median_ns * 1e9
        if rates[name] is not None:
            shown = _rate(rates[name])
            if nominal_gbps:
                shown += f", {rates[name] / 1e7 / nominal_gbps:.2g}% of nominal"
            subjects_json[name]["detail"] = "; ".join(filter(None, [shown, m.detail]))
    return {
        "label": tree.label,
        "source": "pinned" if pinned else "pageable",
        "bytes": nbytes,
        "subjects": subjects_json,
        "bytes_per_s": rates,
    }


# torch's own C++ ops on the batch, the link at pinned speed: per dtype, every tensor's
# elements concatenated into one pinned buffer made beforehand, one copy, and the results
# as views of it. No move that gives each result memory of its own does less host work per
# tensor, and its host copy does not overlap its transfer: a floor for the many-tensor
# batches, a reference for the large ones.
THROUGH_PINNED = "torch's C++ ops through pinned memory (cat, one copy, views)"


def _through_pinned(tree: Any, device: torch.device) -> Callable[[], Any]:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors_in(tree):
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    flat = load("torch._utils", "_flatten_dense_tensors")
    unflatten = load("torch._utils", "_unflatten_dense_tensors")
    groups = [
        (tensors, torch.empty_like(flat(tensors)).pin_memory()) for tensors in by_dtype.values()
    ]

    def move() -> list[torch.Tensor]:
        results: list[torch.Tensor] = []
        for tensors, buffer in groups:
            torch.cat([tensor.reshape(-1) for tensor in tensors], out=buffer)
            results += unflatten(buffer.to(device, non_blocking=True), tensors)
        return results

    return move


# From pageable memory every byte is copied on the host into pinned memory before the link
# takes it: the batch's bytes as one such copy, with every thread the process has, is the
# host's bound, as the pinned copy is the link's; a staged move overlaps the two, and takes
# at least the longer.
HOST_COPY = "one host copy into pinned memory"


def _host_copy(config: Config, tree: Tree) -> Measurement:
    """The host's bound for a pageable batch: its bytes copied once into pinned memory."""
    source = torch.ones(_nbytes(tree), dtype=torch.uint8)
    pinned = torch.empty_like(source).pin_memory()
    make = functools.partial(pinned.copy_, source)
    return measure_group({HOST_COPY: Subject(lambda: make)}, config)[HOST_COPY]


def _reference(config: Config, tree: Tree, device: torch.device) -> Measurement:
    """The link's bound: the batch's bytes as one contiguous pinned tensor, one copy."""
    flat = torch.empty(_nbytes(tree), dtype=torch.uint8).pin_memory()
    sync = torch.accelerator.synchronize
    make = functools.partial(_synced, lambda: bind(flat.to, device, non_blocking=True), sync)
    return measure_group({REFERENCE: Subject(make)}, config)[REFERENCE]


def _row(tree: Tree, device: torch.device, pinned: bool, case: dict[str, Any]) -> Row:
    """Staged against per-tensor, with every peer and the bound in the peers' column."""
    subjects = case["subjects"]
    median = {name: subjects[name]["median_ns"] for name in subjects}
    peers = "; ".join(
        f"{name} {_timed(subjects[name], case['bytes'])}" for name in subjects if name != STAGED
    )
    family = next((key for key in _TARGETS if tree.key.startswith(key)), None)
    target = 1.0 if pinned else _TARGETS.get(family or "")
    text = None
    if target is not None:
        text = "never slower" if target == 1.0 else f">= {1 / target:g}x faster"
    source = "pinned" if pinned else "pageable"
    return judge(
        "5 transfer",
        f"{tree.label} ({_megabytes(tree)}, {source}) cpu->{device}: to_device, staged",
        median[STAGED],
        peers,
        median[PER_TENSOR],
        PER_TENSOR,
        target,
        ours_text=_timed(subjects[STAGED], case["bytes"]),
        target_text=text,
    )


def _timed(figures: dict[str, Any], nbytes: int) -> str:
    """``1.25 ms (40.3 GB/s)``, or why there is no figure."""
    if figures["median_ns"] is None:
        return str(figures["status"])
    return f"{fmt_ns(figures['median_ns'])} ({_rate(nbytes / figures['median_ns'] * 1e9)})"


def _rate(bytes_per_s: float) -> str:
    """A rate in the unit that shows it: ``52.10 GB/s``, ``640.00 MB/s``, ``1.60 MB/s``."""
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.2f} {unit}"
    return f"{bytes_per_s:.2f} B/s"


def _shown(measured: Measurement) -> str:
    return fmt_ns(measured.median_ns) if measured.ok else measured.status


def _nbytes(tree: Tree) -> int:
    return sum(t.nbytes for t in tensors_in(tree.tree))


def _megabytes(tree: Tree) -> str:
    nbytes = _nbytes(tree)
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.0f} kB"


def _consolidated(tensordict: Any, device: torch.device) -> Callable[[], Any]:
    return lambda: tensordict.consolidate().to(device, non_blocking=True)


def _synced(make: Callable[[], Callable[[], object]], sync: Callable[[], None]) -> Any:
    fn = make()

    def call() -> object:
        result = fn()
        sync()
        return result

    return call


def _pinned(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.pin_memory()
    if isinstance(tree, dict):
        return {k: _pinned(v) for k, v in tree.items()}
    return tuple(_pinned(v) for v in tree)
