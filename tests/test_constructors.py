"""What ``on_device`` changes in torch: its constructors, from the first block on; nothing else."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils._device
from helpers import accelerator, mps_like, python_output
from hypothesis import given
from hypothesis import strategies as st

from devicectx import DtypeUnsupportedError, device_agnostic, on_device
from devicectx._torch.modes import stack_length
from devicectx.scope import _constructors

pytestmark = pytest.mark.torch_internals  # CI runs it on every minor torch release

CPU = torch.device("cpu")
META = torch.device("meta")
# torch's own functions, whatever torch.zeros is now: held in an object (a module-level name
# bound to one is replaced at the next block).
OWN = {"zeros": torch._C._VariableFunctions.zeros}
# torch's set lists the replacements too, once made (so that its mode knows them).
CONSTRUCTORS = sorted(
    (
        f
        for f in torch.utils._device._device_constructors()
        if getattr(f, "__code__", None) not in _constructors._REPLACEMENTS
    ),
    key=lambda f: f.__name__,
)
# Arguments that make each constructor allocate something small.
CALLS = {
    "arange": ((3,), {}),
    "as_tensor": (([1.0, 2.0],), {}),
    "asarray": (([1.0, 2.0],), {}),
    "bartlett_window": ((4,), {}),
    "blackman_window": ((4,), {}),
    "empty": ((2,), {}),
    "empty_permuted": (((2, 3), (1, 0)), {}),
    "empty_strided": (((2, 3), (3, 1)), {}),
    "eye": ((2,), {}),
    "full": (((2,), 1.0), {}),
    "hamming_window": ((4,), {}),
    "hann_window": ((4,), {}),
    "kaiser_window": ((4,), {}),
    "linspace": ((0, 1, 5), {}),
    "logspace": ((0, 1, 5), {}),
    "ones": ((2,), {}),
    "rand": ((2,), {}),
    "randint": ((5, (2,)), {}),
    "randn": ((2,), {}),
    "randperm": ((4,), {}),
    "range": ((0, 3), {}),
    "scalar_tensor": ((1.0,), {}),
    "tensor": (([1.0, 2.0],), {}),
    "tril_indices": ((3, 3), {}),
    "triu_indices": ((3, 3), {}),
    "zeros": ((2,), {}),
}


def test_ops_inside_a_block_pass_through_no_mode() -> None:
    """Inside a block no mode sits on torch's stack: ops on existing tensors run as outside."""
    a = torch.ones(2)
    with on_device("meta"):
        assert 0 == stack_length()
        assert CPU == (a + a).device
        assert META == torch.zeros(1).device


@pytest.mark.parametrize("name", sorted(CALLS))
def test_each_constructor_lands_on_the_block_device(name: str) -> None:
    """Each constructor torch's DeviceContext covers, called without device=, lands in the block."""
    args, kwargs = CALLS[name]
    constructor = getattr(torch, name)
    with on_device("meta"):
        assert META == getattr(torch, name)(*args, **kwargs).device
    assert CPU == constructor(*args, **kwargs).device


def test_every_constructor_is_replaced_from_the_first_block_on() -> None:
    """Each of torch's constructors is replaced in its modules at the first block, and stays:
    outside every block the replacement hands the call to torch's own function."""
    homes = {"fft_fftfreq": torch.fft, "fft_rfftfreq": torch.fft, "nested_tensor": torch.nested}
    names = {"fft_fftfreq": "fftfreq", "fft_rfftfreq": "rfftfreq"}
    with on_device("meta"):
        pass
    for original in CONSTRUCTORS:
        home = homes.get(original.__name__, torch)
        name = names.get(original.__name__, original.__name__)
        replacement = getattr(home, name)
        assert replacement is not original, name
        assert original is replacement.__wrapped__, name
    assert CPU == torch.zeros(1).device
    assert 0 == stack_length()


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided])
def test_a_nested_tensor_goes_where_torch_device_puts_it(layout: torch.layout) -> None:
    """``torch.nested.nested_tensor`` of tensors stays with the leftmost one (its documented
    default, as under ``torch.device``); of lists, it lands in the block."""
    parts = [torch.ones(2, 3), torch.ones(1, 3)]
    for make in (
        lambda: torch.nested.nested_tensor(parts, layout=layout),
        lambda: torch.nested.nested_tensor(tensor_list=parts, layout=layout),
        lambda: torch.nested.nested_tensor([[1.0, 2.0], [3.0, 4.0]], layout=layout),
    ):
        assert _outcome(make, torch.device("meta")) == _outcome(make, on_device("meta"))
    with on_device("meta"):
        assert CPU == torch.nested.nested_tensor(parts, layout=layout).device
    if layout == torch.jagged:  # a strided one on meta: torch's own error, in both
        with on_device("meta"):
            assert META == torch.nested.nested_tensor([[1.0], [2.0]], layout=layout).device


