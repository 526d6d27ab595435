"""``on_device``: the default device for a block, across nesting, errors, threads and tasks."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import pickle
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import pytest
import torch
from helpers import accelerator, python_output
from hypothesis import given
from hypothesis import strategies as st
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext

import devicectx
from devicectx import (
    DeviceUnavailableError,
    InvalidDeviceError,
    ScopeExitError,
    StrayTensorWarning,
    current_device,
    device_agnostic,
    on_device,
    resolve_device,
)
from devicectx._torch.modes import clear_default_device
from devicectx.scope._stack import active_device, leave_opened_since
from devicectx.testing.strategies import devices

pytestmark = pytest.mark.torch_internals  # CI runs it on every minor torch release

CPU = torch.device("cpu")
META = torch.device("meta")
T = TypeVar("T")


def allocated() -> torch.device:
    """Where a factory call without ``device=`` allocates right now."""
    return torch.zeros(1).device


def test_block_sets_the_default_device_and_restores_it() -> None:
    """Factories, get_default_device and current_device all follow the block, then revert."""
    with on_device("meta") as device:
        assert META == device
        assert META == allocated()
        assert META == torch.get_default_device()
        assert META == current_device()
        assert META == torch.arange(3).device
        assert META == torch.tensor([1, 2]).device
    assert CPU == allocated()
    assert CPU == torch.get_default_device()


def test_explicit_device_argument_wins() -> None:
    """A factory called with device= is left alone, as torch's own scope does."""
    with on_device("meta"):
        assert CPU == torch.zeros(1, device="cpu").device


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_exit_by_exception_restores(error: type[BaseException]) -> None:
    """Leaving by an exception, KeyboardInterrupt included, restores the previous default."""
    with pytest.raises(error), on_device("meta"):
        raise error
    assert CPU == allocated()
    assert [] == _get_current_function_mode_stack()


_PACKAGE = str(Path(devicectx.__file__).parent)
_EXIT = on_device.__exit__.__code__


def _exit_guarded_from() -> int:
    """The first line of ``on_device.__exit__`` its guard covers (the one after ``try:``):
    no ``__exit__`` written in Python can guard its own lines before that."""
    lines, first = inspect.getsourcelines(on_device.__exit__)
    index = next((i for i, line in enumerate(lines) if line.strip() == "try:"), None)
    return first if index is None else first + index + 1


def _interrupted_at(line_event: int, **options: bool) -> int:
    """Run ``with on_device("meta", **options): pass`` with a KeyboardInterrupt raised at
    the ``line_event``-th line devicectx runs (as Ctrl-C would land there); the number of
    lines it ran. Python's own tracing hook delivers the interrupt, at every line in turn."""
    guarded, seen = _exit_guarded_from(), [0]

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        if not frame.f_code.co_filename.startswith(_PACKAGE):
            return None
        if event == "line" and (frame.f_code is not _EXIT or frame.f_lineno >= guarded):
            seen[0] += 1
            if seen[0] == line_event:
                raise KeyboardInterrupt
        return trace

    sys.settrace(trace)
    try:
        with on_device("meta", **options):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return seen[0]


@pytest.mark.parametrize("exact", [False, True])
def test_an_interrupt_anywhere_in_entering_or_leaving_leaves_nothing_behind(exact: bool) -> None:
    """Ctrl-C that lands while a block enters or leaves, not in its body (a notebook cell
    of short blocks in a loop), leaves no block open: torch's default and its mode stack
    are as before. It left the block's device the task's default for good (after the
    scope opened, the ``with`` statement calls no ``__exit__`` for an ``__enter__`` that
    raised; an exit cut short left the device set)."""
    with on_device("meta", exact=exact):  # the first block of a process does more, once
        pass
    lines = _interrupted_at(0, exact=exact)
    assert lines > 20
    left = []
    for line_event in range(1, lines + 1):
        _interrupted_at(line_event, exact=exact)
        state = (torch.get_default_device(), allocated(), len(_get_current_function_mode_stack()))
        if state != (CPU, CPU, 0):
            left.append(line_event)
            leave_opened_since(())  # what was left, for the tests after this one
            while _get_current_function_mode_stack():
                torch._C._pop_torch_function_stack()
            clear_default_device()
    assert [] == left


def test_nesting_to_any_depth() -> None:
    """Two hundred nested blocks each see their own device and unwind level by level."""
    depth = 200
    blocks = [on_device("meta" if level % 2 else "cpu") for level in range(depth)]
    for level, block in enumerate(blocks):
        block.__enter__()
        assert (META if level % 2 else CPU) == allocated()
    for level, block in reversed(list(enumerate(blocks))):
        assert (META if level % 2 else CPU) == allocated()
        block.__exit__(None, None, None)
    assert CPU == allocated()


def test_same_object_can_be_nested() -> None:
    """One on_device object entered twice, nested, unwinds correctly."""
    meta = on_device("meta")
    with meta, on_device("cpu"), meta:
        assert META == allocated()
    assert CPU == allocated()


