"""An optimizer's state on another device than its parameters: the decorator names it, in
the words of both of torch's optimizer paths, and its fix (reloading the state) works."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers import accelerator
from torch import nn

from devicectx import DeviceMismatchError, device_agnostic, find_devices


@pytest.fixture
def swapping() -> Iterator[None]:
    """module.to keeps each parameter object (the optimizer's), its memory swapped."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(previous)


@device_agnostic
def step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.requires_device("accelerator")
@pytest.mark.usefixtures("swapping")
@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("start", ["cpu", "accelerator"])
def test_optimizer_state_left_behind_is_named_and_its_fix_works(foreach: bool, start: str) -> None:
    """A model moved after its optimizer made state: the step's failure (torch's _foreach
    words, or the per-tensor ops') is a DeviceMismatchError naming each state tensor by a
    short path, and its fix, reloading the state, lets the step run on the device."""
    source, target = torch.device("cpu"), accelerator()
    if start == "accelerator":
        if torch.accelerator.device_count() < 2:
            pytest.skip("needs two devices of the accelerator")
        source, target = accelerator(0), accelerator(1)
    model = nn.Linear(2, 2).to(source)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=foreach)
    step(model, optimizer, torch.ones(2))
    model.to(target)

    with pytest.raises(DeviceMismatchError) as raised:
        step(model, optimizer, torch.ones(2))

    lines = str(raised.value).splitlines()
    assert lines[1].strip() == (
        f"{source} <- optimizer.state[<Parameter (2, 2) on {target}>]['momentum_buffer'] "
        f"(in SGD), optimizer.state[<Parameter (2,) on {target}>]['momentum_buffer'] "
        "(in SGD)"
    )
    fix = "optimizer.load_state_dict(optimizer.state_dict())"
    assert lines[-1].startswith(f"fix: {fix} once the model is on its device")
    optimizer.load_state_dict(optimizer.state_dict())
    step(model, optimizer, torch.ones(2))
    assert target == optimizer.state[model.weight]["momentum_buffer"].device


@pytest.mark.requires_device("accelerator")
@pytest.mark.usefixtures("swapping")
def test_an_optimizers_cpu_step_counters_are_not_named() -> None:
    """Adam's ``step`` counters: 0-dim CPU tensors, where torch keeps them on purpose and
    its kernels take them on any device, and where the fix leaves them. The message names
    only the state tensors off the device, all of them."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, foreach=True)
    step(model, optimizer, torch.ones(2))
    assert torch.device("cpu") == optimizer.state[model.weight]["step"].device
    target = accelerator()
    model.to(target)

    with pytest.raises(DeviceMismatchError) as raised:
        step(model, optimizer, torch.ones(2))

    named = str(raised.value).splitlines()[1]
    assert "'step'" not in named
    assert "and " not in named.rpartition("(in Adam)")[2]  # none left out
    assert 4 == named.count("(in Adam)")  # exp_avg and exp_avg_sq of both parameters
    optimizer.load_state_dict(optimizer.state_dict())
    step(model, optimizer, torch.ones(2))
    assert target == optimizer.state[model.weight]["exp_avg"].device


@pytest.mark.requires_device("accelerator")
@pytest.mark.usefixtures("swapping")
@pytest.mark.parametrize("name", ["RMSprop", "NAdam", "RAdam"])
def test_step_counters_made_on_a_device_are_moved_by_the_fix(name: str) -> None:
    """These optimizers make their ``step`` counters without a device: stepped under torch's
    own ``with torch.device``, they land there. After the model moves on, the fix,
    applied as printed, moves them too (load_state_dict alone leaves them), and the step
    runs."""
    if torch.accelerator.device_count() < 2:
        pytest.skip("needs two devices of the accelerator")
    source, target = accelerator(0), accelerator(1)
    model = nn.Linear(2, 2).to(source)
    optimizer = getattr(torch.optim, name)(model.parameters(), lr=0.01)
    with torch.device(source):
        step(model, optimizer, torch.ones(2, device=source))
    model.to(target)

    with pytest.raises(DeviceMismatchError) as raised:
        step(model, optimizer, torch.ones(2, device=target))

    fix = str(raised.value).splitlines()[-1].removeprefix("fix: ")
    reload, _, rest = fix.partition(" once the model")
    counters = rest.partition("back to the CPU: ")[2].partition(" (not with")[0]
    assert counters.startswith("for s in optimizer.state.values(): ")
    exec(reload)  # the printed fix, as a user pastes it
    exec(counters)
    step(model, optimizer, torch.ones(2, device=target))
    assert (
        target
        == optimizer.state[model.weight]["square_avg" if name == "RMSprop" else "exp_avg"].device
    )


def test_a_path_through_a_tensor_key_names_the_tensor_not_its_values() -> None:
    """A dict keyed by tensors (an optimizer's state) gives paths with the key's kind, shape
    and device, not its printed values, in the fast walk of plain dicts and the full one."""
    weight = nn.Parameter(torch.zeros(4, 4))
    key = "<Parameter (4, 4) on cpu>"
    plain = {weight: {"momentum_buffer": torch.zeros(4, 4)}}
    assert {torch.device("cpu"): [f"state[{key}]['momentum_buffer']"]} == find_devices(
        plain, name="state"
    )
    held = {weight: [torch.zeros(1)], "x": {weight: torch.zeros(1)}}
    assert [f"state[{key}][0]", f"state['x'][{key}]"] == find_devices(held, name="state")[
        torch.device("cpu")
    ]
