"""A decorated method of a class that is no module: its instance is checked, never moved."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from devicectx import (
    DeviceMismatchError,
    device_agnostic,
    on_device,
    register_container,
    to_device,
    unregister_container,
)

CPU = torch.device("cpu")
META = torch.device("meta")


def lines_of(error: pytest.ExceptionInfo[BaseException]) -> list[str]:
    """The message of a caught error, line by line."""
    return str(error.value).splitlines()


def follow(fix: str, obj: object) -> Any:
    """Run the code a ``fix:`` line starts with (up to ``before``) on ``obj``; the object
    the caller then holds."""
    code = fix.removeprefix("fix: ").partition(" before ")[0]
    scope: dict[str, Any] = {"obj": obj, "to_device": to_device, "torch": torch}
    exec(code, scope)
    return scope["obj"]


@dataclasses.dataclass
class Affine:
    """A dataclass holding a tensor, with decorated methods."""

    w: torch.Tensor
    ran: list[str] = dataclasses.field(default_factory=list)

    @device_agnostic(device="meta")
    def apply(self, x: torch.Tensor) -> torch.Tensor:
        self.ran.append("apply")
        return x * self.w

    @device_agnostic(device="meta", move=False)
    def check(self, x: torch.Tensor) -> torch.Tensor:
        self.ran.append("check")
        return x * self.w

    @device_agnostic
    def follows(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w

    @device_agnostic
    def made(self) -> torch.Tensor:
        return torch.zeros(2) + self.w


class Pair(NamedTuple):
    """A NamedTuple holding tensors, with a decorated method."""

    a: torch.Tensor
    b: torch.Tensor

    @device_agnostic(device="meta")
    def dot(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.a * self.b).sum()


class Plain:
    """A plain object holding a tensor, with a decorated method."""

    def __init__(self) -> None:
        self.w = torch.ones(2)

    @device_agnostic(device="meta")
    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class Moving(Plain):
    """``Plain`` with a ``.to`` of its own, which returns a moved copy."""

    def to(self, device: torch.device | str) -> Moving:
        clone = copy.copy(self)
        clone.w = self.w.to(device)
        return clone


class Dropping(Plain):
    """``Plain`` with a ``.to`` that drops what ``tensor.to`` returns: it moves nothing."""

    def to(self, device: torch.device | str) -> Dropping:
        self.w.to(device)
        return self


class FocalLoss:
    """A loss object, called, that checks its inputs and holds a weight."""

    def __init__(self, alpha: torch.Tensor) -> None:
        self.alpha = alpha

    @device_agnostic(move=False)
    def __call__(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((pred - target) * self.alpha).sum()


class Config:
    """A plain object holding a tensor."""

    def __init__(self) -> None:
        self.scale = torch.ones(2)


@dataclasses.dataclass
class Scaled:
    """A dataclass holding a plain object that holds a tensor."""

    cfg: Config

    @device_agnostic(device="meta")
    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.cfg.scale


# --- an instance the walk sees into: checked before the body ---


@pytest.mark.parametrize("method", ["apply", "check"])
def test_a_dataclass_self_off_the_target_is_stopped_before_the_body(method: str) -> None:
    """A dataclass instance holding a tensor off the target: with move=True and move=False
    alike, the call stops before the body, naming ``self.w``, and the printed fix, run as
    written, makes the call pass."""
    affine = Affine(torch.ones(2))
    x = torch.ones(2) if method == "apply" else torch.ones(2, device="meta")
    with pytest.raises(DeviceMismatchError) as error:
        getattr(affine, method)(x)
    moves = (
        ", or take the Affine as an argument of a decorated function, which moves it"
        if method == "apply"
        else ""
    )
    assert [
        f"Affine.{method}() got self (Affine) with tensors on cpu, not on its target:",
        "    cpu <- self.w",
        'target meta (from @device_agnostic(device="meta"))',
        f'fix: obj = to_device(obj, "meta") before obj.{method}(...), where obj is the Affine '
        "you call it on (@device_agnostic checks self but never moves it: it is the caller's "
        f"object){moves}",
    ] == lines_of(error)
    assert [] == affine.ran
    assert {CPU: ["self.w"]} == error.value.devices
    moved = follow(lines_of(error)[-1], affine)
    assert META == getattr(moved, method)(torch.ones(2, device="meta")).device
    assert CPU == affine.w.device  # the caller's object, as it was


def test_a_namedtuple_self_off_the_target_names_each_field() -> None:
    """A NamedTuple instance: its fields are named, and the fix moves the tuple."""
    pair = Pair(torch.ones(2), torch.ones(2))
    with pytest.raises(DeviceMismatchError) as error:
        pair.dot(torch.ones(2))
    assert ["    cpu <- self.a, self.b"] == lines_of(error)[1:2]
    assert META == follow(lines_of(error)[-1], pair).dot(torch.ones(2)).device


def test_a_self_moved_by_its_own_to_is_checked_by_its_attributes() -> None:
    """An instance with a ``.to`` of its own: its attributes are checked, and the fix
    calls that ``.to``."""
    with pytest.raises(DeviceMismatchError) as error:
        Moving().apply(torch.ones(2))
    assert ["    cpu <- self.w"] == lines_of(error)[1:2]
    fix = lines_of(error)[-1]
    assert fix.startswith('fix: obj = obj.to("meta") before obj.apply(...), where obj is the ')
    assert META == follow(fix, Moving()).apply(torch.ones(2)).device


def test_a_self_whose_own_to_moves_nothing_gets_the_fix_for_its_to() -> None:
    """Where the instance's ``.to`` leaves its tensors (tried on a copy), calling it would
    not do: the fix says how to write it first."""
    with pytest.raises(DeviceMismatchError) as error:
        Dropping().apply(torch.ones(2))
    assert (
        "Plain.apply() got self (Dropping) with tensors on cpu, not on its target:"
        == (lines_of(error)[0])
    )
    fix = lines_of(error)[-1]
    assert fix.startswith(
        "fix: Dropping.to left self.w on cpu (tensor.to returns a moved copy and moves "
        "nothing in place): in Dropping.to, self.w = self.w.to(device), then return self"
    )
    assert '; then obj = obj.to("meta") before obj.apply(...), where obj is the ' in fix


def test_a_self_and_the_inputs_must_agree_where_nothing_chooses() -> None:
    """No rule chooses the target: the instance's tensors count among the inputs, listed
    first, and the fix that names the device, followed, runs."""
    affine = Affine(torch.ones(2, device="meta"))
    with pytest.raises(DeviceMismatchError) as error:
        affine.follows(torch.ones(2))
    assert [
        "Affine.follows() got tensors on 2 devices:",
        "    meta <- self.w",
        "    cpu  <- x",
        "no target: no device= argument, no nn.Module involved and no on_device block to "
        "choose one",
        'fix: name the device with @device_agnostic(device="meta"), or call Affine.follows() '
        'inside `with on_device("meta"):`',
    ] == lines_of(error)
    with on_device("meta"):
        assert META == affine.follows(torch.ones(2, device="cpu")).device


def test_a_self_alone_chooses_where_the_body_runs() -> None:
    """With no tensor argument and no rule, the instance's device is the call's: tensors the
    body makes land there."""
    assert META == Affine(torch.ones(2, device="meta")).made().device


def test_a_registered_self_is_checked_and_the_fix_moves_it() -> None:
    """A plain class registered as a container (the fix printed for its tensors in an
    argument) is checked as a dataclass is, and the fix then runs."""
    register_container(
        Plain,
        children=lambda obj: [("w", obj.w)],
        rebuild=lambda obj, new: (clone := copy.copy(obj), setattr(clone, "w", new[0]))[0],
    )
    try:
        plain = Plain()
        with pytest.raises(DeviceMismatchError) as error:
            plain.apply(torch.ones(2))
        assert ["    cpu <- self.w"] == lines_of(error)[1:2]
        assert META == follow(lines_of(error)[-1], plain).apply(torch.ones(2)).device
    finally:
        unregister_container(Plain)


# --- a plain instance: named where torch fails, with a fix that moves it ---


def test_a_plain_self_is_named_with_a_fix_that_moves_its_attribute() -> None:
    """A plain object's attributes are read only where torch fails: the error names
    ``self.w``, and its fix moves the tensor on the caller's object (registering the type
    or giving it a ``.to`` would only have it checked)."""
    plain = Plain()
    with pytest.raises(DeviceMismatchError) as error:
        plain.apply(torch.ones(2))
    assert [
        "Plain.apply() failed in torch on tensors @device_agnostic cannot see into:",
        "    cpu <- self.w (in Plain)",
        'target meta (from @device_agnostic(device="meta"))',
    ] == lines_of(error)[:3]
    fix = lines_of(error)[-1]
    assert fix == (
        'fix: obj.w = obj.w.to("meta") before obj.apply(...), where obj is the Plain you call '
        "it on (@device_agnostic never moves self: it is the caller's object), or where the "
        "Plain is made"
    )
    assert META == follow(fix, plain).apply(torch.ones(2)).device


def test_a_called_plain_self_gets_the_inputs_device_in_its_fix() -> None:
    """A loss object under move=False, its weight elsewhere than the inputs that chose the
    target: the fix moves the weight to them, written for a call of the object."""
    loss = FocalLoss(torch.ones(2))
    with pytest.raises(DeviceMismatchError) as error:
        loss(torch.ones(2, device="meta"), torch.ones(2, device="meta"))
    assert [
        "    cpu <- self.alpha (in FocalLoss)",
        "target meta (from the tensor arguments)",
    ] == lines_of(error)[1:3]
    fix = lines_of(error)[-1]
    assert fix.startswith('fix: obj.alpha = obj.alpha.to("meta") before obj(...), where obj ')
    pred = torch.ones(2, device="meta")
    assert META == follow(fix, loss)(pred, pred).device


# --- what is not checked ---


def test_a_self_on_the_target_runs_as_it_is() -> None:
    """An instance already on the target: the body gets the caller's object itself."""
    affine = Affine(torch.ones(2, device="meta"))
    w = affine.w
    assert META == affine.apply(torch.ones(2)).device
    assert w is affine.w
    assert ["apply"] == affine.ran


