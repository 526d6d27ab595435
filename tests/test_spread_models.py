"""Models spread over several devices: on purpose (accelerate's ``dispatch_model`` and
offloading, transformers' ``device_map``, ``declare_spread``) a call runs where the model
starts; by mistake it stops before the body, naming the stray submodules."""

from __future__ import annotations

import copy
import inspect
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from helpers import accelerator
from hypothesis import given
from hypothesis import strategies as st
from spread_subjects import Net, made
from torch import nn

from devicectx import DeviceMismatchError, declare_spread, device_agnostic, module_placement
from devicectx.decorator._target import Spread, module_device
from devicectx.move._paths import module_path

# The calls repeat a small input on purpose (decorated and undecorated side by side).
pytestmark = pytest.mark.filterwarnings("ignore::devicectx.RepeatedMoveWarning")

CPU = torch.device("cpu")
META = torch.device("meta")


def plain(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The undecorated helper each decorated one is compared with."""
    return model(x)


step = device_agnostic(plain)
step_back = device_agnostic(output="input")(plain)
check = device_agnostic(move=False)(plain)


def lines(error: pytest.ExceptionInfo[DeviceMismatchError]) -> list[str]:
    return str(error.value).splitlines()


def cpu_as(device: torch.device) -> str:
    """``cpu`` padded as the error's column of devices pads it beside ``device``."""
    return "cpu".ljust(len(str(device)))


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """The net's output on the CPU, against one computed on an accelerator (a GPU's kernels
    round differently from the CPU's: equal to float32's tolerance, not bit for bit)."""
    torch.testing.assert_close(actual.cpu(), expected)


# --- accelerate ---------------------------------------------------------------------------


@pytest.mark.requires_device("accelerator")
def test_model_dispatched_over_two_devices_runs_where_its_top_level_hook_runs(
    accelerate: Any, two: tuple[torch.device, torch.device]
) -> None:
    """dispatch_model over two devices: the inputs go where the model starts; the results
    are the undecorated helper's, on the same devices, and the net's before dispatch."""
    first, second = two
    net, x, expected = made()
    model = accelerate.dispatch_model(net, device_map={"embed": 0, "body": 0, "head": 1})

    assert first == module_device(model)
    assert {first: ["model.embed", "model.body"], second: ["model.head"]} == module_placement(model)
    with torch.no_grad():
        there, back = plain(model, x.to(first)), plain(model, x)
        decorated, decorated_back = step(model, x), step_back(model, x)
    assert (first, CPU) == (there.device, back.device)
    assert (first, CPU) == (decorated.device, decorated_back.device)
    assert torch.equal(there, decorated)
    assert torch.equal(back, decorated_back)
    assert_close(decorated_back, expected)


@pytest.mark.requires_device("accelerator")
def test_move_false_checks_the_inputs_against_where_a_dispatched_model_starts(
    accelerate: Any, two: tuple[torch.device, torch.device]
) -> None:
    """move=False: inputs on the model's first device pass; elsewhere, the error says
    which rule chose that device."""
    first, second = two
    net, x, expected = made()
    model = accelerate.dispatch_model(net, device_map={"embed": 0, "body": 0, "head": 1})

    with torch.no_grad():
        assert_close(check(model, x.to(first)).cpu(), expected)
    with pytest.raises(DeviceMismatchError) as error:
        check(model, x)
    assert [
        "plain() got tensors on cpu, not on its target:",
        "    cpu <- x",
        f"target {first} (from model (Net), spread over 2 devices ({first}, {second}) by "
        "accelerate: where its top-level hook runs it)",
        f'fix: pass x.to("{first}"), or use @device_agnostic(move=True) to move the arguments',
    ] == lines(error)
    assert first == error.value.target


@pytest.mark.requires_device("accelerator")
def test_one_device_plus_cpu_offload(accelerate: Any) -> None:
    """A head offloaded to the CPU (its weights on meta, loaded by its hook) is part of the
    model's plan, not a stray: the call runs on the one device, as the undecorated one."""
    first = accelerator(0)
    net, x, expected = made()
    model = accelerate.dispatch_model(net, device_map={"embed": 0, "body": 0, "head": "cpu"})

    assert META == model.head.weight.device  # accelerate's offload, as find_devices sees it
    assert first == module_device(model)
    assert {first: ["model.embed", "model.body"], CPU: ["model.head"]} == module_placement(model)
    with torch.no_grad():
        there, back = plain(model, x.to(first)), plain(model, x)
        decorated, decorated_back = step(model, x), step_back(model, x)
    assert (first, CPU, first, CPU) == tuple(
        t.device for t in (there, back, decorated, decorated_back)
    )
    assert torch.equal(there, decorated)
    assert_close(decorated_back, expected)


@pytest.mark.requires_device("accelerator")
def test_a_model_wholly_offloaded_runs_on_its_execution_device(accelerate: Any) -> None:
    """cpu_offload leaves every weight on meta behind hooks that run on one device: the
    model's device is that one, not meta."""
    first = accelerator(0)
    net, x, expected = made()
    model = accelerate.cpu_offload(net, execution_device=first)

    assert {META} == {p.device for p in model.parameters()}
    assert first == module_device(model)
    with torch.no_grad():
        assert first == step(model, x).device
        assert_close(step_back(model, x), expected)


def test_offloaded_weights_run_on_the_cpu_without_an_accelerator(
    accelerate: Any, tmp_path: Path
) -> None:
    """A model offloaded to the CPU and to disk, computing on the CPU: every weight is on
    meta, and the call runs on the CPU as the undecorated one does."""
    net, x, expected = made()
    device_map = {"embed": "cpu", "body": "cpu", "head": "disk"}
    model = accelerate.dispatch_model(net, device_map=device_map, offload_dir=tmp_path)

    assert META == model.head.weight.device
    assert CPU == module_device(model)
    with torch.no_grad():
        assert_close(step(model, x), expected)
        assert torch.equal(plain(model, x), step_back(model, x))
    cpu_only = accelerate.cpu_offload(made()[0], execution_device="cpu")
    assert CPU == module_device(cpu_only)
    assert {CPU: ["model"]} == module_placement(cpu_only)


@pytest.mark.requires_device("accelerator")
def test_a_part_moved_off_its_hooks_device_is_named(
    accelerate: Any, two: tuple[torch.device, torch.device]
) -> None:
    """A submodule moved after dispatch, off where its hook runs it: refused before the
    body, by its path, with the move that puts it back."""
    first, second = two
    net, x, _ = made()
    model = accelerate.dispatch_model(net, device_map={"embed": 0, "body": 0, "head": 1})
    model.body.to("cpu")

    with pytest.raises(DeviceMismatchError) as error:
        step(model, x)
    assert [
        "plain() got model (Net) spread over 3 devices, 1 part off:",
        f"    {first} <- model.embed",
        f"    {cpu_as(first)} <- model.body (its hook runs it on {first})",
        f"    {second} <- model.head",
        f"target {first} (from model (Net), spread over 3 devices ({first}, cpu, {second}) by "
        "accelerate: where its top-level hook runs it)",
        f'fix: model.body.to("{first}") before calling plain(): each part on the device its '
        "hook runs it on",
    ] == lines(error)


@pytest.mark.requires_device("accelerator")
def test_a_submodule_left_behind_without_hooks_is_named() -> None:
    """No hooks, nothing declared: a head added on the CPU to a model on the accelerator is
    a mistake, named with the move of that head alone."""
    first = accelerator(0)
    model = Net().to(first)
    model.head = nn.Linear(8, 2)  # forgotten on the CPU

    with pytest.raises(DeviceMismatchError) as error:
        step(model, torch.ones(3, 4))
    assert [
        "plain() got model (Net) with parameters on 2 devices:",
        f"    {first} <- model.embed, model.body",
        f"    {cpu_as(first)} <- model.head",
        f"target {first} (from the device holding the largest share of model (Net)'s "
        "parameter and buffer elements, 112 of 130; nothing says it is spread on purpose: "
        "no accelerate hook, no declare_spread)",
        f'fix: model.head.to("{first}") before calling plain() (modules are never moved '
        "implicitly), or declare_spread(model) if the split is on purpose",
    ] == lines(error)


# --- transformers -------------------------------------------------------------------------

DEVICE_MAP = {
    "transformer.wte": 0,
    "transformer.wpe": 0,
    "transformer.drop": 0,
    "transformer.h.0": 0,
    "transformer.h.1": 1,
    "transformer.ln_f": 1,
    "lm_head": 0,  # with the embedding tied to it: a GPU computes with both on one device
}


@pytest.fixture
def gpt2() -> tuple[nn.Module, torch.Tensor]:
    """A tiny GPT-2 made from a config (nothing downloaded), in eval mode, and some ids."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    return model, torch.randint(1, 64, (2, 5))


def generate(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Greedy generation: the same tokens for the same weights, on any device."""
    return model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)  # type: ignore[no-any-return, operator]


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits  # type: ignore[no-any-return]


