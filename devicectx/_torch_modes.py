"""The one place devicectx touches torch's private mode-stack API.

torch keeps its default device as a ``DeviceContext`` (a ``TorchFunctionMode``) on a
per-thread stack of modes. ``torch.set_default_device`` puts it at the bottom of that stack
and chains the one it displaces through ``prev_mode``; ``with torch.device(...)`` pushes one
on top. There is no public API to find a mode in that stack or to remove one that is not on
top, which :mod:`devicectx._context` needs to leave scopes out of order (asyncio tasks).

Checked on torch 2.13.0 (what CI runs): ``torch.utils._device.DeviceContext`` with
``prev_mode``, ``torch._C._len_torch_function_stack``, ``torch._C._get_function_stack_at``,
``torch.overrides._pop_mode`` and ``torch.overrides._push_mode``. tests/test_context.py
exercises every path here, so a torch release that changes them fails there first.
"""

from __future__ import annotations

import torch
from torch._C import _get_function_stack_at, _len_torch_function_stack
from torch.overrides import TorchFunctionMode, _pop_mode, _push_mode
from torch.utils._device import DeviceContext

__all__ = [
    "DeviceContext",
    "_len_torch_function_stack",
    "innermost_device_mode",
    "remove_device_mode",
]


def innermost_device_mode() -> DeviceContext | None:
    """The ``DeviceContext`` nearest the top of this thread's mode stack, or None."""
    for position in range(_len_torch_function_stack() - 1, -1, -1):
        mode = _get_function_stack_at(position)
        if isinstance(mode, DeviceContext):
            return mode
    return None


def remove_device_mode(target: DeviceContext) -> None:
    """Take ``target`` out of this thread's default-device state, wherever it is.

    It may be on the stack (on top, as an exit in order finds it, or lower, when
    another asyncio task entered a scope after it), or held in some ``DeviceContext``'s
    ``prev_mode`` chain (``torch.set_default_device`` called inside the scope displaced
    it). In the first case it is replaced by its own ``prev_mode`` so what it displaced
    comes back; in the second it is unlinked from the chain. When it is in neither place
    (``set_default_device`` was called twice inside the scope), there is nothing to undo.
    """
    above: list[TorchFunctionMode] = []
    found = False
    while _len_torch_function_stack():
        mode = _pop_mode()  # type: ignore[no-untyped-call]
        if mode is target:
            found = True
            break
        above.append(mode)
    if found and target.prev_mode is not None:
        _push_mode(target.prev_mode)  # type: ignore[no-untyped-call]
    for mode in reversed(above):
        _push_mode(mode)  # type: ignore[no-untyped-call]
    if found:
        _set_current_device_global()
        return
    for position in range(_len_torch_function_stack()):
        link = _get_function_stack_at(position)
        while isinstance(link, DeviceContext):
            if link.prev_mode is target:
                link.prev_mode = target.prev_mode
                return
            link = link.prev_mode


def _set_current_device_global() -> None:
    """Keep torch's module-level ``CURRENT_DEVICE`` (read by dynamo's guards) in step."""
    mode = innermost_device_mode()
    torch.utils._device.CURRENT_DEVICE = None if mode is None else mode.device
