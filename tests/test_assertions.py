"""``assert_device_agnostic``: what it runs where, what it catches, and every message."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import attrs
import numpy as np
import pytest
import torch
from helpers import accelerator, mps_like
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import devicectx
from devicectx import InvalidDeviceError
from devicectx.move._move import iter_tensors
from devicectx.testing import assert_device_agnostic, strategies

CPU_META = ["cpu", "meta"]
# Tests of the comparison itself run one device twice (values that differ on the CPU); the
# warning that such a check compares nothing across devices has tests of its own.
pytestmark = pytest.mark.filterwarnings(
    "ignore:assert_device_agnostic\\(devices=:devicectx.DeviceWarning"
)
# Why a fix that leaves a device out adds meta, which the caller did not list.
LEAVE_OUT_META = (
    "meta added: a check needs a second device to compare with, and meta compares "
    "structure, dtypes and shapes, not values"
)


class Pair(NamedTuple):
    """A namedtuple output, to show paths through fields."""

    first: torch.Tensor
    second: torch.Tensor


def agnostic(x: torch.Tensor, scale: float = 2.0) -> dict[str, object]:
    """A device-agnostic function with a nested output."""
    return {"y": x * scale, "parts": [x.sum(0), Pair(x.abs(), x.new_zeros(3))]}


def message_lines(raised: pytest.ExceptionInfo[AssertionError]) -> list[str]:
    """The lines of a raised assertion's message."""
    return str(raised.value).splitlines()


def drifting() -> Callable[[torch.Tensor], dict[str, object]]:
    """A function that computes differently on each call: cpu twice stands in for two devices."""
    calls = itertools.count()

    def drift(x: torch.Tensor) -> dict[str, object]:
        n = next(calls)
        return {"logits": [x, x + n * x.new_tensor([[0.0, 0.0], [0.5, 0.25]])], "n": x.numel()}

    return drift


def _accelerators() -> list[str]:
    return [str(d) for d in devicectx.available_devices() if d.type != "cpu"]


def instead_of_meta() -> str:
    """The fix that replaces meta where it was the second device: never the CPU alone, which
    a check would compare with itself, but this machine's accelerator or the emulated one."""
    if _accelerators():
        return (
            f"check it on an accelerator instead of meta: devices=['cpu', '{_accelerators()[0]}']"
        )
    return (
        "check it on an accelerator instead of meta: devices=['cpu', 'emu:0'] under pytest "
        "--devicectx-accelerator=emulated"
    )


def test_passes_for_an_agnostic_function() -> None:
    """A function that computes the same everywhere passes, with a nested output."""
    assert_device_agnostic(agnostic, torch.randn(4, 3), devices=CPU_META)
    assert_device_agnostic(agnostic, torch.randn(4, 3), scale=0.5, devices=CPU_META)


def test_default_devices_are_the_available_devices() -> None:
    """Without devices=, fn runs once on each available device, with its inputs there."""
    seen: list[torch.device] = []

    def record(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.device)
        return x + 1

    assert_device_agnostic(record, torch.ones(2))
    found = devicectx.available_devices()
    # The CPU alone would be compared with itself: meta is the second device then.
    assert (found if len(found) > 1 else [torch.device("cpu"), torch.device("meta")]) == seen


class _OnCpuByName(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + torch.ones(3, device="cpu")


def test_default_devices_catch_a_tensor_put_on_the_cpu_by_name() -> None:
    """On every machine, one with the CPU alone too, the default devices find the bug."""
    with pytest.raises(AssertionError, match="is not device-agnostic"):
        assert_device_agnostic(_OnCpuByName(), torch.randn(2, 4))


def test_devices_that_are_all_one_warn_with_a_fix_that_finds_the_bug() -> None:
    """A check of one device against itself passes anything: a warning says so, and its fix
    (a second device, one this machine has) then finds the bug."""
    with pytest.warns(devicectx.DeviceWarning) as caught:
        assert_device_agnostic(_OnCpuByName(), torch.randn(2, 4), devices=["cpu", "cpu"])
    [warning] = caught
    text = str(warning.message)
    assert warning.filename == __file__
    accelerators = [str(d) for d in devicectx.available_devices() if d.type != "cpu"]
    pair = ["cpu", accelerators[0] if accelerators else "meta"]
    assert [
        "assert_device_agnostic(devices=['cpu', ...]): every device listed is cpu, so nothing "
        "is compared across devices: the check passes code that runs on cpu alone",
        f"fix: devices={pair} (or, with the plugin's device fixture on a machine without an "
        "accelerator, pytest --devicectx-accelerator=emulated)",
    ] == text.splitlines()
    with pytest.raises(AssertionError, match="is not device-agnostic"):
        assert_device_agnostic(_OnCpuByName(), torch.randn(2, 4), devices=pair)


def test_two_devices_do_not_warn() -> None:
    """The warning is for devices that are all one, not for a device listed twice."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_device_agnostic(lambda x: x * 2, torch.ones(2), devices=["cpu", "meta", "cpu"])


def test_inputs_are_moved_together() -> None:
    """Every tensor argument arrives on the device, and one tensor passed twice stays one."""
    seen: list[tuple[torch.device, torch.device, bool]] = []

    def record(a: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        seen.append((a.device, batch["x"].device, a is batch["x"]))
        return a + batch["x"]

    x = torch.ones(2)
    assert_device_agnostic(record, x, batch={"x": x}, devices=CPU_META)
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert [(cpu, cpu, True), (meta, meta, True)] == seen


def test_module_as_fn_and_argument_is_copied_not_moved() -> None:
    """A model passed as fn, as a bound method or as an argument stays on its device, unchanged."""
    model = nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 3)

    def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = m(x)
        return out

    assert_device_agnostic(model, x, devices=CPU_META)
    assert_device_agnostic(model.forward, x, devices=CPU_META)
    assert_device_agnostic(forward, model, x, devices=CPU_META)
    assert_device_agnostic(forward, m=model, x=x, devices=CPU_META)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert {torch.device("cpu")} == {p.device for p in model.parameters()}


class Decorated(nn.Module):
    """A module whose methods are decorated with @device_agnostic in the class body."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    @devicectx.device_agnostic
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x) + torch.ones(2)
        return out

    @devicectx.device_agnostic(output="input")
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self(x).argmax(-1)
        return out


def test_decorated_methods_keep_their_decorator_on_the_copy() -> None:
    """A decorated forward or method is called on each device's copy, decorator included."""
    model, x = Decorated(), torch.randn(4, 3)
    assert_device_agnostic(model, x, devices=CPU_META)
    assert_device_agnostic(model.forward, x, devices=CPU_META)
    assert_device_agnostic(model.predict, x, devices=CPU_META)
    assert {torch.device("cpu")} == {p.device for p in model.parameters()}


def test_catches_a_tensor_on_the_wrong_device() -> None:
    """A tensor created without device= is caught on meta, by path, with the fix."""

    def make_mask(x: torch.Tensor) -> dict[str, object]:
        return {"x": x, "mask": [x > 0, torch.ones(x.shape[0], dtype=torch.bool)]}

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(make_mask, torch.randn(3), devices=CPU_META)
    assert [
        "make_mask is not device-agnostic (ran on cpu, meta):",
        "  on meta, compared with cpu:",
        "    out['mask'][1]: on cpu, expected meta",
        "fix: create new tensors on the input's device, torch.zeros(n, device=x.device), "
        "and move none to cpu by name (.cpu(), .to('cpu')), or decorate make_mask with "
        "@devicectx.device_agnostic so that those made without device= land there",
    ] == message_lines(raised)


def test_catches_a_tensor_moved_off_the_reference_device() -> None:
    """A tensor sent elsewhere is caught on the reference device too."""

    def to_meta(x: torch.Tensor) -> Pair:
        return Pair(x, x.to("meta"))

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(to_meta, torch.randn(3), devices=CPU_META)
    assert [
        "to_meta is not device-agnostic (ran on cpu, meta):",
        "  on cpu:",
        "    out.second: on meta, expected cpu",
        "fix: create new tensors on the input's device, torch.zeros(n, device=x.device), "
        "and move none to meta by name (.to('meta')), or decorate to_meta with "
        "@devicectx.device_agnostic so that those made without device= land there",
    ] == message_lines(raised)


def test_catches_values_that_differ() -> None:
    """Values that differ are reported by path, count, max abs and rel diff, and where."""
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(drifting(), torch.ones(2, 2), devices=["cpu", "cpu"])
    assert [
        "drift is not device-agnostic (ran on cpu, cpu):",
        "  on cpu, compared with cpu:",
        "    out['logits'][1]: 2 of 4 values differ (50.0%), rtol=1.3e-06, atol=1e-05",
        "      max abs diff 0.5 at index (1, 0)",
        "      max rel diff 0.5 at index (1, 0)",
        "fix: no float rounding is this large (beyond rtol=1e-2, atol=1e-3): drift must be "
        "deterministic (dropout in training mode: model.eval(); torch.rand and the like draw "
        "other numbers on each device, whatever the seed), else it computes something else "
        "there: a bug",
    ] == message_lines(raised)


def test_tolerances_are_applied() -> None:
    """Differences within the given rtol and atol pass; integers must match exactly."""
    assert_device_agnostic(drifting(), torch.ones(2, 2), devices=["cpu", "cpu"], rtol=0, atol=0.5)
    calls = itertools.count()

    def count_up(x: torch.Tensor) -> torch.Tensor:
        return torch.arange(4).reshape(2, 2) * next(calls)

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(count_up, torch.ones(1), devices=["cpu", "cpu"])
    assert [
        "    out: 3 of 4 values differ (75.0%), torch.int64 compared exactly",
        "      max abs diff 3 at index (1, 1)",
        "      max rel diff inf at index (0, 1)",
    ] == message_lines(raised)[2:5]


