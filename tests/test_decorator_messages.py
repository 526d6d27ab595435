"""Every message ``@device_agnostic`` writes, asserted line by line, and its attributes."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import re
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from helpers import accelerator, mps_like
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import devicectx
from devicectx import (
    DeviceMismatchError,
    InvalidDeviceError,
    MoveError,
    device_agnostic,
    explain_device,
    on_device,
    register_container,
    to_device,
    unregister_container,
)
from devicectx.decorator._target import module_devices
from devicectx.move._unseen import unseen_tensors
from devicectx.testing import assert_device_agnostic

CPU = torch.device("cpu")
META = torch.device("meta")


def lines_of(error: pytest.ExceptionInfo[BaseException]) -> list[str]:
    """The message of a caught error, line by line."""
    return str(error.value).splitlines()


def on_meta(*shape: int) -> torch.Tensor:
    """A tensor on the meta device."""
    return torch.ones(*shape, device="meta")


class Model(nn.Module):
    """A module whose forward refuses to move anything."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    @device_agnostic(move=False)
    def forward(self, x: torch.Tensor, *extra: torch.Tensor, **named: torch.Tensor) -> None:
        pass


def test_off_target_with_decorator_device() -> None:
    """move=False: the devices with their paths, the target and why, the fix as code."""

    @device_agnostic(move=False, device="meta")
    def loss(pred: torch.Tensor, batch: dict[str, Any], target: torch.Tensor) -> None:
        pass

    batch = {"mask": on_meta(2), "labels": [torch.ones(2)] * 2}
    with pytest.raises(DeviceMismatchError) as error:
        loss(on_meta(2), batch, torch.ones(2))
    assert [
        "test_off_target_with_decorator_device.<locals>.loss() got tensors on 2 devices:",
        "    meta <- pred, batch['mask']",
        "    cpu  <- batch['labels'][0], batch['labels'][1], target",
        'target meta (from @device_agnostic(device="meta"))',
        'fix: pass to_device(batch, "meta"), target.to("meta"), '
        "or use @device_agnostic(move=True) to move the arguments",
    ] == lines_of(error)
    assert {
        META: ["pred", "batch['mask']"],
        CPU: ["batch['labels'][0]", "batch['labels'][1]", "target"],
    } == error.value.devices
    assert META == error.value.target
    assert '@device_agnostic(device="meta")' == error.value.reason


def test_off_target_from_the_module() -> None:
    """The module chose the target; ``*args`` and keyword paths are named as written."""
    model = Model().to("meta")
    with pytest.raises(DeviceMismatchError) as error:
        model(torch.ones(2), on_meta(2), torch.ones(3), k=torch.ones(2))
    assert [
        "Model.forward() got tensors on 2 devices:",
        "    meta <- extra[0]",
        "    cpu  <- x, extra[1], k",
        "target meta (from the parameters of self (Model))",
        'fix: pass x.to("meta"), to_device(extra, "meta"), k.to("meta"), '
        "or use @device_agnostic(move=True) to move the arguments",
    ] == lines_of(error)
    assert "the parameters of self (Model)" == error.value.reason


def test_off_target_from_on_device() -> None:
    """All tensors on one other device; the target came from an on_device block."""

    @device_agnostic(move=False)
    def loss(pred: torch.Tensor, target: torch.Tensor) -> None:
        pass

    x = torch.ones(2)
    with on_device("meta"), pytest.raises(DeviceMismatchError) as error:
        loss(x, x)
    assert [
        "test_off_target_from_on_device.<locals>.loss() got tensors on cpu, not on its target:",
        "    cpu <- pred, target",
        "target meta (from the innermost on_device block)",
        'fix: pass pred.to("meta"), target.to("meta"), '
        "or use @device_agnostic(move=True) to move the arguments",
    ] == lines_of(error)


def test_off_target_with_auto_says_why() -> None:
    """``device="auto"``: the reason says why auto chose what it chose."""

    @device_agnostic(move=False, device="auto")
    def run(x: torch.Tensor) -> None:
        pass

    # What "auto" is depends on the machine (the CPU, or its accelerator): ask it.
    auto, _, why = explain_device("auto").partition(": ")
    with pytest.raises(DeviceMismatchError) as error:
        run(on_meta(1))
    assert [
        "test_off_target_with_auto_says_why.<locals>.run() got tensors on meta, not on its target:",
        "    meta <- x",
        f'target {auto} (from @device_agnostic(device="auto"): {why})',
        f'fix: pass x.to("{auto}"), or use @device_agnostic(move=True) to move the arguments',
    ] == lines_of(error)


def test_long_path_lists_are_cut() -> None:
    """More than six paths on a device: the first six, then how many more."""

    @device_agnostic
    def run(a: torch.Tensor, b: torch.Tensor, *, c: list[torch.Tensor]) -> None:
        pass

    with pytest.raises(DeviceMismatchError) as error:
        run(torch.ones(2), on_meta(2), c=[torch.ones(2)] * 8)
    assert "    cpu  <- a, c[0], c[1], c[2], c[3], c[4] and 3 more" == lines_of(error)[1]
    assert 9 == len(error.value.devices[CPU])


def test_many_fixes_are_cut() -> None:
    """More than three arguments to move: the fix names three, then an ellipsis."""

    @device_agnostic(move=False, device="meta")
    def run(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> None:
        pass

    with pytest.raises(DeviceMismatchError) as error:
        run(*[torch.ones(1)] * 4)
    assert (
        'fix: pass a.to("meta"), b.to("meta"), c.to("meta"), ..., '
        "or use @device_agnostic(move=True) to move the arguments"
    ) == lines_of(error)[-1]


def test_off_target_fix_names_no_parameter_it_does_not_mean() -> None:
    """The fix's closing words are prose, not a parameter name, beside a parameter ``inputs``."""

    @device_agnostic(move=False)
    def loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        pass

    with pytest.raises(DeviceMismatchError) as error:
        loss(nn.Linear(2, 2, device="meta"), on_meta(2), torch.ones(2))
    assert [
        "test_off_target_fix_names_no_parameter_it_does_not_mean.<locals>.loss() got tensors "
        "on 2 devices:",
        "    meta <- inputs",
        "    cpu  <- targets",
        "target meta (from the parameters of model (Linear))",
        'fix: pass targets.to("meta"), or use @device_agnostic(move=True) to move the arguments',
    ] == lines_of(error)


def test_inputs_disagree_with_nothing_to_choose() -> None:
    """No rule chose a target: the message says so and how to name one."""

    @device_agnostic
    def run(a: torch.Tensor, b: torch.Tensor) -> None:
        pass

    with pytest.raises(DeviceMismatchError) as error:
        run(torch.ones(2), on_meta(2))
    assert [
        "test_inputs_disagree_with_nothing_to_choose.<locals>.run() got tensors on 2 devices:",
        "    cpu  <- a",
        "    meta <- b",
        "no target: no device= argument, no nn.Module involved and no on_device block "
        "to choose one",
        'fix: name the device with @device_agnostic(device="cpu"), or call '
        "test_inputs_disagree_with_nothing_to_choose.<locals>.run() inside "
        '`with on_device("cpu"):`',
    ] == lines_of(error)
    assert error.value.target is None


def test_inputs_disagree_under_move_false_the_fix_passes_them_on_one_device() -> None:
    """``move=False`` and nothing to choose a target: naming one would move nothing, so
    the fix passes the tensors off the first device there, or names the device without
    ``move=False``; either, followed, runs."""

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.device:
        return (x - y).device

    checked = device_agnostic(move=False)(loss)
    with pytest.raises(DeviceMismatchError) as error:
        checked(on_meta(2), torch.ones(2))
    assert (
        'fix: pass y.to("meta"), or use @device_agnostic(device="meta") (without move=False) '
        "to move the arguments there"
    ) == lines_of(error)[-1]
    assert META == checked(on_meta(2), torch.ones(2).to("meta"))
    assert META == device_agnostic(device="meta")(loss)(on_meta(2), torch.ones(2))


def test_module_not_on_the_target() -> None:
    """A module elsewhere than ``device=``: named, with the call that fixes it."""

    @device_agnostic(device="meta")
    def step(model: nn.Module, x: torch.Tensor) -> None:
        pass

    with pytest.raises(DeviceMismatchError) as error:
        step(nn.Linear(2, 2), torch.ones(2))
    assert [
        "test_module_not_on_the_target.<locals>.step() got model (Linear) on cpu, "
        "not on its target:",
        "    cpu <- model",
        'target meta (from @device_agnostic(device="meta"))',
        'fix: model.to("meta") before calling test_module_not_on_the_target.<locals>.step(): '
        "modules are never moved implicitly",
    ] == lines_of(error)
    assert {CPU: ["model"]} == error.value.devices


def test_module_spread_over_devices() -> None:
    """A module on two devices by mistake: each part (the largest submodule on one device),
    as Python code would write it; the fix moves the stray part, not the model."""

    @device_agnostic
    def step(x: torch.Tensor, model: nn.Module) -> None:
        pass

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].to("meta")
    with pytest.raises(DeviceMismatchError) as error:
        step(torch.ones(2), model=model)
    assert [
        "test_module_spread_over_devices.<locals>.step() got model (Sequential) "
        "with parameters on 2 devices:",
        "    cpu  <- model[0]",
        "    meta <- model[1]",
        "target cpu (from the device holding the largest share of model (Sequential)'s "
        "parameter and buffer elements, 6 of 12; nothing says it is spread on purpose: "
        "no accelerate hook, no declare_spread)",
        'fix: model[1].to_empty(device="cpu") before calling '
        "test_module_spread_over_devices.<locals>.step() (modules are never moved "
        "implicitly; then load or initialise its weights: model[1]'s tensors on meta hold "
        "no data), or "
        "declare_spread(model) if the split is on purpose",
    ] == lines_of(error)
    # On meta there is no data to copy: the fix makes the part anew, and, run as printed
    # (its weights then loaded), the call runs on the CPU.
    code = lines_of(error)[-1].removeprefix("fix: ").partition(" before calling")[0]
    exec(code, {"model": model})
    model[1].load_state_dict({"weight": torch.ones(2, 2), "bias": torch.zeros(2)})
    step(torch.ones(2), model=model)  # no error: the model is on the CPU
    assert {CPU} == {p.device for p in model.parameters()}


def test_a_model_wholly_on_meta_gets_a_fix_that_makes_it_anew() -> None:
    """A model made on meta (init_empty_weights), never loaded, given a device: meta holds
    no data for ``.to`` to copy (torch refuses it), so the fix is ``to_empty``, which, run
    as printed and the weights loaded, lets the call run."""

    @device_agnostic(device="cpu")
    def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(DeviceMismatchError) as error:
        predict(model, torch.ones(2))
    fix = lines_of(error)[-1]
    assert fix.startswith(
        'fix: model.to_empty(device="cpu") before calling '
        "test_a_model_wholly_on_meta_gets_a_fix_that_makes_it_anew.<locals>.predict(): "
    )
    assert fix.endswith(
        "(then load or initialise its weights: model's tensors on meta hold no data)"
    )
    exec(fix.removeprefix("fix: ").partition(" before calling")[0], {"model": model})
    model.load_state_dict({"weight": torch.eye(2), "bias": torch.zeros(2)})
    assert torch.equal(torch.ones(2), predict(model, torch.ones(2)))


def test_method_module_spread_names_self() -> None:
    """For a method, the module is ``self``."""
    model = Model()
    model.lin.bias = nn.Parameter(on_meta(2))
    with pytest.raises(DeviceMismatchError) as error:
        model(torch.ones(2))
    assert [
        "Model.forward() got self (Model) with parameters on 2 devices:",
        "    cpu  <- self.lin.weight",
        "    meta <- self.lin.bias",
        "target cpu (from the device holding the largest share of self (Model)'s parameter "
        "and buffer elements, 4 of 6; nothing says it is spread on purpose: no accelerate "
        "hook, no declare_spread)",
        'fix: self.lin.to("cpu") before calling Model.forward() (modules are never moved '
        "implicitly), or declare_spread(self) if the split is on purpose",
    ] == lines_of(error)


