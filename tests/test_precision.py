"""Mixed precision: the pick per device type, every error message, and the autocast it runs.

The decision is ``_precision._decide``, a pure function of the device and the dtypes its
autocast computes in, so the picks of CUDA, MPS, XPU and the others are tested here with
those facts as inputs; the facts of this machine come from ``_resolve.autocast_dtypes``.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from hypothesis import given
from hypothesis import strategies as st

from devicectx import (
    DeviceError,
    InvalidPrecisionError,
    Precision,
    PrecisionUnsupportedError,
    choose_precision,
    device_agnostic,
    on_device,
    precision_scope,
)
from devicectx.devices import _resolve
from devicectx.scope._precision import _decide, check_precision_name

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
BOTH = (BF16, FP16)
# PrivateUse1's device type: "privateuseone", or the name a backend gave it (the emulated
# accelerator's "emu", where the session runs on it).
PRIVATE = torch._C._get_privateuse1_backend_name()
NAMES = ["auto", "bf16-mixed", "16-mixed", "32", "32-true"]
VALID_NAMES = "valid names: 'auto', 'bf16-mixed', '16-mixed', '32' (or '32-true')"
AUTO_FIX = 'precision="auto" to pick what each device supports'
ANY_FIX = 'one of those, such as precision="auto" (it picks what each device supports)'
T4 = "Tesla T4, compute capability 7.5"


def product_dtype(precision: Precision, device: str = "cpu") -> torch.dtype:
    """The dtype of a matrix product computed inside ``precision.autocast()``."""
    ones = torch.ones(4, 4, device=device)
    with precision.autocast():
        return (ones @ ones).dtype


# --- this machine: cpu and meta ----------------------------------------------------------


@pytest.mark.parametrize(
    ("asked", "name", "dtype"),
    [
        ("bf16-mixed", "bf16-mixed", BF16),
        ("16-mixed", "16-mixed", FP16),
        ("32", "32", None),
        ("32-true", "32", None),
    ],
)
def test_explicit_names_on_cpu(asked: Any, name: str, dtype: torch.dtype | None) -> None:
    """Each name runs as asked on the CPU, whose autocast has both 16-bit dtypes."""
    expected = Precision(name, dtype, "cpu", f"asked for {asked!r} on cpu")  # type: ignore[arg-type]
    assert expected == choose_precision("cpu", asked)
    assert (dtype or FP32) == product_dtype(expected)


def test_auto_keeps_the_cpu_in_float32() -> None:
    """On the CPU "auto" is full precision, and says why and how to autocast anyway."""
    precision = choose_precision("cpu", "auto")
    expected = "32: 'auto' on the CPU, where autocast is mostly slower (to use it: 'bf16-mixed')"
    assert expected == str(precision)
    assert (None, "cpu") == (precision.dtype, precision.device_type)
    assert FP32 == product_dtype(precision)


@pytest.mark.parametrize("asked", NAMES)
def test_meta_runs_no_autocast_whatever_is_asked(asked: Any) -> None:
    """On meta every name means full precision, and a product inside still runs."""
    precision = choose_precision("meta", asked)
    reason = f"asked for {asked!r} on meta, which holds no data: no autocast"
    assert Precision("32", None, "meta", reason) == precision
    assert FP32 == product_dtype(precision, "meta")
    with precision_scope("meta", asked):
        product = torch.ones(2, 3, device="meta") @ torch.ones(3, 5, device="meta")
    assert (torch.Size([2, 5]), FP32) == (product.shape, product.dtype)


def test_meta_still_checks_the_name() -> None:
    """A misspelt name fails on meta as it would on a GPU."""
    with pytest.raises(InvalidPrecisionError, match=r"^invalid precision 'bf16'"):
        choose_precision("meta", "bf16")  # type: ignore[arg-type]


def test_this_machines_facts() -> None:
    """The CPU's autocast has both 16-bit dtypes; meta and a type without autocast have none."""
    assert BOTH == _resolve.autocast_dtypes("cpu")
    assert () == _resolve.autocast_dtypes("meta")
    assert () == _resolve.autocast_dtypes("lazy")
    assert "" == _resolve.device_name("cpu") == _resolve.device_name("meta")