def same_as_undecorated(
    model: nn.Module, ids: torch.Tensor, helper: Callable[[nn.Module, torch.Tensor], Any]
) -> None:
    """The decorated helper gives what the undecorated one gives, on the same device: with
    the ids where the model starts, and (``output="input"``) with ids on the CPU."""
    first = accelerator(0)
    with torch.no_grad():
        there, back = helper(model, ids.to(first)), helper(model, ids)
        decorated = device_agnostic(helper)(model, ids.to(first))
        decorated_back = device_agnostic(output="input")(helper)(model, ids)
    assert (first, CPU) == (there.device, back.device)
    assert (there.device, back.device) == (decorated.device, decorated_back.device)
    assert torch.equal(there, decorated)
    assert torch.equal(back, decorated_back)


@pytest.mark.requires_device("accelerator")
def test_gpt2_spread_by_a_device_map_forwards_and_generates_as_undecorated(
    accelerate: Any, gpt2: tuple[nn.Module, torch.Tensor], two: tuple[torch.device, torch.device]
) -> None:
    """A GPT-2 dispatched over two devices: decorated forward and generate helpers return
    exactly what the undecorated ones do, on the same devices, and the tokens the model
    generated before it was spread."""
    model, ids = gpt2
    with torch.no_grad():
        tokens = generate(model, ids)
    spread = accelerate.dispatch_model(model, device_map=DEVICE_MAP)

    assert two[0] == module_device(spread)
    same_as_undecorated(spread, ids, logits)
    same_as_undecorated(spread, ids, generate)
    with torch.no_grad():
        assert torch.equal(tokens, device_agnostic(output="input")(generate)(spread, ids))