def test_unknown_exclude_name() -> None:
    """A name the function does not take: which, what it does take, and the fix."""

    def loss(pred: torch.Tensor, labels: torch.Tensor, *, weight: float = 1.0) -> None:
        pass

    with pytest.raises(ValueError) as error:  # noqa: PT011 - the message is checked below
        device_agnostic(exclude=("lables", "x"))(loss)
    assert [
        "@device_agnostic(exclude=...) names 'lables', 'x', which "
        "test_unknown_exclude_name.<locals>.loss() does not take "
        "(it takes 'pred', 'labels', 'weight')",
        "fix: exclude only parameters of test_unknown_exclude_name.<locals>.loss(), by name",
    ] == lines_of(error)


def test_unmovable_argument_names_the_parameter() -> None:
    """A tensor that cannot be moved: the move engine's error names the parameter path.

    The wording is the move engine's (tested line by line there); here, that the path
    starts at the parameter and the fix names ``exclude=`` with it.
    """

    @device_agnostic(device="cpu")
    def run(x: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
        pass

    with pytest.raises(RuntimeError) as error:
        run(torch.ones(1), {"mask": on_meta(1)})
    lines = lines_of(error)
    assert "could not move batch['mask'] (" in lines[0]
    assert "@device_agnostic(device='cpu', exclude=('batch',))" in lines[-1]


def test_the_exclude_fix_keeps_the_decorators_other_arguments() -> None:
    """The fix of an argument that cannot be moved writes the decorator again with it
    added to exclude=, keeping what the caller wrote (dtypes=, device=, an exclude= of
    its own): pasted, the call runs, its dtypes= still in force."""

    @device_agnostic(device="cpu", dtypes={torch.float64: torch.float32}, exclude=("n",))
    def run(x: torch.Tensor, batch: dict[str, torch.Tensor], n: int = 0) -> torch.dtype:
        return x.dtype

    with pytest.raises(RuntimeError) as error:
        run(torch.ones(1, dtype=torch.float64), {"mask": on_meta(1)})
    decorator = lines_of(error)[-1].rsplit("leave the argument out of the move: ", 1)[1]
    expected = (
        "@device_agnostic(device='cpu', dtypes={torch.float64: torch.float32}, "
        "exclude=('n', 'batch'))"
    )
    assert expected == decorator
    fixed = eval(decorator[1:], {"device_agnostic": device_agnostic, "torch": torch})(
        run.__wrapped__
    )
    assert torch.float32 == fixed(torch.ones(1, dtype=torch.float64), {"mask": on_meta(1)})


def test_decorator_frames_are_hidden_from_pytest() -> None:
    """pytest's traceback of a mismatch shows the caller, not devicectx's wrapper frames."""

    @device_agnostic(move=False, device="meta")
    def run(x: torch.Tensor) -> None:
        pass

    with pytest.raises(DeviceMismatchError) as error:
        run(torch.ones(1))
    shown = [str(entry.path) for entry in error.traceback.filter(error)]
    assert [] == [path for path in shown if "devicectx" in path and "tests" not in path]


def test_module_argument_of_a_method_is_named_by_its_parameter() -> None:
    """In a method of a plain class, a module argument is named by its parameter."""

    class Trainer:
        @device_agnostic(device="meta")
        def step(self, model: nn.Module, x: torch.Tensor) -> None:
            pass

    with pytest.raises(DeviceMismatchError) as error:
        Trainer().step(nn.Linear(2, 2), torch.ones(2))
    assert (
        "test_module_argument_of_a_method_is_named_by_its_parameter.<locals>.Trainer.step() "
        "got model (Linear) on cpu, not on its target:"
    ) == lines_of(error)[0]


def test_wrapped_module_fix_moves_before_wrapping() -> None:
    """A DataParallel (or DDP, FSDP) model off the target: the fix moves the model before
    wrapping it, since a wrapped model is not moved afterwards."""

    @device_agnostic(device="meta")
    def step(model: nn.Module, x: torch.Tensor) -> None:
        pass

    model = nn.DataParallel(nn.Linear(2, 2))  # on cuda:0 where CUDA is: DataParallel moves it
    where = next(model.parameters()).device
    with pytest.raises(DeviceMismatchError) as error:
        step(model, torch.ones(2))
    assert [
        "test_wrapped_module_fix_moves_before_wrapping.<locals>.step() got model "
        f"(DataParallel) on {where}, not on its target:",
        f"    {where} <- model",
        'target meta (from @device_agnostic(device="meta"))',
        'fix: move the model before wrapping it: model.to("meta"), then '
        "DataParallel(model, ...); a wrapped model is not moved afterwards (and never "
        "implicitly)",
    ] == lines_of(error)


# Tensors the decorator cannot see: torch's mismatch in the body, told with their names.


class Config:
    """A plain object holding a tensor: the decorator neither moves nor checks it."""

    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale
        self.name = "config"


class Trainer:
    """A plain object holding the model and its optimizer: the trainer pattern."""

    def __init__(self) -> None:
        model = nn.Linear(2, 3, device="meta")
        # Met first in the look: its parameters are the model's, named once, as the model.
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        self.model = model

    @device_agnostic
    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(batch["x"])


class Slotted:
    """A ``__slots__`` object holding tensors, one in a list."""

    __slots__ = ("bias", "extra")

    def __init__(self, bias: torch.Tensor, extra: list[torch.Tensor]) -> None:
        self.bias = bias
        self.extra = extra


@device_agnostic(device="meta")
def scaled(x: torch.Tensor, cfg: Any) -> torch.Tensor:
    """Multiplies by what ``cfg`` holds."""
    if isinstance(cfg, Slotted):
        return x * cfg.bias + cfg.extra[0]
    return x * cfg.scale


def test_a_tensor_in_a_plain_object_is_named_when_torch_fails() -> None:
    """torch's device mismatch in the body comes back as a DeviceMismatchError naming the
    attribute, its device, the target and the fix, chained to torch's error."""
    with pytest.raises(DeviceMismatchError) as error:
        scaled(torch.ones(2), Config(torch.ones(2)))
    assert [
        "scaled() failed in torch on tensors @device_agnostic cannot see into:",
        "    cpu <- cfg.scale (in Config)",
        'target meta (from @device_agnostic(device="meta"))',
        "torch said: Tensor on device cpu is not on the expected device meta!",
        "fix: import copy; from devicectx import register_container; "
        'register_container(Config, children=lambda obj: [("scale", '
        "obj.scale)], rebuild=lambda obj, new: (clone := copy.copy(obj), setattr(clone, "
        '"scale", new[0]))[0]), pass cfg.scale as an argument, or give Config a .to(device) '
        "method" + written_into("cfg.scale"),
    ] == lines_of(error)
    assert {CPU: ["cfg.scale"]} == error.value.devices
    assert META == error.value.target
    cause = error.value.__cause__
    assert type(cause) is RuntimeError
    assert "is not on the expected device" in str(cause)
    with printed_fix_run(lines_of(error)[-1], {"Config": Config}):
        config = Config(torch.ones(2))
        assert META == scaled(torch.ones(2), config).device
        assert CPU == config.scale.device  # the call's copy moved, the caller's stays


@device_agnostic(device="meta")
def scaled_each(x: torch.Tensor, cfg: Any) -> Iterator[torch.Tensor]:
    """A generator: multiplies by what ``cfg`` holds, at its first resume."""
    yield x * cfg.scale


@device_agnostic(device="meta")
async def scaled_later(x: torch.Tensor, cfg: Any) -> torch.Tensor:
    """A coroutine: multiplies by what ``cfg`` holds, when awaited."""
    return x * cfg.scale


@device_agnostic(device="meta")
async def scaled_each_later(x: torch.Tensor, cfg: Any) -> AsyncIterator[torch.Tensor]:
    """An async generator: multiplies by what ``cfg`` holds, at its first resume."""
    yield x * cfg.scale


async def _first(items: AsyncIterator[torch.Tensor]) -> torch.Tensor:
    return await anext(items)


RUNS: dict[str, Callable[[torch.Tensor, Any], Any]] = {
    "generator": lambda x, cfg: next(scaled_each(x, cfg)),
    "coroutine": lambda x, cfg: asyncio.run(scaled_later(x, cfg)),
    "async generator": lambda x, cfg: asyncio.run(_first(scaled_each_later(x, cfg))),
}


@pytest.mark.parametrize("kind", list(RUNS))
def test_a_tensor_in_a_plain_object_is_named_when_torch_fails_in_a_resumed_body(
    kind: str,
) -> None:
    """A generator's or coroutine's body runs at a resume, after the call returned: torch's
    device mismatch there is told as a plain call's is (the object's tensor named, chained
    to torch's error), not torch's bare error."""
    with pytest.raises(DeviceMismatchError) as error:
        RUNS[kind](torch.ones(2), Config(torch.ones(2)))
    assert "    cpu <- cfg.scale (in Config)" == lines_of(error)[1]
    assert type(error.value.__cause__) is RuntimeError
    with pytest.raises(RuntimeError, match="broadcast") as other:  # as it is
        RUNS[kind](torch.ones(2), Config(on_meta(3)))
    assert type(other.value) is RuntimeError


@attrs.frozen
class FrozenAttrs:
    """A frozen attrs class holding a tensor: its __setattr__ refuses any assignment."""

    scale: torch.Tensor


class FrozenPlain:
    """A plain class that refuses assignment after __init__, as frozen classes do."""

    def __init__(self, scale: torch.Tensor) -> None:
        object.__setattr__(self, "scale", scale)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"FrozenPlain is frozen: cannot set {name}")


@pytest.mark.parametrize("frozen", [FrozenAttrs, FrozenPlain])
def test_the_register_fix_for_a_frozen_class_works_as_printed(frozen: type) -> None:
    """A frozen class (its own __setattr__ refuses assignment): the printed rebuild sets
    the moved tensors on its copy past that __setattr__, as such classes set their own
    fields; with setattr, following the fix failed in the move."""
    with pytest.raises(DeviceMismatchError) as error:
        scaled(torch.ones(2), frozen(torch.ones(2)))
    assert "object.__setattr__(clone, " in lines_of(error)[-1]
    with printed_fix_run(lines_of(error)[-1], {frozen.__name__: frozen}):
        config = frozen(torch.ones(2))
        assert META == scaled(torch.ones(2), config).device
        assert CPU == config.scale.device


class Batch(dict[str, Any]):
    """A collate_fn's batch: a dict with a tensor attached as an attribute too."""


class Rows(list[Any]):
    """A list of rows with a tensor attached as an attribute."""


@pytest.mark.parametrize("holder", [Batch, Rows])
def test_a_tensor_attribute_of_a_dict_or_list_subclass_is_named_when_torch_fails(
    holder: type,
) -> None:
    """The move takes a dict or list subclass's entries, not its attributes: a tensor kept
    as one is named (it was "found in none of its arguments"), with a fix that keeps it
    where the move takes it (a container taught to the walk would drop the entries)."""

    @device_agnostic(device="meta")
    def masked(batch: Any) -> torch.Tensor:
        return torch.ones(2) * batch.scale  # made on meta, in the call's scope

    batch = holder()
    batch.scale = torch.ones(2)
    with pytest.raises(DeviceMismatchError) as error:
        masked(batch)
    lines = lines_of(error)
    assert f"    cpu <- batch.scale (in {holder.__name__})" == lines[1]
    if holder is Batch:
        assert (
            "fix: keep it as an entry, batch['scale'] (the move takes a Batch's entries, not "
            "its attributes), or pass batch.scale as an argument"
        ) == lines[-1]
    else:
        assert lines[-1].startswith("fix: keep batch.scale out of the Rows")


def test_a_tensor_reached_through_a_structure_that_holds_itself_is_named() -> None:
    """A tree with a link back to its root: the move copies each container once, and the
    copy's link leads to the original, left on the CPU. The error names the path through
    the link (it said the tensor was in none of the arguments, made in the body)."""
    root: dict[str, Any] = {"x": torch.ones(2)}
    root["child"] = {"parent": root, "y": torch.ones(2)}

    @device_agnostic(device="meta")
    def summed(tree: dict[str, Any]) -> torch.Tensor:
        return tree["child"]["y"] + tree["child"]["parent"]["x"]

    with pytest.raises(DeviceMismatchError) as error:
        summed(root)
    lines = lines_of(error)
    assert lines[0].endswith(
        "summed() failed in torch on tensors its move left where they were, reached through "
        "a structure that holds itself:"
    )
    assert lines[1].startswith("    cpu <- tree['child']['parent']['x']")
    assert lines[-1].startswith(
        "fix: tree['child']['parent']['x'] is reached through a link back to a container above it"
    )
    assert CPU in error.value.devices


