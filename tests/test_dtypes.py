"""What a device can hold, and the dtype policy of moves (``dtypes=``).

The device without float64 is the emulated accelerator playing MPS (no float64, no
complex128): :func:`mps_like` gives it. The CPU and ``meta`` hold every dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from helpers import accelerator, mps_like, placed, staged_counts
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from devicectx import (
    DeviceError,
    DtypeUnsupportedError,
    MoveError,
    choose_precision,
    device_agnostic,
    device_capabilities,
    on_device,
    prefetch,
    supports_dtype,
    to_device,
)
from devicectx.devices._capabilities import CAPABILITIES
from devicectx.move._walk import iter_tensors
from devicectx.testing.strategies import nested, tensors

needs_accelerator = pytest.mark.requires_device("accelerator")
F64, F32, C128, C64 = torch.float64, torch.float32, torch.complex128, torch.complex64
CPU, META = torch.device("cpu"), torch.device("meta")
NEAREST = {F64: F32, C128: C64}
PORTABLE = " to get the same dtypes on every device, or "
LACKING = " to cast only where the device lacks them"


def offered(call: str, mapping: str = "{torch.float64: torch.float32}") -> str:
    """The fix of a refusal under ``dtypes=None``: ``call`` (its ``DTYPES`` the argument)
    with the mapping, which casts on every device, or with ``"device"``."""
    portable = call.replace("DTYPES", f"dtypes={mapping}")
    lacking = call.replace("DTYPES", 'dtypes="device"')
    return f"{portable}{PORTABLE}{lacking}{LACKING}"


def fix_line(raised: pytest.ExceptionInfo[DtypeUnsupportedError]) -> str:
    """The code of a refusal's fix."""
    fix = str(raised.value).splitlines()[-1]
    assert fix.startswith("fix: ")
    return fix.removeprefix("fix: ")


def alternatives(raised: pytest.ExceptionInfo[DtypeUnsupportedError]) -> tuple[str, str]:
    """The two calls the fix of a refusal under ``dtypes=None`` offers: the mapping's,
    then ``"device"``'s."""
    portable, _, lacking = fix_line(raised).partition(PORTABLE)
    assert lacking.endswith(LACKING)
    return portable, lacking.removesuffix(LACKING)


@pytest.fixture(autouse=True)
def _fresh_answers() -> Iterator[None]:
    """Each test starts with no capability known, and leaves none behind."""
    CAPABILITIES.clear()
    yield
    CAPABILITIES.clear()


# supports_dtype and device_capabilities


def test_cpu_and_meta_hold_every_dtype_without_asking() -> None:
    """The CPU and meta hold every dtype, known without making a tensor."""
    for device in ("cpu", "meta"):
        for dtype in (F64, C128, torch.bfloat16, torch.float8_e4m3fn, torch.bool):
            assert supports_dtype(device, dtype)
    assert 0 == CAPABILITIES.probes


@needs_accelerator
def test_an_accelerator_is_asked_once_per_dtype() -> None:
    """A device torch knows nothing about is asked with one tensor per dtype, then never
    again: the answer is kept."""
    device = accelerator()
    expected = torch.zeros(1, dtype=F64, device=device).dtype == F64  # raises where refused
    assert expected == supports_dtype(device, F64)
    assert 1 == CAPABILITIES.probes
    for _ in range(3):
        supports_dtype(device, F64)
        supports_dtype(str(device), F64)
    assert 1 == CAPABILITIES.probes
    supports_dtype(device, F32)
    assert 2 == CAPABILITIES.probes


@needs_accelerator
def test_a_device_that_gives_no_answer_is_asked_again() -> None:
    """A probe that fails for another reason than the dtype (here the device is full) is
    no refusal: the dtype counts as held and is asked about again, not kept as missing."""
    device = accelerator()
    if device.type != "emu":
        pytest.skip("the full device is the emulated one (--devicectx-accelerator)")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the emulated memory limit is refused here")
    from devicectx.testing import emulated

    held = torch.ones(64, device=device)  # past the limit below: every allocation fails
    with emulated.configure(memory_limit=16):
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1, device=device)
        assert supports_dtype(device, F32)
        assert supports_dtype(device, F32)
        assert 2 == CAPABILITIES.probes
    del held
    asked = CAPABILITIES.probes  # (leaving the block may forget every answer)
    assert supports_dtype(device, F32)
    assert supports_dtype(device, F32)
    assert asked + 1 == CAPABILITIES.probes  # answered now, and kept