def test_target_already_default_installs_nothing() -> None:
    """An on_device whose target is already the default leaves torch's mode stack alone.

    So ops inside it pay no per-op cost: nothing intercepts them.
    """
    with on_device("cpu"):
        assert [] == _get_current_function_mode_stack()
    with on_device("meta"):
        stack = _get_current_function_mode_stack()
        with on_device("meta"):
            assert stack == _get_current_function_mode_stack()


def test_active_device_reports_blocks_even_when_nothing_was_installed() -> None:
    """active_device names the innermost block, including one that needed no mode."""
    assert active_device() is None
    with on_device("cpu"):
        assert CPU == active_device()
        with on_device("meta"):
            assert META == active_device()
        assert CPU == active_device()
    assert active_device() is None


def test_bad_spec_raises_before_any_state_changes() -> None:
    """A malformed or missing device raises our errors at entry and changes nothing."""
    with pytest.raises(InvalidDeviceError), on_device("gpu"):
        pass  # pragma: no cover
    with pytest.raises(DeviceUnavailableError), on_device("cuda:3"):
        pass  # pragma: no cover
    assert [] == _get_current_function_mode_stack()
    assert active_device() is None


@pytest.mark.parametrize("options", [{}, {"exact": True}, {"precision": "32"}])
def test_one_exit_too_many_is_named_with_its_fix(options: dict[str, object]) -> None:
    """An ``__exit__`` with no entry of the object open (a notebook cell run once too often)
    raises our error, a ``RuntimeError`` as torch's own for ``torch.device``, and leaves
    the state as it was."""
    block = on_device("meta", **options)  # type: ignore[arg-type]
    block.__enter__()
    block.__exit__(None, None, None)
    with pytest.raises(ScopeExitError) as raised:
        block.__exit__(None, None, None)
    assert isinstance(raised.value, RuntimeError)
    written = ", ".join(["'meta'", *(f"{k}={v!r}" for k, v in options.items())])
    assert [
        f"on_device({written}).__exit__() was called once more than its __enter__(): "
        "no entry of this object is open",
        f"fix: call __exit__ once per __enter__, or write `with on_device({written}):`",
    ] == str(raised.value).splitlines()
    assert CPU == allocated()
    with block:
        assert META == allocated()
    assert CPU == allocated()


def test_auto_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """on_device("auto") picks DEVICECTX_DEVICE when it is set, at entry time."""
    block = on_device()
    monkeypatch.setenv("DEVICECTX_DEVICE", "meta")
    with block as device:
        assert META == device == allocated()


# ---- composition with torch's own scopes ----


def test_inside_torch_device() -> None:
    """on_device inside ``with torch.device``: innermost wins, and both unwind."""
    with torch.device("meta"):
        with on_device("cpu"):
            assert CPU == allocated() == torch.get_default_device()
        assert META == allocated()
    assert CPU == allocated()
    assert [] == _get_current_function_mode_stack()


def test_torch_device_inside() -> None:
    """``with torch.device`` inside on_device: innermost wins, and both unwind."""
    with on_device("meta"):
        with torch.device("cpu"):
            assert CPU == allocated() == torch.get_default_device()
        assert META == allocated()
    assert CPU == allocated()
    assert [] == _get_current_function_mode_stack()


def test_torch_alone_does_not_both_apply_and_keep_a_default_set_inside_its_scope() -> None:
    """The torch behaviour devicectx fixes: set_default_device inside torch.device.

    torch >= 2.11 applies it at once and loses it at the scope's exit; older releases keep
    it, but apply it only from the exit on. Never both, as on_device does.
    """
    with torch.device("cpu"):
        torch.set_default_device("meta")
        inside = allocated()
    after = allocated()
    clear_default_device()  # torch >= 2.11 then pushes the scope it displaced back: clear it
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()
    assert (inside, after) in [(META, CPU), (CPU, META)]


def test_set_default_device_inside_block_is_kept() -> None:
    """set_default_device inside on_device blocks takes effect at once and outlives them."""
    try:
        with on_device("meta"), on_device("cpu"):
            torch.set_default_device("meta")
            assert META == allocated() == torch.get_default_device()
        assert META == allocated() == torch.get_default_device()
    finally:
        torch.set_default_device(None)
    assert [] == _get_current_function_mode_stack()


def test_set_default_device_twice_inside_block() -> None:
    """A global default replaced inside a block is the one left after it."""
    torch.set_default_device("meta")
    try:
        with on_device("cpu"):
            assert CPU == allocated()
            torch.set_default_device("cpu")
            torch.set_default_device("meta")
        assert META == allocated()
    finally:
        torch.set_default_device(None)
    assert CPU == allocated()
    assert [] == _get_current_function_mode_stack()


def test_block_over_a_global_default_restores_it() -> None:
    """A block entered over set_default_device hands the global default back on exit."""
    torch.set_default_device("meta")
    try:
        with on_device("cpu"):
            assert CPU == allocated() == torch.get_default_device()
        assert META == allocated()
    finally:
        torch.set_default_device(None)


