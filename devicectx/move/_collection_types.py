"""Collections other than the built-in ones and dataclasses: how each family is taken apart
and rebuilt.

- torch's ``PackedSequence`` (its tensors, not ``batch_sizes``, which stays on the CPU);
- ``ChainMap``, through its maps;
- namedtuples and structseqs (``torch.return_types``, ``time.struct_time``);
- torch_geometric's graphs and tensordict's lazy stacks, read through their stores and
  stacked tensordicts (objects with their own ``.to``): known by where they come from,
  so the optional packages are never imported;
- ``UserDict`` and ``UserList``: their entries, then the other attributes an instance was
  given;
- any other ``Mapping``, ``Sequence`` or ``Set``: the generic rebuilds, by the type's own
  protocol (a copy, then item assignment), else its constructor, checked.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import (
    Callable,
    Iterable,
    Mapping,
    MutableMapping,
    MutableSequence,
    MutableSet,
    Sequence,
)
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

from devicectx._errors import with_article
from devicectx.move._attributes import (
    MISSING_ATTRIBUTE,
    add_attributes,
    cached_names,
    forget_cached,
    slot_names,
)
from devicectx.move._kinds import (
    CONTAINER,
    OWN,
    CannotRebuild,
    Kind,
    Rebuild,
    Split,
    items_split,
    positional_split,
)
from devicectx.move._paths import ATTR, DUAL, ITEM, Entry


def is_graph(tp: type) -> bool:
    """torch_geometric's ``Data``, ``Batch`` (and the ``DataBatch`` types it makes),
    ``HeteroData``: known by where they come from, so the package is never imported."""
    return isinstance(getattr(tp, "stores", None), property) and any(
        klass.__module__.partition(".")[0] == "torch_geometric" for klass in tp.__mro__
    )


def graph_split(obj: Any) -> tuple[list[Any], list[Any]]:
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


def is_lazy_stack(tp: type) -> bool:
    """tensordict's ``LazyStackedTensorDict`` (and its subclasses): known by where it comes
    from, so the package is never imported."""
    return any(
        klass.__name__ == "LazyStackedTensorDict"
        and klass.__module__.partition(".")[0] == "tensordict"
        for klass in tp.__mro__
    )


def _stack_split(obj: Any) -> tuple[tuple[str], tuple[Any]]:
    # Its stacked tensordicts, not its items: items() stacks them, copying every tensor on
    # each read, and fails where their shapes differ (a ragged stack, the reason lazy
    # stacks exist). The list is walked as any list: paths read lazy.tensordicts[0]['a'].
    return ("tensordicts",), (obj.tensordicts,)


def _stack_rebuild(obj: Any, keys: object, old: object, new: list[Any]) -> Any:
    # A copy keeps what the stack holds beside its tensordicts (stack_dim, hooks, names);
    # its own tensordicts (fresh shallow copies) are then replaced by the moved ones.
    # Used by the dtype policy's cast, which walks into objects with their own .to.
    clone = copy.copy(obj)
    object.__setattr__(clone, "tensordicts", new[0])
    return clone


STACK_KIND = Kind(OWN, ATTR, _stack_split, _stack_rebuild)


_PACKED_FIELDS = ("data", "sorted_indices", "unsorted_indices")


def _packed_split(obj: PackedSequence) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    # batch_sizes is not a child: PyTorch requires it on the CPU, whatever the data's device.
    return _PACKED_FIELDS, (obj.data, obj.sorted_indices, obj.unsorted_indices)


def _packed_rebuild(obj: PackedSequence, keys: object, old: object, new: list[Any]) -> Any:
    data, sorted_indices, unsorted_indices = new
    return type(obj)(data, obj.batch_sizes, sorted_indices, unsorted_indices)


PACKED_KIND = Kind(CONTAINER, ATTR, _packed_split, _packed_rebuild)


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
        value = getattr(obj, slot, MISSING_ATTRIBUTE)
        if value is not MISSING_ATTRIBUTE:
            object.__setattr__(clone, slot, value)
    clone.maps = new[0]
    forget_cached(clone)
    return clone


CHAIN_KIND = Kind(CONTAINER, ATTR, _chain_split, _chain_rebuild)


def _attributes_split(obj: Any) -> tuple[list[str], list[Any]]:
    state = obj.__dict__
    return list(state), list(state.values())


def _attributes_rebuild(obj: Any, keys: list[str], old: object, new: list[Any]) -> Any:
    # A shallow copy, made without __init__ (which would check and recompute), given the
    # moved attributes: every other attribute (shapes, flags, a transform's cache size)
    # is kept as it was.
    clone = copy.copy(obj)
    clone.__dict__.update(zip(keys, new, strict=True))
    return clone


ATTRIBUTES_KIND = Kind(CONTAINER, ATTR, _attributes_split, _attributes_rebuild)
"""``torch.distributions`` objects and their transforms: their attributes are their state
(parameters, the values their lazy properties cached, a wrapped distribution), and they
have no ``.to``; moved, each is a copy of its own with its tensors on the target."""

_ATTRIBUTE_BASES = (torch.distributions.Distribution, torch.distributions.Transform)


def moves_attributes(tp: type) -> bool:
    """Whether ``tp`` is moved through its attributes (:data:`ATTRIBUTES_KIND`)."""
    return issubclass(tp, _ATTRIBUTE_BASES)


def tuple_kind(tp: type) -> Kind:
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
    return Kind(CONTAINER, ITEM, positional_split, rebuild_sequence)


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


_USER_DICT_READS = ("__iter__", "__getitem__", "__len__", "keys", "values", "items")


def entries_split(tp: type) -> Split:
    """A ``UserDict``'s items, each ``str`` key an :class:`Entry`: paths then write it
    ``ud['k']``, and a plain ``str`` key is an attribute, ``ud.k``. Read from its ``data``
    where the type reads its entries as ``UserDict`` does (faster than ``items()``, which
    looks each key up again, by ``__getitem__``), else by ``items()``."""
    own = collections.UserDict
    if all(getattr(tp, name) is getattr(own, name) for name in _USER_DICT_READS):

        def read(obj: Any) -> tuple[list[Any], list[Any]]:
            data = obj.data
            return [Entry(key) if type(key) is str else key for key in data], list(data.values())

        return read

    def read_items(obj: Any) -> tuple[list[Any], list[Any]]:
        keys, values = items_split(obj)
        return [Entry(key) if type(key) is str else key for key in keys], values

    return read_items


def mapping_items(tp: type) -> Split:
    """A mapping's items, as its ``items()`` gives them. For a ``UserDict`` whose
    ``items()`` is ``UserDict``'s (each key of ``data``, looked up again by
    ``__getitem__``), the same items read without ``items()``'s view, one Python call
    a key fewer: a transformers ``BatchEncoding``, which keeps ``UserDict``'s iteration
    and overrides only ``__getitem__``, is read at a dict's speed."""
    own = collections.UserDict
    if not issubclass(tp, own) or any(
        getattr(tp, name) is not getattr(own, name) for name in ("__iter__", "__len__", "items")
    ):
        return items_split
    if tp.__getitem__ is own.__getitem__:

        def read_data(obj: Any) -> tuple[list[Any], list[Any]]:
            data = obj.data
            return list(data), list(data.values())

        return read_data
    getitem = tp.__getitem__

    def read_each(obj: Any) -> tuple[list[Any], list[Any]]:
        keys = list(obj.data)
        return keys, [getitem(obj, key) for key in keys]

    return read_each


