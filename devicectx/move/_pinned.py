"""Pinned host memory for staged moves: reusable buffers, each reused only once the copies
through it have finished.

One :class:`Pool` per accelerator type holds *chunks*: page-locked host buffers of one
size, which the accelerator's copy engine reads (or writes) at the speed of the link. A
move takes a chunk, fills it, queues its copies, and gives the chunk back with an event
recorded after them (:meth:`Pool.release`); the next move that takes the chunk first asks
that event whether the copies have finished (:meth:`Pool.acquire`), and waits on that
event alone, never on the device, only when every chunk is busy and the pool is full. A
chunk is held by one move at a time, under a lock, so threads never share one in flight
(asyncio tasks cannot: a move never awaits).

Public: :func:`staging_memory` and :func:`release_staging`.

The accelerator is torch's current one (as :func:`devicectx.devices._resolve.accelerator_type`
asks the driver, the one place that does); pinned memory comes from
``torch.empty(..., pin_memory=True)``, which pins for it, events from ``torch.Event`` and
streams from ``torch.accelerator.current_stream``: all there since torch 2.6, the floor.
Where pinning fails (no pinned allocator for that accelerator, or a transient failure:
pinned memory exhausted, a graph being captured), :func:`host_for` says None and moves go
tensor by tensor; a failure is asked again after a back-off of moves (64, doubling to
65,536), never cached for the process. Allocations (the probe, a chunk) are made with the
move's target device current, so that a first move to ``cuda:k`` creates no context on
another GPU (torch pins through the current device's context).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from devicectx.devices._resolve import accelerator_type
from devicectx.move._staging._state import STATE
from devicectx.move._streams import copy_stream

__all__ = ["Host", "Pool", "host_for", "release_staging", "staging_memory"]


class Chunk:
    """One staging buffer, and the event recorded after the last copies through it."""

    __slots__ = ("buffer", "event", "event_device", "generation", "views")

    def __init__(self, buffer: torch.Tensor, generation: int) -> None:
        self.buffer = buffer
        self.event: Any = None
        self.event_device: torch.device | None = None
        self.generation = generation
        self.views: dict[torch.dtype, torch.Tensor] = {}

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The buffer seen as ``dtype`` (its size is a multiple of every element size)."""
        view = self.views.get(dtype)
        if view is None:
            with torch.inference_mode(False):  # kept: usable in and out of inference mode
                view = self.views[dtype] = self.buffer.view(dtype)
        return view


Event = Any
"""A ``torch.Event``, or anything with its ``record(stream)``, ``query()`` and
``synchronize()``."""


class Pool:
    """Host buffers of ``chunk_bytes`` each, at most ``limit_bytes`` of them in all.

    ``allocate(n)`` makes a buffer of ``n`` bytes (pinned, for an accelerator), and
    ``new_event(device)`` an event for copies on that device.
    """

    def __init__(
        self,
        allocate: Callable[[int], torch.Tensor],
        new_event: Callable[[torch.device], Event],
        chunk_bytes: int,
        limit_bytes: int,
    ) -> None:
        self.allocate = allocate
        self.new_event = new_event
        self.chunk_bytes = chunk_bytes
        self.limit_bytes = max(limit_bytes, chunk_bytes)
        self.held_bytes = 0
        self.generation = 0
        self.free: list[Chunk] = []  # in the order they were given back: oldest first
        self.changed = threading.Condition(threading.Lock())
        self.backoff = Backoff()  # after a chunk could not be allocated

    def acquire(self, device: torch.device | None = None) -> Chunk:
        """A chunk for this move alone, whose earlier copies have all finished.

        A finished chunk if there is one; else a new one while the pool is under its
        limit (allocated with ``device`` current); else the chunk given back first, once
        its event says its copies are done. Blocks only when every chunk is held by
        another thread's move, until one comes back. Where a new chunk cannot be
        allocated, it waits for one held, as if the pool were full, and raises only where
        the pool holds none (the allocator's error; the pool then backs off).
        """
        with self.changed:
            while True:
                for index, chunk in enumerate(self.free):
                    if chunk.event is None or chunk.event.query():
                        return self.free.pop(index)
                room = self.held_bytes + self.chunk_bytes <= self.limit_bytes
                if room and self.backoff.ready():
                    try:
                        # Not an inference tensor, even for a move in inference mode:
                        # later moves outside it write into the buffer.
                        with torch.inference_mode(False), current(device):
                            buffer = self.allocate(self.chunk_bytes)
                    except Exception:
                        self.backoff.failed()
                        if not self.held_bytes:
                            raise
                    else:
                        self.backoff.succeeded()
                        self.held_bytes += self.chunk_bytes
                        return Chunk(buffer, self.generation)
                if self.free:
                    oldest = self.free.pop(0)
                    break
                if not self.held_bytes:  # released meanwhile, and backing off
                    msg = "no pinned staging memory: an allocation failed recently"
                    raise RuntimeError(msg)
                self.changed.wait()
        try:
            oldest.event.synchronize()  # waits for that chunk's copies, not for the device
        except BaseException:
            # Interrupted (Ctrl-C in a notebook lands here, where a large move waits):
            # the chunk goes back first in line. Lost, it stayed counted as held, and
            # once such chunks filled the pool every later move waited for ever.
            with self.changed:
                if oldest.generation == self.generation:
                    self.free.insert(0, oldest)
                else:
                    self.held_bytes -= self.chunk_bytes
                self.changed.notify()
            raise
        return oldest

    def release(self, chunk: Chunk, device: torch.device | None, stream: Any) -> Event | None:
        """Give ``chunk`` back, with an event recorded on ``stream`` after its copies.

        ``device`` and ``stream``: where the copies were queued; None where they have
        all finished already (a blocking copy, or one the caller has waited for).

        Returns the event recorded (None where none was): read here, before the chunk is
        back in the free list, since another thread's move may record it again at once.
        """
        event = None
        if device is not None:
            try:
                if chunk.event is None or chunk.event_device != device:
                    chunk.event = self.new_event(device)  # records on its own device only
                    chunk.event_device = device
                event = chunk.event
                event.record(stream)
            except Exception:
                # No event (a device without them, or none for now): the chunk cannot be
                # known free again, so the pool lets it go (torch's pinned allocator keeps
                # memory a copy still reads) and backs off; the caller moves tensor by tensor.
                with self.changed:
                    self.held_bytes -= self.chunk_bytes
                    self.backoff.failed()
                    self.changed.notify()
                raise
        with self.changed:
            if chunk.generation == self.generation:
                self.free.append(chunk)
            else:  # released meanwhile: torch's pinned allocator keeps it till its copies end
                self.held_bytes -= self.chunk_bytes
            self.changed.notify()
        return event

    def clear(self) -> int:
        """Drop every chunk not in use now, and those in use when they come back; the
        bytes dropped now."""
        with self.changed:
            dropped = len(self.free) * self.chunk_bytes
            self.free.clear()
            self.held_bytes -= dropped
            self.generation += 1
            return dropped