@pytest.mark.requires_device("accelerator")
def test_gpt2_loaded_with_a_device_map(
    gpt2: tuple[nn.Module, torch.Tensor], two: tuple[torch.device, torch.device], tmp_path: Path
) -> None:
    """transformers' from_pretrained(device_map=...) (from a checkpoint saved here): the
    model runs where its device map starts it; its placement groups what hf_device_map
    says."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    first, second = two
    gpt2[0].save_pretrained(tmp_path)
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, device_map=DEVICE_MAP).eval()

    assert DEVICE_MAP == model.hf_device_map
    assert first == module_device(model)
    assert {
        first: [
            "model.transformer.wte",
            "model.transformer.wpe",
            "model.transformer.h[0]",
            "model.lm_head",
        ],
        second: ["model.transformer.h[1]", "model.transformer.ln_f"],
    } == module_placement(model)
    same_as_undecorated(model, gpt2[1], generate)


@pytest.mark.requires_device("accelerator")
def test_gpt2_with_a_forgotten_submodule_is_refused_by_its_path(
    accelerate: Any, gpt2: tuple[nn.Module, torch.Tensor], two: tuple[torch.device, torch.device]
) -> None:
    """An MLP moved to the CPU after dispatch: refused before the body, by its path, with
    the move of that MLP alone."""
    first, second = two
    model = accelerate.dispatch_model(gpt2[0], device_map=DEVICE_MAP)
    model.transformer.h[1].mlp.to("cpu")

    with pytest.raises(DeviceMismatchError) as error:
        device_agnostic(logits)(model, gpt2[1])
    assert [
        "logits() got model (GPT2LMHeadModel) spread over 3 devices, 1 part off:",
        f"    {first} <- model.transformer.wte, model.transformer.wpe, model.transformer.h[0], "
        "model.lm_head",
        f"    {second} <- model.transformer.h[1].ln_1, model.transformer.h[1].attn, "
        "model.transformer.h[1].ln_2, model.transformer.ln_f",
        f"    {cpu_as(first)} <- model.transformer.h[1].mlp (its hook runs it on {second})",
        f"target {first} (from model (GPT2LMHeadModel), spread over 3 devices ({first}, "
        f"{second}, cpu) by accelerate: where its top-level hook runs it)",
        f'fix: model.transformer.h[1].mlp.to("{second}") before calling logits(): each part '
        "on the device its hook runs it on",
    ] == lines(error)


@pytest.mark.requires_device("accelerator")
def test_gpt2_with_its_tied_head_split_from_the_embedding_is_refused_before_the_body(
    accelerate: Any, gpt2: tuple[nn.Module, torch.Tensor], two: tuple[torch.device, torch.device]
) -> None:
    """GPT-2's head shares the token embedding's weight: a device map giving them two
    devices fails in torch undecorated, and is refused before the body decorated, with the
    fix in the device map."""
    first, second = two
    model = accelerate.dispatch_model(gpt2[0], device_map={**DEVICE_MAP, "lm_head": 1})
    with torch.no_grad(), pytest.raises(RuntimeError, match="same device"):
        logits(model, gpt2[1].to(first))

    with pytest.raises(DeviceMismatchError) as error:
        device_agnostic(logits)(model, gpt2[1])
    kept = model.lm_head.weight.device
    stray, partner = (
        ("transformer.wte", "lm_head") if kept == second else ("lm_head", "transformer.wte")
    )
    assert f"model.{stray} (its hook runs it on" in str(error.value)
    assert (
        f"fix: model.{stray} shares its weight with model.{partner} (tied): give them one "
        'device in the device map (device_map="auto" keeps tied weights together)'
    ) == lines(error)[-1]


@pytest.mark.torch_internals  # dynamo traces the call: on every minor torch release
@pytest.mark.requires_device("accelerator")
def test_a_dispatched_model_under_torch_compile_is_served_by_the_eager_call(
    accelerate: Any, two: tuple[torch.device, torch.device]
) -> None:
    """Traced by torch.compile, the decorated call breaks the graph and runs eagerly, where
    the model is served: the same result as without compile. With fullgraph=True, torch's
    error quotes why and the fix (where its graph_break takes a message: not 2.6)."""
    first, _ = two
    net, x, expected = made()
    model = accelerate.dispatch_model(net, device_map={"embed": 0, "body": 0, "head": 1})
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(step, backend="eager")(model, x)
    assert first == compiled.device
    assert_close(compiled, expected)

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported) as error:
        torch.compile(step, fullgraph=True, backend="eager")(model, x)
    if "msg" in inspect.signature(torch._dynamo.graph_break).parameters:
        assert (
            "plain() got model (Net) placed by accelerate's hooks or declare_spread, its "
            f"weights on {first}, {two[1]}: @device_agnostic serves such a model in eager "
            "code only"
        ) in str(error.value)
        assert (
            "fix: compile without fullgraph=True / export with strict=False (this call then "
            "runs eagerly)" in str(error.value)
        )


@pytest.mark.torch_internals
@pytest.mark.requires_device("accelerator")
def test_a_model_wholly_offloaded_under_torch_compile_runs_on_its_execution_device(
    accelerate: Any,
) -> None:
    """cpu_offload leaves every weight on meta behind its hooks: traced, the call is
    served eagerly, on the execution device, not sent to meta."""
    first = accelerator(0)
    net, x, expected = made()
    model = accelerate.cpu_offload(net, execution_device=first)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(step, backend="eager")(model, x)
    assert first == compiled.device
    assert_close(compiled, expected)


@pytest.mark.torch_internals
def test_a_declared_split_under_torch_compile_is_served_by_the_eager_call() -> None:
    """declare_spread's model, traced: the call runs eagerly, where it is served (its
    inputs sent where it starts), on every torch; a split by mistake is still refused."""
    torch._dynamo.reset()
    out = torch.compile(step, backend="eager")(declare_spread(Split()), torch.ones(2))
    assert META == out.device
    torch._dynamo.reset()
    with pytest.raises(DeviceMismatchError):
        torch.compile(step, backend="eager")(Split(), torch.ones(2))


class Tied(nn.Module):
    """A language model's shape in small: the output layer shares the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