def test_get_default_device_after_the_default_was_cleared() -> None:
    """After set_default_device(None), blocks still report their device and restore the CPU.

    get_default_device of torch 2.6 to 2.9 fails in that state; leaving a block mends it.
    """
    torch.set_default_device(None)
    with on_device("meta"):
        assert META == torch.get_default_device()
    assert CPU == allocated() == torch.get_default_device()


def test_set_default_device_of_another_thread_is_not_seen() -> None:
    """A default set in another thread, inside or outside its blocks, stays in that thread."""
    seen: list[torch.device] = []

    def other() -> None:
        with on_device("meta"), on_device("cpu"):
            torch.set_default_device("meta")
            seen.append(allocated())
        seen.append(allocated())
        clear_default_device()

    with on_device("meta"):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert META == allocated()
    assert [META, META, CPU] == [*seen, allocated()]


def test_a_device_context_entered_by_hand_and_left_after_the_block() -> None:
    """A DeviceContext entered by hand inside a block and left after it: both undo cleanly.

    torch >= 2.11 moves the block's scope into the DeviceContext's ``prev_mode``; leaving
    the block takes it out of there.
    """
    block = on_device("meta")
    block.__enter__()
    by_hand = DeviceContext("cpu")
    by_hand.__enter__()
    block.__exit__(None, None, None)
    assert CPU == allocated()
    by_hand.__exit__(None, None, None)
    assert CPU == allocated()
    assert [] == _get_current_function_mode_stack()


# ---- property: any sequence of nested blocks ----

# Every device of this machine, and meta: the second device where there is no accelerator.
block_plans = st.lists(st.tuples(devices(allow_meta=True), st.booleans()), min_size=1, max_size=12)


class _Planned(Exception):
    """Raised by a planned level to leave its block by an exception."""


@given(start=st.sampled_from([None, "meta"]), plan=block_plans)
def test_any_nesting_sees_its_own_device_and_restores(
    start: str | None, plan: list[tuple[torch.device, bool]]
) -> None:
    """Nested blocks over {cpu, meta, ...}, some left by exceptions: each sees its own device.

    After the outermost block the starting default (set or not) is back.
    """
    if start is not None:
        torch.set_default_device(start)
    try:
        expected_start = torch.device(start or "cpu")

        def run(level: int) -> None:
            device, raises = plan[level]
            try:
                with on_device(device):
                    assert device == allocated()
                    if level + 1 < len(plan):
                        run(level + 1)
                    assert device == allocated()
                    if raises:
                        raise _Planned
            except _Planned:
                pass

        run(0)
        assert expected_start == allocated() == torch.get_default_device()
        assert active_device() is None
    finally:
        clear_default_device()


# ---- threads ----


@given(plans=st.lists(st.lists(devices(allow_meta=True), max_size=6), min_size=8, max_size=8))
def test_threads_see_only_their_own_blocks(plans: list[list[torch.device]]) -> None:
    """Eight threads inside random nested blocks at the same moment each see only their own."""
    barrier = threading.Barrier(len(plans))
    seen: dict[int, list[torch.device]] = {}

    def work(index: int) -> None:
        observed: list[torch.device] = []

        def nest(level: int) -> None:
            if level == len(plans[index]):
                barrier.wait(timeout=30)  # every thread is now inside all of its blocks
                observed.append(allocated())
                return
            with on_device(plans[index][level]):
                observed.append(allocated())
                nest(level + 1)
                observed.append(allocated())

        nest(0)
        observed.append(allocated())
        seen[index] = observed

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(plans))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, plan in enumerate(plans):
        levels = list(plan)
        innermost = levels[-1] if levels else CPU
        assert [*levels, innermost, *reversed(levels), CPU] == seen[index]


_FIRST_BLOCKS = """
import threading
import torch
import devicectx.scope._constructors as constructors
from devicectx import on_device

keep_trace_rules = constructors.keep_trace_rules
installing, second_done = threading.Event(), threading.Event()

def held(pairs):
    # The first block's install, held after its look through the modules until the second
    # block has allocated; a second block that waits for the install (as it must) cannot,
    # and the install goes on after a bound: the outcome does not depend on the timing.
    installing.set()
    second_done.wait(timeout=0.5)
    return keep_trace_rules(pairs)

constructors.keep_trace_rules = held
devices = {}

def block(name, wait):
    if wait:
        installing.wait()
    with on_device("meta"):
        devices[name] = torch.empty(0).device.type
    if wait:
        second_done.set()

threads = [threading.Thread(target=block, args=(name, name == "second"))
           for name in ("first", "second")]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(devices["first"], devices["second"])
"""


def test_a_block_opened_while_the_first_installs_waits_for_it() -> None:
    """The process's first block puts the constructors' replacements in place; a block
    opened in another thread meanwhile waits for them (it went on, and allocated on the
    CPU, seen on a GPU host where a test's threads opened the process's first blocks)."""
    assert "meta meta" == python_output(_FIRST_BLOCKS)


