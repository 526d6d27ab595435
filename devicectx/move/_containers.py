"""The container registry: which :class:`~devicectx.move._kinds.Kind` each type gets.

:func:`kind_for` works a type's kind out once and caches it (``KIND_CACHE``, which the walks
read directly on the hot path). The rules, first match wins: a registered type (nearest in
the MRO, :func:`register_container`), a tensor, a module, a known leaf (``str``,
``torch.Size``, ``range``, ...), the built-in container types (and the package's own,
:func:`register_builtin_kind`), ``PackedSequence``, ``ChainMap``, a ``torch.distributions``
distribution or transform, an object with a ``.to``
method, a dataclass, a ``SimpleNamespace``, a tuple type, a ``UserDict``, a ``Mapping``, a
``Set``, a ``UserList``, a ``Sequence``; anything else is a leaf.

How each family is taken apart and rebuilt lives beside it: the model and the common kinds
in :mod:`devicectx.move._kinds`, dataclasses and namespaces in
:mod:`devicectx.move._dataclasses`, the other collections in
:mod:`devicectx.move._collection_types`. Optional packages (transformers, tensordict,
torch_geometric) are never imported: their types are known by what they are.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import sys
import threading
import types
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import Any, Literal, TypeVar

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from devicectx._errors import RegistrationError
from devicectx.move._collection_types import (
    ATTRIBUTES_KIND,
    CHAIN_KIND,
    PACKED_KIND,
    STACK_KIND,
    entries_split,
    graph_split,
    is_graph,
    is_lazy_stack,
    mapping_items,
    moves_attributes,
    rebuild_mapping,
    rebuild_sequence,
    rebuild_set,
    tuple_kind,
    user_kind,
)
from devicectx.move._dataclasses import (
    dataclass_rebuild,
    dataclass_split,
    dual_rebuild,
    dual_split,
    namespace_kind,
    two_views,
)
from devicectx.move._distributed import is_dtensor_type
from devicectx.move._kinds import (
    CONTAINER,
    DICT_KIND,
    DTENSOR_KIND,
    LEAF_KIND,
    LIST_KIND,
    MODULE_KIND,
    OWN,
    TENSOR_KIND,
    TUPLE_KIND,
    Kind,
    dict_split,
    items_split,
    listed_split,
)

# Named here too, for the tests that reach them as ``_containers.X``.
from devicectx.move._kinds import LEAF as LEAF
from devicectx.move._kinds import CannotRebuild as CannotRebuild
from devicectx.move._paths import ATTR, DUAL, ITEM, MEMBER

C = TypeVar("C")


_BUILTIN: dict[type, Kind] = {
    list: LIST_KIND,
    tuple: TUPLE_KIND,
    dict: DICT_KIND,
    collections.OrderedDict: Kind(
        CONTAINER,
        ITEM,
        dict_split,
        lambda o, k, old, new: _with_attributes(
            collections.OrderedDict(zip(k, new, strict=True)), o
        ),
    ),
    collections.defaultdict: Kind(
        CONTAINER,
        ITEM,
        dict_split,
        lambda o, k, old, new: collections.defaultdict(o.default_factory, zip(k, new, strict=True)),
    ),
    collections.deque: Kind(
        CONTAINER, ITEM, listed_split, lambda o, k, old, new: collections.deque(new, o.maxlen)
    ),
    set: Kind(CONTAINER, MEMBER, listed_split, lambda o, k, old, new: set(new)),
    frozenset: Kind(CONTAINER, MEMBER, listed_split, lambda o, k, old, new: frozenset(new)),
}


def _with_attributes(made: C, original: object) -> C:
    """``made`` with the attributes ``original`` holds beside its entries, as they are:
    an ``OrderedDict`` takes them (``state_dict()``'s ``_metadata``, module versions that
    ``load_state_dict`` reads)."""
    held = getattr(original, "__dict__", None)
    if held:
        vars(made).update(held)
    return made


# Never iterated, though some are Sequences or Sets: iterating a str or a range is
# pointless, and a dict view, an array or a memoryview never holds a tensor.
_LEAF_BASES: tuple[type, ...] = (
    str,
    bytes,
    bytearray,
    memoryview,
    range,
    torch.Size,
    array.array,
    type,
    type({}.keys()),
    type({}.values()),
    type({}.items()),
)
_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)

_REGISTRY: dict[type, Kind] = {}
KIND_CACHE: dict[type, Kind] = {}
"""Each type's kind once worked out. Other modules read it directly on the hot path, so it
is only ever cleared, never rebound; :func:`kind_for` adds to it only under ``_LOCK``."""
_LOCK = threading.Lock()
_generation = 0
"""How many times the rules changed (each :func:`_reset_cache`): :func:`kind_for` keeps a
kind only if it was worked out under the rules still in force."""


class _Never:
    """Stands in for a built-in type in the walkers' fast checks once it is registered."""