class Host:
    """What a staged move needs for one accelerator type: its pool, streams, pinning.

    ``stream(device)`` is the device's current stream, where blocking moves queue their
    copies; ``side(device)`` the device's copy stream, where non-blocking moves queue
    theirs (None: none, and they queue on the current stream too); ``pinned(tensor)``
    whether a host tensor is pinned; ``idle(device)`` whether the current stream has
    finished all the work queued on it (a query, not a wait): where it has not, a pinned
    source may still be the target of a copy from the device queued there
    (``.to("cpu", non_blocking=True)`` hands back pinned memory), which the host must not
    read before the stream gets there.
    """

    __slots__ = ("idle", "pinned", "pool", "side", "stream")

    def __init__(
        self,
        pool: Pool,
        stream: Callable[[torch.device], Any],
        pinned: Callable[[torch.Tensor], bool],
        idle: Callable[[torch.device], bool] | None = None,
        side: Callable[[torch.device], Any] | None = None,
    ) -> None:
        self.pool = pool
        self.stream = stream
        self.pinned = pinned
        self.idle = idle or _always_idle
        self.side = side or _no_side


def _always_idle(device: torch.device) -> bool:
    return True


def _no_side(device: torch.device) -> None:
    return None


class Backoff:
    """After a failure, skip the next 64 tries, then 128, ... up to 65,536: a transient
    failure (pinned memory exhausted for a while, a graph capture) is retried, and a
    lasting one costs one try in many."""

    __slots__ = ("skip", "wait")

    FIRST, LAST = 64, 65_536

    def __init__(self) -> None:
        self.skip = 0  # tries still to skip
        self.wait = 0  # the skip set at the last failure

    def ready(self) -> bool:
        """Whether to try now; a False counts as a try skipped."""
        if not self.skip:
            return True
        self.skip -= 1
        return False

    def failed(self) -> None:
        self.wait = min(self.wait * 2, self.LAST) if self.wait else self.FIRST
        self.skip = self.wait

    def succeeded(self) -> None:
        self.skip = self.wait = 0


def current(device: torch.device | None) -> contextlib.AbstractContextManager[Any]:
    """``device`` made its accelerator's current device for a block (a no-op for None or
    a device without an index). Restored after without creating a context on the device
    restored, as ``torch.cuda.device`` does (``torch.accelerator.device_index`` from
    torch 2.8; before it, the accelerator module's own ``device`` context)."""
    if device is None or device.index is None or device.type in ("cpu", "meta"):
        return contextlib.nullcontext()
    guard = getattr(torch.accelerator, "device_index", None)
    if guard is None:
        guard = getattr(getattr(torch, device.type, None), "device", None)
    return contextlib.nullcontext() if guard is None else guard(device.index)


