"""Section 6: what the diagnostics (repeated-move check, track_transfers, audit) cost.

- The repeated-move check, which runs on every move that copies something: a decorated
  step that moves the nested batch from the CPU to ``meta``, with the check on and off
  (``set_repeated_move_warning``), for a new batch at each call (the everyday case: each
  tensor is remembered by weak reference) and for the same batch at each call (every
  tensor is a repeat, reported once and then only recognised). Target: the check adds at
  most 5% to the decorated call. (Within each round of trials the first subject runs
  slower by a few percent on a small machine, whatever it is: "check off" goes first, so
  that this does not count against the check.)
- ``track_transfers``, which names every tensor of each move while it is open: the same
  call inside a log, against the call with the check on.
- The audit of stray tensors (``on_device(d, audit=True)``): what it adds to each torch
  call in the block (:mod:`_audit`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _audit import section_audit
from _report import Row, judge
from _timing import Config, Subject, as_json, fmt_ns, measure_group
from _trees import nested

from devicectx import device_agnostic, set_repeated_move_warning, track_transfers

META = torch.device("meta")
_BATCHES = 32  # distinct batches a "new batch" subject cycles through


@device_agnostic(device=META)
def _step(batch: Any) -> Any:
    return batch


@contextlib.contextmanager
def _check_off() -> Iterator[None]:
    previous = set_repeated_move_warning(False)
    try:
        yield
    finally:
        set_repeated_move_warning(previous)


@contextlib.contextmanager
def _tracked() -> Iterator[None]:
    with track_transfers() as log:
        yield
        log.clear()


def _new_batches() -> Callable[[], Any]:
    """A call that moves a batch its place did not move last time (cycling through 32)."""
    batches = itertools.cycle([_copy(nested().tree) for _ in range(_BATCHES)])
    return lambda: _step(next(batches))


def _same_batch() -> Callable[[], Any]:
    batch = nested().tree
    return functools.partial(_step, batch)


def _copy(batch: Any) -> Any:
    if isinstance(batch, dict):
        return {key: _copy(value) for key, value in batch.items()}
    return batch.clone()


def section_diagnostics(config: Config) -> tuple[dict[str, Any], list[Row]]:
    """(6) the repeated-move check and the transfer log on a decorated move; the audit."""
    cases: dict[str, Any] = {}
    rows: list[Row] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the same batch each call is reported, once
        for key, make, what in (
            ("new_batch", _new_batches, "a new batch each call"),
            ("same_batch", _same_batch, "the same batch each call"),
        ):
            subjects = {
                "check off": Subject(make, _check_off),
                "check on": Subject(make),
                "tracked": Subject(make, _tracked),
            }
            measured = measure_group(subjects, config)
            on, off = measured["check on"].median_ns, measured["check off"].median_ns
            tracked = measured["tracked"].median_ns
            cases[key] = {"label": what, "subjects": as_json(measured)}
            label = f"@device_agnostic moving the nested batch to meta, {what}"
            rows.append(
                judge(
                    "6 diagnostics",
                    f"{label}: the repeated-move check on (vs off)",
                    on,
                    f"check off {fmt_ns(off)}",
                    off,
                    "check off",
                    1.05,
                    tolerance=0.0,
                )
            )
            rows.append(
                judge(
                    "6 diagnostics",
                    f"{label}: inside track_transfers() (vs outside)",
                    tracked,
                    f"outside {fmt_ns(on)}",
                    on,
                    "outside",
                    None,
                )
            )
    audit, audit_rows = section_audit(config)
    for op, case in audit["cases"].items():
        cases[f"audit: {op}"] = case
    return {"cases": cases}, [*rows, *audit_rows]