# --- the scope ---------------------------------------------------------------------------


@pytest.mark.parametrize(("asked", "dtype"), [("bf16-mixed", BF16), ("16-mixed", FP16)])
def test_scope_autocasts_and_restores(asked: Any, dtype: torch.dtype) -> None:
    """Inside the scope a product comes out in the chosen dtype; after it, autocast is off."""
    ones = torch.ones(4, 4)
    with precision_scope("cpu", asked):
        assert torch.is_autocast_enabled("cpu")
        inside = (ones @ ones).dtype
    assert (dtype, False, FP32) == (inside, torch.is_autocast_enabled("cpu"), (ones @ ones).dtype)


def test_32_turns_an_outer_autocast_off() -> None:
    """A "32" block inside a bf16 block computes in float32, and the outer block resumes."""
    ones = torch.ones(4, 4)
    with precision_scope("cpu", "bf16-mixed"):
        with precision_scope("cpu", "32"):
            inner = (ones @ ones).dtype
        outer = (ones @ ones).dtype
    assert (FP32, BF16) == (inner, outer)


def test_autocast_does_not_reach_threads_started_inside() -> None:
    """Autocast is torch's per-thread state, as the docstring warns: a new thread has none."""
    seen: list[torch.dtype] = []
    ones = torch.ones(4, 4)
    with precision_scope("cpu", "bf16-mixed"):
        thread = threading.Thread(target=lambda: seen.append((ones @ ones).dtype))
        thread.start()
        thread.join()
    assert [FP32] == seen


def test_grad_scaler_is_for_float16_only() -> None:
    """Only float16 needs its loss scaled: bfloat16 has float32's range."""
    needs = {name: choose_precision("cpu", name).needs_grad_scaler for name in NAMES}  # type: ignore[arg-type]
    expected = {"auto": False, "bf16-mixed": False, "16-mixed": True, "32": False, "32-true": False}
    assert expected == needs


# --- the decision, per device type, from the facts ---------------------------------------


@pytest.mark.parametrize(
    ("device", "dtypes", "name", "dtype", "reason"),
    [
        ("cuda:0", BOTH, "bf16-mixed", BF16, "'auto' on cuda:0, which computes in bfloat16"),
        (
            "cuda:1",
            (FP16,),
            "16-mixed",
            FP16,
            "'auto' on cuda:1, which does not compute in bfloat16 "
            "(scale the loss with torch.amp.GradScaler)",
        ),
        ("mps:0", BOTH, "bf16-mixed", BF16, "'auto' on mps:0, which computes in bfloat16"),
        (
            "mps:0",
            (FP16,),
            "16-mixed",
            FP16,
            "'auto' on mps:0, which does not compute in bfloat16 "
            "(scale the loss with torch.amp.GradScaler)",
        ),
        ("xpu:0", BOTH, "bf16-mixed", BF16, "'auto' on xpu:0, which computes in bfloat16"),
        ("hpu:0", BOTH, "bf16-mixed", BF16, "'auto' on hpu:0, which computes in bfloat16"),
        ("xla:0", BOTH, "bf16-mixed", BF16, "'auto' on xla:0, which computes in bfloat16"),
        (
            f"{PRIVATE}:0",
            (FP16,),
            "16-mixed",
            FP16,
            f"'auto' on {PRIVATE}:0, which does not compute in bfloat16 "
            "(scale the loss with torch.amp.GradScaler)",
        ),
        ("lazy:0", (), "32", None, "'auto' on lazy:0, where torch.autocast does not run"),
        (
            "cpu",
            BOTH,
            "32",
            None,
            "'auto' on the CPU, where autocast is mostly slower (to use it: 'bf16-mixed')",
        ),
        ("meta", (), "32", None, "asked for 'auto' on meta, which holds no data: no autocast"),
    ],
)
def test_auto_per_device_type(
    device: str, dtypes: tuple[torch.dtype, ...], name: str, dtype: torch.dtype | None, reason: str
) -> None:
    """The "auto" pick: bf16, else fp16, else full precision, from what the autocast has."""
    target = torch.device(device)
    expected = Precision(name, dtype, target.type, reason)  # type: ignore[arg-type]
    assert expected == _decide(target, "auto", dtypes)


