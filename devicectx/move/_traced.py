"""The move engine as ``torch.compile`` traces it: the same rebuild, without ``id()``.

The eager engine (:mod:`devicectx.move._rebuild`, :mod:`devicectx.move._alias`) keys its
memo by ``id()``. dynamo, the tracer of ``torch.compile``, serves that badly on every
release it supports:

- ``id()`` of a dict or a list, and ``is`` between two dicts (or two lists), are
  ``Unsupported`` on torch 2.6 (``BuiltinVariable.call_id`` takes only modules, tensors
  and user-defined objects; ``handle_is`` answers only for two different types), so the
  eager walk could not be traced there at all.
- ``id()`` of an input tensor guards the compiled code on that very tensor (``ID_MATCH``,
  in ``TensorVariable.call_id``, 2.6 to 2.15), and from 2.13 ``id()`` of an input dict
  does too: every new batch recompiled the function, till dynamo's cache limit.

``is`` between two tensors is answered from dynamo's fake tensors, with no guard, on every
release: this walk finds a tensor met before with it. It keeps what the eager engine keeps
but for two things, neither of which dynamo can be asked on 2.6: a container held at two
places is rebuilt at each (the tensors in it are still moved once, and the copies are
the same objects at both places); a view arrives as ``.to`` copies it, not as a view of
its base's copy. dynamo inlines each level of the walk, so a cycle, or a structure some
50 containers deep, exceeds its own recursion limit. Modules and objects with their own
``.to`` are moved by the eager engine's own code, as dynamo traces it. Nothing is staged,
and nothing recorded for :mod:`devicectx.move._transfers`: traced code keeps no state. The
scan for a tensor met before costs a comparison per tensor moved so far, at trace time
only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from devicectx.move import _containers
from devicectx.move._alias import TensorMover
from devicectx.move._containers import kind_for
from devicectx.move._kinds import CONTAINER, LEAF, TENSOR
from devicectx.move._rebuild import Fix, Rebuild
from devicectx.move._skip import Skip

_Tensor = torch.Tensor
_CACHE = _containers.KIND_CACHE


class TracedMove:
    """One traced move of a structure to ``device`` (see the module docstring)."""

    __slots__ = ("device", "eager", "fast", "mover", "originals", "results", "skip_types")

    def __init__(
        self, device: torch.device, non_blocking: bool, skip: Skip | None, name: str, fix: Fix
    ) -> None:
        self.device = device
        self.mover = TensorMover(device, non_blocking)
        self.skip_types = () if skip is None else skip.types
        # Each tensor moved and its copy, at the same index: searched with `is`.
        self.originals: list[torch.Tensor] = []
        self.results: list[torch.Tensor] = []
        # The eager engine's code for modules and objects with their own .to.
        self.eager = Rebuild.moving(device, self.mover, skip, name, fix)
        self.fast = (_containers.FAST_DICT, _containers.FAST_LIST, _containers.FAST_TUPLE)

    def run(self, obj: Any) -> Any:
        """``obj`` with its tensors on the device: itself where nothing in it moved."""
        return self._walk(obj)[0]

    def _walk(self, obj: Any) -> tuple[Any, bool]:
        """``obj`` moved, and whether that changed it: dynamo on 2.6 cannot tell whether
        two dicts (or lists) are one, so a rebuilt child cannot be told by ``is``."""
        tp = type(obj)
        if tp is _Tensor:
            return (obj, False) if obj.device == self.device else (self._tensor(obj), True)
        fast_dict, fast_list, fast_tuple = self.fast
        if tp is fast_dict:
            out = {}
            changed = False
            for key, value in obj.items():
                out[key], moved = self._walk(value)
                changed = changed or moved
            return (out, True) if changed else (obj, False)
        if tp is fast_list or tp is fast_tuple:
            items, changed = self._each(obj)
            if not changed:
                return obj, False
            return (items if tp is fast_list else tuple(items)), True
        kind = _CACHE.get(tp) or kind_for(tp)
        role = kind.role
        if role == LEAF or (self.skip_types and isinstance(obj, self.skip_types)):
            return obj, False
        if role == TENSOR:
            return (obj, False) if obj.device == self.device else (self._tensor(obj), True)
        if role != CONTAINER:  # a module, or an object with its own .to: user-defined
            # objects, which dynamo can compare with `is`
            result = self.eager._moved_whole(obj, kind)
            return result, result is not obj
        keys, old = kind.split(obj)  # type: ignore[misc]
        new, changed = self._each(old)
        if not changed:
            return obj, False
        return kind.rebuild(obj, keys, old, new), True  # type: ignore[misc]

    def _each(self, values: Iterable[Any]) -> tuple[list[Any], bool]:
        """Each of ``values`` moved, and whether any changed."""
        moved_values = []
        changed = False
        for value in values:
            result, moved = self._walk(value)
            moved_values.append(result)
            changed = changed or moved
        return moved_values, changed

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, not on the device, moved: the same copy at every place it is."""
        for index, original in enumerate(self.originals):
            if original is tensor:
                return self.results[index]
        moved = self.mover.copy(tensor)
        self.originals.append(tensor)
        self.results.append(moved)
        return moved