def _outcome(make: Callable[[], torch.Tensor], block: Any) -> object:
    """Where ``make`` puts its tensor in ``block``, or the type of its error."""
    with block:
        try:
            return make().device
        except RuntimeError as error:
            return type(error)


def test_fft_constructors() -> None:
    """Constructors outside torch's own namespace (torch.fft) follow the block."""
    with on_device("meta"):
        assert META == torch.fft.fftfreq(4).device
        assert META == torch.fft.rfftfreq(4).device


def test_modules_built_in_a_block_land_on_its_device() -> None:
    """nn.Module parameters and buffers built in a block are on its device."""
    with on_device("meta"):
        layer = torch.nn.BatchNorm1d(3)
        linear = torch.nn.Linear(2, 2)
    assert {META} == {t.device for t in [*layer.parameters(), *layer.buffers()]}
    assert META == linear.weight.device


@pytest.mark.parametrize("name", ["randperm", "randn", "randint"])
def test_a_constructor_given_a_generator_draws_on_its_device(name: str) -> None:
    """A random constructor given a generator draws where the generator is (a CPU
    generator refuses any other device), whatever the block's device; without one, on the
    block's device."""
    arguments = {"randperm": (5,), "randn": (5,), "randint": (9, (5,))}[name]
    with on_device("meta"):
        constructor = getattr(torch, name)  # read in the block: the wrapper, from the first
        drawn = constructor(*arguments, generator=torch.Generator().manual_seed(0))
        unseeded = constructor(*arguments)
    assert torch.device("cpu") == drawn.device
    again = getattr(torch, name)(*arguments, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again, drawn)
    assert torch.device("meta") == unseeded.device


@pytest.mark.requires_device("accelerator")
def test_a_shuffling_data_loader_iterates_inside_a_block() -> None:
    """DataLoader's shuffling sampler draws its order with a CPU generator: inside a block
    on the accelerator it iterates (torch's own default device makes it fail), and its
    batches, made in the block, land on the block's device."""
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=4, shuffle=True)
    device = accelerator()
    with on_device(device):
        batches = list(loader)
    assert [device] * 3 == [batch.device for batch in batches]
    assert list(range(10)) == sorted(torch.cat(batches).tolist())


def test_leaving_by_an_exception_leaves_torch_default() -> None:
    """Leaving a block by an exception leaves constructors on torch's default again, and
    dynamo's view of the default as it was."""
    before = torch.utils._device.CURRENT_DEVICE  # (tests before this one may have set it)
    with pytest.raises(KeyError), on_device("meta"):
        raise KeyError
    assert CPU == torch.zeros(1).device
    assert before is torch.utils._device.CURRENT_DEVICE


def test_threads_leaving_in_any_order_leave_torch_default() -> None:
    """Threads opening and closing blocks in any order see their own device, and the CPU once
    all are out."""
    barrier = threading.Barrier(4)
    seen: list[torch.device] = []

    def work() -> None:
        for _ in range(20):
            with on_device("meta"):
                barrier.wait()
                seen.append(torch.zeros(1).device)
            barrier.wait()
            seen.append(torch.zeros(1).device)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (80, 80) == (seen.count(META), seen.count(CPU))
    assert CPU == torch.zeros(1).device


