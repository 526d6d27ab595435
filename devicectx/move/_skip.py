"""``skip=``: what :func:`~devicectx.to_device` leaves where it is.

A spec is one item or a list/tuple/set of them, each one of:

- a type (or a tuple of types): objects of it, and everything inside them;
- a path as :func:`~devicectx.find_devices` writes it, rooted at ``obj``: ``"obj['meta']"``;
- a key: any other string, int or hashable: the child at that mapping key, sequence index,
  field or attribute name, at any depth (``"labels"`` skips ``obj['labels']`` and
  ``obj.labels``);
- a predicate ``(path, value) -> bool``, asked about every object from the root down.

Specs are compiled once into a :class:`Skip`. :func:`unmatched` finds the keys and paths
that name nothing in a structure (a path under another root, a typo), for
:func:`~devicectx.to_device`'s warning. The engine walks fastest when a skip holds
only types that no list, tuple, dict or plain tensor is an instance of (``nn.Module``,
say); keys, paths, predicates, and types such as ``torch.Tensor`` need per-child checks.
A predicate that raises is reported as its own error (:class:`PredicateFailed`), with the
signature it must have, never as an object that failed to move.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import re
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, TypeAlias

import torch

from devicectx._errors import with_article
from devicectx.move._containers import kind_for
from devicectx.move._kinds import CONTAINER, OWN
from devicectx.move._paths import MEMBER, is_path, join

Predicate: TypeAlias = Callable[[str, Any], bool]

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


# A value at run time (not a string) for annotations that are evaluated: typing.get_type_hints,
# a user's `DeviceLike | None` without `from __future__ import annotations`.
SkipLike: TypeAlias = (
    type | tuple[type, ...] | str | Hashable | Predicate | Skip | list[Any] | set[Any] | None
)
"""What ``skip=`` accepts."""


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


# Bounds of the look for keys and paths a skip names: a checkpoint can hold many
# containers, and the look runs after every to_device with keys or paths in skip=.
_MAX_CONTAINERS = 10_000
_OTHER_ROOT = re.compile(r"^(list\()?([A-Za-z_][A-Za-z_0-9]*)[\[.]")


class InsideOwnTo(NamedTuple):
    """A ``skip=`` entry met inside an object moved by its own ``.to``."""

    entry: Any  # as given: a key or a path
    path: str  # what it names
    key: Any  # that child's key in its holder
    owner: str  # the path of the object with its own .to
    owner_type: type


class NameCheck(NamedTuple):
    """What :func:`check_names` found of the keys and paths a skip names."""

    missing: list[tuple[Any, Any]]  # naming nothing: (entry, what it likely meant or None)
    inside: list[InsideOwnTo]  # met only where skip= does not reach


def check_names(skip: Skip, obj: object, root: str) -> NameCheck:
    """The keys and paths of ``skip`` that name nothing in ``obj`` (whose paths start at
    ``root``), each with a replacement that does where one is near; and those met inside an
    object moved by its own ``.to`` (a ``BatchEncoding``), which moves what it holds whole:
    ``skip=`` does not reach in.

    One walk into containers (and objects with their own ``.to`` whose children a rule
    reads), as the moving walk does. Bounded: past a few thousand containers, what was not
    met counts as met. A second walk, for suggestions, only when an entry names nothing.
    """
    if not (skip.keys or skip.paths):
        return NameCheck([], [])
    names = _Names(set(skip.keys), set(skip.paths))
    _walk_names(obj, root, names, None)
    missing = [e for e in (*skip.keys, *skip.paths) if e in names.keys or e in names.paths]
    if not missing:
        return NameCheck([], names.inside)
    every: tuple[set[Any], list[str]] = (set(), [])  # every key and path, to suggest from
    _walk_names(obj, root, _Names(set(), set()), every)
    return NameCheck([(entry, _near(entry, root, *every)) for entry in missing], names.inside)


class _Names:
    """The walk's state: the entries not met yet, and those met inside an own ``.to``."""

    __slots__ = ("inside", "keys", "paths", "unreported")

    def __init__(self, keys: set[Any], paths: set[str]) -> None:
        self.keys = keys
        self.paths = paths
        self.unreported: tuple[set[Any], set[str]] = (set(keys), set(paths))
        self.inside: list[InsideOwnTo] = []

    def meet(self, key: Any, keyed: bool, path: str, owner: tuple[str, type] | None) -> None:
        """Take a child's ``key`` (where it has one: a set's members have none) and
        ``path`` out of what is still to meet; inside an owner, report each entry the first
        time it is met there."""
        for entry, names in ((key, self.keys), (path, self.paths)):
            if names is self.keys and not keyed:
                continue
            with contextlib.suppress(TypeError):  # an unhashable key: none can name it
                names.discard(entry)
                if owner is not None and any(entry in left for left in self.unreported):
                    for left in self.unreported:
                        left.discard(entry)
                    self.inside.append(InsideOwnTo(entry, path, key, *owner))

    def done(self) -> bool:
        """Whether every entry was met, and each was also met inside an own ``.to``."""
        return not (self.keys or self.paths or any(self.unreported))


