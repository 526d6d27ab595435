"""``on_device(..., audit=...)``: stray tensors named at the user's line, once, or raised."""

from __future__ import annotations

import asyncio
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from helpers import accelerator, mps_like, python_output
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.modules import module as torch_module
from torch.overrides import _get_current_function_mode_stack

from devicectx import DtypeUnsupportedError, StrayTensorError, StrayTensorWarning, on_device
from devicectx.scope._audit import reset_reports
from devicectx.testing import emulated

pytestmark = pytest.mark.torch_internals  # CI runs it on every minor torch release

CPU = torch.device("cpu")
META = torch.device("meta")
# torch's own, held in an object: a module-level name bound to one is replaced in audited
# blocks (and then reported), as torch.from_numpy is.
OWN = {
    "from_numpy": torch.from_numpy,
    "frombuffer": torch.frombuffer,
    "as_tensor": torch._C._VariableFunctions.as_tensor,
}


@pytest.fixture(autouse=True)
def _forget_reports() -> Iterator[None]:
    """Each test starts with no line warned about, and leaves none behind."""
    reset_reports()
    yield
    reset_reports()


def next_line() -> int:
    """The line after the caller's."""
    frame = inspect.currentframe()
    assert frame is not None
    assert frame.f_back is not None
    return frame.f_back.f_lineno + 1


def message(op: str, line: int, finding: str, block: str, fix: str) -> str:
    """The text of a report about this file's ``line``."""
    where = f"{__file__}:{line}"
    return f"{op} at {where} {finding} inside an audited on_device block on {block}\nfix: {fix}"


def strays(caught: list[warnings.WarningMessage]) -> list[str]:
    """The texts of the stray-tensor warnings caught."""
    return [str(w.message) for w in caught if issubclass(w.category, StrayTensorWarning)]


# ---- each op: (op, how it is called, the fix). Each call is on the line after its def. ----

A = np.zeros(3, dtype=np.float32)
X = torch.zeros(3)  # a CPU tensor


def _from_numpy() -> object:
    return torch.from_numpy(A)


def _frombuffer() -> object:
    return torch.frombuffer(bytearray(8), dtype=torch.float32)


def _nested_tensor() -> object:
    return torch.nested.nested_tensor([X, X[:2]], layout=torch.jagged, device="cpu")


def _as_nested_tensor() -> object:
    return torch.nested.as_nested_tensor([X, X[:2]], layout=torch.jagged, device="cpu")


def _as_tensor() -> object:
    return torch.as_tensor(A, device="cpu")


def _as_tensor_held() -> object:
    return OWN["as_tensor"](A)  # an object holds torch's own function


def _asarray() -> object:
    return torch.asarray(A, device="cpu")


def _tensor() -> object:
    return torch.tensor([1.0, 2.0], device="cpu")


def _zeros() -> object:
    return torch.zeros(3, device="cpu")


def _fftfreq() -> object:
    return torch.fft.fftfreq(4, device="cpu")


def _zeros_like() -> object:
    return torch.zeros_like(X)


def _ones_like() -> object:
    return torch.ones_like(X)


def _empty_like() -> object:
    return torch.empty_like(X)


def _full_like() -> object:
    return torch.full_like(X, 2.0)


def _rand_like() -> object:
    return torch.rand_like(X)


def _randn_like() -> object:
    return torch.randn_like(X)


def _randint_like() -> object:
    return torch.randint_like(X, 5)


def _new_zeros() -> object:
    return X.new_zeros(2)


def _new_ones() -> object:
    return X.new_ones(2)


def _new_empty() -> object:
    return X.new_empty(2)


def _new_full() -> object:
    return X.new_full((2,), 1.0)


def _new_tensor() -> object:
    return X.new_tensor([1.0])


def _new_empty_strided() -> object:
    return X.new_empty_strided((2,), (1,))


_GIVEN = ", or leave device= out (the block then picks meta)"
_UNFILLED = (
    "; without device= it got torch's own default: torch.as_tensor held in an object, a "
    "closure or a default argument is not filled in (call torch.as_tensor by its name, or use "
    "on_device(..., exact=True))"
)


def _like(name: str) -> str:
    return f'torch.{name}(x, device="meta"), or move x to meta first'