DEFAULT_CONFIG = Config(torch.ones(2))


class Scaler(nn.Module):
    """A module whose forward reads a config object given as a default."""

    @device_agnostic(device="meta")
    def forward(self, x: torch.Tensor, cfg: Any = DEFAULT_CONFIG) -> torch.Tensor:
        return x * cfg.scale


@pytest.mark.parametrize("method", [False, True])
def test_a_tensor_in_a_default_argument_is_named_when_torch_fails(method: bool) -> None:
    """A plain object given as a parameter's default is an argument the body reads: its
    tensors are named as if it were passed, for a function and a method."""

    @device_agnostic(device="meta")
    def scaled_by_default(x: torch.Tensor, cfg: Any = DEFAULT_CONFIG) -> torch.Tensor:
        return x * cfg.scale

    call = Scaler() if method else scaled_by_default
    with pytest.raises(DeviceMismatchError) as error:
        call(torch.ones(2))
    assert "    cpu <- cfg.scale (in Config)" == lines_of(error)[1]
    assert {CPU: ["cfg.scale"]} == error.value.devices


@pytest.mark.parametrize("move", [True, False])
def test_a_second_module_is_named_when_torch_fails(move: bool) -> None:
    """A loss module whose class weights stayed on the CPU, beside the model the target
    follows: later module arguments are not checked (a teacher may live elsewhere on
    purpose), so torch fails in the body, and the error names the module and its fix."""

    @device_agnostic(move=move)
    def train_step(model: nn.Module, x: torch.Tensor, loss_fn: nn.Module) -> torch.Tensor:
        logits = model(x)
        return loss_fn(logits, torch.zeros(2, dtype=torch.long, device=logits.device))

    model = nn.Linear(2, 3, device="meta")
    with pytest.raises(DeviceMismatchError) as error:
        train_step(model, on_meta(2, 2), nn.CrossEntropyLoss(weight=torch.ones(3)))
    assert [
        "test_a_second_module_is_named_when_torch_fails.<locals>.train_step() failed in torch "
        "on tensors @device_agnostic cannot see into:",
        "    cpu <- loss_fn (CrossEntropyLoss, a module @device_agnostic does not check)",
        "target meta (from the parameters of model (Linear))",
        "torch said: Tensor on device cpu is not on the expected device meta!",
        'fix: loss_fn.to("meta") before the call: modules are never moved implicitly',
    ] == lines_of(error)
    assert {CPU: ["loss_fn"]} == error.value.devices


def test_a_model_held_by_a_plain_object_is_named_with_the_device_to_follow() -> None:
    """The trainer pattern: the model is an attribute of ``self``, a plain object, and the
    inputs chose the target. The error names the model as a whole (not its parameters
    again where the optimizer holds them), says the inputs chose, and the fix follows the
    model's device."""

    with pytest.raises(DeviceMismatchError) as error:
        Trainer().step({"x": torch.ones(2)})
    assert [
        "    meta <- self.model (Linear, in Trainer)",
        "target cpu (from the tensor arguments)",
    ] == lines_of(error)[1:3]
    assert lines_of(error)[-1] == (
        'fix: @device_agnostic(device="meta"), or pass self.model as the first module '
        "argument, so that the inputs follow it"
    )


def test_a_network_held_by_an_agent_given_numpy_gets_a_fix_that_keeps_it_agnostic() -> None:
    """An RL agent, a plain object holding its network, acting on a numpy observation: no
    tensor argument chose a target, which the message says (not "from the tensor
    arguments"), and the fix makes the agent a module, whose network then chooses, before
    naming a device; followed, the call runs on the network's device."""
    net = nn.Linear(4, 2, device="meta")
    obs = np.zeros(4, dtype=np.float32)

    class Agent:
        def __init__(self, net: nn.Linear) -> None:
            self.net = net

        @device_agnostic
        def act(self, obs: np.ndarray) -> torch.Tensor:
            return self.net(torch.as_tensor(obs))  # type: ignore[no-any-return]

    with pytest.raises(DeviceMismatchError) as error:
        Agent(net).act(obs)
    assert lines_of(error)[2] == (
        "no target: no device= argument, no nn.Module argument, no tensor argument and no "
        "on_device block to choose one"
    )
    assert lines_of(error)[-1] == (
        "fix: make Agent an nn.Module (class Agent(nn.Module), super().__init__() first in "
        'its __init__), so that self.net chooses the target, or @device_agnostic(device="meta")'
    )

    class ModuleAgent(nn.Module):
        def __init__(self, net: nn.Linear) -> None:
            super().__init__()
            self.net = net

        act = Agent.act

    assert META == ModuleAgent(net).act(obs).device


def test_modules_in_a_container_are_named_when_torch_fails() -> None:
    """Modules inside a container argument are not checked; torch's failure names them."""

    @device_agnostic(device="meta")
    def step(models: dict[str, nn.Module], x: torch.Tensor) -> torch.Tensor:
        return models["dec"](models["enc"](x))

    models = {"enc": nn.Linear(2, 2, device="meta"), "dec": nn.Linear(2, 2)}
    with pytest.raises(DeviceMismatchError) as error:
        step(models, torch.ones(2))
    assert [
        "    cpu <- models['dec'] (Linear, a module @device_agnostic does not check)",
        'target meta (from @device_agnostic(device="meta"))',
    ] == lines_of(error)[1:3]
    assert lines_of(error)[-1] == (
        "fix: models['dec'].to(\"meta\") before the call: modules are never moved implicitly"
    )


class _TiedLM(nn.Module):
    """An embedding and a head sharing one weight (a language model's tie)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)  # type: ignore[no-any-return]


def test_the_fix_for_a_tied_module_in_a_container_keeps_its_tie() -> None:
    """A tied model that the decorator does not check (in a list): the fix moves it with
    to_device, which keeps the tie (module.to to meta unties it); applied as printed, the
    call runs and the weight is still one tensor."""

    @device_agnostic(device="meta")
    def step(models: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
        return models[0](x).sum()

    models = [_TiedLM()]
    with pytest.raises(DeviceMismatchError) as error:
        step(models, torch.ones(1, 4))
    fix = lines_of(error)[-1].removeprefix("fix: ")
    assert fix == (
        'to_device(models[0], "meta") before the call, which keeps its tied weights tied '
        "(models[0].to() can untie them): modules are never moved implicitly"
    )
    exec(fix.partition(" before the call")[0], {"to_device": to_device, "models": models})
    step(models, torch.ones(1, 4))
    assert models[0].head.weight is models[0].emb.weight
    assert META == models[0].emb.weight.device


def test_slots_and_lists_inside_them_are_looked_into() -> None:
    """Slots are read as attributes are; a container inside the object is walked."""
    with pytest.raises(DeviceMismatchError) as error:
        scaled(torch.ones(2), Slotted(torch.ones(2), [on_meta(2), torch.ones(2)]))
    assert "    cpu <- cfg.bias (in Slotted), cfg.extra[1] (in Slotted)" == lines_of(error)[1]
    assert lines_of(error)[-1].startswith(
        "fix: import copy; from devicectx import register_container; "
        'register_container(Slotted, children=lambda obj: [("bias", '
        'obj.bias), ("extra", obj.extra)], rebuild=lambda obj, new: (clone := copy.copy(obj), '
        'setattr(clone, "bias", new[0]), setattr(clone, "extra", new[1]))[0]), or give '
    )
    with printed_fix_run(lines_of(error)[-1], {"Slotted": Slotted}):
        assert META == scaled(torch.ones(2), Slotted(torch.ones(2), [torch.ones(2)])).device


class Offset(nn.Module):
    """A module with a tensor set as a plain attribute, not a buffer: .to() leaves it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.offset = torch.ones(2)

    @device_agnostic
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.offset


def test_a_module_tensor_that_is_no_buffer_is_named_with_the_buffer_fix() -> None:
    """``self.offset = tensor`` is not moved by ``model.to``: the error says to register it."""
    model = Offset().to("meta")
    with pytest.raises(DeviceMismatchError) as error:
        model(on_meta(2))
    assert [
        "Offset.forward() failed in torch on tensors @device_agnostic cannot see into:",
        "    cpu <- self.offset (a plain attribute of Offset, not a buffer)",
        "target meta (from the parameters of self (Offset))",
        "torch said: Tensor on device cpu is not on the expected device meta!",
        'fix: self.register_buffer("offset", ..., persistent=False) in Offset.__init__, not '
        "self.offset = ..., so that self.to(...) moves it",
    ] == lines_of(error)


class Shifted(nn.Module):
    """A block with a plain tensor attribute, not a buffer, kept in a list by :class:`Stack`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.shift = torch.ones(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.shift


class Stack(nn.Module):
    """Blocks in an ``nn.ModuleList``, which Python reaches as ``blocks[0]``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Shifted()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)  # type: ignore[no-any-return]


def test_the_buffer_fix_names_a_listed_block_by_its_index() -> None:
    """A block in a ModuleList is written ``model.blocks[0]``, as code reaches it."""

    @device_agnostic
    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)  # type: ignore[no-any-return]

    with pytest.raises(DeviceMismatchError) as error:
        step(Stack().to("meta"), on_meta(2))
    assert [
        "test_the_buffer_fix_names_a_listed_block_by_its_index.<locals>.step() failed in torch "
        "on tensors @device_agnostic cannot see into:",
        "    cpu <- model.blocks[0].shift (a plain attribute of Shifted, not a buffer)",
        "target meta (from the parameters of model (Stack))",
        "torch said: Tensor on device cpu is not on the expected device meta!",
        'fix: self.register_buffer("shift", ..., persistent=False) in Shifted.__init__, not '
        "self.shift = ..., so that model.blocks[0].to(...) moves it",
    ] == lines_of(error)


class _HookCache:
    """What accelerate's hook keeps on the module it hooks (offloaded weights, a tied
    weight's copies per device): tensors it puts in place itself at each call."""

    def __init__(self) -> None:
        self.tied_params_map = {0: {CPU: torch.ones(2)}}


def test_tensors_in_accelerates_hook_are_not_named() -> None:
    """A module's ``_hf_hook`` (accelerate's) holds tensors of its own: they are not the
    caller's to move, so the error names the plain attribute alone, and no container fix
    for the hook."""
    model = Offset().to("meta")
    model._hf_hook = _HookCache()
    with pytest.raises(DeviceMismatchError) as error:
        model(on_meta(2))
    named = lines_of(error)[1]
    assert "    cpu <- self.offset (a plain attribute of Offset, not a buffer)" == named
    assert "_hf_hook" not in str(error.value)


def test_a_mismatch_with_nothing_unseen_names_what_the_body_reached() -> None:
    """Where every argument's tensor was seen, the stray one came from the body (made there
    on a device by name, here): the error says where such a tensor comes from and the fix,
    chained to torch's; the fix followed (the tensor passed as an argument) runs."""
    stray = torch.ones(2)

    @device_agnostic(device="meta")
    def adds(x: torch.Tensor, cfg: Config) -> torch.Tensor:
        return x + torch.ones(2, device="cpu")

    @device_agnostic(device="meta")
    def adds_passed(x: torch.Tensor, cfg: Config, offset: torch.Tensor) -> torch.Tensor:
        return x + offset

    with pytest.raises(DeviceMismatchError) as error:
        adds(torch.ones(2), Config(on_meta(2)))  # cfg's tensor is on the target
    assert [
        f"{adds.__qualname__}() failed in torch on a tensor on cpu that @device_agnostic "
        "found in none of its arguments: made in the body on cpu by name, from numpy, or "
        "read from a global or a closure (or held deeper in an argument than it looks)",
        'target meta (from @device_agnostic(device="meta"))',
        "torch said: Tensor on device cpu is not on the expected device meta!",
        "fix: make it on the inputs' device in the body, torch.zeros(n, device=x.device), "
        "and move none to cpu by name; torch.as_tensor(array), which the scope puts on the "
        "target, for a numpy array (torch.from_numpy stays on cpu); pass a global or "
        "closure's tensor as an argument",
    ] == str(error.value).splitlines()
    assert type(error.value.__cause__) is RuntimeError
    assert {torch.device("cpu"): []} == error.value.devices
    assert adds_passed(torch.ones(2), Config(on_meta(2)), stray).device.type == "meta"