def test_modules_and_scalars_in_a_self_are_not_the_check_s() -> None:
    """A module held by the instance is not checked (it is named where torch fails), and a
    0-dim CPU tensor mixes with any device, as in an argument."""

    @dataclasses.dataclass
    class Agent:
        model: nn.Module
        temperature: torch.Tensor

        @device_agnostic(device="meta")
        def act(self, x: torch.Tensor) -> torch.Tensor:
            return x / self.temperature

    assert META == Agent(nn.Linear(2, 2), torch.tensor(2.0)).act(torch.ones(2)).device


def test_an_excluded_self_is_not_checked() -> None:
    """``exclude=("self",)`` leaves the instance unchecked, as it leaves an argument."""

    @dataclasses.dataclass
    class Held:
        w: torch.Tensor

        @device_agnostic(device="meta", exclude=("self",))
        def size(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w.numel()

    assert META == Held(torch.ones(2)).size(torch.ones(2)).device


def test_a_self_off_the_device_a_module_argument_chose_is_stopped() -> None:
    """The module argument chooses the target (rule 2): the instance is checked against it,
    and the reason names the module."""

    @dataclasses.dataclass
    class Head:
        scale: torch.Tensor

        @device_agnostic
        def run(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return model(x) * self.scale  # type: ignore[no-any-return]

    model = nn.Linear(2, 2, device="meta")
    with pytest.raises(DeviceMismatchError) as error:
        Head(torch.ones(2)).run(model, torch.ones(2))
    assert [
        "    cpu <- self.scale",
        "target meta (from the parameters of model (Linear))",
    ] == lines_of(error)[1:3]
    assert META == Head(torch.ones(2, device="meta")).run(model, torch.ones(2)).device


def test_a_plain_object_inside_a_dataclass_self_is_moved_where_it_is() -> None:
    """A plain object held by a dataclass instance: the walk checks the dataclass's fields
    but not the plain object's attributes, which are named where torch fails; the fix moves
    the tensor in place on the caller's object."""
    scaled = Scaled(Config())
    with pytest.raises(DeviceMismatchError) as error:
        scaled.apply(torch.ones(2))
    assert "    cpu <- self.cfg.scale (in Config)" == lines_of(error)[1]
    fix = lines_of(error)[-1]
    assert fix.startswith(
        'fix: obj.cfg.scale = obj.cfg.scale.to("meta") before obj.apply(...), where obj is '
        "the Scaled you call it on"
    )
    assert META == follow(fix, scaled).apply(torch.ones(2)).device
