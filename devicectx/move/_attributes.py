"""An instance's attributes, as the rebuilds copy them: ``__slots__``, ``__dict__`` entries
beyond the ones a kind takes as children, and ``functools.cached_property`` values.

Shared by the dataclass, namespace and collection rebuilds
(:mod:`devicectx.move._dataclasses`, :mod:`devicectx.move._collection_types`) and by the
look for tensors a move cannot see (:mod:`devicectx.move._unseen`).
"""

from __future__ import annotations

import functools
from typing import Any

MISSING_ATTRIBUTE = object()


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


def add_attributes(
    state: dict[Any, Any], hidden: frozenset[str], keys: list[Any], values: list[Any]
) -> None:
    """The attributes in ``state`` (an instance's ``__dict__``) not in ``hidden``, added to
    a split's ``keys`` and ``values``; a key that is no ``str`` is no attribute name."""
    for name, value in state.items():
        if type(name) is str and name not in hidden:
            keys.append(name)
            values.append(value)


def cached_names(tp: type) -> tuple[str, ...]:
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


def forget_cached(clone: Any) -> None:
    """:func:`drop_cached` for a copy of any container type (a ``dict`` subclass, say);
    nothing to do, and nothing asked of the type, where the copy has no ``__dict__``."""
    if getattr(clone, "__dict__", None):
        drop_cached(clone, cached_names(type(clone)))


def drop_cached(clone: Any, cached: tuple[str, ...]) -> None:
    """Forget the values the copy's cached properties hold: they were worked out from the
    children before the move (a tensor on the old device, say), and are worked out again,
    from the moved children, when next read. Lightning's apply_to_collection does the same."""
    state = getattr(clone, "__dict__", None)
    if cached and state:
        for name in cached:
            state.pop(name, None)
