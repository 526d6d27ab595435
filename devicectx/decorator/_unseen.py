"""torch's device mismatch inside a decorated body, told in devicectx's words.

Where the body of a decorated call fails with torch's "Expected all tensors to be on the
same device" (or "... is not on the expected device ..."), the cause is often a tensor
the decorator could not see: held in an attribute of a plain object, or set on a module
without ``register_buffer``. :func:`explain` finds them
(:func:`devicectx.move._unseen.unseen_tensors`) and makes the error that names them, their
devices and the fix; the caller raises it from torch's. :func:`own_to_mend` serves the check of
a call that moves nothing. Only the failure path gets here.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import torch

from devicectx._errors import DeviceError, DeviceMismatchError
from devicectx.move._unseen import (
    Unseen,
    fix_for,
    is_device_mismatch,
    own_to_fix,
    unseen_tensors,
)


def own_to_mend(named: Iterable[tuple[str, Any, object]], target: torch.device) -> str | None:
    """For a call that moves nothing, with tensors off ``target`` in an argument whose own
    ``.to`` would leave them there (tried on a copy): how to write that ``.to``; else None.
    On the error path only.

    Args:
        named: ``(name, value, default)`` for each argument.
        target: the device the call needs.
    """
    unseen = unseen_tensors((name, value) for name, value, _ in named)
    return own_to_fix([u for u in unseen if u.device != target], target)


def explain(
    error: BaseException,
    function: str,
    named: Iterable[tuple[str, Any]],
    target: torch.device | None,
    reason: str,
    checked: Collection[int] = (),
    follow: bool = False,
) -> DeviceMismatchError | None:
    """The error to raise instead of torch's ``error``, or None to let it through.

    None where ``error`` is not a device mismatch, or no argument holds a tensor the
    decorator cannot see off ``target``.

    Args:
        error: what the body raised.
        function: the decorated function's qualname.
        named: ``(name, value)`` for each argument the body got (``self`` included).
        target: the device the call ran for; None where nothing chose one.
        reason: why ``target``, in words.
        checked: the ids of the modules whose devices the call checked (the module its
            rules read, with its submodules); other modules are looked into as unseen.
        follow: whether the inputs chose ``target`` (no device named, no block, no
            module): a module elsewhere is then better followed than moved.
    """
    if isinstance(error, DeviceError) or not is_device_mismatch(error):
        return None
    unseen = [u for u in unseen_tensors(named, checked) if target is None or u.device != target]
    if not unseen:
        return None
    found = _by_device(unseen)
    width = max(len(str(device)) for device in found)
    torch_said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    lines = [f"{function}() failed in torch on tensors @device_agnostic cannot see into:"]
    lines += [f"    {device!s:<{width}} <- {paths}" for device, paths in _shown(found).items()]
    lines.append(
        f"target {target} (from {reason})" if target is not None else f"no target: {reason}"
    )
    lines.append(f"torch said: {torch_said}")
    lines.append(f"fix: {fix_for(unseen, target, follow)}")
    devices = {device: [u.path for u in group] for device, group in found.items()}
    return DeviceMismatchError("\n".join(lines), devices=devices, target=target, reason=reason)


def _by_device(unseen: list[Unseen]) -> dict[torch.device, list[Unseen]]:
    grouped: dict[torch.device, list[Unseen]] = {}
    for item in unseen:
        grouped.setdefault(item.device, []).append(item)
    return grouped


# Paths shown per device before "and N more", as the other mismatch messages do.
_MAX_PATHS = 6


def _shown(found: dict[torch.device, list[Unseen]]) -> dict[torch.device, str]:
    shown: dict[torch.device, str] = {}
    for device, group in found.items():
        paths = [f"{u.path} ({_held_by(u)})" for u in group[:_MAX_PATHS]]
        more = f" and {len(group) - _MAX_PATHS} more" if len(group) > _MAX_PATHS else ""
        shown[device] = ", ".join(paths) + more
    return shown


def _held_by(item: Unseen) -> str:
    if item.module is not None:
        kind = item.module.__qualname__
        if item.holder_path != item.path:
            return f"{kind}, in {item.holder.__qualname__}"
        return f"{kind}, a module @device_agnostic does not check"
    module = issubclass(item.holder, torch.nn.Module)
    if item.shared_by is not None:
        # Said so: the class holds it, so every instance shares it, and no move reaches it.
        buffer = ", not a buffer" if module else ""
        return f"a class attribute of {item.shared_by.__qualname__}{buffer}"
    if module:
        return f"a plain attribute of {item.holder.__qualname__}, not a buffer"
    return f"in {item.holder.__qualname__}"
