"""Container kinds: how each type is taken apart and put back together by the move engine.

Every type the engine meets gets one :class:`Kind`, worked out once per type and cached:

- ``CONTAINER``: taken apart into keyed children and rebuilt, with its own type, when a
  child changed: list, tuple, namedtuple, ``torch.return_types``, dict, ``OrderedDict``,
  ``defaultdict``, deque, set, frozenset, dataclasses (a dataclass that is also a mapping,
  such as transformers' ``ModelOutput``, through both views), ``PackedSequence``,
  ``ChainMap`` (through its maps), other ``Mapping``/``Sequence``/``Set`` types, and
  registered types;
- ``TENSOR``, ``MODULE``: moved by the engine itself;
- ``OWN``: objects with their own ``.to`` (tensordict, ``BatchEncoding``, torch_geometric's
  ``Data``), moved with it; their children are read where the type allows, to list them
  and to check what their ``.to`` did;
- ``LEAF``: everything else, returned by identity and never iterated.

The rules, first match wins: a registered type (nearest in the MRO), a tensor, a module,
a known leaf (``str``, ``torch.Size``, ``range``, ...), the built-in container types, an
object with a ``.to`` method, a dataclass, a tuple type, a ``Mapping``, a ``Set``, a
``Sequence``; anything else is a leaf.

A rebuild never returns a half-moved object: where a type cannot be put back together
with every view of it showing the moved children, it raises :class:`CannotRebuild`, which
the engine reports as a ``MoveError`` naming the path. Optional packages (transformers,
tensordict, torch_geometric) are never imported: their types are known by what they are.
"""

from __future__ import annotations

import array
import collections
import copy
import dataclasses
import functools
import threading
from collections.abc import (
    Callable,
    Iterable,
    Mapping,
    MutableMapping,
    MutableSequence,
    MutableSet,
    Sequence,
    Set,
)
from typing import Any, Literal, TypeAlias, TypeVar

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from devicectx._errors import RegistrationError
from devicectx.move._distributed import is_dtensor_type
from devicectx.move._paths import ATTR, DUAL, ITEM, MEMBER, Entry, join

C = TypeVar("C")

CONTAINER, OWN, TENSOR, MODULE, LEAF = range(5)

Split: TypeAlias = "Callable[[Any], tuple[Any, Sequence[Any]]]"
"""``obj -> (keys, children)``; keys is a sequence, or None when they are the positions."""
Rebuild: TypeAlias = "Callable[[Any, Any, Sequence[Any], list[Any]], Any]"
"""``(obj, keys, old children, new children) -> new obj``."""


class CannotRebuild(Exception):
    """A container that cannot be put back together with its tensors moved.

    Raised by a rebuild, or by the check after an object's own ``.to``; the engine reports
    it as a ``MoveError`` that names the path and suggests :func:`register_container`.

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


def _positions(obj: Any) -> tuple[None, Any]:
    return None, obj


def _listed(obj: Any) -> tuple[None, list[Any]]:
    return None, list(obj)


def _items(obj: Any) -> tuple[list[Any], list[Any]]:
    # items(), not iteration: some mappings iterate over something else (a TensorDict
    # iterates over its batch dimension).
    pairs = list(obj.items())
    return [k for k, _ in pairs], [v for _, v in pairs]


def _dict_items(obj: dict[Any, Any]) -> tuple[list[Any], list[Any]]:
    return list(obj), list(obj.values())


LIST_KIND = Kind(CONTAINER, ITEM, _positions, lambda o, k, old, new: new)
TUPLE_KIND = Kind(CONTAINER, ITEM, _positions, lambda o, k, old, new: tuple(new))
DICT_KIND = Kind(
    CONTAINER, ITEM, _dict_items, lambda o, k, old, new: dict(zip(k, new, strict=True))
)

_BUILTIN: dict[type, Kind] = {
    list: LIST_KIND,
    tuple: TUPLE_KIND,
    dict: DICT_KIND,
    collections.OrderedDict: Kind(
        CONTAINER,
        ITEM,
        _dict_items,
        lambda o, k, old, new: collections.OrderedDict(zip(k, new, strict=True)),
    ),
    collections.defaultdict: Kind(
        CONTAINER,
        ITEM,
        _dict_items,
        lambda o, k, old, new: collections.defaultdict(o.default_factory, zip(k, new, strict=True)),
    ),
    collections.deque: Kind(
        CONTAINER, ITEM, _listed, lambda o, k, old, new: collections.deque(new, o.maxlen)
    ),
    set: Kind(CONTAINER, MEMBER, _listed, lambda o, k, old, new: set(new)),
    frozenset: Kind(CONTAINER, MEMBER, _listed, lambda o, k, old, new: frozenset(new)),
}

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
_CACHE: dict[type, Kind] = {}
_LOCK = threading.Lock()


class _Never:
    """Stands in for a built-in type in the walkers' fast checks once it is registered."""


