"""``to_device``'s errors: each names the path of what failed and the fix, before anything
moves where it can, messages asserted line by line.

``meta`` is the second device: a move off meta fails as a move to a lost GPU would.
"""

from __future__ import annotations

import gc
import pickle
import re
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import accelerator, mps_like
from hypothesis import given
from hypothesis import strategies as st
from move_subjects import CountingTo, Frozen, Holder, Pair
from torch import nn
from torch._utils import ExceptionWrapper

import devicectx
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

pytest_plugins = ["pytester"]


# Errors.


class Refusing(torch.Tensor):
    """A tensor subclass whose .to fails."""

    def to(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("cannot leave\nthis device")


def test_the_skip_fix_keeps_the_callers_own_skip_and_arguments() -> None:
    """The fix adds the failing path to the caller's skip= and keeps its other arguments:
    followed as printed, the move leaves both the caller's entries and that path alone."""
    rng = torch.get_rng_state()
    obj = {"rng": rng, "feats": [torch.ones(2), torch.zeros(2).as_subclass(Refusing)]}
    with pytest.raises(MoveError) as raised:
        to_device(obj, "meta", skip=["rng", nn.Module], non_blocking=True)
    fix = str(raised.value).splitlines()[-1]
    assert (
        "fix: leave it where it is: to_device(obj, 'meta', non_blocking=True, "
        "skip=['rng', torch.nn.Module, \"obj['feats'][1]\"])"
    ) == fix
    moved = eval(fix.partition("leave it where it is: ")[2])  # the fix, as pasted
    assert moved["rng"] is rng
    assert moved["feats"][1] is obj["feats"][1]
    assert META == moved["feats"][0].device

    with pytest.raises(MoveError) as raised:
        to_device(obj, "meta", skip=lambda path, value: False)
    assert str(raised.value).endswith("skip=[<your skip= entries>, \"obj['feats'][1]\"])")


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
        fix = (
            "mend the children= and rebuild= that register_container(Broken, ...) got; or "
            "leave it where it is: do not move obj"
            if path == "obj"  # the whole object, which skip= cannot leave
            else f"leave it where it is: to_device(obj, 'meta', skip=[{path!r}])"
        )
        assert [
            f"to_device() could not move {path} (a Broken) to meta:",
            "    ZeroDivisionError: division by zero",
            f"fix: {fix}",
        ] == str(raised.value).splitlines()


class Pinned(nn.Linear):
    """A module whose .to fails (a module on meta is refused before its .to runs)."""

    def to(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("pinned to this device")


def test_move_error_from_a_module() -> None:
    """A module that cannot be moved raises MoveError naming where it sits."""
    with pytest.raises(MoveError) as raised:
        to_device({"model": Pinned(1, 1)}, "meta")
    assert [
        "to_device() could not move obj['model'] (a Pinned) to meta:",
        "    RuntimeError: pinned to this device",
        "fix: leave it where it is: to_device(obj, 'meta', skip=[\"obj['model']\"])",
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
    assert (
        "fix: free memory on emu:0 (del what you no longer need there), or move less at once "
        "(devicectx.shrink_batch_on_oom retries with smaller batches); or leave it where it "
        f"is: to_device(obj, 'emu:0', skip=[{found[1]!r}])"
    ) == fix


@needs_emulated_memory_limit
def test_out_of_memory_moving_one_tensor_offers_no_skip_of_it() -> None:
    """A single tensor past the device's memory: the fix is memory, not a skip of the whole
    object (which moves nothing, and which the move then refused the same way)."""
    with emulated.configure(memory_limit=4 * MIB), pytest.raises(torch.OutOfMemoryError) as raised:
        to_device(torch.ones(2 * MIB), "emu:0")
    assert (
        "fix: free memory on emu:0 (del what you no longer need there), or move less at once "
        "(devicectx.shrink_batch_on_oom retries with smaller batches)"
    ) == str(raised.value).splitlines()[-1]


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
    assert (
        str(raised.value)
        .rpartition(".<locals>.")[2]
        .startswith("first() could not move w (a Tensor of shape ")
    )


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


# Modules holding tensors on meta: module.to cannot copy them, and stops at the first with
# the tensors before it moved in place; the move is refused before any module moves.


def where(module: nn.Module) -> list[tuple[str, int, torch.device]]:
    """Each parameter and buffer of ``module``: its name, the object, its device."""
    named = [*module.named_parameters(), *module.named_buffers()]
    return [(name, id(tensor), tensor.device) for name, tensor in named]


def half_on_meta() -> nn.Sequential:
    """A model whose second layer is on meta: module.to moves the first before failing."""
    return nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))


def test_a_module_on_meta_is_refused_naming_its_part_on_meta() -> None:
    """To the CPU: refused naming the part on meta and its tensors, with to_empty as the
    fix; a move to meta takes it."""
    model, x = half_on_meta(), torch.ones(1)
    before = where(model)
    with pytest.raises(MoveError) as raised:
        to_device({"model": model, "x": x}, "cpu")
    assert before == where(model)
    assert [
        "to_device() cannot move obj['model'] (a Sequential) to cpu, and moved nothing: 2 of "
        "its tensors are on meta, with no data to copy:",
        "    obj['model'][1] (Linear): weight, bias",
        "fix: obj['model'][1].to_empty(device='cpu'), then initialise it (load a state dict, "
        "or obj['model'][1].reset_parameters()), before the move; or leave it where it is: "
        "to_device(obj, 'cpu', skip=[\"obj['model']\"])",
    ] == str(raised.value).splitlines()
    assert {META} == {device for _, _, device in where(to_device(model, "meta"))}


def test_modules_on_meta_are_named_each_with_a_few_tensors_then_a_count() -> None:
    """Two modules on meta, one wholly (named whole, as to_empty makes it anew): each is
    named with its first tensors and a count of the rest, on the walk that takes paths."""
    whole = nn.Sequential(nn.BatchNorm1d(2), nn.Linear(2, 2)).to("meta")
    batch = {"a": nn.Linear(2, 2, device="meta"), "b": [whole], "x": torch.ones(1)}
    with pytest.raises(MoveError) as raised:
        to_device(batch, "cpu", skip=["obj['x']"])
    assert [
        "to_device() cannot move 2 modules to cpu, and moved nothing: 9 of their tensors are "
        "on meta, with no data to copy:",
        "    obj['a'] (Linear): weight, bias",
        "    obj['b'][0] (Sequential): 0.weight, 0.bias, 1.weight and 4 more",
        "fix: obj['a'].to_empty(device='cpu'); obj['b'][0].to_empty(device='cpu'), then "
        "initialise them (load a state dict), before the move",
    ] == str(raised.value).splitlines()


@pytest.mark.requires_device("accelerator")
def test_a_module_on_meta_leaves_every_module_where_it_was() -> None:
    """To the accelerator, where module.to would have moved a module met before and the
    first layer: every parameter is where it was, the same objects. The skip the fix offers
    moves the rest; its to_empty, the whole."""
    device = accelerator()
    first, model = nn.Linear(2, 2), half_on_meta()
    before = where(first), where(model)
    with pytest.raises(MoveError) as raised:
        to_device({"first": first, "model": model}, device)
    assert before == (where(first), where(model))
    assert {CPU} == {d for _, _, d in where(first) + where(model)[:2]}
    assert [
        f"to_device() cannot move obj['model'] (a Sequential) to {device}, and moved nothing: "
        "2 of its tensors are on meta, with no data to copy:",
        "    obj['model'][1] (Linear): weight, bias",
        f"fix: obj['model'][1].to_empty(device={str(device)!r}), then initialise it (load a "
        "state dict, or obj['model'][1].reset_parameters()), before the move; or leave it "
        f"where it is: to_device(obj, {str(device)!r}, skip=[\"obj['model']\"])",
    ] == str(raised.value).splitlines()
    to_device({"first": first, "model": model}, device, skip=["obj['model']"])
    assert ({device}, before[1]) == ({d for _, _, d in where(first)}, where(model))
    model[1].to_empty(device=device)
    model[1].reset_parameters()
    to_device({"first": first, "model": model}, device)
    assert {device} == {d for _, _, d in where(first) + where(model)}


def test_a_model_offloaded_by_accelerate_is_refused_with_accelerates_way_out() -> None:
    """accelerate keeps offloaded weights on meta behind its hooks, on purpose: the move is
    refused before anything moves, no to_empty is offered for it (that would throw its
    weights away), and the fix removes the hooks, which puts the weights back."""
    accelerate = pytest.importorskip("accelerate")
    model = accelerate.cpu_offload(nn.Linear(2, 2), execution_device=CPU)
    with pytest.raises(MoveError) as raised:
        to_device(model, "cpu")
    fix = str(raised.value).splitlines()[-1]
    assert "to_empty" not in fix
    assert "remove_hook_from_module(obj, recurse=True)" in fix
    assert str(raised.value).startswith(
        "to_device() cannot move obj (a Linear) to cpu, and moved nothing: accelerate offloaded it"
    )


# A move that fails after a module moved in place: the module is put back as it was.


class StaysPut(torch.Tensor):
    """A tensor whose ``.to`` raises: a leaf that cannot be moved."""

    def to(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this tensor stays")


class HoldsAStayer(nn.Module):
    """A module whose buffer cannot move: its ``module.to`` fails midway, after the layers
    before it moved."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stat", torch.ones(2).as_subclass(StaysPut))


def trained_state(model: nn.Module) -> list[tuple[str, int, torch.device, torch.Tensor, Any]]:
    """Each parameter and buffer: name, object, device, values, and its grad object."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return [
        (name, id(t), t.device, t.detach().clone(), getattr(t, "grad", None)) for name, t in named
    ]


def assert_as_before(model: nn.Module, before: list[Any]) -> None:
    after = trained_state(model)
    assert [(n, i, d, g) for n, i, d, _, g in before] == [(n, i, d, g) for n, i, d, _, g in after]
    assert all(torch.equal(b[3], a[3]) for b, a in zip(before, after, strict=True))


@given(model_first=st.booleans(), with_grads=st.booleans(), swap=st.booleans())
def test_a_move_failing_after_a_module_moved_puts_the_module_back(
    model_first: bool, with_grads: bool, swap: bool
) -> None:
    """to_device moves modules in place: a leaf that fails after the model moved (or before)
    leaves the model as it was, the same parameter objects on their device with their
    values and grads, so an optimizer made before still trains it; an RNN's list of its
    weights too. Also where torch swaps a parameter's contents (torch.__future__)."""
    model = nn.Sequential(nn.Linear(2, 2), nn.LSTM(2, 2))
    if with_grads:
        model(torch.ones(3, 2))[0].sum().backward()
    before = trained_state(model)
    stays = torch.ones(2).as_subclass(StaysPut)
    batch = {"model": model, "stays": stays} if model_first else {"stays": stays, "model": model}
    swapped = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        with pytest.raises(MoveError, match=r"could not move obj\['stays'\]"):
            to_device(batch, "meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapped)
    assert_as_before(model, before)
    output, _ = model(torch.ones(3, 2))
    assert CPU == output.device


def test_a_sparse_gradient_is_put_back_with_its_parameter() -> None:
    """An embedding trained with sparse gradients (no data pointer to compare) is put back
    too, its gradient the same sparse tensor."""
    model = nn.Sequential(nn.Embedding(5, 2, sparse=True), nn.Linear(2, 2))
    model(torch.tensor([1, 2])).sum().backward()
    before = trained_state(model)
    with pytest.raises(MoveError, match=r"obj\['stays'\]"):
        to_device({"model": model, "stays": torch.ones(2).as_subclass(StaysPut)}, "meta")
    assert_as_before(model, before)
    assert model[0].weight.grad is not None
    assert model[0].weight.grad.is_sparse


def test_a_module_whose_move_fails_midway_is_put_back_and_the_tensor_named() -> None:
    """module.to stopping at a buffer it cannot move, the layers before it moved: every
    tensor is back where it was, the same objects; the error names the buffer (torch's
    names none)."""
    model = nn.Sequential(nn.Linear(2, 2), HoldsAStayer())
    before = trained_state(model)
    with pytest.raises(MoveError) as raised:
        to_device({"model": model}, "meta")
    assert_as_before(model, before)
    assert [
        "to_device() could not move obj['model'] (a Sequential) to meta:",
        "    its buffer '1.stat' (a StaysPut of shape (2,), torch.float32, on cpu): "
        "RuntimeError: this tensor stays",
    ] == str(raised.value).splitlines()[:2]


@needs_emulated_memory_limit
def test_a_model_out_of_memory_midway_is_put_back_and_frees_the_device() -> None:
    """Out of memory at a model's second layer: the first layer is back on the CPU (not
    left on the device, the model split), the same objects, and no device memory is held."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, MIB // 64))  # 4 MiB
    model[0].weight.grad = torch.ones(64, 64)
    before = trained_state(model)
    gc.collect()
    held = emulated.memory_allocated("emu:0")
    with (
        emulated.configure(memory_limit=held + MIB),
        pytest.raises(torch.OutOfMemoryError, match=r"obj\['model'\]"),
    ):
        to_device({"model": model}, "emu:0")
    assert_as_before(model, before)
    gc.collect()
    assert held == emulated.memory_allocated("emu:0")


# Tracebacks: pytest shows the line that called and the message, not the engine's frames.


@pytest.mark.requires_device("accelerator")
def test_a_refused_move_shows_the_callers_line_and_no_engine_frame(
    pytester: pytest.Pytester,
) -> None:
    """A ``DtypeUnsupportedError`` raised by ``to_device`` in a user's test, the error for a
    ``dtypes=`` that is no policy, a device that does not exist and an object's own ``.to``
    that fails: pytest's report (locals shown) points at the
    test's line, with our message, and shows no frame of the move engine."""
    with mps_like() as device:
        pytester.makepyfile(
            test_user=f"""
            import torch
            from devicectx import to_device

            def test_refused():
                to_device({{"x": torch.ones(2, dtype=torch.float64)}}, "{device}")

            def test_no_policy():
                to_device(torch.ones(2), "cpu", dtypes="bogus")

            def test_no_such_device():
                to_device(torch.ones(2), "cpu:1")

            class Bad:
                def to(self, *args, **kwargs):
                    raise RuntimeError("boom")

            def test_its_own_to_fails():
                to_device({{"b": Bad()}}, "meta")
            """
        )
        done = pytester.runpytest_inprocess("--showlocals", "-p", "no:cacheprovider")
    done.assert_outcomes(failed=4)
    report = done.stdout.str()
    done.stdout.fnmatch_lines(
        [
            '>       to_device({"x": torch.ones(2, dtype=torch.float64)}, *',
            "E       devicectx.DtypeUnsupportedError: to_device() cannot move a tensor to *",
            "E           torch.float64 <- obj['x']",
            "test_user.py:5: DtypeUnsupportedError",
            '>       to_device(torch.ones(2), "cpu", dtypes="bogus")',
            "E       ValueError: dtypes='bogus' is no dtype policy: *",
            "test_user.py:8: ValueError",
            '>       to_device(torch.ones(2), "cpu:1")',
            "E       devicectx.DeviceUnavailableError: device 'cpu:1' is not available: *",
            '>       to_device({"b": Bad()}, "meta")',
            "E       devicectx.MoveError: to_device() could not move obj* (a Bad) to meta:",
        ]
    )
    for engine in ("_dtypes.py", "_move.py", "_rebuild.py", "_resolve.py"):
        assert engine not in report


ERRORS_WITH_ATTRIBUTES: list[tuple[type[Exception], dict[str, Any]]] = [
    (
        devicectx.DeviceMismatchError,
        {"devices": {torch.device("cpu"): ["x"]}, "target": torch.device("meta"), "reason": "r"},
    ),
    (
        devicectx.DtypeUnsupportedError,
        {"device": torch.device("meta"), "paths": {torch.float64: ["x"]}},
    ),
    (devicectx.BatchTooLargeError, {"tried": [4, 2, 1]}),
]


@pytest.mark.parametrize(
    "error",
    [cls("what\nfix: how", **attributes) for cls, attributes in ERRORS_WITH_ATTRIBUTES]
    + [devicectx.MoveError("what"), devicectx.MoveOutOfMemoryError("what")],
    ids=lambda error: type(error).__name__,
)
def test_errors_survive_pickling(error: Exception) -> None:
    """An error raised in a worker process (a DataLoader worker, a process pool) reaches
    the parent whole: the same type, message and attributes, even those __init__ takes
    by keyword only."""
    error.__notes__ = ["a note"]
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert str(again) == str(error)
    assert vars(again) == vars(error)


PUBLIC_ERRORS = sorted(
    (
        value
        for value in vars(devicectx).values()
        if isinstance(value, type) and issubclass(value, devicectx.DeviceError)
    ),
    key=lambda cls: cls.__name__,
)


@pytest.mark.parametrize("cls", PUBLIC_ERRORS, ids=lambda cls: cls.__name__)
def test_an_error_raised_in_a_dataloader_worker_keeps_its_class(cls: type[Exception]) -> None:
    """torch's DataLoader raises a worker's error again in the parent by calling its class
    with the message alone (``ExceptionWrapper.reraise``, run here as the loader runs it), and
    raises a bare RuntimeError where that fails: every error of ours can be made so, and
    ``except devicectx.DeviceError`` still catches it."""
    attributes = dict(ERRORS_WITH_ATTRIBUTES).get(cls, {})
    try:
        raise cls("what\nfix: how", **attributes)
    except cls:
        wrapped = ExceptionWrapper(sys.exc_info(), where="in DataLoader worker process 0")
    with pytest.raises(devicectx.DeviceError) as again:
        wrapped.reraise()
    assert type(again.value) is cls
    assert "fix: how" in str(again.value)


@pytest.mark.requires_device("accelerator")
def test_a_whole_object_the_device_refuses_gets_a_fix_that_is_no_skip() -> None:
    """A sparse tensor the emulated device has no kernels for, moved as the whole object:
    the fix is not to skip the object (skip= leaves parts, never the whole: it would fail
    again) but to give it a layout the device takes, which then moves; torch's dispatcher
    dump (some 50 lines) is quoted by its first line."""
    if accelerator().type != "emu":
        pytest.skip("the emulated device has no sparse kernels; a real one may have them")
    sparse = torch.eye(2).to_sparse()
    with pytest.raises(MoveError) as raised:
        to_device(sparse, accelerator())
    lines = str(raised.value).splitlines()
    assert lines[-1] == (
        "fix: give it a layout the device takes first (obj.to_dense()); "
        "or leave it where it is: do not move obj"
    )
    assert lines[2].startswith("    ... (")
    assert lines[2].endswith(" more lines: in the error above)")
    assert len(lines) == 4
    assert accelerator() == to_device(sparse.to_dense(), accelerator()).device


def test_an_uninitialised_parameter_is_refused_with_its_path() -> None:
    """A lazy module's parameter before its first forward (no shape yet) in a structure:
    MoveError naming its path and torch's reason (run a forward first), not torch's error
    from describing it."""
    lazy = nn.LazyLinear(2)
    with pytest.raises(MoveError) as raised:
        to_device({"w": lazy.weight}, "meta")
    lines = str(raised.value).splitlines()
    assert lines[0] == (
        "to_device() could not move obj['w'] (an UninitializedParameter (not initialised: no "
        "shape yet)) to meta:"
    )
    assert "Call `forward` with a dummy batch" in lines[1]


def test_a_tuple_subclass_made_at_run_time_is_registered_itself_not_tuple() -> None:
    """A ``tuple`` subclass made in a function, which cannot be rebuilt, gets the fix that
    registers that class, not ``tuple`` (its nearest class code can name), whose
    registration would change how every tuple is walked; followed, the class moves and a
    plain tuple still does."""

    def make_pair_type() -> type[tuple[Any, ...]]:
        class Pair(tuple[Any, ...]):
            def __new__(cls, a: object, b: object) -> Pair:
                return super().__new__(cls, (a, b))

        return Pair

    pair_type = make_pair_type()
    with pytest.raises(MoveError) as caught:
        devicectx.to_device(pair_type(torch.ones(1), torch.ones(1)), "meta")
    fix = str(caught.value).splitlines()[-1]
    assert fix.startswith(
        "fix: teach it with devicectx.register_container(Pair, children=pair_children, "
        "rebuild=pair_rebuild) (Pair itself, the class your code made at run time, each one "
        "it makes; not tuple, whose registration would change how every tuple is walked)"
    )
    devicectx.register_container(
        pair_type,
        children=lambda obj: list(enumerate(obj)),
        rebuild=lambda obj, new: pair_type(*new),
    )
    try:
        moved = devicectx.to_device(pair_type(torch.ones(1), torch.ones(1)), "meta")
        plain = devicectx.to_device((torch.ones(1), torch.ones(1), torch.ones(1)), "meta")
    finally:
        devicectx.unregister_container(pair_type)
    assert (pair_type, META) == (type(moved), moved[1].device)
    assert (tuple, META) == (type(plain), plain[2].device)