def test_supports_dtype_takes_only_a_dtype() -> None:
    """Anything but a torch.dtype is refused, with the fix."""
    with pytest.raises(TypeError) as raised:
        supports_dtype("cpu", "float64")  # type: ignore[arg-type]
    assert str(raised.value) == (
        "supports_dtype() takes a torch.dtype, got 'float64'\n"
        "fix: supports_dtype(device, torch.float64)"
    )


def test_capabilities_of_the_cpu() -> None:
    """The record of the CPU: every dtype, no pinned memory to it, blocking copies."""
    caps = device_capabilities("cpu")
    assert (CPU, True, True, True, True, True, False, False, frozenset()) == tuple(caps)


@needs_accelerator
def test_capabilities_of_the_device_without_float64() -> None:
    """The MPS-like device misses float64 and complex128, and nothing else."""
    with mps_like() as device:
        caps = device_capabilities(device)
        assert (False, False, True) == (caps.float64, caps.complex128, caps.complex64)
        assert frozenset({F64, C128}) == caps.missing
        assert caps.non_blocking


# The policy on the device without float64: a property over generated batches

wide_leaves = tensors(devices=["cpu"], dtypes=[F64, C128, F32, torch.int64, torch.bool])


def _pairs(before: Any, after: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The tensors of two structures of one skeleton, position by position."""
    placed_before, placed_after = list(placed(before)), list(placed(after))
    assert [path for path, _ in placed_before] == [path for path, _ in placed_after]
    return [(b, a) for (_, b), (_, a) in zip(placed_before, placed_after, strict=True)]


def bits(tensor: torch.Tensor) -> bytes:
    """The bytes of ``tensor``'s elements, in order: equal bits, NaNs included."""
    values = tensor.detach().cpu().resolve_conj().resolve_neg().numpy()
    return bytes(np.ascontiguousarray(values).tobytes())


def _snapshot(batch: Any) -> list[tuple[torch.Tensor, torch.dtype, bytes]]:
    return [(t, t.dtype, bits(t)) for _, t in placed(batch)]


def _unchanged(batch: Any, snapshot: list[tuple[torch.Tensor, torch.dtype, bytes]]) -> None:
    now = [t for _, t in placed(batch)]
    assert [t for t, _, _ in snapshot] == now  # the same tensor objects
    for (tensor, dtype, before), after in zip(snapshot, now, strict=True):
        assert (tensor.device, dtype) == (CPU, after.dtype)
        assert before == bits(after)


@needs_accelerator
@given(nested(wide_leaves), st.booleans())
def test_device_policy_casts_only_what_the_device_cannot_hold(batch: Any, coalesce: bool) -> None:
    """dtypes="device": float64 leaves arrive as float32, complex128 as complex64, equal to
    the values rounded; every other leaf bit-identical; the same tensor at two places one
    result, a view of a tensor in the batch a view of its result; the input unchanged."""
    with mps_like() as device:
        snapshot = _snapshot(batch)
        moved = to_device(batch, device, dtypes="device", coalesce=coalesce)
        pairs = _pairs(batch, moved)
        for original, result in pairs:
            expected = {F64: F32, C128: C64}.get(original.dtype, original.dtype)
            assert (device, expected) == (result.device, result.dtype)
            assert original.shape == result.shape
            assert bits(original.to(expected)) == bits(result)
        for i, (a, ra) in enumerate(pairs):
            for b, rb in pairs[i + 1 :]:
                assert (a is b) == (ra is rb)
                if (b._base is a or a._base is b) and a.numel() and b.numel():
                    assert rb.untyped_storage().data_ptr() == ra.untyped_storage().data_ptr()
        _unchanged(batch, snapshot)


@needs_accelerator
@given(nested(wide_leaves))
def test_default_policy_refuses_naming_every_path(batch: Any) -> None:
    """dtypes=None: a batch with float64 or complex128 tensors raises before anything is
    copied, naming every path of such a tensor under its dtype; the input is unchanged. A
    batch without them moves as always."""
    with mps_like() as device:
        snapshot = _snapshot(batch)
        listed = dict(iter_tensors(batch, "obj"))  # every path the engine writes, sets too
        refused = {t for t in listed.values() if t.dtype in (F64, C128)}
        if not refused:
            moved = to_device(batch, device)
            assert all(t.device == device for _, t in placed(moved))
            return
        with pytest.raises(DtypeUnsupportedError) as raised:
            to_device(batch, device)
        error = raised.value
        named = {path for paths in error.paths.values() for path in paths}
        assert {id(t) for t in refused} == {id(listed[path]) for path in named}
        for dtype, paths in error.paths.items():
            assert {dtype} == {listed[path].dtype for path in paths}
            assert f"    {dtype}" in str(error)
        assert error.device == device
        mapping = "{" + ", ".join(f"{d}: {NEAREST[d]}" for d in error.paths) + "}"
        call = f"to_device(obj, {str(device)!r}, DTYPES)"
        assert str(error).endswith(f"fix: {offered(call, mapping)}")
        _unchanged(batch, snapshot)


# The policy, one behaviour at a time


@needs_accelerator
def test_default_message_names_every_path_by_dtype() -> None:
    """The default's error, every line: the paths under their dtype, then the fix."""
    with mps_like() as device:
        x = torch.zeros(3, dtype=F64)
        batch = {"x": x, "pair": [x, torch.zeros(2, dtype=C128)], "ids": torch.arange(2)}
        with pytest.raises(DtypeUnsupportedError) as raised:
            to_device(batch, device)
    assert str(raised.value) == (
        f"to_device() cannot move 2 tensors to {device}, which holds no torch.float64 or "
        "torch.complex128:\n"
        "    torch.float64    <- obj['x'], obj['pair'][0]\n"
        "    torch.complex128 <- obj['pair'][1]\n"
        "fix: "
        + offered(
            f"to_device(obj, {str(device)!r}, DTYPES)",
            "{torch.float64: torch.float32, torch.complex128: torch.complex64}",
        )
    )
    assert isinstance(raised.value, (TypeError, DeviceError))  # as torch's MPS error is
    assert {F64: ["obj['x']", "obj['pair'][0]"], C128: ["obj['pair'][1]"]} == raised.value.paths


@needs_accelerator
def test_nothing_is_copied_before_the_refusal() -> None:
    """The refusal comes before any copy: no device memory is taken."""
    from devicectx.testing import emulated

    with mps_like() as device:
        batch = [torch.ones(1000) for _ in range(8)] + [torch.ones(2, dtype=F64)]
        before = emulated.memory_allocated(device)
        with pytest.raises(DtypeUnsupportedError):
            to_device(batch, device)
        assert before == emulated.memory_allocated(device)


@needs_accelerator
def test_a_cast_keeps_views_aliasing_and_autograd() -> None:
    """A cast tensor's view arrives as a view of its cast (after it or before it), a tensor
    at two places as one result, and gradients flow back to the float64 original."""
    with mps_like() as device:
        x = torch.arange(6.0, dtype=F64, requires_grad=True)
        batch = {"first": x[:3], "x": x, "again": x, "n": 3}
        moved = to_device(batch, device, dtypes="device")
        assert moved["again"] is moved["x"]
        assert moved["first"]._base is moved["x"]
        assert (F32, F32) == (moved["x"].dtype, moved["first"].dtype)
        (moved["x"].sum() + moved["first"].sum()).backward()
    assert x.grad is not None
    assert [2.0, 2.0, 2.0, 1.0, 1.0, 1.0] == x.grad.tolist()
    assert F64 == x.grad.dtype


@pytest.mark.parametrize("held", ["alone", "in a dict", "in a list"])
def test_a_cast_loose_parameter_passes_its_gradient_back(held: str) -> None:
    """A float64 parameter passed to a decorated call with a mapping (not in a module)
    reaches the body cast, through autograd: its gradient lands on the caller's parameter,
    as without ``dtypes=`` (a new leaf parameter would train nothing)."""
    temperature = nn.Parameter(torch.tensor(2.0, dtype=F64))

    @device_agnostic(device="cpu", dtypes={F64: F32})
    def scaled(w: torch.Tensor, temp: Any) -> torch.Tensor:
        inside = temp if held == "alone" else temp["t"] if held == "in a dict" else temp[0]
        assert F32 == inside.dtype
        assert not isinstance(inside, nn.Parameter)
        return (w / inside).sum()

    passed = {"alone": temperature, "in a dict": {"t": temperature}, "in a list": [temperature]}
    scaled(torch.ones(3), passed[held]).backward()
    assert temperature.grad is not None
    assert (-0.75, F64) == (temperature.grad.item(), temperature.grad.dtype)


def test_a_mapping_casts_everywhere_even_without_a_move() -> None:
    """A mapping casts on every device, tensors already on the target included: the same
    dtypes on a CPU run as on an MPS one. Other tensors come back as they were."""
    ids = torch.arange(3)
    batch = {"x": torch.ones(2, dtype=F64), "ids": ids}
    moved = to_device(batch, "cpu", dtypes={F64: F32})
    assert F32 == moved["x"].dtype
    assert moved["ids"] is ids
    assert F64 == batch["x"].dtype


def test_device_policy_changes_nothing_where_every_dtype_is_held() -> None:
    """dtypes="device" on a device that holds every dtype is the plain move."""
    x = torch.ones(2, dtype=F64)
    assert to_device(x, "cpu", dtypes="device") is x
    assert F64 == to_device({"x": x}, "meta", dtypes="device")["x"].dtype


@needs_accelerator
def test_skipped_tensors_are_neither_cast_nor_refused() -> None:
    """What skip= leaves where it is keeps its dtype, and is no reason to refuse."""
    with mps_like() as device:
        kept = torch.ones(2, dtype=F64)
        batch = {"x": torch.ones(2), "meta": {"scale": kept}}
        moved = to_device(batch, device, skip="meta")
        assert moved["meta"]["scale"] is kept
        moved = to_device(batch, device, skip="meta", dtypes="device")
        assert moved["meta"]["scale"] is kept


@needs_accelerator
def test_a_partial_mapping_is_refused_with_the_whole_mapping_as_fix() -> None:
    """A mapping that leaves a dtype the device cannot hold: the fix completes it."""
    with mps_like() as device:
        batch = {"x": torch.ones(2, dtype=F64), "z": torch.ones(2, dtype=C128)}
        with pytest.raises(DtypeUnsupportedError) as raised:
            to_device(batch, device, dtypes={F64: F32})
    assert str(raised.value) == (
        f"to_device() cannot move a tensor to {device}, which holds no torch.complex128:\n"
        "    torch.complex128 <- obj['z']\n"
        f"fix: to_device(obj, {str(device)!r}, dtypes={{torch.float64: torch.float32, "
        "torch.complex128: torch.complex64})"
    )


def test_dtypes_takes_only_a_policy() -> None:
    """A string other than "device", or a mapping of anything but dtypes, is refused."""
    with pytest.raises(ValueError, match=r"^dtypes='float32'") as raised:
        to_device(torch.ones(1), "cpu", dtypes="float32")  # type: ignore[arg-type]
    assert str(raised.value) == (
        "dtypes='float32' is no dtype policy: it takes None, \"device\" or a mapping\n"
        'fix: dtypes="device" (what the target cannot hold becomes the nearest dtype it '
        "holds), or dtypes={torch.float64: torch.float32}"
    )
    with pytest.raises(TypeError) as raised_type:
        to_device(torch.ones(1), "cpu", dtypes={"float64": torch.float32})  # type: ignore[dict-item]
    assert str(raised_type.value) == (
        'dtypes= takes None, "device" or a mapping of torch.dtype to torch.dtype, '
        "got 'float64': torch.float32\n"
        "fix: dtypes={torch.float64: torch.float32}"
    )


@pytest.mark.parametrize(
    "given",
    [{torch.float32: "float64"}, {"float32": torch.float64}, {"torch.float32": "float64"}],
)
def test_a_mapping_of_dtype_names_gets_its_own_mapping_as_the_fix(given: Any) -> None:
    """A mapping whose dtypes are written as names: the fix is the same mapping with dtypes
    (float32 to float64, as asked), not a fixed example that maps the other way."""
    with pytest.raises(TypeError) as raised:
        to_device(torch.ones(1), "cpu", dtypes=given)
    assert str(raised.value).splitlines()[-1] == "fix: dtypes={torch.float32: torch.float64}"


@needs_accelerator
def test_staged_moves_send_the_cast_tensors() -> None:
    """Many small float64 tensors to the device: staged (packed through pinned memory) as
    float32, with the values rounded."""
    with mps_like() as device:
        batch = [torch.randn(16, dtype=F64) for _ in range(8)]
        with staged_counts() as counts:
            moved = to_device(batch, device, dtypes="device")
        assert [8] == counts
        for original, result in zip(batch, moved, strict=True):
            assert F32 == result.dtype
            assert torch.equal(original.to(F32), result.cpu())


# The decorator and prefetch


@needs_accelerator
def test_decorator_casts_arguments_with_device_policy() -> None:
    """@device_agnostic(dtypes="device") casts what the target cannot hold, nothing else."""
    with mps_like() as device:

        @device_agnostic(device=device, dtypes="device")
        def step(x: torch.Tensor, batch: dict[str, Any]) -> tuple[torch.dtype, ...]:
            return x.dtype, batch["y"].dtype, batch["ids"].dtype

        got = step(
            torch.ones(2, dtype=F64),
            {"y": torch.ones(1, dtype=C128), "ids": torch.ones(1, dtype=torch.int64)},
        )
        assert (F32, C64, torch.int64) == got


@needs_accelerator
def test_decorator_default_refuses_before_the_body() -> None:
    """Without dtypes=, the call is refused before its body, naming every argument path."""
    ran = []
    with mps_like() as device:

        @device_agnostic(device=device)
        def step(x: torch.Tensor, batch: dict[str, Any]) -> None:
            ran.append(1)

        with pytest.raises(DtypeUnsupportedError) as raised:
            step(torch.ones(2, dtype=F64), {"y": torch.ones(1, dtype=F64)})
    assert [] == ran
    assert str(raised.value).rpartition(".<locals>.")[2] == (
        f"step() cannot move 2 tensors to {device}, which holds no torch.float64:\n"
        "    torch.float64 <- x, batch['y']\n"
        f"fix: {offered(f'@device_agnostic(device={str(device)!r}, DTYPES)')}"
    )


def test_decorator_mapping_casts_on_the_fast_path() -> None:
    """A mapping casts arguments already on the target (no move to make) too."""

    @device_agnostic(device="cpu", dtypes={F64: F32})
    def dtype_of(x: torch.Tensor) -> torch.dtype:
        return x.dtype

    assert F32 == dtype_of(torch.ones(2, dtype=F64))
    assert F32 == dtype_of(x=torch.ones(2, dtype=F64))
    assert torch.int64 == dtype_of(torch.ones(2, dtype=torch.int64))


def test_a_mapping_that_would_take_a_parameter_off_autograd_says_so() -> None:
    """A parameter that requires grad, mapped to an integer dtype: the mapping's mistake,
    said with its fix (it was called a bug in devicectx, moving "to None")."""
    weight = nn.Parameter(torch.ones(2))
    with pytest.raises(MoveError) as raised:
        to_device({"w": weight}, "cpu", dtypes={F32: torch.int64})
    assert [
        "to_device() could not cast obj['w'] (a Parameter of shape (2,), torch.float32, on cpu):",
        "    a parameter that requires grad cannot become torch.int64: only floating point "
        "and complex tensors can require gradients",
        "fix: map torch.float32 to a floating point dtype in dtypes=, or leave it out",
    ] == str(raised.value).splitlines()
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)  # needs no gradient: cast
    assert torch.int64 == to_device(frozen, "cpu", dtypes={F32: torch.int64}).dtype


