"""shrink_batch_on_oom: which errors it retries, the sizes it tries, what it remembers."""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import threading
import weakref
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import devicectx.devices._oom
from devicectx import (
    BatchTooLargeError,
    DeviceError,
    MoveError,
    device_agnostic,
    prefetch,
    shrink_batch_on_oom,
    to_device,
)
from devicectx.devices._oom import is_out_of_memory
from devicectx.testing import emulated

# The messages each backend's allocator raises, copied from torch's sources (c10/cuda,
# c10/xpu, aten/src/ATen/mps) and from real runs; the type is what torch 2.13 raises.
CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.15 GiB "
    "of which 3.12 MiB is free. Including non-PyTorch memory, this process has 79.14 GiB memory "
    "in use. Of the allocated memory 78.50 GiB is allocated by PyTorch, and 112.33 MiB is "
    "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
    "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)
HIP_OOM = "HIP out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 63.98 GiB"
XPU_OOM = "XPU out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.11 GiB"
MPS_OOM = (
    "MPS backend out of memory (MPS allocated: 8.00 GB, other allocations: 1.00 GB, max "
    "allowed: 9.07 GB). Tried to allocate 256.00 MB on private pool. Use "
    "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations "
    "(may cause system failure)."
)
CUDA_RUNTIME_OOM = (
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some "
    "other API call, so the stacktrace below might be incorrect."
)
CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)"
)
# The Windows build's CPU allocator (c10/core/impl/alloc_cpu.cpp, _aligned_malloc failing).
CPU_OOM_WINDOWS = (
    "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you "
    "tried to allocate 1125899906842624 bytes."
)
CUBLAS_OOM = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"

# A CUDA runtime error comes as torch.AcceleratorError since torch 2.8 (a RuntimeError),
# as a plain RuntimeError before.
_ACCELERATOR_ERROR: type[RuntimeError] = getattr(torch, "AcceleratorError", RuntimeError)

OUT_OF_MEMORY_ERRORS = [
    pytest.param(lambda: torch.OutOfMemoryError(CUDA_OOM), id="cuda-OutOfMemoryError"),
    pytest.param(lambda: RuntimeError(CUDA_OOM), id="cuda-RuntimeError-before-torch-2.5"),
    pytest.param(lambda: torch.OutOfMemoryError(HIP_OOM), id="rocm-OutOfMemoryError"),
    pytest.param(lambda: torch.OutOfMemoryError(XPU_OOM), id="xpu-OutOfMemoryError"),
    pytest.param(lambda: RuntimeError(XPU_OOM), id="xpu-RuntimeError"),
    pytest.param(lambda: RuntimeError(MPS_OOM), id="mps-RuntimeError"),
    pytest.param(lambda: torch.OutOfMemoryError(MPS_OOM), id="mps-OutOfMemoryError"),
    pytest.param(lambda: _ACCELERATOR_ERROR(CUDA_RUNTIME_OOM), id="cuda-AcceleratorError"),
    pytest.param(lambda: RuntimeError(CPU_OOM), id="cpu-allocator"),
    pytest.param(lambda: RuntimeError(CPU_OOM_WINDOWS), id="cpu-allocator-windows"),
    pytest.param(lambda: RuntimeError(CUBLAS_OOM), id="cublas-alloc-failed"),
    pytest.param(lambda: torch.OutOfMemoryError(), id="OutOfMemoryError-without-message"),
]

OTHER_ERRORS = [
    pytest.param(lambda: ValueError("out of memory"), id="ValueError-saying-out-of-memory"),
    pytest.param(
        lambda: RuntimeError(
            "Expected all tensors to be on the same device, but found at least two devices"
        ),
        id="device-mismatch",
    ),
    pytest.param(
        lambda: RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED."), id="cudnn-unsupported"
    ),
    pytest.param(lambda: TypeError("batch_size"), id="TypeError"),
    pytest.param(lambda: MemoryError(), id="python-MemoryError"),
]


class Recorder:
    """A function body that records each batch size and runs out of memory above ``fits``."""

    def __init__(self, fits: int, error: Callable[[], Exception] | None = None) -> None:
        self.fits = fits
        self.error = error or (lambda: torch.OutOfMemoryError(CUDA_OOM))
        self.sizes: list[int] = []

    def __call__(self, batch_size: int) -> int:
        self.sizes.append(batch_size)
        if batch_size > self.fits:
            raise self.error()
        return batch_size