@pytest.mark.requires_device("accelerator")
def test_a_tied_weight_split_by_a_device_map_is_refused_before_the_body(
    accelerate: Any, two: tuple[torch.device, torch.device]
) -> None:
    """A device map that puts the two modules of a tied weight on two devices: accelerate
    leaves the one weight on one of them, and the other module's call fails in torch. The
    decorated call is refused first, naming the module off its hook's device and the one
    it shares the weight with, and the fix is in the device map, not a move (which would
    move the other module's weight too)."""
    first, second = two
    model = accelerate.dispatch_model(Tied(), device_map={"embed": 0, "body": 1, "head": 1})
    ids = torch.tensor([[1, 2, 3]])
    assert model.embed.weight is model.head.weight
    assert first == model.head.weight.device  # where accelerate left it (on embed's device)
    with torch.no_grad(), pytest.raises(RuntimeError, match="same device"):
        plain(model, ids.to(first))  # undecorated: torch's own error, in head's call
    ran = []

    @device_agnostic
    def forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        ran.append(ids)
        return model(ids)

    with pytest.raises(DeviceMismatchError) as error:
        forward(model, ids)
    assert not ran
    message = lines(error)
    assert message[0].endswith(".forward() got model (Tied) spread over 2 devices, 1 part off:")
    assert [
        f"    {first} <- model.embed, model.head (its hook runs it on {second})",
        f"    {second} <- model.body",
        f"target {first} (from model (Tied), spread over 2 devices ({first}, {second}) by "
        "accelerate: where its top-level hook runs it)",
        "fix: model.head shares its weight with model.embed (tied): give them one device in "
        'the device map (device_map="auto" keeps tied weights together)',
    ] == message[1:]