def test_decorator_mapping_casts_where_no_rule_chose_a_target() -> None:
    """With no device=, no module and no block, the inputs' own device is the target, and
    a mapping casts there as anywhere (it let float64 through: nothing was to move)."""

    @device_agnostic(dtypes={F64: F32})
    def dtypes_of(pred: torch.Tensor, target: Any) -> tuple[torch.dtype, torch.dtype]:
        return pred.dtype, target["y"].dtype

    pred, y = torch.ones(2, dtype=F64), torch.zeros(2, dtype=F64)
    assert (F32, F32) == dtypes_of(pred, {"y": y})
    assert (F32, F32) == dtypes_of(pred, target={"y": y})
    assert (pred.dtype, y.dtype) == (F64, F64)  # the inputs are left alone


def test_decorator_refuses_dtypes_without_moves() -> None:
    """dtypes= with move=False is refused at decoration: nothing would apply it."""
    with pytest.raises(ValueError, match="move=False") as raised:

        @device_agnostic(move=False, dtypes="device")
        def step(x: torch.Tensor) -> None: ...

    assert str(raised.value) == (
        "@device_agnostic(dtypes='device', move=False) on "
        "test_decorator_refuses_dtypes_without_moves.<locals>.step(): dtypes= says what a "
        "move does with dtypes, and move=False moves nothing\n"
        "fix: @device_agnostic(move=False) and cast the inputs yourself, or "
        "@device_agnostic(dtypes='device')"
    )
    with pytest.raises(TypeError):
        device_agnostic(dtypes=[F64])  # type: ignore[arg-type]


