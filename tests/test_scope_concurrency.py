"""``on_device`` where other code shares the thread: torch's own scopes held by another task
or a suspended generator, ``precision=`` in coroutines, and ``@contextmanager`` helpers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack

from devicectx import device_agnostic, on_device
from devicectx._torch.modes import clear_default_device

pytestmark = pytest.mark.torch_internals  # CI runs it on every minor torch release

CPU = torch.device("cpu")
META = torch.device("meta")


def allocated() -> torch.device:
    """Where a factory call without ``device=`` allocates right now."""
    return torch.zeros(1).device


def matmul_dtype() -> torch.dtype:
    """The dtype a CPU matrix product computes in right now (bfloat16 under autocast)."""
    return (torch.ones(2, 2) @ torch.ones(2, 2)).dtype


# ---- torch's own scope around a block, ended by other code while the block is open ----


def _rows() -> Iterator[torch.Tensor]:
    """A helper written with torch's scope, suspended inside it between its items."""
    with torch.device("cpu"):
        yield torch.zeros(2)
        yield torch.zeros(2)


@pytest.mark.parametrize("end", [list, lambda rows: rows.close()])
def test_a_torch_device_of_a_generator_ended_inside_a_block_leaves_the_block_its_device(
    end: Callable[[Iterator[torch.Tensor]], object],
) -> None:
    """A suspended generator's ``with torch.device`` finished or closed inside a block was
    around the block, not inside it: the block keeps its device after it ends."""
    rows = _rows()
    next(rows)
    with on_device("meta"):
        end(rows)
        assert META == allocated() == torch.get_default_device()
    assert CPU == allocated()
    assert [] == _get_current_function_mode_stack()


def test_a_torch_device_of_a_generator_ended_inside_a_block_holds_for_compiled_code() -> None:
    """Compiled code in the block reads the block's device as eager code does, after a
    generator's ``with torch.device`` around the block ended inside it."""
    rows = _rows()
    next(rows)
    compiled = torch.compile(lambda x: torch.zeros(1) + x, backend="eager", fullgraph=True)
    try:
        with on_device("meta"):
            rows.close()
            assert META == compiled(torch.ones(1, device="meta")).device
    finally:
        torch._dynamo.reset()


def test_a_torch_device_ended_inside_a_block_over_a_global_default_leaves_it_its_device() -> None:
    """Where ``set_default_device``'s scope is back innermost once the generator's ends, the
    block still applies: that scope is older than the block."""
    torch.set_default_device("cpu")
    try:
        rows = _rows()
        next(rows)
        with on_device("meta"):
            rows.close()
            assert META == allocated()
        assert CPU == allocated()
    finally:
        clear_default_device()


def test_a_torch_device_entered_inside_a_block_after_an_outer_one_ended_still_wins() -> None:
    """Once the scope around the block has ended, a ``with torch.device`` entered inside the
    block wins inside it, as it does in any block."""
    rows = _rows()
    next(rows)
    with on_device("meta"):
        rows.close()
        with torch.device("cpu"):
            assert CPU == allocated()
        assert META == allocated()


def test_a_torch_device_of_another_task_that_closes_leaves_the_block_its_device() -> None:
    """Another task's ``with torch.device`` held across an ``await``, open when the block
    opened and closed while it is open, does not take the block's device away."""
    seen: dict[str, torch.device] = {}

    async def main() -> None:
        opened, block_open, closed = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def other() -> None:
            with torch.device("cpu"):
                opened.set()
                await block_open.wait()
            closed.set()

        async def mine() -> None:
            await opened.wait()
            with on_device("meta"):
                seen["before"] = allocated()
                block_open.set()
                await closed.wait()
                seen["after"] = allocated()

        await asyncio.gather(other(), mine())

    asyncio.run(main())
    assert {"before": META, "after": META} == seen
    assert [] == _get_current_function_mode_stack()


# ---- precision= in a decorated coroutine: autocast held across its awaits ----