FAST_LIST: type = list
FAST_TUPLE: type = tuple
FAST_DICT: type = dict
PLAIN_BUILTINS = True
"""Whether dict, list and tuple are all unregistered: the walkers' recursive fast paths
take them as they are only then."""


def _reset_cache() -> None:
    global FAST_LIST, FAST_TUPLE, FAST_DICT, PLAIN_BUILTINS
    _CACHE.clear()
    _CACHE.update(dict.fromkeys(_PLAIN_LEAVES, LEAF_KIND))
    _CACHE[torch.Tensor] = TENSOR_KIND
    FAST_LIST = _Never if list in _REGISTRY else list
    FAST_TUPLE = _Never if tuple in _REGISTRY else tuple
    FAST_DICT = _Never if dict in _REGISTRY else dict
    PLAIN_BUILTINS = not any(tp in _REGISTRY for tp in (dict, list, tuple))


_reset_cache()


def kind_for(tp: type) -> Kind:
    """The kind of every object of exact type ``tp`` (cached)."""
    kind = _CACHE.get(tp)
    if kind is None:
        kind = _work_out(tp)
        _CACHE[tp] = kind
    return kind


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
            f"fix: register_container(MyBatch, children=..., rebuild=...)"
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
        return rebuild(obj, new)

    kind = Kind(CONTAINER, ATTR if keys == "attr" else ITEM, split, rebuilt)
    with _LOCK:
        _REGISTRY[cls] = kind
        _reset_cache()


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
        return _PACKED_KIND
    if issubclass(tp, collections.ChainMap):
        return _CHAIN_KIND
    if callable(getattr(tp, "to", None)):
        return _own_kind(tp)
    if dataclasses.is_dataclass(tp):
        if _two_views(tp):
            return Kind(CONTAINER, DUAL, _dual_split(tp), _dual_rebuild(tp))
        return Kind(CONTAINER, ATTR, _dataclass_split(tp), _dataclass_rebuild(tp))
    if issubclass(tp, tuple):
        return _tuple_kind(tp)
    if issubclass(tp, Mapping):
        return Kind(CONTAINER, ITEM, _items, _rebuild_mapping)
    if issubclass(tp, Set):
        return Kind(CONTAINER, MEMBER, _listed, _rebuild_set)
    if issubclass(tp, Sequence):
        return Kind(CONTAINER, ITEM, _listed, _rebuild_sequence)
    return LEAF_KIND


def _own_kind(tp: type) -> Kind:
    """An object with its own ``.to``: a split where its children can be read, and a
    rebuild where what its ``.to`` leaves behind can be moved by the type's own protocol."""
    if dataclasses.is_dataclass(tp):  # a tensorclass, say: its fields are its own business
        if _two_views(tp):
            return Kind(OWN, DUAL, _dual_split(tp), _dual_rebuild(tp))
        return Kind(OWN, ATTR, _dataclass_split(tp))
    if _is_graph(tp):
        return Kind(OWN, DUAL, _graph_split)
    if issubclass(tp, Mapping):
        return Kind(OWN, ITEM, _items, _rebuild_mapping)
    return Kind(OWN)


def _is_graph(tp: type) -> bool:
    """torch_geometric's ``Data``, ``Batch`` (and the ``DataBatch`` types it makes),
    ``HeteroData``: known by where they come from, so the package is never imported."""
    return isinstance(getattr(tp, "stores", None), property) and any(
        klass.__module__.partition(".")[0] == "torch_geometric" for klass in tp.__mro__
    )