SCALE = torch.ones(2)  # a module's constant, as a notebook's cell makes one
HEAD = nn.Linear(2, 2)


def test_a_stray_tensor_or_module_the_body_reads_by_name_is_named() -> None:
    """A tensor (or a module) on another device that the body reads from its module's
    globals or its closure, where the decorator does not look, is named with what holds it;
    the fix followed (passed as an argument) runs. A notebook's constants are globals."""
    offset = torch.ones(2)

    @device_agnostic(device="meta")
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * SCALE + offset

    @device_agnostic(device="meta")
    def headed(x: torch.Tensor) -> torch.Tensor:
        return HEAD(x)

    with pytest.raises(DeviceMismatchError) as error:
        scaled(torch.ones(2))
    name = scaled.__qualname__
    assert [
        f"{name}() failed in torch on tensors on cpu that its body reads by name, where "
        "@device_agnostic does not look:",
        f"    cpu <- SCALE (a global of {name}), offset (a closure variable of {name})",
        'target meta (from @device_agnostic(device="meta"))',
        "torch said: Tensor on device cpu is not on the expected device meta!",
        "fix: pass SCALE as an argument, which the call then moves (or checks); or move it "
        "to meta once, where it is made",
    ] == str(error.value).splitlines()
    assert {CPU: ["SCALE", "offset"]} == error.value.devices
    with pytest.raises(DeviceMismatchError, match=r"cpu <- HEAD \(a global of"):
        headed(torch.ones(2))

    @device_agnostic(device="meta")
    def scaled_passed(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return x * scale + shift

    assert META == scaled_passed(torch.ones(2), SCALE, offset).device


def test_a_stray_tensor_a_modules_hook_reads_by_name_is_named_with_a_fix_that_works() -> None:
    """A forward hook of a submodule adding a constant made on the CPU: named with the hook
    and the module holding it (not "made in the body"); the fix followed (a buffer, read
    from the hook's module) runs on the target."""
    offset = torch.ones(2)
    model = nn.Sequential(nn.Linear(2, 2)).to("meta")
    model[0].register_forward_hook(lambda module, args, out: out + offset)

    @device_agnostic
    def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)  # type: ignore[no-any-return]

    with pytest.raises(DeviceMismatchError) as error:
        forward(model, torch.ones(2))
    lines = str(error.value).splitlines()
    assert [
        f"{forward.__qualname__}() failed in torch on a tensor on cpu that a hook of its "
        "module reads by name, where @device_agnostic does not look:",
        "    cpu <- offset (a closure variable of a forward hook of model[0])",
    ] == lines[:2]
    assert lines[-1] == (
        'fix: model[0].register_buffer("offset", offset) and read it in the hook as '
        "module.offset (its first argument), so that model[0].to() moves it with the model; "
        "or move offset to meta once, where it is made"
    )
    fixed = nn.Sequential(nn.Linear(2, 2))
    fixed[0].register_buffer("offset", offset)
    fixed[0].register_forward_hook(lambda module, args, out: out + module.offset)
    assert META == forward(fixed.to("meta"), torch.ones(2)).device


def _act(model: nn.Module, obs: np.ndarray) -> torch.Tensor:
    return model(torch.from_numpy(obs))  # type: ignore[no-any-return]


def _act_fixed(model: nn.Module, obs: np.ndarray) -> torch.Tensor:
    return model(torch.as_tensor(obs))  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "where",
    ["meta", pytest.param("accelerator", marks=[pytest.mark.requires_device("accelerator")])],
)
@pytest.mark.parametrize("scope", [True, False])
def test_a_numpy_argument_made_a_tensor_in_the_body_gets_its_fix(where: str, scope: bool) -> None:
    """``model(torch.from_numpy(obs))``, the commonest line of acting code: the error names
    the numpy argument and the fix, which runs, in the words torch has for each device
    ("mat1 is on cpu, different from other tensors on ..." off meta)."""
    device = torch.device("meta") if where == "meta" else accelerator()
    model = nn.Linear(3, 2).to(device)
    obs = np.ones((1, 3), dtype=np.float32)
    with pytest.raises(DeviceMismatchError) as error:
        device_agnostic(scope=scope)(_act)(model, obs)
    made = (
        "torch.as_tensor(obs), which the scope puts on the target"
        if scope
        else "torch.as_tensor(obs, device=x.device)"
    )
    assert (
        f"fix: obs is a numpy array, passed as it is: make its tensor with {made}, in the "
        "body (torch.from_numpy stays on cpu)"
    ) == str(error.value).splitlines()[-1]
    if scope:
        assert device == device_agnostic(_act_fixed)(model, obs).device


def test_a_torch_types_container_fix_names_it_by_its_public_path_and_runs() -> None:
    """A tensor in one of torch's plain objects (a ``TensorDataset``): the fix imports
    what it uses and names the type as ``torch.utils.data.TensorDataset``, so that it
    runs pasted into a fresh namespace; the call then moves the dataset's tensors."""

    @device_agnostic(device="meta")
    def first(x: torch.Tensor, ds: torch.utils.data.TensorDataset) -> torch.Tensor:
        return x + ds.tensors[0]

    with pytest.raises(DeviceMismatchError) as error:
        first(torch.ones(2), torch.utils.data.TensorDataset(torch.ones(2)))
    fix = lines_of(error)[-1]
    assert fix.startswith(
        "fix: import copy, torch; from devicectx import register_container; "
        "register_container(torch.utils.data.TensorDataset, children=lambda obj: "
    )
    code = fix.removeprefix("fix: ").partition(", pass ")[0]
    try:
        exec(code, {})  # a fresh namespace: nothing imported
        dataset = torch.utils.data.TensorDataset(torch.ones(2))
        assert META == first(torch.ones(2), dataset).device
    finally:
        unregister_container(torch.utils.data.TensorDataset)


class _KeepsItsDevice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.device = torch.device("cpu")  # stored when built: model.to() leaves it
        self.linear = nn.Linear(2, 2)

    @device_agnostic
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + torch.zeros(2, device=self.device)


def test_a_device_stored_in_the_module_is_named_with_its_fix() -> None:
    """``self.device`` kept from construction puts a tensor off the device the module was
    moved to: the error names the attribute and the fix reads the inputs' device."""
    model = _KeepsItsDevice().to("meta")
    with pytest.raises(DeviceMismatchError) as error:
        model(torch.ones(1, 2))
    assert [
        "_KeepsItsDevice.forward() failed in torch on a tensor on cpu, where devices stored "
        "in its arguments point:",
        "    cpu <- self.device",
        "target meta (from the parameters of self (_KeepsItsDevice))",
        "torch said: Tensor on device cpu is not on the expected device meta!",
        "fix: read the device where the tensors are made, from the inputs (device=x.device) "
        "or the module's parameters (next(self.parameters()).device), not self.device: "
        "model.to() moves a module's tensors, not a device it stored when it was built",
    ] == str(error.value).splitlines()
    assert {torch.device("cpu"): ["self.device"]} == error.value.devices


def test_a_body_made_numpy_tensor_is_named_with_its_fix() -> None:
    """A tensor made over numpy's memory in a decorated body stays on the CPU, whatever
    the scope: the error names numpy and ``torch.as_tensor(array, device=x.device)``."""

    @device_agnostic(device="meta")
    def shifted(x: torch.Tensor) -> torch.Tensor:
        return x + torch.from_numpy(np.ones(2, dtype=np.float32))

    @device_agnostic(device="meta")
    def shifted_fixed(x: torch.Tensor) -> torch.Tensor:
        return x + torch.as_tensor(np.ones(2, dtype=np.float32))

    with pytest.raises(DeviceMismatchError, match=r"torch.from_numpy stays on cpu"):
        shifted(torch.ones(2))
    assert shifted_fixed(torch.ones(2)).device.type == "meta"


def test_other_errors_pass_through() -> None:
    """An error that is not a device mismatch is not touched, even with unseen tensors."""

    @device_agnostic(device="meta")
    def fails(cfg: Config) -> None:
        raise RuntimeError("something else")

    with pytest.raises(RuntimeError) as error:
        fails(Config(torch.ones(2)))
    assert type(error.value) is RuntimeError
    assert "something else" == str(error.value)


class Walked(nn.Module):
    """A model whose ``modules()`` walk fails once its forward has failed: the walk that an
    error which is no device mismatch must neither pay for nor be replaced by."""

    def __init__(self, error: RuntimeError) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.error = error
        self.failed = False

    def modules(self) -> Iterator[nn.Module]:
        if self.failed:
            msg = "walked the model after its forward failed"
            raise AssertionError(msg)
        return super().modules()

    @device_agnostic
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.failed = True
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("shape '[2, 3]' is invalid for input of size 4"),
    ],
    ids=["out-of-memory", "shape"],
)
def test_other_errors_from_a_model_pass_through_without_a_walk(error: RuntimeError) -> None:
    """An error from a model's forward that is no device mismatch (out of memory, a wrong
    shape) is re-raised as it is, the same object, and the model's modules are not walked."""
    with pytest.raises(RuntimeError) as raised:
        Walked(error)(torch.ones(2))
    assert raised.value is error


class Counted:
    """Counts reads of its ``__dict__``: how the look into attributes starts."""

    reads = 0

    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale

    def __getattribute__(self, name: str) -> Any:
        if name == "__dict__":
            type(self).reads += 1
        return object.__getattribute__(self, name)


def test_the_look_into_attributes_runs_only_on_failure() -> None:
    """A call that succeeds never looks into its arguments' attributes; one that fails does."""

    @device_agnostic(device="meta")
    def uses(x: torch.Tensor, cfg: Counted) -> torch.Tensor:
        return x * cfg.scale

    Counted.reads = 0
    for _ in range(3):
        uses(on_meta(2), Counted(on_meta(2)))
    assert 0 == Counted.reads
    with pytest.raises(DeviceMismatchError):
        uses(on_meta(2), Counted(torch.ones(2)))
    assert Counted.reads > 0


def test_the_look_is_bounded_in_depth_and_ends_on_cycles() -> None:
    """A cycle of objects ends; a tensor nested deeper than the bound is not looked for
    (torch's error then comes through as it was)."""
    a, b = Config(torch.ones(2)), Config(torch.ones(2))
    a.name, b.name = b, a  # type: ignore[assignment]
    with pytest.raises(DeviceMismatchError) as error:
        scaled(torch.ones(2), a)
    assert "    cpu <- cfg.scale (in Config), cfg.name.scale (in Config)" == lines_of(error)[1]

    @device_agnostic(device="meta")
    def innermost(x: torch.Tensor, cfg: Any) -> torch.Tensor:
        while isinstance(cfg.name, Config):
            cfg = cfg.name
        return x * cfg.scale

    deep = Config(torch.ones(2))
    for _ in range(10):  # each level's name holds the next
        outer = Config(on_meta(2))
        outer.name = deep  # type: ignore[assignment]
        deep = outer
    with pytest.raises(DeviceMismatchError) as raw:  # not found: named as not found
        innermost(torch.ones(2), deep)
    assert "(or held deeper in an argument than it looks)" in str(raw.value).splitlines()[0]


@pytest.mark.parametrize("option", ["move", "non_blocking", "scope", "coalesce"])
@pytest.mark.parametrize("value", ["yes", "no", 1, None])
def test_a_switch_that_is_not_a_bool_is_refused_at_decoration(option: str, value: object) -> None:
    """``move="yes"`` (and the other on/off options) fail at decoration, with the fix."""
    with pytest.raises(TypeError) as error:
        device_agnostic(**{option: value})  # type: ignore[arg-type]
    assert [
        f"@device_agnostic({option}={value!r}): {option} takes True or False, not "
        f"{'an int' if isinstance(value, int) else 'a ' + type(value).__qualname__}",
        f"fix: @device_agnostic({option}=True) or @device_agnostic({option}=False)",
    ] == lines_of(error)