@pytest.mark.parametrize("make_error", OUT_OF_MEMORY_ERRORS)
def test_every_backend_out_of_memory_error_halves_the_batch(
    make_error: Callable[[], Exception],
) -> None:
    """Each backend's out-of-memory error, as torch raises it, makes the next try half the size."""
    body = Recorder(fits=16, error=make_error)
    run = shrink_batch_on_oom(body)

    assert run(64) == 16
    assert [64, 32, 16] == body.sizes


def test_the_cpu_allocators_own_error_is_recognised() -> None:
    """The error torch's CPU allocator really raises for an impossible allocation is retried."""
    sizes: list[int] = []

    @shrink_batch_on_oom
    def allocate(batch_size: int) -> int:
        sizes.append(batch_size)
        # 1 PiB cannot be allocated anywhere, so torch raises its own error for real.
        return torch.empty(2**50 if batch_size > 2 else batch_size, dtype=torch.uint8).numel()

    assert allocate(8) == 2
    assert [8, 4, 2] == sizes


@pytest.mark.parametrize("make_error", OTHER_ERRORS)
def test_any_other_exception_passes_through_untouched_on_the_first_raise(
    make_error: Callable[[], Exception],
) -> None:
    """An error that is not out of memory is re-raised as the same object, with no retry."""
    error = make_error()
    sizes: list[int] = []

    @shrink_batch_on_oom
    def run(batch_size: int) -> None:
        sizes.append(batch_size)
        raise error

    with pytest.raises(type(error)) as caught:
        run(64)
    assert caught.value is error
    assert [64] == sizes
    assert caught.value.__cause__ is None


