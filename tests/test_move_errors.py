"""``to_device``'s errors: each names the path of what failed and the fix, before anything
moves where it can, messages asserted line by line.

``meta`` is the second device: a move off meta fails as a move to a lost GPU would.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from move_subjects import CountingTo, Frozen, Holder, Pair
from torch import nn

from devicectx import (
    DeviceUnavailableError,
    InvalidDeviceError,
    MoveError,
    device_agnostic,
    register_container,
    to_device,
)
from devicectx.testing import emulated

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


# Out of memory: the error is torch's own too, so `except torch.OutOfMemoryError` around a
# move catches it as it catches torch's `.to`, and it still names the path and the fix.

MIB = 2**20

needs_emulated_memory_limit = pytest.mark.skipif(
    not emulated.enabled() or torch.cuda.is_available(),
    reason="needs the emulated accelerator's memory limit (pytest "
    "--devicectx-accelerator=emulated), refused where a CUDA GPU is present",
)

TOO_LARGE = [
    pytest.param(lambda: {"x": torch.ones(2 * MIB)}, r"obj\['x'\]", "a Tensor", id="tensor"),
    pytest.param(
        lambda: {"x": [torch.ones(3), torch.ones(2 * MIB)[1:]]},
        r"obj\['x'\]\[1\]",
        "a Tensor",
        id="view",
    ),
    pytest.param(
        lambda: {"p": nn.Parameter(torch.ones(2 * MIB))},
        r"obj\['p'\]",
        "a Parameter",
        id="parameter",
    ),
    pytest.param(lambda: {"m": nn.Linear(1024, 2048)}, r"obj\['m'\]", "a Linear", id="module"),
    # 8 tensors of 1 MiB: staged together first, then moved one by one when that fails, till
    # one does not fit (which one depends on what earlier tests left on the device).
    pytest.param(
        lambda: {k: torch.ones(MIB // 4) for k in "abcdefgh"},
        r"obj\['[a-h]'\]",
        "a Tensor",
        id="staged",
    ),
]


@needs_emulated_memory_limit
@pytest.mark.parametrize(("make", "path_pattern", "what"), TOO_LARGE)
def test_out_of_memory_is_caught_as_torchs_own_error(
    make: Callable[[], Any], path_pattern: str, what: str
) -> None:
    """A move past the device's memory raises an error that is both torch.OutOfMemoryError
    and MoveError, naming the path, torch's words and the fix; torch's error is the cause."""
    batch = make()
    with emulated.configure(memory_limit=4 * MIB), pytest.raises(torch.OutOfMemoryError) as raised:
        to_device(batch, "emu:0")
    assert isinstance(raised.value, MoveError)
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)
    first, cause, *_, fix = str(raised.value).splitlines()
    found = re.fullmatch(
        rf"to_device\(\) could not move ({path_pattern}) \({what}.*\) to emu:0:", first
    )
    assert found is not None, first
    assert cause.startswith("    OutOfMemoryError: emu out of memory. Tried to allocate ")
    assert f"fix: leave it where it is: to_device(obj, 'emu:0', skip=[{found[1]!r}])" == fix


@needs_emulated_memory_limit
def test_out_of_memory_moving_a_decorated_functions_argument() -> None:
    """The decorator's move of an argument past the device's memory raises an error that is
    both torch.OutOfMemoryError and MoveError, naming the argument."""

    @device_agnostic(device="emu:0")
    def first(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x

    # Above what earlier tests of the process still hold there (a staged region kept alive).
    limit = emulated.memory_allocated("emu:0") + 4 * MIB
    with emulated.configure(memory_limit=limit), pytest.raises(torch.OutOfMemoryError) as raised:
        first(torch.ones(3), w=torch.ones(2 * MIB))
    assert isinstance(raised.value, MoveError)
    assert str(raised.value).startswith("@device_agnostic could not move w (a Tensor of shape ")


def test_other_move_errors_are_no_out_of_memory_errors() -> None:
    """Only a move that ran out of memory is a torch.OutOfMemoryError: `except
    torch.OutOfMemoryError` (a back-off that halves the batch) lets other failures through."""
    with pytest.raises(MoveError) as raised:
        to_device({"model": nn.Linear(1, 1, device="meta")}, "cpu")
    assert not isinstance(raised.value, torch.OutOfMemoryError)


@pytest.mark.requires_device("cuda")
def test_a_real_cuda_out_of_memory_error_is_torchs_own_error() -> None:
    """The CUDA allocator's own error, raised moving a tensor larger than any GPU (1 PiB,
    expanded from one byte: no host memory), is a torch.OutOfMemoryError naming the path."""
    huge = torch.zeros(1, dtype=torch.uint8).expand(2**50)
    with pytest.raises(torch.cuda.OutOfMemoryError) as raised:
        to_device({"x": huge}, "cuda")
    assert isinstance(raised.value, MoveError)
    assert str(raised.value).startswith("to_device() could not move obj['x'] (a Tensor of ")
