"""Where the bytes go: :func:`track_transfers`, and what reads every move's copies.

Every copy the move engine makes between devices ends in one list per move (the sources
it copied, see :class:`~devicectx.move._alias.TensorMover`), which :func:`account` reads when
the move is done. Two things read it:

- the logs of :func:`track_transfers` open in the running thread or asyncio task (a
  context variable, as ``on_device`` keeps its blocks), which add one row per place,
  path and direction;
- the repeated-move check (:mod:`devicectx.move._repeats`), always on unless
  :func:`~devicectx.set_repeated_move_warning` turns it off.

A move that copies nothing costs nothing here: the engine returns before it copies, and
this module is never reached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import torch

from devicectx.move import _repeats
from devicectx.move._nbytes import bytes_of
from devicectx.move._repeats import Place, Where, caller_line, checking, label, size_text
from devicectx.move._walk import iter_tensors

__all__ = [
    "Transfer",
    "TransferLog",
    "account",
    "paths_if_tracked",
    "track_transfers",
]


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
        bytes: the bytes their copies carried: elements times element size (no
            padding) for a plain tensor; for a sparse, nested, masked or wrapper tensor,
            those of the tensors it holds (indices and values, not its dense size).
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

    # Pickled and copied as its sums (a rank's log sent with all_gather_object, one returned
    # from a worker process), with a lock of its own.
    def __getstate__(self) -> dict[str, Any]:
        with self._lock:
            return {"sums": {key: list(sums) for key, sums in self._sums.items()}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._sums = state["sums"]
        self._lock = threading.Lock()

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
            (row.where, row.path, _direction(row), str(row.tensors), size_text(row.bytes))
            for row in self.rows
        ]
        lines += [
            ("total", "", f"{source} -> {target}", str(count), size_text(nbytes))
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
        return f"<TransferLog: {self.total_tensors} tensors, {size_text(self.total_bytes)}>"


def _direction(row: Transfer) -> str:
    return f"{row.source} -> {row.target}"


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
    found in it. A sparse tensor counts its indices and values, not the dense size it
    stands for; a nested tensor its values and offsets (a strided one: its buffer and
    sizes); a ``MaskedTensor`` its data and mask; a wrapper subclass its inner tensors.
    Copies made elsewhere (a ``.to`` in your code, torch's own) are not seen.

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
    check = check and checking()
    if not (logs or check):
        return
    place: Where = caller_line() if where is None else where
    repeated = _repeats.repeated(place, target, sent) if check else None
    if paths is None and (logs or repeated):
        paths = _paths(obj, name)
    if repeated:
        assert paths is not None
        _repeats.warn(repeated, place, target, paths, name)
    if logs:
        assert paths is not None
        text = label(place)
        # An object's own .to may leave tensors to the walk, which lists them again.
        for tensor in {id(tensor): tensor for tensor in sent}.values():
            path = paths.get(id(tensor), name or "?")
            nbytes = bytes_of(tensor)
            for log in logs:
                log.add(text, path, tensor.device, target, nbytes)


def _paths(obj: object, name: str) -> dict[int, str]:
    """``id(tensor) -> path`` for every tensor in ``obj``, its first path where it has several."""
    paths: dict[int, str] = {}
    with contextlib.suppress(Exception):  # a container's own code: the paths are a courtesy
        for path, tensor in iter_tensors(obj, name, modules=True):
            paths.setdefault(id(tensor), path)
    return paths