def user_kind(tp: type, entries: Split, rebuild_entries: Rebuild) -> Kind:
    """A ``UserDict`` or ``UserList`` (or a subclass): its entries, then the other
    attributes an instance was given (``self.scale = ...`` in its ``__init__``), which
    its copy carries over as they are. ``data``, where the entries live, is no child."""
    hidden = frozenset({"data", *cached_names(tp)})

    def split(obj: Any) -> tuple[Any, Sequence[Any]]:
        keys, values = entries(obj)
        state = obj.__dict__
        if len(state) > 1 or "data" not in state:
            names: list[Any] = []
            more: list[Any] = []
            add_attributes(state, hidden, names, more)
            if names:  # after the entries, keyed by name
                keys = [*(range(len(values)) if keys is None else keys), *names]
                values = [*values, *more]
        return keys, values

    def rebuild(obj: Any, keys: Any, old: Sequence[Any], new: list[Any]) -> Any:
        if keys is None:  # a list's entries only
            return rebuild_entries(obj, keys, old, new)
        # The entries' keys are Entry objects or positions, the attributes' plain strs.
        count = next((i for i, key in enumerate(keys) if type(key) is str), len(keys))
        entry_keys = [_unwrapped(key) for key in keys[:count]]
        clone = rebuild_entries(obj, entry_keys, old[:count], new[:count])
        state = clone.__dict__
        for name, before, after in zip(keys[count:], old[count:], new[count:], strict=True):
            if after is not before:
                state[name] = after
        return clone

    return Kind(CONTAINER, DUAL, split, rebuild)


def _unwrapped(key: Any) -> Any:
    """An :class:`Entry` key as the plain ``str`` the mapping holds; any other as it is."""
    return str(key) if type(key) is Entry else key


# The generic rebuilds below try the type's own protocol (a copy, then item assignment),
# then its constructor, and check the result; a type that takes neither raises
# CannotRebuild rather than come back half-moved or turned into another type.


