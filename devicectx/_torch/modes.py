"""The one place devicectx touches torch's private default-device state (besides the
constructor list, :mod:`devicectx.scope._constructors`).

torch keeps a thread's default device in two places. One is its stack of function modes:
the innermost ``DeviceContext`` (a ``TorchFunctionMode``) fills in ``device=`` of factory
calls, and ``torch.get_default_device()`` reads it. The other is a per-thread slot,
``torch._GLOBAL_DEVICE_CONTEXT.device_context``: the ``DeviceContext`` that
``torch.set_default_device`` entered, whose ``__exit__`` the next ``set_default_device``
calls. :mod:`devicectx.scope._stack` needs four things no public API gives:

- to read the innermost ``DeviceContext`` (to tell a ``with torch.device`` block entered
  inside a scope, which then wins, from one entered before);
- to hear of ``set_default_device`` called inside a scope, which must take effect at once
  and outlive the block: every call puts a new object (or None) in the slot, so a block
  notes what the slot held at its entry and yields once it holds something else. Nothing
  is put in the slot (a stand-in there would cost every block: see docs/performance.md);
- for ``on_device(..., exact=True)``, to push a mode on top of the stack and take it out
  from wherever it is at exit (asyncio tasks leave blocks out of order);
- to tell dynamo the default device, as ``DeviceContext`` does at entry and exit: the
  global ``CURRENT_DEVICE`` of ``torch.utils._device``, which dynamo guards compiled code
  on (a scope writes it through :data:`DEVICE_MODULE_GLOBALS` and
  :data:`CURRENT_DEVICE_KEY`).

Checked on torch 2.6.0, 2.7.1, 2.8.0, 2.9.1, 2.10.0, 2.11.0, 2.12.1, 2.13.0, 2.14.1 and
2.15.0 (``torch/utils/_device.py``, ``set_default_device`` and ``get_default_device`` in
``torch/__init__.py``, the stack's functions in ``torch._C``). Where they differ, nothing here
asks for a version: from 2.11 a ``DeviceContext`` entered (by ``with torch.device`` or
``set_default_device``) sits at the bottom of the stack and keeps the one it displaced in
``prev_mode``; before, ``with torch.device`` pushes on top. Either way the innermost
``DeviceContext`` is the newest. Up to 2.9 ``get_default_device`` raises
``AttributeError`` where it reaches a slot that ``set_default_device(None)`` left None
(torch's own behaviour; from the first block that changes the device, devicectx's
``get_default_device`` answers instead): :func:`clear_default_device` leaves it empty.

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
    "CURRENT_DEVICE_KEY",
    "DEVICE_MODULE_GLOBALS",
    "EMPTY_SLOT",
    "GLOBAL_DEVICE_CONTEXT",
    "SLOT_KEY",
    "DeviceContext",
    "clear_default_device",
    "default_slot",
    "innermost_device_mode",
    "innermost_of",
    "push_mode",
    "remove_mode",
    "stack_length",
]

# dynamo's view of the default device: the global CURRENT_DEVICE of torch.utils._device,
# which DeviceContext sets and dynamo guards compiled code on. A scope sets it too, at its
# entry and exit, as DEVICE_MODULE_GLOBALS[CURRENT_DEVICE_KEY]: a read and a write of a
# dict, where a function call would cost as much as the read.
DEVICE_MODULE_GLOBALS: dict[str, object] = vars(torch.utils._device)
CURRENT_DEVICE_KEY = "CURRENT_DEVICE"
# The per-thread slot where torch keeps the DeviceContext of set_default_device.
GLOBAL_DEVICE_CONTEXT = torch._GLOBAL_DEVICE_CONTEXT

stack_length = _len_torch_function_stack
"""How many function modes this thread's stack holds (0 outside any mode)."""

# torch's per-thread slot for the default set by set_default_device is the attribute
# "device_context" of this threading.local. Read through its __dict__ (this thread's own):
# getattr with a default is slow when the attribute is missing, the usual case.
_SLOT = torch._GLOBAL_DEVICE_CONTEXT
SLOT_KEY = _KEY = "device_context"
EMPTY_SLOT = _EMPTY = object()  # the slot had no value at all, which torch reads as "no default"


def default_slot() -> object:
    """What this thread's default-device slot holds (``set_default_device`` replaces it with
    a new object at every call): compared with its value at a block's entry, it tells
    whether ``set_default_device`` was called inside the block. (The hot path of a scope's
    entry reads ``_SLOT.__dict__.get(SLOT_KEY, EMPTY_SLOT)`` itself.)"""
    return _SLOT.__dict__.get(_KEY, _EMPTY)


def innermost_device_mode() -> DeviceContext | None:
    """The ``DeviceContext`` nearest the top of this thread's mode stack, or None."""
    length = _len_torch_function_stack()
    if not length:  # the usual case, on every constructor called in a block
        return None
    for position in range(length - 1, -1, -1):
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