def _walk_names(
    obj: object, root: str, names: _Names, every: tuple[set[Any], list[str]] | None
) -> None:
    """Meet the keys and paths of ``obj``'s children (see :class:`_Names`); with ``every``,
    walk it all and gather each key and path met there."""
    stack: list[tuple[Any, str, tuple[str, type] | None]] = [(obj, root, None)]
    seen: set[int] = set()
    while stack and (every is not None or not names.done()):
        item, path, owner = stack.pop()
        kind = kind_for(type(item))
        if kind.split is None or kind.role not in (CONTAINER, OWN) or id(item) in seen:
            continue
        seen.add(id(item))
        if len(seen) > _MAX_CONTAINERS:
            names.keys.clear()
            names.paths.clear()
            return
        if kind.role == OWN and owner is None:
            owner = (path, type(item))
        named, children = kind.split(item)
        style = kind.style
        for index, child in enumerate(children):
            key = index if named is None else named[index]
            child_path = join(path, style, key)
            names.meet(key, style != MEMBER, child_path, owner)
            if every is not None:
                if style != MEMBER:
                    with contextlib.suppress(TypeError):  # unhashable
                        every[0].add(key)
                every[1].append(child_path)
            stack.append((child, child_path, owner))


def _near(entry: Any, root: str, keys: set[Any], paths: list[str]) -> Any:
    """What ``entry`` (a key or path that names nothing) most likely meant: the same path
    under ``root``, else the nearest key or path in the structure, else the keys of which
    it is a word (a tuple where several are); None if nothing is near."""
    if not isinstance(entry, str):
        return None
    other = _OTHER_ROOT.match(entry)
    if other is not None and other.group(2) != root:
        start = other.start(2)
        rooted = entry[:start] + root + entry[other.end(2) :]
        if rooted in paths:
            return rooted
        entry = rooted
    texts = [k for k in keys if isinstance(k, str)] + paths
    same = [text for text in paths if _bare(text) == _bare(entry)]  # obj.rng for obj['rng']
    if same:
        return same[0]
    close = difflib.get_close_matches(entry, texts, n=1, cutoff=0.6)
    if close:
        return close[0]
    # Keys of which the entry is a word ("rng" for "rng_state", "step" for "global_step"):
    # too short beside them for the ratio above. Every one (two RNG states, the CPU's and a
    # GPU's, are both to be kept), shortest first, in an order that is the same every run.
    words = [k for k in keys if isinstance(k, str) and entry in re.split(r"[^A-Za-z0-9]+", k)]
    words.sort(key=lambda k: (len(k), k))
    return words[0] if len(words) == 1 else (tuple(words) or None)


def _bare(path: str) -> str:
    """A path without its punctuation: ``obj rng`` for ``obj['rng']`` and ``obj.rng``."""
    return " ".join(re.findall(r"[A-Za-z_0-9]+", path))


def inside_own_to_message(found: list[InsideOwnTo], target: torch.device, who: str) -> str:
    """The warning for ``skip=`` entries inside objects moved by their own ``.to`` (from
    :func:`inside_own_to`)."""
    first = found[0]
    more = f" (and {', '.join(repr(f.entry) for f in found[1:])})" if len(found) > 1 else ""
    kind = with_article(first.owner_type.__qualname__)
    return (
        f"{who} skip={first.entry!r}{more} names {first.path}, inside {first.owner}, {kind}, "
        f"whose own .to() moves what it holds: skip= does not reach inside it, and "
        f"{first.path} was moved to {target}\n"
        f"fix: move dict({first.owner}) in its place, a plain dict, which skip= reaches "
        f"into; or take {first.key!r} out of {first.owner} before the move"
    )


def _either(near: Any) -> str:
    """``'a'``, or ``'a' or 'b'`` where several keys were near."""
    return " or ".join(map(repr, near)) if type(near) is tuple else repr(near)


def unmatched_message(spec: SkipLike, missing: list[tuple[Any, Any]], root: str, who: str) -> str:
    """The warning for ``skip=`` entries that name nothing (from :func:`unmatched`): which,
    how paths are written, and ``skip=`` with each replaced by what it likely meant."""
    shown = ", ".join(
        repr(entry) if near is None else f"{entry!r} (did you mean {_either(near)}?)"
        for entry, near in missing
    )
    items = list(spec) if isinstance(spec, (list, tuple, set, frozenset)) else [spec]
    replaced = dict(missing)  # every item of a compiled spec is hashable
    kept = []
    for item in items:
        near = replaced.get(item, item)
        kept += list(near) if type(near) is tuple else [] if near is None else [near]
    fix = (
        f"skip={kept!r}"
        if kept
        else f"name what to leave as find_devices({root}) writes its path (\"{root}['x']\") "
        "or by its key ('x')"
    )
    return (
        f"{who}: skip= entries name nothing in {root}, and left nothing in place: {shown}\n"
        f"paths in skip= start at {root} ({root}['x'], {root}.x), as find_devices({root}) "
        "writes them; a key or attribute name matches at any depth\n"
        f"fix: {fix}"
    )
