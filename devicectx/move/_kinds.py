"""The ``Kind`` model: what the move engine does with one type.

Every type the engine meets gets one :class:`Kind` (:func:`~devicectx.move._containers.kind_for`
works it out and caches it), with one of five roles:

- ``CONTAINER``: taken apart into keyed children and rebuilt, with its own type, when a
  child changed: list, tuple, namedtuple, ``torch.return_types``, dict, ``OrderedDict``,
  ``defaultdict``, deque, set, frozenset, ``SimpleNamespace`` (its attributes),
  dataclasses (their fields, then the other attributes an instance was given, in
  ``__post_init__`` say; a dataclass that is also a mapping, such as transformers'
  ``ModelOutput``, through both views), ``PackedSequence``, ``ChainMap`` (through its
  maps), ``UserDict`` and ``UserList`` (their entries, then the other attributes an
  instance was given), other ``Mapping``/``Sequence``/``Set`` types, and registered types;
- ``TENSOR``, ``MODULE``: moved by the engine itself;
- ``OWN``: objects with their own ``.to`` (tensordict, ``BatchEncoding``, torch_geometric's
  ``Data``), moved with it; their children are read where the type allows, to list them
  and to check what their ``.to`` did (a tensordict lazy stack's are its stacked
  tensordicts);
- ``LEAF``: everything else, returned by identity and never iterated.

A kind's ``split`` takes an object apart and its ``rebuild`` puts it back together. A
rebuild never returns a half-moved object: where a type cannot be put back together with
every view of it showing the moved children, it raises :class:`CannotRebuild`, which the
engine reports as a ``MoveError`` naming the path.

This module holds the model, the shared kinds (tensor, module, leaf, list, tuple, dict) and
the splits several families use; it imports nothing of the modules that build kinds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch

from devicectx.move._paths import ITEM

CONTAINER, OWN, TENSOR, MODULE, LEAF = range(5)

Split: TypeAlias = "Callable[[Any], tuple[Any, Sequence[Any]]]"
"""``obj -> (keys, children)``; keys is a sequence, or None when they are the positions."""
Rebuild: TypeAlias = "Callable[[Any, Any, Sequence[Any], list[Any]], Any]"
"""``(obj, keys, old children, new children) -> new obj``."""


class CannotRebuild(Exception):
    """A container that cannot be put back together with its tensors moved.

    Raised by a rebuild, or by the check after an object's own ``.to``; the engine reports
    it as a ``MoveError`` that names the path and suggests
    :func:`~devicectx.move._containers.register_container`.

    Attributes:
        tp: the type.
        why: what went wrong, in words.
        left: for an object whose own ``.to`` left tensors behind, each one's path
            below the object (``"['pixels'][0]"``) and its device.
    """

    def __init__(self, tp: type, why: str, left: Sequence[tuple[str, torch.device]] = ()) -> None:
        super().__init__(f"{tp.__qualname__} cannot be rebuilt with its tensors moved: {why}")
        self.tp = tp
        self.why = why
        self.left = list(left)


class Kind:
    """What the engine does with one type.

    Attributes:
        role: ``CONTAINER``, ``OWN``, ``TENSOR``, ``MODULE`` or ``LEAF``.
        style: how children's paths are written (:mod:`devicectx.move._paths`).
        split: ``obj -> (keys, children)``; ``keys`` is ``None`` when they are the
            positions. ``None`` for an ``OWN`` object whose children cannot be read.
        rebuild: ``(obj, keys, old children, new children) -> new obj``, called only when
            a child changed; it raises :class:`CannotRebuild` where the type cannot be
            rebuilt faithfully.
    """

    __slots__ = ("rebuild", "role", "split", "style")

    def __init__(
        self,
        role: int,
        style: int = ITEM,
        split: Split | None = None,
        rebuild: Rebuild | None = None,
    ) -> None:
        self.role = role
        self.style = style
        self.split = split
        self.rebuild = rebuild


TENSOR_KIND = Kind(TENSOR)
DTENSOR_KIND = Kind(TENSOR)
"""A DTensor's kind: a tensor like any other to the engine, told apart by the decorator's
check (:func:`devicectx.move._walk.shared_device`), which refuses DTensors mixed with plain
tensors."""
MODULE_KIND = Kind(MODULE)
LEAF_KIND = Kind(LEAF)


_ATOMS = frozenset({int, float, bool, complex, str, bytes, type(None)})
_LONG = 64


def only_atoms(items: list[Any] | tuple[Any, ...]) -> bool:
    """Whether a long list or tuple holds only numbers, strings and ``None`` (no tensor, and
    nothing to walk into), found at C speed.

    Walked item by item, a batch's list of token ids costs every walk of the move a Python
    step per id (docs/performance.md has the figures); this look runs in C, and stops at
    the first item of another type (a tensor), so a list of tensors pays almost nothing. A
    short list is not looked at: the walk is as quick there.

    Example:
        >>> only_atoms(list(range(1000))), only_atoms([0.5] * 999 + [None])
        (True, True)
        >>> only_atoms(list(range(10)))  # short: walked as usual
        False
    """
    return len(items) >= _LONG and _ATOMS.issuperset(map(type, items))


def positional_split(obj: Any) -> tuple[None, Any]:
    return None, obj


def listed_split(obj: Any) -> tuple[None, list[Any]]:
    return None, list(obj)


def items_split(obj: Any) -> tuple[list[Any], list[Any]]:
    # items(), not iteration: some mappings iterate over something else (a TensorDict
    # iterates over its batch dimension).
    pairs = list(obj.items())
    return [k for k, _ in pairs], [v for _, v in pairs]


def dict_split(obj: dict[Any, Any]) -> tuple[list[Any], list[Any]]:
    return list(obj), list(obj.values())


LIST_KIND = Kind(CONTAINER, ITEM, positional_split, lambda o, k, old, new: new)
TUPLE_KIND = Kind(CONTAINER, ITEM, positional_split, lambda o, k, old, new: tuple(new))
DICT_KIND = Kind(CONTAINER, ITEM, dict_split, lambda o, k, old, new: dict(zip(k, new, strict=True)))