def test_nan_in_the_same_place_is_equal() -> None:
    """NaN where the reference has NaN is the same result; NaN elsewhere is the largest diff."""
    calls = itertools.count()

    def nan_once(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor([float("nan"), float("nan") if next(calls) else 1.0, 2.0])

    assert_device_agnostic(lambda x: x / 0 * 0, torch.ones(3), devices=["cpu", "cpu"])
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(nan_once, torch.ones(1), devices=["cpu", "cpu"])
    assert [
        "    out: 1 of 3 values differ (33.3%), rtol=1.3e-06, atol=1e-05",
        "      max abs diff nan at index (1,)",
        "      max rel diff nan at index (1,)",
    ] == message_lines(raised)[2:5]


class Tagged(torch.Tensor):
    """A tensor subclass: a tag (units, a quantization scheme) the caller's code reads."""


def test_catches_a_tensor_subclass_lost_on_one_device() -> None:
    """An output that is a subclass on one device and a plain tensor on another (a mask, a
    tag lost) is caught, as a container of another type is."""

    def tagged_on_cpu(x: torch.Tensor) -> dict[str, torch.Tensor]:
        out = x * 2
        return {"y": out.as_subclass(Tagged) if x.device.type == "cpu" else out, "x": x}

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(tagged_on_cpu, torch.ones(2), devices=CPU_META)
    assert [
        "tagged_on_cpu is not device-agnostic (ran on cpu, meta):",
        "  on meta, compared with cpu:",
        "    out['y']: a Tensor, expected a Tagged",
        "fix: make tagged_on_cpu return the same containers and tensors, dtypes, shapes and "
        "layouts on every device",
    ] == message_lines(raised)
    assert_device_agnostic(lambda x: (x * 2).as_subclass(Tagged), torch.ones(2), devices=CPU_META)


def test_catches_a_dtype_shape_and_structure_that_differ() -> None:
    """On meta, a different dtype, shape, output type or set of tensors is caught."""

    def differs_on_meta(x: torch.Tensor) -> object:
        if x.device.type != "meta":
            return {"a": x, "b": x, "c": x}
        return [x.double()]

    def shaped(x: torch.Tensor) -> dict[str, torch.Tensor]:
        on_meta, y = x.device.type == "meta", x * 1
        return {"a": y.double() if on_meta else y * 1, "b": y.t() if on_meta else y * 1, "c": x}

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(shaped, torch.ones(2, 3), devices=CPU_META)
    assert [
        "shaped is not device-agnostic (ran on cpu, meta):",
        "  on meta, compared with cpu:",
        "    out['a']: dtype torch.float64, expected torch.float32",
        "    out['b']: shape (3, 2), expected (2, 3)",
        "fix: make shaped return the same containers and tensors, dtypes, shapes and layouts "
        "on every device",
    ] == message_lines(raised)
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(differs_on_meta, torch.ones(2), devices=CPU_META)
    assert [
        "differs_on_meta is not device-agnostic (ran on cpu, meta):",
        "  on meta, compared with cpu:",
        "    out: a list, expected a dict",
        "    out['a']: missing",
        "    out['b']: missing",
        "    out['c']: missing",
        "    out[0]: unexpected tensor",
        "fix: make differs_on_meta return the same containers and tensors, dtypes, shapes and "
        "layouts on every device",
    ] == message_lines(raised)


def test_meta_first_compares_values_with_the_first_real_device() -> None:
    """With meta first, values are compared with the first device that has values."""
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(drifting(), torch.ones(2, 2), devices=["meta", "cpu", "cpu"])
    assert [
        "drift is not device-agnostic (ran on meta, cpu, cpu):",
        "  on cpu, compared with meta and cpu:",
    ] == message_lines(raised)[:2]


def test_long_lists_of_problems_are_cut() -> None:
    """At most ten problems per device are listed, then how many more."""

    def many(x: torch.Tensor) -> list[torch.Tensor]:
        return [torch.zeros(1) for _ in range(12)]

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(many, torch.ones(1), devices=CPU_META)
    lines = message_lines(raised)
    assert ["    out[9]: on cpu, expected meta", "    ... and 2 more"] == lines[11:13]


# Sets: their iteration order follows hashes (ids, for tensors), so it differs between runs.


class Ranked(torch.Tensor):
    """A tensor hashed by a rank of its own, so that a set's iteration order is chosen."""

    rank = 0

    def __hash__(self) -> int:
        return self.rank


def ranked(*tensors: torch.Tensor, ranks: Sequence[int] | None = None) -> list[Ranked]:
    """``tensors`` as Ranked tensors, ranked by ``ranks`` (default: in order): a set of
    them iterates by rank."""
    out = []
    for rank, tensor in zip(ranks or range(len(tensors)), tensors, strict=True):
        member = tensor.as_subclass(Ranked)
        member.rank = rank
        out.append(member)
    return out


# An iteration order of four tensors for each call, each call's other than the last's.
ORDERS = [(0, 1, 2, 3), (3, 2, 1, 0), (1, 0, 3, 2)]


def reordering() -> Callable[[torch.Tensor], dict[str, object]]:
    """A device-agnostic function returning sets whose iteration order changes at each
    call: a set of tensors, and a frozenset of pairs of them (hashed by their ranks)."""
    calls = itertools.count()

    def stats(x: torch.Tensor) -> dict[str, object]:
        order = ORDERS[next(calls) % len(ORDERS)]
        s, m, a, b = ranked(x.sum(0), x.mean(0), x.amax(0), x.amin(0), ranks=order)
        return {"stats": {s, m, a}, "pairs": frozenset([(s, a), (m, b)])}

    return stats


@pytest.mark.parametrize(
    "devices", [["cpu", "cpu", "cpu"], ["cpu", "meta", "cpu"], ["meta", "cpu", "cpu"]]
)
def test_set_members_are_compared_whatever_their_order(devices: list[str]) -> None:
    """Each member of a set is compared with the reference's member it equals, not with
    the one at the same place in iteration order, which follows hashes."""
    x, stats = torch.randn(4, 3), reordering()
    first, second, third = (list(stats(x)["stats"]) for _ in ORDERS)  # type: ignore[call-overload]
    assert [torch.equal(x.sum(0), t) for t in first] == [True, False, False]
    assert [torch.equal(x.sum(0), t) for t in second] == [False, False, True]
    assert [torch.equal(x.sum(0), t) for t in third] == [False, True, False]
    assert_device_agnostic(reordering(), x, devices=devices)


def test_sets_of_plain_tensors_pass_every_time() -> None:
    """A set of plain tensors (hashed by id: the order changes from run to run) passes
    every time."""

    def stats(x: torch.Tensor) -> set[torch.Tensor]:
        return {x.sum(0), x.mean(0), x.amax(0), *x}

    for _ in range(20):
        assert_device_agnostic(stats, torch.randn(4, 3), devices=["cpu", "meta", "cpu"])


def test_set_members_are_paired_by_a_largest_matching() -> None:
    """Within a tolerance, a member may equal two of the reference's: it is paired so that
    every member finds one, not with the first it equals."""
    calls = itertools.count()

    def near(x: torch.Tensor) -> set[torch.Tensor]:
        values = [0.0, 0.6] if next(calls) == 0 else [0.3, 0.0]  # 0.3 is within 0.5 of both
        return set(ranked(*(x.new_tensor(v) for v in values)))

    assert_device_agnostic(near, torch.ones(1), devices=["cpu", "cpu"], rtol=0, atol=0.5)


def test_a_set_member_that_differs_is_named() -> None:
    """A member that equals none of the reference's is reported at the path of the one left
    over, whatever the order; one missing is reported missing."""
    calls = itertools.count()

    def drifting_stats(x: torch.Tensor) -> dict[str, object]:
        n = next(calls)
        s, m, a = ranked(x.sum(0), x.mean(0), x.amax(0) + n, ranks=ORDERS[n][:3])
        return {"stats": {s, m, a} if n < 2 else {s, m}}

    x = torch.arange(6.0).reshape(2, 3)  # sum, mean and amax all differ, amax + 1 too
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(drifting_stats, x, devices=["cpu", "cpu", "meta"])
    assert [
        "drifting_stats is not device-agnostic (ran on cpu, cpu, meta):",
        "  on cpu, compared with cpu:",
        "    list(out['stats'])[2]: 3 of 3 values differ (100.0%), rtol=1.3e-06, atol=1e-05",
        "      max abs diff 1 at index (0,)",
        "      max rel diff 0.333333 at index (0,)",
        "  on meta, compared with cpu:",
        "    list(out['stats'])[2]: missing",
        "fix: make drifting_stats return the same containers and tensors, dtypes, shapes and "
        "layouts on every device",
        "fix: no float rounding is this large (beyond rtol=1e-2, atol=1e-3): drifting_stats "
        "must be deterministic (dropout in training mode: model.eval(); torch.rand and the "
        "like draw other numbers on each device, whatever the seed), else it computes "
        "something else there: a bug",
    ] == message_lines(raised)


def test_raising_on_a_later_device_is_a_failure() -> None:
    """fn raising on a device other than the first fails, naming it, chained to the error."""

    def to_float(x: torch.Tensor) -> float:
        return x.sum().item()

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(to_float, torch.ones(2), devices=CPU_META)
    assert [
        "to_float is not device-agnostic: it raised on meta, not on cpu:",
        "    RuntimeError: Tensor.item() cannot be called on meta tensors",
        "fix: to_float copies a tensor's values to the host (.item(), .tolist(), .cpu()), "
        f"which meta has none of: {instead_of_meta()}",
    ] == message_lines(raised)
    assert isinstance(raised.value.__cause__, RuntimeError)


def masked_double(x: torch.Tensor) -> torch.Tensor:
    """Doubles ``x``, off the CPU with a fused op that only CUDA has a kernel for (as torch
    itself picks fused kernels for a device that is not the CPU: its recurrent cells)."""
    if x.is_cpu:
        return x * 2
    return torch._masked_scale(x, torch.ones_like(x, dtype=torch.bool), 2.0)


@pytest.mark.requires_device("accelerator")
def test_masked_and_quantized_outputs_are_compared_by_what_they_hold() -> None:
    """A ``MaskedTensor`` is compared by its mask, then its values under the mask; a
    quantized tensor by the values it reads as. Each difference is named by its path
    (torch's own errors escaped the comparison: masks that must match, no ``full_like``)."""
    device = accelerator()
    x = torch.linspace(-1, 1, 12).reshape(4, 3)  # x > 0 and x > 0.5 differ at 3 values

    def masked(x: torch.Tensor) -> torch.Tensor:
        return torch.masked.masked_tensor(x * 2, x > 0)

    def mask_differs(x: torch.Tensor) -> torch.Tensor:
        return torch.masked.masked_tensor(x, x > (0 if x.is_cpu else 0.5))

    def values_differ(x: torch.Tensor) -> torch.Tensor:
        return torch.masked.masked_tensor(x + (0 if x.is_cpu else 7), x > 0)

    def quantized(x: torch.Tensor) -> torch.Tensor:
        return torch.quantize_per_tensor(x.cpu(), 0.1, 0, torch.quint8)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch.masked is a prototype
        assert_device_agnostic(masked, x, devices=["cpu", device])
        found = {}
        for fn in (mask_differs, values_differ, quantized):
            with pytest.raises(AssertionError) as raised:
                assert_device_agnostic(fn, x, devices=["cpu", device])
            found[fn.__name__] = message_lines(raised)[2]
    assert {
        "mask_differs": "    out.get_mask(): 3 of 12 values differ (25.0%), torch.bool compared "
        "exactly",
        "values_differ": "    out.get_data(): 6 of 12 values differ (50.0%), rtol=1.3e-06, "
        "atol=1e-05",
        "quantized": f"    out: on cpu, expected {device}",
    } == found


@pytest.mark.requires_device("accelerator")
def test_an_op_the_device_lacks_is_named_with_a_fix_that_works() -> None:
    """An op the device has no kernel for is named as the device's gap, not fn's: torch's
    list of dispatch keys is left out, and the fix (leave the device out) passes."""
    device = accelerator()
    if device.type != "emu":
        pytest.skip("the op missing here is one the emulated accelerator lacks")
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(masked_double, torch.ones(3), devices=["cpu", device])
    assert [
        "masked_double is not device-agnostic: it raised on emu:0, not on cpu:",
        "    NotImplementedError: Could not run 'aten::_masked_scale' with arguments from "
        "the 'CPU' backend. (torch's list of dispatch keys left out)",
        "  emu:0 has no kernel for aten::_masked_scale: an op the device's backend lacks "
        "(torch's gap, not masked_double's: it ran on cpu)",
        f"fix: leave emu:0 out: devices=['cpu', 'meta'] ({LEAVE_OUT_META})",
    ] == message_lines(raised)
    assert isinstance(raised.value.__cause__, NotImplementedError)
    assert_device_agnostic(masked_double, torch.ones(3), devices=["cpu", "meta"])


@pytest.mark.requires_device("accelerator")
def test_an_op_the_first_device_lacks_is_named_too() -> None:
    """The same gap on the first device of ``devices=``: named as the device's, with the
    fix, not left as torch's raw error (no device ran it before, so none is named)."""
    device = accelerator()
    if device.type != "emu":
        pytest.skip("the op missing here is one the emulated accelerator lacks")
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(masked_double, torch.ones(3), devices=[device, "cpu"])
    assert [
        "masked_double is not device-agnostic: it raised on emu:0:",
        "    NotImplementedError: Could not run 'aten::_masked_scale' with arguments from "
        "the 'CPU' backend. (torch's list of dispatch keys left out)",
        "  emu:0 has no kernel for aten::_masked_scale: an op the device's backend lacks "
        "(torch's gap, not masked_double's)",
        f"fix: leave emu:0 out: devices=['cpu', 'meta'] ({LEAVE_OUT_META})",
    ] == message_lines(raised)


def sparse_doubled(x: torch.Tensor) -> torch.Tensor:
    """Sparse COO ops: the emulated accelerator has no kernels for them, and meta has none
    for ``to_sparse``."""
    return (x.to_sparse() * 2).to_dense()


@pytest.mark.requires_device("accelerator")
def test_an_op_meta_lacks_too_gets_no_fix_that_sends_the_check_to_meta() -> None:
    """Where meta lacks the op too, leaving the device out for meta would fail again: the
    fix says so and gives what works, the op on the CPU in fn."""
    device = accelerator()
    if device.type != "emu":
        pytest.skip("the op missing here is one the emulated accelerator lacks")
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(sparse_doubled, torch.ones(2, 2), devices=["cpu", device])
    assert (
        "fix: run that op on the CPU in sparse_doubled where emu:0 lacks it (x.cpu(), then "
        ".to(x.device) on its result), or check sparse_doubled where another accelerator is "
        "(devices=['cpu', 'cuda']): leaving emu:0 out here leaves the CPU alone, as meta "
        "lacks an op sparse_doubled needs too (aten::_to_sparse)"
    ) == message_lines(raised)[-1]

    def on_the_cpu(x: torch.Tensor) -> torch.Tensor:
        return sparse_doubled(x.cpu()).to(x.device)

    assert_device_agnostic(on_the_cpu, torch.ones(2, 2), devices=["cpu", device])


@pytest.mark.requires_device("accelerator")
def test_a_missing_op_fix_leaves_out_the_whole_backend_and_meta_where_it_fails() -> None:
    """The other devices of the backend lack the op too, so the fix leaves them out with
    it; meta listed after the device is left out as well where fn fails on it."""
    device, second = accelerator(), accelerator(1) if torch.accelerator.device_count() > 1 else None
    if device.type != "emu" or second is None:
        pytest.skip("needs two emulated devices (the suite's --devicectx-accelerator=emulated)")
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(
            sparse_doubled, torch.ones(2, 2), devices=["cpu", device, second, "meta", "cpu"]
        )
    assert message_lines(raised)[-1].startswith("fix: run that op on the CPU in sparse_doubled")
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(masked_double, torch.ones(3), devices=["cpu", device, second])
    assert (f"fix: leave emu:0 out: devices=['cpu', 'meta'] ({LEAVE_OUT_META})") == message_lines(
        raised
    )[-1]


@pytest.mark.requires_device("accelerator")
def test_a_missing_op_fix_names_why_meta_fails_where_it_is_no_op() -> None:
    """fn failing on meta for another reason (values read to the host) is named too."""
    device = accelerator()
    if device.type != "emu":
        pytest.skip("the op missing here is one the emulated accelerator lacks")

    def masked_total(x: torch.Tensor) -> float:
        return float(masked_double(x).sum())

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(masked_total, torch.ones(3), devices=["cpu", device])
    assert message_lines(raised)[-1].endswith(
        "as meta fails masked_total too (RuntimeError: Tensor.item() cannot be called on "
        "meta tensors)"
    )


def positives(x: torch.Tensor) -> torch.Tensor:
    return x[x > 0]  # nonzero: a shape that depends on the values


def test_an_op_whose_shape_needs_values_is_no_gap_of_fn_on_meta() -> None:
    """Boolean indexing (nonzero) on meta: told as meta having no values, with an
    accelerator as the fix; leaving meta out would leave the CPU alone, whose warning sent
    the check back to meta."""
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(positives, torch.tensor([1.0, -1.0]), devices=CPU_META)
    lines = message_lines(raised)
    assert "(the rest of torch's text left out)" in lines[1]  # torch's words vary by release
    assert [
        "positives is not device-agnostic: it raised on meta, not on cpu:",
        "  meta has no values, and aten::nonzero makes a tensor whose shape depends on them "
        "(torch's gap, not positives's: it ran on cpu)",
        f"fix: {instead_of_meta()}",
    ] == [lines[0], *lines[2:]]


def test_an_op_meta_has_no_kernel_for_is_named_with_its_fix() -> None:
    """meta's own words for an op it has no kernel for (no fake impl): named as its gap,
    its long advice on fake impls left out, and an accelerator as the fix."""
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(sparse_doubled, torch.ones(2, 2), devices=CPU_META)
    assert [
        "sparse_doubled is not device-agnostic: it raised on meta, not on cpu:",
        "    NotImplementedError: aten::_to_sparse: attempted to run this operator with Meta "
        "tensors, but there was no fake impl or Meta kernel registered. (the rest of torch's "
        "text left out)",
        "  meta has no kernel for aten::_to_sparse: an op the device's backend lacks (torch's "
        "gap, not sparse_doubled's: it ran on cpu)",
        f"fix: {instead_of_meta()}",
    ] == message_lines(raised)


class Cache:
    """A plain object holding a tensor, as a transformers cache holds its keys."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys


def cached(x: torch.Tensor) -> dict[str, object]:
    return {"y": x * 2, "cache": Cache(x * 3 if x.is_cpu else x[:1])}  # wrong off the CPU


def test_tensors_the_comparison_cannot_see_are_warned_of_with_a_fix_that_works() -> None:
    """A passing check says which tensors of the output it could not compare (in plain
    objects), with a fix that, applied as printed, makes it compare them (and fail here)."""
    with pytest.warns(devicectx.DeviceWarning) as caught:
        assert_device_agnostic(cached, torch.ones(2), devices=CPU_META)
    lines = str(caught[0].message).splitlines()
    assert [
        "assert_device_agnostic(cached): passed, but these tensors of the output were not "
        "compared (held by objects the comparison does not look into):",
        "    out['cache'].keys (in Cache)",
    ] == lines[:2]
    assert caught[0].filename == __file__
    fix = lines[2].removeprefix("fix: teach devicectx those types, and the check compares them: ")
    exec(fix)
    try:
        with pytest.raises(AssertionError, match=r"out\['cache'\]\.keys"):
            assert_device_agnostic(cached, torch.ones(2), devices=CPU_META)
    finally:
        devicectx.unregister_container(Cache)


MPS_MISSING = (
    "The operator 'aten::_masked_scale' is not currently implemented for the MPS device. If "
    "you want this op to be considered for addition please comment on "
    "https://github.com/pytorch/pytorch/issues/141287 and mention use-case, that resulted in "
    "missing op as well as commit hash 2236df1770800ffea5697b11b0bb0d910b2e59e1. As a "
    "temporary fix, you can set the environment variable `PYTORCH_ENABLE_MPS_FALLBACK=1` to "
    "use the CPU as a fallback for this op. WARNING: this will be slower than running "
    "natively on MPS."
)


def test_an_op_mps_lacks_gets_its_fallback_as_the_fix() -> None:
    """MPS's words for an op it lacks: named as the device's gap, with MPS's CPU fallback
    (an environment variable) or leaving the device out as the fix."""

    def on_mps(x: torch.Tensor) -> torch.Tensor:  # what MPS raises, on the second device
        if x.is_cpu:
            return x * 2
        raise NotImplementedError(MPS_MISSING)

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(on_mps, torch.ones(3), devices=CPU_META)
    assert [
        "on_mps is not device-agnostic: it raised on meta, not on cpu:",
        "    NotImplementedError: The operator 'aten::_masked_scale' is not currently "
        "implemented for the MPS device. (the rest of torch's text left out)",
        "  meta has no kernel for aten::_masked_scale: an op the device's backend lacks "
        "(torch's gap, not on_mps's: it ran on cpu)",
        "fix: run with MPS's CPU fallback for the ops it lacks, set before Python starts "
        f"(PYTORCH_ENABLE_MPS_FALLBACK=1 pytest ...), or {instead_of_meta()}",
    ] == message_lines(raised)


def test_a_numpy_round_trip_is_named_with_a_fix_that_works() -> None:
    """``.numpy()`` of a tensor off the CPU fails on every accelerator: the fix names the
    round trip, and on meta (which has no values) the emulated accelerator."""

    def clipped(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.maximum(x.numpy(), 0.0))

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(clipped, torch.ones(3), devices=CPU_META)
    assert [
        "clipped is not device-agnostic: it raised on meta, not on cpu:",
        "    TypeError: can't convert meta device type tensor to numpy. Use Tensor.cpu() to "
        "copy the tensor to host memory first.",
        "fix: clipped converts a tensor to numpy (.numpy()), which fails on every device "
        "but the CPU, and meta has no values to convert: check it on the emulated "
        "accelerator instead of meta (pytest --devicectx-accelerator=emulated, "
        "devices=['cpu', 'emu:0']), where the fix is to keep the work in torch, or copy "
        "there and back: torch.as_tensor(f(x.detach().cpu().numpy()), device=x.device)",
    ] == message_lines(raised)


@pytest.mark.requires_device("accelerator")
def test_a_numpy_round_trip_on_the_accelerator_gets_a_fix_that_works() -> None:
    """On an accelerator, the round trip's fix, applied literally, passes."""
    device = accelerator()

    def clipped(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.maximum(x.numpy(), 0.0))

    def fixed(x: torch.Tensor) -> torch.Tensor:
        def f(a: np.ndarray) -> np.ndarray:
            return np.maximum(a, 0.0)

        return torch.as_tensor(f(x.detach().cpu().numpy()), device=x.device)

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(clipped, torch.ones(3), devices=["cpu", device])
    assert (
        "fix: clipped converts a tensor to numpy (.numpy()), which fails on every device "
        "but the CPU: keep the work in torch, or copy there and back: "
        "torch.as_tensor(f(x.detach().cpu().numpy()), device=x.device)"
    ) == message_lines(raised)[-1]
    assert_device_agnostic(fixed, torch.ones(3), devices=["cpu", device])


def test_raising_on_the_first_device_propagates() -> None:
    """fn raising on the first device is fn's own error, raised as it is."""

    def broken(x: torch.Tensor) -> torch.Tensor:
        raise KeyError("labels")

    with pytest.raises(KeyError, match="labels"):
        assert_device_agnostic(broken, torch.ones(2), devices=CPU_META)


@pytest.mark.parametrize(
    ("kwargs", "error", "expected"),
    [
        (
            {"devices": "meta"},
            TypeError,
            "assert_device_agnostic(devices='meta'): devices takes a list of devices\n"
            "fix: devices=['cpu', 'meta']",
        ),
        (
            {"devices": []},
            ValueError,
            "assert_device_agnostic(devices=[]): no device to run on\nfix: devices=['cpu', 'meta']",
        ),
        (
            {"rtol": 1e-3},
            ValueError,
            "assert_device_agnostic(rtol=0.001): give both rtol and atol, or neither (then "
            "they depend on the dtype, as in torch.testing.assert_close)\n"
            "fix: assert_device_agnostic(fn, ..., rtol=1e-5, atol=1e-8)",
        ),
        (
            {"rtol": -1.0, "atol": 0.0},
            ValueError,
            "assert_device_agnostic(rtol=-1.0): rtol must be 0 or more, as in "
            "torch.testing.assert_close\n"
            "fix: assert_device_agnostic(fn, ..., rtol=1e-5, atol=1e-8)",
        ),
        (
            {"rtol": 0.0, "atol": float("nan")},
            ValueError,
            "assert_device_agnostic(atol=nan): atol must be 0 or more, as in "
            "torch.testing.assert_close\n"
            "fix: assert_device_agnostic(fn, ..., rtol=1e-5, atol=1e-8)",
        ),
        (
            {"rtol": "1e-5", "atol": 1e-8},
            TypeError,
            "assert_device_agnostic(rtol='1e-5'): rtol takes a float, got a str\n"
            "fix: assert_device_agnostic(fn, ..., rtol=1e-5, atol=1e-8)",
        ),
        (
            {"dtypes": "cuda"},
            ValueError,
            "assert_device_agnostic: dtypes='cuda' is no dtype policy: it takes None, "
            '"device" or a mapping\n'
            'fix: dtypes="device" (what the target cannot hold becomes the nearest dtype it '
            "holds), or dtypes={torch.float64: torch.float32}",
        ),
    ],
    ids=[
        "devices-one-string",
        "devices-empty",
        "rtol-alone",
        "rtol-negative",
        "atol-nan",
        "rtol-string",
        "dtypes-unknown",
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], expected: str) -> None:
    """Unusable devices=, rtol=, atol= or dtypes= raise before fn runs, saying what to write."""
    ran: list[torch.device] = []

    def record(x: torch.Tensor) -> torch.Tensor:
        ran.append(x.device)
        return x

    with pytest.raises(error) as raised:
        assert_device_agnostic(record, torch.ones(1), **kwargs)  # type: ignore[arg-type]
    assert expected == str(raised.value)
    assert [] == ran


@pytest.mark.parametrize("given", [0, "cpu", "meta", "auto"])
def test_one_device_for_devices_gets_a_fix_that_runs(given: str | int) -> None:
    """One device where a list is due gets a fix of two devices, the CPU and another that
    is here (that device, an accelerator, or meta), and the fix runs."""
    others = [d for d in devicectx.available_devices() if d.type != "cpu"]
    second = "meta" if given == "meta" or not others else str(others[0])
    with pytest.raises(TypeError) as raised:
        assert_device_agnostic(agnostic, torch.ones(1), devices=given)  # type: ignore[arg-type]
    assert [
        f"assert_device_agnostic(devices={given!r}): devices takes a list of devices",
        f"fix: devices=['cpu', {second!r}]",
    ] == str(raised.value).splitlines()
    assert_device_agnostic(agnostic, torch.ones(1), devices=["cpu", second])


def test_unknown_device_raises_resolve_devices_error() -> None:
    """A malformed device in devices= raises resolve_device's own error."""
    with pytest.raises(InvalidDeviceError, match="invalid device 'gpu'"):
        assert_device_agnostic(agnostic, torch.ones(1), devices=["cpu", "gpu"])


def test_with_the_plugins_device_fixture(device: torch.device) -> None:
    """The plugin's `device` fixture and the assertion combine: cpu against each device."""
    assert_device_agnostic(agnostic, torch.randn(3, 2), devices=["cpu", device, "meta"])


@given(x=strategies.tensors(devices=["cpu"]))
def test_torch_ops_are_agnostic(x: torch.Tensor) -> None:
    """Any tensor the kit's strategy draws passes through torch's own ops on cpu and meta."""
    assert_device_agnostic(lambda t: (t.clone(), t.reshape(-1), t.sum()), x, devices=CPU_META)


@pytest.mark.requires_device("accelerator")
def test_catches_values_that_differ_on_the_accelerator() -> None:
    """A function that adds 1 only on the accelerator is caught there, with its diff."""
    device = accelerator()

    def off_by_one(x: torch.Tensor) -> torch.Tensor:
        return x + 1 if x.device.type == device.type else x

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(off_by_one, torch.ones(2), devices=["cpu", device])
    assert [
        f"off_by_one is not device-agnostic (ran on cpu, {device}):",
        f"  on {device}, compared with cpu:",
        "    out: 2 of 2 values differ (100.0%), rtol=1.3e-06, atol=1e-05",
        "      max abs diff 1 at index (0,)",
        "      max rel diff 1 at index (0,)",
    ] == message_lines(raised)[:5]


class Scales:
    """A plain object holding a tensor: the move to each device cannot see it."""

    def __init__(self, factor: torch.Tensor) -> None:
        self.factor = factor


def test_a_tensor_the_move_cannot_see_is_named_with_the_fix() -> None:
    """torch's device mismatch on a later device names the attribute the move left behind,
    and the fix (register_container, pass it, or a .to()), chained to torch's error."""

    def scaled(x: torch.Tensor, scales: Scales) -> torch.Tensor:
        return x * scales.factor

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(
            scaled, torch.ones(2), Scales(torch.ones(2)), devices=["cpu", "meta"]
        )
    assert [
        "scaled is not device-agnostic: it raised on meta, not on cpu:",
        "    RuntimeError: Tensor on device cpu is not on the expected device meta!",
        "  tensors the move to meta could not see, left where they were:",
        "    cpu <- scales.factor (in Scales)",
        "fix: import copy; from devicectx import register_container; "
        'register_container(Scales, children=lambda obj: [("factor", '
        "obj.factor)], rebuild=lambda obj, new: (clone := copy.copy(obj), setattr(clone, "
        '"factor", new[0]))[0]), pass scales.factor as an argument, or give Scales a '
        ".to(device) method",
    ] == str(raised.value).splitlines()
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_an_unseen_tensor_on_the_first_device_is_named_too() -> None:
    """The first device's run, which otherwise raises as it is, names unseen tensors too."""

    def scaled(x: torch.Tensor, scales: Scales) -> torch.Tensor:
        return x * scales.factor

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(scaled, torch.ones(2), Scales(torch.ones(2)), devices=["meta"])
    lines = str(raised.value).splitlines()
    assert "scaled is not device-agnostic: it raised on meta:" == lines[0]
    assert "    cpu <- scales.factor (in Scales)" == lines[3]


# The structure: containers, shared tensors and requires_grad are compared, strides are not.


def test_nested_container_types_are_compared() -> None:
    """A container of another type at any depth is named by path; other values are not
    compared."""

    def nested(x: torch.Tensor) -> dict[str, object]:
        if x.device.type == "meta":
            return {"out": [(x,)], "n": 0, "label": "meta", "extra": [x]}
        return {"out": [[x]], "n": int(x.sum()), "label": "cpu", "extra": None}

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(nested, torch.ones(3), devices=CPU_META)
    assert [
        "nested is not device-agnostic (ran on cpu, meta):",
        "  on meta, compared with cpu:",
        "    out['out'][0]: a tuple, expected a list",
        "    out['extra']: a list, expected None",
        "    out['extra'][0]: unexpected tensor",
        "fix: make nested return the same containers and tensors, dtypes, shapes and layouts "
        "on every device",
    ] == message_lines(raised)


def test_tensors_shared_between_paths_are_compared() -> None:
    """The same tensor, or a view, at two paths on one device and copies on another is
    named by path (an in-place write by the caller would differ); a view of an input is
    not compared, as the move may copy input views apart."""

    def shared(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x * 2
        if x.device.type == "meta":
            return y, y, y[0], x.clone()
        return y, y.clone(), y[0].clone(), x.reshape(-1)

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(shared, torch.ones(2), devices=CPU_META)
    assert [
        "shared is not device-agnostic (ran on cpu, meta):",
        "  on meta, compared with cpu:",
        "    out[1]: the same tensor as out[0], expected a tensor with its own memory",
        "    out[2]: a view sharing memory with out[0], expected a tensor with its own memory",
        "fix: where shared means a copy, make one on every device: x.clone() (reshape() and "
        "contiguous() return their input, or a view of it, where the strides allow)",
    ] == message_lines(raised)


def test_requires_grad_is_compared() -> None:
    """An output that requires grad on one device only is named, with the fix."""

    def detached(x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = x * 2
        return {"y": y.detach() if x.device.type == "meta" else y}

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(detached, torch.ones(2, requires_grad=True), devices=CPU_META)
    assert [
        "detached is not device-agnostic (ran on cpu, meta):",
        "  on meta, compared with cpu:",
        "    out['y']: requires_grad=False, expected True",
        "fix: make detached record autograd alike on every device: the same ops, no .detach() "
        "or torch.no_grad() on one device only",
    ] == message_lines(raised)


def test_shared_tensors_and_views_that_agree_pass() -> None:
    """Outputs sharing tensors alike on every device pass, with the input among them."""

    def views(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x, x, x[0], x.t(), x.clone(), x.sum()

    assert_device_agnostic(views, torch.ones(2, 2, requires_grad=True), devices=CPU_META)


# Integer and bool values: compared exactly, whatever rtol and atol.


def test_integers_are_compared_exactly_with_a_fix_that_works() -> None:
    """An integer difference says it is compared exactly, not within rtol/atol, and its
    fix (a float, with atol) passes."""
    calls = itertools.count()

    def count(x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"n": (x > 0).sum() + next(calls), "mask": x > 0}

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(count, torch.ones(4), devices=["cpu", "cpu"], rtol=1.0, atol=10.0)
    assert [
        "count is not device-agnostic (ran on cpu, cpu):",
        "  on cpu, compared with cpu:",
        "    out['n']: 1 of 1 values differ (100.0%), torch.int64 compared exactly",
        "      max abs diff 1",
        "      max rel diff 0.25",
        "fix: integer and bool values are compared exactly, whatever rtol and atol; where "
        "out['n'] may differ, make count return it as a float and allow the difference: "
        "assert_device_agnostic(count, ..., rtol=0, atol=1)",
    ] == message_lines(raised)
    calls = itertools.count()

    def count_as_float(x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"n": ((x > 0).sum() + next(calls)).float(), "mask": x > 0}

    assert_device_agnostic(count_as_float, torch.ones(4), devices=["cpu", "cpu"], rtol=0, atol=1)


# Numbers in the output: integers exactly, others within the tolerances.


def test_numbers_in_the_output_are_compared() -> None:
    """A Python number that differs between devices is named (an int exactly, a float
    within float32's tolerances by default, or rtol/atol); a str, which may name the
    device, is not compared; NaN equals NaN."""
    calls = itertools.count()

    def stats(x: torch.Tensor) -> dict[str, object]:
        n = next(calls)
        return {
            "loss": (x.sum() + 0.5 * n).item(),
            "close": 1.0 + 1e-9 * n,
            "steps": 3 + n,
            "nan": float("nan"),
            "where": f"ran on {x.device} (call {n})",
        }

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(stats, torch.ones(4), devices=["cpu", "cpu"])
    assert [
        "stats is not device-agnostic (ran on cpu, cpu):",
        "  on cpu, compared with cpu:",
        "    out['loss']: 4.5, expected 4.0, rtol=1.3e-06, atol=1e-05",
        "    out['steps']: 4, expected 3, integers compared exactly",
        "fix: no float rounding is this large (beyond rtol=1e-2, atol=1e-3): stats must be "
        "deterministic (dropout in training mode: model.eval(); torch.rand and the like draw "
        "other numbers on each device, whatever the seed), else it computes something else "
        "there: a bug",
        "fix: integer and bool values are compared exactly, whatever rtol and atol; where "
        "out['steps'] may differ, make stats return it as a float and allow the difference: "
        "assert_device_agnostic(stats, ..., rtol=0, atol=1)",
    ] == message_lines(raised)
    calls = itertools.count()

    def loss_only(x: torch.Tensor) -> dict[str, object]:
        return {"loss": (x.sum() + 0.5 * next(calls)).item(), "steps": 3}

    assert_device_agnostic(loss_only, torch.ones(4), devices=["cpu", "cpu"], rtol=0, atol=0.5)


def test_a_number_where_the_reference_has_another_type_is_named() -> None:
    """A number on one device where another has None (or another kind of number) is a
    structure difference; values of meta's run are not compared, their types are."""

    def maybe_count(x: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        return x, None if x.is_meta else 3

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(maybe_count, torch.ones(2), devices=CPU_META)
    assert "    out[1]: None, expected an int" in message_lines(raised)
    assert_device_agnostic(
        lambda x: (x, x.numel() * (2 if x.is_meta else 1)), torch.ones(2), devices=CPU_META
    )


# Sparse outputs: compared as the dense tensors they stand for.


def test_sparse_outputs_are_compared_as_dense() -> None:
    """Sparse outputs that agree pass; values that differ are named as dense ones, and a
    layout that differs is a structure difference."""
    assert_device_agnostic(lambda x: x.to_sparse(), torch.eye(2), devices=["cpu", "cpu"])
    calls = itertools.count()

    def sparse(x: torch.Tensor) -> torch.Tensor:
        return (x * (1 + next(calls))).to_sparse()

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(sparse, torch.eye(2), devices=["cpu", "cpu"])
    assert [
        "sparse is not device-agnostic (ran on cpu, cpu):",
        "  on cpu, compared with cpu:",
        "    out: 2 of 4 values differ (50.0%), rtol=1.3e-06, atol=1e-05",
        "      max abs diff 1 at index (0, 0)",
        "      max rel diff 1 at index (0, 0)",
    ] == message_lines(raised)[:5]
    calls = itertools.count()

    def sometimes_sparse(x: torch.Tensor) -> torch.Tensor:
        return x.to_sparse() if next(calls) else x * 1

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(sometimes_sparse, torch.eye(2), devices=["cpu", "cpu"])
    assert ["    out: layout torch.sparse_coo, expected torch.strided"] == message_lines(raised)[
        2:3
    ]


# Modules anywhere in the arguments are copied for each device.


@dataclasses.dataclass
class Batch:
    """A dataclass argument holding a model and its input."""

    model: nn.Module
    x: torch.Tensor


def test_a_module_inside_a_container_is_copied_for_each_device() -> None:
    """A module in a dict, a dataclass or a list (twice: one copy) runs on each device as
    a copy; the caller's module keeps its parameters, values and device."""
    model, x = nn.Linear(3, 2), torch.randn(4, 3)
    parameters = list(model.parameters())
    values = [p.detach().clone() for p in parameters]
    devices = ["cpu", "meta", *map(str, devicectx.available_devices()[1:])]

    def twice(models: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
        assert models[0] is models[1]
        out: torch.Tensor = models[0](x)
        return out

    assert_device_agnostic(lambda d: d["m"](d["x"]), {"m": model, "x": x}, devices=devices)
    assert_device_agnostic(lambda b: b.model(b.x), Batch(model, x), devices=devices)
    assert_device_agnostic(twice, [model, model], x, devices=devices)
    assert all(p is q for p, q in zip(parameters, model.parameters(), strict=True))
    assert all(torch.equal(p, v) for p, v in zip(parameters, values, strict=True))
    assert {torch.device("cpu")} == {p.device for p in model.parameters()}


# dtypes=: inputs of a dtype a device cannot hold (float64 on MPS).


def scale(x: torch.Tensor) -> torch.Tensor:
    """A device-agnostic function of one tensor."""
    return x * 2


@pytest.mark.requires_device("accelerator")
def test_a_dtype_the_device_cannot_hold_is_refused_with_a_fix_that_works() -> None:
    """A float64 input for a device without float64 is refused before fn runs, naming
    assert_device_agnostic, the path and a fix; the fix (dtypes="device") passes."""
    x = torch.ones(3, dtype=torch.float64)
    with mps_like() as device:
        with pytest.raises(devicectx.DtypeUnsupportedError) as raised:
            assert_device_agnostic(scale, x, devices=["cpu", device])
        assert [
            f"assert_device_agnostic(scale) cannot move a tensor to {device}, which holds no "
            "torch.float64:",
            "    torch.float64 <- x",
            'fix: assert_device_agnostic(scale, ..., dtypes="device"), which casts '
            f"torch.float64 to torch.float32 on each device that holds no torch.float64 "
            f"(here {device}), or leave {device} out: devices=['cpu', 'meta'] "
            f"({LEAVE_OUT_META})",
        ] == str(raised.value).splitlines()
        assert_device_agnostic(scale, x, devices=["cpu", "meta"])
        assert_device_agnostic(scale, x, devices=["cpu", device], dtypes="device")
        assert_device_agnostic(scale, x, devices=[device, "cpu"], dtypes="device")
        decorated = devicectx.device_agnostic(dtypes="device")(scale)
        assert_device_agnostic(decorated, x, devices=["cpu", device], dtypes="device")


@pytest.mark.requires_device("accelerator")
def test_float64_inputs_of_a_float32_model_get_the_mapping_as_their_fix() -> None:
    """A float32 model fed numpy's float64 on a device without float64: the fix is the
    mapping, which casts on every device and passes; ``dtypes="device"`` keeps the CPU's
    inputs float64, which the model refuses there (torch's "mat1 and mat2 must have the
    same dtype"), and is no longer offered first."""
    net = nn.Linear(4, 2)
    s = torch.from_numpy(np.random.default_rng(0).random((8, 4)))

    def value_loss(net: nn.Linear, s: torch.Tensor) -> torch.Tensor:
        return net(s).pow(2).mean()

    with mps_like() as device:
        with pytest.raises(devicectx.DtypeUnsupportedError) as raised:
            assert_device_agnostic(value_loss, net, s, devices=["cpu", device])
        assert (
            "fix: assert_device_agnostic(value_loss, ..., dtypes={torch.float64: "
            "torch.float32}), which casts torch.float64 to torch.float32 on every device, as "
            'net (torch.float32) needs; dtypes="device" keeps them torch.float64 on the '
            f"devices that hold it, where net refuses them; or leave {device} out: "
            f"devices=['cpu', 'meta'] ({LEAVE_OUT_META})"
        ) == str(raised.value).splitlines()[-1]
        mapping = {torch.float64: torch.float32}
        assert_device_agnostic(value_loss, net, s, devices=["cpu", device], dtypes=mapping)
        with pytest.raises(RuntimeError, match="same dtype"):
            assert_device_agnostic(value_loss, net, s, devices=["cpu", device], dtypes="device")


class _ClassWeights(nn.Module):
    """A loss whose class weights come from numpy: float64 unless made float32."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.register_buffer("w", torch.as_tensor(np.array([1.0, 2.0, 0.5]), dtype=dtype))

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits, y, weight=self.w.float())


@pytest.mark.requires_device("accelerator")
def test_a_modules_own_float64_buffer_gets_the_code_fix_first() -> None:
    """A module's own buffer of a dtype the device cannot hold fails the module's own move
    there (model.to("mps") on a Mac): the fix is to make it in a dtype the device holds,
    which passes, not dtypes="device", which would cast the check's copies only. A float64
    input beside it still gets dtypes="device"."""
    logits, y = torch.randn(5, 3), torch.tensor([0, 1, 2, 1, 0])
    made = (
        "(torch.as_tensor(array, dtype=torch.float32), or .to(torch.float32) before "
        "register_buffer)"
    )
    with mps_like() as device:
        with pytest.raises(devicectx.DtypeUnsupportedError) as raised:
            assert_device_agnostic(_ClassWeights(), logits, y, devices=["cpu", device])
        assert [
            f"assert_device_agnostic(_ClassWeights) cannot move a tensor to {device}, which "
            "holds no torch.float64:",
            "    torch.float64 <- self.w",
            f"fix: make self.w in a dtype {device} holds (torch.float32 for torch.float64) "
            f"where the module makes it {made}: moving the module to {device} fails for it "
            'too, which dtypes="device" would hide, as it casts the check\'s copies only; or '
            f"leave {device} out: devices=['cpu', 'meta'] ({LEAVE_OUT_META})",
        ] == str(raised.value).splitlines()
        with pytest.raises(TypeError, match="float64"):
            _ClassWeights().to(device)
        assert_device_agnostic(_ClassWeights(torch.float32), logits, y, devices=["cpu", device])
        with pytest.raises(devicectx.DtypeUnsupportedError) as raised:
            assert_device_agnostic(_ClassWeights(), logits.double(), y, devices=["cpu", device])
        assert (
            str(raised.value)
            .splitlines()[-1]
            .endswith(
                "; and for the other inputs: assert_device_agnostic(_ClassWeights, ..., "
                'dtypes="device"), which casts torch.float64 to torch.float32 on each device that '
                f"holds no torch.float64 (here {device}), or leave {device} out: devices=['cpu', "
                f"'meta'] ({LEAVE_OUT_META})"
            )
        )


@pytest.fixture
def float64_by_default() -> Iterator[None]:
    """torch's default dtype float64 in the test, as scientific code sets it."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@pytest.mark.requires_device("accelerator")
@pytest.mark.usefixtures("float64_by_default")
def test_a_default_dtype_the_device_cannot_hold_is_named_for_an_operator() -> None:
    """``ids * 0.5`` makes torch's default dtype; on a device without it torch says only
    "unsupported operand type(s)" (MPS too): the message names the dtype, and its fix (the
    default dtype one the device holds) passes."""

    def half(ids: torch.Tensor) -> torch.Tensor:
        return ids * 0.5

    with mps_like() as device:
        with pytest.raises(AssertionError) as raised:
            assert_device_agnostic(half, torch.arange(4), devices=["cpu", device])
        assert [
            f"half is not device-agnostic: it raised on {device}, not on cpu:",
            "    TypeError: unsupported operand type(s) for *: 'Tensor' and 'float'",
            f"  {device} holds no torch.float64, torch's default dtype here, which an op of a "
            "tensor and a Python float makes (ids * 0.5)",
            f"fix: keep torch's default dtype one {device} holds where half runs there "
            f"(torch.set_default_dtype(torch.float32)), or leave {device} out: devices=['cpu', "
            f"'meta'] ({LEAVE_OUT_META})",
        ] == message_lines(raised)
        torch.set_default_dtype(torch.float32)
        assert_device_agnostic(half, torch.arange(4), devices=["cpu", device])


@pytest.mark.requires_device("accelerator")
def test_the_dtype_fix_leaves_out_every_device_without_the_dtype() -> None:
    """With two devices that hold no float64, the fix leaves both out (not the first alone,
    which fails the same way on the second) and says dtypes="device" casts on both;
    followed either way, it passes."""
    x = torch.ones(3, dtype=torch.float64)
    with mps_like() as first:
        second = accelerator(1)
        with pytest.raises(devicectx.DtypeUnsupportedError) as raised:
            assert_device_agnostic(scale, x, devices=["cpu", first, second])
        assert (
            'fix: assert_device_agnostic(scale, ..., dtypes="device"), which casts '
            "torch.float64 to torch.float32 on each device that holds no torch.float64 "
            f"(here {first}, {second}), or leave {first} and {second} out: "
            f"devices=['cpu', 'meta'] ({LEAVE_OUT_META})"
        ) == str(raised.value).splitlines()[-1]
        assert_device_agnostic(scale, x, devices=["cpu", "meta"])
        assert_device_agnostic(scale, x, devices=["cpu", first, second], dtypes="device")
        with pytest.raises(devicectx.DtypeUnsupportedError) as raised:
            assert_device_agnostic(scale, x, devices=["cpu", "meta", first, second])
        assert str(raised.value).endswith(
            f"or leave {first} and {second} out: devices=['cpu', 'meta']"
        )


def numpy_output(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """An output made over a float64 numpy array's memory."""
    return {"y": x * 2, "w": torch.from_numpy(np.linspace(0, 1, 3))}


@pytest.mark.requires_device("accelerator")
def test_an_output_over_float64_numpy_memory_gets_a_fix_every_device_takes() -> None:
    """The numpy fix, torch.as_tensor(array, device=x.device), names a dtype where a
    device holds no float64 (as_tensor of a float64 array fails there); followed, it
    passes."""
    with mps_like() as device:
        with pytest.raises(AssertionError) as raised:
            assert_device_agnostic(numpy_output, torch.ones(3), devices=["cpu", device])
        assert (
            "fix: out['w'] is made over a numpy array's memory (torch.from_numpy, "
            "torch.as_tensor of an array), which neither on_device nor @device_agnostic "
            "reaches: make it on the input's device, in a dtype every device holds "
            f"({device} holds no torch.float64), torch.as_tensor(array, "
            "dtype=torch.float32, device=x.device)"
        ) == message_lines(raised)[-1]

        def fixed(x: torch.Tensor) -> dict[str, torch.Tensor]:
            array = np.linspace(0, 1, 3)
            return {"y": x * 2, "w": torch.as_tensor(array, dtype=torch.float32, device=x.device)}

        assert_device_agnostic(fixed, torch.ones(3), devices=["cpu", device])


def doubled(x: torch.Tensor) -> torch.Tensor:
    """Computes in float64, which a device playing MPS cannot hold."""
    return (x.double() ** 2).sum().float()


@pytest.mark.requires_device("accelerator")
def test_a_float64_made_inside_fn_is_named_as_a_dtype_the_device_lacks() -> None:
    """fn making float64 itself (.double()) on a device without it: the message says the
    device holds no float64, and the fix (compute in float32) passes where followed."""
    with mps_like() as device:
        with pytest.raises(AssertionError) as raised:
            assert_device_agnostic(doubled, torch.ones(3), devices=["cpu", device])
        lines = message_lines(raised)
        assert lines[1].startswith("    TypeError: Cannot convert a emu Tensor to float64 dtype")
        assert [
            f"  {device} holds no torch.float64, which doubled makes there",
            f"fix: make doubled compute in a dtype {device} holds, torch.float32 for "
            "torch.float64 (x.float(), not x.double(); dtype=torch.float32 in the "
            "constructors, torch.as_tensor(array, dtype=torch.float32, device=x.device) for a "
            f"numpy array), or leave {device} out: devices=['cpu', 'meta'] "
            f"({LEAVE_OUT_META})",
        ] == lines[2:]
        assert_device_agnostic(
            lambda x: (x.float() ** 2).sum().float(), torch.ones(3), devices=["cpu", device]
        )
        # The device's gap on the first device too, not torch's raw TypeError.
        with pytest.raises(AssertionError) as raised:
            assert_device_agnostic(doubled, torch.ones(3), devices=[device, "cpu"])
        assert (
            f"  {device} holds no torch.float64, which doubled makes there"
            == (message_lines(raised)[2])
        )


@pytest.mark.requires_device("accelerator")
def test_dtypes_device_compares_within_the_narrower_dtype() -> None:
    """With dtypes="device", float32 on the device stands for float64 on the CPU, within
    float32's tolerance; a larger difference is still caught; a float64 module argument's
    copy is cast, the caller's module is not."""
    model = nn.Linear(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.float64)

    def off(x: torch.Tensor) -> torch.Tensor:
        return x + 1e-3 if x.device.type == "emu" else x

    with mps_like() as device:
        assert_device_agnostic(model, x, devices=["cpu", device], dtypes="device")
        with pytest.raises(AssertionError) as raised:
            assert_device_agnostic(off, x[0], devices=["cpu", device], dtypes="device")
    assert f"  on {device}, compared with cpu:" == message_lines(raised)[1]
    assert "rtol=1.3e-06, atol=1e-05" == message_lines(raised)[2].rpartition("%), ")[2]
    assert {(torch.float64, torch.device("cpu"))} == {
        (p.dtype, p.device) for p in model.parameters()
    }


def test_a_dtype_mapping_casts_on_every_device() -> None:
    """dtypes= as a mapping casts the inputs on every device, the reference included."""
    seen: list[tuple[torch.device, torch.dtype]] = []

    def record(x: torch.Tensor) -> torch.Tensor:
        seen.append((x.device, x.dtype))
        return x

    x = torch.ones(2, dtype=torch.float64)
    assert_device_agnostic(record, x, devices=CPU_META, dtypes={torch.float64: torch.float32})
    assert [(torch.device(d), torch.float32) for d in CPU_META] == seen


# Optimizers and LR schedulers passed with their model: copied with it, for each device.

OPTIMIZERS: dict[str, Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda parameters: torch.optim.SGD(parameters, lr=0.5, momentum=0.9),
    "adam": lambda parameters: torch.optim.Adam(parameters, lr=0.1),
}


def train_step(
    model: nn.Linear, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> dict[str, torch.Tensor]:
    """One training step: the loss, and the weight it trained."""
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    torch.autograd.backward(loss)
    optimizer.step()
    return {"loss": loss.detach(), "weight": model.weight.detach().clone()}


def trained(
    optimizer: str,
) -> tuple[nn.Linear, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    """A model, its optimizer after one step (so it has state: momentum, Adam's moments),
    and a batch."""
    generator = torch.Generator().manual_seed(0)
    model = nn.Linear(3, 1)
    made = OPTIMIZERS[optimizer](model.parameters())
    x, y = torch.randn(8, 3, generator=generator), torch.randn(8, 1, generator=generator)
    train_step(model, made, x, y)
    return model, made, x, y


def same_values(a: object, b: object) -> bool:
    """Whether two structures of tensors and plain values hold the same values."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_an_optimizer_passed_with_its_model_trains_each_devices_copy(optimizer: str) -> None:
    """The optimizer's copy for each device steps that device's copy of the model, from
    the caller's state, as the step called directly does; the caller's model and
    optimizer are left as they were."""
    model, made, x, y = trained(optimizer)
    before = copy.deepcopy((model.state_dict(), made.state_dict()))
    weights: list[torch.Tensor] = []

    def step(
        model: nn.Linear, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        out = train_step(model, optimizer, x, y)
        if not x.is_meta:
            weights.append(out["weight"].cpu())
        return out

    devices = ["cpu", "meta", *map(str, devicectx.available_devices()[1:])]
    assert_device_agnostic(step, model, made, x, y, devices=devices)
    assert same_values(before, (model.state_dict(), made.state_dict()))
    expected = train_step(model, made, x, y)["weight"]
    assert not torch.equal(before[0]["weight"], expected)
    assert len(devices) - 1 == len(weights)
    assert all(torch.allclose(weight, expected) for weight in weights)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_step_that_trains_differently_is_caught(optimizer: str) -> None:
    """A step whose update differs between runs, its loss alike, is caught by the weight
    it trains: the optimizer's copy really steps."""
    model, made, x, y = trained(optimizer)
    calls = itertools.count()

    def step(
        model: nn.Linear, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        torch.autograd.backward(loss + next(calls) * model.weight.sum())  # on one run only
        optimizer.step()
        return {"loss": loss.detach(), "weight": model.weight.detach().clone()}

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(step, model, made, x, y, devices=["cpu", "cpu"])
    assert message_lines(raised)[2].startswith("    out['weight']: ")


@pytest.mark.requires_device("accelerator")
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_step_that_trains_differently_on_the_accelerator_is_caught(optimizer: str) -> None:
    """A step with a bug on the accelerator only is caught there, by the weight it trains;
    the correct step passes."""
    device = accelerator()
    model, made, x, y = trained(optimizer)

    def step(
        model: nn.Linear, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if x.device.type != "cpu":
            loss = loss + model.weight.sum()  # the bug: a term on the accelerator only
        torch.autograd.backward(loss)
        optimizer.step()
        return {"weight": model.weight.detach().clone()}

    assert_device_agnostic(train_step, model, made, x, y, devices=["cpu", device])
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(step, model, made, x, y, devices=["cpu", device])
    assert f"  on {device}, compared with cpu:" == message_lines(raised)[1]
    assert message_lines(raised)[2].startswith("    out['weight']: ")


def loss_step(
    model: nn.Linear, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """One training step that returns its loss alone, computed before the step."""
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    torch.autograd.backward(loss)
    optimizer.step()
    return loss.detach()


class Doubled(torch.autograd.Function):
    """Twice its input; the backward, given ``off``, gives zero gradients off the CPU (a
    backward with a bug on one device)."""

    off = False

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        return a * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * (0 if Doubled.off and grad.device.type != "cpu" else 2)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_step_that_returns_its_loss_alone_is_checked_by_the_model_it_trained(
    optimizer: str,
) -> None:
    """A step whose update differs between runs, its loss alike, is caught though it
    returns the loss alone: each run's copy of the model is compared after the call, by
    path (a parameter by its gradient); the correct step passes."""
    model, made, x, y = trained(optimizer)
    assert_device_agnostic(loss_step, model, made, x, y, devices=["cpu", "meta"])
    calls = itertools.count()

    def step(
        model: nn.Linear, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        torch.autograd.backward(loss + next(calls) * model.weight.sum())  # on one run only
        optimizer.step()
        return loss.detach()

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(step, model, made, x, y, devices=["cpu", "cpu"])
    lines = message_lines(raised)
    assert [
        "step is not device-agnostic (ran on cpu, cpu):",
        "  its outputs agree; what it left in the modules it was given (each parameter's "
        "gradient, or the parameter where it has none, and the buffers):",
        "  on cpu, compared with cpu:",
    ] == lines[:3]
    reported = [line.split(":")[0].strip() for line in lines if line.startswith("    model")]
    # The weights it stepped are not compared, their gradients are; the extra term reaches
    # the weight's alone.
    assert ["model.weight.grad"] == reported


def test_weights_an_optimizer_stepped_are_compared_by_their_gradients() -> None:
    """Where a parameter has a gradient, the gradient is compared, not the weight stepped
    from it: Adam's first step moves a weight by about lr * sign(grad), so gradients that
    agree within any tolerance (rounding noise around zero, another sign on each device)
    step the weight apart; the check passes."""
    model = nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    signs = iter([1.0, -1.0])
    stepped: list[torch.Tensor] = []

    def step(model: nn.Linear, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
        optimizer.zero_grad()
        model(x).sum().backward()
        assert model.bias.grad is not None
        model.bias.grad.fill_(next(signs) * 1e-9)  # a bias a BatchNorm cancels: noise
        optimizer.step()
        stepped.append(model.bias.detach().clone())

    assert_device_agnostic(step, model, optimizer, x, devices=["cpu", "cpu"])
    assert not torch.allclose(stepped[0], stepped[1], atol=1e-3)


def test_gradients_the_call_leaves_are_compared_where_nothing_steps() -> None:
    """A call that only computes gradients (backward, no step) is checked by them: a
    gradient on one run only, or of other values, is reported at its path."""
    model = nn.Linear(3, 1)
    x = torch.randn(4, 3)
    calls = itertools.count()

    def backward_once(model: nn.Linear, x: torch.Tensor) -> None:
        if next(calls) == 1:
            model(x).sum().backward()

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(backward_once, model, x, devices=["cpu", "cpu"])
    assert "    model.weight.grad: " in str(raised.value)
    assert model.weight.grad is None  # the caller's model is not the one that ran


@pytest.mark.requires_device("accelerator")
def test_a_backward_wrong_on_the_accelerator_is_caught_by_the_gradients() -> None:
    """A training step whose backward gives zero gradients on the accelerator only, its
    loss alike on every device, fails the check with those gradients; with the backward
    right, it passes."""
    device = accelerator()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(8, 4)

    def step(model: nn.Linear, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = Doubled.apply(model(x)).pow(2).mean()
        loss.backward()
        optimizer.step()
        return loss.detach()

    assert_device_agnostic(step, model, optimizer, x, devices=["cpu", device])
    Doubled.off = True
    try:
        with pytest.raises(AssertionError) as raised:
            assert_device_agnostic(step, model, optimizer, x, devices=["cpu", device])
    finally:
        Doubled.off = False
    lines = message_lines(raised)
    assert f"  on {device}, compared with cpu:" == lines[2]
    reported = [line.split(":")[0].strip() for line in lines if line.startswith("    model")]
    assert ["model.weight.grad", "model.bias.grad"] == reported


def test_a_module_met_twice_is_compared_once_at_its_first_path() -> None:
    """A submodule passed beside its model (or a weight two modules share) is compared
    once, at the path it is first met at."""
    model = nn.Sequential(nn.Linear(2, 2))
    calls = itertools.count()

    def step(model: nn.Sequential, head: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            head.weight.add_(next(calls))  # on the second run only
        return x

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(step, model, model[0], torch.ones(2), devices=["cpu", "cpu"])
    reported = [
        line.split(":")[0].strip() for line in message_lines(raised) if line.startswith("    ")
    ]
    assert ["model.0.weight"] == [path for path in reported if "weight" in path]


def test_a_weight_two_module_arguments_share_stays_tied_in_each_runs_copies() -> None:
    """Two modules passed apart that share a weight (an embedding and a head) stay tied in
    each run's copies, on meta and on a backend out of tree too (whose module.to unties
    them): a step that trains the one weight runs alike everywhere, and what it left is
    compared once, at the embedding's path."""
    embed = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = embed.weight
    tokens = torch.tensor([0, 1, 2, 3, 4])

    def step(embed: nn.Embedding, head: nn.Linear, tokens: torch.Tensor) -> dict[str, object]:
        loss = nn.functional.cross_entropy(head(embed(tokens[:-1])), tokens[1:])
        loss.backward()
        return {"loss": loss.detach(), "tied": head.weight is embed.weight}

    devices = ["cpu", "meta", *map(str, devicectx.available_devices()[1:])]
    assert_device_agnostic(step, embed, head, tokens, devices=devices)
    calls = itertools.count()

    def drifting_step(
        embed: nn.Embedding, head: nn.Linear, tokens: torch.Tensor
    ) -> dict[str, object]:
        loss = nn.functional.cross_entropy(head(embed(tokens[:-1])), tokens[1:])
        (loss + next(calls) * head.weight.sum()).backward()  # on the second run only
        return {"loss": loss.detach(), "tied": head.weight is embed.weight}

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(drifting_step, embed, head, tokens, devices=["cpu", "cpu"])
    reported = [line.split(":")[0].strip() for line in message_lines(raised)[3:]]
    assert ["embed.weight.grad"] == [path for path in reported if path.endswith(".grad")]


class TiedLanguageModel(nn.Module):
    """An embedding whose weight is the output head's too, as language models tie them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def language_model_step(
    model: TiedLanguageModel, optimizer: torch.optim.Optimizer, tokens: torch.Tensor
) -> dict[str, torch.Tensor]:
    """One step of next-token training: the loss and both ends of the tied weight."""
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(tokens[:-1]), tokens[1:])
    torch.autograd.backward(loss)
    optimizer.step()
    return {
        "loss": loss.detach(),
        "embed": model.embed.weight.detach().clone(),
        "head": model.head.weight.detach().clone(),
    }


@pytest.mark.requires_device("accelerator")
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_tied_weights_train_as_one_on_each_devices_copy(optimizer: str) -> None:
    """A model with tied weights keeps them tied in its copy for the accelerator (torch's
    module.to unties them on a device registered out of tree), so the step trains the one
    weight as on the CPU: the runs agree, and both ends of the tie are equal in each."""
    torch.manual_seed(0)
    model = TiedLanguageModel()
    made = OPTIMIZERS[optimizer](model.parameters())
    tokens = torch.tensor([0, 3, 1, 4, 2, 0])
    outputs: list[dict[str, torch.Tensor]] = []

    def step(
        model: TiedLanguageModel, optimizer: torch.optim.Optimizer, tokens: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        out = language_model_step(model, optimizer, tokens)
        outputs.append(out)
        return out

    assert_device_agnostic(step, model, made, tokens, devices=["cpu", accelerator()])
    assert all(torch.equal(out["embed"], out["head"]) for out in outputs)


def test_an_lr_scheduler_steps_the_copied_optimizer() -> None:
    """A scheduler passed with its optimizer steps each device's copy of that optimizer,
    which it holds; the copy's step keeps the scheduler's tracking (no warning), and the
    caller's learning rate stays."""
    model, made, x, y = trained("sgd")
    scheduler = torch.optim.lr_scheduler.StepLR(made, step_size=1, gamma=0.5)
    rates: list[float] = []

    def step(
        model: nn.Linear,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        x: torch.Tensor,
        y: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        assert scheduler.optimizer is optimizer
        out = train_step(model, optimizer, x, y)
        scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
        return out

    devices = ["cpu", "meta", *map(str, devicectx.available_devices()[1:])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_device_agnostic(step, model, made, scheduler, x, y, devices=devices)
    assert [0.25] * len(devices) == rates
    assert 0.5 == made.param_groups[0]["lr"]


def test_an_optimizer_without_its_model_is_refused_with_a_fix_that_works() -> None:
    """An optimizer whose model is not in the call (a closure's) is refused before fn
    runs: its copy would train a copy nobody reads. The optimizer built inside fn passes."""
    model, made, x, y = trained("sgd")

    def step(optimizer: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        out: torch.Tensor = model(x)
        return out

    with pytest.raises(TypeError) as raised:
        assert_device_agnostic(step, made, x, devices=CPU_META)
    assert [
        "assert_device_agnostic(step): optimizer (an SGD) holds parameters of no module "
        "given to step: each device's run gets a copy of each module and of the SGD, and "
        "the copy would train parameters that step never reads",
        "fix: pass the model too, assert_device_agnostic(step, model, optimizer, ...), or "
        "build the SGD inside step, from the model it is given",
    ] == str(raised.value).splitlines()

    def step_inside(model: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return train_step(model, torch.optim.SGD(model.parameters(), lr=0.5), x, y)["weight"]

    assert_device_agnostic(step_inside, model, x, y, devices=CPU_META)


def test_each_run_draws_from_the_callers_generator_in_its_state() -> None:
    """A generator argument is copied for each run, in the caller's state: noise drawn on
    the CPU and moved is the same on every device (a check of the same device twice too),
    one generator passed twice stays one, and the caller's is not advanced."""
    drawn: list[list[torch.Tensor]] = []

    def noisy(x: torch.Tensor, first: torch.Generator, second: torch.Generator) -> torch.Tensor:
        draws = [torch.randn(x.shape, generator=g) for g in (first, second)]
        drawn.append(draws)
        return x + sum(draws).to(x.device)  # type: ignore[union-attr]

    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    devices = ["cpu", *_accelerators()[:1], "cpu"]
    assert_device_agnostic(noisy, torch.ones(3), generator, generator, devices=devices)
    assert torch.equal(state, generator.get_state())
    expected = [torch.randn(3, generator=generator) for _ in range(2)]
    assert not torch.equal(expected[0], expected[1])
    for draws in drawn:
        assert all(torch.equal(a, b) for a, b in zip(draws, expected, strict=True))


# In-place writes: each run writes into inputs of its own, never the caller's.


def test_each_run_writes_into_inputs_of_its_own() -> None:
    """fn writing into its input: each run, on one device listed twice too, starts from
    the caller's values, which stay as they were."""

    def normalize_(x: torch.Tensor) -> torch.Tensor:
        x.sub_(x.mean()).div_(2)
        return x.clone()

    def normalize_and_return_it(x: torch.Tensor) -> torch.Tensor:
        normalize_(x)
        return x

    x = torch.tensor([1.0, 2.0, 3.0, 6.0])
    assert_device_agnostic(normalize_, x, devices=["cpu", "cpu", "meta"])
    seen: list[torch.Tensor] = []
    assert_device_agnostic(
        lambda x: seen.append(normalize_and_return_it(x).clone()), x, devices=["cpu", "cpu"]
    )
    assert torch.equal(torch.tensor([1.0, 2.0, 3.0, 6.0]), x)
    assert all(torch.equal(torch.tensor([-1.0, -0.5, 0.0, 1.5]), t) for t in seen)


def test_inputs_on_the_device_are_copied_as_the_move_copies_them() -> None:
    """On its own device, a view stays a view of the tensor it is a view of (in either
    order), a parameter stays a parameter (a leaf), and a module's parameter passed beside
    it is the module copy's, as on another device; the caller's tensors stay as they were."""
    x, weight = torch.zeros(2, 3), nn.Parameter(torch.ones(2))
    model = nn.Linear(2, 2)
    seen: list[tuple[object, ...]] = []

    def write(row: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        row.add_(1)
        if not whole.is_meta:
            seen.append((float(whole.sum()),))
        return whole * 1

    def kinds(m: nn.Linear, w: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        seen.append((w is m.weight, isinstance(p, nn.Parameter), p.is_leaf))
        with torch.no_grad():
            p.add_(1)
        return p * 1

    assert_device_agnostic(write, x[0], x, devices=["cpu", "cpu", "meta"])
    assert_device_agnostic(lambda whole, row: write(row, whole), x, x[1], devices=["cpu", "cpu"])
    assert_device_agnostic(kinds, model, model.weight, weight, devices=["cpu", "meta", "cpu"])
    assert [(3.0,)] * 4 + [(True, True, True)] * 3 == seen
    assert torch.equal(torch.zeros(2, 3), x)
    assert torch.equal(torch.ones(2), weight)


def write_everywhere(batch: object) -> object:
    """Add 1 in place through every tensor of ``batch`` that takes it; the sum of what each
    then holds (order-free: a set's order follows ids), or 0.0 where there is none."""
    for _, tensor in iter_tensors(batch):
        if tensor.dtype == torch.bool or tensor.requires_grad:
            continue
        with contextlib.suppress(RuntimeError):  # an expanded view takes no in-place write
            tensor.add_(1)
    # In float32 (complex64): a device playing MPS holds no float64.
    sums = (
        (t.to(torch.complex64) if t.is_complex() else t.float()).sum()
        for _, t in iter_tensors(batch)
    )
    return sum(sums, 0.0)


@given(batch=strategies.nested())
def test_in_place_writes_reach_neither_the_caller_nor_another_run(batch: object) -> None:
    """Whatever the structure (a tensor at several places, views before or after their
    base, without it), runs on one device write into copies of their own, alike, and the
    caller's tensors keep their values."""
    before = [(tensor, tensor.clone()) for _, tensor in iter_tensors(batch)]
    assert_device_agnostic(write_everywhere, batch, devices=["cpu", "cpu", "meta"])
    assert all(torch.equal(t.nan_to_num(), kept.nan_to_num()) for t, kept in before)


@pytest.mark.requires_device("accelerator")
@given(batch=strategies.nested())
def test_in_place_writes_on_the_inputs_device_match_the_moves_copies(batch: object) -> None:
    """The copies of the inputs on their own device share memory as the move's copies on
    the accelerator do: in-place writes through every alias give the same sums (float64
    cast where the device holds none)."""
    devices = ["cpu", accelerator(), "cpu"]
    assert_device_agnostic(write_everywhere, batch, devices=devices, dtypes="device")


# Failures on a device: the tensor made without device=, and what the fix says.


class Cached(nn.Module):
    """A module that makes a mask on its first call, without device=, and keeps it."""

    def __init__(self) -> None:
        super().__init__()
        self.mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mask is None:
            self.mask = torch.ones(x.shape[-1])
        return x * self.mask


class CachedDecorated(Cached):
    """``Cached`` with the printed fix followed: its forward decorated."""

    @devicectx.device_agnostic
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class CachedOnTheDevice(Cached):
    """``Cached`` with the other printed fix followed: the mask made with device=."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mask is None:
            self.mask = torch.ones(x.shape[-1], device=x.device)
        return x * self.mask


def test_a_tensor_made_in_the_call_and_kept_is_blamed_on_its_making() -> None:
    """A tensor made without device= and kept in an attribute is named as made during the
    call, with the fix for the making (no buffer: the attribute held none before); both
    fixes it prints pass."""
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(Cached(), torch.ones(2, 3), devices=CPU_META)
    assert [
        "Cached is not device-agnostic: it raised on meta, not on cpu:",
        "    RuntimeError: Tensor on device cpu is not on the expected device meta!",
        "  tensors Cached made during the call, kept off meta:",
        "    cpu <- self.mask (in Cached)",
        "fix: make the tensors Cached creates on its inputs' device, torch.zeros(n, "
        "device=x.device), and move none to cpu (a tensor made without device= is on cpu, "
        "as is one moved there: .cpu(), .to('cpu')), or decorate Cached.forward with "
        "@devicectx.device_agnostic so that those made without device= land there",
    ] == message_lines(raised)
    assert_device_agnostic(CachedDecorated(), torch.ones(2, 3), devices=CPU_META)
    assert_device_agnostic(CachedOnTheDevice(), torch.ones(2, 3), devices=CPU_META)


class Stray(nn.Module):
    """A user's module that makes a tensor without device=, inside a library's wrapper."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.ones(x.shape[-1])


class StrayDecorated(Stray):
    """``Stray`` with the printed fix followed: its forward decorated."""

    @devicectx.device_agnostic
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def test_a_tensor_made_in_a_wrapped_module_is_blamed_on_that_module() -> None:
    """The op that met the stray tensor is in a module the wrapper calls: the fix names
    that module's forward, not the wrapper's (nn.Sequential's, torch's own code)."""
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(nn.Sequential(Stray()), torch.ones(2, 3), devices=CPU_META)
    assert message_lines(raised)[-1] == (
        "fix: make the tensors Stray.forward creates on its inputs' device, torch.zeros(n, "
        "device=x.device), and move none to cpu (a tensor made without device= is on cpu, "
        "as is one moved there: .cpu(), .to('cpu')), or decorate Stray.forward with "
        "@devicectx.device_agnostic so that those made without device= land there"
    )
    assert_device_agnostic(nn.Sequential(StrayDecorated()), torch.ones(2, 3), devices=CPU_META)


class OnesIn(torch.autograd.Function):
    """Its input times ones its forward makes without ``device=``."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        return a * torch.ones(a.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class OnesOut(torch.autograd.Function):
    """Its input; its backward multiplies the gradient by ones made without ``device=``."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        return a.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * torch.ones(grad.shape)


class OnesInSetUp(torch.autograd.Function):
    """``OnesIn`` in the ``setup_context`` form: its forward takes no ctx."""

    @staticmethod
    def forward(a: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return a * torch.ones(a.shape)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


@pytest.mark.parametrize(
    ("function", "part"),
    [(OnesIn, "forward"), (OnesInSetUp, "forward"), (OnesOut, "backward")],
    ids=["forward", "forward without ctx", "backward"],
)
def test_a_tensor_made_in_an_autograd_function_is_blamed_on_it_without_the_decorator(
    function: type[torch.autograd.Function], part: str
) -> None:
    """A tensor made without device= in an autograd.Function's forward or backward names
    that method, and the fix offers no decorator: backward runs outside any block, and a
    decorated forward's moves break its gradients."""

    def train(model: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        loss = function.apply(model(x)).sum()
        loss.backward()
        return loss.detach()

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(train, nn.Linear(3, 3), torch.ones(2, 3), devices=CPU_META)
    assert message_lines(raised)[-1] == (
        f"fix: make the tensors {function.__name__}.{part} creates on its inputs' device, "
        f"torch.zeros(n, device=x.device), and move none to cpu (a tensor made without "
        f"device= is on cpu, as is one moved there: .cpu(), .to('cpu'))"
    )


def test_code_in_a_package_named_after_torch_is_the_callers_not_torchs() -> None:
    """A frame in ``torch_geometric`` (beside torch, its name starting as torch's) is code
    fn calls, named in the fix, not skipped as torch's own."""
    import os

    from devicectx.testing import _assertions

    beside = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "torch_like", "x.py")
    scope: dict[str, object] = {}
    exec(compile("def conv(x):\n    raise RuntimeError('stray')\n", beside, "exec"), scope)
    with pytest.raises(RuntimeError) as raised:
        scope["conv"](1)  # type: ignore[operator]
    assert "conv" == _assertions._failed_in(raised.value)


def test_a_tensor_made_without_device_gets_the_fix_for_it_on_any_device() -> None:
    """torch's device mismatch from a tensor made without device= names that cause and
    its fix, on a later device and on the first one (meta first) alike; the decorated
    function passes."""

    def shifted(x: torch.Tensor) -> torch.Tensor:
        return x + torch.zeros(x.shape)

    fix = (
        "fix: make the tensors shifted creates on its inputs' device, torch.zeros(n, "
        "device=x.device), and move none to cpu (a tensor made without device= is on cpu, "
        "as is one moved there: .cpu(), .to('cpu')), or decorate shifted with "
        "@devicectx.device_agnostic so that those made without device= land there"
    )
    for devices, where in [(CPU_META, "on meta, not on cpu"), (["meta", "cpu"], "on meta")]:
        with pytest.raises(AssertionError) as raised:
            assert_device_agnostic(shifted, torch.ones(2), devices=devices)
        assert [
            f"shifted is not device-agnostic: it raised {where}:",
            "    RuntimeError: Tensor on device cpu is not on the expected device meta!",
            fix,
        ] == message_lines(raised)
        assert isinstance(raised.value.__cause__, RuntimeError)
    assert_device_agnostic(devicectx.device_agnostic(shifted), torch.ones(2), devices=CPU_META)


class ToCpu(nn.Module):
    """A module that moves a tensor to the CPU mid-forward, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.body(x)).to("cpu"))
        return out


class ToCpuDecorated(ToCpu):
    """``ToCpu`` with its forward decorated, which moves nothing made by an op."""

    @devicectx.device_agnostic
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class ToCpuFixed(ToCpu):
    """``ToCpu`` with the printed fix followed: nothing moved to the CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.body(x)))
        return out


@pytest.mark.requires_device("accelerator")
def test_a_tensor_moved_to_the_cpu_is_no_tensor_made_without_device() -> None:
    """A tensor moved to the CPU by name fails as one made without device=: the fix names
    both; where fn's forward is decorated already, the decorator is not offered again;
    the fix followed passes."""
    devices = ["cpu", accelerator()]
    lines = {}
    for model in (ToCpu(), ToCpuDecorated()):
        with pytest.raises(AssertionError) as raised:
            assert_device_agnostic(model, torch.ones(2, 4), devices=devices)
        lines[type(model).__name__] = message_lines(raised)[-1]
    assert {
        "ToCpu": "fix: make the tensors ToCpu creates on its inputs' device, torch.zeros(n, "
        "device=x.device), and move none to cpu (a tensor made without device= is on cpu, as "
        "is one moved there: .cpu(), .to('cpu')), or decorate ToCpu.forward with "
        "@devicectx.device_agnostic so that those made without device= land there",
        # Its own @device_agnostic's error, quoted: the stray tensor came from the body.
        "ToCpuDecorated": "    fix: make it on the inputs' device in the body, torch.zeros(n, "
        "device=x.device), and move none to cpu by name; torch.as_tensor(array), which the "
        "scope puts on the target, for a numpy array (torch.from_numpy stays on cpu); pass a "
        "global or closure's tensor as an argument",
    } == lines
    assert_device_agnostic(ToCpuFixed(), torch.ones(2, 4), devices=devices)


class _NumpyOffset(nn.Module):
    """Adds an offset made over numpy's memory: on the CPU, whatever the scope."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ones(3, dtype=np.float32)) + self.linear(x)


class _NumpyOffsetDecorated(_NumpyOffset):
    forward = devicectx.device_agnostic(_NumpyOffset.forward)


class _NumpyOffsetFixed(_NumpyOffset):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(np.ones(3, dtype=np.float32), device=x.device) + self.linear(x)


def test_a_numpy_tensor_inside_a_decorated_forward_gets_the_as_tensor_fix() -> None:
    """The first fix (the decorator) does not reach numpy's memory: decorated, the module
    gets the fix that does, which passes."""
    devices = ["cpu", _accelerators()[0] if _accelerators() else "meta"]
    for model in (_NumpyOffset(), _NumpyOffsetDecorated()):
        with pytest.raises(AssertionError) as raised:
            assert_device_agnostic(model, torch.ones(2, 4), devices=devices)
        decorated = isinstance(model, _NumpyOffsetDecorated)
        # Decorated, @device_agnostic's own error gives the fix.
        fixed_for_numpy = "torch.from_numpy stays on cpu" in message_lines(raised)[-1]
        assert fixed_for_numpy is decorated
    assert_device_agnostic(_NumpyOffsetFixed(), torch.ones(2, 4), devices=devices)


class _StoredDevice(nn.Module):
    """Keeps the device it was built for, as much code does."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.head = nn.Sequential(nn.Linear(4, 3))
        self.head[0].device = torch.device(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x) + torch.zeros(3, device=self.device)


class _StoredDeviceDecorated(_StoredDevice):
    forward = devicectx.device_agnostic(_StoredDevice.forward)


class _StoredDeviceFixed(_StoredDevice):
    @devicectx.device_agnostic
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x) + torch.zeros(3, device=x.device)


def test_a_device_stored_in_a_module_is_named_with_its_fix() -> None:
    """``self.device`` set when the module was built stays after model.to(): the message
    names each such attribute (a submodule's too) and the fix, which passes."""
    devices = ["cpu", _accelerators()[0] if _accelerators() else "meta"]
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(_StoredDevice(), torch.ones(2, 4), devices=devices)
    assert [
        "  devices stored in the call's objects, which may have put it there:",
        "    cpu <- self.device",
        "    cpu <- self.head[0].device",
        "fix: read the device where the tensors are made, from the inputs (device=x.device) "
        "or the module's parameters (next(self.parameters()).device), not self.device: "
        "model.to() moves a module's tensors, not a device it stored when it was built",
    ] == message_lines(raised)[2:]
    with pytest.raises(AssertionError) as raised:  # @device_agnostic's error says it
        assert_device_agnostic(_StoredDeviceDecorated(), torch.ones(2, 4), devices=devices)
    assert "        cpu <- self.device, self.head[0].device" in message_lines(raised)
    assert message_lines(raised)[-1].startswith(
        "    fix: read the device where the tensors are made, from the inputs (device=x.device)"
    )
    assert_device_agnostic(_StoredDeviceFixed(), torch.ones(2, 4), devices=devices)


@pytest.mark.requires_device("accelerator")
def test_a_device_named_by_its_type_alone_is_told_on_another_index() -> None:
    """``device=x.device.type`` lands on the current device, not the inputs' (a second
    GPU): the message says so, not that a tensor is on the CPU; the fix passes."""
    if len(_accelerators()) < 2:
        pytest.skip("needs two accelerator devices")
    second = _accelerators()[1]

    def add_bias(x: torch.Tensor) -> torch.Tensor:
        return x + torch.zeros(x.shape[-1], device=x.device.type)

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(add_bias, torch.ones(2, 3), devices=["cpu", second])
    current = torch.device(torch.device(second).type, torch.accelerator.current_device_index())
    assert (
        f"fix: add_bias makes a tensor on {current}, and runs on {second}: a device named by "
        f'its type alone (device=x.device.type, "{current.type}") is the current one, not the '
        "inputs': use the inputs' device itself, torch.zeros(n, device=x.device)"
    ) == message_lines(raised)[-1]
    assert_device_agnostic(
        lambda x: x + torch.zeros(3, device=x.device), torch.ones(2, 3), devices=["cpu", second]
    )


def test_an_output_off_the_device_of_a_decorated_function_offers_no_decorator() -> None:
    """A decorated function whose output is off the device gets the fixes that are left,
    not the decorator it has; the fix followed passes."""

    @devicectx.device_agnostic
    def counts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, torch.tensor([1.0, 2.0], device="cpu")

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(counts, torch.ones(2), devices=CPU_META)
    assert (
        "fix: create new tensors on the input's device, torch.zeros(n, device=x.device), and "
        "move none to cpu by name (.cpu(), .to('cpu'))"
    ) == message_lines(raised)[-1]
    assert_device_agnostic(
        lambda x: (x * 2, torch.tensor([1.0, 2.0], device=x.device)),
        torch.ones(2),
        devices=CPU_META,
    )


SAMPLES = [np.zeros(3, dtype=np.float32), np.ones(3, dtype=np.float32)]


def numpy_collate(samples: list[np.ndarray]) -> torch.Tensor:
    """A collate function on numpy's memory, as most are."""
    return torch.from_numpy(np.stack(samples))


def test_a_collate_on_numpys_memory_gets_a_fix_that_works() -> None:
    """Outputs made over numpy's memory (torch.from_numpy), which neither on_device nor the
    decorator reaches: the fix is torch.as_tensor(array, device=...), with a device=
    parameter where fn takes no tensor; followed, it passes."""
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(numpy_collate, SAMPLES, devices=CPU_META)
    assert [
        "numpy_collate is not device-agnostic (ran on cpu, meta):",
        "  on meta, compared with cpu:",
        "    out: on cpu, expected meta",
        "fix: out is made over a numpy array's memory (torch.from_numpy, torch.as_tensor of "
        "an array), which neither on_device nor @device_agnostic reaches, and numpy_collate "
        "got no tensor argument: give it a device= parameter and make it there, "
        "torch.as_tensor(array, device=device), then assert_device_agnostic(lambda like, "
        "*a: numpy_collate(*a, device=like.device), torch.empty(0), ...)",
    ] == message_lines(raised)

    def fixed(samples: list[np.ndarray], device: torch.device | None = None) -> torch.Tensor:
        return torch.as_tensor(np.stack(samples), device=device)

    assert_device_agnostic(
        lambda like, *a: fixed(*a, device=like.device), torch.empty(0), SAMPLES, devices=CPU_META
    )


def test_numpys_memory_in_a_block_gets_the_fix_that_works() -> None:
    """The block fix followed for a numpy collate (it does not reach from_numpy) gets the
    fix that works, not the decorator; followed, it passes."""

    def run(like: torch.Tensor, samples: list[np.ndarray]) -> torch.Tensor:
        with devicectx.on_device(like.device):
            return numpy_collate(samples)

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(run, torch.empty(0), SAMPLES, devices=CPU_META)
    assert (
        "fix: out is made over a numpy array's memory (torch.from_numpy, torch.as_tensor of "
        "an array), which neither on_device nor @device_agnostic reaches: make it on the "
        "input's device, torch.as_tensor(array, device=x.device)"
    ) == message_lines(raised)[-1]

    def fixed(like: torch.Tensor, samples: list[np.ndarray]) -> torch.Tensor:
        return torch.as_tensor(np.stack(samples), device=like.device)

    assert_device_agnostic(fixed, torch.empty(0), SAMPLES, devices=CPU_META)


@pytest.mark.requires_device("accelerator")
def test_a_tensor_held_outside_the_arguments_gets_the_fix_for_it() -> None:
    """A tensor on another device than the default, held by a closure, makes the run on
    the default device fail: the fix says to pass it, which passes."""
    bias = torch.ones(2, device=accelerator())

    def shifted(x: torch.Tensor) -> torch.Tensor:
        return x + bias

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(shifted, torch.ones(2), devices=["cpu", accelerator()])
    assert (
        "fix: pass shifted each tensor it uses as an argument (one in a global or a closure "
        "is not moved), or create it on its inputs' device, torch.zeros(n, device=x.device)"
    ) == message_lines(raised)[-1]
    assert_device_agnostic(
        lambda x, bias: x + bias, torch.ones(2), bias, devices=["cpu", accelerator()]
    )


def collate(rows: list[list[int]], device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Rows of ids to a padded batch and their lengths: no tensor argument."""
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, device=device)
    return {"ids": ids, "lengths": torch.tensor([len(row) for row in rows], device=device)}


@attrs.define
class AttrsBatch:
    """An attrs class holding a tensor: the move does not look into it."""

    x: torch.Tensor


def batch_doubled(batch: AttrsBatch) -> torch.Tensor:
    return batch.x * 2


def test_tensors_only_where_the_move_cannot_see_are_named_not_called_no_tensor_argument() -> None:
    """fn's tensors are all in an object the move cannot see into (an attrs class): the
    failure names them with the fix that teaches the walk the type (it said fn "got no
    tensor argument"), and that fix, followed, passes."""
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(batch_doubled, AttrsBatch(torch.ones(3)), devices=CPU_META)
    fix = message_lines(raised)[-1]
    assert fix.startswith(
        "fix: batch_doubled got its tensors only where the move to each device cannot see them, "
        "batch.x (in AttrsBatch), so that none reached the device: import copy; from "
        "devicectx import register_container; register_container(AttrsBatch, "
    )
    calls = fix.removeprefix("fix: ").partition("device: ")[2].partition(", pass ")[0]
    exec(calls, {"AttrsBatch": AttrsBatch})
    try:
        assert_device_agnostic(batch_doubled, AttrsBatch(torch.ones(3)), devices=CPU_META)
    finally:
        devicectx.unregister_container(AttrsBatch)


def test_a_function_without_tensor_arguments_gets_a_fix_that_works() -> None:
    """Outputs off the device of fn without tensor arguments: the fix does not point at an
    input's device, which there is not, and both ways it prints pass."""
    rows = [[1, 2], [3]]
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(collate, rows, devices=CPU_META)
    assert [
        "collate is not device-agnostic (ran on cpu, meta):",
        "  on meta, compared with cpu:",
        "    out['ids']: on cpu, expected meta",
        "    out['lengths']: on cpu, expected meta",
        "fix: collate got no tensor argument, so nothing it is given is on each run's "
        "device: give it one whose device it takes, assert_device_agnostic(lambda like, *a: "
        "collate(*a, device=like.device), torch.empty(0), ...) with a device= parameter in "
        "collate; or run it in a block on that device: def run(like, *a): with "
        "devicectx.on_device(like.device): return collate(*a)",
    ] == message_lines(raised)

    def run(like: torch.Tensor, *a: Any) -> dict[str, torch.Tensor]:
        with devicectx.on_device(like.device):
            return collate(*a)

    devices = ["cpu", "meta", *map(str, devicectx.available_devices()[1:])]

    def printed(like: torch.Tensor, *a: Any) -> object:  # the printed lambda, as a def
        return collate(*a, device=like.device)  # type: ignore[misc]  # *a holds the rows only

    assert_device_agnostic(printed, torch.empty(0), rows, devices=devices)
    assert_device_agnostic(run, torch.empty(0), rows, devices=devices)


@pytest.mark.skipif(torch.cuda.is_available(), reason=".cuda() works on a machine with CUDA")
def test_cuda_asked_for_by_name_gets_a_fix() -> None:
    """``.cuda()`` on a machine without CUDA fails the first run with torch's own error
    (an AssertionError, from a CPU build): reported as not device-agnostic, with the fix,
    which passes."""
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(lambda x: x.cuda() * 2, torch.ones(2), devices=CPU_META)
    lines = message_lines(raised)  # torch's words: a CPU build's, or a CUDA build's
    assert "<lambda> is not device-agnostic: it raised on cpu:" == lines[0]
    assert (
        'fix: <lambda> asks for CUDA by name (.cuda(), device="cuda"), and runs on cpu here: '
        "use its inputs' device instead, t.to(x.device), torch.zeros(n, device=x.device)"
    ) == lines[-1]
    assert_device_agnostic(lambda x, y: y.to(x.device) * 2, torch.ones(2), torch.ones(2))


def test_a_partial_is_named_for_its_function() -> None:
    """fn given as a functools.partial is named for the function it calls."""
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(functools.partial(drifting()), torch.ones(2, 2), devices=["cpu"] * 2)
    assert "drift is not device-agnostic (ran on cpu, cpu):" == message_lines(raised)[0]


# Errors of the move to a device: a fix for this kit, arguments named as fn names them.


class Stubborn:
    """An object with a .to of its own that fails."""

    def __init__(self, offset: torch.Tensor | None = None) -> None:
        self.offset = torch.ones(1) if offset is None else offset

    def to(self, device: torch.device) -> Stubborn:
        raise ValueError("not movable")


def test_an_argument_the_move_cannot_move_gets_a_fix_for_the_kit() -> None:
    """A move that fails names the argument by fn's parameter, and its fix is the kit's
    (no @device_agnostic option), and passes where followed."""

    def shift(x: torch.Tensor, box: Stubborn) -> torch.Tensor:
        return x + box.offset

    with pytest.raises(devicectx.MoveError) as raised:
        assert_device_agnostic(shift, torch.ones(1), Stubborn(), devices=CPU_META)
    assert [
        "assert_device_agnostic(shift) could not move box (a Stubborn) to cpu:",
        "    ValueError: not movable",
        "fix: make it inside shift rather than pass it, or leave cpu out: devices=['meta']",
    ] == str(raised.value).splitlines()
    assert_device_agnostic(
        lambda x, offset: shift(x, Stubborn(offset)), torch.ones(1), torch.ones(1), devices=CPU_META
    )


@pytest.mark.requires_device("accelerator")
def test_out_of_memory_in_the_move_gets_a_fix_for_the_kit() -> None:
    """Out of memory while moving the inputs names the argument by forward's parameter,
    and its fix is the kit's (smaller inputs, or leave the device out); both pass."""
    from devicectx.testing import emulated

    device = accelerator()
    if device.type != "emu":
        pytest.skip("a memory limit is the emulated device's (--devicectx-accelerator)")
    model = nn.Linear(64, 64)
    with emulated.configure(memory_limit=64 * 1024):
        with pytest.raises(devicectx.MoveOutOfMemoryError) as raised:
            assert_device_agnostic(model, torch.randn(512, 64), devices=["cpu", device])
        lines = str(raised.value).splitlines()
        assert [
            "assert_device_agnostic(Linear) could not move input (a Tensor of shape (512, 64), "
            f"torch.float32, on cpu) to {device}:",
            f"fix: give Linear smaller inputs (a smaller batch, a smaller model) that fit on "
            f"{device}, or leave {device} out: devices=['cpu', 'meta'] ({LEAVE_OUT_META})",
        ] == [lines[0], lines[-1]]
        assert isinstance(raised.value, torch.OutOfMemoryError)
        assert_device_agnostic(model, torch.randn(8, 64), devices=["cpu", device])
        assert_device_agnostic(model, torch.randn(512, 64), devices=["cpu", "meta"])


# Values that differ: the fix suggests tolerances only for float rounding, never those in use.


def scaled_per_call(step: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function whose output grows by ``step`` (relative) at each call."""
    calls = itertools.count()

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * (1 + step * next(calls))

    return scaled


@pytest.mark.parametrize(
    ("step", "given", "suggested", "written"),
    [
        (1e-5, (None, None), (1e-4, 1e-5), "rtol=1e-4, atol=1e-5"),
        (5e-4, (1e-4, 1e-5), (1e-3, 1e-4), "rtol=1e-3, atol=1e-4"),
        (5e-3, (1e-3, 1e-5), (1e-2, 1e-3), "rtol=1e-2, atol=1e-3"),
    ],
)
def test_rounding_gets_looser_tolerances_that_work(
    step: float,
    given: tuple[float | None, float | None],
    suggested: tuple[float, float],
    written: str,
) -> None:
    """A difference within float rounding gets the smallest looser tolerances that allow
    it, never those in use; they pass."""
    x = torch.linspace(1, 2, 6)
    rtol, atol = given
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(
            scaled_per_call(step), x, devices=["cpu", "cpu"], rtol=rtol, atol=atol
        )
    assert (
        "fix: if the difference is expected (float sums in another order, TF32), allow it: "
        f"assert_device_agnostic(scaled, ..., {written})"
    ) == message_lines(raised)[-1]
    rtol, atol = suggested
    assert_device_agnostic(scaled_per_call(step), x, devices=["cpu", "cpu"], rtol=rtol, atol=atol)


def test_a_number_within_rounding_gets_tolerances_too() -> None:
    """A float in the output (``loss.item()``) within rounding gets the tolerances too."""
    calls = itertools.count()

    def loss(x: torch.Tensor) -> float:
        return float(x.sum()) * (1 + 1e-5 * next(calls))

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(loss, torch.ones(3), devices=["cpu", "cpu"])
    assert message_lines(raised)[-1].endswith(
        "assert_device_agnostic(loss, ..., rtol=1e-4, atol=1e-5)"
    )


class Dropping(nn.Module):
    """A linear layer and dropout: random in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.drop(self.linear(x))
        return out


def test_dropout_in_training_mode_gets_eval_as_its_fix() -> None:
    """A module in training mode with dropout (as fn, or an argument) differs beyond any
    tolerance: the fix is .eval(), which passes, not tolerances."""
    x = torch.randn(16, 8)

    def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(x)
        return out

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(Dropping(), x, devices=["cpu", "cpu"], rtol=1e-4, atol=1e-5)
    assert (
        "fix: Dropping is in training mode, where its submodule 'drop' (a Dropout) zeroes "
        "other values on "
        "each device: call .eval() on it before the check (assert_device_agnostic("
        "model.eval(), ...)), and draw no other random numbers in Dropping"
    ) == message_lines(raised)[-1]
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(forward, Dropping(), x, devices=["cpu", "cpu"])
    assert (
        "fix: model is in training mode, where its submodule 'drop' (a Dropout) zeroes "
        "other values on "
        "each device: call .eval() on it before the check (pass model.eval()), and draw no "
        "other random numbers in forward"
    ) == message_lines(raised)[-1]
    assert_device_agnostic(Dropping().eval(), x, devices=["cpu", "cpu"])
    assert_device_agnostic(forward, Dropping().eval(), x, devices=["cpu", "cpu"])


def test_dropout_in_a_sequential_is_named_as_its_submodule() -> None:
    """The dropout of an nn.Sequential, whose children are named by number, is named as
    a submodule, not as a number."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(model, torch.randn(16, 8), devices=["cpu", "cpu"])
    assert (
        "fix: Sequential is in training mode, where its submodule '1' (a Dropout) zeroes "
        "other values on each device: call .eval() on it before the check "
        "(assert_device_agnostic(model.eval(), ...)), and draw no other random numbers in "
        "Sequential"
    ) == message_lines(raised)[-1]


# Outputs of other types: numpy arrays, sizes and dtypes compared; generators refused.


def test_numpy_arrays_sizes_and_dtypes_in_the_output_are_compared() -> None:
    """Numpy arrays are compared as tensors (dtype, shape, values; numbers only), numpy
    bools exactly, a torch.Size and a torch.dtype by equality; a torch.device is not (it
    names the device by nature)."""
    calls = itertools.count()

    def predict(x: torch.Tensor) -> dict[str, object]:
        n = next(calls)
        return {
            "shape": torch.Size([2 + n]),
            "dtype": torch.float16 if n else torch.float32,
            "cast": np.zeros(2, dtype=np.float64 if n else np.float32),
            "rows": np.zeros((n + 1, 2)),
            "flag": np.bool_(n),
            "probs": (x + n).numpy(),
            "ids": np.arange(3) + n,
            "names": np.array([str(x.device), str(n)]),
            "where": torch.device("cpu", n),
        }

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(predict, torch.ones(2), devices=["cpu", "cpu"])
    assert [
        "predict is not device-agnostic (ran on cpu, cpu):",
        "  on cpu, compared with cpu:",
        "    out['shape']: torch.Size([3]), expected torch.Size([2])",
        "    out['dtype']: torch.float16, expected torch.float32",
        "    out['cast']: dtype float64, expected float32",
        "    out['rows']: shape (2, 2), expected (1, 2)",
        "    out['flag']: np.True_, expected np.False_, bools compared exactly",
        "    out['probs']: 2 of 2 values differ (100.0%), rtol=1.3e-06, atol=1e-05",
        "      max abs diff 1 at index (0,)",
        "      max rel diff 1 at index (0,)",
        "    out['ids']: 3 of 3 values differ (100.0%), torch.int64 compared exactly",
        "      max abs diff 1 at index (0,)",
        "      max rel diff inf at index (0,)",
    ] == message_lines(raised)[:13]
    calls = itertools.count()

    def steady(x: torch.Tensor) -> dict[str, object]:
        out = predict(x)
        return {**out, "where": out["where"], "names": out["names"]}

    assert_device_agnostic(
        lambda x: {k: v for k, v in steady(x).items() if k in {"where", "names"}},
        torch.ones(2),
        devices=["cpu", "cpu"],
    )
    assert_device_agnostic(
        lambda x: (x.numpy() * 2, torch.Size(x.shape), x.dtype, np.bool_(True)),
        torch.ones(2),
        devices=["cpu", "cpu"],
    )


def test_a_generator_in_the_output_is_refused_with_a_fix_that_works() -> None:
    """A generator cannot be compared without running it: refused, with the fix (a
    list), which passes."""

    def rows(x: torch.Tensor) -> Iterator[torch.Tensor]:
        return (row * 2 for row in x)

    with pytest.raises(TypeError) as raised:
        assert_device_agnostic(rows, torch.ones(2, 2), devices=CPU_META)
    assert [
        "assert_device_agnostic(rows): out is a generator, which cannot be compared without "
        "running it (it may never end, or be meant to run once)",
        "fix: return a list in its place, or compare one: assert_device_agnostic(lambda *a: "
        "list(rows(*a)), ...)",
    ] == str(raised.value).splitlines()
    assert_device_agnostic(lambda *a: list(rows(*a)), torch.ones(2, 2), devices=CPU_META)


def test_an_iterator_inside_the_output_gets_the_fix_for_its_place() -> None:
    """list() around the call is the fix only for an iterator that is the whole output:
    around a dict that holds one, it would compare the dict's keys and pass a wrong output.
    The fix given, a list in its place, lets the check find the output's own bug."""

    def rows(x: torch.Tensor) -> dict[str, object]:
        return {"y": torch.zeros(2), "rows": iter(list(x))}

    def listed(x: torch.Tensor) -> dict[str, object]:
        return {"y": torch.zeros(2), "rows": list(x)}

    with pytest.raises(TypeError) as raised:
        assert_device_agnostic(rows, torch.ones(2, 2), devices=CPU_META)
    assert [
        "assert_device_agnostic(rows): out['rows'] is a list_iterator, which cannot be "
        "compared without running it (it may never end, or be meant to run once)",
        "fix: return a list in its place (list(...) where rows builds out['rows'])",
    ] == str(raised.value).splitlines()
    with pytest.raises(AssertionError, match=r"out\['y'\]: on cpu, expected meta"):
        assert_device_agnostic(listed, torch.ones(2, 2), devices=CPU_META)


@pytest.mark.parametrize(
    ("make", "call"),
    [(lambda: lambda x: (row for row in x), "fn"), (lambda: _Rows(), "model")],
    ids=["lambda", "module"],
)
def test_an_iterator_output_of_a_callable_without_a_name_gets_code_that_runs(
    make: Callable[[], Callable[[torch.Tensor], Iterator[torch.Tensor]]], call: str
) -> None:
    """A lambda, or a module, has no name to call it by in the fix's code: the fix calls
    ``fn`` (or ``model``), which, bound to it, runs."""
    fn = make()
    model = fn
    with pytest.raises(TypeError) as raised:
        assert_device_agnostic(fn, torch.ones(2, 2), devices=CPU_META)
    fix = str(raised.value).splitlines()[-1]
    assert fix.endswith(f"or compare one: assert_device_agnostic(lambda *a: list({call}(*a)), ...)")
    code = fix.rpartition("or compare one: ")[2].replace(
        "...", "torch.ones(2, 2), devices=CPU_META"
    )
    namespace = {"fn": fn, "model": model, "torch": torch, "CPU_META": CPU_META}
    exec(code, {"assert_device_agnostic": assert_device_agnostic, **namespace})


class _Rows(nn.Module):
    def forward(self, x: torch.Tensor) -> Iterator[torch.Tensor]:
        return (row * 2 for row in x)


def test_a_strategy_for_devices_gets_a_fix() -> None:
    """devices= given a hypothesis strategy raises our TypeError, saying to draw it."""
    with pytest.raises(TypeError) as raised:
        assert_device_agnostic(agnostic, torch.ones(1), devices=strategies.devices())  # type: ignore[arg-type]
    lines = str(raised.value).splitlines()
    assert lines[0].endswith(
        "devices takes a list of devices, not a hypothesis strategy: the test draws from it, "
        "the assertion does not"
    )
    assert (
        "fix: draw one in the test, @given(device=strategy) and devices=['cpu', device] (or "
        "data.draw(strategy) with @given(data=st.data())), or take the plugin's device "
        "fixture: def test_x(device): ... devices=['cpu', device]"
    ) == lines[1]


@given(device=strategies.devices(allow_meta=True))
def test_a_drawn_device_passes(device: torch.device) -> None:
    """The fix for a strategy: the device drawn in the test, then given in a list."""
    assert_device_agnostic(agnostic, torch.ones(2, 3), devices=["cpu", device])


# Nested and sparse outputs: nested tensors compared by their components, a ragged
# dimension by its lengths; values a device cannot copy to the CPU named, not compared.


def nested_of(parts: Sequence[torch.Tensor], layout: torch.layout) -> torch.Tensor:
    """A nested tensor of ``parts``: ``layout`` torch.jagged, or torch.strided."""
    return torch.nested.nested_tensor(list(parts), layout=layout)


NESTED_LAYOUTS = pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=str)


@NESTED_LAYOUTS
def test_a_nested_output_passes_where_its_components_agree(layout: torch.layout) -> None:
    """A nested tensor made in the call (a new ragged symbol, j1 then j2, on each run) or
    computed from one passes where its components agree, in a set too."""
    x = torch.randn(5, 3)

    def made(t: torch.Tensor) -> torch.Tensor:
        return nested_of([t[:2], t[2:]], layout)

    assert_device_agnostic(made, x, devices=["cpu", "cpu"])
    assert_device_agnostic(lambda t: {made(t), t}, x, devices=["cpu", "cpu"])
    assert_device_agnostic(lambda n: n * 2, made(x), devices=["cpu", "cpu"])


def test_a_jagged_output_on_meta_is_compared_by_what_meta_knows() -> None:
    """On meta, which holds no lengths, a jagged output's other dimensions are compared."""
    x = torch.randn(5, 3)
    made = functools.partial(nested_of, layout=torch.jagged)
    assert_device_agnostic(lambda t: made([t[:2], t[2:]]), x, devices=CPU_META)
    assert_device_agnostic(lambda n: n * 2, made([x[:2], x[2:]]), devices=CPU_META)
    calls = itertools.count()

    def wider(t: torch.Tensor) -> torch.Tensor:
        return made([t[:2], t[2:]]) if next(calls) == 0 else made([t[:2, :2], t[2:, :2]])

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(wider, x, devices=CPU_META)
    assert ["    out: nested shape (2, j, 2), expected (2, j, 3)"] == message_lines(raised)[2:3]


@NESTED_LAYOUTS
def test_a_nested_component_that_differs_is_named(layout: torch.layout) -> None:
    """Values or lengths that differ are named by component, ``out.unbind()[i]``; a dense
    tensor where a nested one was, of the same dimensions, is named too."""
    x = torch.arange(1.0, 16.0).reshape(5, 3)
    calls = itertools.count()

    def shifted(t: torch.Tensor) -> torch.Tensor:
        return nested_of([t[:2], t[2:] + next(calls)], layout)

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(shifted, x, devices=["cpu", "cpu"])
    assert [
        "shifted is not device-agnostic (ran on cpu, cpu):",
        "  on cpu, compared with cpu:",
        "    out.unbind()[1]: 9 of 9 values differ (100.0%), rtol=1.3e-06, atol=1e-05",
        "      max abs diff 1 at index (0, 0)",
        "      max rel diff 0.142857 at index (0, 0)",
    ] == message_lines(raised)[:5]
    calls = itertools.count()

    def moved_cut(t: torch.Tensor) -> torch.Tensor:
        cut = 2 + next(calls)
        return nested_of([t[:cut], t[cut:]], layout)

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(moved_cut, x, devices=["cpu", "cpu"])
    assert [
        "moved_cut is not device-agnostic (ran on cpu, cpu):",
        "  on cpu, compared with cpu:",
        "    out.unbind()[0]: shape (3, 3), expected (2, 3)",
        "    out.unbind()[1]: shape (2, 3), expected (3, 3)",
        "fix: make moved_cut return the same containers and tensors, dtypes, shapes and "
        "layouts on every device",
    ] == message_lines(raised)
    calls = itertools.count()

    def sometimes_nested(t: torch.Tensor) -> torch.Tensor:
        parts = [t[:2], t[2:4]]
        return torch.stack(parts) if next(calls) else nested_of(parts, layout)

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(sometimes_nested, x, devices=["cpu", "cpu"])
    assert (
        "    out: shape (2, 2, 3), expected nested shape (2, 2, 3)"
        if layout == torch.strided
        else "    out: shape (2, 2, 3), expected nested shape (2, j, 3)"
    ) == message_lines(raised)[2]


@pytest.mark.parametrize(
    ("second", "layout"),
    [
        ("cpu", torch.jagged),
        ("cpu", torch.strided),
        pytest.param("accelerator", torch.jagged, marks=pytest.mark.requires_device("accelerator")),
    ],
    ids=["cpu-jagged", "cpu-strided", "accelerator-jagged"],
)
@given(
    lengths=st.lists(st.integers(0, 4), min_size=1, max_size=5).filter(any),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_nested_outputs_of_any_lengths_pass_and_a_changed_component_is_named(
    second: str, layout: torch.layout, lengths: list[int], seed: int, data: st.DataObject
) -> None:
    """Over components of random lengths (empty ones too): equal outputs pass on cpu and
    the second device; a component changed on the second run only fails, named by its
    path, with every value of it counted."""
    device = accelerator() if second == "accelerator" else torch.device("cpu")
    values = torch.randn(sum(lengths), 3, generator=torch.Generator().manual_seed(seed))

    def split(v: torch.Tensor) -> torch.Tensor:
        return nested_of(v.split(lengths), layout)

    assert_device_agnostic(split, values, devices=["cpu", device])
    index = data.draw(st.sampled_from([i for i, n in enumerate(lengths) if n]))
    calls = itertools.count()

    def changed(v: torch.Tensor) -> torch.Tensor:
        parts = list(v.split(lengths))
        if next(calls):
            parts[index] = parts[index] + 1
        return nested_of(parts, layout)

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(changed, values, devices=["cpu", device])
    count = 3 * lengths[index]
    assert (
        f"    out.unbind()[{index}]: {count} of {count} values differ (100.0%), "
        "rtol=1.3e-06, atol=1e-05"
    ) == message_lines(raised)[2]


def test_sparse_outputs_on_meta_are_compared_by_their_structure() -> None:
    """A sparse COO input and output on cpu and meta: structure compared, values not."""
    coo = torch.eye(3).to_sparse()
    assert_device_agnostic(lambda s: (s.coalesce(), s + s), coo, devices=CPU_META)


def emulated_device() -> torch.device:
    """The emulated accelerator, whose copies of sparse compressed and strided nested
    tensors to the CPU fail; the test skips on a real accelerator, which copies them."""
    device = accelerator()
    if device.type != "emu":
        pytest.skip("only the emulated accelerator cannot copy these layouts to the CPU")
    return device


@pytest.mark.requires_device("accelerator")
def test_values_a_device_cannot_copy_back_are_named_with_a_fix_that_works() -> None:
    """Outputs the emulated accelerator cannot copy to the CPU (sparse CSR, a strided
    nested tensor), alone or in a set: the check fails saying which were not compared and
    why, not with torch's raw error; among values that differ, they are named as well; the
    fix it prints (a jagged tensor, a dense one) passes."""
    device = emulated_device()
    eye = torch.eye(3)
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(lambda x: (x * 2).to_sparse_csr(), eye, devices=["cpu", device])
    lines = message_lines(raised)
    assert [f"<lambda> could not be checked (ran on cpu, {device}):"] == lines[:1]
    assert lines[2].startswith(
        f"    out: not compared: {device} cannot copy this sparse_csr tensor to the CPU "
        "(RuntimeError: "
    )
    assert [
        "fix: compare out on a device that can copy it to the CPU (the emulated accelerator "
        "has no kernels for sparse compressed or strided nested tensors), or make <lambda> "
        "return it in a layout that device copies: dense, or a nested tensor of "
        "layout=torch.jagged"
    ] == lines[3:]
    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(lambda x: {(x * 2).to_sparse_csr()}, eye, devices=["cpu", device])
    assert message_lines(raised)[2].startswith(f"    list(out)[0]: not compared: {device} ")

    def parts(x: torch.Tensor) -> dict[str, torch.Tensor]:
        made = nested_of([x[:1], x[1:]], torch.strided)
        return {"nested": made, "device": x.new_tensor(float(x.device.type == "cpu"))}

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(parts, eye, devices=["cpu", device])
    lines = message_lines(raised)
    assert [f"parts is not device-agnostic (ran on cpu, {device}):"] == lines[:1]
    assert lines[2].startswith(
        f"    out['nested']: not compared: {device} cannot copy this strided nested tensor "
        "to the CPU (NotImplementedError: "
    )
    assert "    out['device']: 1 of 1 values differ (100.0%), rtol=1.3e-06, atol=1e-05" in lines
    assert lines[-1].startswith("fix: compare out['nested'] on a device that can copy it")
    assert_device_agnostic(
        lambda x: nested_of([x[:1], x[1:]], torch.jagged), eye, devices=["cpu", device]
    )
    assert_device_agnostic(lambda x: x * 2, eye, devices=["cpu", device])


def test_a_move_to_meta_that_fails_is_not_fixed_by_listing_meta_again() -> None:
    """An input meta cannot take (a strided nested tensor): the fix leaves meta out of
    the devices, rather than list it again, and passes where followed."""
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(devicectx.MoveError) as raised:
        assert_device_agnostic(lambda n: n * 2, nested, devices=CPU_META)
    assert str(raised.value).splitlines()[-1].endswith(f", or {instead_of_meta()}")
    cuda = [device for device in _accelerators() if device.startswith("cuda")]
    if cuda:  # the emulated accelerator has no nested-tensor kernels
        assert_device_agnostic(lambda n: n * 2, nested, devices=["cpu", cuda[0]])


def _moving_the_original(model: nn.Module) -> Callable[..., Any]:
    """A ``.to`` set on the instance that calls the original's, as accelerate's
    ``dispatch_model`` sets one: a function, which a deep copy keeps as it is."""
    original = model.to

    def to(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    return to


def test_a_copy_moves_with_its_own_to_not_the_one_its_instance_held() -> None:
    """A model whose instance holds a ``.to`` bound to itself: the kit's copies move with
    the class's own, and the caller's model stays where it was."""
    model = nn.Linear(2, 2)
    model.to = _moving_the_original(model)  # type: ignore[method-assign]
    assert_device_agnostic(lambda m, x: m(x), model, torch.ones(2), devices=["cpu", "meta"])
    assert {torch.device("cpu")} == {p.device for p in model.parameters()}


def test_a_model_accelerate_placed_is_refused_and_left_as_it_was() -> None:
    """accelerate's hooks run each part where they say, which a copy moved to each device
    would not follow: the model is refused before anything is copied, with the fix, and
    the caller's model is unchanged."""
    accelerate = pytest.importorskip("accelerate")
    model = accelerate.cpu_offload(
        nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), execution_device="cpu"
    )
    before = devicectx.find_devices(model, name="model")
    with pytest.raises(TypeError) as raised:
        assert_device_agnostic(lambda m, x: m(x), model, torch.ones(2), devices=["cpu", "meta"])
    lines = str(raised.value).splitlines()
    assert lines[0].startswith(
        "assert_device_agnostic cannot run the Sequential on each device: accelerate placed it"
    )
    assert lines[-1] == (
        "fix: check the model as built, before accelerate places it "
        "(assert_device_agnostic(fn, model, ...) before dispatch_model(model, ...))"
    )
    assert before == devicectx.find_devices(model, name="model")


def test_an_inference_tensor_on_the_runs_device_fails_the_check_there_with_the_fix() -> None:
    """A batch made under ``torch.inference_mode()`` reaches a training step as made where
    it is on the run's device already (torch then refuses to save it for backward), and as
    a normal tensor where the move copies it: the check's copy on that device stays an
    inference tensor, as the caller's does, so the check fails there (not only the caller's
    CPU run), naming the tensor and the fix, which then passes."""
    with torch.inference_mode():
        features = torch.randn(3, 4)

    @devicectx.device_agnostic
    def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = model(batch["features"]).pow(2).sum()
        loss.backward()
        return loss.detach()

    with pytest.raises(AssertionError) as caught:
        devicectx.testing.assert_device_agnostic(
            step, nn.Linear(4, 2), {"features": features}, devices=["meta", "cpu"]
        )
    lines = str(caught.value).splitlines()
    assert "step is not device-agnostic: it raised on cpu, not on meta:" == lines[0]
    assert "Inference tensors cannot be saved for backward" in lines[1]
    assert lines[2].startswith(
        "  batch['features']: made under torch.inference_mode() and on cpu already"
    )
    assert (
        "fix: make batch['features'] under torch.no_grad() instead of torch.inference_mode(), "
        "or pass batch['features'].clone() (outside inference mode, a normal tensor)"
    ) == lines[-1]
    assert features.is_inference()  # the caller's tensor as it was
    devicectx.testing.assert_device_agnostic(
        step, nn.Linear(4, 2), {"features": features.clone()}, devices=["meta", "cpu"]
    )


TABLE = np.ones(3, dtype=np.float32)


def test_the_numpy_fix_reads_the_device_of_an_input_the_function_has() -> None:
    """An RL policy ``act(net, obs)`` given a numpy ``obs`` has no tensor input: the numpy
    fix reads the device from the module (``next(net.parameters()).device``), as written
    it passes; with a tensor input, from that input by its name."""

    def act(net: nn.Linear, obs: np.ndarray) -> torch.Tensor:
        return net(torch.from_numpy(obs))

    obs = np.ones(3, dtype=np.float32)
    with pytest.raises(AssertionError) as caught:
        devicectx.testing.assert_device_agnostic(act, nn.Linear(3, 2), obs, devices=["cpu", "meta"])
    assert (
        str(caught.value)
        .splitlines()[-1]
        .endswith(
            "torch.as_tensor(array, device=next(net.parameters()).device) makes it on its inputs' "
            "device"
        )
    )

    def fixed(net: nn.Linear, obs: np.ndarray) -> torch.Tensor:
        return net(torch.as_tensor(obs, device=next(net.parameters()).device))

    devicectx.testing.assert_device_agnostic(fixed, nn.Linear(3, 2), obs, devices=["cpu", "meta"])

    def shift(table: np.ndarray, bias: torch.Tensor) -> torch.Tensor:
        return bias + torch.from_numpy(table)

    with pytest.raises(AssertionError) as caught:
        devicectx.testing.assert_device_agnostic(
            shift, TABLE, torch.ones(3), devices=["cpu", "meta"]
        )
    assert "torch.as_tensor(array, device=bias.device)" in str(caught.value).splitlines()[-1]


def test_a_tensor_made_over_numpy_inside_fn_gets_the_fix_that_works() -> None:
    """A tensor ``fn`` makes with ``torch.from_numpy`` stays on the CPU whatever the scope,
    so decorating ``fn`` is no fix: the check says to make it with ``torch.as_tensor(array,
    device=x.device)``, which then passes; a stray made on another line of a function that
    also uses numpy keeps the usual fix."""

    def shift(x: torch.Tensor) -> torch.Tensor:
        return x + torch.from_numpy(TABLE)

    with pytest.raises(AssertionError) as caught:
        devicectx.testing.assert_device_agnostic(shift, torch.ones(3), devices=["cpu", "meta"])
    assert (
        "fix: shift makes a tensor over a numpy array's memory (torch.from_numpy), which "
        "stays on the CPU, decorated or not: torch.as_tensor(array, device=x.device) makes "
        "it on its inputs' device"
    ) == str(caught.value).splitlines()[-1]

    def fixed(x: torch.Tensor) -> torch.Tensor:
        return x + torch.as_tensor(TABLE, device=x.device)

    devicectx.testing.assert_device_agnostic(fixed, torch.ones(3), devices=["cpu", "meta"])

    def elsewhere(x: torch.Tensor) -> torch.Tensor:
        table = torch.from_numpy(TABLE).to(x.device)
        return x + table + torch.zeros(3)

    with pytest.raises(AssertionError) as caught:
        devicectx.testing.assert_device_agnostic(elsewhere, torch.ones(3), devices=["cpu", "meta"])
    assert (
        str(caught.value)
        .splitlines()[-1]
        .startswith("fix: make the tensors elsewhere creates on its inputs' device")
    )
