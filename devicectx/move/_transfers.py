"""Where the bytes go: :func:`track_transfers`, and the warning for repeated moves.

Every copy the move engine makes between devices ends in one list per move (the sources
it copied, see :class:`~devicectx.move._alias.TensorMover`), which :func:`account` reads when
the move is done. Two things read it:

- the logs of :func:`track_transfers` open in the running thread or asyncio task (a
  context variable, as ``on_device`` keeps its blocks), which add one row per place,
  path and direction;
- the repeated-move check, always on unless :func:`set_repeated_move_warning` turns it
  off: each place keeps the sources of its last checked move (by weak reference, with
  their version counters), and a source moved again by the same place, the same object
  with the same version, is a tensor that never changes but crosses to the device on
  every call. :class:`~devicectx.RepeatedMoveWarning` says so, once per place and path, in
  one warning per move however many tensors it names.
  A place's first 9 moves are all checked, then two in a row in every 8 (see ``_EVERY``).

A *place* is the decorated function (a :class:`Place`, printed ``"train.step()"``, or
``"train.step() -> result"`` for the move of its result), the line that made a prefetcher,
or the line that called :func:`~devicectx.to_device` (``"train.py:42"``). A move that
copies nothing costs nothing here: the engine returns before it copies, and this module is
never reached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import torch

from devicectx._errors import RepeatedMoveWarning, warn_at, warn_explicit_at
from devicectx._torch.tensors import version_of
from devicectx.move._walk import iter_tensors

__all__ = [
    "Place",
    "Transfer",
    "TransferLog",
    "account",
    "caller_place",
    "set_repeated_move_warning",
    "track_transfers",
]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # not move/


class Place:
    """A place that moves, other than the line that called ``to_device``: a decorated
    function, or the line that made a prefetcher.

    One place per object, whatever its ``label`` (how it prints): two functions named
    ``loss_fn()`` in two modules are two places, and the same tensor moved by both is no
    repeat. ``defaults``: the ids of the tensors in the function's defaults, which a call
    that leaves them out moves (the fix is then to the default). ``origin``: the file,
    line and module globals its warnings are given at, where the moves run on another
    thread than the caller's (a prefetcher's); None: the caller's line at the move.
    """

    __slots__ = ("defaults", "label", "origin")

    def __init__(
        self,
        label: str,
        defaults: dict[int, str] | None = None,
        origin: tuple[str, int, dict[str, Any]] | None = None,
    ) -> None:
        self.label = label
        self.defaults = defaults or {}  # id(tensor) -> the parameter it is the default of
        self.origin = origin

    def __str__(self) -> str:
        return self.label

    def __repr__(self) -> str:
        return f"Place({self.label!r})"


def caller_place() -> Place:
    """The caller's line (outside devicectx) as a place whose warnings are given there."""
    frame = _user_frame()
    if frame is None:
        return Place("?")
    filename, line = frame.f_code.co_filename, frame.f_lineno
    return Place(f"{_short(filename)}:{line}", origin=(filename, line, frame.f_globals))


@dataclasses.dataclass(frozen=True)
class Transfer:
    """The copies made at one place, of one path, in one direction.

    Attributes:
        where: the decorated function (``"train.step()"``; ``"train.step() -> result"``
            for its result) or the ``file:line`` that called ``to_device``.
        path: what was moved, as errors name it: ``"batch['x']"``, ``"obj[0]"``.
        source: the device the tensors came from.
        target: the device they went to.
        tensors: how many tensors were copied.
        bytes: their bytes (elements times element size, without any padding).
    """

    where: str
    path: str
    source: torch.device
    target: torch.device
    tensors: int
    bytes: int

    def as_dict(self) -> dict[str, Any]:
        """The row with plain values (devices as text), for a logging library."""
        return {
            "where": self.where,
            "path": self.path,
            "source": str(self.source),
            "target": str(self.target),
            "tensors": self.tensors,
            "bytes": self.bytes,
        }


_Key = tuple[str, str, torch.device, torch.device]