@needs_accelerator
def test_prefetch_casts_each_batch_with_device_policy() -> None:
    """prefetch(dtypes="device") hands over every batch cast, in order."""
    with mps_like() as device:
        loader = [{"x": torch.full((2,), float(i), dtype=F64)} for i in range(4)]
        got = [
            (b["x"].dtype, b["x"].cpu().tolist()) for b in prefetch(loader, device, dtypes="device")
        ]
    assert [(F32, [float(i)] * 2) for i in range(4)] == got


@needs_accelerator
def test_prefetch_default_refuses_naming_batch_and_path() -> None:
    """Without dtypes=, the batch is refused when asked for, by index and path."""
    with mps_like() as device:
        loader = [{"x": torch.ones(2)}, {"x": torch.ones(2, dtype=F64)}]
        batches = iter(prefetch(loader, device))
        assert F32 == next(batches)["x"].dtype
        with pytest.raises(DtypeUnsupportedError) as raised:
            next(batches)
    assert str(raised.value) == (
        f"prefetch() at batch 1 cannot move a tensor to {device}, which holds no "
        "torch.float64:\n"
        "    torch.float64 <- batch['x']\n"
        f"fix: {offered(f'prefetch(batches, {str(device)!r}, DTYPES)')}"
    )


# The refusal's fix keeps the caller's other arguments


