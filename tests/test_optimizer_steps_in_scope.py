"""torch's optimizers step in a scope as they would outside it: their lazy state that torch
makes on the CPU stays there, while the caller's own code (a closure) runs in the scope."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import accelerator
from torch import nn

from devicectx import device_agnostic, on_device

META = torch.device("meta")
CPU = torch.device("cpu")
# Each makes its non-capturable `step` counter with a constructor that names no device.
NO_DEVICE_NAMED = ["RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta", "Adam"]


@device_agnostic
def train_step(model: nn.Module, x: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    model(x).sum().backward()
    optimizer.step()


def counters(optimizer: torch.optim.Optimizer) -> set[torch.device]:
    """The devices of the optimizer's 0-dim state (step counters, NAdam's mu_product)."""
    return {
        value.device
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() == 0
    }


@pytest.mark.parametrize("name", NO_DEVICE_NAMED)
def test_a_decorated_steps_optimizer_makes_its_step_counters_on_the_cpu(name: str) -> None:
    """On meta, a step counter made there fails the step (torch reads it on the host); on
    a GPU it costs a host sync at every read. The rest of the state follows the parameters."""
    model = nn.Linear(2, 2, device=META)
    optimizer = getattr(torch.optim, name)(model.parameters())

    train_step(model, torch.ones(1, 2, device=META), optimizer)

    assert {CPU} == counters(optimizer)
    assert all(
        value.device == META for value in optimizer.state[model.weight].values() if value.dim() > 0
    )


@pytest.mark.parametrize("name", ["RMSprop", "NAdam"])
def test_an_optimizer_stepped_in_a_block_makes_its_step_counters_on_the_cpu(name: str) -> None:
    model = nn.Linear(2, 2, device=META)
    optimizer = getattr(torch.optim, name)(model.parameters())

    with on_device("meta"):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        after = torch.zeros(1)

    assert {CPU} == counters(optimizer)
    assert META == after.device  # the block applies again once the step is over


@pytest.mark.requires_device("accelerator")
def test_on_an_accelerator_the_counters_stay_on_the_cpu_and_the_steps_match() -> None:
    """Two steps of RMSprop decorated on the accelerator: the same parameters as on the
    CPU, the counters where torch keeps them."""
    torch.manual_seed(0)
    reference = nn.Linear(3, 2)
    model = nn.Linear(3, 2).to(accelerator())
    model.load_state_dict(reference.state_dict())
    optimizers = [torch.optim.RMSprop(m.parameters(), lr=0.1) for m in (reference, model)]
    x = torch.randn(4, 3)
    on_target = x.to(accelerator())

    for _ in range(2):
        reference(x).sum().backward()
        optimizers[0].step()
        train_step(model, on_target, optimizers[1])

    assert {CPU} == counters(optimizers[1])
    torch.testing.assert_close(model.weight.cpu(), reference.weight)


def test_a_closure_the_step_calls_runs_in_the_scope() -> None:
    made: list[torch.device] = []
    model = nn.Linear(2, 2, device=META)
    optimizer = torch.optim.RMSprop(model.parameters())

    def closure() -> torch.Tensor:
        made.append(torch.zeros(1).device)
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        return loss

    @device_agnostic(device="meta")
    def steps(positional: bool) -> None:
        if positional:
            optimizer.step(closure)
        else:
            optimizer.step(closure=closure)

    steps(True)
    steps(False)

    assert [META, META] == made
    assert {CPU} == counters(optimizer)


def test_a_step_that_raises_gives_the_scope_back() -> None:
    """torch runs no post-hook after a step that raised: the scope applies again all the
    same, to the code that caught the error and to the next step's closure."""
    model = nn.Linear(2, 2, device=META)
    optimizer = torch.optim.RMSprop(model.parameters())
    made: dict[str, torch.device] = {}

    def failing() -> torch.Tensor:
        raise ValueError("a failing closure")

    def closure() -> torch.Tensor:
        made["closure"] = torch.zeros(1).device
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        return loss

    @device_agnostic(device="meta")
    def body() -> None:
        with pytest.raises(ValueError, match="a failing closure"):
            optimizer.step(failing)
        made["after"] = torch.zeros(1).device
        optimizer.step(closure)
        made["last"] = torch.zeros(1).device

    body()

    assert {"after": META, "closure": META, "last": META} == made
    assert {CPU} == counters(optimizer)


def test_a_thread_running_a_copy_of_the_blocks_context_keeps_the_block() -> None:
    """The block is set aside for the step's own thread only: another thread that runs a
    copy of the context (started by a step hook here) still gets the block's device."""
    model = nn.Linear(2, 2, device=META)
    optimizer = torch.optim.SGD(model.parameters())
    made: dict[str, torch.device] = {}

    def in_thread() -> None:
        made["thread"] = torch.zeros(1).device

    def hook(*_: Any) -> None:
        made["step"] = torch.zeros(1).device
        context = contextvars.copy_context()
        thread = threading.Thread(target=context.run, args=(in_thread,))
        thread.start()
        thread.join()
        made["step, after the thread"] = torch.zeros(1).device

    optimizer.register_step_pre_hook(hook)
    with on_device("meta"):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()

    assert {"step": CPU, "thread": META, "step, after the thread": CPU} == made


def test_an_optimizer_with_a_step_of_its_own_is_left_in_the_scope() -> None:
    """Its author may mean the default device, as under ``with torch.device``."""

    class Counting(torch.optim.Optimizer):
        def __init__(self, params: Any) -> None:
            super().__init__(params, {})

        def step(self, closure: Callable[[], Any] | None = None) -> None:
            for group in self.param_groups:
                for param in group["params"]:
                    self.state[param].setdefault("count", torch.zeros(()))

    model = nn.Linear(2, 2, device=META)
    optimizer = Counting(model.parameters())

    with on_device("meta"):
        optimizer.step()

    assert {META} == counters(optimizer)


def test_a_step_in_a_steps_closure_sets_the_scope_aside_for_itself() -> None:
    """An optimizer stepped in another's closure: its own counters on the CPU, the closure
    in the scope before and after it."""
    outer_model, inner_model = nn.Linear(2, 2, device=META), nn.Linear(2, 2, device=META)
    outer = torch.optim.SGD(outer_model.parameters())
    inner = torch.optim.RMSprop(inner_model.parameters())
    made: list[torch.device] = []

    def closure() -> None:
        made.append(torch.zeros(1).device)
        inner_model(torch.ones(1, 2)).sum().backward()
        inner.step()
        made.append(torch.zeros(1).device)

    with on_device("meta"):
        outer.step(closure)
        made.append(torch.zeros(1).device)

    assert [META, META, META] == made
    assert {CPU} == counters(inner)


def test_outside_every_scope_a_step_is_torchs_own() -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.RMSprop(model.parameters())
    with on_device("meta"):  # the hooks are in place from here on
        pass
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert {CPU} == counters(optimizer)
    with torch.device("meta"):  # torch's own context is torch's business
        assert META == torch.zeros(1).device