def test_a_thread_without_a_block_keeps_the_cpu_while_another_has_one() -> None:
    """The replaced constructors fill in a device only for the thread that opened a block."""
    inside, done = threading.Event(), threading.Event()
    seen: list[torch.device] = []

    def other() -> None:
        inside.wait()
        seen.append(torch.zeros(1).device)
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with on_device("meta"):
        inside.set()
        done.wait()
    thread.join()
    assert [CPU] == seen


def test_a_reference_held_in_an_object_needs_exact() -> None:
    """torch's own constructor held in an object is not filled in: exact=True covers it."""
    zeros = OWN["zeros"]
    with on_device("meta"):
        assert CPU == zeros(1).device
    with on_device("meta", exact=True):
        assert META == zeros(1).device
        assert META == torch.zeros(1).device
        assert 1 == stack_length()
    assert 0 == stack_length()


# A module imported before devicectx binds torch's own functions by name, at module level
# and in a module that binds them after a block closed; torch modules imported after the
# first block are looked through too (torch.utils.benchmark binds none: a stand-in module).
_MODULE_LEVEL_NAMES = r"""
import sys, types
import torch
early = types.ModuleType("early")
exec("import torch\nfrom torch import zeros, ones\nfrom torch.fft import fftfreq\n"
     "arange = torch._C._VariableFunctions.arange", early.__dict__)
sys.modules["early"] = early
from devicectx import on_device

held = {"zeros": torch.zeros}  # in an object: the one limit
with on_device("meta"):
    first = [early.zeros(1).device, early.ones(1).device, early.fftfreq(2).device,
             early.arange(2).device, held["zeros"](1).device]
late = types.ModuleType("torch._late")
exec("import torch\nzeros = torch._C._VariableFunctions.zeros\nones = torch.ones", late.__dict__)
sys.modules["torch._late"] = late
with on_device("meta"):
    second = [late.zeros(1).device, late.ones(1).device]
outside = [early.zeros(1).device, late.zeros(1).device]
print(*first, *second, *outside)
"""


def test_module_level_names_bound_anywhere_anytime_follow_the_block() -> None:
    """A module-level name bound to a constructor, in a module imported before devicectx, or
    after a block closed, follows the block; a reference held in an object does not."""
    expected = "meta meta meta meta cpu meta meta cpu cpu"
    assert expected == python_output(_MODULE_LEVEL_NAMES)


# A failing entry (a bad device, a precision the device lacks) as the first block of the
# process: nothing is replaced, torch's own functions stay.
_FAILING_ENTRY = """
import torch
from devicectx import on_device, DeviceError

for spec in ("gpu", "cuda:3"):
    try:
        with on_device(spec):
            pass
    except DeviceError as error:
        print(type(error).__name__, end=" ")
print(torch.zeros is torch._C._VariableFunctions.zeros, torch.utils._device.CURRENT_DEVICE)
"""


def test_a_failing_entry_leaves_torch_its_own_functions() -> None:
    """A block that fails at entry, the first of the process, replaces nothing in torch."""
    expected = "InvalidDeviceError DeviceUnavailableError True None"
    assert expected == python_output(_FAILING_ENTRY)


def test_a_process_without_a_block_runs_torch_own_functions() -> None:
    """Importing devicectx, and blocks on the default device, replace nothing."""
    source = (
        "import torch, devicectx\nwith devicectx.on_device('cpu'):\n    pass\n"
        "print(torch.zeros is torch._C._VariableFunctions.zeros)"
    )
    assert "True" == python_output(source)


def test_torch_jit_script_compiles_a_constructor_after_a_block() -> None:
    """TorchScript knows each replacement as its aten op: code calling one scripts."""
    with on_device("meta"):
        pass

    def make(n: int) -> torch.Tensor:
        return torch.zeros(n) + torch.arange(n)

    assert [0.0, 1.0] == torch.jit.script(make)(2).tolist()