@needs_accelerator
def test_the_fix_of_a_checkpoint_moved_with_skip_keeps_the_skip() -> None:
    """A float64 checkpoint moved with its RNG state kept on the CPU: the fix keeps
    skip=["rng"]; followed as written, the RNG state is still one torch can set."""
    checkpoint = {"model": nn.Linear(2, 2).double().state_dict(), "rng": torch.get_rng_state()}
    with mps_like() as device:
        with pytest.raises(DtypeUnsupportedError) as raised:
            to_device(checkpoint, device, skip=["rng"])
        assert offered(f"to_device(obj, {str(device)!r}, skip=['rng'], DTYPES)") == (
            fix_line(raised)
        )
        for code in alternatives(raised):
            moved = eval(code, {"to_device": to_device, "obj": checkpoint, "torch": torch})
            assert CPU == moved["rng"].device
            torch.set_rng_state(moved["rng"])
            weight = moved["model"]["weight"]
            assert (device, F32) == (weight.device, weight.dtype)


@needs_accelerator
def test_the_fix_keeps_non_blocking_and_coalesce() -> None:
    """Every argument the caller changed from its default is written back."""
    with mps_like() as device, pytest.raises(DtypeUnsupportedError) as raised:
        to_device(torch.ones(2, dtype=F64), device, non_blocking=True, coalesce=False)
    assert offered(
        f"to_device(obj, {str(device)!r}, non_blocking=True, coalesce=False, DTYPES)"
    ) == fix_line(raised)


