"""numpy arrays, which a move leaves on the host: the warning where they are all it got.

A move takes tensors and keeps every other object as it is (a numpy array becoming a
tensor would change the caller's types), so a batch of arrays (an RL replay buffer's
sample, an environment's observation) comes back unmoved, and the step fails later in
torch, or runs on the CPU. Where the arrays are all there is to move, the move says so.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch

# What may stand beside the arrays in a batch that holds nothing to move: exact types, read
# with a hash (isinstance of a tensor against several types is slower), and numpy's scalars.
_SCALARS = frozenset({bool, int, float, complex, str, bytes, type(None)})
_Tensor = torch.Tensor
_ndarray: type | None = None  # numpy's, once numpy is imported
_generic: type | None = None  # numpy's scalars' base (np.float32(1.0), np.bool_)


def arrays_only(obj: object) -> list[str] | None:
    """The paths of the numpy arrays in ``obj`` where they are all it holds besides
    numbers and strings: ``obj`` an array, or a dict, list or tuple (a namedtuple) of
    them, looked at one level deep; None where it holds anything else, or no array (an
    array's subclass, ``np.matrix``, counts as anything else).

    Example:
        >>> import numpy as np
        >>> arrays_only({"obs": np.zeros(3), "reward": 1.0})
        ["obj['obs']"]
        >>> arrays_only({"obs": np.zeros(3), "mask": torch.ones(3)}) is None
        True
    """
    global _ndarray, _generic
    ndarray, generic = _ndarray, _generic
    if ndarray is None or generic is None:
        numpy = sys.modules.get("numpy")  # no array exists where numpy was never imported
        if numpy is None:
            return None
        ndarray, generic = _ndarray, _generic = numpy.ndarray, numpy.generic
    if type(obj) is ndarray:
        return ["obj"]
    if type(obj) is dict:
        values: Iterable[Any] = obj.values()
    elif type(obj) is list or isinstance(obj, tuple):
        values = obj
    else:
        return None
    # A batch of tensors fails at its first item: the usual case costs one look.
    for value in values:
        kind = type(value)
        if kind is _Tensor or (
            kind is not ndarray and kind not in _SCALARS and not issubclass(kind, generic)
        ):
            return None
    if type(obj) is dict:
        found = [f"obj[{key!r}]" for key, value in obj.items() if type(value) is ndarray]
    else:
        fields = getattr(type(obj), "_fields", None)  # a namedtuple's, as find_devices names
        names = [f".{f}" for f in fields] if fields else [f"[{i}]" for i in range(len(obj))]
        found = [f"obj{n}" for n, value in zip(names, obj, strict=True) if type(value) is ndarray]
    return found or None


def arrays_unmoved(who: str, name: str, paths: list[str], target: torch.device, fix: str) -> str:
    """The warning for a move given numpy arrays and nothing to move (:func:`arrays_only`
    found ``paths``, below ``obj``, shown below ``name``)."""
    shown = ", ".join(name + path[3:] for path in paths[:3])
    more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
    return (
        f"{who} got numpy arrays and no tensor ({shown}{more}): a move takes tensors and "
        f"leaves every other object as it is, so nothing went to {target}\n"
        f"fix: {fix}"
    )
