"""Which tensors a staged move copies, and their places in the buffer: pure, no device.

The thresholds, the sort of a move's tensors into runs of like small tensors and larger
ones, the regions they are packed into, and the packing and unpacking of a run (one
stack in, one unbind out). Everything here runs on any tensors, the CPU's included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from itertools import pairwise
from typing import NamedTuple

import torch

from devicectx._torch.tensors import base_of, below_autograd, storage_slice
from devicectx.move._alias import dense

__all__ = ["THRESHOLDS", "Thresholds"]

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
    """When a move is staged, and how. Each default follows from a GPU link's figures (a
    fixed cost per host-to-device copy, the speed from pageable and from pinned memory):
    docs/performance.md, "The staging thresholds", gives them and the reasoning.

    Attributes:
        min_tensors: a move is staged when it has at least this many small tensors to
            pack: a staged move has a fixed host cost (collecting the tensors, one stack
            and one unbind per run of like tensors, a region, an event), which the copies
            it saves (one fixed driver cost each) repay from this count on.
        stage_min_bytes: ... or when its larger tensors in pageable memory add up to at
            least this: from this size the driver's slow pageable copy costs more than
            packing into pinned memory (overlapped with the copy) and the fast copy.
        share_max_bytes: a tensor of at most this many bytes is packed with others and
            comes back as a view of a shared device region: its own copy would cost more
            in fixed overhead than its bytes take on the link.
        shared_bytes: the most one shared region holds: what a single small tensor kept
            alive can keep allocated with it; one copy per region keeps the fixed cost a
            small part of the copy.
        chunk_bytes: the size of one pinned staging buffer: the unit of pipelining (one
            chunk is packed while the last is copied; long next to the copy's fixed cost)
            and of reuse.
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
        base = base_of(tensor)
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
        base = base_of(tensor)
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
    """Whether views of one base share no byte (each alone is then what ``.to`` copies).

    An empty one shares none but is not told apart: the per-tensor move makes it a view of
    another view it starts in (its end included), so such a group is left to that move."""
    spans = []
    for tensor in members:
        if tensor.layout is not _STRIDED or tensor.is_nested or tensor.numel() == 0:
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
    with below_autograd():  # fresh tensors that need no autograd: see below_autograd
        if shape is not None and stride is not None:
            nbytes = members[0].nbytes
            if stride == _ONE_DIMENSION:
                # new(storage) is the tensor of every element of the storage, in one call:
                # what set_ makes of a 1-D contiguous tensor, without parsing its arguments.
                for member in members:
                    results[id(member)] = new(storage_slice(storage, at, at + nbytes))
                    at += nbytes
                return
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


_ONE_DIMENSION = (1,)


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


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements in memory order, as one dimension."""
    if tensor.is_contiguous():
        return tensor.view(-1)
    return tensor.as_strided((tensor.numel(),), (1,))
