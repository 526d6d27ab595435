"""The fixes ``@device_agnostic``'s errors print, followed as written: each one leaves the
arguments as the call needs them, and keeps what the caller had (a tied weight one tensor,
a set a set)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import accelerator
from torch import nn

from devicectx import DeviceMismatchError, MoveError, declare_spread, device_agnostic, to_device
from devicectx.decorator import _mismatch
from devicectx.decorator._target import module_devices, module_dtypes, shared_devices

CPU = torch.device("cpu")
META = torch.device("meta")
needs_accelerator = pytest.mark.requires_device("accelerator")


class Lm(nn.Module):
    """A small language model whose output head is tied to its embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))  # type: ignore[no-any-return]


def tied(model: Lm) -> bool:
    return model.head.weight is model.embed.weight


@device_agnostic
def loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).sum()  # type: ignore[no-any-return]


def fix_of(error: pytest.ExceptionInfo[DeviceMismatchError], before: str) -> str:
    """The code of the error's fix: the fix line up to ``before``."""
    fix = str(error.value).splitlines()[-1]
    assert fix.startswith("fix: ")
    return fix.removeprefix("fix: ").partition(before)[0]


def follow(code: str, **names: Any) -> dict[str, Any]:
    """Run a fix as a user would paste it, with ``to_device`` imported; the names after."""
    scope: dict[str, Any] = {"to_device": to_device, **names}
    exec(code, scope)
    return scope


@contextlib.contextmanager
def module_flags(*, swap: bool = False, overwrite: bool = False) -> Iterator[None]:
    """torch's switches for what ``Module.to`` does with a parameter, set in the block."""
    was = (
        torch.__future__.get_swap_module_params_on_conversion(),
        torch.__future__.get_overwrite_module_params_on_conversion(),
    )
    torch.__future__.set_swap_module_params_on_conversion(swap)
    torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(was[0])
        torch.__future__.set_overwrite_module_params_on_conversion(was[1])


# --- a tied weight: the fix keeps it one tensor ---------------------------------------


def _devices_here() -> list[torch.device]:
    found = [CPU, META]
    if torch.accelerator.is_available():
        found += [accelerator(i) for i in range(min(2, torch.accelerator.device_count()))]
    return found


PAIRS = [
    (source, destination)
    for source in _devices_here()
    for destination in _devices_here()
    if source != destination and source != META  # nothing comes off meta: no data
]


@pytest.mark.parametrize(("source", "destination"), PAIRS, ids=str)
@pytest.mark.parametrize(
    "flags", [{}, {"swap": True}, {"overwrite": True}], ids=["default", "swap", "overwrite"]
)
def test_the_rule_for_when_module_to_unties_is_torchs(
    source: torch.device, destination: torch.device, flags: dict[str, bool]
) -> None:
    """Whether the fix takes module.to for a module holding a tensor twice is what
    torch's Module.to does with it, asked of torch: between every pair of devices here,
    under each of torch's switches for parameters."""
    with torch.device(source):
        model = Lm()  # tied where it is made: a move to the source could untie it
    with module_flags(**flags):
        model.to(destination)
        assert _mismatch.makes_new_parameters(source, destination) == (not tied(model))


def moved_by(path: str, source: torch.device, device: torch.device) -> str:
    """The fix's move of the tied model at ``path`` from ``source`` to ``device``: with
    ``to_device`` where torch's module.to unties it (the emulated accelerator, meta), with
    ``.to`` where torch keeps the tie itself (CUDA, MPS, or under the swap switch)."""
    if _mismatch.makes_new_parameters(source, device):
        return f'to_device({path}, "{device}")'
    return f'{path}.to("{device}")'


@needs_accelerator
def test_a_tied_model_off_an_accelerator_is_moved_by_to_device_and_stays_tied() -> None:
    """A tied model on the CPU for a call on the accelerator, where model.to gives the
    embedding and the head a copy each: the fix moves it with to_device and says why;
    followed, the weight is one tensor on the device and the call runs."""
    device = accelerator()

    @device_agnostic(device=device)
    def step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(ids).sum()  # type: ignore[no-any-return]

    model = Lm()
    with pytest.raises(DeviceMismatchError) as error:
        step(model, torch.arange(3))
    why = (
        " (model.to() would untie its tied weights)"
        if _mismatch.makes_new_parameters(CPU, device)
        else ""
    )
    assert (
        f"fix: {moved_by('model', CPU, device)} before calling {step.__qualname__}(): modules "
        f"are never moved implicitly{why}"
    ) == str(error.value).splitlines()[-1]
    follow(fix_of(error, " before calling"), model=model)
    assert tied(model)
    assert device == model.embed.weight.device
    assert () == step(model, torch.arange(3)).shape


