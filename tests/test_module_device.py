"""The module rule's device check: cached per module, yet every move and registration seen."""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from warm_python import run_python

from devicectx import DeviceMismatchError, device_agnostic
from devicectx.decorator import _module_watch
from devicectx.decorator._target import Spread, _devices, module_device

pytestmark = pytest.mark.torch_internals  # CI runs it on every minor torch release

CPU = torch.device("cpu")
META = torch.device("meta")
SPREAD = Spread.SPREAD


def truth(module: nn.Module) -> torch.device | Spread | None:
    """What the module's tensors say now, asked of each of them: the uncached answer."""
    found = {t.device for t in (*module.parameters(), *module.buffers())}
    return SPREAD if len(found) > 1 else next(iter(found), None)


def model() -> nn.Sequential:
    """Two layers on the CPU; the cache checks ``model[0].weight``, the first tensor met."""
    return nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)))


@pytest.fixture
def swapping() -> Iterator[None]:
    """Turn on ``swap_module_params_on_conversion`` for one test."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


class Counted(dict[str, Any]):
    """A module's parameter table that counts the walks reading it."""

    walks = 0

    def values(self) -> Any:
        Counted.walks += 1
        return super().values()


# --- cached -------------------------------------------------------------------------------


def test_a_module_unchanged_is_walked_once() -> None:
    """Calls on a module nothing has changed answer from the cache, without a walk."""
    net = model()
    net[1][1]._parameters = Counted(net[1][1]._parameters)
    Counted.walks = 0
    assert [CPU] * 5 == [module_device(net) for _ in range(5)]
    assert 1 == Counted.walks


def test_changes_to_other_modules_keep_the_answer_without_a_walk() -> None:
    """A loss module built at each step (its constructor registers a buffer), another
    module moved or given a buffer: none of them is under the model, whose answer stands
    without a walk, however large it is."""
    net = model()
    net[1][1]._parameters = Counted(net[1][1]._parameters)
    other = nn.Linear(2, 2)
    assert CPU == module_device(net)
    Counted.walks = 0
    for _ in range(3):
        nn.CrossEntropyLoss()
        other.to("meta")
        other.register_buffer("seen", torch.zeros(1))
        assert CPU == module_device(net)
    assert 0 == Counted.walks


def test_a_change_under_the_model_among_others_is_seen() -> None:
    """Among changes to other modules, one to a module under the model: walked again."""
    net = model()
    assert CPU == module_device(net)
    nn.CrossEntropyLoss()
    net[1][1].to("meta")
    nn.CrossEntropyLoss()
    assert SPREAD == module_device(net)


def test_more_changes_than_a_token_remembers_walk_again() -> None:
    """Past the changes a token remembers, the model is walked again (what they touched
    is no longer known), and the answer is still the truth."""
    net = model()
    net[1][1]._parameters = Counted(net[1][1]._parameters)
    assert CPU == module_device(net)
    Counted.walks = 0
    for _ in range(_module_watch._REMEMBERED + 1):
        nn.Identity().register_buffer("b", None)
    assert CPU == module_device(net)
    assert 1 == Counted.walks


def test_importing_devicectx_leaves_torch_alone() -> None:
    """Nothing is installed into torch until a module is first looked up."""
    code = (
        "import torch\n"
        "from torch.nn.modules import module as m\n"
        "apply = torch.nn.Module._apply\n"
        "import devicectx\n"
        "assert torch.nn.Module._apply is apply\n"
        "assert not m._global_parameter_registration_hooks\n"
        "assert not m._global_buffer_registration_hooks\n"
        "assert not m._global_module_registration_hooks\n"
        "devicectx.device_agnostic(lambda model: model)(torch.nn.Linear(1, 1))\n"
        "assert torch.nn.Module._apply.__wrapped__ is apply\n"
        "assert len(m._global_parameter_registration_hooks) == 1\n"
    )
    done = run_python(code)
    assert 0 == done.returncode, done.stderr


# --- moves --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "move",
    [
        lambda net: net.to("meta"),
        lambda net: net.to_empty(device="meta"),
        lambda net: net.to(torch.float64).to("meta"),
    ],
    ids=["to", "to_empty", "dtype-then-device"],
)
def test_a_module_moved_whole_is_seen(move: Callable[[nn.Module], nn.Module]) -> None:
    """A module moved whole between calls answers its new device, and again when moved back."""
    net = model()
    assert CPU == module_device(net)
    move(net)
    assert META == module_device(net)
    net.to_empty(device="cpu")
    assert CPU == module_device(net)


