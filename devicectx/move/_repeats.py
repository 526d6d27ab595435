"""The repeated-move warning: a tensor that never changes, copied to the device again by
the same place.

Each place keeps the sources of its last checked move (by weak reference, with their
version counters); a source moved again by the same place, the same object with the same
version, is a tensor that never changes but crosses to the device on every call.
:class:`~devicectx.RepeatedMoveWarning` says so, once per place and path, in one warning
per move however many tensors it names. A place's first 9 moves are all checked, then two
in a row in every 8 (see ``_EVERY``): a few batches cycled, each moved every few steps, are
no constant. Parameters are left out: a weak reference would make them refuse
``torch.utils.swap_tensors``, which torch uses to move and load them in place. So is memory
torch does not own (a numpy array's, written in place without the version counter's
knowledge).

A *place* is a decorated function (a :class:`Place`, printed ``"train.step()"``, or
``"train.step() -> result"`` for the move of its result), the line that made a prefetcher,
or the line that called :func:`~devicectx.to_device` (``"train.py:42"``).
:mod:`devicectx.move._transfers` calls :func:`repeated` and :func:`warn` after a move.
"""

from __future__ import annotations

import contextlib
import itertools
import linecache
import os
import re
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator
from types import FunctionType, ModuleType
from typing import Any, NamedTuple

import torch

from devicectx._errors import RepeatedMoveWarning, check_switches, warn_at, warn_explicit_at
from devicectx._torch.tensors import version_of
from devicectx.move._nbytes import bytes_of

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter

