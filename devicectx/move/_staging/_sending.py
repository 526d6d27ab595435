"""Host tensors to an accelerator, staged: packed into pinned chunks, sent on streams."""

from __future__ import annotations

from typing import Any

import torch

from devicectx.move import _pinned, _streams
from devicectx.move._staging._layout import (
    Thresholds,
    _aligned,
    _flat,
    _Key,
    _pack,
    _regions,
    _sort,
    _unpack,
)

__all__ = ["HandedTo", "to_accelerator"]


def _capturing(device_type: str) -> bool:
    """Whether the device's current stream is being captured into a graph (CUDA graphs):
    events and host copies have no place there."""
    module = getattr(torch, device_type, None)
    capturing = getattr(module, "is_current_stream_capturing", None)
    return bool(capturing()) if capturing is not None else False


def to_accelerator(
    found: dict[int, torch.Tensor],
    inside: dict[int, torch.Tensor],
    device: torch.device,
    non_blocking: bool,
    thresholds: Thresholds,
    host: _pinned.Host,
    copy_stream: bool = True,
    handed: HandedTo | None = None,
) -> dict[int, torch.Tensor]:
    """Host tensors of ``found`` on ``device``, staged: ``{id(source): result}``; empty
    where staging would not pay (see :class:`Thresholds`). ``copy_stream``: as
    :attr:`~devicectx.move._staging._state.StagingState.copy_stream`; ``handed``: see
    :class:`HandedTo`.

    Pinned sources are packed only while the device's current stream is idle: else a
    copy from the device into one may still be queued there (``.to("cpu",
    non_blocking=True)`` returns pinned memory before the copy lands), and the host would
    read it too early. They then move one by one, with ``.to``, ordered on that stream.

    Larger pinned sources are copied with ``.to``, as the per-tensor move copies them, on
    the current stream, and first: the link is busy with them while the host packs the
    rest, instead of idle until it is done.
    """
    pinned: dict[int, bool] = {}  # id -> is_pinned(), asked once a move
    if not _worth(found, thresholds, host, pinned) or _capturing(device.type):
        return {}  # the cheaper question first: most declines are for want of tensors
    groups, larger = _sort(found, inside, _on_host, thresholds.share_max_bytes)
    idle = host.idle(device) if handed is None else handed.idle
    if not idle:
        groups = _unpinned(groups, host, pinned)
    streamed: list[torch.Tensor] = []
    direct: list[torch.Tensor] = []
    for tensor in larger:
        (direct if _is_pinned(tensor, host, pinned) else streamed).append(tensor)
    if (
        sum(map(len, groups.values())) < thresholds.min_tensors
        and sum(tensor.nbytes for tensor in streamed) < thresholds.stage_min_bytes
    ):
        return {}
    # Queued now, waited for with the staged copies where the move blocks (the same stream,
    # or the caller's stream after the copy stream's event).
    results = {id(tensor): tensor.to(device, non_blocking=True) for tensor in direct}
    if direct and handed is not None:
        handed.reads_later = True
    # Behind work queued on the current stream, the copies would wait for it, and the
    # chunks with them: a non-blocking move sends them on the copy stream. On an idle
    # stream they start at once anyway, and the copy stream's hand-over would cost more;
    # a move handed to a caller (prefetch's) is on the copy stream already.
    side = None
    if non_blocking and not idle and handed is None and copy_stream:
        side = host.side(device)
    made = None if handed is None else handed.regions
    if side is None:
        stream = host.stream(device)
        sent = _send(groups, streamed, device, thresholds, host, stream, non_blocking, None, made)
    else:
        with _streams.queued_on(side, device) as consumer:
            sent = _send(groups, streamed, device, thresholds, host, side, True, consumer, made)
        if sent:
            # The caller's stream runs its later work after the copies, and the results'
            # memory, allocated on the copy stream, is not reused before that work has run.
            consumer.wait_event(side.record_event())
    results.update(sent)
    return results


def _send(
    groups: dict[_Key, list[torch.Tensor]],
    streamed: list[torch.Tensor],
    device: torch.device,
    thresholds: Thresholds,
    host: _pinned.Host,
    stream: Any,
    non_blocking: bool,
    consumer: Any = None,
    made: list[torch.Tensor] | None = None,
) -> dict[int, torch.Tensor]:
    """Pack ``groups`` into shared regions and stream ``streamed`` through the chunks, the
    copies queued on ``stream`` (the current one); ``{id(source): result}``. ``consumer``:
    the stream the results are used on, where that is another (their memory is recorded as
    used there). The regions go into ``made``, where it is a list (:class:`HandedTo`)."""
    results: dict[int, torch.Tensor] = {}
    sender = _Sender(host, device, stream)
    try:
        for size, runs in _regions(groups, thresholds.shared_bytes):
            padded = _aligned(size)
            chunk, start = sender.space(padded, whole=True)
            for run in runs:
                _pack(chunk.typed(run.dtype), start, run)
            # copy=True: a new tensor even where the target is the host itself (tests).
            region = chunk.buffer[start : start + padded].to(device, non_blocking=True, copy=True)
            if consumer is not None:
                region.record_stream(consumer)
            if made is not None:
                made.append(region)
            sender.used(padded)
            for run in runs:
                _unpack(region, run, results)
        for tensor in streamed:
            result = results[id(tensor)] = sender.alone(tensor)
            if consumer is not None:
                result.record_stream(consumer)
    finally:
        event = sender.done()
    if not non_blocking and event is not None:
        event.synchronize()  # as .to(non_blocking=False): the copies have landed
    return results