def test_thread_does_not_inherit_the_block_of_its_creator() -> None:
    """A thread started inside a block allocates on the CPU: the block is not its own."""
    seen: list[torch.device] = []
    with on_device("meta"):
        thread = threading.Thread(target=lambda: seen.append(allocated()))
        thread.start()
        thread.join()
    assert [CPU] == seen


# ---- asyncio ----


async def _interleaved(scope: type[on_device] | type[torch.device]) -> dict[str, torch.device]:
    """A enters meta; an idle task C looks; B enters cpu; A exits first; then B looks."""
    seen: dict[str, torch.device] = {}
    a_entered, b_entered, a_exited = asyncio.Event(), asyncio.Event(), asyncio.Event()
    c_looked = asyncio.Event()

    async def task_a() -> None:
        with scope("meta"):
            a_entered.set()
            await b_entered.wait()
            seen["A inside"] = allocated()
        a_exited.set()

    async def task_b() -> None:
        await c_looked.wait()
        with scope("cpu"):
            b_entered.set()
            await a_exited.wait()
            seen["B inside"] = allocated()
        seen["B after"] = allocated()

    async def task_c() -> None:
        await a_entered.wait()
        seen["C idle"] = allocated()
        c_looked.set()

    await asyncio.gather(task_a(), task_b(), task_c())
    seen["after both"] = allocated()
    return seen


def test_torch_device_leaks_between_asyncio_tasks() -> None:
    """torch's own scope: an idle task sees another's device, and out-of-order exits swap them."""
    seen = asyncio.run(_interleaved(torch.device))
    assert META == seen["C idle"]  # C entered no block but allocates on A's meta
    assert CPU == seen["A inside"]  # A asked for meta but sees B's cpu
    assert META == seen["B inside"]  # B asked for cpu but sees A's meta


def test_on_device_isolates_asyncio_tasks() -> None:
    """on_device: each task sees its own block, an idle task sees none, nothing is left over."""
    seen = asyncio.run(_interleaved(on_device))
    expected = {
        "A inside": META,
        "B inside": CPU,
        "B after": CPU,
        "C idle": CPU,
        "after both": CPU,
    }
    assert expected == seen
    assert [] == _get_current_function_mode_stack()


def test_get_default_device_in_a_task_answers_for_that_task() -> None:
    """torch.get_default_device() in a task without a block is not another task's device."""

    async def main() -> list[torch.device]:
        entered, looked = asyncio.Event(), asyncio.Event()

        async def inside() -> torch.device:
            with on_device("meta"):
                entered.set()
                await looked.wait()
                return torch.get_default_device()

        async def idle() -> torch.device:
            await entered.wait()
            seen = torch.get_default_device()
            looked.set()
            return seen

        return list(await asyncio.gather(inside(), idle()))

    assert [META, CPU] == asyncio.run(main())


def test_task_created_inside_a_block_inherits_it() -> None:
    """A task created inside a block starts with it while the block is open; run after
    the block has closed, it allocates on the default (a context variable set in the block
    keeps its value there: the block's device does not outlive the block)."""
    variable: contextvars.ContextVar[str] = contextvars.ContextVar("variable", default="")

    async def main() -> list[object]:
        async def child() -> tuple[torch.device, str]:
            return allocated(), variable.get()

        with on_device("meta"):
            during = await asyncio.create_task(child())
            variable.set("inner")
            late = asyncio.create_task(child())
        return [during, await late]

    assert [(META, ""), (CPU, "inner")] == asyncio.run(main())


@pytest.mark.parametrize("options", [{}, {"exact": True}, {"audit": True}])
def test_one_object_shared_by_tasks_whose_blocks_interleave(options: dict[str, bool]) -> None:
    """One on_device object (a module-level `GPU = on_device(...)`) entered by two tasks
    whose blocks close in the order they opened: each task's exit ends its own block, so
    the other still allocates on the device inside, and neither does after (the exits had
    ended each other's blocks: one task on the CPU inside, the other on meta after)."""
    shared = on_device("meta", **options)

    async def main() -> list[tuple[str, torch.device]]:
        seen: list[tuple[str, torch.device]] = []
        first_in, second_in, first_out = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def first() -> None:
            with shared:
                first_in.set()
                await second_in.wait()
            seen.append(("first after", allocated()))
            first_out.set()

        async def second() -> None:
            await first_in.wait()
            with shared:
                second_in.set()
                await first_out.wait()
                seen.append(("second inside", allocated()))
            seen.append(("second after", allocated()))

        await asyncio.gather(first(), second())
        return seen

    assert [("first after", CPU), ("second inside", META), ("second after", CPU)] == asyncio.run(
        main()
    )


def test_one_object_shared_by_threads_whose_blocks_interleave() -> None:
    """The same with threads: each thread's exit ends its own block."""
    shared = on_device("meta")
    seen: dict[str, torch.device] = {}
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with shared:
            first_in.set()
            second_in.wait()
        seen["first after"] = allocated()
        first_out.set()

    def second() -> None:
        first_in.wait()
        with shared:
            second_in.set()
            first_out.wait()
            seen["second inside"] = allocated()
        seen["second after"] = allocated()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {"first after": CPU, "second inside": META, "second after": CPU} == seen


