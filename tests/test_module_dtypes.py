"""Modules moved to a device that cannot hold some of their dtypes (float64 on MPS).

``dtypes=`` casts no module's tensors (``module.to`` moves a module in place, as it is), so
a module holding a tensor the target cannot hold is refused before anything moves, with the
cast to make as the fix, and never left half-moved. The device without float64 is the
emulated accelerator playing MPS.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from helpers import mps_like
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from devicectx import (
    DeviceMismatchError,
    DtypeUnsupportedError,
    device_agnostic,
    find_devices,
    to_device,
)
from devicectx.move._dtypes import module_cast, module_casts, outermost
from devicectx.move._paths import within
from devicectx.move._walk import iter_tensors

needs_accelerator = pytest.mark.requires_device("accelerator")
F64, F32, F16, C128 = torch.float64, torch.float32, torch.float16, torch.complex128
CPU = torch.device("cpu")


def float64_stats() -> nn.Sequential:
    """A model whose last tensors, a BatchNorm's running stats, are float64: module.to
    moves the others before it meets them."""
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model[1].running_mean = model[1].running_mean.double()
    model[1].running_var = model[1].running_var.double()
    return model


def tensors(module: nn.Module) -> list[tuple[str, torch.Tensor, torch.device, torch.dtype]]:
    """Each parameter and buffer of ``module``: its name, the object, device and dtype."""
    named = [*module.named_parameters(), *module.named_buffers()]
    return [(name, t, t.device, t.dtype) for name, t in named]


def unchanged(module: nn.Module, before: list[Any]) -> None:
    """``module`` holds the same tensor objects, on the CPU, with the same dtypes."""
    after = tensors(module)
    assert [(n, id(t), d, dt) for n, t, d, dt in before] == [
        (n, id(t), d, dt) for n, t, d, dt in after
    ]
    assert {CPU} == {d for _, _, d, _ in after}


def fix_code(message: str) -> str:
    """The code of a module fix line, without the reason after it."""
    fix = message.splitlines()[-1]
    assert fix.startswith("fix: ")
    return fix.removeprefix("fix: ").split(" before the move")[0]


@dataclasses.dataclass
class Run:
    """A model and a tensor, in a container the quick look does not read itself."""

    model: nn.Module
    other: torch.Tensor


# Refused before anything moves


@needs_accelerator
def test_device_policy_refuses_a_module_with_float64_and_leaves_it_whole() -> None:
    """dtypes="device" on a model with float64 buffers: refused naming each one, with the
    module's .float() as the fix; no tensor of the model moved (it was left half-moved)."""
    with mps_like() as device:
        model = float64_stats()
        before = tensors(model)
        with pytest.raises(DtypeUnsupportedError) as raised:
            to_device(model, device, dtypes="device")
        unchanged(model, before)
    assert [
        f"to_device() cannot move 2 tensors to {device}, which holds no torch.float64:",
        "    torch.float64 <- obj[1].running_mean, obj[1].running_var",
        "fix: obj[1].float() before the move (dtypes= casts no module's tensors)",
    ] == str(raised.value).splitlines()
    assert {F64: ["obj[1].running_mean", "obj[1].running_var"]} == raised.value.paths
    assert raised.value.device == device


@needs_accelerator
def test_default_names_a_module_and_a_batch_tensor_in_one_refusal() -> None:
    """dtypes=None on a model and a float64 tensor: one refusal names both, and the fix
    casts the module and casts the batch with dtypes="device"."""
    with mps_like() as device:
        model = float64_stats()
        before = tensors(model)
        with pytest.raises(DtypeUnsupportedError) as raised:
            to_device({"model": model, "x": torch.ones(2, dtype=F64)}, device)
        unchanged(model, before)
    assert [
        f"to_device() cannot move 3 tensors to {device}, which holds no torch.float64:",
        "    torch.float64 <- obj['x'], obj['model'][1].running_mean, obj['model'][1].running_var",
        "fix: obj['model'][1].float() before the move (dtypes= casts no module's tensors), "
        f"and to_device(obj, {str(device)!r}, dtypes={{torch.float64: torch.float32}}) to get "
        f'the same dtypes on every device, or to_device(obj, {str(device)!r}, dtypes="device") '
        "to cast only where the device lacks them",
    ] == str(raised.value).splitlines()


