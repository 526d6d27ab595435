"""Dataclasses and ``SimpleNamespace``: taken apart into their fields or attributes, and
rebuilt as a shallow copy with the moved ones set.

A dataclass's children are its fields, then the other attributes an instance was given
(in ``__post_init__``, say). A dataclass that is also a mapping or a sequence (transformers'
``ModelOutput``) has two views of its tensors, fields and entries: its children are both,
each object once, and its rebuild checks that every view shows the moved children, or
raises :class:`~devicectx.move._kinds.CannotRebuild`. ``functools.cached_property`` values
are no children: a copy forgets them.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from devicectx.move._attributes import (
    MISSING_ATTRIBUTE,
    add_attributes,
    cached_names,
    drop_cached,
    slot_names,
)
from devicectx.move._kinds import CONTAINER, CannotRebuild, Kind, Rebuild, Split
from devicectx.move._paths import ATTR, DUAL, Entry, join


def dataclass_split(tp: type, attributes: bool = False) -> Split:
    """The fields of a dataclass, in order; with ``attributes``, then the other attributes
    of the instance (set in ``__post_init__``, say), in the order they were set: the
    rebuild copies them as they are, so a tensor among them would stay where it was.

    ``functools.cached_property`` values are no children: the rebuild drops them
    (:func:`drop_cached`). Where reading a field from an instance's ``__dict__`` gives
    what ``getattr`` gives (:func:`_read_from_dict`), the fields are read from it, which is
    faster than a ``getattr`` each; at once where it holds the fields, in field order, and
    nothing else, as the dataclass's ``__init__`` leaves it (the common case: a batch's
    type is read on every decorated call).
    """
    names = tuple(f.name for f in dataclasses.fields(tp))

    def fields(obj: Any) -> tuple[list[str], list[Any]]:
        # Twin of the loop in read below: test_dataclass_split_reads_what_getattr_reads
        # holds them equal.
        keys: list[str] = []
        values: list[Any] = []
        for name in names:
            value = getattr(obj, name, MISSING_ATTRIBUTE)  # an init=False field may never be set
            if value is not MISSING_ATTRIBUTE:
                keys.append(name)
                values.append(value)
        return keys, values

    if not attributes or tp.__dictoffset__ == 0:  # or its instances have no __dict__
        return fields
    hidden = frozenset(names).union(cached_names(tp))

    def scan(obj: Any) -> tuple[list[str], list[Any]]:
        keys, values = fields(obj)
        add_attributes(obj.__dict__, hidden, keys, values)
        return keys, values

    if slot_names(tp) or not _read_from_dict(tp, names):
        return scan
    count = len(names)

    def read(obj: Any) -> tuple[Sequence[str], list[Any]]:
        state = obj.__dict__
        if len(state) == count and tuple(state) == names:
            return names, list(state.values())
        keys: list[str] = []
        values: list[Any] = []
        get = state.get
        elsewhere = 0  # fields read from the class body: the rest are in the __dict__
        for name in names:
            value = get(name, MISSING_ATTRIBUTE)
            if value is MISSING_ATTRIBUTE:  # a default in the class body, or never set
                value = getattr(obj, name, MISSING_ATTRIBUTE)
                if value is MISSING_ATTRIBUTE:
                    continue
                elsewhere += 1
            keys.append(name)
            values.append(value)
        if len(state) > len(keys) - elsewhere:  # an entry that is no field
            add_attributes(state, hidden, keys, values)
        return keys, values

    return read


def _read_from_dict(tp: type, names: Iterable[str]) -> bool:
    """Whether ``getattr(obj, name)``, for each of ``names`` that an instance's ``__dict__``
    holds, gives what the ``__dict__`` holds: ``object``'s own attribute lookup, and no data
    descriptor (a property, say) of any of those names on the class, which would come first."""
    if any("__getattribute__" in vars(klass) for klass in tp.__mro__[:-1]):
        return False
    for name in names:
        for klass in tp.__mro__:
            if name in vars(klass):
                found = type(vars(klass)[name])
                if hasattr(found, "__set__") or hasattr(found, "__delete__"):
                    return False
                break
    return True


def dataclass_rebuild(tp: type) -> Rebuild:
    slots = slot_names(tp)
    cached = cached_names(tp)

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
                value = getattr(obj, slot, MISSING_ATTRIBUTE)
                if value is not MISSING_ATTRIBUTE:
                    object.__setattr__(clone, slot, value)
        for key, before, after in zip(keys, old, new, strict=True):
            if after is not before:
                object.__setattr__(clone, key, after)
        drop_cached(clone, cached)
        return clone

    return rebuild


def namespace_kind(tp: type) -> Kind:
    """A ``SimpleNamespace`` (or a subclass): its attributes, in order, as children."""
    hidden = frozenset(cached_names(tp))
    slots = slot_names(tp)

    def split(obj: Any) -> tuple[list[Any], list[Any]]:
        state = obj.__dict__
        if not hidden:
            return list(state), list(state.values())
        keys: list[Any] = []
        values: list[Any] = []
        add_attributes(state, hidden, keys, values)
        return keys, values

    def rebuild(obj: Any, keys: Any, old: Sequence[Any], new: list[Any]) -> Any:
        # A new namespace, made without calling __init__ (a subclass's may take other
        # arguments), given the original's attributes with the moved ones in place.
        clone: Any = types.SimpleNamespace.__new__(tp)
        state = clone.__dict__
        state.update(obj.__dict__)
        state.update(zip(keys, new, strict=True))
        for slot in slots:
            value = getattr(obj, slot, MISSING_ATTRIBUTE)
            if value is not MISSING_ATTRIBUTE:
                object.__setattr__(clone, slot, value)
        drop_cached(clone, tuple(hidden))
        return clone

    return Kind(CONTAINER, ATTR, split, rebuild)


def two_views(tp: type) -> bool:
    """Whether a dataclass is also a mapping or a sequence: its tensors have two views."""
    return issubclass(tp, Mapping) or (issubclass(tp, Sequence) and not issubclass(tp, str))


def dual_split(tp: type) -> Split:
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
                if key in field_names and getattr(obj, key, MISSING_ATTRIBUTE) is value:
                    named.add(key)
                else:
                    key = Entry(key)
            keys.append(key)
            values.append(value)
        for name in fields:
            if name not in named:
                # An init=False field may never be set.
                value = getattr(obj, name, MISSING_ATTRIBUTE)
                if value is not MISSING_ATTRIBUTE:
                    keys.append(name)
                    values.append(value)
        return keys, values

    return split


def dual_rebuild(tp: type) -> Rebuild:
    split = dual_split(tp)
    names = tuple(f.name for f in dataclasses.fields(tp)) + slot_names(tp)
    cached = cached_names(tp)
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
        drop_cached(clone, cached)
        if not fresh:
            raise CannotRebuild(tp, "copy.copy() does not make a new object of its type")
        if mapping:
            _keep_order(clone, list(obj.keys()), storage)
        for name in (*names, *getattr(clone, "__dict__", ())):
            after = changed.get(id(getattr(clone, name, MISSING_ATTRIBUTE)), MISSING_ATTRIBUTE)
            if after is not MISSING_ATTRIBUTE:
                object.__setattr__(clone, name, after)
        entries = clone.items() if mapping else enumerate(clone)
        for key, value in list(entries):
            after = changed.get(id(value), MISSING_ATTRIBUTE)
            if after is not MISSING_ATTRIBUTE:
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
        found = expected.pop((type(key), key), MISSING_ATTRIBUTE)
        if found is MISSING_ATTRIBUTE:
            return f"{start} has something new at {join('', DUAL, key)}"
        if found is not value:
            return f"{start} shows another object at {join('', DUAL, key)}"
    if expected:
        return f"{start} has nothing at {join('', DUAL, next(iter(expected))[1])}"
    return f"{start} lists them in another order"