def test_exact_applies_per_asyncio_task() -> None:
    """An exact block's mode fills in the device only for the task that entered it."""

    async def main() -> list[torch.device]:
        entered, checked = asyncio.Event(), asyncio.Event()
        seen: list[torch.device] = []

        async def scoped() -> None:
            with on_device("meta", exact=True):
                entered.set()
                await checked.wait()
                seen.append(OWN["zeros"](1).device)

        async def plain() -> None:
            await entered.wait()
            seen.append(OWN["zeros"](1).device)
            checked.set()

        await asyncio.gather(scoped(), plain())
        return seen

    assert [CPU, META] == asyncio.run(main())


def test_get_default_device_answers_for_the_block_over_a_global_default() -> None:
    """Over a set_default_device default, get_default_device reports the block's device."""
    torch.set_default_device("meta")
    try:
        with on_device("cpu"):
            assert CPU == torch.get_default_device()
            assert CPU == torch.zeros(1).device
        assert META == torch.get_default_device()
    finally:
        torch.set_default_device(None)


def test_compiled_function_called_inside_blocks() -> None:
    """A fullgraph-compiled function allocates where eager code would, in and out of blocks."""

    def make(x: torch.Tensor) -> tuple[torch.Tensor, torch.device]:
        return x + torch.zeros(2), torch.ones(1).device

    compiled = torch.compile(make, fullgraph=True, backend="eager")
    with on_device("meta"):
        assert META == compiled(torch.ones(2, device="meta"))[1]
        with torch.device("cpu"):
            assert CPU == compiled(torch.ones(2))[1]
    assert CPU == compiled(torch.ones(2))[1]


@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiled_function_called_inside_an_exact_block(fullgraph: bool) -> None:
    """Inside ``on_device(..., exact=True)`` a compiled function compiles into one graph (as
    inside ``torch.device``) and allocates where eager code would, a constructor held in
    an object included."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(graph: torch.fx.GraphModule, _: list[torch.Tensor]) -> object:
        graphs.append(graph)
        return graph.forward

    def make(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x.sin() + torch.zeros(2), OWN["zeros"](1), torch.ones(1, device="cpu")

    torch._dynamo.reset()
    compiled = torch.compile(make, fullgraph=fullgraph, backend=backend)
    with on_device("meta", exact=True):
        eager = make(torch.ones(2, device="meta"))
        traced = compiled(torch.ones(2, device="meta"))
    assert [META, META, CPU] == [t.device for t in eager]
    assert [t.device for t in eager] == [t.device for t in traced]
    assert 1 == len(graphs)
    assert CPU == compiled(torch.ones(2))[1].device  # outside the block: recompiled for it
    torch._dynamo.reset()


# dynamo is imported first: on torch 2.6 its import makes tensors, which on meta fails (as it
# does under torch's own set_default_device("meta")); its table of functions is built at the
# first compile, in the block.
_FIRST_COMPILE_IN_A_BLOCK = """
import torch
import torch._dynamo
from devicectx import device_agnostic, on_device
from devicectx.scope import _constructors

def make(x):
    return x + torch.zeros(2)

with on_device("meta"):
    inside = torch.compile(make, fullgraph=True, backend="eager")(torch.ones(2, device="meta"))

def other(x):
    return x * torch.ones(2)

outside = torch.compile(other, fullgraph=True, backend="eager")(torch.ones(2))

# A device mode in traced code (a decorated call's scope) still applies to torch's own
# constructors (torch 2.7 to 2.10 lost them from another table built in the block).
@device_agnostic(device="meta")
def scoped(x):
    return x + torch.zeros(1)

traced = torch.compile(scoped, fullgraph=True, backend="eager")(torch.ones(1))
print(inside.device, outside.device, traced.device)
"""


def test_first_compile_of_the_process_inside_a_block() -> None:
    """dynamo building its table of torch functions inside a block still knows torch's own after."""
    assert "meta cpu meta" == python_output(_FIRST_COMPILE_IN_A_BLOCK)


