"""Staged moves: many tensors to an accelerator (or back) in a few large copies.

Copying tensors one by one from host memory to an accelerator pays twice: a fixed cost per
copy (about 9 us on an H100), and, from ordinary (pageable) memory, the driver's own slow
staging (6 to 13 GB/s there, against 52 GB/s from pinned memory). A staged move packs the
tensors into a reused pinned buffer with torch's own (multi-threaded) copies, sends the
buffer in as few copies as it can, and hands back tensors on the device:

- *small* tensors (:attr:`Thresholds.share_max_bytes` or less) are packed side by side,
  sent in one copy per region of at most :attr:`Thresholds.shared_bytes`, and come back
  as views of that region's device memory: they share it, and one kept alive keeps its
  region alive (that much at most);
- *larger* tensors from pageable memory are streamed through the pinned buffer, chunk by
  chunk (the next chunk is packed while the last one is on its way), into device memory
  of their own, as ``.to`` would allocate it;
- larger tensors already pinned, and every tensor the staged path cannot copy faithfully,
  are left to the per-tensor move (:class:`~devicectx.move._alias.TensorMover`).

Back to the host (a ``cpu`` target), small accelerator tensors are packed on the device,
copied out in one blocking copy into pinned memory, and copied from there into host
memory of their own, one region per :attr:`Thresholds.shared_bytes` as above.

Faithful: only plain ``torch.Tensor`` objects are staged, that need no autograd history
(``requires_grad`` is False), strided, dense (their elements fill a block of memory: a
contiguous or ``channels_last`` tensor, not an ``expand`` or a strided slice), not empty,
of the ordinary dtypes, and no conjugate or negative view. They come back with their
dtype, shape and exact strides (the memory format kept, as ``.to`` keeps it). A tensor
whose base is also in the structure is left to the per-tensor move, which makes it a view
of the moved base; a base with views in the structure gets memory of its own, so that its
views' ``_base`` is the moved tensor itself. Views of one absent base are staged only
where they do not overlap (then ``.to`` copies each alone too).

Safe: the sources have been copied into the staging buffer when the move returns, so the
caller may change them at once, even with ``non_blocking=True``. The copies to the device
are queued on the device's current stream, and with ``non_blocking=False`` waited for, as
``.to`` does; but a ``non_blocking=True`` move made while the current stream has work
queued (a query) queues them on the device's copy stream instead
(:mod:`devicectx.move._streams`), results allocated there: they start at once instead of
behind that work, and their chunks are free again when they land; the current stream
then waits on an event after them (the device waits, not the host), and the results'
memory is recorded as used on it, so the caller uses them there as it would ``.to``'s.
The buffers come from :mod:`devicectx.move._pinned`.

:func:`stage` is the move engine's entry; :func:`forced` the seam through which tests take
this path on any device (packing into ordinary host memory), and check it without one.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from itertools import pairwise
from typing import Any, NamedTuple

import torch

from devicectx._torch.tensors import storage_slice
from devicectx.devices._resolve import accelerator_type
from devicectx.move import _pinned, _streams
from devicectx.move._alias import dense
from devicectx.move._staging._state import STATE, swapped
from devicectx.move._walk import collect

__all__ = [
    "FORCED_THRESHOLDS",
    "THRESHOLDS",
    "HandedTo",
    "Staged",
    "Thresholds",
    "forced",
    "forget_accelerator",
    "stage",
    "to_accelerator",
    "to_host",
]

_Tensor = torch.Tensor
_ALIGN = 16  # every run of packed tensors starts here: the largest element size, complex128
_KIB = 1024
_MIB = 1024 * _KIB

# Dtypes every copy, stack and view used here supports on every device torch has. Not the
# quantized ones, float8, complex32, nor the unsigned types past uint8: those move one by one.
_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """When a move is staged, and how; every figure from an NVIDIA H100 (PCIe Gen5, torch
    2.11, issue 13): a fixed cost of about 9 us per host-to-device copy, 6 to 13 GB/s from
    pageable memory, about 52 GB/s from pinned memory in one contiguous copy.

    Attributes:
        min_tensors: a move is staged when it has at least this many small tensors to
            pack. A staged move has a fixed host cost (collecting the tensors, one stack
            and one unbind per run of like tensors, a region, an event): measured through
            the test seam on a 2-core machine, about 25 times the host cost of one
            ``.to`` (50 us there). A per-tensor copy costs about 1 us of dispatch on a
            fast host plus the 9 us in the driver, which staging pays once: it is ahead
            from about 4 tensors.
        stage_min_bytes: ... or when its larger tensors in pageable memory add up to at
            least this: 1 MiB takes about 100 us at pageable speed and about 20 us at
            pinned speed, plus about 40 us to pack on one thread (less on several),
            overlapped with the copy.
        share_max_bytes: a tensor of at most this many bytes is packed with others and
            comes back as a view of a shared device region. 64 KiB takes 1.3 us at 52
            GB/s, under 15% of the 9 us its own copy would cost in fixed overhead.
        shared_bytes: the most one shared region holds: what a single small tensor kept
            alive can keep allocated with it. 1 MiB, one copy (9 us + 20 us) per MiB of
            small tensors: the fixed cost is under a third of the copy.
        chunk_bytes: the size of one pinned staging buffer: the unit of pipelining (one
            chunk is packed while the last is copied; 4 MiB is 80 us at 52 GB/s, long
            next to the copy's fixed cost) and of reuse.
        pool_bytes: the most pinned memory kept per accelerator type, in chunks (16).
            A move that needs more waits for the oldest chunk's copies, chunk by chunk.
    """

    min_tensors: int = 4
    stage_min_bytes: int = 1 * _MIB
    share_max_bytes: int = 64 * _KIB
    shared_bytes: int = 1 * _MIB
    chunk_bytes: int = 4 * _MIB
    pool_bytes: int = 64 * _MIB

    def __post_init__(self) -> None:
        if not 0 < self.share_max_bytes <= self.shared_bytes <= self.chunk_bytes:
            msg = f"{self}: needs 0 < share_max_bytes <= shared_bytes <= chunk_bytes"
            raise ValueError(msg)
        if self.chunk_bytes % _ALIGN:
            msg = f"{self}: chunk_bytes must be a multiple of {_ALIGN}"
            raise ValueError(msg)


THRESHOLDS = Thresholds()

_NEVER_TYPES = frozenset({"meta", "mps"})
"""Device types never staged to or from: ``meta`` has no memory; MPS shares memory with
the host (and its non-blocking copies have been seen to arrive late)."""


class _Forced:
    """What :func:`forced` set: the host to stage through, and the thresholds."""

    __slots__ = ("host", "thresholds")

    def __init__(self, host: _pinned.Host, thresholds: Thresholds) -> None:
        self.host = host
        self.thresholds = thresholds


_FORCED_NAME = "forced (tests)"


class Staged(NamedTuple):
    """What a staged move made: :func:`stage`'s result."""

    results: dict[int, torch.Tensor]
    """``id(source) -> result`` on the target, where the move engine finds them."""
    sources: list[torch.Tensor]
    """The sources staged, in the order of ``results`` (for transfer accounting)."""
    keep: list[Any]
    """What must be kept alive until the move ends: the ids in ``results`` are those of
    its tensors."""


def stage(
    obj: object,
    device: torch.device,
    non_blocking: bool,
    skip_types: tuple[type, ...],
    handed: HandedTo | None = None,
) -> Staged | None:
    """Stage what can be staged of a move of ``obj`` to ``device``; ``handed``: where the
    move is made on a copy stream for another (see :class:`HandedTo`).

    Returns the results, or None where nothing was staged. Never raises where the
    per-tensor move would not: any failure here stages nothing, and the move goes on
    tensor by tensor (under :func:`forced`, failures are raised, for the tests to see).
    """
    if torch.compiler.is_compiling():
        return None
    state = STATE
    forced = state.forced
    host: _pinned.Host | None
    kind: str | None = None  # the accelerator's type
    if forced is not None:
        host, thresholds = forced.host, forced.thresholds
    else:
        thresholds = state.thresholds or THRESHOLDS
        if device.type in _NEVER_TYPES:
            state.never.add(device)
            return None
        kind = _accelerator_type() if device.type == "cpu" else device.type
        host = None
        if kind is not None and kind not in _NEVER_TYPES:  # not back from MPS either
            host = _pinned.host_for(
                kind, thresholds.chunk_bytes, thresholds.pool_bytes, _index_of(device, kind)
            )
        if host is None:
            if kind is None or kind in _NEVER_TYPES or _pinned.never(kind):
                state.never.add(device)  # for good; else a failed probe, tried again later
            return None
    if not host.pool.held_bytes and not host.pool.backoff.ready():
        return None  # no chunk, and a recent allocation failed: per tensor, at no cost
    try:
        found, inside, keep = collect(obj, skip_types)
    except Exception:  # a container's own code: the move reports it, with its path
        return None
    if len(found) < thresholds.min_tensors and not _large(found, thresholds):
        return None
    try:
        if device.type == "cpu":
            if kind is not None and _capturing(kind):
                return None
            source = _on_accelerator if forced is None else _with_data
            results = to_host(found, inside, source, thresholds, host)
        else:
            copy_stream = state.copy_stream
            results = to_accelerator(
                found, inside, device, non_blocking, thresholds, host, copy_stream, handed
            )
    except Exception:
        if forced is not None:
            raise
        return None
    if not results:
        return None
    keep.append(found)
    return Staged(results, [found[source] for source in results], keep)


def _index_of(device: torch.device, kind: str) -> torch.device | None:
    """The accelerator device a move's allocations are made for: the target, or for a
    move back to the host, none in particular (the current one)."""
    return device if device.type == kind else None


def _large(found: dict[int, torch.Tensor], thresholds: Thresholds) -> bool:
    """Whether a move of few tensors is worth staging for its bytes alone."""
    return sum(t.nbytes for t in found.values()) >= thresholds.stage_min_bytes


def forget_accelerator() -> None:
    """Ask again which accelerator there is: a PrivateUse1 backend has registered (the
    emulated accelerator), and the devices found unable to stage may now stage."""
    STATE.accelerator_known = False
    STATE.never.intersection_update({torch.device("meta")})


def _accelerator_type() -> str | None:
    """The accelerator a ``cpu`` target stages back from; asked of the driver once, by
    the resolver, whose answer holds on every torch release of the range (2.6 to 2.15)."""
    state = STATE
    if not state.accelerator_known:
        state.accelerator = accelerator_type()
        state.accelerator_known = True
    return state.accelerator


def _capturing(device_type: str) -> bool:
    """Whether the device's current stream is being captured into a graph (CUDA graphs):
    events and host copies have no place there."""
    module = getattr(torch, device_type, None)
    capturing = getattr(module, "is_current_stream_capturing", None)
    return bool(capturing()) if capturing is not None else False


def _on_host(tensor: torch.Tensor) -> bool:
    return tensor.is_cpu


def _on_accelerator(tensor: torch.Tensor) -> bool:
    return tensor.device.type == STATE.accelerator


def _with_data(tensor: torch.Tensor) -> bool:
    return tensor.device.type != "meta"


# Which tensors, and how: small ones grouped by (dtype, shape, strides), to be packed in
# runs (one stack in, one unbind out, per run); larger ones (and bases of views) alone.

_Key = tuple[torch.dtype, torch.Size, tuple[int, ...]]
_STRIDED = torch.strided


def _sort(
    found: dict[int, torch.Tensor],
    inside: dict[int, torch.Tensor],
    source: Callable[[torch.Tensor], bool],
    share_max_bytes: int,
) -> tuple[dict[_Key, list[torch.Tensor]], list[torch.Tensor]]:
    """The tensors of ``found`` a staged move may copy: small ones by group, larger ones.

    One pass, as it is paid per tensor; views (rare in a batch) are settled after it.
    """
    groups: dict[_Key, list[torch.Tensor]] = {}
    larger: list[torch.Tensor] = []
    views: dict[int, list[torch.Tensor]] = {}
    sizes: dict[_Key, int] = {}  # the bytes of a faithful tensor of that kind, else 0
    for tensor in found.values():
        base = tensor._base
        if base is not None:
            views.setdefault(id(base), []).append(tensor)
            continue
        if (
            type(tensor) is not _Tensor
            or tensor.requires_grad
            or not source(tensor)
            or tensor.layout is not _STRIDED
            or tensor.is_nested
        ):
            continue
        key = (tensor.dtype, tensor.shape, tensor.stride())
        nbytes = sizes.get(key)
        if nbytes is None:  # a batch holds many tensors of few kinds: each judged once
            nbytes = sizes[key] = tensor.nbytes if _faithful(tensor) else 0
        if not nbytes:
            continue
        if nbytes <= share_max_bytes:
            group = groups.get(key)
            if group is None:
                groups[key] = [tensor]
            else:
                group.append(tensor)
        else:
            larger.append(tensor)
    for tensor in inside.values():
        base = tensor._base
        if base is not None:
            views.setdefault(id(base), []).append(tensor)
    if views:
        _settle_views(views, found, inside, source, share_max_bytes, groups, larger)
    return groups, larger


def _faithful(tensor: torch.Tensor) -> bool:
    """Whether a staged copy of a plain tensor that needs no autograd is what ``.to``
    makes of it (see the module docstring): strided, of one of ``_DTYPES``, not empty,
    dense."""
    return (
        tensor.layout is _STRIDED
        and not tensor.is_nested
        and tensor.dtype in _DTYPES
        and tensor.nbytes > 0
        and (tensor.is_contiguous() or dense(tensor.size(), tensor.stride()))
    )


def _settle_views(
    views: dict[int, list[torch.Tensor]],
    found: dict[int, torch.Tensor],
    inside: dict[int, torch.Tensor],
    source: Callable[[torch.Tensor], bool],
    share_max_bytes: int,
    groups: dict[_Key, list[torch.Tensor]],
    larger: list[torch.Tensor],
) -> None:
    """Bases of views met get memory of their own (so that the views' ``_base`` is their
    copy); views of an absent base are staged where they overlap no other view of it."""
    for key, members in list(groups.items()):
        kept = [tensor for tensor in members if id(tensor) not in views]
        if len(kept) < len(members):
            larger += [tensor for tensor in members if id(tensor) in views]
            if kept:
                groups[key] = kept
            else:
                del groups[key]
    for base, members in views.items():
        if base in found or base in inside:
            continue  # the per-tensor move makes each a view of the moved base
        if len(members) > 1 and not _disjoint(members):
            continue
        for tensor in members:
            if (
                id(tensor) not in found
                or type(tensor) is not _Tensor
                or tensor.requires_grad
                or not source(tensor)
                or not _faithful(tensor)
                or tensor.is_conj()
                or tensor.is_neg()
            ):
                continue
            if tensor.nbytes <= share_max_bytes:
                groups.setdefault((tensor.dtype, tensor.shape, tensor.stride()), []).append(tensor)
            else:
                larger.append(tensor)


def _disjoint(members: list[torch.Tensor]) -> bool:
    """Whether views of one base share no byte (each alone is then what ``.to`` copies)."""
    spans = []
    for tensor in members:
        if tensor.layout is not _STRIDED or tensor.is_nested:
            return False
        if not (tensor.is_contiguous() or dense(tensor.size(), tensor.stride())):
            return False
        start = tensor.storage_offset() * tensor.element_size()
        spans.append((start, start + tensor.nbytes))
    spans.sort()
    return all(end <= next_start for (_, end), (next_start, _) in pairwise(spans))


# Regions: runs of small tensors side by side, at most `capacity` bytes in all. Tensors of
# one dtype, shape and strides go in one stack (and come out of one unbind); the others of
# a dtype, each alone of its kind (boxes of varying lengths), in one cat.


class _Run(NamedTuple):
    """Tensors packed side by side in a region: where they start, and their kind."""

    start: int
    """The byte offset of the first in its region."""
    dtype: torch.dtype
    shape: torch.Size | None
    """The shape every member has; None for a run of tensors of varying shapes."""
    stride: tuple[int, ...] | None
    members: list[torch.Tensor]


def _regions(groups: dict[_Key, list[torch.Tensor]], capacity: int) -> list[tuple[int, list[_Run]]]:
    """The groups laid out in regions of at most ``capacity`` bytes: ``(size, runs)``."""
    regions: list[tuple[int, list[_Run]]] = []
    runs: list[_Run] = []
    used = 0
    lone: dict[torch.dtype, list[torch.Tensor]] = {}
    for (dtype, shape, stride), members in groups.items():
        if len(members) == 1:
            lone.setdefault(dtype, []).append(members[0])
            continue
        size = members[0].nbytes
        taken = 0
        while taken < len(members):
            start = _aligned(used)
            fit = (capacity - start) // size
            if fit <= 0:
                regions.append((used, runs))
                runs, used = [], 0
                continue
            count = min(fit, len(members) - taken)
            runs.append(_Run(start, dtype, shape, stride, members[taken : taken + count]))
            used = start + count * size
            taken += count
    for dtype, members in lone.items():
        run: list[torch.Tensor] = []
        start = end = _aligned(used)
        for tensor in members:
            if end + tensor.nbytes > capacity:
                if run:
                    runs.append(_Run(start, dtype, None, None, run))
                    used = end
                regions.append((used, runs))
                runs, run, used, start, end = [], [], 0, 0, 0
            run.append(tensor)
            end += tensor.nbytes
        runs.append(_Run(start, dtype, None, None, run))
        used = end
    if runs:
        regions.append((used, runs))
    return regions


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _slots(typed: torch.Tensor, offset: int, run: _Run) -> torch.Tensor:
    """A run of one shape, placed in ``typed`` (a buffer seen as the run's dtype) at
    ``offset`` bytes (from that buffer's start), as one tensor of them or as the one."""
    start, _, shape, stride, members = run
    assert shape is not None
    assert stride is not None
    at = (offset + start) // typed.element_size()
    if len(members) == 1:
        return typed.as_strided(shape, stride, at)
    return typed.as_strided((len(members), *shape), (members[0].numel(), *stride), at)


def _pack(typed: torch.Tensor, offset: int, run: _Run) -> None:
    members = run.members
    if run.shape is None:  # shapes vary
        at = (offset + run.start) // typed.element_size()
        if len(members) == 1:
            member = members[0]
            typed.as_strided(member.shape, member.stride(), at).copy_(member)
        else:
            flat = [_flat(member) for member in members]
            torch.cat(flat, out=typed.narrow(0, at, sum(map(len, flat))))
    elif len(members) == 1:
        _slots(typed, offset, run).copy_(members[0])
    else:
        torch.stack(members, out=_slots(typed, offset, run))


def _unpack(region: torch.Tensor, run: _Run, results: dict[int, torch.Tensor]) -> None:
    """Each tensor of ``run`` as it lies in ``region`` (bytes, at offset 0): a tensor with
    a storage of its own, over its own bytes of the region's memory.

    Not views of the region (an ``unbind`` of the run's stack would give views that autograd
    calls multi-output, which refuse in-place ops with grad operands, and whose
    ``resize_`` would grow into a neighbour): each storage is a slice of the region's,
    which keeps the region's memory alive and cannot be resized, so the tensor is what
    ``.to`` returns (``_base`` None, in-place ops allowed) but for ``resize_`` past its
    size, which raises.
    """
    at, dtype, shape, stride, members = run
    device = region.device
    if device.type == "meta":  # the test seam's target: no memory to share
        for member in members:
            results[id(member)] = torch.empty_strided(
                member.shape, member.stride(), dtype=dtype, device=device
            )
        return
    storage = region.untyped_storage()
    new = region.view(dtype).new  # an empty tensor of the dtype on the device: the cheapest
    if shape is not None and stride is not None:
        nbytes = members[0].nbytes
        for member in members:
            results[id(member)] = new().set_(
                storage_slice(storage, at, at + nbytes), 0, shape, stride
            )
            at += nbytes
        return
    for member in members:
        nbytes = member.nbytes
        part = storage_slice(storage, at, at + nbytes)
        results[id(member)] = new().set_(part, 0, member.shape, member.stride())
        at += nbytes


class _Typed:
    """A byte buffer seen as each dtype it is asked for, each view made once."""

    __slots__ = ("buffer", "views")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer  # a multiple of _ALIGN bytes long
        self.views: dict[torch.dtype, torch.Tensor] = {}

    def __call__(self, dtype: torch.dtype) -> torch.Tensor:
        view = self.views.get(dtype)
        if view is None:
            view = self.views[dtype] = self.buffer.view(dtype)
        return view


# The two directions.


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
    """
    pinned: dict[int, bool] = {}  # id -> is_pinned(), asked once a move
    if not _worth(found, thresholds, host, pinned) or _capturing(device.type):
        return {}  # the cheaper question first: most declines are for want of tensors
    groups, larger = _sort(found, inside, _on_host, thresholds.share_max_bytes)
    caller = None if handed is None else handed.caller
    idle = host.idle(device) if caller is None else bool(caller.query())
    if not idle:
        groups = _unpinned(groups, host, pinned)
    streamed = [tensor for tensor in larger if not _is_pinned(tensor, host, pinned)]
    if (
        sum(map(len, groups.values())) < thresholds.min_tensors
        and sum(tensor.nbytes for tensor in streamed) < thresholds.stage_min_bytes
    ):
        return {}
    # Behind work queued on the current stream, the copies would wait for it, and the
    # chunks with them: a non-blocking move sends them on the copy stream. On an idle
    # stream they start at once anyway, and the copy stream's hand-over would cost more;
    # a move handed to a caller (prefetch's) is on the copy stream already.
    side = None
    if non_blocking and not idle and caller is None and copy_stream:
        side = host.side(device)
    made = None if handed is None else handed.regions
    if side is None:
        stream = host.stream(device)
        return _send(groups, streamed, device, thresholds, host, stream, non_blocking, None, made)
    with _streams.queued_on(side, device) as consumer:
        results = _send(groups, streamed, device, thresholds, host, side, True, consumer, made)
    if results:
        # The caller's stream runs its later work after the copies, and the results'
        # memory, allocated on the copy stream, is not reused before that work has run.
        consumer.wait_event(side.record_event())
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
        nbytes = tensor.nbytes
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
    """A move made on another current stream (a copy stream) for ``caller``, a stream of
    the target that gets the results later (:func:`devicectx.prefetch`), passed down to
    :func:`stage`; ``regions`` gets the device regions the move makes.

    Pinned sources are then packed only while ``caller`` is idle, not the current stream:
    a copy from the device into one may still be queued on ``caller``. And the regions are
    for the caller to record as used on the stream the results are handed to:
    ``record_stream`` on a result itself does not reach its region, since a result's
    storage is a slice of the region's (see :func:`_unpack`), which the allocator does not
    know; recorded, the region's memory is not reused before that stream is done with it,
    whenever its last result is freed.
    """

    __slots__ = ("caller", "regions")

    def __init__(self, caller: Any) -> None:
        self.caller = caller
        self.regions: list[torch.Tensor] = []


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


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements in memory order, as one dimension."""
    if tensor.is_contiguous():
        return tensor.view(-1)
    return tensor.as_strided((tensor.numel(),), (1,))


def to_host(
    found: dict[int, torch.Tensor],
    inside: dict[int, torch.Tensor],
    source: Callable[[torch.Tensor], bool],
    thresholds: Thresholds,
    host: _pinned.Host,
) -> dict[int, torch.Tensor]:
    """Small accelerator tensors of ``found`` (those ``source`` accepts) on the host, staged:
    ``{id(source): result}``; empty where staging would not pay. Blocking."""
    groups, _ = _sort(found, inside, source, thresholds.share_max_bytes)
    by_device: dict[torch.device, dict[_Key, list[torch.Tensor]]] = {}
    for key, members in groups.items():
        for tensor in members:
            by_device.setdefault(tensor.device, {}).setdefault(key, []).append(tensor)
    results: dict[int, torch.Tensor] = {}
    for device, on_device in by_device.items():
        if sum(map(len, on_device.values())) < thresholds.min_tensors:
            continue
        regions = _regions(on_device, thresholds.shared_bytes)
        while regions:
            batch, used = [], 0  # the regions that fit in one chunk, and where each starts
            while regions and used + _aligned(regions[0][0]) <= thresholds.chunk_bytes:
                size, runs = regions.pop(0)
                batch.append((used, _aligned(size), runs))
                used += _aligned(size)
            packed = _Typed(torch.empty(used, dtype=torch.uint8, device=device))
            for start, _, runs in batch:
                for run in runs:
                    _pack(packed(run.dtype), start, run)
            chunk = host.pool.acquire()
            try:
                staging = chunk.buffer[:used]
                staging.copy_(packed.buffer)  # blocking: the host reads it next
                for start, padded, runs in batch:
                    region = staging[start : start + padded].clone()  # its own memory
                    for run in runs:
                        _unpack(region, run, results)
            finally:
                host.pool.release(chunk, None, None)
    return results


# The seam for tests.


FORCED_THRESHOLDS = Thresholds(
    min_tensors=1,
    stage_min_bytes=0,
    share_max_bytes=64,
    shared_bytes=256,
    chunk_bytes=1024,
    pool_bytes=4096,
)
""":func:`forced`'s default: every move of one or more tensors staged, through buffers so
small that a test's batch fills several regions and chunks."""


@contextlib.contextmanager
def forced(
    thresholds: Thresholds | None = None,
    *,
    pinned: Callable[[torch.Tensor], bool] | None = None,
) -> Iterator[_pinned.Host]:
    """Stage every move that can be, to any target, through ordinary host memory.

    The test seam: packing and unpacking are the same on every device, so tests take this
    path to the CPU or ``meta`` and compare it with the per-tensor move. ``cpu`` targets
    stage back to the host from any device (a CPU tensor stands for an accelerator's).
    Failures are raised instead of falling back. Not thread-safe: for tests.

    Args:
        thresholds: default :data:`FORCED_THRESHOLDS`.
        pinned: which sources count as pinned (default: none).

    Yields:
        The host staged through: its pool can be inspected.
    """
    limits = thresholds or FORCED_THRESHOLDS
    pool = _pinned.Pool(_host_buffer, _landed, limits.chunk_bytes, limits.pool_bytes)
    host = _pinned.Host(pool, _no_stream, pinned or _never_pinned)
    # The hosts are shared with the state outside: staging_memory() sees this one too.
    with swapped(STATE.replace(forced=_Forced(host, limits), never=set())):
        _pinned.register(_FORCED_NAME, host)
        try:
            yield host
        finally:
            _pinned.unregister(_FORCED_NAME)


def _host_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


class _Landed:
    """The event of copies that are all blocking (host memory): always complete."""

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _landed(device: torch.device) -> _Landed:
    return _Landed()


def _no_stream(device: torch.device) -> None:
    return None


def _never_pinned(tensor: torch.Tensor) -> bool:
    return False
