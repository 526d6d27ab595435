"""Section 5, with an accelerator only: host-to-device bandwidth of the batches.

Each move is followed by ``torch.accelerator.synchronize()``, so a non-blocking copy is
timed until it has landed. The reference is one contiguous pinned tensor of the same size:
what the link gives when nothing is spent per tensor. ``--nominal-gbps`` adds the fraction
of the datasheet figure, which torch cannot query.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from _report import Row
from _timing import Config, Subject, as_json, bind, measure_group
from _trees import Tree, many_leaves, movers, nested, tensors_in

REFERENCE = "one contiguous tensor, pinned, non_blocking"
MOVERS = ("to_device", "send_to_device")


def section_transfer(
    config: Config, quick: bool, nominal_gbps: float | None
) -> tuple[dict[str, Any], list[Row]]:
    """(5) ``to_device`` and ``send_to_device`` to the accelerator, pinned or not,
    ``non_blocking`` or not, in GB/s; ``{"skipped": "no accelerator"}`` without one."""
    if not torch.accelerator.is_available():
        return {"skipped": "no accelerator"}, []
    kind = torch.accelerator.current_accelerator()
    assert kind is not None
    device = torch.device(kind.type, torch.accelerator.current_device_index())
    out: dict[str, Any] = {"device": str(device), "nominal_gbps": nominal_gbps, "cases": {}}
    rows: list[Row] = []
    for tree in (nested(scale=8 if quick else 128), many_leaves(1_000 if quick else 10_000)):
        case = _case(config, tree, device, nominal_gbps)
        out["cases"][tree.key] = case
        rows += _rows(tree, device, case, nominal_gbps)
    return out, rows


def _case(
    config: Config, tree: Tree, device: torch.device, nominal_gbps: float | None
) -> dict[str, Any]:
    sync = torch.accelerator.synchronize
    nbytes = sum(t.nbytes for t in tensors_in(tree.tree))

    def moving(name: str, pinned: bool, non_blocking: bool) -> Callable[[], Any]:
        source = _pinned(tree.tree) if pinned else tree.tree
        return _synced(movers(source, device, non_blocking=non_blocking)[name](), sync)

    def reference() -> Callable[[], Any]:
        flat = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        return _synced(bind(flat.to, device, non_blocking=True), sync)

    subjects: dict[str, Subject] = {}
    for pinned in (False, True):
        for non_blocking in (False, True):
            for name in MOVERS:
                subjects[_label(name, pinned, non_blocking)] = Subject(
                    functools.partial(moving, name, pinned, non_blocking)
                )
    subjects[REFERENCE] = Subject(reference)
    measured = measure_group(subjects, config)
    gbps = {
        name: None if m.median_ns is None else nbytes / m.median_ns for name, m in measured.items()
    }
    return {
        "label": tree.label,
        "bytes": nbytes,
        "subjects": as_json(measured),
        "gbps": gbps,
        "fraction_of_nominal": {
            name: None if v is None or not nominal_gbps else v / nominal_gbps
            for name, v in gbps.items()
        },
    }


def _rows(
    tree: Tree, device: torch.device, case: dict[str, Any], nominal_gbps: float | None
) -> list[Row]:
    """One row per way of moving: to_device's GB/s, send_to_device's, the fraction of the
    reference (one contiguous pinned tensor) that to_device reaches."""
    gbps = case["gbps"]
    reference = gbps[REFERENCE]
    rows = []
    for pinned in (False, True):
        for non_blocking in (False, True):
            labels = [_label(name, pinned, non_blocking) for name in MOVERS]
            ours, peer = (gbps[label] for label in labels)
            peers = f"send_to_device {_gbps(peer)}; one contiguous tensor {_gbps(reference)}"
            status = case["subjects"][labels[0]]["status"]
            if nominal_gbps:
                peers += f"; nominal {nominal_gbps:g} GB/s"
            fraction = None if ours is None or not reference else ours / reference
            rows.append(
                Row(
                    "5 transfer",
                    f"{tree.label} ({case['bytes'] / 1e6:.1f} MB) cpu->{device}: to_device, "
                    f"pinned={pinned}, non_blocking={non_blocking}",
                    status if ours is None else _gbps(ours),
                    peers,
                    "n/a" if fraction is None else f"{fraction:.2f}x one contiguous tensor",
                    "",
                    "",
                    fraction,
                )
            )
    return rows


def _label(name: str, pinned: bool, non_blocking: bool) -> str:
    return f"{name} pinned={pinned} non_blocking={non_blocking}"


def _gbps(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} GB/s"


def _synced(fn: Callable[[], object], sync: Callable[[], None]) -> Callable[[], object]:
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