FAST_LIST: type = list
FAST_TUPLE: type = tuple
FAST_DICT: type = dict
PLAIN_BUILTINS = True
"""Whether dict, list and tuple are all unregistered: the walkers' recursive fast paths
take them as they are only then."""


def _reset_cache() -> None:
    """Forget every worked-out kind, after the rules changed; called under ``_LOCK``."""
    global FAST_LIST, FAST_TUPLE, FAST_DICT, PLAIN_BUILTINS, _generation
    _generation += 1
    KIND_CACHE.clear()
    KIND_CACHE.update(dict.fromkeys(_PLAIN_LEAVES, LEAF_KIND))
    KIND_CACHE[torch.Tensor] = TENSOR_KIND
    FAST_LIST = _Never if list in _REGISTRY else list
    FAST_TUPLE = _Never if tuple in _REGISTRY else tuple
    FAST_DICT = _Never if dict in _REGISTRY else dict
    PLAIN_BUILTINS = not any(tp in _REGISTRY for tp in (dict, list, tuple))


_reset_cache()


def kind_for(tp: type) -> Kind:
    """The kind of every object of exact type ``tp`` (cached).

    Safe beside a registration in another thread: a kind worked out from the rules as they
    were before a (un)registration is never cached after it, but worked out again.
    """
    kind = KIND_CACHE.get(tp)
    if kind is None:
        kind = _worked_out(tp)
    return kind


def _worked_out(tp: type) -> Kind:
    """``tp``'s kind under the rules in force, cached if they did not change meanwhile."""
    # Worked out without the lock: it runs the type's own code (a metaclass's ``to``
    # property, say), which may register, or wait for a thread that does.
    for _ in range(2):
        generation = _generation
        kind = _work_out(tp)
        with _LOCK:
            if generation == _generation:
                KIND_CACHE[tp] = kind
                return kind
    # The rules changed on each try (a type whose own code registers as it is read):
    # this answer is not cached, so the next look works the kind out again.
    return kind


def register_builtin_kind(tp: type, kind: Kind) -> None:
    """Give ``tp``, a container type of devicectx's own, ``kind`` among the built-in rules.

    For the package's internal containers (the move engine's call arguments, say), which
    need a ``Kind`` of their own (a path style, a rebuild taking the old children) that
    :func:`register_container` does not offer. It applies to ``tp`` exactly, not to its
    subclasses, and a user's :func:`register_container` of ``tp`` still wins. Giving
    ``tp`` a kind again replaces it. Call it where ``tp`` is defined, at import.
    """
    with _LOCK:
        _BUILTIN[tp] = kind
        _reset_cache()