@pytest.mark.requires_device("accelerator")
def test_a_tied_weight_kept_on_one_device_runs_wherever_the_rest_is(
    accelerate: Any, two: tuple[torch.device, torch.device]
) -> None:
    """The same model with both modules of the tied weight on one device, the rest on
    the other: in place, and the decorated call gives the undecorated one's result."""
    first, second = two
    torch.manual_seed(0)
    model = accelerate.dispatch_model(Tied(), device_map={"embed": 1, "body": 0, "head": 1})
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        expected = plain(model, ids.to(module_device(model)))
        decorated = step(model, ids)
    assert expected.device == decorated.device
    assert torch.equal(expected, decorated)
    assert {second: ["model.embed", "model.head"], first: ["model.body"]} == (
        module_placement(model)
    )


# --- declared splits ----------------------------------------------------------------------


class Split(nn.Module):
    """A hand-made pipeline: a stage on the CPU, a stage on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(2, 2)
        self.second = nn.Linear(2, 2, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x).to("meta"))


def test_a_declared_split_runs_where_its_first_parameter_is() -> None:
    """declare_spread: the split is trusted, and the inputs go where its first parameter
    is; the declaration survives a deep copy and a pickle."""
    model = declare_spread(Split())

    assert CPU == module_device(model)
    assert META == check(model, torch.ones(2)).device  # move=False: x is where it starts
    with torch.device("meta"), pytest.raises(DeviceMismatchError):
        check(model, torch.ones(2))
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert CPU == module_device(twin)
    assert {CPU: ["model.first"], META: ["model.second"]} == module_placement(model)


def test_a_declared_split_with_inputs_says_so_when_move_false_refuses() -> None:
    """declare_spread(inputs=...) names where the inputs go; move=False checks against it
    and says which rule chose it."""
    model = declare_spread(Split(), inputs="meta")

    assert META == module_device(model)
    with pytest.raises(DeviceMismatchError) as error:
        check(model, torch.ones(2))
    assert [
        "plain() got tensors on cpu, not on its target:",
        "    cpu <- x",
        "target meta (from model (Split), spread over 2 devices (cpu, meta) on purpose: "
        'declare_spread(model, inputs="meta"))',
        'fix: pass x.to("meta"), or use @device_agnostic(move=True) to move the arguments',
    ] == lines(error)


def test_declaring_a_refused_model_is_seen_at_the_next_call() -> None:
    """A split refused as a mistake, then declared: the next call runs (the cached verdict
    is dropped by the declaration, though no tensor moved)."""
    model = Split()
    with pytest.raises(DeviceMismatchError):
        step(model, torch.ones(2))
    declare_spread(model)
    assert META == step(model, torch.ones(2)).device


def test_a_declared_part_of_a_model_covers_only_that_part() -> None:
    """A declared submodule is trusted and chooses where the model starts; the rest of the
    model must be there, and a stray in it is still named."""
    model = nn.Sequential(nn.Identity(), declare_spread(Split()), nn.Linear(2, 2))
    placed = device_agnostic(lambda model, x: x)

    assert CPU == module_device(model)
    assert CPU == placed(model, torch.ones(2)).device
    model[2].to("meta")
    with pytest.raises(DeviceMismatchError) as error:
        placed(model, torch.ones(2))
    assert [
        'fix: model[2].to_empty(device="cpu") before calling '
        "test_a_declared_part_of_a_model_covers_only_that_part.<locals>.<lambda>(): each part "
        "where it runs (then load or initialise its weights: model[2]'s tensors on meta hold "
        "no data)"
    ] == lines(error)[-1:]
    assert "    meta <- model[1].second, model[2] (off where model starts, cpu)" in lines(error)


def test_a_mistake_against_device_option_lists_each_stray_or_moves_the_model() -> None:
    """With device= naming the target, the strays are what is off it: named one by one
    where they are few, the whole model's move where most of it is off."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].to("meta")
    on_meta = device_agnostic(device="meta")(plain)
    with pytest.raises(DeviceMismatchError) as error:
        on_meta(model, torch.ones(2))
    assert [
        "plain() got model (Sequential) with parameters on 2 devices:",
        "    meta <- model[0]",
        "    cpu  <- model[1], model[2], model[3]",
        'target meta (from @device_agnostic(device="meta"))',
        'fix: model[1].to("meta"), model[2].to("meta"), model[3].to("meta") before calling '
        "plain() (modules are never moved implicitly), or declare_spread(model) if the split "
        "is on purpose",
    ] == lines(error)
    model.append(nn.Linear(2, 2))
    with pytest.raises(DeviceMismatchError) as error:
        on_meta(model, torch.ones(2))
    assert lines(error)[-1].startswith('fix: model.to("meta") before calling plain()')