@pytest.mark.usefixtures("swapping")
def test_a_move_that_swaps_tensors_is_seen() -> None:
    """With ``swap_module_params_on_conversion`` on, moves are seen as well, and the cache
    holds nothing that makes torch refuse to swap a tensor (a weak reference)."""
    net = model()
    assert CPU == module_device(net)
    net[1][0].bias = nn.Parameter(torch.zeros(2))
    net[1].to("meta")
    assert SPREAD == module_device(net)
    net.to("meta")
    assert META == module_device(net)


def test_a_submodule_moved_alone_spreads_the_module() -> None:
    """Moving one submodule makes the model spread; moving it back makes it whole again."""
    net = model()
    assert CPU == module_device(net)
    net[1][1].to("meta")
    assert (SPREAD, META) == (module_device(net), module_device(net[1][1]))
    net[1][1].to_empty(device="cpu")
    assert CPU == module_device(net)


# --- registrations ------------------------------------------------------------------------


def replace_a_parameter(net: nn.Module) -> None:
    """``setattr`` of a new parameter, on a tensor that is not the checked one."""
    net[1][0].bias = nn.Parameter(torch.zeros(2, device="meta"))


def register_a_buffer(net: nn.Module) -> None:
    """``register_buffer`` of a buffer on another device."""
    net[1][1].register_buffer("scale", torch.ones(2, device="meta"))


def assign_from_a_state_dict(net: nn.Module) -> None:
    """``load_state_dict(assign=True)`` of a state dict with one tensor on another device."""
    state = net.state_dict()
    state["1.1.weight"] = torch.ones(2, device="meta")
    net.load_state_dict(state, assign=True)


def add_a_submodule(net: nn.Module) -> None:
    """``add_module`` of a submodule on another device."""
    net[1].add_module("head", nn.Linear(2, 2, device="meta"))


def set_a_submodule(net: nn.Module) -> None:
    """``setattr`` of a submodule on another device, in place of one on the CPU."""
    net[1][1] = nn.LayerNorm(2, device="meta")


@pytest.mark.parametrize(
    "change",
    [
        replace_a_parameter,
        register_a_buffer,
        assign_from_a_state_dict,
        add_a_submodule,
        set_a_submodule,
    ],
)
def test_a_registration_is_seen(change: Callable[[nn.Module], None]) -> None:
    """A tensor or submodule registered on another device between calls spreads the model."""
    net = model()
    assert CPU == module_device(net)
    change(net)
    assert SPREAD == module_device(net)


def test_a_swap_of_the_checked_tensor_is_seen() -> None:
    """``torch.utils.swap_tensors`` on the tensor the cache checks is seen, unreported."""
    net = model()
    assert CPU == module_device(net)
    torch.utils.swap_tensors(net[0].weight, nn.Parameter(torch.zeros(2, 2, device="meta")))
    assert SPREAD == module_device(net)


@pytest.mark.requires_device("cuda")
def test_data_replaced_on_the_checked_tensor_is_seen() -> None:
    """``param.data = t`` on the tensor the cache checks is seen, unreported. (The CPU cannot
    take a meta tensor's data, nor a PrivateUse1 backend's, the emulated one's included:
    torch allows ``.data`` across the CPU and its built-in accelerators only.)"""
    device = torch.device("cuda", torch.cuda.current_device())
    net = model()
    assert CPU == module_device(net)
    net[0].weight.data = net[0].weight.data.to(device)
    assert SPREAD == module_device(net)
    net = model()
    assert CPU == module_device(net)
    rest = [p for p in net.parameters() if p is not net[0].weight]
    for parameter in rest:  # not the sample: not seen (documented), until the sample moves
        parameter.data = parameter.data.to(device)
    net[0].weight.data = net[0].weight.data.to(device)
    assert device == module_device(net)