@pytest.mark.parametrize(
    ("device", "dtypes", "asked", "dtype"),
    [
        ("cuda:0", BOTH, "bf16-mixed", BF16),
        ("cuda:0", (FP16,), "16-mixed", FP16),
        ("cuda:0", (FP16,), "32", None),
        ("mps:0", BOTH, "16-mixed", FP16),
        ("xpu:0", BOTH, "bf16-mixed", BF16),
        ("lazy:0", (), "32-true", None),
    ],
)
def test_explicit_names_per_device_type(
    device: str, dtypes: tuple[torch.dtype, ...], asked: str, dtype: torch.dtype | None
) -> None:
    """A name the device's autocast can run is used as asked, and the reason says so."""
    target = torch.device(device)
    precision = _decide(target, asked, dtypes)
    assert (dtype, target.type) == (precision.dtype, precision.device_type)
    assert f"asked for {asked!r} on {device}" == precision.reason


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "dtypes", "hardware", "asked", "lines"),
    [
        pytest.param(
            "cuda:0",
            (FP16,),
            T4,
            "bf16-mixed",
            [
                f"precision 'bf16-mixed' (autocast to torch.bfloat16) is not supported on cuda:0 "
                f"({T4}): bfloat16 needs compute capability 8.0 (Ampere) or newer; torch would "
                "emulate it, slower than float16",
                "works there: '16-mixed', '32'",
                f'fix: precision="16-mixed", or {AUTO_FIX}',
            ],
            id="cuda-before-ampere",
        ),
        pytest.param(
            "mps:0",
            (FP16,),
            "",
            "bf16-mixed",
            [
                "precision 'bf16-mixed' (autocast to torch.bfloat16) is not supported on mps:0: "
                "bfloat16 autocast on MPS needs macOS 14 or newer",
                "works there: '16-mixed', '32'",
                f'fix: precision="16-mixed", or {AUTO_FIX}',
            ],
            id="mps-before-macos-14",
        ),
        pytest.param(
            "xpu:0",
            (FP16,),
            "Intel(R) Arc(TM) A770 Graphics",
            "bf16-mixed",
            [
                "precision 'bf16-mixed' (autocast to torch.bfloat16) is not supported on xpu:0 "
                "(Intel(R) Arc(TM) A770 Graphics): this XPU has no bfloat16 arithmetic "
                "(torch.xpu.is_bf16_supported() is False)",
                "works there: '16-mixed', '32'",
                f'fix: precision="16-mixed", or {AUTO_FIX}',
            ],
            id="xpu-without-bf16",
        ),
        pytest.param(
            f"{PRIVATE}:0",
            (BF16,),
            "",
            "16-mixed",
            [
                "precision '16-mixed' (autocast to torch.float16) is not supported on "
                f"{PRIVATE}:0: its autocast computes in torch.bfloat16 only",
                "works there: 'bf16-mixed', '32'",
                f'fix: precision="bf16-mixed", or {AUTO_FIX}',
            ],
            id="backend-without-fp16",
        ),
        pytest.param(
            "lazy:0",
            (),
            "",
            "16-mixed",
            [
                "precision '16-mixed' (autocast to torch.float16) is not supported on lazy:0: "
                "torch.autocast does not run on 'lazy' devices",
                "works there: '32'",
                f'fix: precision="32", or {AUTO_FIX}',
            ],
            id="type-without-autocast",
        ),
    ],
)
def test_unsupported_precision_messages(
    device: str, dtypes: tuple[torch.dtype, ...], hardware: str, asked: str, lines: list[str]
) -> None:
    """The error names the device and its hardware, the dtype, what works there, and the fix."""
    with pytest.raises(PrecisionUnsupportedError) as info:
        _decide(torch.device(device), asked, dtypes, describe=lambda: hardware)
    assert lines == str(info.value).splitlines()
    assert isinstance(info.value, RuntimeError)
    assert isinstance(info.value, DeviceError)


