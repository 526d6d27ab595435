"""Batches on the device before the step asks for them: :func:`prefetch`.

A loop that moves each batch when its step asks waits for the copy: the copy of batch
``i + 1`` starts only then, on the stream the step computes on. :func:`prefetch` moves the
next ``depth`` batches ahead, on a side *copy stream* of the target device, so that their
copies run while the device computes the steps queued before them. How, on an accelerator
with streams (CUDA, ROCm, XPU, the testing kit's emulated device):

- each batch is moved by the move engine (:func:`~devicectx.to_device`: staged through
  pinned buffers, so sources need not be pinned), with the device's copy stream (the one
  non-blocking staged moves use, :mod:`devicectx.move._streams`) made the current stream
  of the target around the move: the engine queues its copies, and allocates the
  results, on the current stream;
- before that, where a source may still be written by the caller's stream (one on a
  device, or a pinned buffer a device-to-host copy still fills) and that stream is busy,
  the copy stream waits for the work queued there so far; a batch of pageable host
  tensors (a ``DataLoader`` without ``pin_memory``) needs no such wait, and its copies
  start at once, overlapping the steps queued before them;
- an event is recorded on the copy stream after the move. Handing the batch over, the
  caller's current stream waits on that event (the device waits, not the host), and every
  tensor of the batch is recorded as used on that stream (``Tensor.record_stream``): the
  caching allocator does not give its memory to another tensor until the work queued
  there on it has run, whichever stream frees it.

The loader is read in the caller's thread, inside ``next()``, so that its exceptions,
warnings and context stay where the caller expects them; each batch read is then moved on
a thread of the prefetcher's own (:mod:`devicectx.move._background`), as a ``DataLoader``'s
pin-memory thread pins, with the caller's context (``track_transfers``' logs, ``on_device``)
and the caller's current stream taken at that ``next()``. Collecting, casting and packing
a batch (host copies into pinned memory, which release the GIL) then overlap the
caller's next step instead of delaying it; the caller waits only for a batch whose move
has not finished when its turn comes. Errors of a move are raised at its batch. The loader
is read again only once the move of the batch it gave last has read that batch's host
sources (it ran during the caller's step, mostly): a loader may refill one pageable buffer
for every batch.

Elsewhere (the CPU, ``meta``, MPS, whose one queue copies in order anyway, a device
without streams, events or ``record_stream``), each batch is moved when it is asked for:
the same iterator, no lookahead, nothing started.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import reprlib
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from devicectx._errors import DeviceWarning, warn_explicit_at, with_article
from devicectx.devices._resolve import DeviceLike, accelerator_type, resolve_device
from devicectx.move import _repeats
from devicectx.move._background import Ticket, Worker
from devicectx.move._dtypes import DtypesLike, Suggest, call_suggest, cast_batch, check_dtypes
from devicectx.move._host_arrays import arrays_only, arrays_unmoved
from devicectx.move._move import _move, _nothing_to_move
from devicectx.move._skip import (
    Skip,
    SkipLike,
    check_names,
    compile_skip,
    inside_own_to_message,
    unmatched_message,
)
from devicectx.move._staging import HandedTo
from devicectx.move._streams import copy_stream, queued_on
from devicectx.move._unseen import fix_for, unseen_tensors
from devicectx.move._walk import collect
from devicectx.scope._stack import active_device

__all__ = ["Prefetcher", "Streams", "prefetch", "streams_for"]

T = TypeVar("T")

_NO_STREAMS = frozenset({"cpu", "meta", "mps"})
"""Device types moved in order: no memory of their own (``cpu``, ``meta``), or one queue
that runs copies in order with the compute (MPS)."""

_NAME = "batch"  # the root of the paths in errors, in track_transfers and in skip=


def prefetch(
    batches: Iterable[T],
    device: DeviceLike | None = None,
    *,
    depth: int = 2,
    skip: SkipLike = None,
    dtypes: DtypesLike = None,
) -> Prefetcher[T]:
    """Iterate over ``batches`` moved to ``device``, with the next ``depth`` already on their way.

    Example:
        >>> import torch
        >>> from devicectx import prefetch
        >>> loader = [{"x": torch.ones(2), "id": i} for i in range(3)]
        >>> batches = prefetch(loader, "meta")
        >>> [(batch["x"].device.type, batch["id"]) for batch in batches]
        [('meta', 0), ('meta', 1), ('meta', 2)]
        >>> len(batches)
        3

    Args:
        batches: any iterable of batches: a ``DataLoader`` (``pin_memory`` not needed), a
            list, a generator. Each batch is anything :func:`~devicectx.to_device` moves.
        device: where to; anything :func:`~devicectx.resolve_device` takes. None: the
            device of the enclosing ``on_device`` block, else ``"auto"``. Resolved here,
            once.
        depth: on an accelerator with streams, how many batches are moved ahead of the one
            handed over (each holds its device memory until it is handed over and freed):
            1 overlaps each copy with one step, 2 (the default) also absorbs a loader or
            a copy that is slow now and then.
        skip: what stays where it is, as :func:`~devicectx.to_device` takes it; paths are
            rooted at ``batch`` (``"batch['meta']"``). An entry that names nothing in the
            first batch is warned of, as ``to_device`` warns (so are tensors in the first
            batch that the move cannot see: held by an object of a type it cannot look
            into).
        dtypes: what a move does with a dtype the device cannot hold, as
            :func:`~devicectx.to_device` takes it (``"device"``: float64 -> float32 on
            MPS, cast on the host before the copy).

    Returns:
        A :class:`Prefetcher`: iterable as ``batches`` is (a new pass per ``iter()`` for a
        ``DataLoader`` or a list; one pass, resumed after a ``break``, for an iterator or
        a generator), with ``len()``, the wrapped object's attributes (``sampler``,
        ``batch_size``, ``dataset``, ...), :meth:`~Prefetcher.set_epoch` and
        :meth:`~Prefetcher.close`.

    Raises:
        InvalidDeviceError, DeviceUnavailableError: ``device`` is no device here.
        ValueError: ``depth`` is not an int of at least 1.
        TypeError: ``batches`` is not iterable, or is one batch (a dict); ``skip`` holds
            something that is no type, path, key or predicate.
        ValueError, TypeError: ``dtypes`` is no dtype policy.

    While iterating:
        - An exception the loader raises for batch ``k`` is raised when batch ``k`` is
          asked for, never earlier, with the loader's own traceback; the batches before
          it are handed over first. Iterating again goes on reading the loader.
        - A batch that cannot be moved raises :class:`~devicectx.MoveError` when it is
          asked for, naming its index (counting from 0) and the path inside it.
        - ``track_transfers`` counts the copies under the line that called ``prefetch``
          (``train.py:12``), in the log open where ``next()`` moves them.

    What you may do, and when:
        - The batch handed over is ready on your current stream at that moment: use it
          there with no further wait, write into it, keep it; the batch is safe on the
          stream current at ``next()``, whichever was current when it was sent. To use
          it on another stream, make that stream wait for yours
          (``other.wait_stream(current)``), as for any tensor, and keep the batch alive
          until that stream is done with it: ``record_stream`` on one of its small
          tensors does not reach the staged region it lies in (see
          :func:`~devicectx.to_device`).
        - The source batch: the loader may reuse its memory at once (one host buffer
          refilled for each batch). Pageable tensors (a ``DataLoader`` without
          ``pin_memory``) have been copied into staging memory before the loader is read
          again. Pinned ones may be copied to the device directly, later (large ones, a
          batch of a few, any while your stream is busy): before it reads the loader
          again, ``next()`` waits (the host waits) for the copies of the last batch that
          had such a copy, and so for the work queued on your stream before it (see
          below). A ``DataLoader(pin_memory=True, num_workers=N)`` with ``N > 0`` pins
          each batch into memory of its own: nothing is waited for.
        - The copies of a batch with pinned tensors, or tensors on a device, wait for the
          work queued on your stream when the batch was read: a copy from the device
          queued there may still be filling one (``.to("cpu", non_blocking=True)``
          returns pinned memory at once). From a ``DataLoader(pin_memory=True,
          num_workers=N)`` with ``N > 0``, whose pin-memory thread fills each batch on the
          host, pinned batches do not wait: their copies overlap your step's work.

    Caveats:
        - The loader is read in the caller's thread, inside ``next()``: its own work
          (``num_workers=0``) is the caller's host time. Use loader workers for slow
          loading. The moves run on the prefetcher's own thread (where the device has
          streams), one batch after another; ``close()`` ends it, and so does dropping
          the prefetcher.
        - ``close()`` frees the batches in flight at once, and so does dropping the
          pass: a ``break`` out of ``for batch in prefetch(loader)`` over a
          ``DataLoader`` or a list. Over an iterator or a generator, whose one pass the
          prefetcher keeps for the next loop, they are freed with the prefetcher, or by
          ``close()``. A loader error read ahead and never asked for holds its pass
          (through its traceback's frames) until the garbage collector runs, or until
          ``close()``. Staging memory (pinned buffers shared by every move, at most
          64 MiB) stays for the next move, as :func:`~devicectx.staging_memory` reports;
          :func:`~devicectx.release_staging` lets it go.
        - The streams used are the caller's current stream of the target device at each
          ``next()``, and the device's copy stream, which devicectx makes once per
          device and shares with ``to_device(..., non_blocking=True)``. Inside a CUDA
          graph capture, do not prefetch.
    """
    _check_batches(batches)
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        msg = (
            f"prefetch(depth={depth!r}): depth is how many batches move ahead of the one "
            f"handed over, an int of at least 1\n"
            f"fix: prefetch(batches, depth=2), or depth=1 to hold the fewest batches on the "
            f"device"
        )
        raise ValueError(msg)
    if device is None:
        device = active_device() or "auto"
    target = resolve_device(device)
    compiled = compile_skip(skip, _NAME)
    prefetcher = Prefetcher(batches, target, depth, compiled, _repeats.caller_place())
    check_dtypes(dtypes)
    prefetcher._dtypes = dtypes
    prefetcher._spec = skip
    # A dtype refusal's fix: this call with dtypes= added, the caller's depth= and skip= kept.
    kept = [("depth", depth, 2), ("skip", skip, None)]
    prefetcher._suggest = call_suggest("prefetch", ("batches", repr(str(target))), kept)
    return prefetcher


def _check_batches(batches: object) -> None:
    """Refuse what cannot be the loop's batches: no iterable, or one batch (a mapping, whose
    iteration gives its keys)."""
    # Asked of the type, not by iter(): a DataLoader's iter() would start its workers.
    kind = with_article(type(batches).__name__)
    if not (hasattr(type(batches), "__iter__") or hasattr(type(batches), "__getitem__")):
        problem = f"batches is what the training loop iterates over, and {kind} is not iterable"
    elif isinstance(batches, Mapping):
        problem = f"{kind} is one batch: iterating it gives its keys, not batches"
    else:
        return
    msg = (
        f"prefetch({reprlib.repr(batches)}, ...): {problem}\n"
        f"fix: prefetch(loader, ...) with the DataLoader (or list, or generator) of batches; "
        f"to move one batch, to_device(batch, ...)"
    )
    raise TypeError(msg)


class Prefetcher(Generic[T]):
    """What :func:`prefetch` returns: ``batches`` moved to :attr:`device`, ahead of use.

    Attributes:
        device: the resolved target device.
        depth: how many batches are moved ahead, where the device has streams.
        batches: the wrapped iterable; its other attributes are read through this object.
        streams: whether batches are moved ahead, on a thread of the prefetcher's own and
            a copy stream (an accelerator with streams and events), else in order when
            asked for.
    """

    def __init__(
        self,
        batches: Iterable[T],
        device: torch.device,
        depth: int,
        skip: Skip | None,
        where: _repeats.Place,
    ) -> None:
        self.batches = batches
        self.device = device
        self.depth = depth
        self._skip = skip
        self._where = where
        self._dtypes: DtypesLike = None  # the dtype policy (devicectx.move._dtypes)
        self._suggest: Suggest | None = None  # its refusal's fix line
        self._spec: SkipLike = None  # skip= as given, quoted by the first batch's warnings
        self._streams = streams_for(device, pinned_when_read=_pins_on_the_host(batches))
        self.streams = self._streams is not None
        self._passes: weakref.WeakSet[_Pass[T]] = weakref.WeakSet()
        # An iterator has one pass, resumed by every iter(), as a generator is.
        self._shared: _Pass[T] | None = None
        self._one_pass = isinstance(batches, Iterator)

    def __iter__(self) -> Iterator[T]:
        if self._one_pass:
            if self._shared is None:
                self._shared = self._start(iter(self.batches))
            return self._shared
        return self._start(iter(self.batches))

    def _start(self, source: Iterator[Any]) -> _Pass[T]:
        started: _Pass[T] = _Pass(self, source)
        self._passes.add(started)
        return started

    def __len__(self) -> int:
        """``len()`` of the wrapped object: a ``TypeError`` where it has none."""
        return len(self.batches)  # type: ignore[arg-type]

    if not TYPE_CHECKING:  # passed through at run time; a type checker sees only our names

        def __getattr__(self, name: str) -> Any:
            # Only reached for names this object lacks: the loader's sampler, dataset, ...
            if name.startswith("__") or "batches" not in self.__dict__:
                raise AttributeError(name)
            try:
                return getattr(self.batches, name)
            except AttributeError:
                kind = type(self.batches).__qualname__
                msg = f"prefetch() object has no attribute {name!r}, nor has the {kind} it reads"
                raise AttributeError(msg) from None

    def set_epoch(self, epoch: int) -> None:
        """Tell the wrapped object (or its sampler) which epoch starts.

        The wrapped object's own ``set_epoch`` where it has one (accelerate's loaders),
        else that of its ``sampler`` and ``batch_sampler`` (a ``DistributedSampler``,
        which reshuffles per epoch only when told).

        Raises:
            AttributeError: neither the wrapped object nor its samplers have ``set_epoch``.
        """
        own = getattr(self.batches, "set_epoch", None)
        if own is not None:
            own(epoch)
            return
        told = False
        for name in ("sampler", "batch_sampler"):
            sampler = getattr(self.batches, name, None)
            for candidate in (sampler, getattr(sampler, "sampler", None)):
                if candidate is not None and hasattr(candidate, "set_epoch"):
                    candidate.set_epoch(epoch)
                    told = True
        if not told:
            kind = type(self.batches).__name__
            msg = (
                f"prefetch(...).set_epoch({epoch}): the wrapped {kind} has no set_epoch, "
                f"nor has its sampler\n"
                f"fix: leave set_epoch out for this loader, or give it a sampler that "
                f"takes one (DistributedSampler)"
            )
            raise AttributeError(msg)

    def close(self) -> None:
        """End every pass under way: their batches in flight are freed (see :meth:`_Pass.close`).

        The thread that moves the batches ends. A ``DataLoader`` or a list can be
        iterated again afterwards (a new pass, a new thread); an iterator's one pass is
        over.
        """
        for running in list(self._passes):
            running.close()
        if self._streams is not None:
            self._streams.close()

    def __repr__(self) -> str:
        return f"prefetch({_batches_text(self.batches)}, {str(self.device)!r}, depth={self.depth})"


def _batches_text(batches: object) -> str:
    """The loader as a prefetcher's repr shows it: an iterator's own repr (one line), else
    its type and length, never its batches (a notebook shows a prefetcher of a list of
    batches as a cell's last line: the list's repr printed every tensor in it).

    Example:
        >>> _batches_text([{"x": 1}] * 200), _batches_text([])
        ('<list of 200 batches>', '[]')
    """
    if isinstance(batches, Iterator):
        return repr(batches)
    kind = type(batches).__qualname__
    try:
        count = len(batches)  # type: ignore[arg-type]
    except Exception:  # no length (an iterable dataset's loader raises TypeError)
        return f"<{kind}>"
    if not count and type(batches) in (list, tuple):
        return repr(batches)
    return f"<{kind} of {count} batch{'' if count == 1 else 'es'}>"


class _InFlight:
    """A batch being moved on the copy stream: ``Streams.send``'s token, which
    ``Streams.hand_over`` redeems for the moved batch."""

    __slots__ = ("token",)

    def __init__(self, token: Any) -> None:
        self.token = token


class _Raised:
    """What the loader raised for a batch (or the hand-off of its move to the prefetcher's
    thread), kept till that batch is asked for; a move's own error comes with its batch."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _attempt(call: Callable[..., Any], *args: Any) -> tuple[Any, Exception | None]:
    """``call(*args)`` and None, or None and what it raised (``StopIteration`` included).

    Kept, the error's traceback starts in this frame, whose locals are ``call`` and its
    arguments: not the pass, which holds the error (a cycle the garbage collector alone
    would free, with the batches in flight)."""
    try:
        return call(*args), None
    except Exception as error:
        return None, error


