"""The one place devicectx touches torch's private default-device machinery.

torch keeps a thread's default device in two places. One is its stack of function modes:
the topmost ``DeviceContext`` (a ``TorchFunctionMode``) fills in ``device=`` of factory
calls, and ``torch.get_default_device()`` reads it; ``with torch.device(d)`` pushes one on
top and pops the top at exit. The other is a per-thread slot,
``torch._GLOBAL_DEVICE_CONTEXT.device_context``: the ``DeviceContext`` that
``torch.set_default_device`` entered (at the bottom of the stack), whose ``__exit__`` the
next ``set_default_device`` calls. No public API finds a mode in the stack, removes one
that is not on top, or tells ``set_default_device`` about modes it did not make: what
:mod:`devicectx._context` needs for scopes left out of order (asyncio tasks) and composed
with ``set_default_device``.

How. A scope is pushed on top of the stack, as ``with torch.device`` does, and taken out
wherever it is at exit. While a thread has scopes installed, the slot holds a stand-in
that keeps what it displaced: ``set_default_device`` calls its ``__exit__``, which takes the
thread's scopes off the stack and exits the displaced default, so the new default takes
effect at once and outlives the blocks (torch's own ``DeviceContext.__exit__`` would fail
on a ``DeviceContext`` above the bottom of the stack); and where ``get_default_device``
reads the slot, the stand-in answers with the innermost ``DeviceContext``'s device. When
the thread's last scope leaves, the slot gets back what it held.

That works the same on every release checked: torch 2.6.0, 2.7.1, 2.8.0, 2.9.1, 2.10.0,
2.11.0, 2.12.1, 2.13.0, 2.14.1 and 2.15.0 (``torch/utils/_device.py``,
``set_default_device`` and ``get_default_device`` in ``torch/__init__.py``, and the
stack's functions in ``torch._C``, which ``torch.overrides._push_mode``/``_pop_mode``
wrap). Where they differ, nothing here asks for a version:

- ``DeviceContext.__enter__`` (``set_default_device``) puts the new mode at the bottom of
  the stack. Up to 2.10 it leaves every other mode in place; from 2.11 it takes the
  ``DeviceContext`` modes off the stack, keeping the topmost in its new ``prev_mode``, which
  ``__exit__`` pushes back. So a scope may be found in a ``prev_mode`` chain instead of on
  the stack (read with ``getattr``: older ``DeviceContext`` modes have no such attribute).
- ``get_default_device`` reads the stack, then the slot, from 2.8; 2.6 and 2.7 read only
  the slot, which the stand-in answers for. Up to 2.9 it raises ``AttributeError`` where
  it reaches a slot that ``set_default_device(None)`` left None: the stand-in's departure
  and :func:`clear_default_device` leave the slot empty instead.

tests/test_context.py exercises every path here, so a torch release that changes them
fails there first.
"""

from __future__ import annotations

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
    "clear_default_device",
    "innermost_device_mode",
    "install",
    "mode_at",
    "stack_length",
    "uninstall",
]

stack_length = _len_torch_function_stack
"""How many function modes this thread's stack holds (0 outside any scope)."""

mode_at = _get_function_stack_at
"""The mode at a position of this thread's stack, 0 being the bottom."""

# torch's per-thread slot for the default set by set_default_device is the attribute
# "device_context" of this threading.local. Read through its __dict__ (this thread's own):
# getattr with a default costs 0.6 µs when the attribute is missing, the usual case.
_SLOT = torch._GLOBAL_DEVICE_CONTEXT
_KEY = "device_context"
_EMPTY = object()  # the slot had no value at all, which torch reads as "no default"
# dynamo guards compiled code on this module's CURRENT_DEVICE, which DeviceContext keeps.
_DEVICE_MODULE = torch.utils._device
_CPU = torch.device("cpu")