# --- properties ---------------------------------------------------------------------------


@st.composite
def module_trees(draw: st.DrawFn, depth: int = 2) -> nn.Module:
    """A module with parameters and buffers on the CPU or meta, and children (some shared)."""
    module = nn.Module()
    for i in range(draw(st.integers(0, 2))):
        device = draw(st.sampled_from(["cpu", "meta"]))
        size = draw(st.integers(1, 3))
        module.register_parameter(f"p{i}", nn.Parameter(torch.zeros(size, device=device)))
    if draw(st.booleans()):
        module.register_buffer("b", torch.zeros(1, device=draw(st.sampled_from(["cpu", "meta"]))))
    children: list[nn.Module] = []
    for i in range(draw(st.integers(0, 2)) if depth else 0):
        shared = bool(children) and draw(st.booleans())
        child = children[-1] if shared else draw(module_trees(depth - 1))
        children.append(child)
        module.add_module(f"c{i}", child)
    return module


def _places(module: nn.Module) -> list[tuple[str, torch.device]]:
    """Every parameter and buffer at each place it is held, as the messages write it."""
    named = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    return [(module_path("model", path), tensor.device) for path, tensor in named]


def _under(path: str, part: str) -> bool:
    return path == part or path.startswith((f"{part}.", f"{part}["))


