"""torch's tensor constructors, filled in with a scope's device while any scope is open.

Why not torch's own mechanism. ``with torch.device(d)`` and ``set_default_device`` put a
``DeviceContext`` (a ``TorchFunctionMode``) on the thread's mode stack, and every torch call
in the thread then makes a trip through Python to reach it, although the mode changes only
the few dozen constructors (pytorch/pytorch#92701: a 4.5x slower ``mm`` launch). Here the
constructors themselves are replaced, in the torch modules that hold them, by wrappers that
fill in ``device=`` and call the original: every other call costs what it costs outside a
scope, and a constructor costs a Python call instead of a mode dispatch (1.5 µs, about
what the mode costs it, on a 2-core CPU).

The wrappers are put in place when the first scope of the process opens and taken away when
the last one closes (2 µs each way), so a process, or a stretch of one, without scopes runs
torch's own functions. While they are in place, they ask :mod:`devicectx._context` which
device the running thread or asyncio task wants (``None``: leave torch to decide), and
``torch.get_default_device`` answers for the scopes too.

The limit: a constructor bound to another name before the first scope opened
(``from torch import zeros`` in a module imported earlier) is not replaced; the torch
modules that do that themselves are found and patched. ``on_device(..., exact=True)`` adds
torch's mode for such code.

Private torch API: ``torch.utils._device._device_constructors()`` is the list torch's own
``DeviceContext`` fills in; checked on torch 2.6.0 to 2.15.0 (36 functions, the same set).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from types import CodeType, ModuleType
from typing import Any

import torch
import torch.utils._device

from devicectx._dynamo_hooks import constant, keep_trace_rules, never_top_level

__all__ = ["TorchPatch", "constructor_patch", "inline_only"]

DeviceQuery = Callable[[], "torch.device | None"]
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling


class TorchPatch:
    """Functions of torch replaced in every loaded torch module that holds them, counted:
    in place while anyone holds the patch, torch's own again when the last one releases.

    Args:
        make: ``{torch's function: its replacement}``, called once, at the first acquire
            (by then every torch module that imports one of them by name is loaded).
    """

    def __init__(self, make: Callable[[], dict[object, Callable[..., Any]]]) -> None:
        self._make = make
        self._holders = 0
        self._lock = threading.Lock()
        # (module, name, torch's function, its replacement), found at the first acquire.
        self._sites: list[tuple[ModuleType, str, object, object]] | None = None

    def acquire(self) -> None:
        """Put the replacements in place, if nobody else has."""
        with self._lock:
            if not self._holders:
                sites = self._find_sites()
                keep_trace_rules((original, wrapper) for _, _, original, wrapper in sites)
                if "torch._dynamo.eval_frame" in sys.modules:
                    inline_only()
                for module, name, _original, wrapper in sites:
                    setattr(module, name, wrapper)
            self._holders += 1

    def release(self) -> None:
        """Give torch its functions back, once the last holder releases."""
        with self._lock:
            self._holders -= 1
            if not self._holders and self._sites is not None:
                for module, name, original, wrapper in self._sites:
                    # Someone else may have replaced it since (a test's monkeypatch): theirs stays.
                    if module.__dict__.get(name) is wrapper:
                        setattr(module, name, original)
                # dynamo, loaded and first tracing while they were in place, listed them.
                keep_trace_rules((original, wrapper) for _, _, original, wrapper in self._sites)

    def _find_sites(self) -> list[tuple[ModuleType, str, object, object]]:
        if self._sites is None:
            wrappers = {id(original): wrapper for original, wrapper in self._make().items()}
            _REPLACEMENTS.update(wrapper.__code__ for wrapper in wrappers.values())
            sites: list[tuple[ModuleType, str, object, object]] = []
            for module_name, module in list(sys.modules.items()):
                if not (module_name == "torch" or module_name.startswith("torch.")):
                    continue
                if not isinstance(module, ModuleType):
                    continue
                for name, value in list(vars(module).items()):
                    wrapper = wrappers.get(id(value))
                    if wrapper is not None and not name.startswith("__"):
                        sites.append((module, name, value, wrapper))
            self._sites = sites
        return self._sites


def constructor_patch(
    scope_device: DeviceQuery,
    traced_scope_device: DeviceQuery,
    default_device: Callable[[], torch.device],
) -> TorchPatch:
    """The replacement of torch's constructors (and ``torch.get_default_device``).

    Args:
        scope_device: the device a constructor called without ``device=`` gets here, or
            None to leave torch's own default (and modes) in charge. Called on every
            constructor call, so it must be cheap.
        traced_scope_device: the same, for code dynamo traces: a trace-time constant.
        default_device: what ``torch.get_default_device()`` answers while the patch is
            in place.
    """

    def make() -> dict[object, Callable[..., Any]]:
        wrappers: dict[object, Callable[..., Any]] = {
            original: _fill_device(original, scope_device, traced_scope_device)
            for original in torch.utils._device._device_constructors()
        }
        getter = torch.get_default_device
        wrappers[getter] = _answer_default(getter, default_device)
        return wrappers

    return TorchPatch(make)


def _fill_device(
    original: Callable[..., Any], scope_device: DeviceQuery, traced_scope_device: DeviceQuery
) -> Callable[..., Any]:
    """``original``, with ``device=`` filled in from the scope where the caller gave none."""

    # As in torch's DeviceContext: only a device given by keyword counts (a positional one
    # is not in any constructor's signature), and device=None means "the default".
    # is_dynamo_compiling() is False when the function runs, True where dynamo traces it:
    # then the scope's device is read at trace time, where dynamo keeps its own mode stack.
    @functools.wraps(original)
    def constructor(*args: Any, **kwargs: Any) -> Any:
        if _is_dynamo_compiling():
            inline_only()
            if kwargs.get("device") is None:
                device = traced_scope_device()
                if device is not None:
                    kwargs["device"] = device
        elif kwargs.get("device") is None:
            device = scope_device()
            if device is not None and not _from_dynamo():
                kwargs["device"] = device
        return original(*args, **kwargs)

    return constructor


_REPLACEMENTS: set[CodeType] = set()  # the code of every replacement a patch made
_INLINED: set[CodeType] = set()  # those dynamo was told to inline only


@constant
def inline_only() -> bool:
    """Tell dynamo never to compile a replacement as a frame of its own (see
    ``never_top_level``): when a patch is put in place with dynamo loaded, else where
    dynamo traces a replacement (too late for one compiled on its own before). A constant
    where dynamo traces it: it runs once, at trace time."""
    for code in _REPLACEMENTS - _INLINED:
        _INLINED.add(code)
        never_top_level(code)
    return True


def _from_dynamo() -> bool:
    """Whether the constructor's caller is dynamo's own code (not code it traces).

    dynamo makes probe tensors when it is imported, which a meta op can trigger inside a
    block (torch 2.6, 2.7: ops with Python meta kernels import it): on the block's device,
    meta, they fail and leave dynamo half imported.
    """
    caller = sys._getframe(2).f_globals.get("__name__", "")  # 0: here, 1: the constructor
    # (never in code dynamo traces, which cannot read frames)
    return isinstance(caller, str) and caller.startswith("torch._dynamo")


def _answer_default(
    original: Callable[[], torch.device], default_device: Callable[[], torch.device]
) -> Callable[[], torch.device]:
    """``torch.get_default_device``, answering for the scopes."""

    @functools.wraps(original)
    def get_default_device() -> torch.device:
        return default_device()

    return get_default_device