_LOCK = threading.Lock()


def host_for(
    device_type: str, chunk_bytes: int, limit_bytes: int, device: torch.device | None = None
) -> Host | None:
    """The :class:`Host` for an accelerator type; None where its memory cannot be pinned.

    Worked out once where the type is not torch's current accelerator (torch pins for
    that one alone); a probe that fails (no pinned allocator, or none for now) is tried
    again after a back-off. ``device``: the move's target, made current for the probe.
    """
    hosts = STATE.hosts
    try:
        return hosts[device_type]
    except KeyError:
        pass
    with _LOCK:
        if device_type in hosts:
            return hosts[device_type]
        try:
            current_type = accelerator_type()
        except Exception:  # no accelerator runtime
            current_type = None
        if current_type != device_type:  # torch pins for its current accelerator only
            hosts[device_type] = None
            return None
        backoff = STATE.backoff.setdefault(device_type, Backoff())
        if not backoff.ready():
            return None
        try:
            with current(device):
                _pinned_buffer(1)  # the allocator is there
                if device is not None:  # and events, which tell when a chunk is free again
                    _probe_events(device)
        except Exception:  # no pinned allocator for it, or none for now
            backoff.failed()
            return None
        del STATE.backoff[device_type]
        pool = Pool(_pinned_buffer, _new_event, chunk_bytes, limit_bytes)
        hosts[device_type] = host = Host(pool, _current_stream, _is_pinned, _idle, copy_stream)
        return host


def never(device_type: str) -> bool:
    """Whether :func:`host_for` settled that ``device_type`` has no host, for good."""
    hosts = STATE.hosts
    return device_type in hosts and hosts[device_type] is None


def _current_stream(device: torch.device) -> Any:
    return torch.accelerator.current_stream(device)


def _probe_events(device: torch.device) -> None:
    """Raise where ``device`` has no events. Its copy stream, where it has one, was made
    with an event recorded; else one is recorded on its current stream. Never on the
    caller's stream where another will do: the move that probes next asks whether that
    stream is idle, and packs pinned sources only if so (so that the caller may change
    them once it returns), which a probe of our own still pending there would deny."""
    if copy_stream(device) is None:
        _new_event(device).record(_current_stream(device))


def _idle(device: torch.device) -> bool:
    return bool(torch.accelerator.current_stream(device).query())


def _pinned_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _new_event(device: torch.device) -> Event:
    return torch.Event(device=device)


def _is_pinned(tensor: torch.Tensor) -> bool:
    return tensor.is_pinned()


def register(name: str, host: Host) -> None:
    """Make ``host`` the one for ``name`` (tests, through :mod:`devicectx.move._staging`)."""
    with _LOCK:
        STATE.hosts[name] = host


def unregister(name: str) -> None:
    """Forget the host for ``name``, its buffers with it."""
    with _LOCK:
        STATE.hosts.pop(name, None)


def staging_memory() -> int:
    """Bytes of pinned host memory devicectx holds for staged moves, in use or kept for reuse.

    Example:
        >>> import devicectx
        >>> devicectx.staging_memory()  # doctest: +SKIP
        4194304

    The pool grows with need up to a bound (64 MiB per accelerator type, see
    :class:`devicectx.move._staging.Thresholds`), and keeps what it has for the next move.
    """
    with _LOCK:
        hosts = [host for host in STATE.hosts.values() if host is not None]
    return sum(host.pool.held_bytes for host in hosts)


def release_staging() -> int:
    """Let go of the pinned memory kept for staged moves; returns the bytes let go.

    Example:
        >>> import devicectx
        >>> released = devicectx.release_staging()  # after a staged move: 4194304, say
        >>> devicectx.staging_memory()
        0

    Buffers a move is using now are let go when it is done with them. Safe at any time:
    a copy still in flight keeps its buffer (torch's pinned allocator waits for it).
    The memory goes back to torch's pinned-memory cache, which torch reuses for other
    pinned allocations; ``torch.accelerator.empty_host_cache()`` (torch >= 2.12) hands
    that cache back to the system. The next staged move allocates again.
    """
    with _LOCK:
        hosts = [host for host in STATE.hosts.values() if host is not None]
    return sum(host.pool.clear() for host in hosts)


_ORPHANS: list[Host | None] = []


def _forget_in_child() -> None:
    # A forked child cannot use its parent's accelerator context, nor the pinned memory
    # registered with it: it starts from nothing, and never frees the parent's buffers
    # (freeing them would call into that context), which it keeps unreachable instead.
    global _LOCK
    _LOCK = threading.Lock()
    _ORPHANS.extend(STATE.hosts.values())
    STATE.hosts.clear()
    STATE.backoff.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