class TransferLog:
    """What :func:`track_transfers` recorded: every copy between devices, summed by place.

    Example:
        >>> import torch
        >>> from devicectx import to_device, track_transfers
        >>> with track_transfers() as log:
        ...     _ = to_device({"x": torch.zeros(4), "y": torch.zeros(2, 2)}, "meta")
        >>> log.total_tensors, log.total_bytes
        (2, 32)
        >>> [(row.path, row.tensors, row.bytes) for row in log.rows]
        [("obj['x']", 1, 16), ("obj['y']", 1, 16)]
    """

    def __init__(self) -> None:
        self._sums: dict[_Key, list[int]] = {}
        self._lock = threading.Lock()  # a log may be shared by threads run in its context

    def add(
        self, where: str, path: str, source: torch.device, target: torch.device, nbytes: int
    ) -> None:
        """Record one tensor copied."""
        key = (where, path, source, target)
        with self._lock:
            sums = self._sums.get(key)
            if sums is None:
                self._sums[key] = [1, nbytes]
            else:
                sums[0] += 1
                sums[1] += nbytes

    @property
    def rows(self) -> list[Transfer]:
        """One row per place, path and direction, most bytes first (then in order met)."""
        with self._lock:
            items = list(self._sums.items())
        rows = [Transfer(*key, count, nbytes) for key, (count, nbytes) in items]
        return sorted(rows, key=lambda row: -row.bytes)

    @property
    def total_tensors(self) -> int:
        """How many tensors were copied."""
        return sum(row.tensors for row in self.rows)

    @property
    def total_bytes(self) -> int:
        """How many bytes were copied."""
        return sum(row.bytes for row in self.rows)

    def directions(self) -> dict[tuple[torch.device, torch.device], tuple[int, int]]:
        """``{(source, target): (tensors, bytes)}``, summed over places."""
        totals: dict[tuple[torch.device, torch.device], tuple[int, int]] = {}
        for row in self.rows:
            count, nbytes = totals.get((row.source, row.target), (0, 0))
            totals[(row.source, row.target)] = (count + row.tensors, nbytes + row.bytes)
        return totals

    def as_dict(self) -> dict[str, Any]:
        """Everything as plain values: totals, each direction, each row."""
        return {
            "total_tensors": self.total_tensors,
            "total_bytes": self.total_bytes,
            "directions": {
                f"{source} -> {target}": {"tensors": count, "bytes": nbytes}
                for (source, target), (count, nbytes) in self.directions().items()
            },
            "rows": [row.as_dict() for row in self.rows],
        }

    def clear(self) -> None:
        """Forget what was recorded (a log per epoch, say)."""
        with self._lock:
            self._sums.clear()

    def table(self) -> str:
        """The rows as a text table, with a total per direction."""
        header = ("where", "what", "from -> to", "tensors", "bytes")
        lines = [
            (row.where, row.path, _direction(row), str(row.tensors), _size(row.bytes))
            for row in self.rows
        ]
        lines += [
            ("total", "", f"{source} -> {target}", str(count), _size(nbytes))
            for (source, target), (count, nbytes) in self.directions().items()
        ]
        if not lines:
            return "no transfers"
        widths = [max(len(line[i]) for line in [header, *lines]) for i in range(len(header))]

        def render(line: Sequence[str]) -> str:
            left = [text.ljust(width) for text, width in zip(line[:3], widths, strict=False)]
            right = [text.rjust(width) for text, width in zip(line[3:], widths[3:], strict=True)]
            return "  ".join([*left, *right]).rstrip()

        return "\n".join(render(line) for line in [header, *lines])

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"<TransferLog: {self.total_tensors} tensors, {_size(self.total_bytes)}>"


def _direction(row: Transfer) -> str:
    return f"{row.source} -> {row.target}"


