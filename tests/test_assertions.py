"""``assert_device_agnostic``: what it runs where, what it catches, and every message."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import pytest
import torch
from helpers import accelerator, mps_like
from hypothesis import given
from torch import nn

import devicectx
from devicectx import InvalidDeviceError
from devicectx.testing import assert_device_agnostic, strategies

CPU_META = ["cpu", "meta"]


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
    assert devicectx.available_devices() == seen


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
        "or decorate make_mask with @devicectx.device_agnostic so they land there",
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
        "or decorate to_meta with @devicectx.device_agnostic so they land there",
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
        "fix: if the difference is expected (float sums in another order, TF32), allow it: "
        "assert_device_agnostic(drift, ..., rtol=1e-4, atol=1e-5)",
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
        "fix: if the difference is expected (float sums in another order, TF32), allow it: "
        "assert_device_agnostic(drifting_stats, ..., rtol=1e-4, atol=1e-5)",
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
        "fix: make to_float work on meta, or leave meta out of devices=",
    ] == message_lines(raised)
    assert isinstance(raised.value.__cause__, RuntimeError)


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
        'fix: register_container(Scales, children=lambda obj: [("factor", obj.factor)], '
        "rebuild=...), pass scales.factor as an argument, or give Scales a .to(device) method",
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
        "fix: if the difference is expected (float sums in another order, TF32), allow it: "
        "assert_device_agnostic(stats, ..., rtol=1e-4, atol=1e-5)",
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
            f"torch.float64 to torch.float32 on {device} only, or leave {device} out: "
            "devices=['cpu', 'meta']",
        ] == str(raised.value).splitlines()
        assert_device_agnostic(scale, x, devices=["cpu", device], dtypes="device")
        assert_device_agnostic(scale, x, devices=[device, "cpu"], dtypes="device")
        decorated = devicectx.device_agnostic(dtypes="device")(scale)
        assert_device_agnostic(decorated, x, devices=["cpu", device], dtypes="device")


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
