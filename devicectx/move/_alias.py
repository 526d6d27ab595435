"""Moving tensors so that what shared memory before the move shares it after.

One :class:`TensorMover` serves one move call. It copies each tensor once, however many
places hold it (by identity), and keeps views views: a tensor whose memory lies inside
another tensor of the same structure (a view and its base, a slice and a larger slice of
the same base) arrives as a view of that tensor's copy, via ``as_strided``, which autograd
differentiates. Tensors are grouped by their base (``tensor._base``, or the tensor itself
for one that is no view); within a group the *anchor* of a member is the largest dense
tensor that covers its memory (the base, when it is there). An empty tensor has no memory
to cover: the base covers it wherever it lies (a slice past the base's end too), another
anchor of its kind only where it starts within that anchor's bytes (ends included), and its
anchor is the largest of those. A tensor covered by none is copied alone, as ``.to`` copies
it: only its own elements, never the rest of its base. Nor is a view re-made on a view that
autograd did not record (made under ``no_grad``) where it has history of its own: its
gradient would stop there instead of reaching their base.
Tensors that share memory without being views (``x.data``, ``x.detach()``) are copied
apart, as ``.to`` would copy them. A view on XLA is copied alone too: XLA tensors report
their base but not where in it they lie (every one says offset 0, contiguous strides), and
so is an empty view moved to XLA (it has no element to share).

A module is moved in place by its own ``module.to``, which makes its own copies: a tensor of
the module that the structure also holds is *adopted* (:meth:`TensorMover.adopt`), its result
the module's moved tensor, and views of it are made views of that, whether the walk meets
them before the module or after it.

The walk meets tensors in structure order, so it cannot know whether a larger tensor will
come later. It links each member to the first member of its group when that one covers it
(a base before its views: the common case, settled at once) and copies it alone
otherwise; :meth:`TensorMover.finish` then settles the groups where that guess may be
wrong and returns the few results to replace.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from devicectx._torch.tensors import base_of
from devicectx.devices._capabilities import ALWAYS_BLOCKING

_Tensor = torch.Tensor
# Copies to these are always blocking: the host reads a copy to the CPU as soon as it
# returns, and a non-blocking copy to MPS can land after the tensor is read (the set's
# home, with the reasons, is devicectx.devices._capabilities).
_BLOCKING_TARGETS = ALWAYS_BLOCKING
# XLA: a view's storage_offset and strides are not its place in its base (torch_xla 2.9
# reports 0 and contiguous strides for every tensor), so no view of it can be re-made.
_NO_GEOMETRY = frozenset({"xla"})


class TensorMover:
    """Moves the tensors of one call to ``device``; see the module docstring."""

    __slots__ = (
        "adopted",
        "device",
        "dtypes",
        "groups",
        "moved",
        "non_blocking",
        "optimizer",
        "parameters",
        "sent",
        "unsettled",
    )

    def __init__(
        self,
        device: torch.device | None,
        non_blocking: bool,
        dtypes: Mapping[torch.dtype, torch.dtype] | None = None,
        parameters: bool = True,
    ) -> None:
        # device None with dtypes: a cast where each tensor is (the dtype policy's, which
        # sends only the tensors to cast), views and aliasing kept as in a move.
        self.device = device
        self.dtypes = dtypes
        # False: a parameter is copied as any tensor, through autograd (see copy).
        self.parameters = parameters
        self.non_blocking = (
            non_blocking and device is not None and device.type not in _BLOCKING_TARGETS
        )
        # id(original) -> its result. The caller keeps every original alive until the call
        # ends, so no id here can be reused by a new object meanwhile.
        self.moved: dict[int, _Tensor] = {}
        self.groups: dict[int, _Group] = {}  # id(base) -> the tensors met on it
        self.unsettled: list[_Group] = []
        # Every tensor copied to the device, once each, for devicectx.move._transfers: a view
        # re-made as a view of another tensor's copy is no copy and is not listed.
        self.sent: list[_Tensor] = []
        # id(original) -> the original as it was, for the tensors adopted (see adopt); None
        # until a module moves, so that a move without modules pays nothing for it.
        self.adopted: dict[int, _Tensor] | None = None
        # An optimizer the walk met (and left where it is): its state stays where it was.
        self.optimizer: object = None

    def move(self, tensor: _Tensor) -> _Tensor:
        """``tensor`` (not on the target) on the target: the same copy every time."""
        moved = self.moved.get(id(tensor))
        if moved is not None:
            return moved
        if tensor.device == self.device:
            return tensor
        base = base_of(tensor)
        if base is not None and (
            tensor.device.type in _NO_GEOMETRY
            or (tensor.numel() == 0 and self.device is not None and self.device.type == "xla")
        ):
            # Copied alone: an XLA view's place is unknown; and XLA's lowering refuses an
            # empty view at an offset past its source's end, where an empty base covers one.
            base = None
        if base is None:
            group = self.groups.get(id(tensor)) if self.groups else None
            if group is not None:  # views of it came first
                moved = group.add(self, tensor)
            elif type(tensor) is _Tensor and not self.non_blocking and self.dtypes is None:
                moved = tensor.to(self.device)  # the common case
                self.sent.append(tensor)
            else:
                moved = self.copy(tensor)
        else:
            group = self.groups.get(id(base))
            if group is None:
                first = self.moved.get(id(base))
                if first is None:  # the first of this base's tensors met: copied alone
                    moved = self.moved[id(tensor)] = self.copy(tensor)
                    self.groups[id(base)] = _Group(tensor, moved)
                    return moved
                was = None if self.adopted is None else self.adopted.get(id(base))
                if was is None:
                    group = self.groups[id(base)] = _Group(base, first)
                else:  # a module's moved tensor: the anchor, whatever the views around it
                    group = self.groups[id(base)] = _Group(was, first)
                    group.given = {0: first}
            moved = group.add(self, tensor)
        self.moved[id(tensor)] = moved
        return moved

    def adopt(self, original: _Tensor, was: _Tensor, result: _Tensor) -> None:
        """Make ``result``, which ``module.to`` made of ``original`` (a parameter or buffer of
        a module it moved in place), the result of ``original`` wherever the walk meets it.

        ``was`` is ``original`` as it was before the module moved: ``original`` itself, or
        where the module may have moved it in place (``param.data = ...``,
        ``torch.utils.swap_tensors``) a ``detach()`` made before, which still has its place
        in its old memory, for the views of it. What the walk gave ``original`` or its views
        already is put right by :meth:`finish`. The first result adopted for a tensor stays:
        a module moved later that shares it is given it (:meth:`adopted_result`).
        """
        key = id(original)
        adopted = self.adopted
        if adopted is None:
            adopted = self.adopted = {}
        elif key in adopted:
            return
        adopted[key] = was
        previous = self.moved.get(key)
        self.moved[key] = result
        base = base_of(original)
        group_key = key if base is None else id(base)
        group = self.groups.get(group_key)
        if group is None:
            if previous is None or previous is result:
                return  # not met yet: the walk finds the result in `moved`
            group = self.groups[group_key] = _Group(was, previous)
            group.adopt(self, was, was, result)
        else:
            group.adopt(self, original, was, result)

    def adopted_result(self, original: _Tensor) -> _Tensor | None:
        """What a module moved before made of ``original`` (see :meth:`adopt`), if any."""
        adopted = self.adopted
        if adopted is None or id(original) not in adopted:
            return None
        return self.moved[id(original)]

    def finish(self) -> dict[int, _Tensor]:
        """Settle the groups the walk could not: ``{id(result given): result to use}``."""
        replace: dict[int, _Tensor] = {}
        for group in self.unsettled:
            group.settle(self, replace)
        return replace

    def copy(self, tensor: _Tensor) -> _Tensor:
        """A copy of ``tensor`` alone on the target, as ``.to`` makes it.

        An ``nn.Parameter`` comes back as a new parameter (a leaf, as ``module.to`` makes
        them, with its ``.grad`` moved too) where :attr:`parameters` is set; any other
        tensor through ``.to``, so the copy is differentiable: a decorated call's
        parameter, copied so, passes its gradient back to the caller's.
        """
        non_blocking = self.non_blocking and tensor.is_cpu
        dtype = None if self.dtypes is None else self.dtypes.get(tensor.dtype)
        self.sent.append(tensor)
        # Parameter's isinstance goes through a Python-level metaclass hook: test the
        # exact type first.
        if type(tensor) is not _Tensor and self.parameters and isinstance(tensor, nn.Parameter):
            if dtype is not None and tensor.requires_grad and not _differentiable(dtype):
                raise CannotCast(tensor.dtype, dtype)
            data = _to(tensor.detach(), self.device, dtype, non_blocking)
            try:
                param = _parameter(tensor, data)
            except Exception as error:
                raise EngineBug(error) from error
            grad = tensor.grad
            if grad is not None:  # as module.to carries it: a step's gradient, not lost
                param.grad = _to(grad, self.device, dtype, non_blocking)
            return param
        return _to(tensor, self.device, dtype, non_blocking)


def _to(
    tensor: _Tensor, device: torch.device | None, dtype: torch.dtype | None, non_blocking: bool
) -> _Tensor:
    # No dtype argument unless there is one: some subclasses' .to reads its arguments.
    if dtype is None:
        return tensor.to(device, non_blocking=non_blocking)
    return tensor.to(device, dtype, non_blocking=non_blocking)


class CannotCast(ValueError):
    """A parameter that requires grad, mapped by ``dtypes=`` to a dtype no tensor that
    requires grad can have (an integer dtype): the mapping's mistake, with its fix."""

    def __init__(self, source: torch.dtype, dtype: torch.dtype) -> None:
        super().__init__(
            f"a parameter that requires grad cannot become {dtype}: only floating point and "
            f"complex tensors can require gradients\n"
            f"fix: map {source} to a floating point dtype in dtypes=, or leave it out"
        )


