"""``skip=``: what :func:`~devicectx.to_device` leaves where it is.

A spec is one item or a list/tuple/set of them, each one of:

- a type (or a tuple of types): objects of it, and everything inside them;
- a path as :func:`~devicectx.find_devices` writes it, rooted at ``obj``: ``"obj['meta']"``;
- a key: any other string, int or hashable: the child at that mapping key, sequence index,
  field or attribute name, at any depth (``"labels"`` skips ``obj['labels']`` and
  ``obj.labels``);
- a predicate ``(path, value) -> bool``, asked about every object from the root down.

Specs are compiled once into a :class:`Skip`. The engine walks fastest when a skip holds
only types that no list, tuple, dict or plain tensor is an instance of (``nn.Module``,
say); keys, paths, predicates, and types such as ``torch.Tensor`` need per-child checks.
A predicate that raises is reported as its own error (:class:`PredicateFailed`), with the
signature it must have, never as an object that failed to move.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from typing import Any, TypeAlias

import torch

from devicectx.move._paths import is_path

Predicate: TypeAlias = "Callable[[str, Any], bool]"
SkipLike: TypeAlias = (
    "type | tuple[type, ...] | str | Hashable | Predicate | Skip | list[Any] | set[Any] | None"
)
"""What ``skip=`` accepts."""

_FAST_TYPES = (torch.Tensor, list, tuple, dict)
_TYPE_CACHE: dict[object, Skip] = {}


class Skip:
    """A compiled ``skip=`` spec.

    Attributes:
        types: instances of these are left alone.
        keys: children at these keys (mapping keys, indices, names) are left alone.
        paths: objects at these paths are left alone.
        predicates: objects for which one of these says True are left alone.
        slow: whether every child must be checked (else only objects of types
            other than tensor, list, tuple and dict are checked, against ``types``).
        needs_paths: whether the walk must build each object's path.
    """

    __slots__ = ("keys", "needs_paths", "paths", "predicates", "slow", "types")

    def __init__(
        self,
        types: tuple[type, ...] = (),
        keys: frozenset[Any] = frozenset(),
        paths: frozenset[str] = frozenset(),
        predicates: tuple[Predicate, ...] = (),
    ) -> None:
        self.types = types
        self.keys = keys
        self.paths = paths
        self.predicates = predicates
        self.needs_paths = bool(paths or predicates)
        touches_fast = any(issubclass(fast, t) for fast in _FAST_TYPES for t in types)
        self.slow = bool(keys or self.needs_paths or touches_fast)

    def skips(self, path: str, value: object) -> bool:
        """Whether the object ``value`` at ``path`` stays where it is (keys aside).

        Raises:
            PredicateFailed: a predicate raised (or returned something with no truth
                value, such as a tensor of several elements).
        """
        if self.types and isinstance(value, self.types):
            return True
        if path in self.paths:
            return True
        for predicate in self.predicates:
            try:
                if predicate(path, value):
                    return True
            except Exception as error:
                raise PredicateFailed(predicate, path, error) from error
        return False


class PredicateFailed(Exception):
    """A ``skip=`` predicate raised; the engine reports it with :meth:`message`."""

    def __init__(self, predicate: Predicate, path: str, error: Exception) -> None:
        super().__init__(path, error)
        self.predicate = predicate
        self.path = path
        self.error = error

    def message(self, who: str) -> str:
        """What failed, where, the signature a predicate must have, and the fix."""
        shown, where = _describe(self.predicate)
        name = getattr(self.predicate, "__name__", "")
        detail = f"{type(self.error).__name__}: {self.error}".replace("\n", "\n    ")
        if _takes_path_and_value(self.predicate):
            fix = f"make {shown} return True or False for every (path, value) it is given"
        elif name.isidentifier():
            fix = f"def {name}(path: str, value: object) -> bool: ..."
        else:
            fix = "skip=lambda path, value: ..."
        return (
            f"{who}: the skip predicate {shown}{where} raised on {self.path}:\n"
            f"    {detail}\n"
            f"skip predicates are called as predicate(path, value) -> bool, for every object "
            f"from the root down\n"
            f"fix: {fix}"
        )


def _takes_path_and_value(predicate: Predicate) -> bool:
    """Whether ``predicate(path, value)`` binds to the predicate's signature."""
    try:
        inspect.signature(predicate).bind("obj", None)
    except (TypeError, ValueError):  # no such signature, or none can be read
        return False
    return True


def _describe(predicate: Predicate) -> tuple[str, str]:
    """A predicate's name, and where it was defined (`` (file.py:12)``, or empty)."""
    name = getattr(predicate, "__qualname__", None) or type(predicate).__qualname__
    code = getattr(predicate, "__code__", None)
    if code is None:
        return name, ""
    file = code.co_filename.replace("\\", "/").rsplit("/", 1)[-1]
    return name, f" ({file}:{code.co_firstlineno})"


def compile_skip(spec: SkipLike, root: str = "obj") -> Skip | None:
    """Compile a ``skip=`` spec; ``None`` when it skips nothing.

    Raises:
        TypeError: an item is none of the accepted forms (an unhashable key, say).
    """
    if spec is None or isinstance(spec, Skip):
        return spec
    cacheable = isinstance(spec, type) or (
        isinstance(spec, tuple) and all(isinstance(item, type) for item in spec)
    )
    if cacheable:
        cached = _TYPE_CACHE.get(spec)
        if cached is None:
            cached = _compile(spec, root)
            _TYPE_CACHE[spec] = cached
        return cached
    return _compile(spec, root)


def _compile(spec: Any, root: str) -> Skip:
    items = list(spec) if isinstance(spec, (list, tuple, set, frozenset)) else [spec]
    types: list[type] = []
    keys: set[Any] = set()
    paths: set[str] = set()
    predicates: list[Predicate] = []
    for item in items:
        if isinstance(item, type):
            types.append(item)
        elif isinstance(item, str):
            (paths if is_path(item, root) else keys).add(item)
        elif callable(item):
            predicates.append(item)
        elif isinstance(item, Hashable):
            keys.add(item)
        else:
            msg = (
                f"skip={spec!r}: {item!r} is not a type, a path, a key or a predicate\n"
                f"fix: skip=[torch.nn.Module, \"{root}['meta']\", 'labels', "
                f"lambda path, value: ...]"
            )
            raise TypeError(msg)
    return Skip(tuple(types), frozenset(keys), frozenset(paths), tuple(predicates))
