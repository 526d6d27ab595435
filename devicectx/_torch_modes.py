"""The one place devicectx touches torch's private default-device state (besides the
constructor list, :mod:`devicectx._constructors`).

torch keeps a thread's default device in two places. One is its stack of function modes:
the innermost ``DeviceContext`` (a ``TorchFunctionMode``) fills in ``device=`` of factory
calls, and ``torch.get_default_device()`` reads it. The other is a per-thread slot,
``torch._GLOBAL_DEVICE_CONTEXT.device_context``: the ``DeviceContext`` that
``torch.set_default_device`` entered, whose ``__exit__`` the next ``set_default_device``
calls. :mod:`devicectx._context` needs three things no public API gives:

- to read the innermost ``DeviceContext`` (to tell a ``with torch.device`` block entered
  inside a scope, which then wins, from one entered before);
- to hear of ``set_default_device`` called inside a scope, which must take effect at once
  and outlive the block. While a thread has scopes open, its slot holds a stand-in that
  keeps what it displaced; ``set_default_device`` calls the stand-in's ``__exit__``, which
  tells every scope of the thread to yield and exits the displaced default. When the
  thread's last scope closes, the slot gets back what it held. Where ``get_default_device``
  reads the slot (torch 2.6, 2.7), the stand-in answers with the scopes' device;
- for ``on_device(..., exact=True)``, to push a mode on top of the stack and take it out
  from wherever it is at exit (asyncio tasks leave blocks out of order).

Checked on torch 2.6.0, 2.7.1, 2.8.0, 2.9.1, 2.10.0, 2.11.0, 2.12.1, 2.13.0, 2.14.1 and
2.15.0 (``torch/utils/_device.py``, ``set_default_device`` and ``get_default_device`` in
``torch/__init__.py``, the stack's functions in ``torch._C``). Where they differ, nothing here
asks for a version: from 2.11 a ``DeviceContext`` entered (by ``with torch.device`` or
``set_default_device``) sits at the bottom of the stack and keeps the one it displaced in
``prev_mode``; before, ``with torch.device`` pushes on top. Either way the innermost
``DeviceContext`` is the newest. Up to 2.9 ``get_default_device`` raises
``AttributeError`` where it reaches a slot that ``set_default_device(None)`` left None: the
stand-in's departure and :func:`clear_default_device` leave the slot empty instead.

tests/test_context.py exercises every path here, so a torch release that changes them
fails there first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.utils._device
from torch._C import (
    _get_function_stack_at,
    _len_torch_function_stack,
    _pop_torch_function_stack,
    _push_on_torch_function_stack,
)
from torch.overrides import TorchFunctionMode
from torch.utils._device import DeviceContext

__all__ = [
    "DeviceContext",
    "Yielding",
    "clear_default_device",
    "hold_slot",
    "innermost_device_mode",
    "innermost_of",
    "push_mode",
    "release_slot",
    "remove_mode",
    "set_current_device",
    "stack_length",
]

stack_length = _len_torch_function_stack
"""How many function modes this thread's stack holds (0 outside any mode)."""

# torch's per-thread slot for the default set by set_default_device is the attribute
# "device_context" of this threading.local. Read through its __dict__ (this thread's own):
# getattr with a default costs 0.6 µs when the attribute is missing, the usual case.
_SLOT = torch._GLOBAL_DEVICE_CONTEXT
_KEY = "device_context"
_EMPTY = object()  # the slot had no value at all, which torch reads as "no default"
# dynamo guards compiled code on this module's CURRENT_DEVICE, which DeviceContext keeps.
_DEVICE_MODULE = torch.utils._device


class Yielding(Protocol):
    """A scope that gives way when ``set_default_device`` is called inside it."""

    def yield_to_default(self) -> None: ...


class _StandIn:
    """Holds torch's default-device slot while this thread has scopes open."""

    __slots__ = ("answer", "displaced", "scopes")

    def __init__(self, displaced: object, answer: Callable[[], torch.device]) -> None:
        self.displaced = displaced
        self.answer = answer
        self.scopes: list[Yielding] = []

    @property
    def device(self) -> torch.device:
        """What ``get_default_device`` reports where it reads the slot (torch 2.6, 2.7)."""
        return self.answer()

    def __exit__(self, *exc_info: object) -> None:
        """``set_default_device`` replaces the thread's default: every scope yields to it."""
        for scope in self.scopes:
            scope.yield_to_default()
        self.scopes.clear()
        displaced, self.displaced = self.displaced, _EMPTY
        if isinstance(displaced, DeviceContext):
            displaced.__exit__(None, None, None)  # type: ignore[no-untyped-call]


def hold_slot(scope: Yielding, answer: Callable[[], torch.device]) -> None:
    """Have ``scope`` told when ``set_default_device`` is called in this thread.

    ``answer`` is what ``get_default_device`` reports where it reads the slot.
    """
    slot = _SLOT.__dict__
    held = slot.get(_KEY, _EMPTY)
    if not isinstance(held, _StandIn):
        held = slot[_KEY] = _StandIn(held, answer)
    held.scopes.append(scope)


def release_slot(scope: Yielding) -> None:
    """Undo :func:`hold_slot`; the thread's last scope gives the slot back."""
    slot = _SLOT.__dict__
    held = slot.get(_KEY)
    if isinstance(held, _StandIn) and scope in held.scopes:
        held.scopes.remove(scope)
        if not held.scopes:
            _restore_slot(slot, held.displaced)


def innermost_device_mode() -> DeviceContext | None:
    """The ``DeviceContext`` nearest the top of this thread's mode stack, or None."""
    for position in range(_len_torch_function_stack() - 1, -1, -1):
        mode = _get_function_stack_at(position)
        if isinstance(mode, DeviceContext):
            return mode
    return None


def innermost_of(modes: list[object]) -> DeviceContext | None:
    """The ``DeviceContext`` nearest the top of ``modes`` (a stack, bottom first), or None."""
    for mode in reversed(modes):
        if isinstance(mode, DeviceContext):
            return mode
    return None


def set_current_device(device: torch.device | None) -> None:
    """Tell dynamo, which guards compiled code on it, what the default device now is."""
    _DEVICE_MODULE.CURRENT_DEVICE = device


def push_mode(mode: TorchFunctionMode) -> None:
    """Push ``mode`` on top of this thread's mode stack."""
    _push_on_torch_function_stack(mode)


def remove_mode(target: TorchFunctionMode) -> None:
    """Take ``target`` off this thread's stack, wherever it is, leaving the rest in order."""
    above: list[TorchFunctionMode] = []
    while _len_torch_function_stack():
        mode = _pop_torch_function_stack()
        if mode is target:
            break
        above.append(mode)
    for mode in reversed(above):
        _push_on_torch_function_stack(mode)


def clear_default_device() -> None:
    """``torch.set_default_device(None)``, leaving the slot empty rather than None.

    ``get_default_device`` of torch 2.6 to 2.9 raises ``AttributeError`` on a None slot.
    """
    torch.set_default_device(None)
    _restore_slot(_SLOT.__dict__, None)


def _restore_slot(slot: dict[str, object], displaced: object) -> None:
    """Put ``displaced`` back in the slot; where it means "no default", leave it empty."""
    if displaced is _EMPTY or displaced is None:
        slot.pop(_KEY, None)
    else:
        slot[_KEY] = displaced