def _graph_split(obj: Any) -> tuple[list[Any], list[Any]]:
    # Its stores, not items(): a HeteroData's items() is empty. The global store's entries
    # are attributes of the object (data.x); each node or edge type's store is an entry
    # (data['paper']), itself a mapping with its own .to.
    keys: list[Any] = []
    values: list[Any] = []
    for store in obj.stores:
        key = getattr(store, "_key", None)
        if key is None:
            for name, value in store.items():
                keys.append(name)
                values.append(value)
        else:
            keys.append(Entry(key) if type(key) is str else key)
            values.append(store)
    return keys, values


_PACKED_FIELDS = ("data", "sorted_indices", "unsorted_indices")


def _packed_split(obj: PackedSequence) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    # batch_sizes is not a child: PyTorch requires it on the CPU, whatever the data's device.
    return _PACKED_FIELDS, (obj.data, obj.sorted_indices, obj.unsorted_indices)


def _packed_rebuild(obj: PackedSequence, keys: object, old: object, new: list[Any]) -> Any:
    data, sorted_indices, unsorted_indices = new
    return type(obj)(data, obj.batch_sizes, sorted_indices, unsorted_indices)


_PACKED_KIND = Kind(CONTAINER, ATTR, _packed_split, _packed_rebuild)


def _chain_split(obj: collections.ChainMap[Any, Any]) -> tuple[tuple[str], tuple[Any]]:
    # Its maps, not its items: a key in an earlier map hides the same key in the later
    # ones, whose tensors the chain still holds (chain.parents reaches them), and item
    # assignment on a copy would write every moved item into the first map.
    return ("maps",), (obj.maps,)


def _chain_rebuild(
    obj: collections.ChainMap[Any, Any], keys: object, old: object, new: list[Any]
) -> Any:
    # Not copy.copy: ChainMap's copies the first map and forgets the chain's other
    # attributes; the moved maps replace all of them anyway.
    clone: Any = object.__new__(type(obj))
    clone.__dict__.update(vars(obj))
    for slot in slot_names(type(obj)):
        value = getattr(obj, slot, _MISSING)
        if value is not _MISSING:
            object.__setattr__(clone, slot, value)
    clone.maps = new[0]
    _forget_cached(clone)
    return clone


_CHAIN_KIND = Kind(CONTAINER, ATTR, _chain_split, _chain_rebuild)


def _tuple_kind(tp: type) -> Kind:
    fields = getattr(tp, "_fields", None)
    if isinstance(fields, tuple) and callable(getattr(tp, "_make", None)):
        make = tp._make  # type: ignore[attr-defined]

        def namedtuple_split(obj: Any) -> tuple[tuple[str, ...], Any]:
            return fields, obj

        return Kind(CONTAINER, ATTR, namedtuple_split, lambda o, k, old, new: make(new))
    count = getattr(tp, "n_sequence_fields", None)
    if count is not None:  # a structseq, such as torch.return_types.max
        names = getattr(tp, "__match_args__", ())
        if count != getattr(tp, "n_fields", None) or len(names) != count:
            return _hidden_structseq_kind(tp, count)

        def structseq_split(obj: Any) -> tuple[tuple[str, ...], Any]:
            return names, obj

        return Kind(CONTAINER, ATTR, structseq_split, lambda o, k, old, new: tp(new))
    return Kind(CONTAINER, ITEM, _positions, _rebuild_sequence)


def _hidden_structseq_kind(tp: type, count: int) -> Kind:
    """A structseq with fields that are no positions (``time.struct_time``'s ``tm_zone``,
    ``os.stat_result``'s ``st_atime_ns``): taken apart and rebuilt as pickle does it,
    by ``__reduce__``, which gives ``(tp, (visible fields, {hidden name: value}))``.
    The visible fields are keyed by position, as ``obj[0]`` reads them; the hidden ones
    by name, as ``obj.tm_zone`` does."""

    def split(obj: Any) -> tuple[list[Any], list[Any]]:
        _, (visible, hidden) = obj.__reduce__()
        return [*range(len(visible)), *hidden], [*visible, *hidden.values()]

    def rebuild(obj: Any, keys: Any, old: Sequence[Any], new: list[Any]) -> Any:
        visible = len(obj)
        return tp(tuple(new[:visible]), dict(zip(keys[visible:], new[visible:], strict=True)))

    return Kind(CONTAINER, DUAL, split, rebuild)