def test_a_device_type_in_the_wrong_case_suggests_the_right_one() -> None:
    """``on_device("CPU")`` says did you mean 'cpu'."""
    with pytest.raises(InvalidDeviceError) as error, on_device("CPU"):
        pass
    assert lines_of(error)[0] == (
        "invalid device 'CPU': unknown device type 'CPU', did you mean 'cpu'?"
    )


def test_public_exceptions_print_under_the_package_name() -> None:
    """A traceback shows devicectx.DeviceMismatchError, as users import it."""
    for name in devicectx.__all__:
        obj = getattr(devicectx, name)
        if isinstance(obj, type) and issubclass(obj, (Exception, Warning)):
            assert "devicectx" == obj.__module__, name

    text = "".join(
        traceback.format_exception_only(
            DeviceMismatchError("x", devices={}, target=None, reason="")
        )
    )
    assert text.startswith("devicectx.DeviceMismatchError: x")


class Keyed(nn.Module):
    """Children reached by string keys that are digits: a ModuleDict's and a
    ParameterDict's (``heads[1]`` would be a KeyError), beside a ModuleList's indices."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleDict({"0": nn.Linear(2, 2), "1": nn.Linear(2, 2)})
        self.scales = nn.ParameterDict({"0": torch.ones(2), "1": torch.ones(2)})
        self.layers = nn.ModuleList([nn.Linear(2, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads["1"](self.layers[0](x)) * self.scales["0"]


def reached(model: nn.Module, path: str) -> set[torch.device]:
    """The devices of what ``path`` (``model.heads['1']``), evaluated, reaches."""
    found = eval(path, {"model": model})
    if isinstance(found, torch.Tensor):
        return {found.device}
    return {tensor.device for tensor in (*found.parameters(), *found.buffers())}


def test_paths_of_dict_keys_that_are_digits_reach_what_they_name() -> None:
    """A ModuleDict's (or ParameterDict's) keys are strings, digits or not: each path a
    message lists reaches what it names, and the fix, run as written, moves the strays."""
    model = Keyed()
    model.heads["0"].to("meta")
    model.layers.to("meta")
    model.scales["1"] = nn.Parameter(torch.ones(2, device="meta"))

    @device_agnostic
    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)  # type: ignore[no-any-return]

    with pytest.raises(DeviceMismatchError) as error:
        step(model, torch.ones(2))
    assert {
        META: ["model.heads['0']", "model.scales['1']", "model.layers"],
        CPU: ["model.heads['1']", "model.scales['0']"],
    } == error.value.devices
    for device, paths in error.value.devices.items():
        assert all({device} == reached(model, path) for path in paths)
    # The listing of tensors a traced call writes (torch.compile), from the same paths.
    for device, paths in module_devices(model, "model").items():
        assert all({device} == reached(model, path) for path in paths)
    fix = lines_of(error)[-1].removeprefix("fix: ").partition(" before calling ")[0]
    assert """model.heads['1'].to("meta"), model.scales.to("meta")""" == fix
    exec(fix, {"model": model})
    assert (2,) == step(model, torch.ones(2)).shape


# Tensors in class bodies, and in plain objects inside plain objects: named, with a fix
# that runs as printed.


class Table(nn.Module):
    """A module whose class body holds a tensor: one for every instance, never a buffer."""

    table = torch.ones(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.table


class Buffered(nn.Module):
    """:class:`Table` as the fix rewrites it: the tensor a non-persistent buffer."""

    table: torch.Tensor  # an annotation, not a class attribute: the buffer's type

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.ones(2, 2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.table


@device_agnostic(device="meta")
def applied(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Runs ``model`` on ``x``."""
    return model(x)  # type: ignore[no-any-return]


def test_a_tensor_in_a_module_class_body_is_named_with_the_buffer_fix() -> None:
    """``table = tensor`` in a module's class body is read as ``model.table`` and moved by
    nothing: the error names it, says the class holds it, and the fix registers a buffer in
    its place (the class attribute must go: register_buffer refuses a name it has)."""
    with pytest.raises(DeviceMismatchError) as error:
        applied(Table(), on_meta(2, 2))
    assert [
        "applied() failed in torch on tensors @device_agnostic cannot see into:",
        "    cpu <- model.table (a class attribute of Table, not a buffer)",
        'target meta (from @device_agnostic(device="meta"))',
        f"torch said: {error.value.__cause__}",
        'fix: self.register_buffer("table", ..., persistent=False) in Table.__init__, in place '
        "of the class attribute Table.table (one tensor, shared by every instance), so that "
        "model.to(...) moves it",
    ] == lines_of(error)
    assert {CPU: ["model.table"]} == error.value.devices
    with pytest.raises(KeyError, match="already exists"):
        Table().register_buffer("table", torch.ones(2, 2), persistent=False)
    fixed = Buffered().to("meta")
    assert META == applied(fixed, on_meta(2, 2)).device
    assert {} == fixed.state_dict()  # as with the class attribute: no checkpoint changes


class Scaled(Table):
    """A subclass: the class body holding the tensor is its base's."""


class Blocks(nn.Module):
    """Two instances of one class whose body holds a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Scaled(), Scaled()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](x))  # type: ignore[no-any-return]


def test_a_class_body_tensor_is_named_once_for_its_class() -> None:
    """A tensor every instance shares is named once, at the first instance, by the class
    whose body holds it; the fix registers the buffer in that class's ``__init__``."""
    with pytest.raises(DeviceMismatchError) as error:
        applied(Blocks(), on_meta(2, 2))
    named = lines_of(error)[1]
    assert "    cpu <- model.blocks[0].table (a class attribute of Table, not a buffer)" == named
    assert lines_of(error)[-1] == (
        'fix: self.register_buffer("table", ..., persistent=False) in Table.__init__, in place '
        "of the class attribute Table.table (one tensor, shared by every instance), so that "
        "model.blocks[0].to(...) moves it"
    )


class Lookup:
    """A plain object whose class body holds a tensor."""

    table = torch.ones(2, 2)


@device_agnostic(device="meta")
def looked_up(x: torch.Tensor, lookup: Any) -> torch.Tensor:
    """Scales by the lookup's table."""
    return x * lookup.table  # type: ignore[no-any-return]


def written_into(held: str) -> str:
    """How a plain object's fix ends: the move to make once, for an object the call writes
    into (``held``, its attribute, on ``meta``)."""
    return (
        "; where the call writes into them (an EMA's update), move them once instead, before "
        f"the calls: {held} = to_device({held}, 'meta') (a move at each call writes into a "
        "copy, and the update is lost)"
    )


class _Ema:
    """A hand-made EMA of a model's weights: a plain object whose tensors a step updates."""

    def __init__(self, model: nn.Module) -> None:
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for k, v in model.state_dict().items():
            self.shadow[k].mul_(0.5).add_(v, alpha=0.5)


@pytest.mark.requires_device("accelerator")
def test_the_fix_for_a_plain_object_the_call_writes_into_keeps_its_updates() -> None:
    """An EMA object made on the CPU, passed to a step on the accelerator: taught to the
    walk, it would be copied at each call and its updates written into the copy, lost; the
    fix says to move it once, and, followed as printed, the updates reach it."""
    device = accelerator()
    model = nn.Linear(2, 2).to(device)
    ema = _Ema(nn.Linear(2, 2))

    @device_agnostic
    def step(model: nn.Linear, ema: _Ema) -> None:
        ema.update(model)

    with pytest.raises(DeviceMismatchError) as error:
        step(model, ema)
    fix = lines_of(error)[-1]
    moved = f"ema.shadow = to_device(ema.shadow, '{device}')"
    assert fix.endswith(
        "; where the call writes into them (an EMA's update), move them once instead, before "
        f"the calls: {moved} (a move at each call writes into a copy, and the update is lost)"
    )
    exec(moved, {"to_device": to_device, "ema": ema})
    before = ema.shadow["weight"].clone()
    step(model, ema)
    assert not torch.equal(before, ema.shadow["weight"])  # the caller's EMA was updated

    class Holder:
        def __init__(self, ema: _Ema) -> None:
            self.ema = ema

    @device_agnostic
    def nested(model: nn.Linear, h: Holder) -> None:
        h.ema.update(model)

    h = Holder(_Ema(nn.Linear(2, 2)))  # one object deeper: the attribute that holds them
    with pytest.raises(DeviceMismatchError) as error:
        nested(model, h)
    moved = f"h.ema.shadow = to_device(h.ema.shadow, '{device}')"
    assert f"before the calls: {moved} (a move" in lines_of(error)[-1]
    exec(moved, {"to_device": to_device, "h": h})
    nested(model, h)


def test_a_tensor_in_a_plain_class_body_is_named_and_an_instance_one_shadows_it() -> None:
    """A plain object's class attribute is named as one; set on the instance, the
    instance's (here on the target) is what ``lookup.table`` reads, and nothing is named."""
    with pytest.raises(DeviceMismatchError) as error:
        looked_up(on_meta(2, 2), Lookup())
    assert "    cpu <- lookup.table (a class attribute of Lookup)" == lines_of(error)[1]
    assert lines_of(error)[-1] == (
        "fix: import copy; from devicectx import register_container; "
        'register_container(Lookup, children=lambda obj: [("table", '
        "obj.table)], rebuild=lambda obj, new: (clone := copy.copy(obj), setattr(clone, "
        '"table", new[0]))[0]), pass lookup.table as an argument, or give Lookup a '
        ".to(device) method" + written_into("lookup.table")
    )
    shadowed = Lookup()
    shadowed.table = on_meta(2, 2)
    assert META == looked_up(on_meta(2, 2), shadowed).device
    assert [("lookup.table", META)] == [
        (u.path, u.device) for u in unseen_tensors([("lookup", shadowed)])
    ]


class Inner:
    """A plain object holding a tensor, held by :class:`Outer`."""

    def __init__(self) -> None:
        self.t = torch.ones(2)


class Outer:
    """A plain object holding a plain object and a list with a tensor."""

    def __init__(self) -> None:
        self.inner = Inner()
        self.k = [torch.ones(2)]
        self.note = "kept"


@device_agnostic(device="meta")
def cached(x: torch.Tensor, cache: Outer) -> torch.Tensor:
    """Adds what the cache holds."""
    return x + cache.k[0] + cache.inner.t


@contextlib.contextmanager
def printed_fix_run(fix: str, types: dict[str, type]) -> Iterator[list[type]]:
    """Runs the ``import copy; ...; register_container(...)`` calls a fix line prints, as
    printed; unregisters them when the block ends. Yields what it registered."""
    calls = fix.removeprefix("fix: ").partition(", pass ")[0].partition(", or give ")[0]
    # The fix imports register_container; the test's, which records, stands in for it.
    imported = "from devicectx import register_container; "
    assert imported in calls
    calls = calls.replace(imported, "")
    registered: list[type] = []

    def register(cls: type, children: Any, rebuild: Any) -> None:
        register_container(cls, children, rebuild)
        registered.append(cls)

    try:
        exec(calls, {"register_container": register, **types})
        yield registered
    finally:
        for cls in registered:
            unregister_container(cls)