@needs_accelerator
def test_a_mapping_does_not_cast_a_module_either() -> None:
    """A mapping that casts float64 casts the batch, not the model in it: the model is
    refused as it stands, the batch left as it was."""
    with mps_like() as device:
        model, x = float64_stats(), torch.ones(2, dtype=F64)
        before = tensors(model)
        with pytest.raises(DtypeUnsupportedError) as raised:
            to_device({"model": model, "x": x}, device, dtypes={F64: F32})
        unchanged(model, before)
    assert {F64: ["obj['model'][1].running_mean", "obj['model'][1].running_var"]} == (
        raised.value.paths
    )
    assert (CPU, F64) == (x.device, x.dtype)


@needs_accelerator
def test_a_module_off_the_plain_walk_is_checked_too() -> None:
    """A model in a dataclass, moved with a skip given as a path (the walks that take paths
    and other containers): refused the same, and left whole."""
    with mps_like() as device:
        model = float64_stats()
        before = tensors(model)
        with pytest.raises(DtypeUnsupportedError) as raised:
            to_device(Run(model, torch.ones(2)), device, skip=["obj.other"], dtypes="device")
        unchanged(model, before)
    named = str(raised.value).splitlines()[1]
    assert "    torch.float64 <- obj.model[1].running_mean, obj.model[1].running_var" == named


@needs_accelerator
def test_a_float64_parameter_nested_in_a_submodule_is_named_by_its_module() -> None:
    """A float64 parameter deep in the model: its own module is the one the fix casts."""
    with mps_like() as device:
        encoder = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        encoder[1].double()
        model = nn.ModuleDict({"encoder": encoder})
        with pytest.raises(DtypeUnsupportedError) as raised:
            to_device(model, device)
    assert [
        f"to_device() cannot move 2 tensors to {device}, which holds no torch.float64:",
        "    torch.float64 <- obj.encoder[1].weight, obj.encoder[1].bias",
        "fix: obj.encoder[1].float() before the move (dtypes= casts no module's tensors)",
    ] == str(raised.value).splitlines()


# The fix works


@needs_accelerator
def test_the_fix_line_run_as_written_lets_the_module_move() -> None:
    """The fix line, run as code with the model as obj, makes the move go through: every
    tensor of the model on the device."""
    with mps_like() as device:
        model = float64_stats()
        with pytest.raises(DtypeUnsupportedError) as raised:
            to_device(model, device, dtypes="device")
        exec(fix_code(str(raised.value)), {"obj": model, "torch": torch})
        assert to_device(model, device, dtypes="device") is model
        assert {device} == set(find_devices(model))
        assert F32 == model[1].running_mean.dtype