_MISSING = object()


def _dataclass_split(tp: type) -> Split:
    names = tuple(f.name for f in dataclasses.fields(tp))

    def split(obj: Any) -> tuple[list[str], list[Any]]:
        keys: list[str] = []
        values: list[Any] = []
        for name in names:
            value = getattr(obj, name, _MISSING)  # an init=False field may never be set
            if value is not _MISSING:
                keys.append(name)
                values.append(value)
        return keys, values

    return split


def _dataclass_rebuild(tp: type) -> Rebuild:
    slots = slot_names(tp)
    cached = _cached_names(tp)

    def rebuild(obj: Any, keys: Any, old: Sequence[Any], new: list[Any]) -> Any:
        # Not the constructor: init=False fields, InitVars and __post_init__ side effects
        # would all get in the way. A shallow copy with the changed fields set works for
        # mutable, frozen and slots dataclasses alike (copy.copy fails on frozen slots
        # dataclasses before Python 3.11).
        clone: Any
        try:
            clone = object.__new__(tp)
        except TypeError:  # a dataclass that also subclasses a built-in type
            clone = copy.copy(obj)
        else:
            state = getattr(obj, "__dict__", None)
            if state is not None:
                clone.__dict__.update(state)
            for slot in slots:
                value = getattr(obj, slot, _MISSING)
                if value is not _MISSING:
                    object.__setattr__(clone, slot, value)
        for key, before, after in zip(keys, old, new, strict=True):
            if after is not before:
                object.__setattr__(clone, key, after)
        _drop_cached(clone, cached)
        return clone

    return rebuild


def _cached_names(tp: type) -> tuple[str, ...]:
    """The names under which ``functools.cached_property``s of ``tp`` keep their values."""
    names = _CACHED_NAMES.get(tp)
    if names is None:
        names = _CACHED_NAMES[tp] = _work_out_cached_names(tp)
    return names


_CACHED_NAMES: dict[type, tuple[str, ...]] = {}


def _work_out_cached_names(tp: type) -> tuple[str, ...]:
    return tuple(
        {
            value.attrname or name: None
            for klass in tp.__mro__
            for name, value in vars(klass).items()
            if isinstance(value, functools.cached_property)
        }
    )


def _forget_cached(clone: Any) -> None:
    """:func:`_drop_cached` for a copy of any container type (a ``dict`` subclass, say);
    nothing to do, and nothing asked of the type, where the copy has no ``__dict__``."""
    if getattr(clone, "__dict__", None):
        _drop_cached(clone, _cached_names(type(clone)))


def _drop_cached(clone: Any, cached: tuple[str, ...]) -> None:
    """Forget the values the copy's cached properties hold: they were worked out from the
    children before the move (a tensor on the old device, say), and are worked out again,
    from the moved children, when next read. Lightning's apply_to_collection does the same."""
    state = getattr(clone, "__dict__", None)
    if cached and state:
        for name in cached:
            state.pop(name, None)


def _two_views(tp: type) -> bool:
    """Whether a dataclass is also a mapping or a sequence: its tensors have two views."""
    return issubclass(tp, Mapping) or (issubclass(tp, Sequence) and not issubclass(tp, str))


def _dual_split(tp: type) -> Split:
    """Children of a dataclass that is also a mapping (``ModelOutput``) or a sequence.

    Entries first, in their order, then the fields no entry stands for. An entry and the
    field of its name that hold the same object are one child, keyed by the plain name
    (``out.logits``); any other entry is keyed by :class:`Entry` or its own key
    (``out['extra']``, ``row[0]``), so that each view of each object is walked once.
    """
    fields = tuple(f.name for f in dataclasses.fields(tp))
    field_names = frozenset(fields)
    mapping = issubclass(tp, Mapping)

    def split(obj: Any) -> tuple[list[Any], list[Any]]:
        keys: list[Any] = []
        values: list[Any] = []
        named: set[str] = set()
        for key, value in obj.items() if mapping else enumerate(obj):
            if type(key) is str:
                if key in field_names and getattr(obj, key, _MISSING) is value:
                    named.add(key)
                else:
                    key = Entry(key)
            keys.append(key)
            values.append(value)
        for name in fields:
            if name not in named:
                value = getattr(obj, name, _MISSING)  # an init=False field may never be set
                if value is not _MISSING:
                    keys.append(name)
                    values.append(value)
        return keys, values

    return split