# ---- the decorator form ----


def test_decorated_function() -> None:
    """A decorated function runs under the device and leaves nothing behind."""

    @on_device("meta")
    def make(n: int) -> torch.Tensor:
        """Make n zeros."""
        return torch.zeros(n)

    assert META == make(2).device
    assert "make" == make.__name__
    assert "Make n zeros." == make.__doc__
    assert CPU == allocated()


def test_decorated_generator_is_reentered_and_does_not_leak() -> None:
    """A decorated generator allocates on its device at every resume; its caller never does."""

    @on_device("meta")
    def numbers() -> Iterator[torch.Tensor]:
        for n in range(3):
            yield torch.zeros(n)

    seen = []
    for tensor in numbers():
        seen.append((tensor.device, allocated()))
    assert [(META, CPU)] * 3 == seen


def test_decorated_generator_send_throw_close_and_return() -> None:
    """send, throw, close and the return value pass through the decorated generator."""
    events: list[object] = []

    @on_device("meta")
    def echo() -> Iterator[object]:
        try:
            received = yield "ready"
            while True:
                try:
                    received = yield (received, allocated())
                except KeyError as error:
                    events.append(("caught", allocated()))
                    received = error.args[0]
        finally:
            events.append(("closed", allocated()))

    gen = echo()
    assert "ready" == next(gen)
    assert (1, META) == gen.send(1)
    assert ("k", META) == gen.throw(KeyError("k"))
    assert CPU == allocated()
    gen.close()
    assert [("caught", META), ("closed", META)] == events

    @on_device("meta")
    def returns() -> Iterator[int]:
        yield 1
        return 42

    gen2 = returns()
    next(gen2)
    with pytest.raises(StopIteration) as stop:
        next(gen2)
    assert 42 == stop.value.value


def test_decorated_coroutine_in_interleaved_tasks() -> None:
    """Decorated coroutines on different devices, interleaved, each see their own."""

    @on_device("meta")
    async def on_meta(gate: asyncio.Event) -> tuple[torch.device, torch.device]:
        before = allocated()
        await gate.wait()
        return before, allocated()

    @on_device("cpu")
    async def on_cpu(gate: asyncio.Event) -> torch.device:
        gate.set()
        return allocated()

    async def main() -> tuple[tuple[torch.device, torch.device], torch.device]:
        gate = asyncio.Event()
        return await asyncio.gather(on_meta(gate), on_cpu(gate))

    assert ((META, META), CPU) == tuple(asyncio.run(main()))


def test_decorated_async_generator() -> None:
    """A decorated async generator allocates on its device; its consumer does not."""

    @on_device("meta")
    async def stream() -> AsyncIterator[torch.device]:
        for _ in range(2):
            yield allocated()

    async def main() -> list[tuple[torch.device, torch.device]]:
        return [(item, allocated()) async for item in stream()]

    assert [(META, CPU), (META, CPU)] == asyncio.run(main())


def test_decorated_async_generator_forwards_asend_athrow_and_aclose() -> None:
    """asend, athrow and aclose reach the decorated async generator, on its device."""
    events: list[object] = []

    @on_device("meta")
    async def echo() -> AsyncIterator[object]:
        try:
            received = yield "ready"
            while True:
                try:
                    received = yield (received, allocated())
                except KeyError as error:
                    events.append(("caught", allocated()))
                    received = error.args[0]
        finally:
            events.append(("closed", allocated()))

    async def main() -> list[object]:
        gen = echo()
        seen: list[object] = [await gen.asend(None), await gen.asend(1)]
        seen.append(await gen.athrow(KeyError("k")))
        seen.append(allocated())
        await gen.aclose()
        return seen

    assert ["ready", (1, META), ("k", META), CPU] == asyncio.run(main())
    assert [("caught", META), ("closed", META)] == events


def test_decorated_async_generator_methods_bind_to_their_instance() -> None:
    """A decorated async generator method gets its instance, from the instance and from the
    class, and runs on its device."""

    class Source:
        @on_device("meta")
        async def items(self, count: int) -> AsyncIterator[tuple[object, torch.device]]:
            for _ in range(count):
                yield self, allocated()

    async def main(source: Source) -> list[object]:
        bound = [item async for item in source.items(2)]
        unbound = [item async for item in Source.items(source, 1)]
        return bound + unbound

    source = Source()
    assert [(source, META)] * 3 == asyncio.run(main(source))
    assert inspect.isasyncgenfunction(Source.items)


def test_decorated_functions_keep_their_kind() -> None:
    """inspect still sees a generator, coroutine or async generator function."""

    def gen() -> Iterator[int]:
        yield 1

    async def coro() -> int:
        return 1

    async def agen() -> AsyncIterator[int]:
        yield 1

    meta = on_device("meta")
    assert inspect.isgeneratorfunction(meta(gen))
    assert inspect.iscoroutinefunction(meta(coro))
    assert inspect.isasyncgenfunction(meta(agen))