def test_a_nested_plain_object_fix_teaches_every_type_the_walk_passes() -> None:
    """A tensor in a plain object inside the argument's: the walk enters ``Inner`` only
    where it knows ``Outer``, so the fix registers both, the argument's type first, with
    the attributes that lead to each tensor (a list inside ``Outer`` is walked as it is);
    run as printed, the call succeeds. ``Inner`` alone would not do."""
    with pytest.raises(DeviceMismatchError) as error:
        cached(on_meta(2), Outer())
    assert [
        "cached() failed in torch on tensors @device_agnostic cannot see into:",
        "    cpu <- cache.inner.t (in Inner), cache.k[0] (in Outer)",
        'target meta (from @device_agnostic(device="meta"))',
        f"torch said: {error.value.__cause__}",
        "fix: import copy; from devicectx import register_container; "
        'register_container(Outer, children=lambda obj: [("inner", '
        'obj.inner), ("k", obj.k)], rebuild=lambda obj, new: (clone := copy.copy(obj), '
        'setattr(clone, "inner", new[0]), setattr(clone, "k", new[1]))[0]); '
        'register_container(Inner, children=lambda obj: [("t", obj.t)], rebuild=lambda obj, '
        'new: (clone := copy.copy(obj), setattr(clone, "t", new[0]))[0]), or give Outer a '
        ".to(device) method" + written_into("cache.inner.t"),
    ] == lines_of(error)
    fix = lines_of(error)[-1]
    with printed_fix_run(fix, {"Outer": Outer, "Inner": Inner}) as registered:
        assert [Outer, Inner] == registered
        assert META == cached(on_meta(2), Outer()).device
    # The call for Outer left out.
    inner_only = (
        "fix: import copy; from devicectx import register_container; " + fix.split("; ", 3)[3]
    )
    with printed_fix_run(inner_only, {"Inner": Inner}), pytest.raises(DeviceMismatchError):
        cached(on_meta(2), Outer())
    assert ", or give Outer a .to(device) method; " in fix
    assert META == cached(on_meta(2), OuterWithTo()).device


class OuterWithTo(Outer):
    """:class:`Outer` given the ``.to(device)`` the fix names: it moves what it holds."""

    def to(self, device: torch.device) -> OuterWithTo:
        """Moves the tensors it holds."""
        self.inner.t = self.inner.t.to(device)
        self.k = [t.to(device) for t in self.k]
        return self


class Settings:
    """A plain object holding a tensor, kept in a module's plain attribute."""

    def __init__(self) -> None:
        self.scale = torch.ones(2)


class Configured(nn.Module):
    """A module holding a plain object with a tensor: ``.to`` moves neither."""

    def __init__(self) -> None:
        super().__init__()
        self.cfg = Settings()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.cfg.scale


class ConfiguredBuffer(nn.Module):
    """:class:`Configured` as the fix rewrites it."""

    scale: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_a_plain_object_in_a_module_attribute_gets_the_buffer_fix() -> None:
    """A module's ``.to`` never looks into a plain attribute: registering the plain
    object's type would not move it, so the fix makes the tensor a buffer of the module."""
    with pytest.raises(DeviceMismatchError) as error:
        applied(Configured(), on_meta(2))
    assert "    cpu <- model.cfg.scale (in Settings)" == lines_of(error)[1]
    assert lines_of(error)[-1] == (
        'fix: self.register_buffer("scale", ..., persistent=False) in Configured.__init__, '
        "read as self.scale, not self.cfg.scale, so that model.to(...) moves it (.to does not "
        "look into plain attributes)"
    )
    assert META == applied(ConfiguredBuffer().to("meta"), on_meta(2)).device


