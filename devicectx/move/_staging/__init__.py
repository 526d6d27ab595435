"""Staged moves: many tensors to an accelerator (or back) in a few large copies.

Copying tensors one by one from host memory to an accelerator pays twice: a fixed cost per
copy, and, from ordinary (pageable) memory, the driver's own slow staging, a fraction of the
speed of a copy from pinned memory (figures in docs/performance.md). A staged move packs the
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

The package, by concern: :mod:`~devicectx.move._staging._layout` (which tensors qualify,
their places in the buffer: pure, no device), :mod:`~devicectx.move._staging._sending`
(to an accelerator, on streams), :mod:`~devicectx.move._staging._back` (back to the
host), :mod:`~devicectx.move._staging._seam` (:func:`forced`), and
:mod:`~devicectx.move._staging._state` (what staging keeps between moves, in one object).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from devicectx.devices._resolve import accelerator_type
from devicectx.move import _containers, _pinned
from devicectx.move._containers import kind_for
from devicectx.move._kinds import LEAF
from devicectx.move._staging._back import to_host
from devicectx.move._staging._layout import THRESHOLDS, Thresholds
from devicectx.move._staging._seam import FORCED_THRESHOLDS, forced
from devicectx.move._staging._sending import HandedTo, _capturing, to_accelerator
from devicectx.move._staging._state import STATE, StagingState, swapped
from devicectx.move._walk import collect

_Tensor = torch.Tensor
_STRIDED = torch.strided
_CACHE = _containers.KIND_CACHE

__all__ = [
    "FORCED_THRESHOLDS",
    "STATE",
    "THRESHOLDS",
    "HandedTo",
    "Staged",
    "StagingState",
    "Thresholds",
    "declines",
    "forced",
    "forget_accelerator",
    "stage",
    "swapped",
    "to_accelerator",
    "to_host",
]

_NEVER_TYPES = frozenset({"meta", "mps"})
"""Device types never staged to or from: ``meta`` has no memory; MPS shares memory with
the host (and its non-blocking copies have been seen to arrive late)."""


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


def declines(obj: object, device: torch.device, skip_types: tuple[type, ...] = ()) -> bool:
    """Whether a move of ``obj`` to ``device`` would stage nothing, told before
    :func:`stage` looks for a pinned host and collects the tensors, where ``obj`` is a
    batch too small to stage: a tensor alone (smaller than a move staged for its bytes
    alone), or plain dicts, lists and tuples holding fewer tensors off ``device`` than a
    staged move needs, and fewer bytes (and values that are no containers, and objects of
    ``skip_types``). False where it cannot tell: :func:`stage` looks then.

    A training step's batch of three tensors pays nothing for staging this way.
    """
    state = STATE
    if state.forced is not None:
        return False
    thresholds = state.thresholds or THRESHOLDS
    if thresholds.min_tensors <= 1:
        return False
    if type(obj) is torch.Tensor:
        tensor: torch.Tensor = obj
        return tensor.layout != torch.strided or tensor.nbytes < thresholds.stage_min_bytes
    return _few_small(obj, device, skip_types, thresholds)


_FEW_CONTAINERS = 16  # a batch has a few; more (or a cycle) is left to stage()'s own look


def _few_small(
    obj: object, device: torch.device, skip_types: tuple[type, ...], thresholds: Thresholds
) -> bool:
    # A tensor held twice counts twice: the answer errs toward stage()'s own look.
    most, most_bytes = thresholds.min_tensors, thresholds.stage_min_bytes
    count = nbytes = containers = 0
    stack: list[Any] = [obj]
    while stack:
        item = stack.pop()
        tp = type(item)
        if tp is _Tensor:
            if item.device != device:
                count += 1
                if count >= most:
                    return False
                if item.layout is _STRIDED:
                    nbytes += item.nbytes
                    if nbytes >= most_bytes:
                        return False
            continue
        if tp is dict:
            stack.extend(item.values())
        elif tp is list or tp is tuple:
            stack.extend(item)
        elif (_CACHE.get(tp) or kind_for(tp)).role == LEAF or (
            skip_types and isinstance(item, skip_types)
        ):
            continue
        else:
            return False
        containers += 1
        if containers > _FEW_CONTAINERS:
            return False
    return True


def _index_of(device: torch.device, kind: str) -> torch.device | None:
    """The accelerator device a move's allocations are made for: the target, or for a
    move back to the host, none in particular (the current one)."""
    return device if device.type == kind else None


def _large(found: dict[int, torch.Tensor], thresholds: Thresholds) -> bool:
    """Whether a move of few tensors is worth staging for its bytes alone."""
    total = 0
    for tensor in found.values():
        try:
            total += tensor.nbytes
        except RuntimeError:  # a sparse COO tensor has none (torch raises); never staged
            continue
    return total >= thresholds.stage_min_bytes


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


def _on_accelerator(tensor: torch.Tensor) -> bool:
    return tensor.device.type == STATE.accelerator


def _with_data(tensor: torch.Tensor) -> bool:
    return tensor.device.type != "meta"