@given(module=module_trees())
def test_the_placement_puts_each_tensor_under_one_part_on_its_device(module: nn.Module) -> None:
    """module_placement partitions a module: every tensor, at each place it is held, is
    under exactly one listed part, and that part is listed on the tensor's device."""
    placement = module_placement(module)
    parts = [(part, device) for device, paths in placement.items() for part in paths]
    for path, device in _places(module):
        holding = [(part, on) for part, on in parts if _under(path, part)]
        assert [device] == [on for _, on in holding], (path, placement)


@given(module=module_trees())
def test_a_split_made_by_mistake_names_what_is_off_the_largest_share(module: nn.Module) -> None:
    """A module spread by mistake is refused; the error's listing is its placement, and
    the target is the device holding most of its elements."""
    counts: dict[torch.device, int] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        counts[tensor.device] = counts.get(tensor.device, 0) + tensor.numel()
    if len(counts) < 2:
        assert Spread.SPREAD != module_device(module)
        return
    assert Spread.SPREAD == module_device(module)
    with pytest.raises(DeviceMismatchError) as error:
        step(module, torch.ones(1))
    home = error.value.target
    assert max(counts.values()) == counts[home]  # type: ignore[index]
    assert {d: sorted(p) for d, p in module_placement(module).items()} == {
        d: sorted(p) for d, p in error.value.devices.items()
    }


class Heads(nn.Module):
    """A body and a head per task, in a ModuleDict keyed by digits (strings still)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.heads = nn.ModuleDict({"0": nn.Linear(4, 2), "1": nn.Linear(4, 2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads["1"](self.body(x))  # type: ignore[no-any-return]


@pytest.mark.torch_internals
def test_a_stray_keyed_by_digits_is_named_by_its_key_under_torch_compile() -> None:
    """A head left behind under the ModuleDict key "1" is model.heads['1'] (heads[1] is
    a KeyError): traced or not, each path the error lists reaches what it names, and its
    fix, run as written, lets the call through. With fullgraph=True, torch's error quotes
    the traced message, which lists the head's tensors by the same paths."""
    for fullgraph in (False, True):
        model = Heads()
        model.body.to("meta")
        model.heads["0"].to("meta")
        torch._dynamo.reset()
        compiled = torch.compile(step, backend="eager", fullgraph=fullgraph)
        raised = torch._dynamo.exc.Unsupported if fullgraph else DeviceMismatchError
        with pytest.raises(raised) as error:
            compiled(model, torch.ones(3, 4))
        if fullgraph:
            if "msg" in inspect.signature(torch._dynamo.graph_break).parameters:
                assert "cpu  <- model.heads['1'].weight, model.heads['1'].bias" in str(error.value)
            continue
        assert isinstance(error.value, DeviceMismatchError)
        for device, paths in error.value.devices.items():
            for path in paths:
                found = eval(path, {"model": model})
                tensors = [found] if isinstance(found, torch.Tensor) else [*found.parameters()]
                assert {device} == {tensor.device for tensor in tensors}, path
        code = str(error.value).splitlines()[-1].removeprefix("fix: ")
        exec(code.partition(" before calling ")[0], {"model": model})
        assert META == compiled(model, torch.ones(3, 4)).device