class _StandIn:
    """Holds torch's default-device slot while this thread has scopes installed."""

    __slots__ = ("displaced", "installed")

    def __init__(self, displaced: object) -> None:
        self.displaced = displaced
        self.installed: list[TorchFunctionMode] = []

    @property
    def device(self) -> torch.device:
        """What ``get_default_device`` reports where it reads the slot (torch 2.6, 2.7)."""
        mode = innermost_device_mode()
        return _CPU if mode is None else mode.device

    def __exit__(self, *exc_info: object) -> None:
        """``set_default_device`` replaces the thread's default: every scope yields to it."""
        for mode in self.installed:
            _take_off_stack(mode)
        self.installed.clear()
        displaced, self.displaced = self.displaced, _EMPTY
        if isinstance(displaced, DeviceContext):
            displaced.__exit__(None, None, None)  # type: ignore[no-untyped-call]


def install(mode: TorchFunctionMode, device: torch.device) -> None:
    """Push ``mode`` (a scope for ``device``) on top of this thread's mode stack."""
    slot = _SLOT.__dict__
    held = slot.get(_KEY, _EMPTY)
    if not isinstance(held, _StandIn):
        held = slot[_KEY] = _StandIn(held)
    held.installed.append(mode)
    _push_on_torch_function_stack(mode)
    _DEVICE_MODULE.CURRENT_DEVICE = device


def uninstall(mode: TorchFunctionMode) -> None:
    """Take ``mode`` out of this thread's default-device state, wherever it is.

    It may be on the stack (on top, as an exit in order finds it, or lower, when another
    asyncio task entered a scope after it), or held in a ``DeviceContext``'s ``prev_mode``
    (a ``DeviceContext`` entered by hand inside the scope, torch >= 2.11). When it is in
    neither place (``set_default_device`` was called inside the scope), there is nothing
    to undo.
    """
    if not _take_off_stack(mode):
        _unlink(mode)
    slot = _SLOT.__dict__
    held = slot.get(_KEY)
    if isinstance(held, _StandIn) and mode in held.installed:
        held.installed.remove(mode)
        if not held.installed:
            _restore_slot(slot, held.displaced)
    innermost = innermost_device_mode()
    _DEVICE_MODULE.CURRENT_DEVICE = None if innermost is None else innermost.device


def innermost_device_mode() -> DeviceContext | None:
    """The ``DeviceContext`` nearest the top of this thread's mode stack, or None."""
    for position in range(_len_torch_function_stack() - 1, -1, -1):
        mode = _get_function_stack_at(position)
        if isinstance(mode, DeviceContext):
            return mode
    return None


def clear_default_device() -> None:
    """``torch.set_default_device(None)``, leaving the slot empty rather than None.

    ``get_default_device`` of torch 2.6 to 2.9 raises ``AttributeError`` on a None slot.
    """
    torch.set_default_device(None)
    _restore_slot(_SLOT.__dict__, None)


def _take_off_stack(target: TorchFunctionMode) -> bool:
    """Remove ``target`` from this thread's stack, leaving the modes above it in order."""
    above: list[TorchFunctionMode] = []
    found = False
    while _len_torch_function_stack():
        mode = _pop_torch_function_stack()
        if mode is target:
            found = True
            break
        above.append(mode)
    for mode in reversed(above):
        _push_on_torch_function_stack(mode)
    return found


def _unlink(target: TorchFunctionMode) -> None:
    """Take ``target`` out of the ``prev_mode`` chain that holds it, if one does."""
    for position in range(_len_torch_function_stack()):
        link = _get_function_stack_at(position)
        while isinstance(link, DeviceContext):
            below = getattr(link, "prev_mode", None)
            if below is target:
                link.prev_mode = getattr(target, "prev_mode", None)
                return
            link = below


def _restore_slot(slot: dict[str, object], displaced: object) -> None:
    """Put ``displaced`` back in the slot; where it means "no default", leave it empty."""
    if displaced is _EMPTY or displaced is None:
        slot.pop(_KEY, None)
    else:
        slot[_KEY] = displaced