@needs_accelerator
def test_the_fix_of_a_tied_model_off_an_accelerator_runs_as_written() -> None:
    """The message of a tied model on the CPU, off the accelerator (as the decorator builds
    it, from the module's shared tensors): its fix, followed, keeps the weight one tensor,
    and the model runs there."""
    device = accelerator()
    model = Lm()
    error = _mismatch.module_off_target(
        "step",
        "model",
        "Lm",
        module_devices(model, "model"),
        device,
        "@device_agnostic(device=...)",
        dtypes=module_dtypes(model, "model"),
        shared=shared_devices(model),
    )
    fix = str(error).splitlines()[-1]
    assert fix.startswith(f"fix: {moved_by('model', CPU, device)} before calling step(): ")
    follow(fix.removeprefix("fix: ").partition(" before calling")[0], model=model)
    assert tied(model)
    assert () == loss(model, torch.arange(3)).shape


def test_the_fix_of_a_tied_model_off_meta_runs_as_written() -> None:
    """The same on meta, where torch's model.to unties the weight too."""
    model = Lm()
    error = _mismatch.module_off_target(
        "step", "model", "Lm", module_devices(model, "model"), META, "x", shared=(CPU,)
    )
    code = str(error).splitlines()[-1].removeprefix("fix: ").partition(" before calling")[0]
    assert 'to_device(model, "meta")' == code
    follow(code, model=model)
    assert tied(model)
    assert META == model.head.weight.device


def test_a_tied_model_off_meta_is_moved_by_to_device_and_stays_tied() -> None:
    """@device_agnostic(device="meta") and a tied model on the CPU: the fix moves it with
    to_device; followed, the call runs on meta with the weight still one tensor. Under
    torch.compile the fix is the same."""

    @device_agnostic(device="meta")
    def step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(ids).sum()  # type: ignore[no-any-return]

    for call in (step, torch.compile(step, backend="eager")):
        model = Lm()
        with pytest.raises(DeviceMismatchError) as error:
            call(model, torch.arange(3))
        assert fix_of(error, " before calling").startswith("to_device(model")
        follow(fix_of(error, " before calling"), model=model)
        assert tied(model)
        assert META == call(model, torch.arange(3)).device


def test_an_untied_model_keeps_the_plain_fix() -> None:
    """Without a tensor held twice, the fix stays model.to(...)."""
    model = nn.Linear(2, 2)
    error = _mismatch.module_off_target(
        "step", "model", "Linear", module_devices(model, "model"), META, "x", shared=()
    )
    assert str(error).splitlines()[-1].startswith('fix: model.to("meta") before calling step()')


def spread_lm(home: torch.device, tied_on: torch.device) -> Lm:
    """An Lm with its body (most of its elements) on ``home``, the tied embedding and head
    on ``tied_on``: a split made by mistake."""
    with torch.device(tied_on):
        model = Lm()  # tied where it is made: a move there could untie it
    model.body.to(home)
    return model


@pytest.mark.parametrize("home", [pytest.param("accelerator", marks=needs_accelerator), "meta"])
def test_a_tied_pair_left_behind_is_moved_with_the_whole_model_by_to_device(home: str) -> None:
    """The tied embedding and head left on the CPU, the body on the device: moved one by
    one with .to, each would get a copy of its own; the fix moves the model with to_device
    and says why; followed, the weight is one tensor there and the call runs."""
    device = accelerator() if home == "accelerator" else META
    model = spread_lm(device, CPU)
    with pytest.raises(DeviceMismatchError) as error:
        loss(model, torch.arange(3))
    if _mismatch.makes_new_parameters(CPU, device):
        assert (
            f'fix: to_device(model, "{device}") before calling {loss.__qualname__}() (modules '
            "are never moved implicitly; model.to() would untie its tied weights), or "
            "declare_spread(model) if the split is on purpose"
        ) == str(error.value).splitlines()[-1]
    else:  # torch keeps the tie itself (CUDA): the parts alone, as between two devices
        code = f'model.embed.to("{device}"), model.head.to("{device}")'
        assert code == fix_of(error, " before calling")
    follow(fix_of(error, " before calling"), model=model)
    assert tied(model)
    assert device == model.head.weight.device
    assert device == loss(model, torch.arange(3)).device


