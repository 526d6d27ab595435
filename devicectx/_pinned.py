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

The accelerator is torch's current one (as :func:`devicectx._resolve.accelerator_type`
asks the driver, the one place that does); pinned memory comes from
``torch.empty(..., pin_memory=True)``, which pins for it, events from ``torch.Event`` and
streams from ``torch.accelerator.current_stream``: all there since torch 2.6, the floor.
Where pinning fails (no pinned allocator for that accelerator), :func:`host_for` says
None and moves go tensor by tensor.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from devicectx._resolve import accelerator_type

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

    def acquire(self) -> Chunk:
        """A chunk for this move alone, whose earlier copies have all finished.

        A finished chunk if there is one; else a new one while the pool is under its
        limit; else the chunk given back first, once its event says its copies are done.
        Blocks only when every chunk is held by another thread's move, until one comes back.
        """
        with self.changed:
            while True:
                for index, chunk in enumerate(self.free):
                    if chunk.event is None or chunk.event.query():
                        return self.free.pop(index)
                if self.held_bytes + self.chunk_bytes <= self.limit_bytes:
                    # Not an inference tensor, even for a move in inference mode: later
                    # moves outside it write into the buffer.
                    with torch.inference_mode(False):
                        buffer = self.allocate(self.chunk_bytes)
                    self.held_bytes += self.chunk_bytes
                    return Chunk(buffer, self.generation)
                if self.free:
                    oldest = self.free.pop(0)
                    break
                self.changed.wait()
        oldest.event.synchronize()  # waits for that chunk's copies, not for the device
        return oldest

    def release(self, chunk: Chunk, device: torch.device | None, stream: Any) -> None:
        """Give ``chunk`` back, with an event recorded on ``stream`` after its copies.

        ``device`` and ``stream``: where the copies were queued; None where they have
        all finished already (a blocking copy, or one the caller has waited for).
        """
        if device is not None:
            if chunk.event is None or chunk.event_device != device:
                chunk.event = self.new_event(device)  # an event records on its own device only
                chunk.event_device = device
            chunk.event.record(stream)
        with self.changed:
            if chunk.generation == self.generation:
                self.free.append(chunk)
            else:  # released meanwhile: torch's pinned allocator keeps it till its copies end
                self.held_bytes -= self.chunk_bytes
            self.changed.notify()

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
    """What a staged move needs for one accelerator type: its pool, streams, pinning."""

    __slots__ = ("pinned", "pool", "stream")

    def __init__(
        self,
        pool: Pool,
        stream: Callable[[torch.device], Any],
        pinned: Callable[[torch.Tensor], bool],
    ) -> None:
        self.pool = pool
        self.stream = stream
        self.pinned = pinned


_HOSTS: dict[str, Host | None] = {}
_LOCK = threading.Lock()


def host_for(device_type: str, chunk_bytes: int, limit_bytes: int) -> Host | None:
    """The :class:`Host` for an accelerator type; None where its memory cannot be pinned
    (it is not torch's current accelerator, or has no pinned allocator). Worked out once."""
    try:
        return _HOSTS[device_type]
    except KeyError:
        pass
    with _LOCK:
        if device_type not in _HOSTS:
            _HOSTS[device_type] = _make_host(device_type, chunk_bytes, limit_bytes)
        return _HOSTS[device_type]


def _make_host(device_type: str, chunk_bytes: int, limit_bytes: int) -> Host | None:
    try:
        if accelerator_type() != device_type:  # torch pins for its current accelerator only
            return None
        torch.empty(1, dtype=torch.uint8, pin_memory=True)  # the allocator is there
    except Exception:  # no accelerator runtime, or no pinned allocator for it
        return None
    pool = Pool(_pinned_buffer, _new_event, chunk_bytes, limit_bytes)
    return Host(pool, torch.accelerator.current_stream, _is_pinned)


def _pinned_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _new_event(device: torch.device) -> Event:
    return torch.Event(device=device)


def _is_pinned(tensor: torch.Tensor) -> bool:
    return tensor.is_pinned()


def register(name: str, host: Host) -> None:
    """Make ``host`` the one for ``name`` (tests, through :mod:`devicectx._staging`)."""
    with _LOCK:
        _HOSTS[name] = host


def unregister(name: str) -> None:
    """Forget the host for ``name``, its buffers with it."""
    with _LOCK:
        _HOSTS.pop(name, None)


def staging_memory() -> int:
    """Bytes of pinned host memory devicectx holds for staged moves, in use or kept for reuse.

    Example:
        >>> import devicectx
        >>> devicectx.staging_memory()  # doctest: +SKIP
        4194304

    The pool grows with need up to a bound (64 MiB per accelerator type, see
    :class:`devicectx._staging.Thresholds`), and keeps what it has for the next move.
    """
    with _LOCK:
        hosts = [host for host in _HOSTS.values() if host is not None]
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
        hosts = [host for host in _HOSTS.values() if host is not None]
    return sum(host.pool.clear() for host in hosts)


_ORPHANS: list[Host | None] = []


def _forget_in_child() -> None:
    # A forked child cannot use its parent's accelerator context, nor the pinned memory
    # registered with it: it starts from nothing, and never frees the parent's buffers
    # (freeing them would call into that context), which it keeps unreachable instead.
    global _LOCK
    _LOCK = threading.Lock()
    _ORPHANS.extend(_HOSTS.values())
    _HOSTS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