def register_container(
    cls: type[C],
    children: Callable[[C], Iterable[tuple[Any, Any]]],
    rebuild: Callable[[C, list[Any]], C],
    *,
    keys: Literal["attr", "item"] = "attr",
) -> None:
    """Teach :func:`to_device` and :func:`find_devices` a container type of your own.

    Example:
        >>> import torch, devicectx
        >>> class Pair:
        ...     def __init__(self, left, right, note=""):
        ...         self.left, self.right, self.note = left, right, note
        >>> devicectx.register_container(
        ...     Pair,
        ...     children=lambda p: [("left", p.left), ("right", p.right)],
        ...     rebuild=lambda p, new: Pair(*new, note=p.note),
        ... )
        >>> pair = Pair(torch.zeros(2), torch.ones(2), note="kept")
        >>> devicectx.to_device(pair, "meta").right.device
        device(type='meta')
        >>> devicectx.find_devices(pair, name="pair")
        {device(type='cpu'): ['pair.left', 'pair.right']}

    Args:
        cls: the type. Its subclasses use the registration too, unless they have their own
            (the nearest class in the MRO wins). Registered types win over every built-in
            rule, so this also changes how a ``dict`` subclass or a class with a ``.to``
            method is handled. Registering a type again replaces its registration.
        children: ``obj -> iterable of (key, child)``, in a fixed order. Only the children
            listed are looked into and moved.
        rebuild: ``(obj, new_children) -> new object``, the new children in the order
            ``children`` gave them. Called only when a child changed; ``obj`` is the
            original, to copy what is not a child (use ``type(obj)`` to keep subclasses).
            Its result must be of ``obj``'s type and hold as many children: the move
            checks both, and refuses (``MoveError``) a rebuild that drops a child.
        keys: how paths show the keys: ``"attr"`` writes ``pair.left``, ``"item"``
            writes ``pair['left']``.

    Raises:
        TypeError: ``cls`` is not a class, or is ``object`` or ``torch.Tensor`` itself,
            or ``children``/``rebuild`` are not callable.
        ValueError: ``keys`` is neither ``"attr"`` nor ``"item"``.
        devicectx.RegistrationError: at a move or a look, ``children`` gave something
            other than a ``(key, child)`` pair (a ``TypeError``).
    """
    if not isinstance(cls, type) or cls in (object, torch.Tensor):
        msg = (
            f"register_container() needs a container class, got {cls!r}\n"
            "fix: register_container(MyBatch, children=mybatch_children, "
            "rebuild=mybatch_rebuild), MyBatch your container class, with the two "
            "functions you write for it: obj -> its (key, child) pairs, and "
            "(obj, new children) -> a new MyBatch"
        )
        raise TypeError(msg)
    for label, fn in (("children", children), ("rebuild", rebuild)):
        if not callable(fn):
            msg = (
                f"register_container({cls.__qualname__}, ...): {label}={fn!r} is not callable\n"
                f"fix: pass a function, e.g. {label}="
                f"lambda obj{', new' * (label == 'rebuild')}: ..."
            )
            raise TypeError(msg)
    if keys not in ("attr", "item"):
        msg = (
            f"register_container({cls.__qualname__}, ...): keys={keys!r} is not a key style\n"
            f"fix: keys='attr' (paths like obj.left) or keys='item' (paths like obj['left'])"
        )
        raise ValueError(msg)

    def split(obj: Any) -> tuple[list[Any], list[Any]]:
        keys: list[Any] = []
        values: list[Any] = []
        for pair in children(obj):
            try:
                # A tensor of two elements would unpack, as its two halves.
                if isinstance(pair, torch.Tensor):
                    raise TypeError
                key, value = pair
            except (TypeError, ValueError):
                raise RegistrationError(_not_a_pair(cls, pair)) from None
            keys.append(key)
            values.append(value)
        return keys, values

    def rebuilt(obj: Any, _keys: object, _old: object, new: list[Any]) -> Any:
        result = rebuild(obj, new)
        # What the user's rebuild gives is checked, as a built-in rebuild is: the same type,
        # holding as many children (one dropped would be lost without a word).
        if type(result) is not type(obj):
            raise RegistrationError(_rebuilt_as(cls, f"a {type(result).__qualname__}"))
        held = sum(1 for _ in children(result))
        if held != len(new):
            raise RegistrationError(
                _rebuilt_as(
                    cls, f"a {cls.__qualname__} holding {held} of the {len(new)} new children"
                )
            )
        return result

    kind = Kind(CONTAINER, ATTR if keys == "attr" else ITEM, split, rebuilt)
    with _LOCK:
        _REGISTRY[cls] = kind
        _reset_cache()


def _rebuilt_as(cls: type, what: str) -> str:
    """The message for a ``rebuild=`` whose result is not ``cls`` with every new child."""
    name = cls.__qualname__
    return (
        f"register_container({name}, rebuild=...) returned {what}\n"
        f"fix: rebuild=lambda obj, new: {name}(*new), a new {name} holding each new child, "
        f"in the order children= gives them"
    )


def _not_a_pair(cls: type, item: object) -> str:
    """The message for a ``children=`` that gave ``item`` where a ``(key, child)`` belongs."""
    name = cls.__qualname__
    return (
        f"register_container({name}, children=...) gave a {type(item).__qualname__} for a "
        f"{name}, not a (key, child) pair\n"
        f'fix: children=lambda obj: [("left", obj.left), ("right", obj.right)], each child '
        f"with its key"
    )


def unregister_container(cls: type) -> None:
    """Undo :func:`register_container`: ``cls`` is handled by the built-in rules again.

    Example:
        >>> import torch, devicectx
        >>> class Pair:
        ...     def __init__(self, left, right):
        ...         self.left, self.right = left, right
        >>> devicectx.register_container(
        ...     Pair, children=lambda p: [("left", p.left)], rebuild=lambda p, new: p
        ... )
        >>> devicectx.unregister_container(Pair)
        >>> devicectx.find_devices(Pair(torch.zeros(1), None))
        {}

    Args:
        cls: a type given to :func:`register_container` before.

    Raises:
        ValueError: ``cls`` is not registered (its subclasses' and bases' registrations
            are their own).
    """
    with _LOCK:
        if cls not in _REGISTRY:
            registered = ", ".join(sorted(tp.__qualname__ for tp in _REGISTRY)) or "none"
            msg = (
                f"unregister_container({getattr(cls, '__qualname__', cls)!r}): it is not "
                f"registered (registered: {registered})\n"
                f"fix: unregister only a class given to register_container()"
            )
            raise ValueError(msg)
        del _REGISTRY[cls]
        _reset_cache()