def _worth(
    found: dict[int, torch.Tensor],
    thresholds: Thresholds,
    host: _pinned.Host,
    pinned: dict[int, bool],
) -> bool:
    """Whether a staged move may pay, asked before the sort in one cheap pass: at least
    ``min_tensors`` small tensors, or ``stage_min_bytes`` of larger ones in pageable
    memory. It may say yes where the sort then finds less (tensors that require grad,
    say), never no where the sort would find enough: a move it declines pays this pass
    alone (and one ``is_pinned`` per larger host tensor, kept in ``pinned``)."""
    small = pageable = 0
    share_max, enough_small = thresholds.share_max_bytes, thresholds.min_tensors
    for tensor in found.values():
        try:
            nbytes = tensor.nbytes
        except RuntimeError:  # a sparse COO tensor has none (torch raises); never staged
            continue
        if nbytes <= share_max:
            small += 1
            if small >= enough_small:
                return True
        elif tensor.is_cpu and not _is_pinned(tensor, host, pinned):
            pageable += nbytes
            if pageable >= thresholds.stage_min_bytes:
                return True
    return False


def _is_pinned(tensor: torch.Tensor, host: _pinned.Host, pinned: dict[int, bool]) -> bool:
    known = pinned.get(id(tensor))
    if known is None:
        known = pinned[id(tensor)] = host.pinned(tensor)
    return known


def _unpinned(
    groups: dict[_Key, list[torch.Tensor]], host: _pinned.Host, pinned: dict[int, bool]
) -> dict[_Key, list[torch.Tensor]]:
    """``groups`` without their pinned tensors."""
    kept: dict[_Key, list[torch.Tensor]] = {}
    for key, members in groups.items():
        pageable = [tensor for tensor in members if not _is_pinned(tensor, host, pinned)]
        if pageable:
            kept[key] = pageable
    return kept


class HandedTo:
    """A move made on another current stream (a copy stream) for a stream of the target
    that gets the results later (:func:`devicectx.prefetch`'s caller), passed down to
    :func:`stage`: whether that stream was ``idle`` when the move was asked for;
    ``regions``, which gets the device regions the move makes; and ``reads_later``, set
    where a pinned source is copied directly (its memory read after the move returns).

    Pinned sources are then packed only if that stream was idle, not the current one: a
    copy from the device into one may be queued there. And the regions are for the
    caller to record as used on the stream the results are handed to: ``record_stream``
    on a result itself does not reach its region, since a result's storage is a slice of
    the region's (see :func:`_unpack`), which the allocator does not know; recorded, the
    region's memory is not reused before that stream is done with it, whenever its last
    result is freed.
    """

    __slots__ = ("idle", "reads_later", "regions")

    def __init__(self, idle: bool) -> None:
        self.idle = idle
        self.regions: list[torch.Tensor] = []
        # Whether a pinned source was copied directly, to be read by its copy after the
        # move returns (a staged one is read by the move itself).
        self.reads_later = False


class _Sender:
    """The chunk being filled by one move, taken from the pool and given back to it."""

    __slots__ = ("chunk", "device", "host", "position", "stream")

    def __init__(self, host: _pinned.Host, device: torch.device, stream: Any) -> None:
        self.host = host
        self.device = device
        self.stream = stream
        self.chunk: _pinned.Chunk | None = None
        self.position = 0

    def space(self, nbytes: int, *, whole: bool) -> tuple[_pinned.Chunk, int]:
        """The current chunk and where the next bytes go in it: ``nbytes`` of room if
        ``whole``, else at least some (the next chunk when this one is full)."""
        start = _aligned(self.position)
        if self.chunk is None or start + (nbytes if whole else 1) > self.host.pool.chunk_bytes:
            self._next()
            start = 0
        assert self.chunk is not None
        self.position = start
        return self.chunk, start

    def used(self, nbytes: int) -> None:
        self.position += nbytes

    def alone(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the device, in memory of its own, through the chunks: each part
        is packed while the one before is on its way."""
        shape, stride, dtype = tensor.shape, tensor.stride(), tensor.dtype
        result = torch.empty_strided(shape, stride, dtype=dtype, device=self.device)
        nbytes, itemsize = tensor.nbytes, tensor.element_size()
        chunk_bytes = self.host.pool.chunk_bytes
        if nbytes <= chunk_bytes:  # in one piece, laid out as it is
            chunk, start = self.space(nbytes, whole=True)
            staging = chunk.typed(dtype).as_strided(shape, stride, start // itemsize)
            staging.copy_(tensor)
            result.copy_(staging, non_blocking=True)
            self.used(nbytes)
            return result
        source, target = _flat(tensor), _flat(result)
        numel, done = tensor.numel(), 0
        while done < numel:
            chunk, start = self.space(itemsize, whole=False)
            count = min(numel - done, (chunk_bytes - start) // itemsize)
            staging = chunk.typed(dtype).narrow(0, start // itemsize, count)
            staging.copy_(source.narrow(0, done, count))
            target.narrow(0, done, count).copy_(staging, non_blocking=True)
            self.used(count * itemsize)
            done += count
        return result

    def _next(self) -> None:
        if self.chunk is not None:
            self.host.pool.release(self.chunk, self.device, self.stream)
        self.chunk = None
        self.chunk = self.host.pool.acquire(self.device)

    def done(self) -> Any:
        """Give the chunk back; the event after this move's copies (None if none)."""
        chunk, self.chunk = self.chunk, None
        if chunk is None:
            return None
        return self.host.pool.release(chunk, self.device, self.stream)


def _on_host(tensor: torch.Tensor) -> bool:
    return tensor.is_cpu