class Lm(nn.Module):
    """A small language model: submodules nested two deep, and a buffer of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
        self.norm = nn.LayerNorm(4)
        self.register_buffer("pos", torch.zeros(4))
        self.register_buffer("phase", torch.zeros(4, dtype=torch.complex64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.block(self.embed(ids) + self.pos))  # type: ignore[no-any-return]


@needs_accelerator
def test_a_whole_float64_model_is_cast_by_its_own_float_alone() -> None:
    """A model cast to float64 whole: the fix is its own .float(), which casts every
    submodule, not one line per module as well; a complex128 buffer, which .float()
    leaves alone, keeps its own line. Run as written, the model moves; the decorator's
    fix is the same, before its move."""
    with mps_like() as device:
        model = Lm().double()
        model.phase = model.phase.to(C128)
        with pytest.raises(DtypeUnsupportedError) as raised:
            to_device(model, device)
        cast = "obj.float(); obj.phase.data = obj.phase.data.to(torch.complex64)"
        assert cast == fix_code(str(raised.value))
        exec(fix_code(str(raised.value)), {"obj": model, "torch": torch})
        assert to_device(model, device) is model
        assert {device} == set(find_devices(model))

        @device_agnostic(device=device)
        def step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
            return model(ids)  # type: ignore[no-any-return]

        model = Lm().double()
        with pytest.raises(DeviceMismatchError) as mismatch:
            step(model, torch.arange(3))
        code = str(mismatch.value).splitlines()[-1].partition(" before calling ")[0]
        assert f'fix: model.float(); model.to("{device}")' == code
        exec(code.removeprefix("fix: "), {"model": model})
        assert (3, 4) == tuple(step(model, torch.arange(3)).shape)


@st.composite
def float64_trees(draw: st.DrawFn, depth: int = 3) -> nn.Module:
    """A tree of Sequential and ModuleDict modules over Linear leaves, some holding a
    buffer of their own (so a module and its submodules both hold tensors), some of its
    modules (any level, the root too) cast to float64."""

    def tree(level: int) -> nn.Module:
        if level == 0 or draw(st.booleans()):
            return nn.Linear(1, 1)
        children = [tree(level - 1) for _ in range(draw(st.integers(1, 3)))]
        module: nn.Module
        if draw(st.booleans()):
            module = nn.Sequential(*children)
        else:
            keys = [f"m-{i}" if i % 2 else f"m{i}" for i in range(len(children))]
            module = nn.ModuleDict(dict(zip(keys, children, strict=True)))
        if draw(st.booleans()):
            module.register_buffer("scale", torch.ones(1))
        return module

    model = tree(depth)
    modules = [module for _, module in model.named_modules()]
    for index in draw(st.sets(st.integers(0, len(modules) - 1), min_size=1)):
        modules[index].double()
    return model


@given(float64_trees())
def test_the_casts_kept_cast_every_float64_tensor_and_none_is_under_another(
    model: nn.Module,
) -> None:
    """For any model with float64 modules, the cast lines left (a module's .float() under
    another's dropped) cast every float64 tensor when run, and no module cast is under
    another one cast."""
    found = [(path, t.dtype) for path, t in iter_tensors(model, "obj", modules=True)]
    lines = outermost(dict.fromkeys(module_cast(CPU, p, d) for p, d in found if d == F64))
    exec("; ".join(lines), {"obj": model, "torch": torch})
    assert {F32} == {tensor.dtype for _, tensor in iter_tensors(model, "obj", modules=True)}
    cast = [line.removesuffix(".float()") for line in lines]
    assert not [(a, b) for a in cast for b in cast if a != b and within(a, b)]


@needs_accelerator
def test_a_complex128_buffer_is_cast_alone_by_the_fix() -> None:
    """A complex128 buffer: the fix casts that buffer to complex64 (a module's
    .to(torch.complex64) would make its real tensors complex), then the module moves."""
    with mps_like() as device:
        model = nn.Linear(2, 2)
        model.register_buffer("phase", torch.zeros(2, dtype=C128))
        with pytest.raises(DtypeUnsupportedError) as raised:
            to_device(model, device)
        assert [
            f"to_device() cannot move a tensor to {device}, which holds no torch.complex128:",
            "    torch.complex128 <- obj.phase",
            "fix: obj.phase.data = obj.phase.data.to(torch.complex64) before the move "
            "(dtypes= casts no module's tensors)",
        ] == str(raised.value).splitlines()
        exec(fix_code(str(raised.value)), {"obj": model, "torch": torch})
        to_device(model, device)
        assert {device} == set(find_devices(model))
        assert (F32, torch.complex64) == (model.weight.dtype, model.phase.dtype)


# The cast changes no dtype but those refused


class HalfWithEma(nn.Module):
    """A float16 layer beside a float64 running statistic of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).half()
        self.register_buffer("ema", torch.zeros(4, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)  # type: ignore[no-any-return]


def dtypes_of(module: nn.Module) -> dict[str, torch.dtype]:
    """Each parameter and buffer of ``module`` by name, with its dtype."""
    return {name: t.dtype for name, t in [*module.named_parameters(), *module.named_buffers()]}


@needs_accelerator
def test_a_float64_buffer_beside_float16_weights_is_cast_alone() -> None:
    """A float16 model with a float64 buffer: the fix casts the buffer alone (the
    module's .float() would upcast the float16 weights too); run as written, the weights
    stay float16 and the model moves. The decorator's fix is the same, before its move."""
    with mps_like() as device:
        model = HalfWithEma()
        with pytest.raises(DtypeUnsupportedError) as raised:
            to_device(model, device)
        assert "obj.ema.data = obj.ema.data.to(torch.float32)" == fix_code(str(raised.value))
        exec(fix_code(str(raised.value)), {"obj": model, "torch": torch})
        assert to_device(model, device) is model
        assert {"lin.weight": F16, "lin.bias": F16, "ema": F32} == dtypes_of(model)

        @device_agnostic(device=device)
        def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return model(x)  # type: ignore[no-any-return]

        model = HalfWithEma()
        with pytest.raises(DeviceMismatchError) as mismatch:
            step(model, torch.ones(2, 4, dtype=F16))
        code = str(mismatch.value).splitlines()[-1].partition(" before calling ")[0]
        cast = "model.ema.data = model.ema.data.to(torch.float32)"
        assert f'fix: {cast}; model.to("{device}")' == code
        exec(code.removeprefix("fix: "), {"model": model, "torch": torch})
        assert F16 == step(model, torch.ones(2, 4, dtype=F16)).dtype


class Block(nn.Module):
    """A transformer-like block: a norm, two layers, no tensor of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))  # type: ignore[no-any-return]


def deep_model() -> nn.Sequential:
    """An embedding, 12 blocks and a norm; the root holds no tensor of its own."""
    return nn.Sequential(nn.Embedding(5, 4), nn.Sequential(*(Block() for _ in range(12))))


@needs_accelerator
def test_a_double_model_without_tensors_of_its_own_is_cast_by_its_own_float() -> None:
    """model.double() on a model whose tensors are all in submodules: the fix is the
    model's .float(), one statement, not one per submodule (49 here); run as written,
    it moves. The decorator's fix is the same, before its move."""
    with mps_like() as device:
        model = deep_model().double()
        with pytest.raises(DtypeUnsupportedError) as raised:
            to_device(model, device)
        assert "obj.float()" == fix_code(str(raised.value))
        exec(fix_code(str(raised.value)), {"obj": model})
        assert to_device(model, device) is model
        assert {F32} == set(dtypes_of(model).values())

        @device_agnostic(device=device)
        def step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
            return model(ids)  # type: ignore[no-any-return]

        model = deep_model().double()
        with pytest.raises(DeviceMismatchError) as mismatch:
            step(model, torch.arange(3))
        code = str(mismatch.value).splitlines()[-1].partition(" before calling ")[0]
        assert f'fix: model.float(); model.to("{device}")' == code
        exec(code.removeprefix("fix: "), {"model": model})
        assert (3, 4) == tuple(step(model, torch.arange(3)).shape)


@needs_accelerator
def test_many_tensors_cast_alone_are_cast_by_one_line() -> None:
    """Six float16 modules, each with a float64 buffer: more casts than a fix lists one by
    one, so one line casts every float64 tensor of the model; run as written, the float16
    weights stay float16 and the model moves."""
    with mps_like() as device:
        model = nn.Sequential(*(HalfWithEma() for _ in range(6)))
        with pytest.raises(DtypeUnsupportedError) as raised:
            to_device(model, device)
        assert (
            '[setattr(t, "data", t.data.to(torch.float32)) for t in '
            "[*obj.parameters(), *obj.buffers()] if t.dtype == torch.float64]"
        ) == fix_code(str(raised.value))
        exec(fix_code(str(raised.value)), {"obj": model, "torch": torch})
        assert to_device(model, device) is model
        assert {F16, F32} == set(dtypes_of(model).values())
        assert all(F16 == dtypes_of(model)[f"{i}.lin.weight"] for i in range(6))


@st.composite
def mixed_trees(draw: st.DrawFn, depth: int = 3) -> nn.Module:
    """A tree as :func:`float64_trees` draws, some of its modules then cast to float16,
    some (after) to float64: a float64 tensor may sit beside float16 ones at any level."""
    model = draw(float64_trees(depth))
    modules = [module for _, module in model.named_modules()]
    for index in draw(st.lists(st.integers(0, len(modules) - 1), max_size=3)):
        modules[index].half()
    for index in draw(st.lists(st.integers(0, len(modules) - 1), max_size=2)):
        modules[index].double()
    return model


@needs_accelerator
@given(mixed_trees())
def test_the_casts_change_the_float64_tensors_alone(model: nn.Module) -> None:
    """For any model of float16, float32 and float64 modules, the fix's cast lines, run,
    make every float64 tensor float32 and change no other tensor's dtype; they are at most
    a handful, and no module cast is under another."""
    with mps_like() as device:
        before = dtypes_of(model)
        found = [(path, t.dtype) for path, t in iter_tensors(model, "obj", modules=True)]
        lines = module_casts(device, found, "obj")
        exec("; ".join(lines), {"obj": model, "torch": torch})
    assert {n: F32 if d == F64 else d for n, d in before.items()} == dtypes_of(model)
    assert len(lines) <= 4
    cast = [line.removesuffix(".float()") for line in lines if line.endswith(".float()")]
    assert not [(a, b) for a in cast for b in cast if a != b and within(a, b)]


# What is not refused


@needs_accelerator
def test_a_skipped_module_is_neither_cast_nor_refused() -> None:
    """skip=nn.Module leaves the float64 model where it is, and moves the rest."""
    with mps_like() as device:
        model = float64_stats()
        before = tensors(model)
        moved = to_device({"model": model, "x": torch.ones(2)}, device, skip=nn.Module)
        unchanged(model, before)
        assert moved["model"] is model
        assert ["moved['x']"] == find_devices(moved, name="moved")[device]


@needs_accelerator
def test_a_float32_module_moves_under_every_policy() -> None:
    """A model the device can hold moves whole, with and without dtypes=, and a second
    move of it changes nothing."""
    with mps_like() as device:
        for dtypes in (None, "device", {F64: F32}):
            model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
            assert to_device(model, device, dtypes=dtypes) is model
            assert {device} == set(find_devices(model))
            assert to_device(model, device, dtypes=dtypes) is model


@needs_accelerator
def test_decorator_leaves_a_float64_model_off_the_target_whole() -> None:
    """@device_agnostic never moves a module: a float64 model off the target is refused
    as any module off its target (that message is the decorator's), and left as it was."""
    with mps_like() as device:
        model = float64_stats()
        before = tensors(model)

        @device_agnostic(device=device, dtypes="device")
        def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return x

        with pytest.raises(DeviceMismatchError):
            step(model, torch.ones(2, dtype=F64))
        unchanged(model, before)


@needs_accelerator
def test_the_decorators_fix_casts_before_the_move_and_runs_as_written() -> None:
    """The decorator's fix for a float64 model off a device without float64 casts the
    modules holding float64 before model.to (which alone stops at the first float64
    tensor, the ones before it moved); run as written, the model moves whole and the
    call goes through. Under torch.compile the fix is the same."""
    with mps_like() as device:

        @device_agnostic(device=device, dtypes="device")
        def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return model(x)

        for call in (step, torch.compile(step, backend="eager")):
            model = float64_stats().eval()
            with pytest.raises(DeviceMismatchError) as raised:
                call(model, torch.ones(3, 2))
            fix = str(raised.value).splitlines()[-1]
            code, _, rest = fix.removeprefix("fix: ").partition(" before calling ")
            assert f'model[1].float(); model.to("{device}")' == code
            assert rest.endswith(f"modules are never moved implicitly ({device} holds no {F64})")
            exec(code, {"model": model})
            assert {device} == set(find_devices(model))
            assert (3, 2) == tuple(step(model, torch.ones(3, 2)).shape)


class Rope(nn.Module):
    """Rotary frequencies kept in float64, as some models keep them."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(1.0, 3.0, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.inv_freq.float().sum()


@needs_accelerator
def test_the_fix_for_a_stray_part_casts_it_before_its_move_and_runs_as_written() -> None:
    """A model spread by mistake, its stray part holding float64: on a device without
    float64 the fix casts that part before its .to (which alone would raise), says why,
    and parts the moves after it with "; " too; run as written, the call goes through.
    Under torch.compile (the eager call raises) the fix runs as well."""
    with mps_like() as device:

        @device_agnostic
        def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return model(x)  # type: ignore[no-any-return]

        cast = f'model[2].float(); model[2].to("{device}")'
        for call in (step, torch.compile(step, backend="eager")):
            for off, fix in (((2,), cast), ((1, 2), f'model[1].to("{device}"); {cast}')):
                model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), Rope(), nn.Linear(4, 4))
                for index in {0, 1, 3} - set(off):
                    model[index].to(device)
                with pytest.raises(DeviceMismatchError) as raised:
                    call(model, torch.ones(3, 4))
                code, _, rest = str(raised.value).splitlines()[-1].partition(" before calling ")
                if call is step:
                    assert f"fix: {fix}" == code
                    assert f"implicitly; {device} holds no {F64}), or declare_spread" in rest
                exec(code.removeprefix("fix: "), {"model": model})
                assert {device} == set(find_devices(model))
                assert (3, 4) == tuple(call(model, torch.ones(3, 4)).shape)


class Tasks(nn.Module):
    """A body and a head per task, in a ModuleDict keyed by digits; the first head holds
    float64, the second float32."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.heads = nn.ModuleDict({"0": Rope(), "1": nn.Linear(4, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads["0"](self.body(x))  # type: ignore[no-any-return]


@needs_accelerator
def test_the_cast_names_a_moduledict_entry_by_its_string_key() -> None:
    """The module a cast names is reached as the user reaches it: a ModuleDict's key is a
    string, digits or not (model.heads[0] is a KeyError); run as written, the fix goes."""
    with mps_like() as device:

        @device_agnostic(device=device)
        def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return model(x)  # type: ignore[no-any-return]

        model = Tasks()
        with pytest.raises(DeviceMismatchError) as raised:
            step(model, torch.ones(3, 4))
        code = str(raised.value).splitlines()[-1].partition(" before calling ")[0]
        assert f"""fix: model.heads['0'].float(); model.to("{device}")""" == code
        exec(code.removeprefix("fix: "), {"model": model})
        assert (3, 4) == tuple(step(model, torch.ones(3, 4)).shape)