@needs_accelerator
def test_a_tied_pair_moved_where_module_to_keeps_it_keeps_the_parts_fix() -> None:
    """The tied pair on the accelerator's second device, the body on its first: .to keeps
    the Parameter between two devices of one backend, so the fix still moves the parts
    alone, and followed, keeps them tied."""
    if torch.accelerator.device_count() < 2:
        pytest.skip("needs two devices of the accelerator")
    first, second = accelerator(0), accelerator(1)
    model = spread_lm(first, second)
    with pytest.raises(DeviceMismatchError) as error:
        loss(model, torch.arange(3))
    code = fix_of(error, " before calling")
    assert f'model.embed.to("{first}"), model.head.to("{first}")' == code
    follow(code, model=model)
    assert tied(model)
    assert first == loss(model, torch.arange(3)).device


def test_under_the_overwrite_switch_a_tied_pair_is_moved_by_to_device() -> None:
    """With torch's switch that gives every parameter a new object on conversion, .to
    unties a weight between any devices: the fix moves the model with to_device there too
    (from the CPU to meta, and back within the CPU's type it would as well)."""
    model = spread_lm(META, CPU)
    with module_flags(overwrite=True):
        with pytest.raises(DeviceMismatchError) as error:
            loss(model, torch.arange(3))
        follow(fix_of(error, " before calling"), model=model)
    assert fix_of(error, " before calling").startswith('to_device(model, "meta")')
    assert tied(model)


@needs_accelerator
def test_a_tied_stray_of_a_split_on_purpose_is_moved_by_to_device() -> None:
    """A model split on purpose (a declared part on the CPU and meta, so it starts on the
    CPU) with a tied submodule left on the accelerator: the fix moves that part alone, with
    to_device, which keeps its weight one tensor; followed, the call runs."""
    with torch.device(accelerator()):
        lm = Lm()
    split = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    model = nn.Sequential(declare_spread(split), lm)
    placed = device_agnostic(lambda model, x: x)
    with pytest.raises(DeviceMismatchError) as error:
        placed(model, torch.ones(2))
    code = fix_of(error, " before calling")
    assert moved_by("model[1]", accelerator(), CPU) == code
    if _mismatch.makes_new_parameters(accelerator(), CPU):  # not from CUDA, where .to keeps the tie
        assert str(error.value).endswith(
            "each part where it runs (model[1].to() would untie its tied weights)"
        )
    follow(code, model=model)
    assert tied(lm)
    assert CPU == lm.head.weight.device
    assert CPU == placed(model, torch.ones(2)).device


# --- a stray buffer is named as one -----------------------------------------------------


