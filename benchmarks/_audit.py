"""Section 6, in part: what ``on_device(..., audit=True)`` costs per torch op.

Each op is timed plain, inside ``on_device(cpu)`` and inside ``on_device(cpu, audit=True)``,
with ``torch.device(cpu)`` beside them (torch's own mode, for scale). The CPU is torch's
default here, so ``on_device(cpu)`` changes nothing in torch and the difference between the
last two is the audit mode alone: a mode dispatch on every op, and for an op that makes
tensors a look at the device of its result. Nothing in the ops strays, so nothing is
reported: this is the price of looking, paid on every op of an audited block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from _report import Row, judge
from _timing import Config, Measurement, Subject, as_json, fmt_ns, measure_group

from devicectx import on_device

CPU = torch.device("cpu")
PLAIN = "no block"
BLOCK = "on_device(cpu)"
AUDITED = "on_device(cpu, audit=True)"
TORCH_MODE = "torch.device(cpu)"


def _same(fn: Callable[[], object]) -> Callable[[], object]:
    return fn


def section_audit(config: Config) -> tuple[dict[str, Any], list[Row]]:
    """(6) the time audit mode adds to a small op on an existing tensor and to a
    constructor, over the same op in a block without audit."""
    x = torch.ones(4)
    ops: dict[str, Callable[[], object]] = {
        "x + 1 (4 elements)": lambda: x + 1,
        "torch.zeros(4)": lambda: torch.zeros(4),
    }
    cases: dict[str, Any] = {}
    rows: list[Row] = []
    for op, fn in ops.items():
        same = functools.partial(_same, fn)
        subjects = {
            PLAIN: Subject(same),
            BLOCK: Subject(same, lambda: on_device(CPU)),
            AUDITED: Subject(same, lambda: on_device(CPU, audit=True)),
            TORCH_MODE: Subject(same, lambda: torch.device(CPU)),
        }
        with torch.no_grad():
            measured = measure_group(subjects, config)
        m = {name: measured[name].median_ns for name in subjects}
        added = _minus(m[AUDITED], m[BLOCK])
        cases[op] = {"subjects": as_json(measured), "added_ns": {AUDITED: added}}
        peers = "; ".join(f"{name} {fmt_ns(m[name])}" for name in (PLAIN, BLOCK, TORCH_MODE))
        rows.append(
            judge(
                "6 diagnostics",
                f"{op} inside on_device(cpu, audit=True): time audit adds per op",
                m[AUDITED],
                peers,
                m[BLOCK],
                BLOCK,
                None,
                ours_text=f"+{fmt_ns(added)} ({fmt_ns(m[AUDITED])})" if added is not None else None,
                missing=_missing(measured[AUDITED], measured[BLOCK]),
            )
        )
    return {"default_device": str(torch.get_default_device()), "cases": cases}, rows


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _missing(*measured: Measurement) -> str:
    statuses = {m.status for m in measured if not m.ok}
    return "error" if "error" in statuses else "not available"