class _Pass(Iterator[T]):
    """One pass over the wrapped iterable: what ``iter(prefetcher)`` returns.

    It holds what it needs of its prefetcher, not the prefetcher itself, which holds an
    iterator's one pass: no reference cycle keeps the batches in flight alive once both
    are dropped."""

    def __init__(self, owner: Prefetcher[T], source: Iterator[Any]) -> None:
        self._streams = owner._streams
        self._move = functools.partial(
            _move_batch,
            owner.device,
            owner._skip,
            owner._where,
            self._streams is not None,
            dtypes=owner._dtypes,
            suggest=owner._suggest,
            spec=owner._spec,
        )
        self._depth = owner.depth
        self._source: Iterator[Any] | None = source
        self._read = 0  # the index of the next batch read from the source
        self._queue: collections.deque[_InFlight | _Raised] = collections.deque()
        self._raised = 0  # how many _Raised are in the queue: no reading past one
        self._last: Any = None  # the token of the batch read last, till its move has run

    def __iter__(self) -> _Pass[T]:
        return self

    def __next__(self) -> T:
        streams = self._streams
        if streams is None:  # in order: read one, move it
            source = self._source
            if source is None:
                raise StopIteration
            batch = next(source)  # the loader's StopIteration and errors, as they are
            index = self._read
            self._read += 1
            return self._move(batch, index)  # type: ignore[no-any-return]
        self._fill(streams)
        if not self._queue:
            self._source = None
            raise StopIteration
        queue = self._queue
        if isinstance(queue[0], _Raised):
            self._raised -= 1
            error = queue.popleft().error  # type: ignore[union-attr]
            try:
                raise error  # its traceback still holds the loader's frames
            finally:
                del error
        # No local holds the batch: a loader error read ahead holds this frame (its
        # traceback reaches it), which would keep the batch until the collector runs.
        return streams.hand_over(queue.popleft().token)  # type: ignore[no-any-return, union-attr]

    def _fill(self, streams: Streams) -> None:
        """Read and move batches until ``depth + 1`` are queued (the next one and ``depth``
        after it), the source ends, or a batch raised."""
        queue = self._queue
        while len(queue) <= self._depth and not self._raised and self._source is not None:
            if self._last is not None:
                # The loader may refill the memory of the batch it handed out last (one
                # host buffer reused per batch): read it again only once that batch's move
                # has read its pageable sources. It ran during the caller's step, mostly.
                streams.sources_read(self._last)
                self._last = None
            index = self._read
            batch, error = _attempt(next, self._source)
            if isinstance(error, StopIteration):
                # Let go of it: its traceback holds this frame, which holds the pass (and
                # the prefetcher's thread) in a cycle only the collector would free.
                self._source = error = None
                return
            self._read += 1
            if error is None:
                token, error = _attempt(streams.send, self._move, batch, index)
            del batch
            if error is not None:  # the loader's: raised in its turn
                self._raised += 1
                queue.append(_Raised(error))
                error = None  # as above: its traceback holds this frame
                return
            queue.append(_InFlight(token))
            self._last = token
            # Not kept in this frame: a loader error raised next holds it (its traceback
            # reaches this frame), and with it this batch, until the collector runs.
            token = None

    def close(self) -> None:
        """Stop: the source is let go, and the batches in flight are freed, once their
        copies have landed (so that no copy writes into memory given back)."""
        self._source = None
        queue, self._queue = self._queue, collections.deque()
        self._raised = 0
        self._last = None
        streams = self._streams
        for item in queue:
            if isinstance(item, _InFlight) and streams is not None:
                streams.landed(item.token)
        queue.clear()

    def __del__(self) -> None:
        # A `break` out of a for loop drops the pass: free what it holds, as close() does.
        with contextlib.suppress(Exception):
            self.close()