def _size(nbytes: int) -> str:
    """Bytes for people: ``512 B``, ``4.0 KiB``, ``1.5 MiB``."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{nbytes} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError  # pragma: no cover


# The logs open in the running thread or task, innermost last. A tuple, so that tasks
# (which copy the context) never share a mutable list.
_LOGS: ContextVar[tuple[TransferLog, ...]] = ContextVar("devicectx_transfer_logs", default=())


@contextlib.contextmanager
def track_transfers() -> Iterator[TransferLog]:
    """Record every copy devicectx makes between devices inside the block.

    Example:
        >>> import torch
        >>> from devicectx import device_agnostic, track_transfers
        >>> @device_agnostic(device="meta")
        ... def step(batch):
        ...     return batch["x"].sum()
        >>> with track_transfers() as log:
        ...     for _ in range(3):
        ...         _ = step({"x": torch.zeros(8), "y": [torch.zeros(2), 0]})
        >>> print(log.table())
        where   what           from -> to   tensors  bytes
        step()  batch['x']     cpu -> meta        3   96 B
        step()  batch['y'][0]  cpu -> meta        3   24 B
        total                  cpu -> meta        6  120 B

    Yields:
        A :class:`TransferLog`, filled as the block runs: rows by place (the decorated
        function, or the line that called ``to_device``), path and direction, with
        tensors and bytes; ``log.total_bytes``, ``log.directions()``, ``log.as_dict()``
        (for logging libraries) and ``log.table()`` answer in code or text.

    What is counted: each tensor copied to another device by :func:`~devicectx.to_device`
    or ``@device_agnostic`` (arguments and results), once however many places hold it; a
    view that arrives as a view of another tensor moved with it is no copy, and is not
    counted. Tensors inside a module or an object with its own ``.to`` count as they are
    found in it. Copies made elsewhere (a ``.to`` in your code, torch's own) are not seen.

    Caveats:
        - Like ``on_device``, the block sees its own thread and asyncio task (and tasks
          created inside it), not other threads; nested blocks each record everything.
        - Paths are worked out for every move while a log is open, which makes each move
          slower (docs/performance.md gives the cost). Outside the block nothing is
          recorded and nothing is paid.
        - Compiled code records nothing: a ``to_device`` or decorated call that
          ``torch.compile`` traces into a graph copies as graph ops, which no log sees
          (the log cannot be read while dynamo traces, nor written by the graph). Moves
          made eagerly around a compiled function are counted as usual.
    """
    log = TransferLog()
    _LOGS.set((*_LOGS.get(), log))
    try:
        yield log
    finally:
        _LOGS.set(tuple(open_log for open_log in _LOGS.get() if open_log is not log))


# The repeated-move check.

_CHECK = [True]  # one cell, read on every move that copied something
# The check costs a weak reference and a version counter read per tensor copied
# (docs/performance.md). So it looks at the first 256 copies of a move (in the order of
# the structure), and, past a place's first 8 moves, at one move in 8, each compared with
# the last one looked at: a tensor copied on every step is still reported by the 16th
# step, at an eighth of the cost.
_CHECKED = 256
_EVERY_FROM = 8
_EVERY = 8
_Seen = tuple["weakref.ref[torch.Tensor]", int, bool]  # the tensor, its version, reported
# Per place: [how many moves it made, what its last checked move copied, by id].
_LAST: dict[tuple[Place | str, torch.device], list[Any]] = {}
_NONE: list[torch.Tensor] = []  # no repeats (never appended to)
_WARNED: set[tuple[Place | str, torch.device, str]] = set()
_WARNED_LOCK = threading.Lock()


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
    previous = _CHECK[0]
    _CHECK[0] = bool(enabled)
    if not enabled:
        _LAST.clear()
    return previous


def paths_if_tracked(obj: object, name: str) -> dict[int, str] | None:
    """Before a move: the paths of ``obj``'s tensors where a log is open (a module is moved
    in place, so its tensors can only be named before), else None, at no cost. Eager code
    only: dynamo cannot trace ``ContextVar.get``, and traced code records nothing."""
    return _paths(obj, name) if _LOGS.get() else None


def account(
    sent: list[torch.Tensor],
    target: torch.device,
    obj: object,
    name: str,
    where: Place | None,
    check: bool = True,
    paths: dict[int, str] | None = None,
) -> None:
    """After a move: ``sent`` are the tensors it copied to ``target``, from ``obj`` (whose
    paths start at ``name``, and are ``paths`` where :func:`paths_if_tracked` gave them);
    ``where`` is the place, None for the caller of the move; ``check=False`` leaves the
    move out of the repeated-move check. Eager code only, as :func:`paths_if_tracked`."""
    if not sent:
        return
    logs = _LOGS.get()
    check = check and _CHECK[0]
    if not (logs or check):
        return
    place: Place | str = _caller_line() if where is None else where
    repeated = _repeated(place, target, sent) if check else None
    if paths is None and (logs or repeated):
        paths = _paths(obj, name)
    if repeated:
        assert paths is not None
        _warn(repeated, place, target, paths, name)
    if logs:
        assert paths is not None
        label = str(place)
        # An object's own .to may leave tensors to the walk, which lists them again.
        for tensor in {id(tensor): tensor for tensor in sent}.values():
            path = paths.get(id(tensor), name or "?")
            nbytes = tensor.nbytes
            for log in logs:
                log.add(label, path, tensor.device, target, nbytes)


def _repeated(
    where: Place | str, target: torch.device, sent: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The tensors of ``sent`` that this place moved, unchanged, at its move just before,
    and not yet reported; and remember ``sent`` for the next check (weakly: the batch of a
    past step is not kept alive).

    Past the first moves, a place's moves are looked at in pairs of two in a row, one pair
    in ``_EVERY``: the first of a pair is remembered, the second compared with it. A
    tensor moved again by the very next move crosses on every call; one that comes back
    every few moves (a list of a few batches, cycled) is no such constant."""
    key = (where, target)
    state = _LAST.get(key)
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
        try:
            version = version_of(tensor)
        except RuntimeError:  # an inference tensor keeps no version: it cannot be told
            continue
        if get is not None:
            seen = get(id(tensor))
            if seen is not None and seen[1] == version and seen[0]() is tensor:
                now[id(tensor)] = seen
                if compare and not seen[2]:
                    repeated.append(tensor)
                continue
        now[id(tensor)] = (ref(tensor), version, False)
    _LAST[key] = [count, now]
    for tensor in repeated:  # reported below (or already, at its path): never again
        weak, version, _ = now[id(tensor)]
        now[id(tensor)] = (weak, version, True)
    return repeated


