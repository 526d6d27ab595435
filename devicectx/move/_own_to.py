"""Objects moved by their own ``.to``: calling it so that the caller's object does not
change, and reading what it did.

devicectx trusts such a ``.to`` (a TensorDict's, a ``BatchEncoding``'s, torch_geometric's
``Data``'s, a user's config object's) to move what it holds. Some move in place, so
:func:`own_to` calls it on a shallow copy (tensordict's, which returns a new object, on the
object itself); a locked TensorDict comes back locked. :func:`off` and
:func:`left_behind` read the result where a rule reads its children, for tensors the
``.to`` left where they were.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from devicectx.move._kinds import CannotRebuild
from devicectx.move._walk import iter_tensors, shared_device

__all__ = ["left_behind", "lost_lock", "off", "own_to", "shallow_copy"]

_NOT_CALLED = object()  # no .to(non_blocking=True) was made: .to(device) must be


def own_to(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``obj.to(device)``, the caller's ``obj`` unchanged: its result, or for a ``.to``
    that moves in place and returns nothing (no ``return self``), the object it moved."""
    target = obj if _returns_new(type(obj)) else shallow_copy(obj)
    result: Any = _NOT_CALLED
    if non_blocking:
        with contextlib.suppress(TypeError):  # a .to that takes no non_blocking
            result = target.to(device, non_blocking=True)
    if result is _NOT_CALLED:
        result = target.to(device)
    if result is None:  # it moved in place: the object it moved is checked like any result
        return target
    if target is not obj and lost_lock(obj, result):
        # A TensorDict's copy is unlocked; its own .to keeps the lock.
        result.lock_()
    return result


def lost_lock(obj: Any, result: Any) -> bool:
    """Whether ``result`` came back unlocked from a locked ``obj`` (tensordict's
    ``is_locked``: a locked TensorDict refuses new keys, and a move must keep that)."""
    return getattr(obj, "is_locked", False) is True and getattr(result, "is_locked", True) is False


_RETURNS_NEW: dict[type, bool] = {}


def _returns_new(tp: type) -> bool:
    """Whether the ``.to`` of ``tp`` is tensordict's, which returns a new object and leaves
    its input as it was: the input needs no copy first (another's may move it in place)."""
    known = _RETURNS_NEW.get(tp)
    if known is None:
        module = getattr(getattr(tp, "to", None), "__module__", None) or ""
        known = _RETURNS_NEW[tp] = module.partition(".")[0] == "tensordict"
    return known


def shallow_copy(obj: Any) -> Any:
    """A copy to call ``.to`` on: some ``.to`` methods move in place (BatchEncoding's,
    torch_geometric's), and the input must not change."""
    try:
        target = copy.copy(obj)
    except Exception:
        return obj
    _own_containers(target)
    return target


def _own_containers(clone: Any) -> None:
    """Give a shallow copy its own dicts and lists, one level down: a ``.to`` that writes
    into one it holds (``self.tensors[k] = v.to(device)``) then writes into the copy's,
    not into the caller's, which the shallow copy shares."""
    state = getattr(clone, "__dict__", None)
    if type(state) is not dict:
        return
    for name, value in state.items():
        if type(value) is dict or type(value) is list:
            state[name] = copy.copy(value)


def off(result: Any, device: torch.device) -> bool:
    """Whether a tensor that can be read in ``result`` is not on ``device``. What cannot be
    read (an object inside with a ``.to`` of its own and no readable children) is trusted:
    the ``.to`` that moved ``result`` moved it."""
    if shared_device(result, device) is device:  # all on it, read without paths
        return False
    return any(tensor.device != device for _, tensor in iter_tensors(result, "result"))


def left_behind(result: Any, device: torch.device) -> CannotRebuild:
    """The error for an object whose own ``.to`` left some of its tensors where they were."""
    left = [(path, t.device) for path, t in iter_tensors(result, "") if t.device != device]
    why = f"its own .to({str(device)!r}) left tensors where they were"
    return CannotRebuild(type(result), why, left)