def _move_batch(
    device: torch.device,
    skip: Skip | None,
    where: _repeats.Place,
    non_blocking: bool,
    batch: Any,
    index: int,
    handed: HandedTo | None = None,
    dtypes: DtypesLike = None,
    suggest: Suggest | None = None,
    spec: SkipLike = None,
) -> Any:
    """``batch`` on ``device`` through the move engine, its errors naming ``index``;
    ``non_blocking`` and ``handed`` where it is moved on a copy stream; ``spec``, the
    ``skip=`` as given (the first batch's warnings quote it)."""
    # The dtype policy: casts made (or refused, naming every path) before the move.
    batch = cast_batch(batch, device, dtypes, skip, index, suggest)
    types = () if skip is None else skip.types
    if (skip is None or not skip.slow) and _nothing_to_move(batch, device, types):
        moved = batch
    else:

        def fix(path: str) -> str:
            return f"leave it where it is: prefetch(batches, {str(device)!r}, skip=[{path!r}])"

        who = f"prefetch() at batch {index}"
        moved = _move(batch, device, non_blocking, skip, _NAME, fix, who, True, where, True, handed)
    if index == 0:
        _look_at_first(batch, moved, device, skip, spec, where)
    return moved


def _look_at_first(
    batch: Any,
    moved: Any,
    device: torch.device,
    skip: Skip | None,
    spec: SkipLike,
    where: _repeats.Place,
) -> None:
    """Warn, at the line that made the prefetcher, of what its first batch shows would go
    unseen on every batch until a step fails: ``skip=`` entries that name nothing in it
    (as :func:`~devicectx.to_device` warns), and tensors the move cannot see (held by
    objects of a type it cannot look into), left where the loader made them."""
    messages = []
    if skip is not None and (skip.keys or skip.paths):
        missing, inside = check_names(skip, batch, _NAME)
        if missing:
            messages.append(unmatched_message(spec, missing, _NAME, "prefetch()"))
        if inside:
            messages.append(inside_own_to_message(inside, device, "prefetch()"))
    arrays = arrays_only(batch) if device.type != "cpu" else None
    if arrays is not None:
        fix = (
            "make them tensors where the batches are made: torch.as_tensor(array) in the "
            "loader's collate_fn (a DataLoader's default collate_fn does it), or around the "
            "sampler's arrays"
        )
        messages.append(arrays_unmoved("prefetch() at its first batch", _NAME, arrays, device, fix))
    types = () if skip is None else skip.types
    left = [
        unseen
        for unseen in unseen_tensors([(_NAME, moved)])
        if unseen.device != device and not issubclass(unseen.holder, types)
    ]
    if left:
        paths = ", ".join(f"{unseen.path} (on {unseen.device})" for unseen in left[:3])
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        them = "it" if len(left) == 1 else "them"
        messages.append(
            f"prefetch() left {paths}{more} where the loader made {them}, in every batch: the "
            f"move does not look inside {with_article(left[0].holder.__qualname__)}\n"
            f"fix: {fix_for(left, device, argument=False)}"
        )
    origin = where.origin
    for message in messages:
        if origin is None:  # pragma: no cover - a prefetcher's place always has its line
            warnings.warn(message, DeviceWarning, stacklevel=2)
        else:
            warn_explicit_at(*origin, message, DeviceWarning)