def _warn(
    repeated: list[torch.Tensor],
    where: Place | str,
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
            if (where, target, path) not in _WARNED:
                _WARNED.add((where, target, path))
                fresh.append((path, tensor))
    if not fresh:
        return
    message = _message(fresh, where, target)
    origin = where.origin if isinstance(where, Place) else None
    if origin is not None:  # a prefetcher's line: its moves run on a thread of its own
        warn_explicit_at(*origin, message, RepeatedMoveWarning)
        return
    frame = _user_frame()
    if frame is None:
        warnings.warn(message, RepeatedMoveWarning, stacklevel=2)
    else:
        warn_at(frame, message, RepeatedMoveWarning)


_NAMED = 3  # the tensors a warning about several names; the rest are counted


def _message(
    fresh: list[tuple[str, torch.Tensor]], where: Place | str, target: torch.device
) -> str:
    device = str(target)
    named = fresh[:_NAMED]
    what = ", ".join(
        f"{path} (shape {tuple(tensor.shape)}, {tensor.dtype}, {_size(tensor.nbytes)})"
        for path, tensor in named
    )
    sources = " and ".join(sorted({str(tensor.device) for _, tensor in fresh}))
    size = _size(sum(tensor.nbytes for _, tensor in fresh))
    if len(fresh) == 1:
        copied = f"the same unchanged tensor {what}"
    else:
        more = f" and {len(fresh) - len(named)} more" if len(fresh) > len(named) else ""
        copied = f"the same {len(fresh)} unchanged tensors {what}{more}"
    return (
        f"{where} copied {copied} from {sources} to {device} again: {size} crosses on every "
        f"call\n"
        f"fix: {_fix(fresh, where, device)}; for a model's constant, register it as a buffer "
        f"(self.register_buffer(name, tensor)) so that model.to() moves it once"
    )


def _fix(fresh: list[tuple[str, torch.Tensor]], where: Place | str, device: str) -> str:
    """How to move them once: the caller's ``to_device``, an argument passed already on the
    device, or a default made on it (rebinding an argument cannot reach a default)."""
    if not isinstance(where, Place):
        them = "it" if len(fresh) == 1 else "them"
        return f"call to_device on {them} once, before the loop, and reuse the result"
    defaults = where.defaults
    steps = []
    for path, tensor in fresh[:_NAMED]:
        parameter = defaults.get(id(tensor))
        if parameter is None:
            steps.append(f"{path} = {path}.to({device!r})")
        else:
            steps.append(f"{parameter}'s default made on {device} in the def")
    rest = ", ..." if len(fresh) > _NAMED else ""
    if len(fresh) > 1:
        verb = "have" if any(id(tensor) in defaults for _, tensor in fresh) else "pass"
        return f"{verb} them on {device} already, each moved once before the loop: " + (
            ", ".join(steps) + rest
        )
    path, tensor = fresh[0]
    parameter = defaults.get(id(tensor))
    if parameter is None:
        return f"pass it on {device} already: {steps[0]} once, before the loop"
    return (
        f"it is {parameter}'s default, which stays where it is: make the default on "
        f"{device} where the function is defined ({parameter}=<the tensor>.to({device!r})), "
        f"or pass {parameter} on {device} already"
    )


def _paths(obj: object, name: str) -> dict[int, str]:
    """``id(tensor) -> path`` for every tensor in ``obj``, its first path where it has several."""
    paths: dict[int, str] = {}
    with contextlib.suppress(Exception):  # a container's own code: the paths are a courtesy
        for path, tensor in iter_tensors(obj, name, modules=True):
            paths.setdefault(id(tensor), path)
    return paths


def _user_frame() -> Any:
    """The innermost frame outside devicectx: the caller of the move."""
    frame: Any = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    return frame


def _caller_line() -> str:
    """``file:line`` of the caller of the move."""
    frame = _user_frame()
    return "?" if frame is None else f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}"


_SHORT: dict[str, str] = {}


def _short(filename: str) -> str:
    """A file name as people read it: relative to the working directory when inside it
    (worked out once per file: it is part of every place key of ``to_device``)."""
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