# dynamo turns a numpy argument into a tensor with torch.as_tensor, run between graphs: the
# replacement must not be compiled as a frame of its own (its graph called it again, without
# end: RecursionError). The result is where torch's own device block puts it.
_NUMPY_INTO_A_COMPILED_FUNCTION = """
import numpy as np
import torch
from devicectx import on_device

compiled = torch.compile(lambda a: torch.from_numpy(a) + 1, backend="eager")
with torch.device("meta"):
    theirs = compiled(np.ones(2, dtype=np.float32)).device
torch._dynamo.reset()
with on_device("meta"):
    ours = compiled(np.ones(2, dtype=np.float32)).device
print(theirs, ours)
"""


def test_a_numpy_argument_of_a_compiled_function_inside_a_block() -> None:
    """A compiled function given a numpy array runs inside a block, as inside torch.device."""
    pytest.importorskip("numpy")
    theirs, ours = python_output(_NUMPY_INTO_A_COMPILED_FUNCTION).split()
    assert theirs == ours


@given(
    st.lists(
        st.sampled_from(["meta", "cpu", "torch-meta", "torch-cpu", "call-meta", "call-cpu"]),
        max_size=6,
    )
)
def test_nesting_with_torch_device_blocks(plan: list[str]) -> None:
    """Any nesting of on_device blocks, torch.device blocks and decorated calls allocates on
    the innermost one's device, at every level, before and after the ones inside it (a
    block on the CPU entered first changes nothing torch would not do: what is entered
    inside it still counts)."""

    def enter(level: int, expected: torch.device) -> None:
        assert expected == torch.zeros(1).device
        # torch 2.6 and 2.7 alone miss torch.device blocks here.
        if level and plan[level - 1] in ("cpu", "meta"):
            assert expected == torch.get_default_device()
        if level == len(plan):
            return
        kind, _, name = plan[level].rpartition("-")
        inner = torch.device(name)
        if kind == "call":
            device_agnostic(device=inner)(enter)(level + 1, inner)
        else:
            with torch.device(inner) if kind == "torch" else on_device(inner):
                enter(level + 1, inner)
        assert expected == torch.zeros(1).device

    enter(0, CPU)
    assert CPU == torch.zeros(1).device


def test_dynamo_s_own_code_gets_no_device_from_a_block() -> None:
    """A constructor called from a module of dynamo's (as its import-time probes are) is
    left to torch inside a block; the same call from any other module gets the block's."""
    import torch._dynamo  # its import puts it in sys.modules

    code = compile("made = torch.zeros(1)", "<probe>", "exec")
    for module, expected in (("torch._dynamo.probe", CPU), ("user_code", META)):
        namespace = {"__name__": module, "torch": torch}
        with on_device("meta"):
            exec(code, namespace)
        assert expected == namespace["made"].device, module