def _dual_rebuild(tp: type) -> Rebuild:
    split = _dual_split(tp)
    names = tuple(f.name for f in dataclasses.fields(tp)) + slot_names(tp)
    cached = _cached_names(tp)
    mapping = issubclass(tp, Mapping)
    storage = next((k for k in tp.__mro__ if k in (dict, collections.OrderedDict, list)), None)

    def rebuild(obj: Any, keys: Any, old: Sequence[Any], new: list[Any]) -> Any:
        # Every view of the copy that showed an old child is made to show its new one,
        # whatever it is (a field, an entry, another attribute holding it): found by
        # identity. Then the copy is read again, and must give exactly the new children.
        changed = {id(a): b for a, b in zip(old, new, strict=True) if b is not a}
        try:
            clone = copy.copy(obj)
        except Exception as error:
            why = f"copy.copy() raised {type(error).__name__}: {error}"
            raise CannotRebuild(tp, why) from error
        fresh = clone is not obj and type(clone) is tp
        _drop_cached(clone, cached)
        if not fresh:
            raise CannotRebuild(tp, "copy.copy() does not make a new object of its type")
        if mapping:
            _keep_order(clone, list(obj.keys()), storage)
        for name in (*names, *getattr(clone, "__dict__", ())):
            after = changed.get(id(getattr(clone, name, _MISSING)), _MISSING)
            if after is not _MISSING:
                object.__setattr__(clone, name, after)
        entries = clone.items() if mapping else enumerate(clone)
        for key, value in list(entries):
            after = changed.get(id(value), _MISSING)
            if after is not _MISSING:
                _set_entry(clone, key, after, storage)
        again, now = split(clone)
        if [(type(k), k) for k in again] != [(type(k), k) for k in keys] or any(
            a is not b for a, b in zip(now, new, strict=True)
        ):
            raise CannotRebuild(tp, _disagreement(keys, new, again, now))
        return clone

    return rebuild


def _keep_order(clone: Any, order: list[Any], storage: type | None) -> None:
    """Give the copy's entries the original's ``order``, by its built-in storage's code.

    A type's copy may make the object anew and set its entries as its constructor does:
    a ``ModelOutput``'s sets its fields first, in field order, so an entry the caller set
    later (``out["loss"] = ...``) would come before those set earlier, and ``out[0]`` would
    give another tensor. Only the order is put back, and only in a ``dict`` or
    ``OrderedDict``: entries the copy lacks or adds, and an order only the type itself
    could change, are left for the check to find. The storage's own methods, as in
    :func:`_set_entry`: the type's may be refused (a ``ModelOutput``'s ``pop`` raises).
    """
    now = list(clone.keys())
    if now == order or set(now) != set(order):
        return
    if storage is collections.OrderedDict:
        for key in order:
            collections.OrderedDict.move_to_end(clone, key)
    elif storage is dict:
        for key in order:
            dict.__setitem__(clone, key, dict.pop(clone, key))


def _set_entry(clone: Any, key: Any, value: Any, storage: type | None) -> None:
    """``clone[key] = value``, by the type's own code, else its built-in storage's."""
    try:
        clone[key] = value
    except Exception as error:
        if storage is None:
            why = f"its entry {key!r} cannot be set: {type(error).__name__}: {error}"
            raise CannotRebuild(type(clone), why) from error
        storage.__setitem__(clone, key, value)  # type: ignore[index]