def _new(name: str) -> str:
    return f'x.{name}(..., device="meta"), or move x to meta first'


OPS: list[tuple[str, Callable[[], object], str]] = [
    ("torch.from_numpy", _from_numpy,
     'torch.as_tensor(array, device="meta")'),
    ("torch.frombuffer", _frombuffer,
     'torch.frombuffer(buffer, dtype=...) before the block, then .to("meta") inside it'),
    ("torch.nested.nested_tensor", _nested_tensor,
     'torch.nested.nested_tensor(tensors, layout=torch.jagged, device="meta")'),
    ("torch.nested.as_nested_tensor", _as_nested_tensor,
     'torch.nested.as_nested_tensor(tensors, layout=torch.jagged, device="meta")'),
    ("torch.as_tensor", _as_tensor, 'torch.as_tensor(..., device="meta")' + _GIVEN),
    ("torch.as_tensor", _as_tensor_held, 'torch.as_tensor(..., device="meta")' + _UNFILLED),
    ("torch.asarray", _asarray, 'torch.asarray(..., device="meta")' + _GIVEN),
    ("torch.tensor", _tensor, 'torch.tensor(..., device="meta")' + _GIVEN),
    ("torch.zeros", _zeros, 'torch.zeros(..., device="meta")' + _GIVEN),
    ("torch.fft.fftfreq", _fftfreq, 'torch.fft.fftfreq(..., device="meta")' + _GIVEN),
    ("torch.zeros_like", _zeros_like, _like("zeros_like")),
    ("torch.ones_like", _ones_like, _like("ones_like")),
    ("torch.empty_like", _empty_like, _like("empty_like")),
    ("torch.full_like", _full_like, _like("full_like")),
    ("torch.rand_like", _rand_like, _like("rand_like")),
    ("torch.randn_like", _randn_like, _like("randn_like")),
    ("torch.randint_like", _randint_like, _like("randint_like")),
    ("Tensor.new_zeros", _new_zeros, _new("new_zeros")),
    ("Tensor.new_ones", _new_ones, _new("new_ones")),
    ("Tensor.new_empty", _new_empty, _new("new_empty")),
    ("Tensor.new_full", _new_full, _new("new_full")),
    ("Tensor.new_tensor", _new_tensor, _new("new_tensor")),
    ("Tensor.new_empty_strided", _new_empty_strided, _new("new_empty_strided")),
]  # fmt: skip
OP_IDS = [make.__name__.strip("_") for _, make, _ in OPS]


def line_of(make: Callable[[], object]) -> int:
    """The line of the op in a one-line maker above."""
    return make.__code__.co_firstlineno + 1


@pytest.mark.parametrize(("op", "make", "fix"), OPS, ids=OP_IDS)
def test_each_op_is_reported_at_its_line(op: str, make: Callable[[], object], fix: str) -> None:
    """Each op that makes a CPU tensor in a meta block warns with its name, line and fix."""
    with warnings.catch_warnings(record=True) as caught, on_device("meta", audit=True):
        warnings.simplefilter("always")
        made = make()
    expected = message(op, line_of(make), "made a tensor on cpu", "meta", fix)
    assert [expected] == strays(caught)
    assert (__file__, line_of(make)) == (caught[0].filename, caught[0].lineno)
    assert isinstance(made, torch.Tensor)
    assert CPU == made.device


@pytest.mark.parametrize(("op", "make", "fix"), OPS, ids=OP_IDS)
def test_raise_says_the_same_every_time(op: str, make: Callable[[], object], fix: str) -> None:
    """audit="raise" raises StrayTensorError with the warning's text, at every call, and
    the stray tensor never reaches the caller."""
    expected = message(op, line_of(make), "made a tensor on cpu", "meta", fix)
    made = None
    for _ in range(2):
        with pytest.raises(StrayTensorError) as info, on_device("meta", audit="raise"):
            made = make()
        assert expected == str(info.value)
        assert info.value.__suppress_context__
    assert made is None