def test_functional_call_with_every_parameter_elsewhere_is_seen() -> None:
    """``functional_call`` given every parameter on another device runs the forward there."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        @device_agnostic
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    net = Net()
    assert CPU == net(torch.ones(2)).device
    on_meta = {name: p.to("meta") for name, p in net.named_parameters()}
    assert META == torch.func.functional_call(net, on_meta, (torch.ones(2),)).device
    assert CPU == net(torch.ones(2)).device


# --- garbage and identity -----------------------------------------------------------------


def test_a_module_collected_leaves_no_entry() -> None:
    """The cache holds modules weakly: a dropped module is freed, and its entry goes with it."""
    gc.collect()
    before = len(_devices)
    gc.disable()
    try:
        net = model()
        assert CPU == module_device(net)
        assert before + 1 == len(_devices)
        ref = weakref.ref(net)
        del net
        assert (None, before) == (ref(), len(_devices))
    finally:
        gc.enable()


def test_a_replaced_tensor_is_not_kept_alive() -> None:
    """The tensor the cache checks is held weakly: replacing it frees the old one."""
    net = model()
    assert CPU == module_device(net)
    old = weakref.ref(net[0].weight)
    net[0].weight = nn.Parameter(torch.zeros(2, 2))
    assert None is old()
    assert CPU == module_device(net)


class Unhashable(nn.Linear):
    """A module equal to every other, and so unhashable: ``__eq__`` without ``__hash__``."""

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = None  # type: ignore[assignment]


class OneHash(nn.Linear):
    """Modules that all hash alike and are all equal."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return 0


@pytest.mark.parametrize("kind", [Unhashable, OneHash])
def test_modules_that_define_equality_each_keep_their_own_answer(kind: type[nn.Linear]) -> None:
    """Entries go by identity: modules equal by ``__eq__`` or ``__hash__`` are not confused."""
    first, second = kind(2, 2), kind(2, 2, device="meta")
    assert (CPU, META) == (module_device(first), module_device(second))
    second.to_empty(device="cpu")
    first.to("meta")
    assert (META, CPU) == (module_device(first), module_device(second))


def test_a_module_without_tensors_gains_some() -> None:
    """A module with no tensor answers None until one is registered, then its device."""
    net = nn.Sequential(nn.ReLU())
    assert None is module_device(net)
    net.append(nn.Linear(2, 2, device="meta"))
    assert META == module_device(net)


# --- threads ------------------------------------------------------------------------------