@pytest.mark.parametrize(
    ("asked", "problem", "fix"),
    [
        ("fp16", "not a precision name", 'precision="16-mixed"'),
        ("bfloat16", "not a precision name", 'precision="bf16-mixed"'),
        (
            "16",
            "not a precision name",
            'precision="16-mixed" (Lightning reads "16" so; devicectx wants it spelled out)',
        ),
        (
            "bf16-true",
            "not a precision name",
            'precision="bf16-mixed", or cast the model yourself: model.to(torch.bfloat16) '
            "(devicectx runs autocast only)",
        ),
        (
            "64-true",
            "not a precision name",
            'model.to(torch.float64) and precision="32" (devicectx runs autocast only)',
        ),
        ("Auto", "not a precision name", 'precision="auto"'),
        ("bf16_mixed", "not a precision name", 'precision="bf16-mixed"'),
        ("16-Mixed", "not a precision name", 'precision="16-mixed"'),
        ("", "not a precision name", ANY_FIX),
        (16, "an int is not a precision name", 'precision="16-mixed"'),
        (BF16, "a dtype is not a precision name", 'precision="bf16-mixed"'),
        (
            None,
            "a NoneType is not a precision name",
            ANY_FIX,
        ),
        (
            ["32"],
            "a list is not a precision name",
            ANY_FIX,
        ),
    ],
)
def test_invalid_precision_messages(asked: object, problem: str, fix: str) -> None:
    """An unknown name lists the valid ones and says what to write (a ValueError)."""
    with pytest.raises(InvalidPrecisionError) as info:
        choose_precision("cpu", asked)  # type: ignore[arg-type]
    expected = [f"invalid precision {asked!r}: {problem}", VALID_NAMES, f"fix: {fix}"]
    assert expected == str(info.value).splitlines()
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, DeviceError)


@pytest.mark.parametrize("name", ["bf16-mixed", "16-mixed", "32"])
def test_a_precision_object_for_a_name_gets_a_fix_that_works_where_names_are_taken(
    name: str,
) -> None:
    """A Precision passed where a name goes: the fix names the same precision (its name,
    not "auto", which may pick another), and written in place of the Precision in
    precision_scope, on_device and @device_agnostic it runs in that precision."""
    chosen = choose_precision("cpu", name)  # type: ignore[arg-type]
    with pytest.raises(InvalidPrecisionError) as info:
        precision_scope("cpu", chosen)  # type: ignore[arg-type]
    fix = str(info.value).splitlines()[-1]
    assert (
        f'fix: precision="{name}", its name (Precision.name); a block can also enter the '
        "Precision itself, with its .autocast()"
    ) == fix
    written = fix.removeprefix("fix: ").partition(",")[0]  # precision="..."
    expected = chosen.dtype or FP32
    taken: dict[str, Any] = eval(f"dict({written})")  # the fix as code, as a user writes it

    @device_agnostic(**taken)
    def product(x: torch.Tensor) -> torch.Tensor:
        return x @ x

    ones = torch.ones(2, 2)
    with precision_scope("cpu", **taken):
        assert expected == (ones @ ones).dtype
    with on_device("cpu", **taken):
        assert expected == (ones @ ones).dtype
    assert expected == product(ones).dtype
    with chosen.autocast():
        assert expected == (ones @ ones).dtype


