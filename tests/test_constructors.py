"""What ``on_device`` changes in torch: its constructors while a block is open, nothing else."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
import torch.utils._device
from helpers import python_output
from hypothesis import given
from hypothesis import strategies as st

from devicectx import device_agnostic, on_device
from devicectx._torch_modes import stack_length

CPU = torch.device("cpu")
META = torch.device("meta")
ZEROS = torch._C._VariableFunctions.zeros  # torch's own, whatever torch.zeros is now
CONSTRUCTORS = sorted(torch.utils._device._device_constructors(), key=lambda f: f.__name__)
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


def test_every_constructor_is_replaced_only_while_a_block_is_open() -> None:
    """Each of torch's constructors is replaced in its modules inside a block, and given back."""
    homes = {"fft_fftfreq": torch.fft, "fft_rfftfreq": torch.fft, "nested_tensor": torch.nested}
    names = {"fft_fftfreq": "fftfreq", "fft_rfftfreq": "rfftfreq"}
    for original in CONSTRUCTORS:
        home = homes.get(original.__name__, torch)
        name = names.get(original.__name__, original.__name__)
        assert getattr(home, name) is original, name
        with on_device("meta"):
            assert getattr(home, name) is not original, name
        assert getattr(home, name) is original, name


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


def test_torch_is_given_back_after_an_exception() -> None:
    """Leaving the last block by an exception gives torch its own functions back."""
    with pytest.raises(KeyError), on_device("meta"):
        raise KeyError
    assert torch.zeros is ZEROS


def test_torch_is_given_back_when_threads_leave_in_any_order() -> None:
    """Threads opening and closing blocks in any order leave torch as it was, once all are out."""
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
    assert torch.zeros is ZEROS


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


def test_a_name_bound_before_the_block_needs_exact() -> None:
    """A constructor bound to a name before the first block is torch's own: exact=True covers it."""
    zeros = ZEROS
    with on_device("meta"):
        assert CPU == zeros(1).device
    with on_device("meta", exact=True):
        assert META == zeros(1).device
        assert META == torch.zeros(1).device
        assert 1 == stack_length()
    assert 0 == stack_length()


def test_exact_applies_per_asyncio_task() -> None:
    """An exact block's mode fills in the device only for the task that entered it."""

    async def main() -> list[torch.device]:
        entered, checked = asyncio.Event(), asyncio.Event()
        seen: list[torch.device] = []

        async def scoped() -> None:
            with on_device("meta", exact=True):
                entered.set()
                await checked.wait()
                seen.append(ZEROS(1).device)

        async def plain() -> None:
            await entered.wait()
            seen.append(ZEROS(1).device)
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


# dynamo is imported first: on torch 2.6 its import makes tensors, which on meta fails (as it
# does under torch's own set_default_device("meta")); its table of functions is built at the
# first compile, in the block.
_FIRST_COMPILE_IN_A_BLOCK = """
import torch
import torch._dynamo
from devicectx import device_agnostic, on_device

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


@given(st.lists(st.sampled_from(["meta", "cpu", "torch-meta", "torch-cpu"]), max_size=6))
def test_nesting_with_torch_device_blocks(plan: list[str]) -> None:
    """Any nesting of on_device and torch.device blocks allocates on the innermost one's device."""

    def enter(level: int) -> None:
        if level == len(plan):
            expected = CPU
            for step in plan:
                expected = torch.device(step.removeprefix("torch-"))
            assert expected == torch.zeros(1).device
            # torch 2.6 and 2.7 alone miss torch.device blocks here.
            if plan and plan[-1] in ("cpu", "meta"):
                assert expected == torch.get_default_device()
            return
        step = plan[level]
        block = torch.device(step[6:]) if step.startswith("torch-") else on_device(step)
        with block:
            enter(level + 1)

    enter(0)
    assert torch.zeros is ZEROS
    assert CPU == torch.zeros(1).device


def test_decorated_call_scopes_its_body_without_a_mode() -> None:
    """@device_agnostic scopes its body to the target with no mode on torch's stack."""

    @device_agnostic(device="meta")
    def body(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return torch.zeros(1), stack_length()

    made, modes = body(torch.ones(1))
    assert (META, 0) == (made.device, modes)
