"""Staged moves on a real accelerator's semantics: the emulated one in CI, a GPU elsewhere.

Copies to or from pinned memory finish late there (``devicectx.testing.emulated``: about
2 ms after their stream reaches them), so what the staged path reads, and when, shows: a
source read too early, a chunk reused too early, a result handed back before it landed.
Each property compares the staged move with the per-tensor one (``coalesce=False``),
whose every copy is ``.to``: ordered on the stream, as torch orders it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import accelerator, described, tensors_of
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from devicectx import to_device
from devicectx.testing.strategies import nested, tensors

pytestmark = pytest.mark.requires_device("accelerator")


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.pin_memory()


def pending(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as a copy from the device that has not landed yet when returned: pinned
    memory that the stream writes into later."""
    return tensor.to(accelerator()).to("cpu", non_blocking=True)


def channels_last(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(memory_format=torch.channels_last) if tensor.dim() == 4 else tensor


def requiring_grad(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype.is_floating_point:
        return tensor.detach().requires_grad_(True)
    return tensor


SOURCES: list[Callable[[torch.Tensor], torch.Tensor]] = [
    lambda tensor: tensor,  # pageable
    pinned,
    pending,
    channels_last,
    requiring_grad,
]

shapes = st.one_of(
    st.lists(st.integers(0, 4), max_size=3).map(tuple),
    st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
)
sources = st.tuples(tensors(devices=["cpu"], shapes=shapes), st.sampled_from(SOURCES)).map(
    lambda pair: pair[1](pair[0])
)
batches = nested(sources)


def relations(results: list[torch.Tensor]) -> list[tuple[bool, bool, bool]]:
    """For each pair: the same object? the first a view of the second? sharing memory?"""
    return [
        (a is b, a._base is b, a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
        for a in results
        for b in results
        if a.numel() and b.numel()
    ]


def in_place_with_grad(results: list[torch.Tensor]) -> list[str]:
    """Each floating result, in turn, multiplied in place by a parameter under grad mode:
    what happened (``ok`` or the error's type)."""
    outcomes = []
    for tensor in results:
        if not tensor.dtype.is_floating_point or tensor.dtype == torch.float16:
            continue
        weight = nn.Parameter(torch.ones((), dtype=tensor.dtype, device=tensor.device))
        try:
            with torch.enable_grad():
                tensor.mul_(weight)
            outcomes.append("ok")
        except RuntimeError as error:
            outcomes.append(type(error).__name__)
    return outcomes


@settings(max_examples=40)
@given(batch=batches, non_blocking=st.booleans())
def test_staged_and_per_tensor_moves_agree(batch: Any, non_blocking: bool) -> None:
    """For batches of pageable, pinned and pending-copy sources, views, channels_last and
    tensors that require grad: the staged move gives what ``.to`` gives, tensor by tensor:
    values, dtypes, shapes, strides, aliasing, views, autograd, in-place ops with grad
    operands, with non_blocking either way. The staged move goes first, while the copies
    into pending sources may still be in flight."""
    device = accelerator()
    staged = to_device(batch, device, non_blocking=non_blocking)
    alone = to_device(batch, device, non_blocking=non_blocking, coalesce=False)
    torch.accelerator.synchronize()
    expected, actual = tensors_of(alone), tensors_of(staged)
    assert [described(t) for t in expected] == [described(t) for t in actual]
    assert all(torch.equal(e.cpu(), a.cpu()) for e, a in zip(expected, actual, strict=True))
    assert relations(expected) == relations(actual)
    assert in_place_with_grad(expected) == in_place_with_grad(actual)


@settings(max_examples=25)
@given(batch=nested(tensors(devices=["cpu"], shapes=shapes), views=False))
def test_pageable_sources_may_change_once_the_move_returns(batch: Any) -> None:
    """With ``non_blocking=True``, pageable sources may be overwritten as soon as
    ``to_device`` returns (staged ones are in the staging buffer; the rest were copied
    by ``.to``, which copies pageable memory before it returns): the results hold the
    values from before."""
    device = accelerator()
    before = [t.clone() for t in tensors_of(batch)]
    moved = to_device(batch, device, non_blocking=True)
    for source in tensors_of(batch):
        if source.numel():
            source.fill_(7)
    torch.accelerator.synchronize()
    assert all(torch.equal(e, a.cpu()) for e, a in zip(before, tensors_of(moved), strict=True))