@needs_accelerator
def test_the_fix_writes_a_skip_of_types_by_name_and_marks_one_it_cannot_write() -> None:
    """A type is written by its name (torch's under torch.); a lambda cannot be written,
    and is marked so that the line fails when pasted rather than move what it kept."""
    with mps_like() as device:
        batch = {"x": torch.ones(2, dtype=F64), "n": nn.Linear(2, 2)}
        with pytest.raises(DtypeUnsupportedError) as by_type:
            to_device(batch, device, skip=[torch.nn.Module, "n"])
        with pytest.raises(DtypeUnsupportedError) as by_lambda:
            to_device(batch, device, skip=lambda path, value: False)
    assert offered(f"to_device(obj, {str(device)!r}, skip=[torch.nn.Module, 'n'], DTYPES)") == (
        fix_line(by_type)
    )
    assert offered(f"to_device(obj, {str(device)!r}, skip=<your skip= as it was>, DTYPES)") == (
        fix_line(by_lambda)
    )


@needs_accelerator
def test_the_fix_of_prefetch_keeps_its_depth_and_skip() -> None:
    """prefetch's fix keeps depth= and skip=."""
    with mps_like() as device:
        loader = [{"x": torch.ones(2, dtype=F64), "rng": torch.get_rng_state()}]
        batches = iter(prefetch(loader, device, depth=3, skip=["rng"]))
        with pytest.raises(DtypeUnsupportedError) as raised:
            next(batches)
    assert offered(f"prefetch(batches, {str(device)!r}, depth=3, skip=['rng'], DTYPES)") == (
        fix_line(raised)
    )
    for code in alternatives(raised):  # each, as pasted, hands the batch over cast
        with mps_like():
            batches = eval(code, {"prefetch": prefetch, "batches": loader, "torch": torch})
            [batch] = list(batches)
        assert (device, F32) == (batch["x"].device, batch["x"].dtype)
        assert CPU == batch["rng"].device


# The refusal's fix: the mapping, which gives the same dtypes on every device


@needs_accelerator
def test_the_mapping_the_fix_offers_casts_on_a_device_that_holds_float64_too() -> None:
    """A float32 model and numpy's float64 batch, refused on a device without float64
    (the Mac): each call the fix offers runs there as pasted. On a device that holds
    float64 (the GPU the code is deployed to) the mapping's still casts, and the model
    gets the float32 batch it needs; "device"'s casts nothing there."""
    from devicectx.testing import emulated

    def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.dtype:
        return model(batch["x"]).dtype  # type: ignore[no-any-return]

    batch = {"x": torch.from_numpy(np.random.default_rng(0).random((4, 3)))}
    with mps_like() as device:
        model = nn.Linear(3, 1).to(device)
        with pytest.raises(DtypeUnsupportedError) as raised:
            device_agnostic(device=str(device))(step)(model, batch)
        portable, lacking = alternatives(raised)
        assert f"@device_agnostic(device={str(device)!r}, dtypes={{{F64}: {F32}}})" == portable
        fixed = [eval(code.removeprefix("@"))(step) for code in (portable, lacking)]
        assert [F32, F32] == [call(model, batch) for call in fixed]
    with emulated.profile("cuda"):
        assert F32 == fixed[0](model, batch)
        with pytest.raises(RuntimeError, match="dtype"):  # torch's: a float64 batch
            fixed[1](model, batch)


