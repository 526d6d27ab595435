"""Models accelerate dispatched or offloaded, then moved: gathered onto one device behind
hooks that still run a part elsewhere, stopped before the body; an offloaded model refused
by ``to_device`` before anything moves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import accelerator
from spread_subjects import made
from torch import nn

from devicectx import (
    DeviceMismatchError,
    MoveError,
    device_agnostic,
    find_devices,
    module_placement,
    to_device,
)
from devicectx.decorator._target import module_device

pytestmark = pytest.mark.filterwarnings("ignore::devicectx.RepeatedMoveWarning")

CPU = torch.device("cpu")
META = torch.device("meta")


class Scale(nn.Module):
    """A stage holding a buffer alone (a normaliser): ``module.to`` moves it first."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s


ran: list[torch.device] = []


@device_agnostic
def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Runs the model where it starts, noting that the body ran."""
    ran.append(x.device)
    return model(x)  # type: ignore[no-any-return]


def devices_of(model: nn.Module) -> set[torch.device]:
    """Where the model's parameters and buffers are."""
    return {t.device for t in (*model.parameters(), *model.buffers())}


# --- a dispatched model gathered onto one device ------------------------------------------

GATHER: dict[str, Callable[[nn.Module, torch.device], object]] = {
    "its part moved": lambda model, first: model.head.to(first),  # type: ignore[operator]
    "model.to": lambda model, first: model.to(first),
}


@pytest.mark.requires_device("accelerator")
@pytest.mark.parametrize("how", list(GATHER))
def test_a_dispatched_model_gathered_onto_one_device_is_stopped_before_the_body(
    accelerate: Any, two: tuple[torch.device, torch.device], how: str
) -> None:
    """Every weight moved onto one device, the head's hook still running it on the other:
    refused before the body, naming the head and its hook's device; the printed fix, applied
    as written, makes the call run as before the move."""
    first, second = two
    net, x, expected = made()
    model = accelerate.dispatch_model(net, device_map={"embed": 0, "body": 0, "head": 1})
    step(model, x)  # a call before the move: its cached verdict must not outlive the move
    GATHER[how](model, first)
    assert {first} == devices_of(model)
    ran.clear()

    with pytest.raises(DeviceMismatchError) as error:
        step(model, x)
    assert [] == ran
    message = str(error.value).splitlines()
    assert f"step() got model (Net) on {first}, 1 part off:" == message[0]
    assert [
        f"    {first} <- model.embed, model.body, model.head (its hook runs it on {second})",
        f"target {first} (from model (Net), spread over 1 device ({first}) by accelerate: "
        "where its top-level hook runs it)",
        f'fix: model.head.to("{second}") before calling step(): each part on the device its '
        "hook runs it on",
    ] == message[1:]

    model.head.to(second)  # the fix, as printed
    with torch.no_grad():
        torch.testing.assert_close(step(model, x).cpu(), expected)
    assert [first] == ran


@pytest.mark.torch_internals  # dynamo traces the call: on every minor torch release
@pytest.mark.requires_device("accelerator")
def test_a_gathered_model_under_torch_compile_is_stopped_by_the_eager_call(
    accelerate: Any, two: tuple[torch.device, torch.device]
) -> None:
    """Traced by torch.compile, a gathered model breaks the graph as a spread one does, and
    the eager call stops it before the body with the same error (torch's device error came
    from inside the hook); once the fix is applied, the compiled call runs. A model whose
    hooks all run where its weights are is traced as any."""
    first, second = two
    net, x, expected = made()
    model = accelerate.dispatch_model(net, device_map={"embed": 0, "body": 0, "head": 1})
    model.to(first)
    ran.clear()
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="eager")

    with pytest.raises(DeviceMismatchError) as error, torch.no_grad():
        compiled(model, x)
    assert [] == ran
    assert str(error.value).splitlines()[-1].startswith(f'fix: model.head.to("{second}") before')

    model.head.to(second)  # the fix, as printed
    with torch.no_grad():
        torch.testing.assert_close(compiled(model, x).cpu(), expected)

    placed = accelerate.dispatch_model(made()[0], device_map={"": 0}, force_hooks=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(placed, x).cpu(), expected)