class Positions(nn.Module):
    """A linear layer and a buffer of positions added to its output."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("pos", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.pos  # type: ignore[no-any-return]


@pytest.mark.parametrize("home", [pytest.param("accelerator", marks=needs_accelerator), "meta"])
def test_a_stray_buffer_is_named_among_parameters_and_buffers(home: str) -> None:
    """A buffer alone off the device the parameters are on: the model is said to have
    parameters and buffers on two devices (not parameters alone); the fix, followed, runs."""
    device = accelerator() if home == "accelerator" else META
    model = Positions().to(device)
    model.pos = torch.zeros(4)  # left on the CPU
    with pytest.raises(DeviceMismatchError) as error:
        loss(model, torch.ones(4))
    assert (
        f"{loss.__qualname__}() got model (Positions) with parameters and buffers on 2 devices:"
    ) == str(error.value).splitlines()[0]
    width = len(str(device))  # "meta", "emu:0": as long as "cpu" or longer
    assert [f"    {device} <- model.proj", f"    {'cpu':<{width}} <- model.pos"] == (
        str(error.value).splitlines()[1:3]
    )
    follow(fix_of(error, " before calling"), model=model)
    assert device == loss(model, torch.ones(4)).device


def test_a_module_of_buffers_alone_is_said_to_have_buffers() -> None:
    """A module holding no parameter, its buffers on two devices: buffers."""
    model = nn.Module()
    model.register_buffer("a", torch.zeros(4, device="meta"))
    model.register_buffer("b", torch.zeros(8, device="meta"))
    model.register_buffer("c", torch.zeros(1))

    @device_agnostic
    def step(model: nn.Module) -> None:
        pass

    with pytest.raises(DeviceMismatchError) as error:
        step(model)
    first = str(error.value).splitlines()[0]
    assert first.endswith("got model (Module) with buffers on 2 devices:")


def test_a_spread_of_parameters_with_buffers_in_place_says_parameters() -> None:
    """Buffers that are where parameters are too add no device: parameters."""
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 4), nn.Linear(4, 4))
    model[2].to("meta")
    with pytest.raises(DeviceMismatchError) as error:
        loss(model, torch.ones(2, 4))
    assert "with parameters on 2 devices:" in str(error.value).splitlines()[0]


# --- a set argument: the fix moves the set ---------------------------------------------


@device_agnostic(move=False)
def count(model: nn.Module, batch: Any) -> int:
    return len(batch)


@pytest.mark.parametrize("kind", [set, frozenset])
def test_a_mismatch_in_a_set_is_fixed_by_moving_the_set_itself(kind: type) -> None:
    """A tensor off the target inside a set: the fix moves the argument (to_device(batch)),
    not list(batch), which would turn it into a list; followed, the body gets a set of
    the same kind, on the target."""
    model = nn.Linear(2, 2, device="meta")
    batch: Any = kind({torch.ones(2, device="meta"), torch.ones(2)})
    with pytest.raises(DeviceMismatchError) as error:
        count(model, batch)
    code = fix_of(error, ", or use @device_agnostic")
    assert 'pass to_device(batch, "meta")' == code
    batch = follow(f"batch = {code.removeprefix('pass ')}", batch=batch)["batch"]
    assert {META} == {tensor.device for tensor in batch}
    assert 2 == count(model, batch)
    assert kind is type(batch)


def test_a_mismatch_in_a_set_nested_in_a_mapping_names_the_argument() -> None:
    """A set inside a dict (list(batch['s'])[0]): the argument is still batch."""
    model = nn.Linear(2, 2, device="meta")
    batch = {"s": frozenset({torch.ones(2)}), "t": torch.ones(2, device="meta")}
    with pytest.raises(DeviceMismatchError) as error:
        count(model, batch)
    code = fix_of(error, ", or use @device_agnostic")
    assert 'pass to_device(batch, "meta")' == code
    batch = follow(f"batch = {code.removeprefix('pass ')}", batch=batch)["batch"]
    assert frozenset is type(batch["s"])
    assert 2 == count(model, batch)


# --- a tied model made anew from meta: the fix ties it again ------------------------------


def meta_fix(model: nn.Module) -> str:
    """The code of the refusal's fix for moving ``model`` (on meta) to the CPU: up to its
    ``, then initialise``."""
    with pytest.raises(MoveError) as raised:
        to_device(model, "cpu")
    fix = str(raised.value).splitlines()[-1]
    assert fix.startswith("fix: ")
    return fix.removeprefix("fix: ").partition(", then initialise")[0].partition(" (to_empty")[0]


def test_the_to_empty_fix_of_a_tied_model_on_meta_ties_it_again() -> None:
    """to_empty gives each place of a tied weight a tensor of its own: the fix assigns the
    tied weight back; followed, then loaded, the model has its one weight again."""
    model = Lm()
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    to_device(model, "meta")
    code = meta_fix(model)
    assert "obj.to_empty(device='cpu'); obj.head.weight = obj.embed.weight" == code
    follow(code, obj=model)
    model.load_state_dict(state)
    assert tied(model)
    assert len(state) - 1 == len(list(model.parameters()))
    assert torch.equal(state["embed.weight"], model.head.weight)


def test_the_to_empty_fix_of_a_tied_transformers_model_calls_tie_weights() -> None:
    """A transformers model ties its own weights: the fix calls its tie_weights()."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=99, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    to_device(model, "meta")
    code = meta_fix(model)
    assert "obj.to_empty(device='cpu'); obj.tie_weights()" == code
    follow(code, obj=model)
    model.load_state_dict(state)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_a_tie_across_two_modules_made_anew_is_assigned_back() -> None:
    """A weight shared by two modules made anew one by one: assigned back across them."""
    first = nn.Embedding(10, 4, device="meta")
    second = nn.Linear(4, 10, bias=False, device="meta")
    second.weight = first.weight
    batch = {"a": first, "b": second}
    with pytest.raises(MoveError) as raised:
        to_device(batch, "cpu")
    code = str(raised.value).splitlines()[-1].removeprefix("fix: ").partition(" (to_empty")[0]
    assert (
        "obj['a'].to_empty(device='cpu'); obj['b'].to_empty(device='cpu'); "
        "obj['b'].weight = obj['a'].weight"
    ) == code
    follow(code, obj=batch)
    assert second.weight is first.weight


def test_an_untied_model_on_meta_keeps_the_plain_to_empty_fix() -> None:
    """Without a tensor held twice, nothing is assigned back."""
    model = nn.Linear(2, 2, device="meta")
    assert "obj.to_empty(device='cpu')" == meta_fix(model)


def test_an_untied_transformers_model_on_meta_is_not_told_to_tie_weights() -> None:
    """tie_weights() is called only where a weight is tied."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=99, n_embd=16, n_layer=1, n_head=2, n_positions=16, tie_word_embeddings=False
    )
    model = transformers.GPT2LMHeadModel(config)
    to_device(model, "meta")
    assert "obj.to_empty(device='cpu')" == meta_fix(model)
