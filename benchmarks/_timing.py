"""Timing for the benchmark: timeit-style loops, interleaved trials, medians.

Each subject is a zero-argument callable. Its loop count is auto-ranged (1, 2, 5, 10, 20,
... calls until one loop lasts ``min_time``), then ``trials`` loops are timed and the median
per-call time is kept. The subjects of one comparison are timed round-robin (trial 1 of
each, then trial 2 of each, ...), so a burst of load from another process on a shared
machine hits all of them alike instead of skewing one ratio. The garbage collector is off
inside a loop, as in :mod:`timeit`.
"""

from __future__ import annotations

import gc
import itertools
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

Fn = Callable[[], object]
"""A subject: one call of the thing measured."""

Maker = Callable[[], Fn]
"""Builds a subject. Runs inside a ``try`` so that a placeholder raising at decoration time
(``NotImplementedError``) makes a "not available" row instead of a crash."""

Scope = Callable[[], AbstractContextManager[object]]
"""Builds the context a subject's loops run in (``torch.device("meta")``, ``on_device``)."""

OK = "ok"
NOT_AVAILABLE = "not available"
ERROR = "error"


@dataclass(frozen=True)
class Config:
    """How long to measure: ``min_time`` seconds per loop, ``trials`` loops per subject."""

    min_time: float
    trials: int


@dataclass
class Measurement:
    """What one subject measured: per-call times in nanoseconds, or why it could not run."""

    status: str
    median_ns: float | None = None
    min_ns: float | None = None
    number: int = 0
    trials_ns: list[float] = field(default_factory=list)
    detail: str = ""

    @property
    def ok(self) -> bool:
        """Whether the subject ran and has a median."""
        return self.status == OK and self.median_ns is not None


@dataclass(frozen=True)
class Subject:
    """A thing to time: how to build its call, and optionally a scope its loops run in."""

    make: Maker
    scope: Scope | None = None


def failed(exc: BaseException) -> Measurement:
    """How a subject that raised is reported.

    "not available" for a placeholder (``NotImplementedError``) or a package that is not
    installed; "error", with the exception and the line it came from, for anything else.
    """
    if isinstance(exc, NotImplementedError):
        return Measurement(NOT_AVAILABLE, detail="raises NotImplementedError (not written yet)")
    if isinstance(exc, ImportError):
        return Measurement(NOT_AVAILABLE, detail=f"not installed: {exc}")
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" at {last[0].filename}:{last[0].lineno}" if last else ""
    return Measurement(ERROR, detail=f"{type(exc).__name__}: {exc}{where}")


@contextmanager
def _entered(scope: Scope | None) -> Iterator[None]:
    if scope is None:
        yield
    else:
        with scope():
            yield


def _loop(fn: Fn, number: int) -> float:
    """Seconds that ``number`` calls of ``fn`` take, with the garbage collector off."""
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        calls = itertools.repeat(None, number)
        start = time.perf_counter()
        for _ in calls:
            fn()
        return time.perf_counter() - start
    finally:
        if gc_was_on:
            gc.enable()


def _autorange(fn: Fn, scope: Scope | None, min_time: float) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... calls that last ``min_time``; warms up too.

    Each count is timed twice, the faster kept: a one-off stall (the collector, an
    allocation) in a loop of one call would otherwise settle the count at one, and every
    trial would then be a single call, the median at the mercy of such stalls.
    """
    scale = 1
    while True:
        for factor in (1, 2, 5):
            number = factor * scale
            with _entered(scope):
                if min(_loop(fn, number), _loop(fn, number)) >= min_time:
                    return number
        scale *= 10


def measure_group(subjects: dict[str, Subject], config: Config) -> dict[str, Measurement]:
    """Time every subject, trials interleaved across subjects; per-call medians in ns.

    A subject whose maker, scope or first call raises is reported with its reason and
    left out of the trials; the others still run.
    """
    results: dict[str, Measurement] = {}
    ready: dict[str, tuple[Fn, Scope | None, int]] = {}
    for name, subject in subjects.items():
        try:
            fn = subject.make()
            with _entered(subject.scope):
                fn()
            number = _autorange(fn, subject.scope, config.min_time)
        except Exception as exc:
            results[name] = failed(exc)
            continue
        ready[name] = (fn, subject.scope, number)
        results[name] = Measurement(OK, number=number)
    for _ in range(config.trials):
        for name, (fn, scope, number) in ready.items():
            with _entered(scope):
                seconds = _loop(fn, number)
            results[name].trials_ns.append(seconds / number * 1e9)
    for name in ready:
        trials = results[name].trials_ns
        results[name].median_ns = statistics.median(trials)
        results[name].min_ns = min(trials)
    return results


def bind(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Fn:
    """A subject that calls ``fn(*args, **kwargs)``."""
    return lambda: fn(*args, **kwargs)


def as_json(measured: dict[str, Measurement]) -> dict[str, Any]:
    """Measurements as JSON objects, keyed by subject."""
    return {
        name: {
            "status": m.status,
            "median_ns": m.median_ns,
            "min_ns": m.min_ns,
            "loops": m.number,
            "trials_ns": m.trials_ns,
            "detail": m.detail,
        }
        for name, m in measured.items()
    }


def fmt_ns(ns: float | None) -> str:
    """A duration for a table: ``412 ns``, ``3.10 µs``, ``1.25 ms``, ``2.00 s``."""
    if ns is None:
        return "n/a"
    size = abs(ns)
    if size < 1e3:
        return f"{ns:.0f} ns"
    if size < 1e6:
        return f"{ns / 1e3:.2f} µs"
    if size < 1e9:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e9:.2f} s"
