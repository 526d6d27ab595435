"""Rows for a target that is not the default device, and a block entered per call.

The decorator rows of ``bench.py`` time a CPU target from a CPU default, where the
decorator's scope changes nothing and is skipped; a training step on an accelerator is the
other case: its target is not the default, so each call enters a scope. Here the same three
tensors are already on such a device (``meta``, and the accelerator where
``torch.accelerator`` reports one), and every block is entered and left at each call.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from _devices import accelerator
from _report import Row, judge, times
from _timing import Config, Measurement, Subject, as_json, bind, fmt_ns, measure_group
from _trees import load

from devicectx import RepeatedMoveWarning, device_agnostic, on_device, to_device

Section = dict[str, Any]
META = torch.device("meta")


def off_default_devices() -> list[torch.device]:
    """The devices that are not the default here: meta, and the accelerator if any."""
    device = accelerator()
    return [META] if device is None else [META, device]


def _loss(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return pred


def _in_torch_device(device: torch.device, a: Any, b: Any, c: Any) -> torch.Tensor:
    with torch.device(device):
        return _loss(a, b, c)


def _send(device: torch.device, *tensors: torch.Tensor) -> Callable[[], Any]:
    send_to_device = load("accelerate.utils", "send_to_device")
    return lambda: send_to_device(tensors, device)


def decorator_off_default(config: Config, device: torch.device) -> tuple[Section, list[Row]]:
    """``@device_agnostic(device=d)`` on three tensors already on ``d``, not the default.

    Each decorated call enters the scope of ``d`` (``scope=False`` shows the rest), beside
    ``send_to_device`` of the same tensors to ``d`` (what a hand-written step does instead)
    and ``with torch.device(d)`` around the plain call.
    """
    a, b, c = (torch.ones(4, device=device) for _ in range(3))
    spec = str(device)
    scoped = device_agnostic(device=spec)(_loss)
    unscoped = device_agnostic(device=spec, scope=False)(_loss)
    inside = f"@device_agnostic(device={spec!r}), in on_device({spec!r})"
    subjects = {
        "call": Subject(functools.partial(bind, _loss, a, b, c)),
        f"@device_agnostic(device={spec!r})": Subject(functools.partial(bind, scoped, a, b, c)),
        f"@device_agnostic(device={spec!r}, scope=False)": Subject(
            functools.partial(bind, unscoped, a, b, c)
        ),
        inside: Subject(functools.partial(bind, scoped, a, b, c), lambda: on_device(device)),
        f"call in torch.device({spec!r})": Subject(
            functools.partial(bind, _in_torch_device, device, a, b, c)
        ),
        "send_to_device": Subject(functools.partial(_send, device, a, b, c)),
    }
    measured = measure_group(subjects, config)
    base = measured["call"].median_ns
    timed = [name for name in subjects if name not in ("call", "send_to_device")]
    added = {name: _minus(measured[name].median_ns, base) for name in timed}
    peers = times(measured, ["send_to_device"])
    peers += f"; with torch.device({spec!r}) per call +{fmt_ns(added[timed[-1]])}"
    rows = [
        judge(
            "1 decorator",
            f"3 flat tensors on {spec}, not the default: time {name} adds",
            added[name],
            peers,
            measured["send_to_device"].median_ns,
            "send_to_device",
            0.5 if name == timed[0] else None,
            missing=_missing(measured[name], measured["call"]),
        )
        for name in timed[:3]
    ]
    case = {
        "label": f"3 flat tensors on {spec}",
        "device": spec,
        "subjects": as_json(measured),
        "added_ns": added,
    }
    return case, rows


def moved_off_default(config: Config, device: torch.device) -> tuple[Section, list[Row]]:
    """Three small tensors on the host moved to ``d`` at each call: a training step's batch.

    ``to_device`` and the decorated call that moves them, beside ``send_to_device`` and
    ``.to`` on each tensor (the floor: the copies alone); the repeated-move check sees the
    same three tensors again, as it would a cached batch, and is silenced, not turned off.
    """
    a, b, c = (torch.ones(4) for _ in range(3))
    spec = str(device)
    decorated = device_agnostic(device=spec)(_loss)
    subjects = {
        ".to each": Subject(functools.partial(_each, device, a, b, c)),
        "to_device": Subject(functools.partial(_to_device, device, a, b, c)),
        f"@device_agnostic(device={spec!r})": Subject(functools.partial(bind, decorated, a, b, c)),
        "send_to_device": Subject(functools.partial(_send, device, a, b, c)),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RepeatedMoveWarning)
        measured = measure_group(subjects, config)
    peers = times(measured, ["send_to_device", ".to each"])
    rows = [
        judge(
            "1 decorator",
            f"3 small tensors moved cpu->{spec} at each call: {name}",
            measured[name].median_ns,
            peers,
            measured["send_to_device"].median_ns,
            "send_to_device",
            None,
            missing=_missing(measured[name]),
        )
        for name in ("to_device", f"@device_agnostic(device={spec!r})")
    ]
    case = {"label": f"3 small tensors moved to {spec}", "subjects": as_json(measured)}
    return case, rows


def _each(device: torch.device, *tensors: torch.Tensor) -> Callable[[], Any]:
    return lambda: [tensor.to(device) for tensor in tensors]


def _to_device(device: torch.device, *tensors: torch.Tensor) -> Callable[[], Any]:
    return lambda: to_device(tensors, device)


def _enter_torch_device(spec: str) -> None:
    with torch.device(spec):
        pass


def _enter_on_device(spec: str) -> None:
    with on_device(spec):
        pass


def entry(config: Config, device: torch.device) -> tuple[Section, list[Row]]:
    """Entering and leaving a block, nothing inside, no block around: ``on_device(d)``
    beside ``torch.device(d)``, each made from the spec string at each call."""
    spec = str(device)
    subjects = {
        f"with torch.device({spec!r}): pass": Subject(
            functools.partial(bind, _enter_torch_device, spec)
        ),
        f"with on_device({spec!r}): pass": Subject(functools.partial(bind, _enter_on_device, spec)),
    }
    measured = measure_group(subjects, config)
    theirs, ours = subjects
    row = judge(
        "3 scope",
        f"entering and leaving on_device({spec!r}), no block around it",
        measured[ours].median_ns,
        times(measured, [theirs]),
        measured[theirs].median_ns,
        "torch.device",
        2.0,
        missing=_missing(measured[ours]),
    )
    return {"device": spec, "subjects": as_json(measured)}, [row]


def in_block(block: Callable[[], Any], model: torch.nn.Module, ids: torch.Tensor) -> Any:
    """``model(ids)`` inside a block entered for this call alone."""
    with block():
        return model(ids)


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _missing(*measured: Measurement) -> str:
    statuses = {m.status for m in measured if not m.ok}
    return "error" if "error" in statuses else "not available"