def _differentiable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


class EngineBug(Exception):
    """A move that failed in devicectx's own code, not in torch's or the user's: the
    ``MoveError`` then says so, instead of telling the user to work around it."""

    def __init__(self, error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


def _parameter(tensor: _Tensor, data: _Tensor) -> _Tensor:
    """``data``, the moved copy of the parameter ``tensor``, made a parameter as it was.

    A subclass of ``nn.Parameter`` is rebuilt by its own type. A parameter of a tensor
    subclass (``nn.Parameter(dtensor)``: every FSDP2 and tensor-parallel parameter) is no
    instance of ``nn.Parameter`` but the subclass flagged ``_is_param`` (torch 2.6-2.15):
    ``nn.Parameter(data)`` makes it so again, keeping the subclass (a DTensor keeps its
    mesh and placements, which ``.to`` kept). Attributes set on the parameter are carried
    over where the new one has none of its own (a subclass's inner tensors are its own).
    """
    tp = type(tensor)
    param = tp(data, tensor.requires_grad) if issubclass(tp, nn.Parameter) else None
    if param is None:
        param = nn.Parameter(data, tensor.requires_grad)
    state = param.__dict__
    for key, value in tensor.__dict__.items():
        state.setdefault(key, value)
    return param


class _Span:
    """Where a tensor's elements lie in its storage, in bytes, and whether it can anchor."""

    __slots__ = (
        "anchor",
        "empty",
        "hi",
        "index",
        "linkable",
        "lo",
        "sort_key",
        "tensor",
        "what",
        "whole",
    )

    def __init__(self, tensor: _Tensor, index: int) -> None:
        self.tensor = tensor
        self.index = index
        # Only plain tensors are re-made as views: a view of a subclass would lose its type.
        self.linkable = type(tensor) is _Tensor
        self.what: tuple[Any, ...] | None = None
        self.anchor = False
        self.empty = False
        self.whole = False  # the base of its group (no view), which covers every empty member
        self.lo = self.hi = 0
        self.sort_key: tuple[int, int, bool, bool, int] = (0, 0, self.linkable, False, index)
        if tensor.layout != torch.strided:
            return
        size, stride, itemsize = tensor.size(), tensor.stride(), tensor.element_size()
        start = int(tensor.storage_offset())
        self.lo = self.hi = start * itemsize
        self.what = (tensor.dtype, tensor.device, tensor.is_conj(), tensor.is_neg())
        can_anchor = self.linkable or isinstance(tensor, nn.Parameter)
        self.whole = base_of(tensor) is None
        if tensor.numel() == 0:
            # No elements: its offset and strides say nothing of memory it holds (the
            # extent below would give a (3, 0) tensor two elements, a (0,) one a negative
            # length; an empty view's offset may lie past its base's end). It covers only
            # other empty tensors at its offset (or any, as the base), and is covered by
            # what its offset lies in (see covers).
            self.empty = True
            self.anchor = can_anchor
        else:
            extent = sum((n - 1) * s for n, s in zip(size, stride, strict=True))
            self.hi = (start + int(extent) + 1) * itemsize
            self.anchor = can_anchor and dense(size, stride)
        # Among anchors of equal memory: a parameter first (it must stay one), then the base
        # itself (so views stay views of it), then the first met.
        self.sort_key = (self.lo, -self.hi, self.linkable, not self.whole, index)

    def covers(self, other: _Span) -> bool:
        if not self.anchor or self.what is None or self.what != other.what:
            return False
        if other.empty:
            # It reads nothing, so a view of any copy would do; but only the base holds it
            # wherever it lies. Another tensor of the base holds it only where it starts in
            # that one's bytes (a slice at its end included): an empty slice elsewhere of an
            # absent base is copied alone, as any view of an absent base is.
            return self.whole or self.lo <= other.lo <= self.hi
        return not self.empty and self.lo <= other.lo and other.hi <= self.hi

    def preference(self) -> tuple[int, bool, bool, int]:
        """The order in which anchors are chosen: the largest, then as in ``sort_key``."""
        return (self.lo - self.hi, *self.sort_key[2:])


class _Group:
    """Tensors of one call on one base, with the results the walk gave them."""

    __slots__ = ("given", "links", "queued", "results", "spans")

    def __init__(self, tensor: _Tensor, moved: _Tensor) -> None:
        self.spans = [_Span(tensor, 0)]
        self.results = [moved]
        self.links: list[int | None] = [None]  # the member whose copy each result views
        self.queued = False
        # The members whose result was given from outside (a module's moved tensor): final,
        # whatever the walk gave them, and what the views on them are views of.
        self.given: dict[int, _Tensor] | None = None

    def add(self, mover: TensorMover, tensor: _Tensor) -> _Tensor:
        span = _Span(tensor, len(self.spans))
        first = self.spans[0]
        moved: _Tensor | None = None
        # Linked to the first member when that one covers it, unless it would be the better
        # anchor of the two (the same memory, and it is the base while the first is a view).
        better = span.covers(first) and span.preference() < first.preference()
        if span.linkable and first.covers(span) and not better:
            moved = view_of(first.tensor, self.results[0], tensor)
        link: int | None = 0
        if moved is None:
            moved, link = mover.copy(tensor), None
            # Copied alone: a later (or an earlier, non-first) member may cover it, or it
            # may cover others. A member linked to the first is never a better anchor.
            if not self.queued:
                self.queued = True
                mover.unsettled.append(self)
        self.spans.append(span)
        self.results.append(moved)
        self.links.append(link)
        return moved

    def adopt(self, mover: TensorMover, member: _Tensor, was: _Tensor, result: _Tensor) -> None:
        """Give ``member`` (added with ``was`` for its place, if the walk has not met it) the
        final result ``result``; :meth:`settle` puts it, and the views on it, in place."""
        for span in self.spans:
            if span.tensor is member:
                index = span.index
                span.tensor = was  # its place in its old memory, for the views on it
                break
        else:
            index = len(self.spans)
            self.spans.append(_Span(was, index))
            self.results.append(result)
            self.links.append(None)
        if self.given is None:
            self.given = {}
        self.given[index] = result
        if not self.queued:
            self.queued = True
            mover.unsettled.append(self)

    def settle(self, mover: TensorMover, replace: dict[int, _Tensor]) -> None:
        """Make each member a view of its best anchor's copy; record the results that change."""
        best = _best_anchors(self.spans)
        alone: dict[int, _Tensor] = {}
        given = self.given or {}

        def copy_of(index: int) -> _Tensor:
            # A given result; the walk's result for a member it copied alone; else a new
            # copy of its own.
            result = given.get(index)
            if result is not None:
                return result
            if self.links[index] is None:
                return self.results[index]
            if index not in alone:
                alone[index] = mover.copy(self.spans[index].tensor)
            return alone[index]

        for span in self.spans:
            index, anchor = span.index, best[span.index]
            if anchor is None or anchor == index or index in given:
                final = copy_of(index)
            elif self.links[index] == anchor and self.links[anchor] is None and anchor not in given:
                continue  # the walk already made it a view of that anchor's copy
            else:
                view = view_of(self.spans[anchor].tensor, copy_of(anchor), span.tensor)
                final = copy_of(index) if view is None else view
            if final is not self.results[index]:
                replace[id(self.results[index])] = final


def _best_anchors(spans: list[_Span]) -> list[int | None]:
    """For each member, the index of the largest anchor of like kind covering it."""
    best: list[int | None] = [None] * len(spans)
    kinds: dict[tuple[Any, ...], list[_Span]] = {}
    for span in spans:
        if span.what is not None:
            kinds.setdefault(span.what, []).append(span)
    for members in kinds.values():
        anchors = [s for s in members if s.anchor]
        # Keep only the anchors no other anchor covers: sorted by start, their ends rise.
        # Empty ones cover no tensor that has elements.
        maximal: list[_Span] = []
        reach = -1
        for span in sorted((s for s in anchors if not s.empty), key=lambda s: s.sort_key):
            if span.hi > reach:
                maximal.append(span)
                reach = span.hi
        starts = [s.lo for s in maximal]
        for span in members:
            if not span.linkable and not span.anchor:
                continue
            chosen: _Span | None = None
            if span.empty:  # rare: each anchor asked
                covering = [anchor for anchor in anchors if anchor.covers(span)]
                chosen = min(covering, key=_Span.preference, default=None)
            at = -1 if span.empty else bisect_right(starts, span.lo) - 1
            while at >= 0 and maximal[at].hi >= span.hi:
                candidate = maximal[at]
                if chosen is None or candidate.hi - candidate.lo > chosen.hi - chosen.lo:
                    chosen = candidate
                at -= 1
            if chosen is not None and (span.linkable or chosen is span):
                best[span.index] = chosen.index
    return best


def anchor_among(members: list[_Tensor], tensor: _Tensor) -> _Tensor | None:
    """The one of ``members`` (the tensors of a structure on one base, ``tensor`` among
    them) whose copy a move makes ``tensor``'s copy a view of; None where it is copied alone.

    Example:
        >>> base = torch.arange(6.0)
        >>> members = [base[1:3], base, base[2:]]
        >>> anchor_among(members, members[0]) is base
        True
        >>> apart = [base[1:3], base[2:4]]
        >>> anchor_among(apart, apart[0]) is None  # no member covers it
        True
    """
    index = next(i for i, member in enumerate(members) if member is tensor)
    best = _best_anchors([_Span(member, i) for i, member in enumerate(members)])[index]
    return None if best is None or best == index else members[best]


def view_of(anchor: _Tensor, moved_anchor: _Tensor, tensor: _Tensor) -> _Tensor | None:
    """``tensor`` re-made as a view into ``moved_anchor``, or None where that cannot be."""
    if not _same_layout(anchor, moved_anchor):
        return None
    if (
        tensor.requires_grad
        and base_of(anchor) is not None
        and anchor.grad_fn is None
        and tensor.grad_fn is not None
        and torch.is_grad_enabled()
    ):
        # The anchor is a view autograd did not record (made under no_grad): through its
        # copy, this tensor's gradient would stop at it, not reach their base.
        return None
    offset = tensor.storage_offset() - anchor.storage_offset() + moved_anchor.storage_offset()
    source = moved_anchor
    if moved_anchor.requires_grad and not tensor.requires_grad:
        source = moved_anchor.detach()  # shares memory, but adds no autograd history
    try:
        view = source.as_strided(tensor.size(), tensor.stride(), offset)
        if tensor.requires_grad and not view.requires_grad and torch.is_grad_enabled():
            view.requires_grad_(True)  # as .to's copy would (under no_grad, it would not)
    except RuntimeError:
        return None
    return view


def _same_layout(tensor: _Tensor, moved: _Tensor) -> bool:
    """Whether ``moved`` lays its elements out in memory as ``tensor`` does."""
    if tensor.size() != moved.size():
        return False
    if tensor.numel() == 0:  # nothing to lay out: any view of it reads no element
        return True
    layouts = zip(tensor.size(), tensor.stride(), moved.stride(), strict=True)
    return all(a == b or n <= 1 for n, a, b in layouts)


def dense(size: torch.Size, stride: tuple[int, ...]) -> bool:
    """Whether the elements fill a block of memory with no gap and no overlap."""
    expected = 1
    for n, s in sorted(zip(size, stride, strict=True), key=lambda pair: pair[1]):
        if n == 1:
            continue
        if s != expected:
            return False
        expected *= n
    return True