def test_the_fixes_for_from_numpy_frombuffer_and_nested_tensors_pass_the_audit() -> None:
    """Applied as written, the fixes for an array, a buffer and nested tensors make no
    stray tensor: the audit stays silent (a fix that still made a CPU tensor in the block
    was reported again)."""
    buffer = bytearray(8)
    held = torch.frombuffer(buffer, dtype=torch.float32)  # before the block
    with on_device("meta", audit="raise"):
        from_array = torch.as_tensor(A, device="meta")
        from_buffer = held.to("meta")
        nested = torch.nested.nested_tensor([X, X[:2]], layout=torch.jagged, device="meta")
        as_nested = torch.nested.as_nested_tensor([X, X[:2]], layout=torch.jagged, device="meta")
    assert {"meta"} == {t.device.type for t in (from_array, from_buffer, nested, as_nested)}


def test_once_per_line_and_op() -> None:
    """Two calls from one line warn once; the same op on another line warns again."""
    with warnings.catch_warnings(record=True) as caught, on_device("meta", audit=True):
        warnings.simplefilter("always")
        first = next_line() + 1
        for _ in range(3):
            torch.from_numpy(A)
        second = next_line()
        torch.from_numpy(A)
    fix = 'torch.as_tensor(array, device="meta")'
    expected = [
        message("torch.from_numpy", line, "made a tensor on cpu", "meta", fix)
        for line in (first, second)
    ]
    assert expected == strays(caught)