@needs_accelerator
def test_the_mapping_the_fix_offers_casts_complex128_too() -> None:
    """float64 and complex128 refused: the mapping offered casts each to the nearest
    dtype the device holds; pasted, it moves the batch there."""
    with mps_like() as device:
        batch = {"z": torch.ones(2, dtype=C128), "x": torch.ones(2, dtype=F64)}
        with pytest.raises(DtypeUnsupportedError) as raised:
            to_device(batch, device)
        portable, _ = alternatives(raised)
        assert (
            f"to_device(obj, {str(device)!r}, "
            "dtypes={torch.complex128: torch.complex64, torch.float64: torch.float32})"
        ) == portable
        moved = eval(portable, {"to_device": to_device, "obj": batch, "torch": torch})
    assert (C64, F32) == (moved["z"].dtype, moved["x"].dtype)


# A mapping to a dtype the device cannot hold


def echo(b: Any) -> Any:
    """A decorated call's body: what it was given."""
    return b


def _refusal(caller: str, device: torch.device, batch: Any, dtypes: Any) -> str:
    """The message of ``caller``'s refusal to move ``batch`` with ``dtypes``."""
    calls = {
        "to_device": lambda: to_device(batch, device, dtypes=dtypes),
        "decorator": lambda: device_agnostic(device=str(device), dtypes=dtypes)(echo)(batch),
        "prefetch": lambda: list(prefetch([batch], device, dtypes=dtypes)),
    }
    with pytest.raises(DtypeUnsupportedError) as raised:
        calls[caller]()
    return str(raised.value)


@needs_accelerator
@pytest.mark.parametrize("caller", ["to_device", "decorator", "prefetch"])
def test_a_mapping_to_a_dtype_the_device_cannot_hold_names_that_dtype(caller: str) -> None:
    """dtypes={float32: float64} on a device without float64 (it holds float32): the
    refusal names float64, the mapping's value, and the fix maps to the nearest dtype the
    device holds, float32 itself, so leaves the key out; pasted, the move goes."""
    with mps_like() as device:
        batch = {"x": torch.ones(2), "ids": torch.arange(2)}
        message = _refusal(caller, device, batch, {F32: F64})
        who, name, call = {
            "to_device": ("to_device()", "obj", f"to_device(obj, {str(device)!r}, dtypes=None)"),
            "decorator": (
                "echo()",
                "b",
                f"@device_agnostic(device={str(device)!r}, dtypes=None)",
            ),
            "prefetch": (
                "prefetch() at batch 0",
                "batch",
                f"prefetch(batches, {str(device)!r}, dtypes=None)",
            ),
        }[caller]
        assert [
            f"{who} cannot move a tensor to {device}, which holds no torch.float64 "
            "(dtypes= maps torch.float32 to torch.float64):",
            f"    torch.float32 -> torch.float64 <- {name}['x']",
            f"fix: {call}",
        ] == message.splitlines()[-3:]
        if caller == "to_device":
            moved = eval(call, {"to_device": to_device, "obj": batch})
            assert (device, F32) == (moved["x"].device, moved["x"].dtype)


@needs_accelerator
def test_a_mapping_to_a_dtype_the_device_cannot_hold_is_fixed_to_the_nearest() -> None:
    """A mapping whose value the device cannot hold (complex128) beside a dtype it leaves
    out (float64): both named, under the dtype the device lacks; the fix maps each to
    the nearest dtype the device holds, and works as pasted."""
    with mps_like() as device:
        batch = {"x": torch.ones(2), "y": torch.ones(2, dtype=F64)}
        with pytest.raises(DtypeUnsupportedError) as raised:
            to_device(batch, device, dtypes={F32: C128})
        assert [
            f"to_device() cannot move 2 tensors to {device}, which holds no torch.complex128 "
            "or torch.float64 (dtypes= maps torch.float32 to torch.complex128):",
            "    torch.float32 -> torch.complex128 <- obj['x']",
            "    torch.float64                     <- obj['y']",
            f"fix: to_device(obj, {str(device)!r}, "
            "dtypes={torch.float32: torch.complex64, torch.float64: torch.float32})",
        ] == str(raised.value).splitlines()
        assert {C128: ["obj['x']"], F64: ["obj['y']"]} == raised.value.paths
        moved = eval(fix_line(raised), {"to_device": to_device, "obj": batch, "torch": torch})
    assert (C64, F32) == (moved["x"].dtype, moved["y"].dtype)