__all__ = [
    "NOT_CALLERS",
    "Line",
    "Place",
    "Where",
    "caller_line",
    "caller_place",
    "checking",
    "forget",
    "label",
    "repeated",
    "set_repeated_move_warning",
    "size_text",
    "warn",
]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # not move/
# Frames a move's caller is not in: devicectx's, and torch's own between the user's line and
# a decorated call (nn.Module's __call__ for a decorated forward; dynamo's frame for a call
# run eagerly behind a graph break).
NOT_CALLERS = (_PACKAGE, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


class Place:
    """A place that moves, other than the line that called ``to_device``: a decorated
    function, or the line that made a prefetcher.

    One place per object, whatever its ``label`` (how it prints): two functions named
    ``loss_fn()`` in two modules are two places, and the same tensor moved by both is no
    repeat. ``defaults``: ``id(tensor) -> parameter`` for the tensors in the function's
    defaults, which a call that leaves them out moves (the fix is then to the default).
    ``origin``: the file, line and module globals its warnings are given at, where the
    moves run on another thread than the caller's (a prefetcher's); None: the caller's
    line at the move. ``home``: where they are given where the move has no caller of the
    user's (a decorated function run again by autograd's backward, under activation
    checkpointing): where the function is defined (its first decorator's line).

    A place keeps what the check remembers of it (``last``, ``warned``), so that it goes
    with its decorated function or prefetcher: a notebook that makes a prefetcher each
    epoch, or defines a function again in each run of a cell, keeps nothing of the old.
    """

    __slots__ = ("__weakref__", "defaults", "home", "label", "last", "origin", "warned")

    def __init__(
        self,
        label: str,
        defaults: dict[int, str] | None = None,
        origin: tuple[str, int, dict[str, Any]] | None = None,
        home: tuple[str, int, dict[str, Any]] | None = None,
    ) -> None:
        self.label = label
        self.defaults = defaults or {}  # id(tensor) -> the parameter it is the default of
        self.origin = origin
        self.home = home
        # Per target: [how many moves it made, what its last checked move copied, by id].
        self.last: dict[torch.device, list[Any]] = {}
        self.warned: set[tuple[torch.device, str]] = set()  # (target, path) reported

    def __str__(self) -> str:
        return self.label

    def __repr__(self) -> str:
        return f"Place({self.label!r})"


Line = tuple[str, int]
"""The line that called :func:`~devicectx.to_device` as a place: ``(file name, line)``,
written out (``"train.py:42"``, :func:`label`) only where a warning or a log needs it."""
Where = Place | Line


def label(where: Where) -> str:
    """How a place prints: ``"train.step()"``, ``"train.py:42"``."""
    if isinstance(where, Place):
        return where.label
    filename, line = where
    return "?" if not filename else f"{_short(filename)}:{line}"


def caller_place() -> Place:
    """The caller's line (outside devicectx) as a place whose warnings are given there."""
    frame = _user_frame()
    if frame is None:
        return Place("?")
    filename, line = frame.f_code.co_filename, frame.f_lineno
    return Place(f"{_short(filename)}:{line}", origin=(filename, line, frame.f_globals))


_CHECK = [True]  # one cell, read on every move that copied something
# The check costs a weak reference and a version counter read per tensor copied
# (docs/performance.md). So it looks at the first 256 copies of a move (in the order of
# the structure), and, past a place's first 9 moves, at two moves in a row in every 8, the
# second compared with the first: a tensor copied on every step is still reported within
# 8 steps, at a quarter of the cost.
_CHECKED = 256
_EVERY_FROM = 8
_EVERY = 8
_Seen = tuple["weakref.ref[torch.Tensor]", int, bool]  # the tensor, its version, reported
# The caller lines' state, as a Place keeps its own: per (line, target), [how many moves
# it made, what its last checked move copied, by id]; and the (line, target, path)
# reported. At most _LINES lines, the oldest dropped first: a notebook's cells are new
# files at each run.
_LAST: dict[tuple[Line, torch.device], list[Any]] = {}
_WARNED: set[tuple[Line, torch.device, str]] = set()
_LINES = 512
_NONE: list[torch.Tensor] = []  # no repeats (never appended to)
_WARNED_LOCK = threading.Lock()
_REMEMBERING: weakref.WeakSet[Place] = weakref.WeakSet()  # Places with a state to clear


def set_repeated_move_warning(enabled: bool) -> bool:
    """Turn the repeated-move check (and its :class:`~devicectx.RepeatedMoveWarning`) on or off.

    Example:
        >>> from devicectx import set_repeated_move_warning
        >>> previous = set_repeated_move_warning(False)
        >>> _ = set_repeated_move_warning(previous)

    Off, moves skip the check altogether; a warnings filter
    (``warnings.filterwarnings("ignore", category=devicectx.RepeatedMoveWarning)``) only
    silences it. Returns the previous setting.
    """
    check_switches("set_repeated_move_warning", enabled=enabled)
    previous = _CHECK[0]
    _CHECK[0] = enabled
    if not enabled:
        _LAST.clear()
        for place in list(_REMEMBERING):
            place.last.clear()
    return previous


def checking() -> bool:
    """Whether the check is on (:func:`set_repeated_move_warning`)."""
    return _CHECK[0]


def repeated(where: Where, target: torch.device, sent: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of ``sent`` that this place moved, unchanged, at its move just before,
    and not yet reported; and remember ``sent`` for the next check (weakly: the batch of a
    past step is not kept alive).

    Past the first moves, a place's moves are looked at in pairs of two in a row, one pair
    in ``_EVERY``: the first of a pair is remembered, the second compared with it. A
    tensor moved again by the very next move crosses on every call; one that comes back
    every few moves (a list of a few batches, cycled) is no such constant."""
    table: dict[Any, list[Any]]
    key: Any
    if isinstance(where, Place):
        table, key = where.last, target
    else:
        table, key = _LAST, (where, target)
    state = table.get(key)
    count, get, compare = 0, None, True
    if state is not None:
        count = state[0] = state[0] + 1  # in place: a move not checked allocates nothing
        if count > _EVERY_FROM:
            phase = count % _EVERY
            if phase and phase != _EVERY - 1:
                return _NONE
            compare = not phase  # the pair's first is remembered, not compared
        get = state[1].get
    now: dict[int, _Seen] = {}
    repeated: list[torch.Tensor] = []
    ref = weakref.ref
    for tensor in sent[:_CHECKED]:
        if type(tensor) is not _Tensor and isinstance(tensor, _Parameter):
            # Never weakly referenced: torch.utils.swap_tensors refuses a tensor that is,
            # and swaps parameters (module.to of a tensor subclass, or with torch.__future__'s
            # swap flag; load_state_dict with it). A model moved on every step is rare.
            continue
        try:
            version = version_of(tensor)
        except RuntimeError:  # an inference tensor keeps no version: it cannot be told
            continue
        if get is not None:
            seen = get(id(tensor))
            if seen is not None and seen[1] == version and seen[0]() is tensor:
                now[id(tensor)] = seen
                if compare and not seen[2] and _written_by_torch(tensor):
                    repeated.append(tensor)
                continue
        now[id(tensor)] = (ref(tensor), version, False)
    if state is None:
        _remember(where, table)
    table[key] = [count, now]
    for tensor in repeated:  # reported below (or already, at its path): never again
        weak, version, _ = now[id(tensor)]
        now[id(tensor)] = (weak, version, True)
    return repeated


def _written_by_torch(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s version counter sees every write of its memory: not where torch
    does not own the memory (``torch.from_numpy``, DLPack, ``torch.frombuffer``), which its
    owner writes in place unseen (a replay buffer refilled through numpy at every step).
    torch never resizes memory it does not own, nor pinned memory, which it owns."""
    try:
        return tensor.untyped_storage().resizable() or tensor.is_pinned()
    except (RuntimeError, NotImplementedError):  # no storage (sparse, a wrapper): as before
        return True


def forget(where: Where, target: torch.device | None) -> None:
    """Forget the last move of ``where`` to ``target``: the call it moved for failed, and
    the same batch moved again by a retry is no tensor that crosses on every call."""
    if target is None:
        return
    if isinstance(where, Place):
        where.last.pop(target, None)
    else:
        _LAST.pop((where, target), None)


def _remember(where: Where, table: dict[Any, list[Any]]) -> None:
    """Before a place's first state: its Place noted (for a clear of every state), or
    room made among the lines' states."""
    if isinstance(where, Place):
        _REMEMBERING.add(where)
    elif len(table) >= _LINES:
        with contextlib.suppress(StopIteration, KeyError):  # another thread's meanwhile
            del table[next(iter(table))]


def warn(
    repeated: list[torch.Tensor],
    where: Where,
    target: torch.device,
    paths: dict[int, str],
    name: str,
) -> None:
    """One warning for the tensors of a move not yet reported at their place and path: a
    batch of constants (a cached validation batch) is one warning, not one per tensor."""
    fresh: list[tuple[str, torch.Tensor]] = []
    with _WARNED_LOCK:
        for tensor in repeated:
            path = paths.get(id(tensor), name or "?")
            if _first_report(where, target, path):
                fresh.append((path, tensor))
    if not fresh:
        return
    origin = where.origin if isinstance(where, Place) else None
    if origin is not None:  # a prefetcher's line: its moves run on a thread of its own
        warn_explicit_at(*origin, _message(fresh, where, target, {}), RepeatedMoveWarning)
        return
    frame = _user_frame()
    held = {}
    if isinstance(where, Place) and not _returned(where):  # a decorated call's arguments
        held = _held(frame, [tensor for _, tensor in fresh[:_NAMED]])
    message = _message(fresh, where, target, held)
    if frame is not None:
        warn_at(frame, message, RepeatedMoveWarning)
    elif isinstance(where, Place) and where.home is not None:
        warn_explicit_at(*where.home, message, RepeatedMoveWarning)
    else:
        warnings.warn(message, RepeatedMoveWarning, stacklevel=2)


def _first_report(where: Where, target: torch.device, path: str) -> bool:
    """Whether ``path`` moved by ``where`` to ``target`` was not reported yet; now it is.
    Under ``_WARNED_LOCK``."""
    if isinstance(where, Place):
        if (target, path) in where.warned:
            return False
        where.warned.add((target, path))
        return True
    if (where, target, path) in _WARNED:
        return False
    if len(_WARNED) >= _LINES * 8:
        _WARNED.clear()  # past the bound, a line may be warned of again
    _WARNED.add((where, target, path))
    return True


_NAMED = 3  # the tensors a warning about several names; the rest are counted


def _shape_text(tensor: torch.Tensor) -> str:
    """``shape (2, 3)``; a strided nested tensor, whose ragged shape ``.shape`` refuses,
    by its number of components."""
    try:
        return f"shape {tuple(tensor.shape)}"
    except RuntimeError:
        return f"nested, {tensor.size(0)} components"


def _message(
    fresh: list[tuple[str, torch.Tensor]],
    where: Where,
    target: torch.device,
    held: dict[int, _Held],
) -> str:
    device = str(target)
    named = fresh[:_NAMED]
    what = ", ".join(
        f"{path} ({_shape_text(tensor)}, {tensor.dtype}, {size_text(bytes_of(tensor))})"
        for path, tensor in named
    )
    sources = " and ".join(sorted({str(tensor.device) for _, tensor in fresh}))
    size = size_text(sum(bytes_of(tensor) for _, tensor in fresh))
    if len(fresh) == 1:
        copied = f"the same unchanged tensor {what}"
    else:
        more = f" and {len(fresh) - len(named)} more" if len(fresh) > len(named) else ""
        copied = f"the same {len(fresh)} unchanged tensors {what}{more}"
    return (
        f"{label(where)} copied {copied} from {sources} to {device} again: {size} crosses on every "
        f"call\n"
        f"fix: {_fix(fresh, where, device, held)}; for a model's constant, register it as a buffer "
        f"(self.register_buffer(name, tensor)) so that model.to() moves it once"
    )


def _fix(
    fresh: list[tuple[str, torch.Tensor]],
    where: Where,
    device: str,
    held: dict[int, _Held],
) -> str:
    """How to move them once: the caller's ``to_device``, an argument passed already on the
    device (named as the caller holds it, where ``held`` says), a default made on it
    (rebinding an argument cannot reach a default), a result kept on it, or the batches of
    a prefetcher's loader holding it already."""
    them = "it" if len(fresh) == 1 else "them"
    if not isinstance(where, Place):
        return f"call to_device on {them} once, before the loop, and reuse the result"
    if where.origin is not None:
        return (
            f"the loader yields {them} in every batch: move {them} to {device} once, before "
            f"the loop, where the loader gets {them}, so that each batch holds {them} there"
        )
    if _returned(where):
        function = where.label.split(" -> ", 1)[0]
        return (
            f"{function} returns {them} unchanged at every call: keep a copy on {device} "
            f"where {function} holds {them} (made once), and return that"
        )
    defaults = where.defaults
    if len(fresh) == 1:
        path, tensor = fresh[0]
        parameter = defaults.get(id(tensor))
        if parameter is None:
            return f"pass it on {device} already: {_moved_once(path, tensor, device, held)}"
        return (
            f"it is {parameter}'s default, which stays where it is: make the default on "
            f"{device} where the function is defined ({parameter}=<the tensor>.to({device!r})), "
            f"or pass {parameter} on {device} already"
        )
    steps = []
    for path, tensor in fresh[:_NAMED]:
        parameter = defaults.get(id(tensor))
        if parameter is not None:
            steps.append(f"{parameter}'s default made on {device} in the def")
        elif id(tensor) in held:
            steps.append(_rebound(held[id(tensor)], device))
        else:
            steps.append(f"the tensor passed as {path}")
    rest = ", ..." if len(fresh) > _NAMED else ""
    verb = "have" if any(id(tensor) in defaults for _, tensor in fresh) else "pass"
    return f"{verb} them on {device} already, each moved once before the loop: " + (
        ", ".join(steps) + rest
    )


def _moved_once(path: str, tensor: torch.Tensor, device: str, held: dict[int, _Held]) -> str:
    """The fix for one argument: rebinding the caller's name for it, where known."""
    name = held.get(id(tensor))
    if name is None:
        return (
            f"move the tensor passed as {path} to {device} once, before the loop, and pass "
            f"the moved one"
        )
    if name.kind == "argument":
        return (
            f"it is {name.text}, an argument of {name.function}(): move it to {device} "
            f"once where {name.function}() is called from, before the loop"
        )
    where = (
        f"at the top level of its file, where {name.text} is defined"
        if name.kind == "global"
        else "before the loop"
    )
    return f"{name.text} = {name.text}.to({device!r}) once, {where}"


def _rebound(name: _Held, device: str) -> str:
    """The step of a fix for several that moves what the caller holds as ``name``."""
    if name.kind == "argument":
        return f"{name.text} (an argument of {name.function}()) where it is called from"
    statement = f"{name.text} = {name.text}.to({device!r})"
    return f"{statement} at the top level of its file" if name.kind == "global" else statement


def _returned(where: Where) -> bool:
    """Whether ``where`` is the move of a decorated function's result (``output=``)."""
    return isinstance(where, Place) and where.label.endswith(" -> result")


class _Held(NamedTuple):
    """How the caller holds a tensor: ``text``, a name (``weight``) or one step down from
    one (``self.weight``, ``batch['weight']``, ``tables[0]``). ``kind``: ``"name"``, or
    ``"global"`` for a module's global read in a function (rebound there, it would be a
    local), ``"argument"`` for an argument of the caller's function (``function``: the
    tensor comes from further out, rebinding it there moves it at every call), ``"step"``
    one step down."""

    text: str
    kind: str
    function: str = ""


_LOOKED_AT = 1024  # the entries of one container looked through, one step down


def _held(frame: Any, tensors: list[torch.Tensor]) -> dict[int, _Held]:
    """``id(tensor) -> how the caller's frame holds it``, for the ``tensors`` it holds as
    that very object: a name of its locals, then of its module's globals, then one step
    down from either (an attribute, a dict entry, a list item). Where several hold it,
    one written in the caller's line wins (an alias made elsewhere does not reach what it
    passes). Asked on the warning's path only."""
    wanted = {id(tensor) for tensor in tensors}
    if frame is None or not wanted:
        return {}
    try:
        local = frame.f_locals
        code = frame.f_code
        line = linecache.getline(code.co_filename, frame.f_lineno)
        spaces = [(local, "name")]
        arguments: tuple[str, ...] = ()
        if frame.f_globals is not local:  # a function's frame: its module's globals too
            spaces.append((frame.f_globals, "global"))
            arguments = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        best: dict[int, tuple[int, _Held]] = {}

        def offer(key: int, rank: int, root: str, held: _Held) -> None:
            if not re.search(rf"(?<![\w.]){re.escape(root)}\b", line):
                rank += 1  # not in the caller's line: another name may be what it passes
            if key not in best or rank < best[key][0]:
                best[key] = (rank, held)

        for level, (space, kind) in enumerate(spaces):
            for name, value in list(space.items()):
                if not isinstance(name, str) or name.startswith("__"):
                    continue
                if id(value) in wanted:
                    if kind == "name" and name in arguments:
                        held = _Held(name, "argument", code.co_name)
                    else:
                        held = _Held(name, kind)
                    offer(id(value), 2 * level, name, held)
                    continue
                for step, item in _one_step_down(value):
                    if id(item) in wanted:
                        offer(id(item), 4 + 2 * level, name, _Held(name + step, "step"))
        return {key: held for key, (_, held) in best.items()}
    except Exception:  # the caller's objects' own code: the names are a courtesy
        return {}


def _one_step_down(value: object) -> Iterator[tuple[str, object]]:
    """``(step, item)`` for what ``value`` holds one step down, where the step can be
    assigned to: ``['key']`` of a dict, ``[0]`` of a list, ``.name`` of an object's own
    attributes (not of a module, class, function, tensor or frozen dataclass)."""
    if isinstance(value, dict):
        for key, item in itertools.islice(value.items(), _LOOKED_AT):
            if isinstance(key, (str, int)) and not isinstance(key, bool):
                yield f"[{key!r}]", item
    elif isinstance(value, list):
        for index, item in enumerate(value[:_LOOKED_AT]):
            yield f"[{index}]", item
    elif not isinstance(value, (ModuleType, type, FunctionType, torch.Tensor)):
        params = getattr(type(value), "__dataclass_params__", None)
        if params is not None and params.frozen:
            return
        try:
            attributes = object.__getattribute__(value, "__dict__")
        except AttributeError:
            return
        if isinstance(attributes, dict):
            for name, item in itertools.islice(attributes.items(), _LOOKED_AT):
                if isinstance(name, str) and name.isidentifier() and not name.startswith("__"):
                    yield f".{name}", item


def size_text(nbytes: int) -> str:
    """Bytes for people: ``512 B``, ``4.0 KiB``, ``1.5 MiB``."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{nbytes} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError  # pragma: no cover


def _user_frame() -> Any:
    """The innermost frame outside devicectx and torch: the caller of the move."""
    frame: Any = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(NOT_CALLERS):
        frame = frame.f_back
    return frame


def caller_line() -> Line:
    """The line of the caller of the move (``("", 0)`` where there is none)."""
    frame = _user_frame()
    return ("", 0) if frame is None else (frame.f_code.co_filename, frame.f_lineno)


_SHORT: dict[str, str] = {}


def _short(filename: str) -> str:
    """A file name as people read it: relative to the working directory when inside it
    (worked out once per file)."""
    short = _SHORT.get(filename)
    if short is None:
        short = filename
        with contextlib.suppress(ValueError):
            relative = os.path.relpath(filename)
            if not relative.startswith(".."):
                short = relative
        if len(_SHORT) < 1024:
            _SHORT[filename] = short
    return short


def _reset_for_tests() -> None:
    """Forget every place's last move and every warning given, and turn the check on."""
    _CHECK[0] = True
    _LAST.clear()
    with _WARNED_LOCK:
        _WARNED.clear()
        for place in list(_REMEMBERING):
            place.last.clear()
            place.warned.clear()