def test_once_per_line_across_blocks() -> None:
    """A line warned about in one block is not warned about again in the next."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with on_device("meta", audit=True):
                torch.zeros(1, device="cpu")
    assert 1 == len(strays(caught))


def test_cpu_block_reports_a_meta_tensor() -> None:
    """In a block on the CPU (torch's default here), a tensor made on meta is the stray."""
    meta = torch.zeros(2, device="meta")
    with warnings.catch_warnings(record=True) as caught, on_device("cpu", audit=True):
        warnings.simplefilter("always")
        first = next_line()
        torch.ones(2, device="meta")
        second = next_line()
        torch.zeros_like(meta)
        torch.zeros(2)  # lands on the block's device
    expected = [
        message("torch.ones", first, "made a tensor on meta", "cpu",
                'torch.ones(..., device="cpu"), or leave device= out (the block then picks cpu)'),
        message("torch.zeros_like", second, "made a tensor on meta", "cpu",
                'torch.zeros_like(x, device="cpu"), or move x to cpu first'),
    ]  # fmt: skip
    assert expected == strays(caught)


def test_generator_on_another_device() -> None:
    """A CPU generator used in a meta block is named, at the op that uses it."""
    gen = torch.Generator().manual_seed(0)
    meta = torch.zeros(2, device="meta")
    fix = "leave generator= out on meta; on an accelerator, "
    with warnings.catch_warnings(record=True) as caught, on_device("meta", audit=True):
        warnings.simplefilter("always")
        first = next_line()
        made = torch.randn(2, generator=gen)
        second = next_line()
        meta.normal_(generator=torch.Generator())
    assert torch.device("cpu") == made.device  # drawn where its generator is
    expected = [
        message("torch.randn", first, "used the generator gen (on cpu)", "meta",
                fix + "gen = torch.Generator(device=<the block's device>)"),
        message("Tensor.normal_", second, "used a torch.Generator (on cpu)", "meta",
                fix + "generator = torch.Generator(device=<the block's device>)"),
    ]  # fmt: skip
    assert expected == strays(caught)


def test_generator_raises_before_the_op_runs() -> None:
    """With audit="raise", the op that would use the stray generator never runs."""
    gen = torch.Generator()
    before = X.clone()
    block = on_device("meta", audit="raise")
    with pytest.raises(StrayTensorError, match="used the generator gen"), block:
        X.normal_(generator=gen)
    assert torch.equal(before, X)


def test_generator_on_the_block_device_is_fine() -> None:
    """A CPU generator in a CPU block is not reported."""
    with warnings.catch_warnings(record=True) as caught, on_device("cpu", audit=True):
        warnings.simplefilter("always")
        torch.randn(2, generator=torch.Generator())
    assert [] == strays(caught)


class Masked(torch.nn.Module):
    """A module that makes a CPU buffer whatever the default device."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", OWN["from_numpy"](np.ones(2, dtype=np.float32)))

    def extend(self) -> None:
        self.register_buffer("extra", OWN["from_numpy"](np.ones(1, dtype=np.float32)))


BUFFER_LINE = inspect.getsourcelines(Masked.extend)[1] + 1


def test_buffer_registered_later_is_reported_where_the_user_called() -> None:
    """A buffer registered inside the block is named with its module, at the user's line
    (not torch's register_buffer, nor the module's own __init__ when torch called it)."""
    model = Masked()  # outside: nothing
    fix = ", or make the tensor without device= (the block then picks meta)"
    with warnings.catch_warnings(record=True) as caught, on_device("meta", audit=True):
        warnings.simplefilter("always")
        model.extend()
    expected = message("register_buffer('extra') on Masked", BUFFER_LINE,
                       "got a tensor on cpu", "meta",
                       """self.register_buffer('extra', tensor.to("meta"))""" + fix)  # fmt: skip
    assert [expected] == strays(caught)


def test_module_with_explicit_cpu_device_reports_its_parameters() -> None:
    """nn.Linear(..., device="cpu") reports its parameters at the user's line; the
    torch.empty that torch's own code calls inside is not reported separately."""
    fix = 'nn.Parameter(tensor.to("meta")), or build the module without device= (the block '
    fix += "then picks meta)"
    with warnings.catch_warnings(record=True) as caught, on_device("meta", audit=True):
        warnings.simplefilter("always")
        line = next_line()
        torch.nn.Linear(2, 2, device="cpu")
    expected = [
        message(f"register_parameter({name!r}) on Linear", line, "got a tensor on cpu",
                "meta", fix)
        for name in ("weight", "bias")
    ]  # fmt: skip
    assert expected == strays(caught)


def test_nothing_reported_for_tensors_that_landed_right() -> None:
    """Constructors without device=, *_like and new_* of meta tensors, as_tensor of numpy
    (filled in by the block), modules built in the block: all on meta, no report."""
    with warnings.catch_warnings(record=True) as caught, on_device("meta", audit="raise"):
        warnings.simplefilter("always")
        meta = torch.zeros(3)
        made = [meta, torch.as_tensor(A), torch.tensor([1.0]), torch.zeros_like(meta)]
        made += [meta.new_zeros(2), torch.randn(2), torch.zeros(1, device="meta")]
        made += [torch.nn.Linear(2, 2).weight, torch.nn.BatchNorm1d(2).running_mean]
    assert [] == strays(caught)
    assert {META} == {tensor.device for tensor in made}


def test_nothing_reported_for_ops_on_existing_tensors() -> None:
    """Results of ops on an existing CPU tensor follow it: not reported (not creations)."""
    with warnings.catch_warnings(record=True) as caught, on_device("meta", audit="raise"):
        warnings.simplefilter("always")
        made = [X + 1, X.clone(), torch.cat([X, X]), X[1:], X.to(torch.float64), X.sum()]
    assert [] == strays(caught)
    assert {CPU} == {tensor.device for tensor in made}


def test_nothing_reported_outside_or_without_audit() -> None:
    """Outside any block, and in a block without audit, nothing is reported or replaced."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.from_numpy(A)
        torch.zeros(1, device="cpu")
        with on_device("meta"), on_device("meta", audit=False):
            assert torch.from_numpy is OWN["from_numpy"]
            assert [] == _get_current_function_mode_stack()
            torch.from_numpy(A)
            torch.zeros_like(X)
        with on_device("meta", audit=True):
            pass
        torch.from_numpy(A)
    assert [] == strays(caught)


def test_torch_restored_after_the_last_audited_block() -> None:
    """from_numpy, frombuffer, the registration hooks and the mode stack come back exactly
    when the last audited block closes, also when it is left by an exception."""
    hooks = (
        dict(torch_module._global_buffer_registration_hooks),
        dict(torch_module._global_parameter_registration_hooks),
    )

    def installed() -> bool:
        return (
            torch.from_numpy is not OWN["from_numpy"] and torch.frombuffer is not OWN["frombuffer"]
        )

    def nest_then_fail() -> None:
        with on_device("meta", audit=True):
            assert installed()
            with on_device("cpu", audit="raise"):
                assert installed()
            assert installed()
            assert 1 == len(_get_current_function_mode_stack())
            raise KeyError

    with pytest.raises(KeyError):
        nest_then_fail()
    assert torch.from_numpy is OWN["from_numpy"]
    assert torch.frombuffer is OWN["frombuffer"]
    assert hooks == (
        dict(torch_module._global_buffer_registration_hooks),
        dict(torch_module._global_parameter_registration_hooks),
    )
    assert [] == _get_current_function_mode_stack()


def test_nested_blocks_audit_against_the_innermost_device() -> None:
    """An inner block, audited or not, sets the device audited against; the innermost
    audited block sets warn or raise."""
    with warnings.catch_warnings(record=True) as caught, on_device("meta", audit=True):
        warnings.simplefilter("always")
        with on_device("cpu"):
            torch.zeros(1, device="cpu")  # on the inner block's device
            line = next_line()
            torch.zeros(1, device="meta")
        with on_device("meta", audit="raise"), pytest.raises(StrayTensorError):
            torch.zeros(1, device="cpu")
        with on_device("meta", audit="raise"), on_device("meta", audit=True):
            torch.ones(1, device="cpu")  # warns: the innermost audited block warns
    fix = 'torch.zeros(..., device="cpu"), or leave device= out (the block then picks cpu)'
    assert message("torch.zeros", line, "made a tensor on meta", "cpu", fix) == strays(caught)[0]
    assert 2 == len(strays(caught))


def test_decorated_function_reports_inside_its_body() -> None:
    """The decorator form audits each call, at the line in the decorated body."""

    @on_device("meta", audit="raise")
    def load(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array)

    line = inspect.getsourcelines(load)[1] + 2  # the decorator's line, then def, then return
    with pytest.raises(StrayTensorError) as info:
        load(A)
    assert str(info.value).startswith(f"torch.from_numpy at {__file__}:{line} made")


def test_another_thread_is_not_audited() -> None:
    """While one thread has an audited block open, another thread's strays (and its
    from_numpy, which is replaced process-wide) go unreported; each thread is audited
    in its own block only."""
    inside, done = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def plain() -> None:
        inside.wait(5)
        try:
            seen["plain"] = [torch.from_numpy(A).device, torch.zeros(1, device="cpu").device]
        except Exception as error:  # a report would be raised here
            seen["plain"] = error
        done.set()

    def audited_thread() -> None:
        try:
            with on_device("meta", audit="raise"):
                torch.from_numpy(A)
        except StrayTensorError as error:
            seen["audited"] = error

    thread = threading.Thread(target=plain)
    thread.start()
    with on_device("meta", audit="raise"):
        inside.set()
        assert done.wait(5)
    thread.join()
    assert [CPU, CPU] == seen["plain"]
    other = threading.Thread(target=audited_thread)
    other.start()
    other.join()
    assert isinstance(seen["audited"], StrayTensorError)
    assert torch.from_numpy is OWN["from_numpy"]


def test_another_task_is_not_audited() -> None:
    """An asyncio task without a block, running while another task's audited block is
    open in the same thread (its mode on the thread's stack), is not reported."""
    opened = asyncio.Event()

    async def audited_task() -> str:
        with on_device("meta", audit="raise"):
            opened.set()
            await asyncio.sleep(0.01)
            try:
                torch.from_numpy(A)
            except StrayTensorError:
                return "raised"
        return "not raised"

    async def plain_task() -> list[torch.device]:
        await opened.wait()
        assert 1 == len(_get_current_function_mode_stack())
        return [torch.from_numpy(A).device, torch.zeros_like(X).device]

    async def both() -> tuple[str, list[torch.device]]:
        return await asyncio.gather(audited_task(), plain_task())

    assert ("raised", [CPU, CPU]) == tuple(asyncio.run(both()))
    assert [] == _get_current_function_mode_stack()


def test_compiled_function_inside_an_audited_block() -> None:
    """A compiled function called inside an audited block runs (unaudited) and agrees
    with eager code; a block entered inside compiled code compiles with fullgraph=True."""

    def add(x: torch.Tensor) -> torch.Tensor:
        return x + torch.zeros(2, device="cpu") + torch.ones_like(x)

    def make(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with on_device("meta", audit=True):
            inside = torch.zeros(2)
        return x + 1, inside

    torch._dynamo.reset()
    compiled, x = torch.compile(add, backend="eager"), torch.zeros(2)
    with warnings.catch_warnings(record=True) as caught, on_device("meta", audit=True):
        warnings.simplefilter("always")
        out = compiled(x)
    assert torch.equal(torch.ones(2), out)
    assert [] == strays(caught)
    plus_one, inside = torch.compile(make, backend="eager", fullgraph=True)(torch.ones(2))
    assert (CPU, META) == (plus_one.device, inside.device)
    torch._dynamo.reset()


# The first compiles of the process happen inside an audited block: dynamo's table of
# functions it handles its own way (torch.from_numpy, torch.full) is built there, while
# from_numpy is replaced. Compiled code runs unaudited, and compiles after the block too.
_FIRST_COMPILES_IN_AN_AUDITED_BLOCK = """
import numpy as np
import torch
import torch._dynamo
from devicectx import on_device

from_array = lambda a: torch.from_numpy(a) * 2
filled = lambda x: torch.full((2,), 3.0) + x
with on_device("meta", audit=True):
    inside = torch.compile(from_array, backend="eager")(np.ones(2, dtype=np.float32))
    torch.compile(filled, backend="eager")(torch.ones(2, device="meta"))
torch._dynamo.reset()
after = torch.compile(from_array, backend="eager", fullgraph=True)(np.ones(2, dtype=np.float32))
print(after.device, torch.compile(filled, backend="eager", fullgraph=True)(torch.ones(2)).device)
"""


def test_first_compiles_of_the_process_inside_an_audited_block() -> None:
    """Code compiled inside an audited block runs, and so does code compiled after it."""
    assert "cpu cpu" == python_output(_FIRST_COMPILES_IN_AN_AUDITED_BLOCK)


@pytest.mark.parametrize("audit", ["warn", "yes", 1, None, "RAISE"])
def test_audit_values_are_checked_when_the_block_is_made(audit: object) -> None:
    """Only False, True and "raise" are accepted, at on_device(...), with the fix."""
    expected = (
        f"on_device(audit={audit!r}): audit takes False, True (warn once per line) or "
        '"raise" (raise at the first stray tensor)\nfix: on_device(device, audit=True)'
    )
    with pytest.raises(ValueError, match="audit takes") as info:
        on_device("meta", audit=audit)  # type: ignore[arg-type]
    assert expected == str(info.value)


def test_repr_shows_the_audit() -> None:
    """repr names the audit where it is on."""
    assert "on_device('meta', audit=True)" == repr(on_device("meta", audit=True))
    assert "on_device('meta', audit='raise')" == repr(on_device("meta", audit="raise"))
    assert "on_device('meta')" == repr(on_device("meta", audit=False))


# ---- a property: any sequence of creation calls, explicit CPU or not ----

GEN = torch.Generator()
MAKERS: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
    # op: (a stray, the same landing on the block's device), each on one line
    "torch.zeros": (lambda: torch.zeros(2, device="cpu"), lambda: torch.zeros(2)),
    "torch.tensor": (lambda: torch.tensor([1], device="cpu"), lambda: torch.tensor([1])),
    "torch.zeros_like": (lambda: torch.zeros_like(X), lambda: torch.zeros_like(X, device="meta")),
    "Tensor.new_ones": (lambda: X.new_ones(1), lambda: X.new_ones(1, device="meta")),
    "torch.from_numpy": (lambda: torch.from_numpy(A), lambda: torch.as_tensor(A, device="meta")),
    "torch.randn": (lambda: torch.randn(2, generator=GEN), lambda: torch.randn(2)),
}  # fmt: skip


@given(
    calls=st.lists(st.tuples(st.sampled_from(sorted(MAKERS)), st.booleans()), max_size=12),
    raising=st.booleans(),
)
def test_reports_match_the_stray_calls(calls: list[tuple[str, bool]], raising: bool) -> None:
    """For any sequence of creation calls, stray or not: one warning per stray (op, line)
    in order of first call, or, raising, an error at the first stray and no call after."""
    reset_reports()
    expected: list[tuple[str, int]] = []
    for op, stray in calls:
        line = MAKERS[op][0].__code__.co_firstlineno
        if stray and (op, line) not in expected:
            expected.append((op, line))
    ran: list[str] = []

    def run() -> None:
        with on_device("meta", audit="raise" if raising else True):
            for op, stray in calls:
                MAKERS[op][0 if stray else 1]()
                ran.append(op)

    if raising and expected:
        with pytest.raises(StrayTensorError) as info:
            run()
        op, line = expected[0]
        assert str(info.value).startswith(f"{op} at {__file__}:{line} ")
        assert [stray for _, stray in calls].index(True) == len(ran)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    reported = [(str(w.message).split(" at ")[0], w.lineno) for w in caught]
    assert expected == reported
    assert [__file__] * len(expected) == [w.filename for w in caught]


@pytest.mark.requires_device("accelerator")
def test_generator_fix_runs_on_the_block_device() -> None:
    """The fix for a stray generator on an accelerator (CUDA, the emulated device) is a
    generator on the block's device; followed, nothing is reported, and the generator
    draws there."""
    device = accelerator()
    gen = torch.Generator()
    block = on_device(device, audit="raise")
    with pytest.raises(StrayTensorError) as caught, block:
        torch.randn(2, generator=gen)
    fix = str(caught.value).rpartition("fix: ")[2]
    assert f'gen = torch.Generator(device="{device}")' == fix
    with on_device(device, audit="raise"):
        gen = torch.Generator(device=device)
        made = torch.randn(2, generator=gen.manual_seed(0))
        again = torch.randn(2, generator=gen.manual_seed(0))
    assert device == made.device
    assert torch.equal(made.cpu(), again.cpu())


@pytest.mark.requires_device("emu")
def test_generator_fix_on_a_device_without_generators() -> None:
    """On a backend without generators of its own (the emulated device playing one), the
    fix is to leave generator= out and seed the device's default generator with
    torch.manual_seed; followed, nothing is reported, and the seed reproduces the numbers."""
    device = torch.device("emu", 0)
    gen = torch.Generator()
    with emulated.configure(generators=False):
        block = on_device(device, audit="raise")
        with pytest.raises(StrayTensorError) as caught, block:
            torch.randn(2, generator=gen)
        fix = str(caught.value).rpartition("fix: ")[2]
        assert (
            "leave generator= out (emu:0 has no torch.Generator of its own; seed its default "
            "one with torch.manual_seed)"
        ) == fix
        with on_device(device, audit="raise"):
            torch.manual_seed(0)
            made = torch.randn(2)
            torch.manual_seed(0)
            again = torch.randn(2)
    assert device == made.device
    assert torch.equal(made.cpu(), again.cpu())


@pytest.mark.requires_device("accelerator")
@pytest.mark.parametrize("audit", [True, "raise"])
def test_a_dtype_the_block_device_lacks_is_refused_as_without_the_audit(audit: object) -> None:
    """On a device without float64, torch.tensor of a float64 array in an audited block is
    refused with DtypeUnsupportedError and its fix, as without audit=: the tensor the
    refusal remakes on meta to learn its dtype is not reported (nor raised at)."""
    with mps_like() as device, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(DtypeUnsupportedError) as info, on_device(device, audit=audit):
            torch.tensor(np.ones(3))
    assert "fix: torch.tensor(..., dtype=torch.float32)" in str(info.value)
    assert [] == [w for w in caught if issubclass(w.category, StrayTensorWarning)]


@pytest.mark.requires_device("accelerator")
def test_the_fix_for_from_numpy_casts_where_the_block_device_lacks_the_dtype() -> None:
    """On a device without float64, the fix for torch.from_numpy of a float64 array gives
    the dtype to cast to, and passes the audit applied as written (without it, torch
    refused the copy)."""
    array = np.ones(3)
    with (
        mps_like() as device,
        on_device(device, audit=True),
        pytest.warns(StrayTensorWarning) as caught,
    ):
        torch.from_numpy(array)
    fix = str(caught[0].message).split("\nfix: ", 1)[1]
    assert f'torch.as_tensor(array, dtype=torch.float32, device="{device}")' == fix
    with mps_like() as device, on_device(device, audit="raise"):
        made = eval(fix, {"torch": torch, "array": array})
    assert (device, torch.float32) == (made.device, made.dtype)