# Constructors inside on_device, and precision="auto"


@needs_accelerator
def test_constructor_of_a_dtype_the_block_device_cannot_hold() -> None:
    """torch.tensor(numpy float64) inside on_device(d) gets our error and the fix, where
    the device refuses float64 as MPS does."""
    with mps_like() as device:
        try:
            torch.zeros(1, dtype=F64, device=device)
        except Exception:
            pass
        else:
            pytest.skip("this emulated accelerator holds float64: it cannot play MPS here")
        with on_device(device), pytest.raises(DtypeUnsupportedError) as raised:
            torch.tensor(np.zeros(3))
    message = str(raised.value)
    assert message.startswith(
        f"torch.tensor() inside a block on {device} would make a torch.float64 tensor, "
        f"which {device} cannot hold ("
    )
    assert message.endswith(
        "fix: torch.tensor(..., dtype=torch.float32), or make it on the CPU and move it "
        f'with to_device(..., {str(device)!r}, dtypes="device")'
    )


@needs_accelerator
def test_a_compiled_constructor_of_a_dtype_the_block_device_cannot_hold() -> None:
    """The same in a compiled function, after a refusal in eager code: our error (dynamo
    compiling the refusal's own frame made the tensor again, until RecursionError)."""

    @torch.compile(backend="eager")
    def total(array: Any) -> torch.Tensor:
        return torch.tensor(array).sum()

    with mps_like() as device, on_device(device):
        with pytest.raises(DtypeUnsupportedError):
            torch.tensor(np.zeros(3))
        with pytest.raises(DtypeUnsupportedError) as raised:
            total(np.zeros(3))
    assert f"inside a block on {device} would make a torch.float64 tensor" in str(raised.value)
    assert "dtype=torch.float32), or make it on the CPU" in str(raised.value)


@needs_accelerator
def test_precision_auto_skips_a_dtype_the_device_cannot_hold() -> None:
    """precision="auto" never picks bfloat16 on a device that cannot hold it."""
    device = accelerator()
    if device.type != "emu":
        pytest.skip("the emulated accelerator plays a device without bfloat16")
    assert "bf16-mixed" == choose_precision(device, "auto").name
    CAPABILITIES.tell(device, torch.bfloat16, False)
    assert "16-mixed" == choose_precision(device, "auto").name


@pytest.mark.parametrize("dtypes", [None, "device"])
def test_a_first_move_inside_a_compiled_function_asks_the_device_outside_the_graph(
    dtypes: str | None,
) -> None:
    """Nothing known yet (each test starts so): the first move to a device is one that
    dynamo traces, whole (fullgraph), the device asked while tracing."""
    compiled = torch.compile(
        lambda x: to_device(x, "meta", dtypes=dtypes), backend="eager", fullgraph=True
    )

    moved = compiled({"x": torch.ones(2, dtype=F64)})

    assert (META, F64) == (moved["x"].device, moved["x"].dtype)
    assert CAPABILITIES.missing(META) == frozenset()


def test_decorator_casts_under_torch_compile() -> None:
    """Under torch.compile a call with dtypes= casts as the eager call does."""

    @device_agnostic(device="cpu", dtypes={F64: F32})
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    compiled = torch.compile(lambda x: double(x) + 1, backend="eager")
    result = compiled(torch.ones(2, dtype=F64))
    assert F32 == result.dtype
    assert [3.0, 3.0] == result.tolist()


@needs_accelerator
def test_the_fix_of_the_decorator_keeps_its_other_arguments() -> None:
    """@device_agnostic's fix is the caller's decorator with dtypes= added: device=,
    exclude= (which keeps an argument out of the move) and the switches stay; followed as
    written, the call runs with the RNG state left where it was."""
    with mps_like() as device:

        @device_agnostic(device=str(device), exclude="rng", scope=False, output="input")
        def step(x: torch.Tensor, rng: torch.Tensor) -> torch.device:
            return rng.device

        with pytest.raises(DtypeUnsupportedError) as raised:
            step(torch.ones(2, dtype=F64), torch.get_rng_state())
        assert offered(
            f"@device_agnostic(device={str(device)!r}, output='input', exclude='rng', "
            "scope=False, DTYPES)"
        ) == fix_line(raised)
        for fix in alternatives(raised):
            fixed = eval(fix.removeprefix("@"))(step.__wrapped__)  # the fix, as pasted
            assert torch.device("cpu") == fixed(torch.ones(2, dtype=F64), torch.get_rng_state())
