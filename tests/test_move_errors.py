"""``to_device``'s errors: each names the path of what failed and the fix, before anything
moves where it can, messages asserted line by line.

``meta`` is the second device: a move off meta fails as a move to a lost GPU would.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from move_subjects import CountingTo, Frozen, Holder, Pair
from torch import nn

from devicectx import (
    DeviceUnavailableError,
    InvalidDeviceError,
    MoveError,
    register_container,
    to_device,
)

CPU = torch.device("cpu")
META = torch.device("meta")


# Errors.


class Refusing(torch.Tensor):
    """A tensor subclass whose .to fails."""

    def to(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("cannot leave\nthis device")


def test_unknown_device_raises_before_anything_moves() -> None:
    """A malformed or missing device raises resolve_device's error before any .to runs."""
    with pytest.raises(InvalidDeviceError) as raised:
        to_device(CountingTo(), "gpu")
    assert str(raised.value).startswith("invalid device 'gpu': unknown device type 'gpu'")
    with pytest.raises(DeviceUnavailableError):
        to_device(CountingTo(), "cpu:3")
    assert CountingTo.calls == 0


def test_move_error_describes_a_nested_tensor() -> None:
    """A nested tensor has no shape of its own (torch raises at ``.shape``): the error
    describes it by its number of tensors, not with torch's internal error from inside ours."""
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(MoveError) as raised:
        to_device({"n": nested}, META)  # torch has no nested tensors on meta
    assert str(raised.value).startswith(
        "to_device() could not move obj['n'] (a nested Tensor of 2 tensors, torch.float32, "
        "on cpu) to meta:"
    )


def test_move_error_names_the_path() -> None:
    """A tensor whose .to fails raises MoveError naming its path, the original error chained."""
    refusing = torch.zeros(2, 3).as_subclass(Refusing)
    with pytest.raises(MoveError) as raised:
        to_device({"feats": [1, 2, refusing]}, "meta")
    assert [
        "to_device() could not move obj['feats'][2] (a Refusing of shape (2, 3), "
        "torch.float32, on cpu) to meta:",
        "    RuntimeError: cannot leave",
        "    this device",
        "fix: leave it where it is: to_device(obj, 'meta', skip=[\"obj['feats'][2]\"])",
    ] == str(raised.value).splitlines()
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert isinstance(raised.value, RuntimeError)


@pytest.mark.parametrize("depth_limit", [100, -1])
def test_move_error_path_through_every_kind(
    depth_limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path in a MoveError is right through each kind of container, on both walks."""
    from devicectx.move import _rebuild

    monkeypatch.setattr(_rebuild, "_DEPTH", depth_limit)
    stuck = torch.zeros(1, device="meta")
    batch = {"a": [Pair(1, Frozen(Holder(0, (stuck,))))]}
    with pytest.raises(MoveError) as raised:
        to_device(batch, "cpu")
    first = str(raised.value).splitlines()[0]
    assert first.startswith("to_device() could not move obj['a'][0].second.x.right[0] (")


class Broken:
    """A registered container whose children function fails."""


register_container(Broken, children=lambda b: 1 / 0, rebuild=lambda b, new: b)


@pytest.mark.parametrize("depth_limit", [100, -1])
def test_move_error_from_a_registered_container(
    depth_limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registered container whose functions fail raises MoveError naming it, on both walks."""
    from devicectx.move import _rebuild

    monkeypatch.setattr(_rebuild, "_DEPTH", depth_limit)
    for batch, path in [({"k": [Broken()]}, "obj['k'][0]"), (Broken(), "obj")]:
        with pytest.raises(MoveError) as raised:
            to_device(batch, "meta")
        assert [
            f"to_device() could not move {path} (a Broken) to meta:",
            "    ZeroDivisionError: division by zero",
            f"fix: leave it where it is: to_device(obj, 'meta', skip=[{path!r}])",
        ] == str(raised.value).splitlines()


def test_move_error_from_a_module() -> None:
    """A module that cannot be moved raises MoveError naming where it sits."""
    with pytest.raises(MoveError) as raised:
        to_device({"model": nn.Linear(1, 1, device="meta")}, "cpu")
    assert [
        "to_device() could not move obj['model'] (a Linear) to cpu:",
        "    NotImplementedError: Cannot copy out of meta tensor; no data! Please use "
        "torch.nn.Module.to_empty() instead of torch.nn.Module.to() when moving module from "
        "meta to a different device.",
        "fix: leave it where it is: to_device(obj, 'cpu', skip=[\"obj['model']\"])",
    ] == str(raised.value).splitlines()
