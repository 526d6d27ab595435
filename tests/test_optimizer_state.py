"""An optimizer's state on another device than its parameters: the decorator names it, in
the words of both of torch's optimizer paths, and its fix (reloading the state) works. An
optimizer left holding the parameters a move replaced is stopped before the body."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import accelerator
from torch import nn

from devicectx import (
    DeviceMismatchError,
    DeviceWarning,
    declare_spread,
    device_agnostic,
    find_devices,
    on_device,
    to_device,
)


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
def test_optimizer_state_left_behind_is_stopped_before_the_body_and_its_fix_works(
    foreach: bool, start: str
) -> None:
    """A model moved after its optimizer made state, both passed: stopped before the body
    (the state untouched), naming each state tensor by a short path; its fix, reloading the
    state, lets the step run on the device."""
    source, target = torch.device("cpu"), accelerator()
    if start == "accelerator":
        if torch.accelerator.device_count() < 2:
            pytest.skip("needs two devices of the accelerator")
        source, target = accelerator(0), accelerator(1)
    model = nn.Linear(2, 2).to(source)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=foreach)
    step(model, optimizer, torch.ones(2))
    model.to(target)
    before = optimizer.state[model.weight]["momentum_buffer"].clone()

    with pytest.raises(DeviceMismatchError) as raised:
        step(model, optimizer, torch.ones(2))

    lines = str(raised.value).splitlines()
    assert lines[0] == (
        "step() got optimizer (SGD) with state off its parameters' devices (a step would "
        "fail in torch after changing part of it):"
    )
    assert lines[1].strip() == (
        f"{source} <- optimizer.state[<Parameter (2, 2) on {target}>]['momentum_buffer'], "
        f"optimizer.state[<Parameter (2,) on {target}>]['momentum_buffer']"
    )
    assert model.weight.grad is None  # the body did not run
    assert torch.equal(before, optimizer.state[model.weight]["momentum_buffer"])
    fix = "optimizer.load_state_dict(optimizer.state_dict())"
    assert lines[-1].startswith(f"fix: {fix} once the model is on its device")
    optimizer.load_state_dict(optimizer.state_dict())
    step(model, optimizer, torch.ones(2))
    assert target == optimizer.state[model.weight]["momentum_buffer"].device


@pytest.mark.requires_device("accelerator")
@pytest.mark.usefixtures("swapping")
@pytest.mark.parametrize("foreach", [True, False])
def test_a_run_that_follows_the_fix_is_the_run_that_never_failed(foreach: bool) -> None:
    """AdamW (foreach counts the step before its kernels fail; per tensor, the first
    parameter's weight decay is applied first): refused before the body, the fix applied,
    the run matches one that reloaded the state before any step failed, bit for bit."""
    device = accelerator()

    def run(fail_first: bool) -> tuple[torch.Tensor, list[float]]:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=1e-2, weight_decay=0.1, foreach=foreach
        )
        xs = [torch.randn(8, 4) for _ in range(3)]
        step(model, optimizer, xs[0])
        model.to(device)
        if fail_first:
            with pytest.raises(DeviceMismatchError):
                step(model, optimizer, xs[1])
        optimizer.load_state_dict(optimizer.state_dict())
        step(model, optimizer, xs[1])
        step(model, optimizer, xs[2])
        return model.weight.detach().cpu(), [s["step"].item() for s in optimizer.state.values()]

    weight, counters = run(fail_first=True)
    expected_weight, expected_counters = run(fail_first=False)
    assert [3.0, 3.0] == expected_counters == counters
    assert torch.equal(expected_weight, weight)


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
    assert 4 == named.count("['exp_avg")  # exp_avg and exp_avg_sq of both parameters
    optimizer.load_state_dict(optimizer.state_dict())
    step(model, optimizer, torch.ones(2))
    assert target == optimizer.state[model.weight]["exp_avg"].device


@pytest.mark.requires_device("accelerator")
@pytest.mark.usefixtures("swapping")
def test_state_left_behind_by_an_optimizer_the_call_cannot_see_is_named_after_torch_fails() -> None:
    """An optimizer held by an object (a trainer's ``self.optimizer``) is no argument to
    look at before the body: torch's failure in its step is told with the paths of its
    state and the same fix."""

    class Trainer:
        def __init__(self) -> None:
            self.model = nn.Linear(2, 2)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

        @device_agnostic
        def step(self, x: torch.Tensor) -> None:
            self.model(x).sum().backward()
            self.optimizer.step()
            self.optimizer.zero_grad()

    trainer, target = Trainer(), accelerator()
    trainer.step(torch.ones(2))
    trainer.model.to(target)

    with on_device(target), pytest.raises(DeviceMismatchError) as raised:
        trainer.step(torch.ones(2))

    lines = str(raised.value).splitlines()
    assert lines[1].strip() == (
        f"cpu <- self.optimizer.state[<Parameter (2, 2) on {target}>]['momentum_buffer'] "
        f"(in SGD), self.optimizer.state[<Parameter (2,) on {target}>]['momentum_buffer'] "
        "(in SGD)"
    )
    assert lines[-1].startswith(
        "fix: self.optimizer.load_state_dict(self.optimizer.state_dict()) once the model"
    )
    assert lines[-1].endswith(  # torch's step failed part way: the state may have changed
        "; the failed step may have changed the state already (a momentum scaled, a counter "
        "counted, weights decayed): where that matters, load it from your last checkpoint "
        "instead"
    )


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


def test_to_device_of_an_optimizer_warns_that_it_moves_nothing() -> None:
    """``optimizer = to_device(optimizer, device)`` moves nothing (an optimizer is no
    container): the same object comes back, with a DeviceWarning that says so."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    with pytest.warns(DeviceWarning) as caught, swapped(True):
        assert optimizer is to_device(optimizer, "meta")
    assert str(caught[0].message).splitlines() == [
        "to_device() moves no optimizer (an Adam): it came back as it was, its state where it was",
        "fix: move the model, then optimizer.load_state_dict(optimizer.state_dict()), which "
        "puts the state beside each parameter (on meta); or build the optimizer after moving "
        "the model",
    ]
    assert caught[0].filename == __file__


@contextlib.contextmanager
def swapped(on: bool) -> Iterator[None]:
    """module.to keeps each parameter object (swapping its memory), or, off, does so only
    between the dense backends: to meta it makes new parameters."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(on)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


NEW_OPTIMIZER_FIX = (
    "a move from cpu to meta makes new parameters, and reloading the optimizer's state does "
    "not change which parameters it steps: as it is, it would train nothing",
    "fix: build the optimizer after moving the model, from the moved model's parameters; to "
    "keep its state, take state = optimizer.state_dict() before the move and load it into "
    "the new optimizer",
)


@pytest.mark.parametrize("beside", [False, True])
def test_where_the_move_makes_new_parameters_the_optimizer_fix_is_a_new_optimizer(
    beside: bool,
) -> None:
    """To meta (or a device out of torch's tree), a module's move makes new parameters: a
    reloaded optimizer would still step the old ones, training nothing. The warning says so
    and gives the fix that works: a new optimizer, the old state loaded into it."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    step(model, optimizer, torch.ones(2))
    training = {"model": model, "optimizer": optimizer} if beside else optimizer
    with pytest.warns(DeviceWarning) as caught, swapped(False):
        to_device(training, "meta")
    lines = str(caught[0].message).splitlines()
    if beside:
        assert lines[0] == (
            "to_device() moved a module in obj, and no optimizer (an Adam, in obj too): it "
            "steps the module's old parameters, left on cpu"
        )
    else:
        assert lines[0].startswith("to_device() moves no optimizer (an Adam)")
    assert tuple(lines[1:]) == NEW_OPTIMIZER_FIX
    # The fix, followed: the new optimizer steps the moved model, with the old state.
    state = optimizer.state_dict()
    with swapped(False):
        moved = to_device(model, "meta")
    renewed = torch.optim.Adam(moved.parameters())
    renewed.load_state_dict(state)
    assert renewed.param_groups[0]["params"][0] is moved.weight
    assert torch.device("meta") == renewed.state[moved.weight]["exp_avg"].device


@pytest.mark.requires_device("accelerator")
@pytest.mark.usefixtures("swapping")
def test_the_fix_for_to_device_of_an_optimizer_moves_its_state() -> None:
    """The warning's fix, applied as printed, puts the state beside the moved parameters."""
    target = accelerator()
    model = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    step(model, optimizer, torch.ones(2))
    with pytest.warns(DeviceWarning):
        to_device(optimizer, target)
    model.to(target)
    optimizer.load_state_dict(optimizer.state_dict())
    assert target == optimizer.state[model.weight]["exp_avg"].device


@pytest.mark.requires_device("accelerator")
@pytest.mark.usefixtures("swapping")
@pytest.mark.parametrize("state", ["dict", "tuple"])
def test_to_device_of_a_training_state_warns_that_its_optimizer_stayed(state: str) -> None:
    """``to_device({"model": model, "optimizer": optimizer}, device)`` moves the model and
    leaves the optimizer's state where it was: warned, at the caller's line, with a fix
    that works as printed (the next plain ``optimizer.step()`` was torch's error)."""
    target = accelerator()
    model = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    step(model, optimizer, torch.ones(2))
    training = {"model": model, "optimizer": optimizer} if state == "dict" else (model, optimizer)
    with pytest.warns(DeviceWarning) as caught:
        to_device(training, target)
    assert str(caught[0].message).splitlines() == [
        "to_device() moved a module in obj, and no optimizer (an Adam, in obj too): its "
        "state stays where it was, off the parameters it steps",
        "fix: optimizer.load_state_dict(optimizer.state_dict()) after the move, which puts the "
        f"state beside each parameter (on {target}); or build the optimizer after moving the "
        "model",
    ]
    assert caught[0].filename == __file__
    exec(str(caught[0].message).splitlines()[1].removeprefix("fix: ").split(" after the move")[0])
    assert target == optimizer.state[model.weight]["exp_avg"].device
    step(model, optimizer, torch.ones(2, device=target))


def test_to_device_of_a_batch_beside_an_optimizer_moves_no_module_and_warns_nothing() -> None:
    """No module moved, no warning: the optimizer's state still lies beside its model."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        to_device({"x": torch.ones(2), "optimizer": optimizer}, "meta")


@pytest.mark.parametrize("skip", [torch.optim.Optimizer, (torch.optim.Adam,), "optimizer"])
@pytest.mark.parametrize("depth", [1, 150])  # the recursive walk and the explicit stack's
def test_to_device_of_a_training_state_warns_nothing_of_an_optimizer_it_was_told_to_skip(
    skip: Any, depth: int
) -> None:
    """An optimizer the caller skipped (by type or by key) was left where it was on purpose:
    no warning that it stayed behind the moved model, at any depth of nesting."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    training: object = {"model": model, "optimizer": optimizer}
    for _ in range(depth - 1):
        training = [training]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        to_device(training, "meta", skip=skip)
    assert model.weight.device.type == "meta"


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


# --- an optimizer built before a move that made new parameters ---------------------------

META = torch.device("meta")


def stale(momentum: float = 0.9) -> tuple[nn.Linear, torch.optim.SGD]:
    """A model moved to meta after its optimizer stepped: to_device made new parameters
    there (module.to does too), and the optimizer holds the old ones, on the CPU."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    step(model, optimizer, torch.ones(2))
    to_device(model, "meta")
    return model, optimizer


def test_an_optimizer_holding_the_parameters_a_move_replaced_is_stopped() -> None:
    """The call stops before the body, naming the optimizer, where its parameters are, the
    target and the fix; the fix, pasted, points the optimizer at the model's parameters,
    keeping its state (moved beside them), and the step runs."""
    model, optimizer = stale()
    ran: list[int] = []

    @device_agnostic
    def counted(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
        ran.append(1)

    with pytest.raises(DeviceMismatchError) as raised:
        counted(model, optimizer, torch.ones(2))
    assert [] == ran
    name = "test_an_optimizer_holding_the_parameters_a_move_replaced_is_stopped.<locals>.counted"
    assert [
        f"{name}() got optimizer (SGD) stepping parameters no module of the call holds:",
        "    cpu <- optimizer.param_groups[0]['params'][0], optimizer.param_groups[0]['params'][1]",
        "target meta (from the parameters of model (Linear))",
        "fix: state = optimizer.state_dict(); "
        "optimizer.param_groups[0]['params'] = list(model.parameters()); "
        "optimizer.load_state_dict(state) (the model's parameters are new ones (a move to "
        "meta makes them, as does load_state_dict(..., assign=True)), and optimizer steps the "
        "old ones: it would train nothing), or build the optimizer after the move",
    ] == str(raised.value).splitlines()
    assert META == raised.value.target
    code = str(raised.value).splitlines()[-1].removeprefix("fix: ").partition(" (the model's")[0]
    exec(code, {"optimizer": optimizer, "model": model})
    assert [model.weight, model.bias] == optimizer.param_groups[0]["params"]
    assert META == optimizer.state[model.weight]["momentum_buffer"].device
    step(model, optimizer, torch.ones(2, device="meta"))


@pytest.mark.requires_device("accelerator")
def test_a_stale_optimizer_on_the_accelerator_is_stopped_and_its_fix_trains() -> None:
    """Moved to a device where module.to and to_device make new parameters (the emulated
    one, as an NPU): without the check the loss never moves; with the fix it does."""
    target = accelerator()
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    x = torch.randn(8, 4)

    @device_agnostic
    def train(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> float:
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.item())

    train(model, optimizer, x)
    kept = model.weight
    to_device(model, target)
    if model.weight is kept:
        pytest.skip(f"module moves to {target.type} keep the parameter objects")
    with pytest.raises(DeviceMismatchError) as raised:
        train(model, optimizer, x)
    code = str(raised.value).splitlines()[-1].removeprefix("fix: ").partition(" (the model's")[0]
    exec(code, {"optimizer": optimizer, "model": model})
    x = x.to(target)
    losses = [train(model, optimizer, x) for _ in range(3)]
    assert 3 == len(set(losses))  # it trains: without the check, the loss never moved


class TiedLM(nn.Module):
    """An embedding and an output layer sharing one weight, and a bias of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))  # type: ignore[no-any-return]


@pytest.mark.parametrize("where", ["meta", "accelerator"])
def test_the_fix_of_a_stale_optimizer_ties_again_what_module_to_untied(where: str) -> None:
    """``model.to`` to meta, or to a device out of tree, copies each place of a tied weight
    apart, so the model has one parameter more than its optimizer: the fix ties it again
    first, then points the optimizer at the model's parameters; applied as printed, the
    optimizer loads its state, and (with values) the model trains, still tied."""
    if where == "accelerator" and torch.accelerator.current_accelerator() is None:
        pytest.skip("no accelerator here")
    target = torch.device("meta") if where == "meta" else accelerator()
    model = TiedLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    ids = torch.tensor([[1, 2, 3]])

    @device_agnostic
    def train(model: nn.Module, ids: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        model(ids).logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    train(model, ids, optimizer)
    model.to(target)
    if model.head.weight is model.embed.weight:
        pytest.skip(f"module moves to {target.type} keep tied parameters tied")
    with pytest.raises(DeviceMismatchError) as raised:
        train(model, ids, optimizer)
    fix = str(raised.value).splitlines()[-1].removeprefix("fix: ")
    assert fix.startswith(
        "model.head.weight = model.embed.weight (the move untied its tied weights); "
        "state = optimizer.state_dict(); "
        "optimizer.param_groups[0]['params'] = list(model.parameters()); "
        "optimizer.load_state_dict(state) ("
    )
    code = fix.replace(" (the move untied its tied weights)", "").partition(" (the model's")[0]
    exec(code, {"optimizer": optimizer, "model": model})
    assert model.head.weight is model.embed.weight
    assert target == optimizer.state[model.embed.weight]["exp_avg"].device
    if target.type != "meta":
        before = model.embed.weight.detach().clone()
        train(model, ids, optimizer)
        assert not torch.equal(before, model.embed.weight)
        assert model.head.weight is model.embed.weight


def test_a_decorated_method_of_a_trainer_is_stopped_too() -> None:
    """The model and its optimizer passed to a decorated method of a plain object."""

    class Trainer:
        @device_agnostic
        def train_step(
            self, net: nn.Module, x: torch.Tensor, optimizer: torch.optim.Optimizer
        ) -> None:
            raise AssertionError("the body ran")

    model, optimizer = stale(momentum=0.0)
    with pytest.raises(DeviceMismatchError) as raised:
        Trainer().train_step(model, torch.ones(2, device="meta"), optimizer)
    assert "optimizer.param_groups[0]['params'] = list(net.parameters())" in str(raised.value)


class Stepped(nn.Linear):
    """A model whose training step is a decorated method of its own."""

    @device_agnostic
    def train_step(self, x: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        loss = self(x).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("keyword", [False, True])
def test_a_decorated_method_of_the_model_itself_is_stopped(keyword: bool) -> None:
    """``model.train_step(x, optimizer)``: the model is the instance, no argument; an
    optimizer beside it holding the replaced parameters is stopped before the body, by
    position or keyword, and the fix, pasted with ``model`` named ``self``, lets it step
    the model's parameters."""
    model = Stepped(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train_step(torch.ones(2), optimizer)
    to_device(model, "meta")
    x = torch.ones(2, device="meta")
    with pytest.raises(DeviceMismatchError) as raised:
        model.train_step(x, optimizer=optimizer) if keyword else model.train_step(x, optimizer)
    lines = str(raised.value).splitlines()
    assert lines[0].endswith("got optimizer (SGD) stepping parameters no module of the call holds:")
    assert "target meta (from the parameters of self (Stepped))" == lines[2]
    code = lines[-1].removeprefix("fix: ").partition(" (the model's")[0]
    assert "optimizer.param_groups[0]['params'] = list(self.parameters())" in code
    exec(code, {"optimizer": optimizer, "self": model})
    model.train_step(x, optimizer)
    assert [model.weight, model.bias] == optimizer.param_groups[0]["params"]


def test_the_fix_of_a_model_in_several_groups_says_how_to_rebuild() -> None:
    """Two groups (no weight decay on biases): no one expression gives each group its
    parameters back, so the fix says what to do, with the state kept."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(
        [{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}]
    )
    to_device(model, "meta")
    with pytest.raises(DeviceMismatchError) as raised:
        step(model, optimizer, torch.ones(2, device="meta"))
    assert str(raised.value).splitlines()[-1] == (
        "fix: build the optimizer after the move, from model's parameters (the model's "
        "parameters are new ones (a move to meta makes them, as does load_state_dict(..., "
        "assign=True)), and optimizer steps the old ones: it would train nothing); "
        "to keep its state, take state = optimizer.state_dict() now and "
        "optimizer.load_state_dict(state) on the new optimizer"
    )


def test_move_false_is_stopped_the_same() -> None:
    """move=False checks the optimizer as it checks the tensors."""
    model, optimizer = stale()

    @device_agnostic(move=False, scope=False)
    def checked(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
        raise AssertionError("the body ran")

    with pytest.raises(DeviceMismatchError, match="stepping parameters no module"):
        checked(model, optimizer, torch.ones(2, device="meta"))


# The optimizers that are no stale ones run as before.


def test_an_optimizer_built_after_the_move_runs() -> None:
    """Its parameters are the model's, on the target."""
    model = to_device(nn.Linear(2, 2), "meta")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step(model, optimizer, torch.ones(2))


def test_an_excluded_optimizer_is_not_checked() -> None:
    """exclude= leaves an argument alone: neither moved nor checked."""
    model, optimizer = stale(momentum=0.0)

    @device_agnostic(exclude="optimizer")
    def lenient(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> int:
        return len(optimizer.param_groups)

    assert 1 == lenient(model, optimizer, torch.ones(2))


def test_an_optimizer_of_a_loose_parameter_passed_beside_the_model_runs() -> None:
    """A learned temperature on the CPU, passed as an argument of its own, with its own
    optimizer (or in the model's): it is the caller's parameter, stepped where it is."""
    model = to_device(nn.Linear(2, 2), "meta")
    temperature = nn.Parameter(torch.ones(()))
    alone = torch.optim.SGD([temperature], lr=0.1)
    together = torch.optim.SGD([*model.parameters(), temperature], lr=0.1)

    @device_agnostic
    def scaled(
        model: nn.Module, temperature: nn.Parameter, optimizer: torch.optim.Optimizer
    ) -> torch.Size:
        return model(torch.ones(2) * temperature).shape

    assert (2,) == scaled(model, temperature, alone)
    assert (2,) == scaled(model, temperature, together)


def test_an_optimizer_over_a_model_spread_on_purpose_runs() -> None:
    """A model with its first layer kept on the CPU on purpose (declare_spread), its inputs
    on meta: an optimizer over all its parameters, or over the CPU layer's, starts off the
    target, with the model's own parameters, and runs. Once that layer moved too (new
    parameters), the optimizer over it is stopped: what the call knew of the model's
    parameters went with the move."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    to_device(model[1], "meta")
    declare_spread(model, inputs="meta")
    whole = torch.optim.SGD(model.parameters(), lr=0.1)
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)

    @device_agnostic(move=False)
    def predict(model: nn.Module, x: torch.Tensor, optimizer: torch.optim.Optimizer) -> str:
        x = model[0](torch.ones(2, device="cpu")).to("meta")  # the first layer on the CPU
        return model[1](x).device.type  # type: ignore[no-any-return]

    x = torch.ones(2, device="meta")
    ran = [predict(model, x, whole), predict(model, x, first), predict(model, x, first)]
    assert ["meta", "meta", "meta"] == ran
    to_device(model[0], "meta")
    with pytest.raises(DeviceMismatchError, match="stepping parameters no module"):
        predict(model, x, first)


def test_without_a_module_in_the_call_an_optimizer_is_not_checked() -> None:
    """No module: nothing says which parameters the step trains."""
    _, optimizer = stale(momentum=0.0)

    @device_agnostic(device="meta")
    def no_model(optimizer: torch.optim.Optimizer, x: torch.Tensor) -> str:
        return x.device.type

    assert "meta" == no_model(optimizer, torch.ones(2))