def test_names_are_checked_before_the_device() -> None:
    """check_precision_name validates without a device, for a check at decoration time."""
    assert ["auto", "bf16-mixed", "16-mixed", "32", "32"] == [
        check_precision_name(name) for name in NAMES
    ]
    with pytest.raises(InvalidPrecisionError, match=r"^invalid precision 'fp32'"):
        check_precision_name("fp32")


# --- every input: a precision autocast takes, or our error -------------------------------

device_types = st.sampled_from(["cpu", "cuda", "mps", "xpu", "hpu", "xla", "meta", "lazy", PRIVATE])
devices = st.builds(
    lambda kind, index: (
        torch.device(kind) if kind in ("cpu", "meta") else torch.device(kind, index)
    ),
    device_types,
    st.integers(0, 7),
)
facts = st.lists(st.sampled_from(BOTH), unique=True).map(tuple)
precisions = st.one_of(
    st.sampled_from([*NAMES, "16", "bf16", "bf16-true", "fp16", " 32"]),
    st.text(max_size=12),
    st.sampled_from([None, 16, 32, BF16, FP32, 1.5, b"32", ("32",)]),
)


@given(device=devices, dtypes=facts, asked=precisions)
def test_a_precision_autocast_takes_or_our_error(
    device: torch.device, dtypes: tuple[torch.dtype, ...], asked: object
) -> None:
    """For any device, facts and input, the pick is one the device's autocast computes in
    (or full precision), the name matches the dtype; else one of our two errors, exactly when
    the name is unknown, or a 16-bit dtype the device lacks was asked for by name."""
    known = isinstance(asked, str) and asked in NAMES
    try:
        precision = _decide(device, asked, dtypes)
    except InvalidPrecisionError:
        assert not known
        return
    except PrecisionUnsupportedError:
        wanted = {"bf16-mixed": BF16, "16-mixed": FP16}.get(asked)  # type: ignore[call-overload]
        assert device.type != "meta"
        assert wanted is not None
        assert wanted not in dtypes
        return
    assert known
    assert precision.dtype is None or precision.dtype in dtypes
    names = {None: "32", BF16: "bf16-mixed", FP16: "16-mixed"}
    assert names[precision.dtype] == precision.name
    assert device.type == precision.device_type
    assert precision.reason
    if device.type == "cpu":
        assert (precision.dtype or FP32) == product_dtype(precision)


# --- under torch.compile -----------------------------------------------------------------


def test_scopes_compile_with_fullgraph() -> None:
    """Choosing a precision and entering its scope trace into one graph, with eager's dtypes."""

    def products(x: torch.Tensor) -> list[torch.Tensor]:
        with precision_scope("cpu", "bf16-mixed"):
            mixed = x @ x
            with precision_scope("cpu", "32"):
                full = x @ x
        with precision_scope("cpu", "auto"):
            auto = x @ x
        with choose_precision("cpu", "16-mixed").autocast():
            half = x @ x
        with precision_scope("meta", "bf16-mixed"):
            meta = x.to("meta") @ x.to("meta")
        return [mixed, full, auto, half, meta]

    expected = [t.dtype for t in products(torch.ones(4, 4))]
    torch._dynamo.reset()
    try:
        got = torch.compile(products, backend="eager", fullgraph=True)(torch.ones(4, 4))
    finally:
        torch._dynamo.reset()
    assert [BF16, FP32, FP32, FP16, FP32] == expected == [t.dtype for t in got]


def test_an_error_while_compiling_is_ours() -> None:
    """Without fullgraph, a bad name in compiled code raises our error, as eager code does."""

    def product(x: torch.Tensor) -> torch.Tensor:
        with precision_scope("cpu", "fp16"):  # type: ignore[arg-type]
            return x @ x

    torch._dynamo.reset()
    try:
        with pytest.raises(InvalidPrecisionError, match=r"^invalid precision 'fp16'"):
            torch.compile(product, backend="eager")(torch.ones(2, 2))
    finally:
        torch._dynamo.reset()


# --- on a GPU ----------------------------------------------------------------------------