def test_decorated_call_scopes_its_body_without_a_mode() -> None:
    """@device_agnostic scopes its body to the target with no mode on torch's stack."""

    @device_agnostic(device="meta")
    def body(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return torch.zeros(1), stack_length()

    made, modes = body(torch.ones(1))
    assert (META, 0) == (made.device, modes)


# A dtype the block's device cannot hold, from torch's default dtype


@pytest.fixture
def default_float64() -> Iterator[None]:
    """torch's default dtype float64 in the test, as scientific code sets it; the one
    before after it."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.mark.requires_device("accelerator")
@pytest.mark.usefixtures("default_float64")
def test_a_default_dtype_the_block_device_cannot_hold_is_named_with_its_fix() -> None:
    """A module built in a block on a device without float64, torch's default dtype
    float64: the error names the default dtype as the cause (the constructor is inside the
    module, where no dtype= can be given), and its fix, followed, builds the module."""
    with mps_like() as device:
        with on_device(device), pytest.raises(DtypeUnsupportedError) as raised:
            torch.nn.Linear(3, 2)
        assert [
            f"torch.empty() inside a block on {device}, called without dtype=, would make a "
            f"tensor of torch's default dtype, torch.float64, which {device} cannot hold "
            "(TypeError from torch)",
            "fix: torch.set_default_dtype(torch.float32) before the block, or where "
            "torch.empty() is called in your code, torch.empty(..., dtype=torch.float32)",
        ] == str(raised.value).splitlines()
        exec(str(raised.value).splitlines()[-1].removeprefix("fix: ").partition(" before")[0])
        with on_device(device):
            layer = torch.nn.Linear(3, 2)
    assert (device, torch.float32) == (layer.weight.device, layer.weight.dtype)


@pytest.mark.requires_device("accelerator")
def test_a_constructor_outside_torch_s_namespace_is_named_as_the_user_wrote_it() -> None:
    """``torch.fft.fftfreq`` (``fft_fftfreq`` to torch) refused on a device without float64
    is named as written, and its fix, pasted, runs."""
    with mps_like() as device:
        with on_device(device), pytest.raises(DtypeUnsupportedError) as raised:
            torch.fft.fftfreq(4, dtype=torch.float64)
        fix = str(raised.value).splitlines()[-1]
        assert str(raised.value).startswith("torch.fft.fftfreq() inside a block on ")
        assert fix.startswith("fix: torch.fft.fftfreq(..., dtype=torch.float32)")
        with on_device(device):
            assert torch.float32 == torch.fft.fftfreq(4, dtype=torch.float32).dtype


@pytest.mark.requires_device("accelerator")
@pytest.mark.usefixtures("default_float64")
def test_a_dtype_of_the_data_or_given_keeps_the_dtype_fix_under_a_float64_default() -> None:
    """With torch's default dtype float64, a float64 that the constructor takes from its
    data (a numpy array) or from dtype= is not the default's doing: the fix stays dtype=."""
    np = pytest.importorskip("numpy")
    with mps_like() as device, on_device(device):
        for make in (
            lambda: torch.tensor(np.zeros(3)),
            lambda: torch.zeros(2, dtype=torch.float64),
            lambda: torch.tensor([np.float64(1.0), 2.0]),
        ):
            with pytest.raises(DtypeUnsupportedError) as raised:
                make()
            assert "default dtype" not in str(raised.value)
            assert ", dtype=torch.float32), or make it on the CPU" in str(raised.value)


class _WorkerSeeds(torch.utils.data.Dataset[int]):
    """Each item: the seed of the worker that loads it."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        info = torch.utils.data.get_worker_info()
        return -1 if info is None else info.seed


def _loaded(workers: int) -> list[list[int]]:
    torch.manual_seed(0)
    shuffled = torch.utils.data.DataLoader(
        list(range(8)), batch_size=4, shuffle=True, collate_fn=list
    )
    seeds = torch.utils.data.DataLoader(_WorkerSeeds(), num_workers=workers, collate_fn=list)
    return [*shuffled, *seeds]


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize(
    "target",
    ["meta", pytest.param("accelerator", marks=pytest.mark.requires_device("accelerator"))],
)
def test_a_dataloader_in_a_block_draws_the_seeds_a_cpu_run_draws(target: str, exact: bool) -> None:
    """torch.utils.data draws its shuffling sampler's seed and its workers' base seed with
    ``torch.empty((), dtype=torch.int64).random_()``: in a block they are drawn on the host,
    as outside it, so a block gives the order and the worker seeds of a CPU run with the
    same ``torch.manual_seed`` (torch's ``with torch.device`` draws them on the device, and
    a shuffling loader fails in a ``meta`` block: no values to read); ``exact=True``'s mode
    leaves them to the host too."""
    device = accelerator() if target == "accelerator" else torch.device("meta")
    workers = 1 if target == "meta" else 0  # no fork of a process using the accelerator
    outside = _loaded(workers)
    with on_device(device, exact=exact):
        inside = _loaded(workers)
        assert device == torch.empty(()).device  # a block's own 0-d tensors stay its
        assert device == torch.empty((), dtype=torch.int64).device
    assert outside == inside