class _Sent:
    """What a batch's move left on the copy stream: the event after its copies, the staged
    regions its small tensors' storages are slices of (``record_stream`` on such a tensor
    does not reach its region, which must be recorded itself), and the caller's stream,
    on which both are recorded as used."""

    __slots__ = ("caller", "event", "reads_later", "regions")

    def __init__(
        self, event: Any, regions: list[torch.Tensor], caller: Any, *, reads_later: bool
    ) -> None:
        self.event = event
        self.regions = regions
        self.caller = caller
        self.reads_later = reads_later  # pinned sources read by their copies, after the move


class Streams:
    """The stream work of one prefetcher: a copy stream of the device, the thread that
    moves the batches, events, hand-over.

    :func:`streams_for` makes one per prefetcher (None: move in order); the tests put a
    stand-in in its place that records what is asked of it, to check the lookahead on a
    machine without streams. ``send`` returns a token at once, which the pass hands back
    to ``hand_over`` (for the moved batch) or to ``landed`` (to let it go); ``close`` ends
    the thread.
    """

    __slots__ = ("copy", "device", "pinned_when_read", "worker")

    def __init__(
        self, device: torch.device, copy: torch.Stream, pinned_when_read: bool = False
    ) -> None:
        self.device = device
        self.copy = copy
        # The loader's pinned batches are whole when read: no device copy fills them.
        self.pinned_when_read = pinned_when_read
        self.worker = Worker(f"devicectx-prefetch-{device}")

    def send(self, move: Callable[[Any, int, HandedTo], Any], batch: Any, index: int) -> Ticket:
        """``move(batch, index)`` queued on the prefetcher's thread, to run on the copy
        stream; what it needs of the caller (the context, the current stream, and an
        event after the work queued there so far, where there is any) is taken here."""
        caller = torch.accelerator.current_stream(self.device)
        busy = None if caller.query() else caller.record_event()
        context = contextvars.copy_context()
        return self.worker.submit(context.run, self._moved, move, batch, index, caller, busy)

    def _moved(
        self,
        move: Callable[[Any, int, HandedTo], Any],
        batch: Any,
        index: int,
        caller: Any,
        busy: Any,
    ) -> tuple[Any, _Sent]:
        """On the prefetcher's thread: the move, its copies queued on the copy stream (after
        ``busy``, the caller's work queued when it was sent, where the batch needs it)."""
        copy = self.copy
        # The engine queues its copies, and allocates their results, on the current stream.
        with queued_on(copy, self.device):
            if busy is not None and _written_by_streams(batch, self.pinned_when_read):
                copy.wait_event(busy)
            handed = HandedTo(idle=busy is None)
            moved = move(batch, index, handed)
        # A loader that pins each batch anew never refills one: nothing to wait for.
        reads_later = handed.reads_later and not self.pinned_when_read
        sent = _Sent(copy.record_event(), handed.regions, caller, reads_later=reads_later)
        self._record(moved, sent.regions, caller)
        return moved, sent

    def sources_read(self, token: Ticket) -> None:
        """Wait until the move of a batch sent has read its host sources, so that the
        loader may write them again: a pageable or staged one once the move has run; a
        pinned one copied directly once the batch's copies have landed (the host waits)."""
        token.wait()
        done = token.peek()
        if done is not None and done[1].reads_later:
            done[1].event.synchronize()

    def hand_over(self, token: Ticket) -> Any:
        """The moved batch, made safe on the caller's current stream: it waits for the
        copies (the device waits, not the host), and the batch's memory, with the staged
        regions it lies in, is recorded as used there. Raises the move's error."""
        moved, sent = token.take()
        consumer = torch.accelerator.current_stream(self.device)
        consumer.wait_event(sent.event)
        if consumer != sent.caller:  # recorded on the stream current at send already
            self._record(moved, sent.regions, consumer)
        return moved

    def _record(self, batch: Any, regions: list[torch.Tensor], stream: Any) -> None:
        """Record ``batch``'s device memory, and ``regions``, as used on ``stream``."""
        for region in regions:
            region.record_stream(stream)
        device_type = self.device.type
        found, inside, _ = collect(batch)
        for tensors in (found, inside):
            for tensor in tensors.values():
                if tensor.device.type == device_type:
                    tensor.record_stream(stream)

    def close(self) -> None:
        """End the prefetcher's thread, after the moves queued; a later send starts another."""
        self.worker.stop()

    def landed(self, token: Ticket) -> None:
        """Wait until the move of a batch sent has run and its copies have landed, and let
        the batch go (not on the prefetcher's own thread, whose jobs it would wait for)."""
        if self.worker.here():
            return
        try:
            _, sent = token.take()
        except Exception:  # a batch that could not be moved: nothing was left in flight
            return
        sent.event.synchronize()