def is_registered(tp: type) -> bool:
    """Whether ``tp`` or a class it derives from was taught with :func:`register_container`."""
    return any(klass in _REGISTRY for klass in tp.__mro__)


def is_plain_leaf(tp: type) -> bool:
    """Whether objects of ``tp`` are leaves that hold no tensor: scalars, strings, types."""
    return tp in _PLAIN_LEAVES or issubclass(tp, _LEAF_BASES)


def _work_out(tp: type) -> Kind:
    for klass in tp.__mro__:
        registered = _REGISTRY.get(klass)
        if registered is not None:
            return registered
    if issubclass(tp, torch.Tensor):
        return DTENSOR_KIND if is_dtensor_type(tp) else TENSOR_KIND
    if issubclass(tp, nn.Module):
        return MODULE_KIND
    if issubclass(tp, _LEAF_BASES):
        return LEAF_KIND
    builtin = _BUILTIN.get(tp)
    if builtin is not None:
        return builtin
    if issubclass(tp, PackedSequence):
        return PACKED_KIND
    if issubclass(tp, collections.ChainMap):
        return CHAIN_KIND
    if moves_attributes(tp):
        return ATTRIBUTES_KIND
    if callable(getattr(tp, "to", None)):
        return _own_kind(tp)
    if dataclasses.is_dataclass(tp):
        if two_views(tp):
            return Kind(CONTAINER, DUAL, dual_split(tp), dual_rebuild(tp))
        return Kind(CONTAINER, ATTR, dataclass_split(tp, True), dataclass_rebuild(tp))
    if issubclass(tp, types.SimpleNamespace):
        return namespace_kind(tp)
    if issubclass(tp, tuple):
        return tuple_kind(tp)
    if issubclass(tp, collections.UserDict):
        return user_kind(tp, entries_split(tp), rebuild_mapping)
    if issubclass(tp, Mapping):
        return Kind(CONTAINER, ITEM, items_split, rebuild_mapping)
    if issubclass(tp, Set):
        return Kind(CONTAINER, MEMBER, listed_split, rebuild_set)
    if issubclass(tp, collections.UserList):
        return user_kind(tp, listed_split, rebuild_sequence)
    if issubclass(tp, Sequence):
        return Kind(CONTAINER, ITEM, listed_split, rebuild_sequence)
    return LEAF_KIND


def _is_tensorclass(tp: type) -> bool:
    """Whether ``tp`` is a tensordict ``@tensorclass`` (tensordict is imported where one
    exists)."""
    tensordict = sys.modules.get("tensordict")
    is_tensorclass = getattr(tensordict, "is_tensorclass", None)
    return callable(is_tensorclass) and bool(is_tensorclass(tp))


def _tensorclass_rebuild(obj: Any, keys: Any, old: Sequence[Any], new: list[Any]) -> Any:
    """A tensorclass with its changed fields set on its shallow copy (``obj.copy()``),
    which keeps its batch size, device and plain fields, as a cast of its tensors needs
    (its constructor would need them all given again)."""
    clone = obj.copy()
    for key, before, after in zip(keys, old, new, strict=True):
        if after is not before:
            setattr(clone, key, after)
    return clone


def _own_kind(tp: type) -> Kind:
    """An object with its own ``.to``: a split where its children can be read, and a
    rebuild where what its ``.to`` leaves behind can be moved by the type's own protocol."""
    if dataclasses.is_dataclass(tp):  # a tensorclass, say: its fields are its own business
        if two_views(tp):
            return Kind(OWN, DUAL, dual_split(tp), dual_rebuild(tp))
        if _is_tensorclass(tp):
            return Kind(OWN, ATTR, dataclass_split(tp), _tensorclass_rebuild)
        return Kind(OWN, ATTR, dataclass_split(tp))
    if is_graph(tp):
        return Kind(OWN, DUAL, graph_split)
    if is_lazy_stack(tp):
        return STACK_KIND
    if issubclass(tp, Mapping):
        return Kind(OWN, ITEM, mapping_items(tp), rebuild_mapping)
    return Kind(OWN)