@pytest.mark.requires_device("accelerator")
def test_a_class_body_tensor_in_a_matmul_is_named_on_an_accelerator() -> None:
    """On an accelerator, torch's matmul mismatch ("mat2 is on cpu") is ours too."""
    target = accelerator()

    @device_agnostic(device=target)
    def run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)  # type: ignore[no-any-return]

    class MatMul(nn.Module):
        table = torch.ones(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.table

    with pytest.raises(DeviceMismatchError) as error:
        run(MatMul(), torch.ones(2, 2))
    assert "    cpu <- model.table (a class attribute of " in lines_of(error)[1]
    assert {CPU: ["model.table"]} == error.value.devices


@st.composite
def nestings(draw: st.DrawFn) -> tuple[list[str], int | None]:
    """How each plain object of a chain holds the next (the last, its tensor): ``"attr"``,
    ``"list"`` or ``"dict"``; and the level of a second tensor, ``extra``, or None."""
    ways = draw(st.lists(st.sampled_from(["attr", "list", "dict"]), min_size=1, max_size=3))
    return ways, draw(st.none() | st.integers(0, len(ways) - 1))


def held_in(way: str, value: object) -> object:
    """``value`` as a plain object holds it: itself, in a list, or in a dict."""
    return value if way == "attr" else [value] if way == "list" else {"v": value}


def taken_out(way: str, held: Any) -> Any:
    """What :func:`held_in` put in."""
    return held if way == "attr" else held[0] if way == "list" else held["v"]


@given(nesting=nestings())
def test_the_fix_for_nested_plain_objects_runs_as_printed(
    nesting: tuple[list[str], int | None],
) -> None:
    """Plain objects in plain objects, through lists and dicts: every path the error names
    reaches a tensor, and the register_container calls the fix prints, run
    as printed, make the call succeed."""
    ways, extra_at = nesting
    classes = [type(f"Level{i}", (), {}) for i in range(len(ways))]
    value: object = torch.ones(2)
    for level in reversed(range(len(ways))):
        obj = classes[level]()
        obj.held = held_in(ways[level], value)
        if level == extra_at:
            obj.extra = torch.ones(2)
        value = obj

    @device_agnostic(device="meta")
    def run(x: torch.Tensor, root: Any) -> torch.Tensor:
        total, obj = x, root
        for way in ways:
            total = total + obj.extra if hasattr(obj, "extra") else total
            obj = taken_out(way, obj.held)
        return total + obj  # type: ignore[no-any-return]

    with pytest.raises(DeviceMismatchError) as error:
        run(on_meta(2), value)
    paths = error.value.devices[CPU]
    assert (1 if extra_at is None else 2) == len(paths)
    assert all(isinstance(eval(path, {"root": value}), torch.Tensor) for path in paths)
    fix = lines_of(error)[-1]
    with printed_fix_run(fix, {cls.__qualname__: cls for cls in classes}) as registered:
        assert classes == registered
        assert META == run(on_meta(2), value).device


# Objects with a .to of their own whose children no rule reads: the look reads their
# attributes as a plain object's, and the fix moves the object, or mends its .to.


class OwnScale:
    """A config with its own ``.to``, which moves what it holds."""

    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale

    def to(self, device: torch.device) -> OwnScale:
        """A new config holding the moved tensor."""
        return OwnScale(self.scale.to(device))


class DroppingScale:
    """A config whose ``.to`` drops what ``tensor.to`` returns: the tensor stays."""

    def __init__(self) -> None:
        self.scale = torch.ones(2)
        self.offsets = [torch.zeros(2)]

    def to(self, device: torch.device) -> DroppingScale:
        """Moves nothing: ``tensor.to`` returns a copy, which is dropped."""
        self.scale.to(device)
        self.offsets[0].to(device)
        return self


def inferred(model: nn.Module, x: torch.Tensor, cfg: Any) -> torch.Tensor:
    """The model's output, scaled and shifted by what ``cfg`` holds."""
    out = model(x) * cfg.scale
    return out + cfg.offsets[0] if hasattr(cfg, "offsets") else out


def test_an_object_whose_own_to_nothing_called_is_checked_before_the_body() -> None:
    """move=False: nothing calls an object's own ``.to``, so the check reads its attributes
    and stops the call before its body, naming the tensor; the fix moves the object, and
    run as printed, the call succeeds."""
    calls: list[str] = []

    def infer(model: nn.Module, x: torch.Tensor, cfg: Any) -> torch.Tensor:
        calls.append("body")
        return inferred(model, x, cfg)

    checked = device_agnostic(move=False)(infer)
    model = nn.Linear(2, 2, device="meta")
    with pytest.raises(DeviceMismatchError) as error:
        checked(model, on_meta(2, 2), OwnScale(torch.ones(2)))
    assert lines_of(error)[0].endswith(".infer() got tensors on 2 devices:")
    assert [
        "    meta <- x",
        "    cpu  <- cfg.scale",
        "target meta (from the parameters of model (Linear))",
        'fix: pass to_device(cfg, "meta"), or use @device_agnostic(move=True) to move the '
        "arguments",
    ] == lines_of(error)[1:]
    assert [] == calls
    assert {META: ["x"], CPU: ["cfg.scale"]} == error.value.devices
    names: dict[str, Any] = {"cfg": OwnScale(torch.ones(2)), "to_device": to_device}
    cfg = eval(lines_of(error)[-1].removeprefix("fix: pass ").partition(", or")[0], names)
    assert META == checked(model, on_meta(2, 2), cfg).device
    assert ["body"] == calls


def test_an_object_in_a_container_whose_own_to_nothing_called_is_checked_before_the_body() -> None:
    """The object inside a dict argument, and in a set of its own: the path goes through
    the container; the fix moves the argument, and run as printed, the call succeeds."""
    infer = device_agnostic(move=False)(lambda model, batch: model(batch["x"]) * batch["cfg"].scale)
    model = nn.Linear(2, 2, device="meta")
    with pytest.raises(DeviceMismatchError) as error:
        infer(model, {"x": on_meta(2, 2), "cfg": OwnScale(torch.ones(2))})
    assert "    cpu  <- batch['cfg'].scale" == lines_of(error)[2]
    fix = lines_of(error)[-1]
    assert fix.startswith('fix: pass to_device(batch, "meta"), or ')
    batch = to_device({"x": on_meta(2, 2), "cfg": OwnScale(torch.ones(2))}, "meta")
    assert META == infer(model, batch).device


def test_an_object_with_its_own_to_on_the_target_passes_the_check() -> None:
    """move=False with the object's tensors already on the target: no error, the object
    reaches the body as it was given (nothing is moved or copied)."""
    got: list[Any] = []
    infer = device_agnostic(move=False)(lambda model, x, cfg: got.append(cfg) or model(x))
    cfg = OwnScale(on_meta(2))
    infer(nn.Linear(2, 2, device="meta"), on_meta(2, 2), cfg)
    assert [cfg] == got


def test_an_object_with_its_own_to_counts_among_the_inputs_devices() -> None:
    """move=False with nothing to choose a target: an object's tensors elsewhere than the
    other inputs make them disagree, as a tensor there would."""
    infer = device_agnostic(move=False)(lambda x, cfg: x * cfg.scale)
    with pytest.raises(DeviceMismatchError) as error:
        infer(on_meta(2), OwnScale(torch.ones(2)))
    assert ["    meta <- x", "    cpu  <- cfg.scale"] == lines_of(error)[1:3]
    fix = 'fix: pass to_device(cfg, "meta"), or use @device_agnostic(device="meta")'
    assert lines_of(error)[-1].startswith(fix)


def test_an_own_to_that_leaves_tensors_behind_is_named_with_how_to_write_it() -> None:
    """move=True: the object's own ``.to`` ran and left its tensors where they were; the
    error names them and the ``.to`` that left them, and the fix writes that ``.to``:
    pasted into it as printed, the call succeeds."""
    infer = device_agnostic(inferred)
    model = nn.Linear(2, 2, device="meta")
    with pytest.raises(DeviceMismatchError) as error:
        infer(model, torch.ones(2, 2), DroppingScale())
    assert [
        "inferred() failed in torch on tensors @device_agnostic cannot see into:",
        "    cpu <- cfg.scale (in DroppingScale), cfg.offsets[0] (in DroppingScale)",
        "target meta (from the parameters of model (Linear))",
        f"torch said: {error.value.__cause__}",
        "fix: DroppingScale.to left cfg.scale, cfg.offsets[0] on cpu (tensor.to returns a "
        "moved copy and moves nothing in place): in DroppingScale.to, self.scale = "
        "self.scale.to(device); self.offsets[0] = self.offsets[0].to(device), then return "
        "self (or return a new DroppingScale holding the moved tensors)",
    ] == lines_of(error)
    body = lines_of(error)[-1].partition(": in DroppingScale.to, ")[2].partition(", then ")[0]
    names: dict[str, Any] = {}
    exec(f"def to(self, device):\n    {body}\n    return self", names)
    mended = type("Mended", (DroppingScale,), {"to": names["to"]})
    assert META == infer(model, torch.ones(2, 2), mended()).device


def test_an_own_to_that_moves_nothing_is_named_under_move_false_too() -> None:
    """move=False with a ``.to`` that leaves the tensor behind: moving the object with it
    would not do, so the fix starts with how to write the ``.to``, then moves the object;
    both run as printed, the call succeeds."""
    infer = device_agnostic(move=False)(inferred)
    model = nn.Linear(2, 2, device="meta")
    with pytest.raises(DeviceMismatchError) as error:
        infer(model, on_meta(2, 2), DroppingScale())
    assert "    cpu  <- cfg.scale, cfg.offsets[0]" == lines_of(error)[2]
    fix = lines_of(error)[-1]
    assert fix.startswith("fix: DroppingScale.to left cfg.scale, cfg.offsets[0] on cpu")
    body = fix.partition(": in DroppingScale.to, ")[2].partition(", then ")[0]
    names: dict[str, Any] = {}
    exec(f"def to(self, device):\n    {body}\n    return self", names)
    mended = type("Mended", (DroppingScale,), {"to": names["to"]})
    moved = fix.partition("; then pass ")[2].partition(", or")[0]
    assert 'to_device(cfg, "meta")' == moved
    cfg = eval(moved, {"cfg": mended(), "to_device": to_device})
    assert META == infer(model, on_meta(2, 2), cfg).device


class Holder:
    """A plain object holding an :class:`OwnScale`."""

    def __init__(self) -> None:
        self.cfg = OwnScale(torch.ones(2))


def test_an_object_with_its_own_to_inside_a_plain_one_is_moved_by_its_to() -> None:
    """A plain object holding one with its own ``.to``: the fix registers the plain one
    only, as its ``.to`` moves the other once the walk reaches it; run as printed, the
    call succeeds."""
    infer = device_agnostic(lambda model, x, holder: model(x) * holder.cfg.scale)
    model = nn.Linear(2, 2, device="meta")
    with pytest.raises(DeviceMismatchError) as error:
        infer(model, torch.ones(2, 2), Holder())
    assert "    cpu <- holder.cfg.scale (in OwnScale)" == lines_of(error)[1]
    fix = lines_of(error)[-1]
    assert fix.startswith(
        "fix: import copy; from devicectx import register_container; "
        'register_container(Holder, children=lambda obj: [("cfg", obj.cfg)], '
    )
    with printed_fix_run(fix, {"Holder": Holder}) as registered:
        assert [Holder] == registered
        assert META == infer(model, torch.ones(2, 2), Holder()).device


# A tensor a module holds as a plain attribute, alone or in a list or dict: the fix makes
# each a non-persistent buffer (register_buffer takes one tensor, and a checkpoint saved
# before, which never held it, must still load).


def printed_call(fix: str) -> str:
    """The ``self.register_buffer(...)`` call a fix line prints, as printed."""
    found = re.search(r"self\.register_buffer\([^)]*\)", fix)
    assert found is not None, fix
    return found[0]


def registered_as_printed(module: nn.Module, fix: str) -> None:
    """Runs the ``register_buffer`` call of a fix line on ``module``, as printed, with its
    ``...`` a tensor."""
    exec(printed_call(fix).replace("...", "torch.ones(2)"), {"self": module, "torch": torch})


def test_the_buffer_fix_keeps_a_checkpoint_saved_before_it_loading() -> None:
    """The buffer the fix registers, run as printed, is non-persistent: the tensor was never
    in the ``state_dict``, so a checkpoint saved from the module as it was loads into the
    fixed one with ``strict=True``, and the call succeeds. Also for a tensor in a plain
    object the module holds."""
    with pytest.raises(DeviceMismatchError) as error:
        Offset().to("meta")(on_meta(2))
    fixed = Offset()
    del fixed.offset
    registered_as_printed(fixed, lines_of(error)[-1])
    fixed.load_state_dict(Offset().state_dict(), strict=True)
    assert META == fixed.to("meta")(on_meta(2)).device
    with pytest.raises(DeviceMismatchError) as error:
        applied(Configured(), on_meta(2))
    configured = Configured()
    registered_as_printed(configured, lines_of(error)[-1])
    configured.load_state_dict(Configured().state_dict(), strict=True)


class Held(nn.Module):
    """A module holding constants in a container set as a plain attribute, ``consts``; its
    forward adds what ``reads`` (code, ``self.consts[0]``) reach."""

    def __init__(self, consts: object, reads: list[str]) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.consts = consts
        self.reads = reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + sum(eval(read, {"self": self}) for read in self.reads)


def buffers_of(fix: str) -> list[tuple[str, str]]:
    """``(buffer, read)`` for each tensor a container's buffer fix names: the buffer to
    register and the code it replaces (``self.consts[0]``), the first, then each likewise."""
    found = re.fullmatch(
        r'fix: self\.register_buffer\("(\w+)", \.\.\., persistent=False\) in Held\.__init__, '
        r"read as self\.\1, not (.+?)(?: \(likewise (.+)\))?, so that \w+\.to\(\.\.\.\) "
        r"moves (?:it|them) \(\.to does not look into plain attributes\)",
        fix,
    )
    assert found is not None, fix
    likewise = [item.partition(" for ") for item in found[3].split(", ")] if found[3] else []
    return [(found[1], found[2])] + [(buffer, read) for buffer, _, read in likewise]


def rewritten(model: Held, fix: str) -> Held:
    """``model`` rewritten as the fix says: its ``register_buffer`` call run as printed for
    each tensor (``...`` that tensor; a likewise with its own name), each read replaced by
    the buffer, and the container gone."""
    call, buffers = printed_call(fix), buffers_of(fix)
    fixed = copy.deepcopy(model)
    for buffer, read in buffers:
        named = call.replace(f'"{buffers[0][0]}"', f'"{buffer}"')
        exec(named.replace("...", read), {"self": fixed})
    del fixed.consts
    instead = {read: f"self.{buffer}" for buffer, read in buffers}
    fixed.reads = [instead.get(read, read) for read in fixed.reads]
    return fixed


# The likewise part names this many tensors after the first, then "and N more".
LIKEWISE = 3


@st.composite
def held_constants(draw: st.DrawFn) -> tuple[object, list[str]]:
    """A container of 1 to 4 tensors (a fix names them all) for :class:`Held`, and the code
    that reads each: a list, a tuple, a set (read ``list(self.consts)[0]``), or a dict whose
    keys may have no letter, be written alike once made names (``'a-b'``, ``'a_b'``), or be
    ints."""
    way = draw(st.sampled_from(["list", "tuple", "set", "dict"]))
    count = draw(st.integers(1, 1 + LIKEWISE))
    tensors = [torch.full((2,), float(i)) for i in range(count)]
    if way == "set":
        return set(tensors), [f"list(self.consts)[{i}]" for i in range(count)]
    if way != "dict":
        consts = tensors if way == "list" else tuple(tensors)
        return consts, [f"self.consts[{i}]" for i in range(count)]
    key = st.text(alphabet="ab_-. 0", max_size=3) | st.integers(-2, 12)
    keys = draw(st.lists(key, min_size=count, max_size=count, unique=True))
    return dict(zip(keys, tensors, strict=True)), [f"self.consts[{k!r}]" for k in keys]


@given(held=held_constants())
def test_tensors_in_a_list_or_dict_attribute_get_a_buffer_each_as_printed(
    held: tuple[object, list[str]],
) -> None:
    """A list, tuple, set or dict of tensors set as a module attribute: ``register_buffer`` of
    the container is refused by torch, so the fix registers one buffer per tensor, named for
    its place, read in its place. Rewritten as printed, the call succeeds, and a checkpoint
    saved before loads with ``strict=True``."""
    consts, reads = held
    model = Held(consts, reads).to("meta")
    with pytest.raises(DeviceMismatchError) as error:
        applied(model, on_meta(2))
    fix = lines_of(error)[-1]
    assert reads == [read for _, read in buffers_of(fix)]
    fixed = rewritten(model, fix).to("meta")
    assert META == applied(fixed, on_meta(2)).device
    fixed.load_state_dict(model.state_dict(), strict=True)


def test_a_list_attribute_of_tensors_is_named_with_a_buffer_each() -> None:
    """The error for a list of tensors set as a module attribute, every line; past
    the first and three more, the rest are counted."""
    model = Held([torch.ones(2), torch.zeros(2)], ["self.consts[0]", "self.consts[1]"])
    model.to("meta")
    with pytest.raises(DeviceMismatchError) as error:
        applied(model, on_meta(2))
    assert [
        "applied() failed in torch on tensors @device_agnostic cannot see into:",
        "    cpu <- model.consts[0] (a plain attribute of Held, not a buffer), model.consts[1] "
        "(a plain attribute of Held, not a buffer)",
        'target meta (from @device_agnostic(device="meta"))',
        f"torch said: {error.value.__cause__}",
        'fix: self.register_buffer("consts_0", ..., persistent=False) in Held.__init__, read '
        "as self.consts_0, not self.consts[0] (likewise consts_1 for self.consts[1]), so that "
        "model.to(...) moves them (.to does not look into plain attributes)",
    ] == lines_of(error)
    many = Held([torch.ones(2) for _ in range(6)], [f"self.consts[{i}]" for i in range(6)])
    many.to("meta")
    with pytest.raises(DeviceMismatchError) as error:
        applied(many, on_meta(2))
    assert (
        "(likewise consts_1 for self.consts[1], consts_2 for self.consts[2], consts_3 for "
        "self.consts[3] and 2 more), so that"
    ) in lines_of(error)[-1]


def test_assert_device_agnostic_gives_the_buffer_fix_for_a_dict_attribute() -> None:
    """``assert_device_agnostic`` names tensors in a dict attribute with the same fix;
    the module rewritten as printed passes it."""
    consts = {"w": torch.ones(2), "b": torch.zeros(2)}
    model = Held(consts, ["self.consts['w']", "self.consts['b']"])
    with pytest.raises(AssertionError) as error:
        assert_device_agnostic(model, torch.ones(3, 2), devices=["cpu", "meta"])
    fix = lines_of(error)[-1]
    assert fix == (
        'fix: self.register_buffer("consts_w", ..., persistent=False) in Held.__init__, read '
        "as self.consts_w, not self.consts['w'] (likewise consts_b for self.consts['b']), so "
        "that self.to(...) moves them (.to does not look into plain attributes)"
    )
    assert_device_agnostic(rewritten(model, fix), torch.ones(3, 2), devices=["cpu", "meta"])


@pytest.mark.requires_device("accelerator")
def test_index_add_s_mismatch_is_ours_on_an_accelerator() -> None:
    """torch's index ops word a mismatch their own way ("expected to be in the same
    device"): a tensor the decorator cannot see is named there too."""
    target = accelerator()

    class Table:
        def __init__(self) -> None:
            self.rows = torch.ones(1, 2)

    @device_agnostic(device=target)
    def scatter(x: torch.Tensor, index: torch.Tensor, table: Table) -> torch.Tensor:
        return x.index_add_(0, index, table.rows)

    with pytest.raises(DeviceMismatchError) as error:
        scatter(torch.zeros(3, 2), torch.tensor([0]), Table())
    assert {CPU: ["table.rows"]} == error.value.devices


# --- arguments exclude= holds out --------------------------------------------------------


def test_an_excluded_module_torch_fails_on_is_named_as_excluded() -> None:
    """A module in ``exclude=`` chose no target and was not checked: the message says it is
    excluded, and the fix (dropping it from ``exclude=``) makes the call work."""
    model = nn.Linear(4, 2, device="meta")

    @device_agnostic(exclude=("model",))
    def g(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)  # type: ignore[no-any-return]

    with pytest.raises(DeviceMismatchError) as error:
        g(model, torch.ones(3, 4))
    lines = str(error.value).splitlines()
    assert [
        f"{g.__qualname__}() failed in torch on tensors @device_agnostic cannot see into "
        "or excludes:",
        "    meta <- model (Linear, excluded: exclude= means not checked)",
        "target cpu (from the tensor arguments)",
    ] == lines[:3]
    assert lines[-1] == (
        'fix: drop "model" from exclude=, so that model chooses the target: modules are '
        "never moved, and exclude= only kept model from being checked"
    )
    fixed = device_agnostic(g.__wrapped__)
    assert META == fixed(model, torch.ones(3, 4)).device


def test_an_excluded_tensor_torch_fails_on_is_named_with_its_move() -> None:
    """A tensor in ``exclude=`` off the module's device: a devicectx error naming it as
    excluded (was torch's raw error), whose ``.to`` works when pasted."""
    model = nn.Linear(4, 2, device="meta")

    @device_agnostic(exclude=("x",))
    def h(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)  # type: ignore[no-any-return]

    x = torch.ones(3, 4)
    with pytest.raises(DeviceMismatchError) as error:
        h(model, x)
    lines = str(error.value).splitlines()
    assert [
        f"{h.__qualname__}() failed in torch on tensors @device_agnostic cannot see into "
        "or excludes:",
        "    cpu <- x (excluded)",
        "target meta (from the parameters of model (Linear))",
    ] == lines[:3]
    assert lines[-1] == (
        'fix: pass x.to("meta"), or drop "x" from exclude= so that it is moved: exclude= '
        "means neither moved nor checked"
    )
    code = lines[-1].removeprefix("fix: pass ").partition(", or")[0]
    assert META == h(model, eval(code, {"x": x})).device


@pytest.mark.requires_device("accelerator")
def test_an_excluded_tensor_of_a_dtype_the_target_lacks_gets_a_fix_that_casts() -> None:
    """An excluded float64 tensor off a device without float64: the fix's ``.to`` also
    casts it to the device's nearest dtype, so that the pasted call runs (a plain
    ``x.to(device)`` meets torch's own dtype error)."""
    with mps_like() as device:
        model = nn.Linear(4, 2, device=device)

        @device_agnostic(exclude=("bias",))
        def h(model: nn.Module, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            return model(x) + bias  # type: ignore[no-any-return]

        x, bias = torch.ones(3, 4), torch.ones(3, 2, dtype=torch.float64)
        with pytest.raises(DeviceMismatchError) as error:
            h(model, x, bias)
        fix = str(error.value).splitlines()[-1]
        assert fix == (
            f'fix: pass bias.to("{device}", torch.float32), or drop "bias" from exclude= so '
            "that it is moved: exclude= means neither moved nor checked"
        )
        code = fix.removeprefix("fix: pass ").partition(", or")[0]
        assert device == h(model, x, eval(code, {"bias": bias, "torch": torch})).device


@pytest.mark.parametrize("lacking", [False, True])
@pytest.mark.requires_device("accelerator")
def test_an_excluded_container_gets_a_fix_that_moves_it_with_to_device(lacking: bool) -> None:
    """An excluded dict of tensors has no ``.to``: the fix moves it with ``to_device``
    (casting what the device lacks), and the pasted call runs."""
    with mps_like() if lacking else contextlib.nullcontext(accelerator()) as device:
        model = nn.Linear(4, 2, device=device)

        @device_agnostic(exclude=("batch",))
        def h(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return model(batch["x"].float())  # type: ignore[no-any-return]

        dtype = torch.float64 if lacking else torch.float32
        batch = {"x": torch.ones(3, 4, dtype=dtype)}
        with pytest.raises(DeviceMismatchError) as error:
            h(model, batch)
        fix = str(error.value).splitlines()[-1]
        cast = ', dtypes="device"' if lacking else ""
        assert fix == (
            f'fix: pass to_device(batch, "{device}"{cast}), or drop "batch" from exclude= '
            "so that it is moved: exclude= means neither moved nor checked"
        )
        code = fix.removeprefix("fix: pass ").partition(", or")[0]
        moved = eval(code, {"batch": batch, "to_device": devicectx.to_device})
        assert device == h(model, moved).device


@pytest.mark.requires_device("accelerator")
def test_move_false_fix_casts_what_the_target_lacks() -> None:
    """``move=False`` with a float64 tensor off a device without float64: the fix's moves
    cast it to the nearest dtype the device holds, and the pasted call runs."""
    with mps_like() as device:

        @device_agnostic(move=False, device=device)
        def h(x: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return x + batch["y"]

        x, batch = torch.ones(3, dtype=torch.float64), {"y": torch.ones(3, dtype=torch.float64)}
        with pytest.raises(DeviceMismatchError) as error:
            h(x, batch)
        fix = lines_of(error)[-1]
        assert fix == (
            f'fix: pass x.to("{device}", torch.float32), to_device(batch, "{device}", '
            'dtypes="device"), or use @device_agnostic(move=True) to move the arguments'
        )
        code = fix.removeprefix("fix: pass ").partition(", or")[0]
        scope = {"x": x, "batch": batch, "torch": torch, "to_device": devicectx.to_device}
        assert device == h(*eval(code, scope)).device


@pytest.mark.parametrize("nested", [False, True])
def test_a_0_dim_cpu_tensor_the_inputs_left_on_the_host_is_named_when_torch_fails(
    nested: bool,
) -> None:
    """The inputs chose the target (no ``device=``, module or block): a 0-dim CPU tensor
    among them stays on the host, as PyTorch mixes it with any device. Where the body then
    fails on it (unsqueezed into a tensor of one element), the error names it and its fix,
    which works when pasted."""

    @device_agnostic
    def bootstrap(values: torch.Tensor, last: Any) -> torch.Tensor:
        reward = last["reward"] if nested else last
        return torch.cat([values, reward.unsqueeze(0)])

    values, reward = torch.ones(3, device="meta"), torch.tensor(1.0)
    last = {"reward": reward} if nested else reward
    with pytest.raises(DeviceMismatchError) as error:
        bootstrap(values, last)
    path = "last['reward']" if nested else "last"
    move = 'to_device(last, "meta")' if nested else 'last.to("meta")'
    assert [
        f"{bootstrap.__qualname__}() failed in torch on a 0-dim CPU tensor @device_agnostic "
        "leaves where it is:",
        f"    cpu <- {path} (0-dim: mixes with any device, so it is not moved)",
        "target meta (from the tensor arguments)",
    ] == lines_of(error)[:3]
    assert lines_of(error)[-1] == (
        f"fix: pass {move}, or give the call a target, to which every tensor moves: "
        '@device_agnostic(device="auto"), or the call inside an on_device block'
    )
    code = lines_of(error)[-1].removeprefix("fix: pass ").partition(", or")[0]
    moved = eval(code, {"last": last, "to_device": devicectx.to_device})
    assert META == bootstrap(values, moved).device


def test_a_result_that_cannot_go_where_output_sends_it_names_the_call_and_its_option() -> None:
    """A result ``output=`` cannot move (on meta, no values; a sparse tensor a device cannot
    copy back) is the decorated call's failure, with a fix in its options: not
    ``to_device()``'s, which the caller never called."""

    @device_agnostic(device="meta", output="cpu")
    def predict(x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": x * 2}

    with pytest.raises(MoveError) as raised:
        predict(torch.ones(2))
    text = str(raised.value)
    name = predict.__qualname__
    assert text.startswith(f"{name}() could not move result['y'] (a Tensor of shape (2,), ")
    assert text.endswith(
        "or leave the result where the body made it, @device_agnostic(output=None), and move "
        "what can move in your code (to_device(result, ..., skip=[\"result['y']\"])); or "
        "return result['y'] in a form that copies (a sparse tensor's .to_dense())"
    )


class _Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 2)

    @devicectx.device_agnostic
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.l(x)
        return out


def test_functional_call_s_stand_ins_off_the_model_s_device_are_to_pass_there() -> None:
    """``functional_call`` with some parameters replaced by tensors on another device: the
    fix passes those tensors where the model's own parameters are, and does not move the
    model (its parameters would leave their device for good), whichever device holds more
    of the elements; where every parameter is a stand-in, nothing says where the model
    belongs, and the fix is the usual one."""
    from torch.func import functional_call

    net = _Wrapped()
    with pytest.raises(DeviceMismatchError) as caught:
        functional_call(net, {"l.weight": torch.ones(2, 4, device="meta")}, (torch.ones(3, 4),))
    assert (
        "fix: pass l.weight on cpu, where _Wrapped's own parameters are: self.l.weight is a "
        "tensor put in place of _Wrapped's for this call (the dict given to "
        'torch.func.functional_call, say): {"l.weight": tensor.to("cpu")}'
    ) == str(caught.value).splitlines()[-1]
    assert {"cpu"} == {p.device.type for p in net.parameters()}

    fixed = {"l.weight": torch.ones(2, 4)}
    assert (3, 2) == functional_call(net, fixed, (torch.ones(3, 4),)).shape

    stand_ins = {"l.weight": torch.ones(2, 4, device="meta"), "l.bias": torch.ones(2)}
    both = {"l.weight": torch.ones(2, 4), "l.bias": torch.ones(2, device="meta")}
    for swapped in (stand_ins, both):  # all of them stand-ins: no device of the model's own
        with pytest.raises(DeviceMismatchError) as caught:
            functional_call(net, swapped, (torch.ones(3, 4),))
        assert "declare_spread(self)" in str(caught.value).splitlines()[-1]


class ScaledIn(torch.autograd.Function):
    """``x * w``, with the decorator on ``forward`` (where it does not belong)."""

    @staticmethod
    @device_agnostic(device="meta")
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (w,) = ctx.saved_tensors
        return grad * w, None


class ScaledInSetUp(torch.autograd.Function):
    """``x * w``, a forward of the ``setup_context`` form (no ctx) decorated."""

    @staticmethod
    @device_agnostic(device="meta")
    def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (w,) = ctx.saved_tensors
        return grad * w, None


def test_a_move_inside_an_autograd_functions_forward_is_refused() -> None:
    """A decorated ``forward`` of an autograd.Function that would move an input requiring
    grad is stopped before the body, with the fix of moving before ``apply``: torch's own
    error came at backward ("returned an invalid gradient", the gradient on the target)."""
    x = torch.ones(3, requires_grad=True)
    w = torch.ones(3)
    with pytest.raises(DeviceMismatchError) as caught:
        ScaledIn.apply(x, w)
    assert str(caught.value).splitlines() == [
        "ScaledIn.forward() got tensors that require grad on cpu, not on its target:",
        "    cpu <- x",
        'target meta (from @device_agnostic(device="meta"))',
        'fix: pass x.to("meta") to ScaledIn.apply, or decorate the function that calls '
        "ScaledIn.apply instead of ScaledIn.forward: a move inside forward has no backward, "
        "and ScaledIn.backward must return each gradient on its input's device",
    ]


def test_a_move_inside_a_forward_of_inputs_that_need_no_grad_goes_on() -> None:
    """Inputs that need no gradient move inside a Function's forward (one given a ctx,
    which saves the moved copies): the gradient of an input already on the target
    reaches it."""
    x = torch.ones(3, device="meta", requires_grad=True)
    out = ScaledIn.apply(x, torch.ones(3))
    out.sum().backward()
    assert (out.device, x.grad.device if x.grad is not None else None) == (META, META)


@pytest.mark.parametrize("grad", [True, False])
def test_a_move_inside_a_setup_context_forward_is_refused(grad: bool) -> None:
    """A forward of the ``setup_context`` form moves nothing: ``setup_context`` is given
    the inputs as passed to ``apply``, so what it saves stays off the target (torch's
    error came at backward); a 0-dim CPU tensor, which mixes with any device, moves."""
    x = torch.ones(3, device="meta", requires_grad=True)
    w = torch.ones(3, requires_grad=grad)
    with pytest.raises(DeviceMismatchError) as caught:
        ScaledInSetUp.apply(x, w)
    assert str(caught.value).splitlines() == [
        "ScaledInSetUp.forward() got tensors on cpu, not on its target:",
        "    cpu <- w",
        'target meta (from @device_agnostic(device="meta"))',
        'fix: pass w.to("meta") to ScaledInSetUp.apply, or decorate the function that calls '
        "ScaledInSetUp.apply instead of ScaledInSetUp.forward: ScaledInSetUp.setup_context "
        "is given the inputs as passed to ScaledInSetUp.apply, not moved",
    ]
    assert ScaledInSetUp.apply(x, torch.tensor(2.0)).device == META


def test_a_forward_that_is_no_autograd_functions_moves_under_no_grad() -> None:
    """A decorated function named ``forward`` that belongs to no autograd.Function (a
    module's, called under no_grad for inference) moves its inputs as before."""

    class Net(nn.Module):
        @device_agnostic(device="meta")
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    x = torch.ones(3, requires_grad=True)
    with torch.no_grad():
        assert Net()(x).device == META
        assert Net()(x).device == META  # the answer kept from the first call
