"""The property of ``@device_agnostic``, over random argument structures, devices and targets.

For any arguments (every container kind of :func:`devicectx.testing.strategies.nested`,
with shared tensors and views, on cpu or meta, and plain values), any target (from
``device=``, a module argument or ``on_device``) and ``move`` either way: the body sees
every tensor on the target, and ``DeviceMismatchError`` is raised exactly when
``move=False`` and some tensor is elsewhere (a 0-dim CPU tensor is allowed), and then
before the body runs, with the arguments unchanged.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from devicectx import DeviceMismatchError, device_agnostic, on_device
from devicectx.decorator._target import Spread, module_device
from devicectx.move._move import iter_tensors
from devicectx.testing.strategies import nested, tensors

CPU = torch.device("cpu")
META = torch.device("meta")


def flat(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a structure, at each place it is held, in the walk's order."""
    return [tensor for _, tensor in iter_tensors(obj)]


def allowed_off_target(tensor: torch.Tensor) -> bool:
    """PyTorch mixes a 0-dim CPU tensor with any device: the decorator allows it too."""
    return tensor.device == CPU and tensor.dim() == 0


@given(data=st.data())
def test_body_sees_target_or_call_is_refused(data: st.DataObject) -> None:
    """Every tensor arrives on the target, or move=False refuses exactly the bad calls."""
    target = data.draw(st.sampled_from([CPU, META]), label="target")
    move = data.draw(st.booleans(), label="move")
    source = data.draw(st.sampled_from(["device", "module", "on_device"]), label="source")
    # meta tensors hold no data, so nothing can be moved off meta: only to it.
    devices = [CPU, META] if target == META or not move else [CPU]
    batches = nested(tensors(devices=devices), max_depth=2)
    args = data.draw(st.lists(batches, max_size=3), label="args")
    keywords = st.dictionaries(st.sampled_from(["k", "m"]), batches, max_size=2)
    kwargs = data.draw(keywords, label="kwargs")

    seen: list[torch.Tensor] = []

    def body(*args: Any, **kwargs: Any) -> None:
        seen.extend(flat((args, kwargs)))

    decorate = device_agnostic(move=move, device=target if source == "device" else None)
    decorated = decorate(body)
    call_args = [nn.Linear(1, 1).to(target), *args] if source == "module" else args
    scope: AbstractContextManager[Any] = (
        on_device(target) if source == "on_device" else nullcontext()
    )
    before = [(t, t.device) for t in flat((args, kwargs))]
    off = [t for t, _ in before if t.device != target and not allowed_off_target(t)]

    refused: DeviceMismatchError | None = None
    try:
        with scope:
            decorated(*call_args, **kwargs)
    except DeviceMismatchError as error:
        refused = error

    assert before == [(t, t.device) for t in flat((args, kwargs))]  # arguments unchanged
    if refused is not None:
        assert (False, True, []) == (move, bool(off), seen)
        assert target == refused.target
    else:
        assert move or not off
        expected = [t.device if not move and allowed_off_target(t) else target for t, _ in before]
        assert expected == [t.device for t in seen]


def _module_trees(draw: st.DrawFn, depth: int = 2) -> nn.Module:
    """A module with parameters (some None), buffers and children (some shared)."""
    module = nn.Module()
    for i in range(draw(st.integers(0, 2))):
        device = draw(st.sampled_from(["cpu", "meta"]))
        parameter = draw(st.booleans())
        value = nn.Parameter(torch.zeros(1, device=device)) if parameter else None
        module.register_parameter(f"p{i}", value)
    for i in range(draw(st.integers(0, 1))):
        module.register_buffer(
            f"b{i}", torch.zeros(1, device=draw(st.sampled_from(["cpu", "meta"])))
        )
    children: list[nn.Module] = []
    for i in range(draw(st.integers(0, 2)) if depth else 0):
        shared = children and draw(st.booleans())
        child = children[-1] if shared else _module_trees(draw, depth - 1)
        children.append(child)
        module.add_module(f"c{i}", child)
    return module


@given(data=st.data())
def test_module_device_agrees_with_parameters_and_buffers(data: st.DataObject) -> None:
    """The module rule's walk finds the one device of a module's parameters and buffers,
    None where it has none, and SPREAD where they are on several."""
    module = data.draw(st.composite(_module_trees)())
    found = {t.device for t in (*module.parameters(), *module.buffers())}
    expected = Spread.SPREAD if len(found) > 1 else next(iter(found), None)
    assert expected == module_device(module)