def test_decorating_a_class_is_refused() -> None:
    """Decorating a class raises a TypeError that says what to do instead."""

    class Model(torch.nn.Module):
        pass

    with pytest.raises(TypeError) as info:
        on_device("meta")(Model)
    expected = (
        "on_device cannot decorate the class Model: decorate its methods instead "
        "(`@on_device(...)` on `def forward`), or use `with on_device(...):` inside them"
    )
    assert expected == str(info.value)


# ---- the scope of a @device_agnostic call (kept per thread, not in the context) ----


def _to_meta(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` decorated with ``@device_agnostic(device="meta")``: its body runs in a scope."""
    return device_agnostic(device="meta")(fn)


def test_a_block_inside_a_decorated_call_wins_and_the_call_scope_comes_back() -> None:
    """Blocks entered in a decorated body are inner to the call's scope; after them, and
    after the call, each outer device is back."""

    def body() -> list[torch.device]:
        seen = [allocated()]
        with on_device("cpu"):
            seen.append(allocated())
            seen.append(_to_meta(allocated)())  # a decorated call inside the inner block
        seen.append(allocated())
        return seen

    with on_device("cpu"):
        assert [META, CPU, META, META] == _to_meta(body)()
        assert CPU == allocated() == current_device()
    assert active_device() is None


def test_a_block_entered_and_left_in_a_decorated_body_leaves_the_call_innermost() -> None:
    """Inside a block, a decorated body that entered and left a block of its own is back in
    the call's scope (the task's blocks are the same again, in a new tuple)."""

    def body() -> list[torch.device]:
        seen = [allocated()]
        with on_device("meta"):
            seen.append(allocated())
        seen.append(allocated())
        return seen

    with on_device("meta"):
        assert [CPU, META, CPU] == device_agnostic(device="cpu")(body)()


def test_a_decorated_call_inside_a_block_sees_its_own_target() -> None:
    """Inside a meta block, a call decorated for the CPU allocates on the CPU, and nested
    decorated calls and active_device() see the call's target."""

    @device_agnostic(device="cpu")
    def body() -> tuple[torch.device, torch.device | None]:
        return allocated(), active_device()

    with on_device("meta"):
        assert (CPU, CPU) == body()
        assert META == allocated()


def test_a_task_created_in_a_decorated_body_runs_without_its_scope() -> None:
    """A task created in a decorated body, run once the call has returned, allocates on the
    default: the call's scope was closed (as a block's is for a task that outlives it)."""

    async def main() -> torch.device:
        async def child() -> torch.device:
            return allocated()

        task = _to_meta(lambda: asyncio.get_running_loop().create_task(child()))()
        return await task

    assert CPU == asyncio.run(main())


def test_tasks_run_by_a_decorated_body_see_its_scope() -> None:
    """An event loop run inside a decorated body runs its tasks inside the call's scope;
    each task's own blocks stay its own."""

    async def inside() -> list[torch.device]:
        async def own_block() -> torch.device:
            with on_device("cpu"):
                await asyncio.sleep(0)
                return allocated()

        async def plain() -> torch.device:
            await asyncio.sleep(0)
            return allocated()

        return list(await asyncio.gather(own_block(), plain()))

    assert [CPU, META] == _to_meta(lambda: asyncio.run(inside()))()


def test_a_decorated_call_scope_stays_in_its_thread() -> None:
    """Another thread, running while a decorated call is in its body, allocates on its own
    default."""
    seen: list[torch.device] = []

    def other() -> None:
        seen.append(allocated())

    def body() -> torch.device:
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        return allocated()

    assert META == _to_meta(body)()
    assert [CPU] == seen


def test_an_audited_block_audits_against_a_decorated_call_inside_it() -> None:
    """Inside an audited block, a decorated call's target is the device tensors are
    audited against: a tensor made there on the block's device is reported."""

    @device_agnostic(device="cpu")
    def body() -> torch.Tensor:
        return torch.empty(1, device="meta")

    with (
        pytest.warns(StrayTensorWarning, match="made a tensor on meta"),
        on_device("meta", audit=True),
    ):
        body()


# ---- torch.compile ----


def test_compiles_with_fullgraph() -> None:
    """A function entering on_device compiles with fullgraph=True and allocates as eager does."""

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with on_device("meta"):
            inside = torch.zeros(2)
        return x + 1, inside, torch.zeros(1)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    plus_one, inside, outside = compiled(torch.ones(2))
    assert (CPU, META, CPU) == (plus_one.device, inside.device, outside.device)
    assert 0 == torch._dynamo.explain(fn)(torch.ones(2)).graph_break_count
    assert CPU == allocated()


def test_torch_device_does_not_compile_with_fullgraph() -> None:
    """The contrast: torch's own ``with torch.device`` is an unsupported context in dynamo."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        with torch.device("meta"):
            return x + torch.zeros(2)

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(fn, fullgraph=True, backend="eager")(torch.ones(2))
    while torch._C._len_torch_function_stack():  # dynamo leaves the mode behind on failure
        torch._C._pop_torch_function_stack()
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator")
def test_accelerator_index_is_made_current_and_restored() -> None:
    """On an accelerator the block's index becomes current, and the old one comes back."""
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None
    last = torch.accelerator.device_count() - 1
    before = torch.accelerator.current_device_index()
    with on_device(torch.device(accelerator.type, last)):
        assert last == torch.accelerator.current_device_index()
    assert before == torch.accelerator.current_device_index()


def test_a_block_on_the_device_torch_gives_leaves_constructors_to_torch() -> None:
    """A block on the CPU with nothing around it (torch gives the CPU already) fills in no
    device: a constructor there gets torch's own default, and a block entered inside
    still gets its own."""
    from devicectx.scope import _stack

    with on_device("meta"):
        pass  # the replacements are in place from here on
    with on_device("cpu"):
        assert _stack.scope_device() is None
        assert torch.device("cpu") == torch.zeros(1).device
        with on_device("meta"):
            assert torch.device("meta") == torch.zeros(1).device
            with on_device("meta"):
                assert torch.device("meta") == torch.zeros(1).device
        torch.set_default_device("meta")
        try:
            assert torch.device("meta") == torch.zeros(1).device
        finally:
            torch.set_default_device(None)


def test_on_device_documents_each_of_its_parameters_in_order() -> None:
    """The Args section of on_device's docstring has one entry per parameter of the block,
    in the signature's order: a keyword added to the block is documented where users read
    about it."""
    doc = inspect.getdoc(on_device) or ""
    section = doc.split("\nArgs:\n", 1)[1].split("\n\n", 1)[0]
    documented = [
        line.split(":", 1)[0].strip()
        for line in section.splitlines()
        if line.startswith("    ") and not line.startswith("     ")
    ]
    assert list(inspect.signature(on_device).parameters) == documented


def test_an_on_device_object_pickles_as_what_it_is_made_of() -> None:
    """An on_device object, entered or not, pickles as its device and options; the copy
    is a fresh block that works on its own."""
    block = on_device("meta", exact=True, audit="raise")
    with block:
        copy = pickle.loads(pickle.dumps(block))
    assert repr(copy) == repr(block)
    with copy:
        assert torch.zeros(1).device == torch.device("meta")
    assert torch.zeros(1).device == torch.device("cpu")


_SPEC_TEXTS = st.sampled_from(
    ["cpu", "meta", "cuda", "cuda:7", "mps", "xpu:1", "npu", "cdua", "meat", "gpu", "CPU",
     "cuda:x", "cuda:-1", "1", "", " auto ", "auto"]
)  # fmt: skip


@given(st.one_of(_SPEC_TEXTS, st.integers(-2, 9), st.floats(), st.booleans(), st.none()))
def test_a_malformed_device_is_refused_where_the_block_is_made(spec: Any) -> None:
    """on_device refuses at construction exactly the specs resolve_device calls malformed,
    in its words; a well-formed device this machine lacks is refused when entered, since
    the block may be made on a machine other than the one that runs it."""
    try:
        resolve_device(spec)
    except InvalidDeviceError as error:
        refused: BaseException = error
    except DeviceUnavailableError:
        block = on_device(spec)
        with pytest.raises(DeviceUnavailableError), block:
            pass
        return
    else:
        with on_device(spec):
            pass
        return
    with pytest.raises(InvalidDeviceError) as raised:
        on_device(spec)
    assert str(refused) == str(raised.value)
    assert str(raised.value).splitlines()[-1].startswith("fix: pass a device this machine has")


def test_a_misspelt_device_of_a_decorated_function_fails_at_its_def() -> None:
    """``@on_device("cdua")`` fails where the function is defined, with the device meant."""
    with pytest.raises(InvalidDeviceError, match="did you mean 'cuda'"):

        @on_device("cdua")
        def step() -> None:
            pass


# ---- the accelerator's current index, in threads that run a copy of the context ----


def _two_indices() -> tuple[torch.device, torch.device]:
    """Devices 0 and 1 of the accelerator; the test skips where it has one."""
    if torch.accelerator.device_count() < 2:
        pytest.skip("needs an accelerator with two devices (the emulated one has two)")
    return accelerator(0), accelerator(1)


def _index() -> int:
    return torch.accelerator.current_device_index()


def _in_a_copy(how: str, fn: Callable[[], T]) -> T:
    """``fn()`` run in another thread, in a copy of this thread's context."""
    if how == "asyncio.to_thread":

        async def main() -> T:
            return await asyncio.to_thread(fn)

        return asyncio.run(main())
    context = contextvars.copy_context()
    if how == "a pool":
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(context.run, fn).result()
    results: list[T] = []
    thread = threading.Thread(target=context.run, args=(lambda: results.append(fn()),))
    thread.start()
    thread.join()
    return results[0]


_COPIES = ["asyncio.to_thread", "a pool", "a thread"]


@pytest.mark.requires_device("accelerator")
@pytest.mark.parametrize("how", _COPIES)
@pytest.mark.parametrize("block", ["changes the index", "nested in one", "on the index already"])
def test_a_thread_running_a_copy_of_the_context_follows_the_blocks_index(
    how: str, block: str
) -> None:
    """Code run in a copy of a block's context (asyncio.to_thread, copy_context().run in a
    thread or a pool) gets the block's index current with its device, from its first
    tensor on: also inside a block nested on the same device, and where the block's thread
    had that index current already (under torchrun); the block's thread is unchanged."""
    _, second = _two_indices()

    def work() -> tuple[torch.device, int]:
        return allocated(), _index()

    try:
        if block == "on the index already":
            torch.accelerator.set_device_index(1)
        with on_device(second):
            if block == "nested in one":
                with on_device(second):
                    seen = _in_a_copy(how, work)
            else:
                seen = _in_a_copy(how, work)
            assert 1 == _index()
    finally:
        torch.accelerator.set_device_index(0)
    assert (second, 1) == seen


@pytest.mark.requires_device("accelerator")
@pytest.mark.parametrize("first", ["get_default_device", "a decorated call"])
def test_the_index_follows_at_the_first_read_of_the_scope(first: str) -> None:
    """torch.get_default_device(), or a decorated call on the block's device, in the copy
    makes the index current as a constructor does."""
    _, second = _two_indices()

    @device_agnostic(device=second)
    def body() -> int:
        return _index()

    def work() -> int:
        if first == "get_default_device":
            assert second == torch.get_default_device()
            return _index()
        return body()

    with on_device(second):
        assert 1 == _in_a_copy("asyncio.to_thread", work)


@pytest.mark.requires_device("accelerator")
def test_a_pool_thread_has_its_own_index_back_for_its_next_job() -> None:
    """The pool's thread that ran a job in a copy of a block's context has its own index
    back for the next job, in the block or after it; run_in_executor copies no context,
    and its job sees no block (as a thread started in a block)."""
    _, second = _two_indices()

    def work() -> tuple[torch.device, int]:
        return allocated(), _index()

    async def main() -> list[tuple[torch.device, int]]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))  # one thread: every job reuses it
        seen = []
        with on_device(second):
            seen.append(await asyncio.to_thread(work))
            seen.append(await loop.run_in_executor(None, work))
            seen.append(await asyncio.to_thread(work))
        seen.append(await asyncio.to_thread(work))
        return seen

    assert [(second, 1), (CPU, 0), (second, 1), (CPU, 0)] == asyncio.run(main())
    with ThreadPoolExecutor(1) as pool, on_device(second):
        assert (second, 1) == pool.submit(contextvars.copy_context().run, work).result()
        assert 0 == pool.submit(_index).result()


@pytest.mark.requires_device("accelerator")
def test_a_generator_closed_after_the_block_around_it_leaves_the_index_as_it_was() -> None:
    """A generator that yields inside a block, left open past the end of the block around
    it: once both have closed, the index is the one before either (it was the outer
    block's: the inner block gave back what it found at its entry)."""
    first, second = _two_indices()

    def leaky() -> Iterator[None]:
        with on_device(first):
            yield

    with on_device(second):
        generator = leaky()
        next(generator)
    generator.close()
    assert 0 == _index()


@pytest.mark.requires_device("accelerator")
@given(data=st.data(), indices=st.lists(st.sampled_from([0, 1]), min_size=2, max_size=5))
def test_blocks_of_tasks_closing_in_any_order_give_back_the_threads_index(
    data: st.DataObject, indices: list[int]
) -> None:
    """Tasks of one thread enter blocks on either index one after another and leave them
    in any order: once all have closed, the thread has the index it had before them."""
    _two_indices()
    start = data.draw(st.sampled_from([0, 1]), label="start")
    order = data.draw(st.permutations(range(len(indices))), label="exit order")

    async def main() -> None:
        entered = [asyncio.Event() for _ in indices]
        turn = [asyncio.Event() for _ in indices]

        async def task(position: int) -> None:
            if position:
                await entered[position - 1].wait()
            with on_device(accelerator(indices[position])):
                entered[position].set()
                await turn[position].wait()
            after = order.index(position) + 1
            if after < len(order):
                turn[order[after]].set()

        tasks = [asyncio.create_task(task(position)) for position in range(len(indices))]
        await entered[-1].wait()
        turn[order[0]].set()
        await asyncio.gather(*tasks)

    torch.accelerator.set_device_index(start)
    try:
        asyncio.run(main())
        assert start == _index()
    finally:
        torch.accelerator.set_device_index(0)


@pytest.mark.requires_device("accelerator")
def test_a_copy_inside_a_block_without_an_index_keeps_its_threads_index() -> None:
    """Inside a block on an accelerator device, a decorated call on meta and a block on
    meta in its body: code run in a copy of the context allocates on meta, and keeps its
    thread's index (meta has none to follow)."""
    _, second = _two_indices()

    @device_agnostic(device="meta")
    def body() -> tuple[torch.device, int]:
        with on_device("meta"):
            return _in_a_copy("asyncio.to_thread", lambda: (allocated(), _index()))

    with on_device(second):
        assert (META, 0) == body()