@pytest.mark.parametrize(
    "decorate",
    [on_device("cpu", precision="bf16-mixed"), device_agnostic(precision="bf16-mixed")],
    ids=["on_device", "device_agnostic"],
)
def test_a_precision_coroutine_holds_its_autocast_for_the_tasks_it_gathers(
    decorate: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> None:
    """Autocast is the thread's: a ``precision=`` coroutine holds it across its awaits, so
    the coroutines it gathers (tasks of their own) and a region of its own body held
    across an ``await`` compute as written (entering it anew at each resume would take
    both from them)."""

    async def child() -> torch.dtype:
        await asyncio.sleep(0)
        return matmul_dtype()

    @decorate
    async def gathered() -> tuple[list[torch.dtype], tuple[torch.dtype, torch.dtype]]:
        children = await asyncio.gather(child(), child())
        with torch.autocast("cpu", enabled=False):
            before = matmul_dtype()
            await asyncio.sleep(0)
            after = matmul_dtype()
        return children, (before, after)

    children, region = asyncio.run(gathered())
    assert ([torch.bfloat16] * 2, (torch.float32, torch.float32)) == (children, region)
    assert not torch.is_autocast_enabled("cpu")


def test_a_precision_coroutine_cancelled_or_raising_leaves_no_autocast() -> None:
    """Cancelled while it awaits, or raising after a resume, a ``precision=`` coroutine
    leaves the thread's autocast as it found it; its error reaches the caller."""

    @on_device("cpu", precision="bf16-mixed")
    async def waits(forever: asyncio.Event) -> None:
        await forever.wait()

    @on_device("cpu", precision="bf16-mixed")
    async def fails() -> None:
        await asyncio.sleep(0)
        msg = "in the body"
        raise ValueError(msg)

    async def main() -> None:
        task = asyncio.create_task(waits(asyncio.Event()))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not torch.is_autocast_enabled("cpu")
        with pytest.raises(ValueError, match=r"^in the body$"):
            await fails()

    asyncio.run(main())
    assert not torch.is_autocast_enabled("cpu")


# ---- @contextmanager helpers ----


@pytest.mark.parametrize(
    ("factory", "name"),
    [
        (contextlib.contextmanager, "contextmanager"),
        (contextlib.asynccontextmanager, "asynccontextmanager"),
    ],
)
def test_on_device_above_a_context_manager_factory_is_refused_with_the_form_that_works(
    factory: Callable[..., Any], name: str
) -> None:
    """Above ``@contextmanager`` the block would cover only the making of the context
    manager: refused where written, with the fix that puts the ``with`` body in the block."""

    def inference_scope() -> Iterator[None]:
        yield

    with pytest.raises(TypeError) as error:
        on_device("meta", precision="32")(factory(inference_scope))
    assert [
        f"@on_device('meta', precision='32') written above @{name} would be in the block "
        f"only while inference_scope() makes its context manager: the generator's code and "
        f"the `with` body run after, outside it (below @{name}, the block is left at the "
        f"`yield`, so the `with` body runs outside it too)",
        f"fix: in `{'async def' if name.startswith('async') else 'def'} inference_scope`, "
        "write `with on_device('meta', precision='32'):` around the `yield`",
    ] == str(error.value).splitlines()


def test_the_refusals_fix_puts_the_with_body_in_the_block_and_below_it_does_not() -> None:
    """``with on_device(...):`` around the ``yield`` covers the ``with`` body; ``@on_device``
    below ``@contextmanager`` leaves its block at the ``yield``, as for any generator."""

    @contextlib.contextmanager
    def fixed() -> Iterator[None]:
        with on_device("meta"):
            yield

    @contextlib.asynccontextmanager
    async def fixed_async() -> AsyncIterator[None]:
        with on_device("meta"):
            yield

    @contextlib.contextmanager
    @on_device("meta")
    def below() -> Iterator[torch.device]:
        yield allocated()

    async def in_async_with() -> torch.device:
        async with fixed_async():
            return allocated()

    with fixed():
        assert META == allocated()
    assert META == asyncio.run(in_async_with())
    with below() as inside_the_generator:
        assert (META, CPU) == (inside_the_generator, allocated())