@pytest.mark.requires_device("cuda")
def test_cuda_picks_and_runs() -> None:
    """On a GPU "auto" is bf16 exactly where it computes in it natively, and each scope runs."""
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    assert (BOTH if native else (FP16,)) == _resolve.autocast_dtypes("cuda", 0)
    auto = choose_precision("cuda:0", "auto")
    assert (BF16 if native else FP16) == auto.dtype
    assert (BF16 if native else FP16) == product_dtype(auto, "cuda:0")
    assert FP16 == product_dtype(choose_precision("cuda", "16-mixed"), "cuda:0")
    assert FP32 == product_dtype(choose_precision("cuda", "32"), "cuda:0")
    if native:
        assert BF16 == product_dtype(choose_precision("cuda", "bf16-mixed"), "cuda:0")
    else:
        with pytest.raises(PrecisionUnsupportedError) as info:
            choose_precision("cuda:0", "bf16-mixed")
        assert f"({_resolve.device_name('cuda', 0)})" in str(info.value).splitlines()[0]


@pytest.mark.requires_device("cuda")
def test_cuda_scope_compiles_with_fullgraph() -> None:
    """On a GPU "auto" compiles into one graph, with the dtype eager code gets."""

    def product(x: torch.Tensor) -> torch.Tensor:
        with precision_scope("cuda", "auto"):
            return x @ x

    x = torch.ones(4, 4, device="cuda")
    torch._dynamo.reset()
    try:
        got = torch.compile(product, backend="eager", fullgraph=True)(x)
    finally:
        torch._dynamo.reset()
    assert product(x).dtype == got.dtype


# ---- on_device(precision=...) ----


def test_on_device_runs_its_block_in_the_precision() -> None:
    """A block with precision= runs under the device's autocast, and leaves it on exit."""
    a = torch.ones(2, 2)
    with on_device("cpu", precision="bf16-mixed"):
        assert torch.bfloat16 == (a @ a).dtype
    assert torch.float32 == (a @ a).dtype
    assert not torch.is_autocast_enabled("cpu")


def test_on_device_precision_is_left_on_an_exception() -> None:
    """Leaving a block by an exception turns its autocast off too."""
    with pytest.raises(KeyError), on_device("cpu", precision="16-mixed"):
        raise KeyError
    assert not torch.is_autocast_enabled("cpu")


def test_on_device_refuses_a_misspelt_precision_where_written() -> None:
    """A misspelt precision fails when the block is made, before anything is entered."""
    with pytest.raises(InvalidPrecisionError, match="'bf16'"):
        on_device("cpu", precision="bf16")  # type: ignore[arg-type]


def test_on_device_precision_on_meta_runs_in_full_precision() -> None:
    """On meta the block allocates there and computes in float32."""
    with on_device("meta", precision="auto"):
        made = torch.ones(2, 2)
        assert (torch.device("meta"), torch.float32) == (made.device, (made @ made).dtype)


def test_decorated_generator_leaves_the_precision_at_every_yield() -> None:
    """A generator decorated with a precision runs in it and leaves it between items."""

    @on_device("cpu", precision="bf16-mixed")
    def products() -> Iterator[torch.dtype]:
        a = torch.ones(2, 2)
        for _ in range(2):
            yield (a @ a).dtype

    seen = []
    for dtype in products():
        seen.append((dtype, torch.is_autocast_enabled("cpu")))
    assert [(torch.bfloat16, False)] * 2 == seen


def test_on_device_precision_under_fullgraph_says_what_to_write() -> None:
    """Compiled, a block with precision= runs eagerly behind a graph break; with fullgraph it
    fails quoting the form that traces."""

    def step(a: torch.Tensor) -> torch.Tensor:
        with on_device("cpu", precision="bf16-mixed"):
            return a @ a

    if "msg" not in inspect.signature(torch._dynamo.graph_break).parameters:
        pytest.skip("torch 2.6's dynamo fails on it: a known limit")
    a = torch.ones(2, 2)
    assert torch.bfloat16 == torch.compile(step, backend="eager")(a).dtype
    torch._dynamo.reset()
    with pytest.raises(Exception, match="precision_scope"):
        torch.compile(step, backend="eager", fullgraph=True)(a)