@pytest.mark.requires_device("accelerator")
def test_a_submodule_of_a_gathered_model_is_stopped_too(
    accelerate: Any, two: tuple[torch.device, torch.device]
) -> None:
    """A hooked submodule passed alone, moved off its hook's device onto the one the rest
    of the model is on, is refused as the argument it came in."""
    first, second = two
    net, _, _ = made()
    model = accelerate.dispatch_model(net, device_map={"embed": 0, "body": 0, "head": 1})
    model.head.to(first)

    with pytest.raises(DeviceMismatchError) as error:
        step(model.head, torch.ones(3, 8))
    assert str(error.value).splitlines()[-1].startswith(f'fix: model.to("{second}") before')


@pytest.mark.requires_device("accelerator")
def test_a_model_hooked_on_one_device_with_its_weights_there_runs_as_any(
    accelerate: Any,
) -> None:
    """Hooks that run every part where its weights are (a device map of one device, hooks
    forced) change nothing: the model's device is that one."""
    first = accelerator(0)
    net, x, expected = made()
    model = accelerate.dispatch_model(net, device_map={"": 0}, force_hooks=True)

    assert first == module_device(model)
    with torch.no_grad():
        torch.testing.assert_close(step(model, x).cpu(), expected)


@pytest.mark.requires_device("accelerator")
def test_a_model_offloaded_with_hook_runs_wherever_its_hook_left_it(accelerate: Any) -> None:
    """cpu_offload_with_hook moves the whole model to its execution device at each forward
    and leaves it there: on the CPU or on the device, it is in place."""
    first = accelerator(0)
    torch.manual_seed(0)
    encoder, decoder = nn.Linear(4, 8), nn.Linear(8, 2)
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = decoder(encoder(x))
    encoder, hook = accelerate.cpu_offload_with_hook(encoder, execution_device=first)
    decoder, _ = accelerate.cpu_offload_with_hook(
        decoder, execution_device=first, prev_module_hook=hook
    )

    @device_agnostic(output="input")
    def run(encoder: nn.Module, decoder: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return decoder(encoder(x))  # type: ignore[no-any-return]

    with torch.no_grad():
        for _ in range(2):  # the encoder on the CPU, then offloaded back there by the decoder
            torch.testing.assert_close(run(encoder, decoder, x), expected)


# --- an offloaded model moved by to_device -------------------------------------------------


@pytest.mark.requires_device("accelerator")
def test_to_device_refuses_a_cpu_offloaded_model_before_anything_moves(
    accelerate: Any, two: tuple[torch.device, torch.device]
) -> None:
    """cpu_offload keeps the weights on meta behind hooks and patches no ``.to``: the move
    is refused before its buffer stage moves, and the printed way to move it works."""
    first, second = two
    torch.manual_seed(0)
    net = nn.Sequential(Scale(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = net(x)
    model = accelerate.cpu_offload(net, execution_device=first)
    before = find_devices(model)

    with pytest.raises(MoveError) as error:
        to_device(model, second)
    assert before == find_devices(model)
    assert [
        f"to_device() cannot move obj (a Sequential) to {second}, and moved nothing: accelerate "
        f"offloaded it (its hooks load its weights onto {first} at each forward; the module "
        "holds them on meta):",
        "    obj[1] (Linear): weight, bias",
        "fix: leave it where it is: do not move obj; or, to move it, first remove accelerate's "
        "hooks, which puts the weights back in it: from accelerate.hooks import "
        "remove_hook_from_module; remove_hook_from_module(obj, recurse=True)",
    ] == str(error.value).splitlines()

    accelerate.hooks.remove_hook_from_module(model, recurse=True)  # the fix, as printed
    to_device(model, second)
    assert {second} == devices_of(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x.to(second)).cpu(), expected)


def test_to_device_refuses_a_model_offloaded_on_the_cpu_with_the_way_to_move_it(
    accelerate: Any,
) -> None:
    """Without an accelerator: a model offloaded to compute on the CPU is refused a move
    with accelerate's way out, not torch's to_empty (which would drop its weights); that
    way, applied, moves it with its weights."""
    torch.manual_seed(0)
    net = nn.Sequential(Scale(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = net(x)
    model = accelerate.cpu_offload(net, execution_device=CPU)
    before = find_devices(model)

    with pytest.raises(MoveError) as error:
        to_device(model, CPU)
    assert before == find_devices(model)
    message = str(error.value).splitlines()
    assert message[0].endswith(
        "and moved nothing: accelerate offloaded it (its hooks load its weights onto cpu at "
        "each forward; the module holds them on meta):"
    )
    assert message[-1].endswith("remove_hook_from_module(obj, recurse=True)")

    accelerate.hooks.remove_hook_from_module(model, recurse=True)
    to_device(model, CPU)
    assert {CPU} == devices_of(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected)


@pytest.mark.requires_device("accelerator")
def test_to_device_refuses_a_model_dispatched_with_offloaded_parts_by_the_same_rule(
    accelerate: Any, two: tuple[torch.device, torch.device]
) -> None:
    """dispatch_model with a part offloaded to the CPU: refused before anything moves, with
    the same message, naming the offloaded part; removing the hooks lets it move."""
    first, second = two
    net, x, expected = made()
    model = accelerate.dispatch_model(net, device_map={"embed": 0, "body": "cpu", "head": 1})
    before = find_devices(model)

    with pytest.raises(MoveError) as error:
        to_device({"model": model}, second)
    assert before == find_devices(model)
    message = str(error.value).splitlines()
    assert f"load its weights onto {first} at each forward" in message[0]
    assert "    obj['model'].body (Linear): weight, bias" == message[1]
    assert message[-1].endswith("remove_hook_from_module(obj['model'], recurse=True)")

    accelerate.hooks.remove_hook_from_module(model, recurse=True)
    to_device(model, second)
    assert {second: ["model"]} == module_placement(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x.to(second)).cpu(), expected)


# --- a dispatched model moved by to_device -------------------------------------------------


@pytest.mark.requires_device("accelerator")
@pytest.mark.parametrize("onto", [0, 1, "cpu"])
def test_to_device_refuses_a_dispatched_model_and_its_fix_moves_it(
    accelerate: Any, two: tuple[torch.device, torch.device], onto: int | str
) -> None:
    """A model dispatched over two devices, moved whole onto one (or the CPU): refused
    before anything moves, naming each part whose hook runs it elsewhere (gathered, its
    hooks would send those parts their inputs on the other device, and torch would fail
    at the next forward); the printed fix, applied as written, moves it and it runs."""
    net, x, expected = made()
    model = accelerate.dispatch_model(net, device_map={"embed": 0, "body": 0, "head": 1})
    target = CPU if onto == "cpu" else two[int(onto)]
    before = find_devices(model)

    with pytest.raises(MoveError) as error:
        to_device(model, target)
    assert before == find_devices(model)
    message = str(error.value).splitlines()
    assert message[0] == (
        f"to_device() cannot move obj (a Net) to {target}, and moved nothing: accelerate "
        "dispatched it (at each forward, each part's hook moves its inputs to the device it "
        "names, so a part moved off that device would fail there, in torch):"
    )
    hooks = {"obj": "", "obj.embed": "", "obj.body": "", "obj.head": ""}
    for path in hooks:
        part = model.get_submodule(path[4:]) if path != "obj" else model
        hooks[path] = str(part._hf_hook.execution_device)
    away = [
        f"    {path} ({type(model.get_submodule(path[4:])).__name__}): its hook runs it on "
        f"{accelerator(int(device)) if device.isdigit() else device}"
        for path, device in hooks.items()
        if (accelerator(int(device)) if device.isdigit() else torch.device(device)) != target
    ]
    assert away == message[1:-1]
    assert message[-1] == (
        "fix: leave it where it is: do not move obj; or, to move it, first remove "
        "accelerate's hooks: from accelerate.hooks import remove_hook_from_module; "
        "remove_hook_from_module(obj, recurse=True)"
    )

    accelerate.hooks.remove_hook_from_module(model, recurse=True)  # the fix, as printed
    to_device(model, target)
    assert {target} == devices_of(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x.to(target)).cpu(), expected)


@pytest.mark.requires_device("accelerator")
def test_to_device_of_a_batch_holding_a_dispatched_model_leaves_it_by_skip(
    accelerate: Any, two: tuple[torch.device, torch.device]
) -> None:
    """Inside a structure the fix is skip= at the model's path, which moves the rest and
    leaves the model where accelerate put it; a model on its hooks' devices is no bother."""
    first, _ = two
    net, x, expected = made()
    model = accelerate.dispatch_model(net, device_map={"embed": 0, "body": 0, "head": 1})
    batch = {"model": model, "x": x}

    with pytest.raises(MoveError) as error:
        to_device(batch, first)
    assert [CPU] == list(find_devices(x))
    fix = str(error.value).splitlines()[-1]
    assert fix.startswith(
        f"fix: leave it where it is: to_device(obj, {str(first)!r}, skip=[\"obj['model']\"]); "
        "or, to move it"
    )

    moved = to_device(batch, first, skip=["obj['model']"])
    assert moved["model"] is model
    assert first == moved["x"].device
    with torch.no_grad():
        torch.testing.assert_close(model(moved["x"]).cpu(), expected)


@pytest.mark.requires_device("accelerator")
def test_to_device_moves_a_model_hooked_where_the_move_takes_it(accelerate: Any) -> None:
    """Hooks that run every part on the target (a device map of one device, hooks forced)
    are no reason to refuse: a module already there is not moved, its hooks kept."""
    first = accelerator(0)
    net, x, expected = made()
    model = accelerate.dispatch_model(net, device_map={"": 0}, force_hooks=True)

    assert to_device({"model": model}, first)["model"] is model
    assert {first} == devices_of(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x).cpu(), expected)


# --- hooks removed after a call -------------------------------------------------------------


@pytest.mark.requires_device("accelerator")
def test_hooks_removed_after_a_call_are_seen_at_the_next(
    accelerate: Any, two: tuple[torch.device, torch.device]
) -> None:
    """remove_hook_from_module tells torch nothing: the call after it still sees that the
    split is no longer on purpose, and stops before the body."""
    first, _ = two
    net, x, _ = made()
    model = accelerate.dispatch_model(net, device_map={"embed": 0, "body": 0, "head": 1})
    step(model, x)
    accelerate.hooks.remove_hook_from_module(model, recurse=True)
    ran.clear()

    with pytest.raises(DeviceMismatchError) as error:
        step(model, x)
    assert [] == ran
    assert "nothing says it is spread on purpose" in str(error.value)
    assert str(error.value).splitlines()[-1].startswith(f'fix: model.head.to("{first}") before')


@pytest.mark.requires_device("accelerator")
def test_a_gathered_model_runs_on_its_device_once_its_hooks_are_removed(
    accelerate: Any, two: tuple[torch.device, torch.device]
) -> None:
    """The other way out of a gathered model: without accelerate's hooks it is a model on
    one device like any other, also after a refused call."""
    first, _ = two
    net, x, expected = made()
    model = accelerate.dispatch_model(net, device_map={"embed": 0, "body": 0, "head": 1})
    model.to(first)
    with pytest.raises(DeviceMismatchError):
        step(model, x)

    accelerate.hooks.remove_hook_from_module(model, recurse=True)
    assert first == module_device(model)
    with torch.no_grad():
        torch.testing.assert_close(step(model, x).cpu(), expected)