@pytest.fixture
def frequent_switches() -> Iterator[None]:
    """Let threads switch every 10 microseconds, so walks overlap moves often."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(interval)


def run_threads(*targets: Callable[[], None]) -> None:
    """Run each target in a thread, wait for all, and raise the first error any of them met."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as error:  # a barrier broken by it is reported, not the cause
            errors.append(error)
            raise

    threads = [threading.Thread(target=guarded, args=(target,)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        causes = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        raise (causes or errors)[0]


@pytest.mark.usefixtures("frequent_switches")
def test_checks_during_moves_never_leave_a_stale_answer() -> None:
    """Threads checking a model while another moves it see its device once the move is over."""
    net = nn.Sequential(*(nn.Linear(2, 2) for _ in range(30)))
    checkers, rounds = 3, 40
    # A timeout, so a thread that dies breaks the barriers instead of hanging the others.
    start = threading.Barrier(checkers + 1, timeout=120)
    end = threading.Barrier(checkers + 1, timeout=120)
    moved = threading.Event()
    seen: list[list[object]] = [[] for _ in range(checkers)]

    def mover() -> None:
        for i in range(rounds):
            start.wait()
            net.to_empty(device="meta" if i % 2 == 0 else "cpu")
            moved.set()
            end.wait()
            moved.clear()

    def checker(index: int) -> Callable[[], None]:
        def check() -> None:
            for _ in range(rounds):
                start.wait()
                while not moved.is_set():  # walks that overlap the move, their answers cached
                    module_device(net)
                seen[index].append(module_device(net))
                end.wait()

        return check

    run_threads(mover, *(checker(i) for i in range(checkers)))
    expected = [META if i % 2 == 0 else CPU for i in range(rounds)]
    assert [expected] * checkers == seen


def test_a_check_between_torch_hook_and_write_is_not_cached() -> None:
    """A check made after torch's registration hooks ran, before it wrote the tensor, is not
    kept: the check after the write sees the new tensor."""
    net = model()
    assert CPU == module_device(net)
    in_the_gap, checked = threading.Event(), threading.Event()
    answers: list[object] = []

    def hold(module: nn.Module, name: str, value: object) -> None:
        # Registered after devicectx's hook, so it runs between that hook and the write.
        if name == "late":
            in_the_gap.set()
            checked.wait()

    def check() -> None:
        in_the_gap.wait()
        answers.append(module_device(net))
        checked.set()

    handle = nn.modules.module.register_module_buffer_registration_hook(hold)
    thread = threading.Thread(target=check)
    thread.start()
    try:
        net[1][0].register_buffer("late", torch.ones(1, device="meta"))
    finally:
        thread.join()
        handle.remove()
    answers.append(module_device(net))
    assert [CPU, SPREAD] == answers


# --- torch.compile ------------------------------------------------------------------------


def test_a_registration_in_compiled_code_is_seen() -> None:
    """A buffer registered by compiled code is seen by the next eager check: dynamo replays
    what the hook records."""
    net = nn.Linear(2, 2, device="meta")
    assert META == module_device(net)

    @torch.compile(fullgraph=True, backend="eager")
    def keep(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        module.register_buffer("kept", x * 2)
        return x

    keep(net, torch.ones(2))
    assert SPREAD == module_device(net)


# --- properties ---------------------------------------------------------------------------


def tree() -> nn.Module:
    """A model of nested submodules, one of them shared, with parameters and buffers."""
    shared = nn.BatchNorm1d(2)
    return nn.Sequential(
        nn.Linear(2, 2),
        nn.Sequential(nn.Linear(2, 2), shared, nn.Sequential(nn.LayerNorm(2), nn.ReLU())),
        shared,
        nn.ModuleDict({"a": nn.Linear(2, 2, bias=False), "b": nn.Embedding(3, 2)}),
    )


@given(
    moves=st.lists(
        st.tuples(st.integers(0, 100), st.sampled_from(["cpu", "meta"]), st.booleans()),
        max_size=12,
    )
)
def test_cached_answer_equals_the_walk_after_any_moves(moves: list[tuple[int, str, bool]]) -> None:
    """After any moves of any submodules of two models between cpu and meta, each answer
    is the uncached one: a move in one model leaves the other's answers standing, and
    changes the moved module's and its ancestors'."""
    modules = list(tree().modules()) + list(tree().modules())
    for index, device, check in moves:
        modules[index % len(modules)].to_empty(device=device)
        if check:  # also let the cache fill between moves, or not
            assert [truth(m) for m in modules] == [module_device(m) for m in modules]
    assert [truth(m) for m in modules] == [module_device(m) for m in modules]


# --- through the decorator ----------------------------------------------------------------


class Net(nn.Module):
    """A model whose forward is decorated, and follows the model."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))

    @device_agnostic(scope=False)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_decorated_forward_follows_the_model_between_calls() -> None:
    """Moving the model between calls moves the next call's inputs to its new device."""
    net = Net()
    devices = [net(torch.ones(2)).device]
    net.to("meta")
    devices.append(net(torch.ones(2)).device)
    net.to_empty(device="cpu")
    devices.append(net(torch.ones(2)).device)
    assert [CPU, META, CPU] == devices


def test_decorated_forward_refuses_a_model_moved_in_part() -> None:
    """A model moved in part between calls is refused, by the name of the moved layer."""
    net = Net()
    net(torch.ones(2))
    net.body[1].to("meta")
    with pytest.raises(
        DeviceMismatchError, match=r'fix: self\.body\[1\]\.to_empty\(device="cpu"\)'
    ):
        net(torch.ones(2))


def test_a_spread_modules_verdict_is_cached_and_dropped_by_a_move() -> None:
    """A module spread by mistake is analysed once per change: the cached verdict stands
    until torch reports a move, which a fix (moving the stray) is."""
    net = model()
    net[1].to("meta")
    assert SPREAD == module_device(net)
    Counted.walks = 0
    net[0]._parameters = Counted(net[0]._parameters)
    assert [SPREAD, SPREAD] == [module_device(net), module_device(net)]
    assert 0 == Counted.walks
    net[1].to_empty(device="cpu")
    assert CPU == module_device(net)