def test_keyboard_interrupt_passes_through() -> None:
    """A BaseException such as KeyboardInterrupt is never caught."""

    @shrink_batch_on_oom
    def run(batch_size: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(8)


@pytest.mark.parametrize(
    ("make_error", "expected"),
    [
        *((p.values[0], True) for p in OUT_OF_MEMORY_ERRORS),
        *((p.values[0], False) for p in OTHER_ERRORS),
    ],
)
def test_is_out_of_memory_tells_the_two_kinds_apart(
    make_error: Callable[[], Exception], expected: bool
) -> None:
    """is_out_of_memory is True for every backend's out-of-memory error and False otherwise."""
    assert expected == is_out_of_memory(make_error())


def test_below_the_minimum_raises_batch_too_large_with_every_size_tried() -> None:
    """Out of memory at the minimum too raises BatchTooLargeError naming each size tried."""
    body = Recorder(fits=0, error=lambda: torch.OutOfMemoryError(CUDA_OOM))

    @shrink_batch_on_oom(minimum=8)
    def train(batch_size: int) -> int:
        return body(batch_size)

    with pytest.raises(BatchTooLargeError) as caught:
        train(64)
    expected = [
        f"{train.__qualname__}() ran out of memory at every batch_size tried: 64, 32, 16, 8 "
        "(minimum=8)",
        f"last error: {CUDA_OOM}",
        "fix: @shrink_batch_on_oom(minimum=4) to try smaller batches, or make one sample need "
        "less memory (shorter sequences, torch.autocast), or free memory held outside the call",
    ]
    assert expected == str(caught.value).splitlines()
    assert [64, 32, 16, 8] == caught.value.tried
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    assert isinstance(caught.value, torch.OutOfMemoryError)
    assert isinstance(caught.value, DeviceError)


def test_batch_too_large_with_minimum_one_and_another_parameter_name() -> None:
    """At minimum 1 the fix names no smaller minimum; the message uses the parameter's name."""

    @shrink_batch_on_oom(param="chunk")
    def encode(texts: list[str], chunk: int) -> None:
        raise RuntimeError(f"{MPS_OOM}\nsecond line")

    with pytest.raises(BatchTooLargeError) as caught:
        encode([], chunk=3)
    expected = [
        f"{encode.__qualname__}() ran out of memory at every chunk tried: 3, 1 (minimum=1)",
        f"last error: {MPS_OOM}",
        "fix: make one sample need less memory (shorter sequences, torch.autocast), "
        "or free memory held outside the call",
    ]
    assert expected == str(caught.value).splitlines()
    assert [3, 1] == caught.value.tried


def test_a_halving_below_the_minimum_tries_the_minimum_itself() -> None:
    """From 12 with minimum 8, the next size is 8, not 6 and not an error."""
    body = Recorder(fits=8)

    assert shrink_batch_on_oom(minimum=8)(body)(12) == 8
    assert [12, 8] == body.sizes


def test_a_size_already_below_the_minimum_is_tried_once() -> None:
    """A call that asks for less than the minimum runs with it, and is not shrunk further."""
    body = Recorder(fits=0)

    with pytest.raises(BatchTooLargeError) as caught:
        shrink_batch_on_oom(minimum=8)(body)(4)
    assert [4] == caught.value.tried


def test_a_refusal_at_a_size_asked_below_the_minimum_gives_a_minimum_that_helps() -> None:
    """Asked for 4 with minimum=8, the error says nothing smaller was tried, and its fix
    names a minimum below 4 (not 8 // 2 = 4, which fails the same way): applied, it runs."""
    body = Recorder(fits=2)

    with pytest.raises(BatchTooLargeError) as caught:
        shrink_batch_on_oom(minimum=8)(body)(batch_size=4)
    expected = [
        f"{body!r}() ran out of memory at every batch_size tried: 4 "
        "(minimum=8); the call asked for 4, not above the minimum, so no smaller size was tried",
        f"last error: {CUDA_OOM}",
        "fix: @shrink_batch_on_oom(minimum=2) to try smaller batches, or make one sample need "
        "less memory (shorter sequences, torch.autocast), or free memory held outside the call",
    ]
    assert expected == str(caught.value).splitlines()
    assert 2 == shrink_batch_on_oom(minimum=2)(body)(batch_size=4)


@given(start=st.integers(1, 4096), minimum=st.integers(1, 64), fits=st.integers(0, 4096))
def test_sizes_tried_halve_from_the_start_down_to_the_minimum(
    start: int, minimum: int, fits: int
) -> None:
    """For any start, minimum and capacity, each size is the last halved (floored at minimum)."""
    body = Recorder(fits=fits)
    run = shrink_batch_on_oom(minimum=minimum, remember=False)(body)

    # A full gc.collect() with torch loaded is slow, and 12 of them run per example here;
    # the sizes do not depend on it, and the test of freed memory below runs the real one.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(devicectx.devices._oom, "free_memory", lambda: None)
        try:
            result: int | None = run(start)
        except BatchTooLargeError as error:
            tried: list[int] | None = error.tried
            result = None
        else:
            tried = None
    sizes = body.sizes
    assert tried is None or sizes == tried
    assert start == sizes[0]
    assert [max(size // 2, minimum) for size in sizes[:-1]] == sizes[1:]
    assert all(size > fits for size in sizes[:-1])
    if result is None:
        assert sizes[-1] > fits
        assert min(start, minimum) == sizes[-1]
    else:
        assert sizes[-1] == result
        assert result <= fits


def test_later_calls_start_at_the_size_that_worked() -> None:
    """After a shrink, a call asking for more starts at the size that worked, without errors."""
    body = Recorder(fits=16)
    run = shrink_batch_on_oom(body)

    assert run(64) == 16
    assert run(128) == 16
    assert [64, 32, 16, 16] == body.sizes


def test_a_function_pickled_by_value_keeps_the_size_that_worked_and_shrinks_on_its_own() -> None:
    """cloudpickle (Ray, loky) pickles a function of ``__main__`` or a local one by value,
    with its state: the copy starts at the size that worked, and its later shrinks are its
    own."""
    cloudpickle = pytest.importorskip("cloudpickle")
    body = Recorder(fits=16)
    run = shrink_batch_on_oom(body)
    assert run(64) == 16

    copied = cloudpickle.loads(cloudpickle.dumps(run))
    assert copied(128) == 16
    copied_body = copied.__wrapped__
    copied_body.fits = 4
    assert copied(16) == 4
    assert [64, 32, 16, 16, 16, 8, 4] == copied_body.sizes  # the first three before the copy
    assert run(128) == 16  # the original's memory is untouched


def test_a_later_call_asking_for_less_gets_what_it_asked_for() -> None:
    """The remembered size is a ceiling: a smaller request is not raised to it."""
    body = Recorder(fits=16)
    run = shrink_batch_on_oom(body)
    run(64)

    assert run(4) == 4
    assert [64, 32, 16, 4] == body.sizes


def test_a_later_shrink_lowers_the_ceiling_further() -> None:
    """When memory gets tighter, the next shrink lowers the remembered size for later calls."""
    body = Recorder(fits=16)
    run = shrink_batch_on_oom(body)
    run(64)
    body.fits = 4

    assert run(64) == 4
    assert run(64) == 4
    assert [64, 32, 16, 16, 8, 4, 4] == body.sizes


def test_a_refusal_that_started_at_the_ceiling_says_so() -> None:
    """A call asking for more than an earlier call shrank to starts at that ceiling; run out
    of memory at every size from there, its error says it asked for more and where the
    start came from."""
    body = Recorder(fits=32, error=lambda: torch.OutOfMemoryError(CUDA_OOM))

    @shrink_batch_on_oom(minimum=8)
    def train(batch_size: int) -> int:
        return body(batch_size)

    assert 32 == train(128)
    body.fits = 0
    with pytest.raises(BatchTooLargeError) as caught:
        train(64)
    assert (
        f"{train.__qualname__}() ran out of memory at every batch_size tried: 32, 16, 8 "
        "(minimum=8); asked for 64, it started at 32, the batch_size an earlier call shrank "
        "to (remember=True)"
    ) == str(caught.value).splitlines()[0]
    assert [32, 16, 8] == caught.value.tried
    with pytest.raises(BatchTooLargeError) as asked_less:
        train(16)
    assert str(asked_less.value).splitlines()[0].endswith("tried: 16, 8 (minimum=8)")


def test_a_call_that_fits_the_first_time_remembers_nothing() -> None:
    """Without a shrink there is no ceiling: a later, larger request is tried as asked."""
    body = Recorder(fits=1024)
    run = shrink_batch_on_oom(body)

    assert run(16) == 16
    assert run(512) == 512
    assert [16, 512] == body.sizes


def test_remember_false_starts_every_call_at_the_size_given() -> None:
    """With remember=False each call starts from its own batch size."""
    body = Recorder(fits=16)
    run = shrink_batch_on_oom(remember=False)(body)

    run(64)
    run(64)
    assert [64, 32, 16, 64, 32, 16] == body.sizes


def test_each_decorated_function_has_its_own_memory() -> None:
    """Two functions decorated separately do not share a remembered size."""
    first, second = Recorder(fits=8), Recorder(fits=1024)
    run_first, run_second = shrink_batch_on_oom(first), shrink_batch_on_oom(second)
    run_first(64)

    assert run_second(64) == 64


def test_the_batch_size_is_found_positionally_by_keyword_or_by_default() -> None:
    """Positional, keyword and default batch sizes are all shrunk in place of the original."""
    seen: list[tuple[object, int]] = []

    @shrink_batch_on_oom(remember=False)
    def run(data: object, batch_size: int = 32, *, scale: float = 1.0) -> int:
        seen.append((data, batch_size))
        if batch_size > 8:
            raise torch.OutOfMemoryError(CUDA_OOM)
        return batch_size

    assert run("a", 16) == 8
    assert run("b", batch_size=16) == 8
    assert run("c") == 8
    assert run(data="d", batch_size=16, scale=2.0) == 8
    expected = [("a", 16), ("a", 8), ("b", 16), ("b", 8), ("c", 32), ("c", 16), ("c", 8)]
    assert [*expected, ("d", 16), ("d", 8)] == seen


def test_keyword_only_and_positional_only_batch_sizes() -> None:
    """A keyword-only batch size and a positional-only one left to its default both shrink."""

    @shrink_batch_on_oom
    def keyword_only(data: object, *, batch_size: int) -> int:
        return Recorder(fits=4)(batch_size)

    @shrink_batch_on_oom
    def positional_only(data: object = None, batch_size: int = 16, /) -> int:
        return Recorder(fits=4)(batch_size)

    assert keyword_only(None, batch_size=16) == 4
    assert positional_only() == 4
    assert positional_only(None, 8) == 4


def test_a_missing_batch_size_gets_pythons_own_error() -> None:
    """A call that passes no batch size (and has no default) fails as it would undecorated."""

    @shrink_batch_on_oom
    def run(data: object, batch_size: int) -> int:
        return batch_size

    with pytest.raises(TypeError, match="missing 1 required positional argument: 'batch_size'"):
        run(None)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("value", "error", "expected"),
    [
        (0, ValueError, "{name}() got batch_size=0: a batch size must be an int >= 1"),
        (-4, ValueError, "{name}() got batch_size=-4: a batch size must be an int >= 1"),
        (
            "8",
            TypeError,
            "{name}() got batch_size='8': a batch size must be an int >= 1, not a str",
        ),
        (
            8.0,
            TypeError,
            "{name}() got batch_size=8.0: a batch size must be an int >= 1, not a float",
        ),
        (
            True,
            TypeError,
            "{name}() got batch_size=True: a batch size must be an int >= 1, not a bool",
        ),
    ],
)
def test_a_batch_size_that_is_not_a_positive_int_is_refused(
    value: object, error: type[Exception], expected: str
) -> None:
    """0, negatives, strings, floats and bools are refused before the function runs."""

    @shrink_batch_on_oom
    def run(batch_size: int) -> int:
        raise AssertionError("not reached")

    with pytest.raises(error) as caught:
        run(value)  # type: ignore[arg-type]
    assert expected.format(name=run.__qualname__) == str(caught.value)


def test_integer_like_batch_sizes_are_accepted_as_ints() -> None:
    """A 0-dim integer tensor works as a batch size, and the retries pass plain ints."""
    body = Recorder(fits=4)

    assert shrink_batch_on_oom(body)(torch.tensor(8)) == 4  # type: ignore[arg-type]
    assert [8, 4] == body.sizes


def test_methods_classmethods_and_staticmethods() -> None:
    """Every binding form finds the batch size at the position its signature gives."""

    class Model:
        fits = 4

        @shrink_batch_on_oom
        def predict(self, data: object, batch_size: int) -> int:
            return Recorder(fits=self.fits)(batch_size)

        @classmethod
        @shrink_batch_on_oom
        def build(cls, batch_size: int) -> int:
            return Recorder(fits=cls.fits)(batch_size)

        @staticmethod
        @shrink_batch_on_oom
        def helper(batch_size: int) -> int:
            return Recorder(fits=4)(batch_size)

    model = Model()
    assert model.predict(None, 16) == 4
    assert Model.predict(model, None, 16) == 4
    assert Model.build(16) == 4
    assert model.helper(16) == 4
    assert Model.helper(16) == 4


def test_async_functions_are_retried_around_the_await() -> None:
    """An async function stays async, and an error at its await is retried with a smaller size."""
    body = Recorder(fits=8)

    @shrink_batch_on_oom
    async def run(batch_size: int) -> int:
        await asyncio.sleep(0)
        return body(batch_size)

    assert inspect.iscoroutinefunction(run)
    assert asyncio.run(run(32)) == 8
    assert [32, 16, 8] == body.sizes


def test_the_signature_name_and_docstring_are_kept() -> None:
    """The decorated function reports the original's signature, name, docstring and __wrapped__."""

    def train(model: object, batch_size: int = 64) -> float:
        """Train one epoch."""
        return 0.0

    decorated = shrink_batch_on_oom(train)
    assert inspect.signature(train) == inspect.signature(decorated)
    assert ("train", "Train one epoch.") == (decorated.__name__, decorated.__doc__)
    assert decorated.__wrapped__ is train  # type: ignore[attr-defined]


def test_memory_of_the_failed_attempt_is_freed_before_the_retry() -> None:
    """A tensor held only by the failed attempt, even through a cycle, is freed before the retry."""
    refs: list[weakref.ref[torch.Tensor]] = []

    @shrink_batch_on_oom
    def run(batch_size: int) -> int:
        if refs:
            assert refs[0]() is None, "the failed attempt's tensor is still alive"
            return batch_size
        activations = torch.ones(batch_size)
        refs.append(weakref.ref(activations))
        cycle: list[object] = [activations]
        cycle.append(cycle)  # only the garbage collector can free this
        raise torch.OutOfMemoryError(CUDA_OOM)

    gc.disable()  # so that only the decorator's own collection can free the cycle
    try:
        assert run(8) == 4
    finally:
        gc.enable()


def test_each_shrink_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Every halving is logged as a warning naming the function and both sizes."""

    @shrink_batch_on_oom
    def run(batch_size: int) -> int:
        return Recorder(fits=8)(batch_size)

    with caplog.at_level(logging.WARNING, logger="devicectx"):
        run(32)
    name = run.__qualname__
    expected = [
        f"{name}(): out of memory at batch_size=32; retrying with batch_size=16 (what the "
        "failed attempt changed, such as gradients it accumulated, is not undone)",
        f"{name}(): out of memory at batch_size=16; retrying with batch_size=8",
    ]
    assert expected == [record.getMessage() for record in caplog.records]


def test_the_shrinks_are_logged_on_the_public_devicectx_oom_logger(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The log lines come from the logger "devicectx.oom" (docs/diagnostics.md), a name that
    a logging configuration can rely on, not a private module's path."""

    @shrink_batch_on_oom
    def run(batch_size: int) -> int:
        return Recorder(fits=8)(batch_size)

    with caplog.at_level(logging.WARNING, logger="devicectx.oom"):
        run(16)
        run(16)
    assert ["devicectx.oom", "devicectx.oom"] == [record.name for record in caplog.records]


def test_the_not_undone_clause_is_logged_once_per_function(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first shrink of a decorated function says that the failed attempt is not undone;
    later shrinks, in this call or the next, do not say it again."""

    @shrink_batch_on_oom(remember=False)
    def run(batch_size: int) -> int:
        return Recorder(fits=8)(batch_size)

    with caplog.at_level(logging.WARNING, logger="devicectx"):
        run(16)
        run(16)
    told = ["not undone" in record.getMessage() for record in caplog.records]
    assert [True, False] == told


def test_a_call_held_below_its_batch_size_by_the_ceiling_is_logged_once_per_ceiling(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A call that asks for more than the remembered size logs, at WARNING as the shrinks
    do, that it starts lower; once per ceiling, and again once the ceiling is lowered."""
    body = Recorder(fits=16)
    run = shrink_batch_on_oom(body)
    name = repr(body)  # a callable object is shown as itself
    run(64)

    with caplog.at_level(logging.WARNING, logger="devicectx"):
        run(128)
        run(512)
        run(8)  # asked for less: not held, nothing to say
        body.fits = 4
        run(64)  # held at 16 again (not logged), then shrinks to 4
        run(64)
    held = [r.getMessage() for r in caplog.records if "asked for" in r.getMessage()]
    assert [
        f"{name}(): asked for batch_size=128, starting at batch_size=16, the size an earlier "
        "call shrank to (remember=True); later calls held there are not logged",
        f"{name}(): asked for batch_size=64, starting at batch_size=4, the size an earlier "
        "call shrank to (remember=True); later calls held there are not logged",
    ] == held
    assert {logging.WARNING} == {record.levelno for record in caplog.records}


def test_concurrent_calls_each_find_a_size_that_fits() -> None:
    """Threads calling one decorated function all succeed, and the ceiling is the size that fits."""
    body = Recorder(fits=8)
    run = shrink_batch_on_oom(body)
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(run(64))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert [8] * 8 == results
    assert run(64) == 8
    assert body.sizes[-1] == 8


def test_an_unknown_parameter_name_is_refused_at_decoration() -> None:
    """Naming a parameter the function lacks fails at decoration, listing the parameters."""

    def train(model: object, bs: int) -> None:
        pass

    with pytest.raises(TypeError) as caught:
        shrink_batch_on_oom(train)
    expected = [
        f"{train.__qualname__}() has no parameter 'batch_size', which shrink_batch_on_oom "
        "would shrink; its parameters: model, bs",
        "fix: @shrink_batch_on_oom(param='<the batch size parameter>')",
    ]
    assert expected == str(caught.value).splitlines()


def test_var_args_cannot_be_the_batch_size() -> None:
    """*args or **kwargs named as the batch size parameter is refused at decoration."""

    def run(*batch_size: int) -> None:
        pass

    with pytest.raises(TypeError, match=r"takes \*args/\*\*kwargs as 'batch_size'"):
        shrink_batch_on_oom(run)


@pytest.mark.parametrize(
    ("minimum", "error", "expected"),
    [
        (
            0,
            ValueError,
            "shrink_batch_on_oom(minimum=0): minimum must be >= 1\n"
            "fix: @shrink_batch_on_oom(minimum=1)",
        ),
        (2.5, TypeError, "shrink_batch_on_oom(minimum=2.5): minimum must be an int >= 1"),
    ],
)
def test_a_bad_minimum_is_refused(minimum: object, error: type[Exception], expected: str) -> None:
    """A minimum below 1 or not an int is refused when the decorator is made."""
    with pytest.raises(error) as caught:
        shrink_batch_on_oom(minimum=minimum)  # type: ignore[call-overload]
    assert expected == str(caught.value)


def test_generators_classes_and_method_objects_are_refused() -> None:
    """Generators, classes and staticmethod/classmethod objects fail with what to do instead."""

    def batches(batch_size: int):  # type: ignore[no-untyped-def]
        yield batch_size

    with pytest.raises(TypeError, match="cannot retry the generator function"):
        shrink_batch_on_oom(batches)
    with pytest.raises(TypeError, match="cannot decorate a class"):
        shrink_batch_on_oom(Recorder)
    with pytest.raises(TypeError) as caught:
        shrink_batch_on_oom(staticmethod(batches))
    assert "fix: put @shrink_batch_on_oom below @staticmethod, next to the def" in str(caught.value)


def test_the_generator_function_refusal_points_away_from_generators() -> None:
    """The generator function refusal's fix says to pass a list or a DataLoader, not a
    generator: passing the generator instead is refused too (below)."""

    def batches(batch_size: int):  # type: ignore[no-untyped-def]
        yield batch_size

    with pytest.raises(TypeError) as caught:
        shrink_batch_on_oom(batches)
    assert str(caught.value).splitlines()[-1] == (
        "fix: decorate the function that takes the batch size and reads the items, and pass "
        "it a list or a DataLoader (read again from the start at each attempt), not a generator"
    )


def _one_shots() -> list[object]:
    samples = list(range(32))
    return [
        (x for x in samples),
        iter(samples),
        map(int, samples),
        iter(torch.utils.data.DataLoader(samples, batch_size=4)),
        prefetch((x for x in samples), "cpu"),
    ]


@pytest.mark.parametrize(
    ("index", "kind"),
    [
        (0, "a generator"),
        (1, "a list_iterator"),
        (2, "a map"),
        (3, "a _SingleProcessDataLoaderIter"),
        (4, "a Prefetcher over a generator"),
    ],
)
def test_a_one_shot_iterator_argument_is_refused_before_the_first_attempt(
    index: int, kind: str
) -> None:
    """A generator, iter(...), an iterator over a DataLoader or a prefetch over one, as an
    argument, would be read in part by an attempt that runs out of memory, and the retry
    would see only the rest: refused before the function runs, naming the argument."""
    calls: list[int] = []

    @shrink_batch_on_oom
    def total(stream: object, batch_size: int = 16) -> int:
        calls.append(batch_size)
        return batch_size

    with pytest.raises(TypeError) as caught:
        total(_one_shots()[index])
    name = total.__qualname__
    assert [
        f"shrink_batch_on_oom cannot retry {name}() with stream={kind}, an iterator read "
        "once: an attempt that runs out of memory reads part of it, and the retry would see "
        "only the rest",
        f"fix: pass list(stream) or a DataLoader, which each attempt reads from the start, "
        f"not an iterator; or make the iterator inside {name}()",
    ] == str(caught.value).splitlines()
    assert [] == calls


def test_a_one_shot_iterator_is_named_by_keyword_and_in_star_args() -> None:
    """The argument is named as the call passes it: a keyword, or *args' position."""

    @shrink_batch_on_oom
    def run(*parts: object, batch_size: int = 4, **extra: object) -> int:
        return batch_size

    with pytest.raises(TypeError, match=r"with parts\[1\]=a list_iterator, "):
        run([1], iter([2]))
    with pytest.raises(TypeError, match=r"with labels=a generator, "):
        run([1], labels=(x for x in "ab"))


def test_the_fix_of_the_one_shot_refusal_works_when_applied() -> None:
    """The data loss the refusal prevents, and its fix: list(stream), passed in place of the
    generator, gives every item to the attempt that fits."""

    @shrink_batch_on_oom(remember=False)
    def total(stream: object, batch_size: int = 16) -> tuple[int, int]:
        seen: list[int] = []
        batch: list[int] = []
        for x in stream:  # type: ignore[attr-defined]
            batch.append(x)
            if len(batch) == batch_size:
                if batch_size > 4:  # stands in for the device running out of memory
                    raise torch.OutOfMemoryError(CUDA_OOM)
                seen += batch
                batch = []
        return len(seen + batch), sum(seen + batch)

    stream = (x for x in range(32))
    with pytest.raises(TypeError):
        total(stream)
    assert (32, sum(range(32))) == total(list(stream))


def test_re_iterables_are_not_refused() -> None:
    """A list, a tensor, a DataLoader, a dict and a prefetch over a list are read anew by
    each attempt: not refused."""

    @shrink_batch_on_oom
    def run(stream: object, batch_size: int = 4) -> int:
        return batch_size

    samples = list(range(8))
    loader = torch.utils.data.DataLoader(samples, batch_size=4)
    for argument in [samples, torch.ones(3), loader, {"a": 1}, prefetch(samples, "cpu"), "text"]:
        assert 4 == run(argument)


def test_an_async_iterator_argument_is_refused() -> None:
    """An async generator passed to an async function is read once too: refused, with a fix
    that builds a list with an async comprehension."""

    async def items():  # type: ignore[no-untyped-def]
        yield 1

    @shrink_batch_on_oom
    async def run(stream: object, batch_size: int = 4) -> int:
        return batch_size

    with pytest.raises(TypeError) as caught:
        asyncio.run(run(items()))
    assert str(caught.value).splitlines()[-1] == (
        "fix: pass [item async for item in stream], which each attempt reads from the start, "
        f"not an iterator; or make the iterator inside {run.__qualname__}()"
    )


def test_a_nested_batch_too_large_error_shrinks_the_outer_batch() -> None:
    """An inner back-off that gives up is out of memory for an outer one, which then shrinks."""
    inner_sizes: list[int] = []

    @shrink_batch_on_oom(param="micro", minimum=4)
    def step(micro: int, outer: int) -> int:
        inner_sizes.append(micro)
        if outer > 8:
            raise torch.OutOfMemoryError(CUDA_OOM)
        return outer

    @shrink_batch_on_oom(remember=False)
    def epoch(batch_size: int) -> int:
        return step(4, batch_size)

    assert epoch(32) == 8
    assert [4, 4, 4] == inner_sizes


@pytest.mark.requires_device("cuda")
def test_a_real_cuda_out_of_memory_error_is_retried() -> None:
    """The allocator's own out-of-memory error on a GPU shrinks the batch until it fits."""
    sizes: list[int] = []

    @shrink_batch_on_oom
    def allocate(batch_size: int) -> int:
        sizes.append(batch_size)
        # 1 PiB per sample above 1: more than any GPU has, so the allocator really fails.
        count = 2**50 if batch_size > 1 else 1
        return torch.empty(count, dtype=torch.uint8, device="cuda").numel()

    assert allocate(4) == 1
    assert [4, 2, 1] == sizes


@pytest.mark.skipif(
    not emulated.enabled() or torch.cuda.is_available(),
    reason="needs the emulated accelerator's memory limit (pytest "
    "--devicectx-accelerator=emulated), refused where a CUDA GPU is present",
)
def test_a_move_out_of_memory_shrinks_the_batch() -> None:
    """A to_device past the device's memory raises devicectx's MoveError, a
    torch.OutOfMemoryError too: the back-off knows it by its type, and halves the batch."""
    sizes: list[int] = []
    kinds: list[tuple[bool, bool]] = []  # not the errors: their frames would hold the batch
    mib = 2**20

    @shrink_batch_on_oom
    def step(batch_size: int) -> int:
        sizes.append(batch_size)
        try:
            batch = to_device({"x": torch.ones(batch_size, mib // 4)}, "emu:0")  # 1 MiB each
        except Exception as error:
            kinds.append((isinstance(error, MoveError), isinstance(error, torch.OutOfMemoryError)))
            raise
        return int(batch["x"].shape[0])

    gc.collect()
    room = emulated.memory_allocated("emu:0") + 4 * mib + mib // 2
    with emulated.configure(memory_limit=room):
        assert 4 == step(16)
    assert [16, 8, 4] == sizes
    assert [(True, True), (True, True)] == kinds


@pytest.mark.skipif(
    not emulated.enabled() or torch.cuda.is_available(),
    reason="needs the emulated accelerator's memory limit (pytest "
    "--devicectx-accelerator=emulated), refused where a CUDA GPU is present",
)
def test_the_same_move_out_of_memory_twice_stops_with_the_moves_fix() -> None:
    """@device_agnostic's move of a whole argument does not change with the batch size:
    after it fails on the same tensor at two sizes, the back-off stops (it halved down to
    the minimum), and the error gives the move's own fix, which, applied, lets it run."""
    mib = 2**20
    data = torch.ones(4, mib // 4)  # 4 MiB
    model = nn.Linear(mib // 4, 1, bias=False).requires_grad_(False)  # no graph holds chunks
    sizes: list[int] = []

    def evaluate(model: nn.Module, data: torch.Tensor, batch_size: int = 4) -> torch.Tensor:
        sizes.append(batch_size)
        chunks = [data[i : i + batch_size] for i in range(0, len(data), batch_size)]
        return torch.cat([model(to_device(chunk, "emu:0")) for chunk in chunks])

    gc.collect()
    model.to("emu:0")
    with emulated.configure(memory_limit=emulated.memory_allocated("emu:0") + 3 * mib):
        moving = shrink_batch_on_oom(minimum=1)(device_agnostic(output="input")(evaluate))
        with pytest.raises(BatchTooLargeError) as raised:
            moving(model, data)
        lines = str(raised.value).splitlines()
        assert [4, 2] == raised.value.tried
        assert [] == sizes  # the body never ran: the move before it failed
        assert lines[0].endswith(
            "evaluate() ran out of memory moving the same tensor at batch_size=4 and "
            "batch_size=2: the batch_size does not change that move"
        )
        assert lines[1].startswith("last error: ")
        assert lines[1].rpartition(".<locals>.")[2].startswith("evaluate() could not move data")
        assert "OutOfMemoryError: emu out of memory" in lines[1]
        assert lines[-1] == (
            "fix: free memory on emu:0 (del what you no longer need there); or move it "
            "yourself, or leave the argument out of the move: "
            "@device_agnostic(output='input', exclude=('data',))"
        )
        excluded = shrink_batch_on_oom(minimum=1)(
            device_agnostic(output="input", exclude=("data",))(evaluate)
        )
        assert (4, 1) == tuple(excluded(model, data, batch_size=1).shape)