# ---- @device_agnostic(precision=...) ----


@device_agnostic(precision="bf16-mixed")
def _product(a: torch.Tensor) -> torch.Tensor:
    return a @ a


def test_decorated_body_runs_in_the_precision_of_its_target() -> None:
    """A decorated function's body runs under its target's autocast, and only its body."""
    a = torch.ones(2, 2)
    assert torch.bfloat16 == _product(a).dtype
    assert not torch.is_autocast_enabled("cpu")
    assert torch.float32 == (a @ a).dtype


def test_decorated_body_on_meta_runs_in_full_precision() -> None:
    """A decorated call whose target is meta computes in float32 there."""
    made = _product(torch.ones(2, 2, device="meta"))
    assert (torch.device("meta"), torch.float32) == (made.device, made.dtype)


@device_agnostic(device="cpu", precision="32")
def _full(a: torch.Tensor) -> tuple[torch.dtype, bool]:
    return (a @ a).dtype, torch.is_autocast_enabled("cpu")


def test_a_decorated_32_body_leaves_an_outer_autocast_and_enters_none_outside() -> None:
    """precision="32": inside the caller's bf16 region the body computes in float32 (the
    region is left); outside any region, it runs as it is (no region to leave)."""
    a = torch.ones(2, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (torch.float32, False) == _full(a)
        assert torch.is_autocast_enabled("cpu")
    assert (torch.float32, False) == _full(a)


def test_a_decorated_call_chooses_its_precision_once_per_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The choice is made at the first call on a device and kept with the device's
    capabilities: forgotten with them, then made again."""
    from devicectx.decorator import _plan
    from devicectx.devices._capabilities import CAPABILITIES

    choices: list[object] = []
    choose = _plan.choose_precision

    def counted(device: Any, precision: Any) -> Precision:
        choices.append(device)
        return choose(device, precision)

    monkeypatch.setattr(_plan, "choose_precision", counted)

    @device_agnostic(device="cpu", precision="bf16-mixed")
    def product(a: torch.Tensor) -> torch.Tensor:
        return a @ a

    a = torch.ones(2, 2)
    CAPABILITIES.clear()  # choices other tests made for the CPU are shared: none left
    assert [torch.bfloat16] * 3 == [product(a).dtype for _ in range(3)]
    assert 1 == len(choices)
    CAPABILITIES.clear()
    assert torch.bfloat16 == product(a).dtype
    assert 2 == len(choices)


def test_decorator_refuses_a_misspelt_precision_at_decoration() -> None:
    """A misspelt precision fails when the function is decorated."""
    with pytest.raises(InvalidPrecisionError, match="'fp16'"):
        device_agnostic(precision="fp16")  # type: ignore[call-overload]


def test_decorated_generator_runs_in_the_precision_between_yields_only() -> None:
    """A decorated generator computes in the precision and leaves it at every yield."""

    @device_agnostic(device="cpu", precision="bf16-mixed")
    def products(a: torch.Tensor) -> Iterator[torch.dtype]:
        for _ in range(2):
            yield (a @ a).dtype

    seen = [(dtype, torch.is_autocast_enabled("cpu")) for dtype in products(torch.ones(2, 2))]
    assert [(torch.bfloat16, False)] * 2 == seen


def test_decorated_precision_compiles_with_fullgraph() -> None:
    """A decorated function with a precision compiles with fullgraph and computes in it."""

    @device_agnostic(device="cpu", precision="bf16-mixed")
    def product(a: torch.Tensor) -> torch.Tensor:
        return a @ a

    compiled = torch.compile(product, fullgraph=True, backend="eager")
    assert torch.bfloat16 == compiled(torch.ones(2, 2)).dtype