def _written_by_streams(batch: Any, pinned_when_read: bool = False) -> bool:
    """Whether a stream may still be writing a source of ``batch``: one on a device, or a
    pinned one (``.to("cpu", non_blocking=True)`` fills pinned memory later) unless the
    loader pinned it itself (``pinned_when_read``). The copies of such a batch wait for
    the caller's stream; a batch of pageable host tensors (a ``DataLoader`` without
    ``pin_memory``) is read by the host alone, and its copies need not wait for the steps
    queued before them: that wait would hold every staging chunk until the device is done
    with those steps, and the host with them, and for pinned batches it leaves nothing to
    overlap."""
    found, inside, _ = collect(batch)
    for tensors in (found, inside):
        for tensor in tensors.values():
            if not tensor.is_cpu or (not pinned_when_read and tensor.is_pinned()):
                return True
    return False


def _pins_on_the_host(batches: object) -> bool:
    """Whether ``batches`` is a ``DataLoader`` whose pinned batches no device copy can be
    filling: ``pin_memory=True`` with workers, whose batches its pin-memory thread copies
    from the workers' shared memory into pinned memory of their own, on the host, before
    handing them out. (Without workers, a dataset's own pinned tensor, which may be a
    device copy's destination, is handed out as it is.)"""
    return (
        isinstance(batches, torch.utils.data.DataLoader)
        and bool(batches.pin_memory)
        and batches.num_workers > 0
    )


def streams_for(device: torch.device, pinned_when_read: bool = False) -> Streams | None:
    """The :class:`Streams` of a new prefetcher to ``device``; None where the device has no
    streams (or no events, or no ``record_stream``), and batches move in order.
    ``pinned_when_read``: the loader's pinned batches are whole when read (see
    :func:`_pins_on_the_host`), and their copies need not wait for the caller's stream."""
    if device.type in _NO_STREAMS or device.type != accelerator_type():
        return None
    copy = copy_stream(device)
    return None if copy is None else Streams(device, copy, pinned_when_read)