def rebuild_mapping(obj: Any, keys: Any, old: Sequence[Any], new: list[Any]) -> Any:
    def own_attributes(clone: Any) -> None:
        if getattr(obj, "__dict__", None) is obj:
            # A dict that is its own __dict__ (an attribute dict): the copy gets a copy of
            # it instead, whose attributes would keep the old children. Not by
            # clone.__dict__ = ...: the type's __setattr__ may set entries.
            object.__setattr__(clone, "__dict__", clone)

    def update(clone: Any) -> None:
        for key, before, after in zip(keys, old, new, strict=True):
            if after is not before:
                clone[key] = after

    clone, failed = _updated_copy(obj, MutableMapping, update, own_attributes)
    if clone is not None:
        return clone
    moved = _moved_tensors(keys, old, new)
    contents = dict(zip(keys, new, strict=True))
    return _construct(obj, contents, len(new), "dict(new_items)", failed, moved)


def rebuild_sequence(obj: Any, keys: Any, old: Sequence[Any], new: list[Any]) -> Any:
    def update(clone: Any) -> None:
        for index, (before, after) in enumerate(zip(old, new, strict=True)):
            if after is not before:
                clone[index] = after

    clone, failed = _updated_copy(obj, MutableSequence, update)
    if clone is not None:
        return clone
    moved = _moved_tensors(range(len(new)), old, new)
    return _construct(obj, new, len(new), "new_items", failed, moved)


def rebuild_set(obj: Any, keys: Any, old: Sequence[Any], new: list[Any]) -> Any:
    def update(clone: Any) -> None:
        for before, after in zip(old, new, strict=True):
            if after is not before:
                clone.discard(before)
                clone.add(after)

    clone, failed = _updated_copy(obj, MutableSet, update)
    if clone is not None:
        return clone
    return _construct(obj, new, len(new), "new_members", failed)


def _updated_copy(
    obj: Any,
    mutable: type,
    update: Callable[[Any], None],
    prepare: Callable[[Any], None] | None = None,
) -> tuple[Any, Exception | None]:
    """A shallow copy of ``obj`` (``prepare`` applied to it, its cached properties
    forgotten), then ``update`` applied, where ``obj`` is an instance of ``mutable`` and
    its copy is a new object of its type: ``(copy, None)``; else ``(None, why)``, ``why``
    the exception that stopped it (None: no copy to update)."""
    if not isinstance(obj, mutable):
        return None, None
    try:
        clone = copy.copy(obj)
        if clone is obj or type(clone) is not type(obj):
            return None, None
        if prepare is not None:
            prepare(clone)
        forget_cached(clone)
        update(clone)
    except Exception as error:  # the constructor may still work; if not, both are told
        return None, error
    return clone, None


def _moved_tensors(
    keys: Iterable[Any], old: Sequence[Any], new: list[Any]
) -> list[tuple[Any, torch.Tensor]]:
    """The tensors a rebuilt container must hold at each key: those that moved."""
    return [
        (key, after)
        for key, before, after in zip(keys, old, new, strict=True)
        if after is not before and isinstance(after, torch.Tensor)
    ]


def _construct(
    obj: Any,
    contents: Any,
    size: int,
    argument: str,
    failed: Exception | None = None,
    moved: Sequence[tuple[Any, torch.Tensor]] = (),
) -> Any:
    """``type(obj)(contents)``, checked: of its type, its length, and holding each ``moved``
    tensor at its key (a constructor may take something else first, a lazy mapping its
    source: it would give an object that still reads its tensors where they were);
    ``failed``: why a copy could not be updated."""
    tp = type(obj)
    call = f"{tp.__qualname__}({argument})"
    if failed is not None:
        how = f"updating a copy of it raised {type(failed).__name__}: {failed}, and"
    elif isinstance(obj, (MutableMapping, MutableSequence, MutableSet)):
        how = "a copy of it cannot be updated, and"
    else:
        mutable = (
            "MutableMapping"
            if isinstance(obj, Mapping)
            else "MutableSet"
            if isinstance(obj, AbstractSet)
            else "MutableSequence"
        )
        how = f"a copy of it takes no item assignment (it is no {mutable}), and"
    try:
        made = tp(contents)
    except Exception as error:
        if failed is not None:  # chained through it, so the traceback shows both
            error.__context__ = failed
        raise CannotRebuild(tp, f"{how} {call} raised {type(error).__name__}: {error}") from error
    if type(made) is not tp or len(made) != size:
        got = f"a {type(made).__qualname__} of length {len(made)}, not {size}"
        raise CannotRebuild(tp, f"{how} {call} gave {got}")
    for key, tensor in moved:
        try:
            held = made[key]
        except Exception as error:
            got = f"one whose [{key!r}] raised {type(error).__name__}: {error}"
            raise CannotRebuild(tp, f"{how} {call} gave {got}") from error
        if held is not tensor and not (
            isinstance(held, torch.Tensor) and held.device == tensor.device
        ):
            where = f" on {held.device}" if isinstance(held, torch.Tensor) else ""
            got = (
                f"one whose [{key!r}] is {with_article(type(held).__qualname__)}{where}, not "
                f"the tensor moved to {tensor.device}: {tp.__qualname__}(...) does not take "
                f"its items first"
            )
            raise CannotRebuild(tp, f"{how} {call} gave {got}")
    return made