def _disagreement(
    keys: Sequence[Any], new: Sequence[Any], again: Sequence[Any], now: Sequence[Any]
) -> str:
    """Where a rebuilt two-view object does not show the moved children, in words."""
    expected = dict(zip(((type(k), k) for k in keys), new, strict=True))
    start = "a copy given the moved children"
    for key, value in zip(again, now, strict=True):
        found = expected.pop((type(key), key), _MISSING)
        if found is _MISSING:
            return f"{start} has something new at {join('', DUAL, key)}"
        if found is not value:
            return f"{start} shows another object at {join('', DUAL, key)}"
    if expected:
        return f"{start} has nothing at {join('', DUAL, next(iter(expected))[1])}"
    return f"{start} lists them in another order"


def slot_names(tp: type) -> tuple[str, ...]:
    """The attribute names of ``tp``'s ``__slots__``, through its MRO (mangled as stored)."""
    names: list[str] = []
    for klass in tp.__mro__:
        declared = klass.__dict__.get("__slots__", ())
        for name in (declared,) if isinstance(declared, str) else declared:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{klass.__name__.lstrip('_')}{name}"
            names.append(name)
    return tuple(names)


# The generic rebuilds below try the type's own protocol (a copy, then item assignment),
# then its constructor, and check the result; a type that takes neither raises
# CannotRebuild rather than come back half-moved or turned into another type.


def _rebuild_mapping(obj: Any, keys: Any, old: Sequence[Any], new: list[Any]) -> Any:
    failed: Exception | None = None
    if isinstance(obj, MutableMapping):
        try:
            clone = copy.copy(obj)
            if clone is not obj and type(clone) is type(obj):
                if getattr(obj, "__dict__", None) is obj:
                    # A dict that is its own __dict__ (an attribute dict): the copy gets a
                    # copy of it instead, whose attributes would keep the old children.
                    # Not by clone.__dict__ = ...: the type's __setattr__ may set entries.
                    object.__setattr__(clone, "__dict__", clone)
                _forget_cached(clone)
                for key, before, after in zip(keys, old, new, strict=True):
                    if after is not before:
                        clone[key] = after
                return clone
        except Exception as error:  # the constructor may still work; if not, both are told
            failed = error
    return _construct(obj, dict(zip(keys, new, strict=True)), len(new), "dict(new_items)", failed)


def _rebuild_sequence(obj: Any, keys: Any, old: Sequence[Any], new: list[Any]) -> Any:
    failed: Exception | None = None
    if isinstance(obj, MutableSequence):
        try:
            clone = copy.copy(obj)
            if clone is not obj and type(clone) is type(obj):
                _forget_cached(clone)
                for index, (before, after) in enumerate(zip(old, new, strict=True)):
                    if after is not before:
                        clone[index] = after
                return clone
        except Exception as error:  # the constructor may still work; if not, both are told
            failed = error
    return _construct(obj, new, len(new), "new_items", failed)


def _rebuild_set(obj: Any, keys: Any, old: Sequence[Any], new: list[Any]) -> Any:
    failed: Exception | None = None
    if isinstance(obj, MutableSet):
        try:
            clone = copy.copy(obj)
            if clone is not obj and type(clone) is type(obj):
                _forget_cached(clone)
                for before, after in zip(old, new, strict=True):
                    if after is not before:
                        clone.discard(before)
                        clone.add(after)
                return clone
        except Exception as error:  # the constructor may still work; if not, both are told
            failed = error
    return _construct(obj, new, len(new), "new_members", failed)


def _construct(
    obj: Any, contents: Any, size: int, argument: str, failed: Exception | None = None
) -> Any:
    """``type(obj)(contents)``, checked; ``failed``: why a copy could not be updated."""
    tp = type(obj)
    call = f"{tp.__qualname__}({argument})"
    if failed is not None:
        how = f"updating a copy of it raised {type(failed).__name__}: {failed}, and"
    elif isinstance(obj, (MutableMapping, MutableSequence, MutableSet)):
        how = "a copy of it cannot be updated, and"
    else:
        how = "it is immutable, and"
    try:
        made = tp(contents)
    except Exception as error:
        if failed is not None:  # chained through it, so the traceback shows both
            error.__context__ = failed
        raise CannotRebuild(tp, f"{how} {call} raised {type(error).__name__}: {error}") from error
    if type(made) is not tp or len(made) != size:
        got = f"a {type(made).__qualname__} of length {len(made)}, not {size}"
        raise CannotRebuild(tp, f"{how} {call} gave {got}")
    return made
