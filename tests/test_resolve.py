"""Device resolution: every accepted form, the ``"auto"`` rules, and every error message."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from devicectx import (
    DeviceError,
    DeviceUnavailableError,
    InvalidDeviceError,
    available_devices,
    explain_device,
    on_device,
    resolve_device,
)
from devicectx.devices import _resolve

CPU = torch.device("cpu")
META = torch.device("meta")
HAS_ACCELERATOR = torch.accelerator.is_available()
VALID_FORMS = (
    "valid forms: 'auto', 'cpu', 'cuda', 'cuda:1', 'mps', 'xpu', 'meta' (any device type torch "
    "knows, with an optional ':index'), an int index on the current accelerator, "
    "a torch.device, or None (same as 'auto')"
)
HERE = ", ".join(str(d) for d in [*available_devices(), META])
FIX_INVALID = (
    f'fix: pass a device this machine has ({HERE}), or "auto", which picks its accelerator, '
    "else the CPU"
)
ACCELERATOR = _resolve.accelerator_type()
# What "gpu" gets on this machine: its own accelerator, else the CPU, which both work.
GPU_HINT = (
    f"did you mean {ACCELERATOR!r} (this machine's accelerator) or 'auto'?"
    if ACCELERATOR is not None
    else "did you mean 'cpu' (no accelerator here; a GPU is 'cuda' on NVIDIA and AMD, 'mps' "
    "on Apple, 'xpu' on Intel) or 'auto'?"
)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("cpu", CPU),
        ("cpu:0", CPU),
        (" cpu ", CPU),
        (CPU, CPU),
        ("meta", META),
        (torch.device("meta"), META),
    ],
)
def test_explicit_specs(spec: object, expected: torch.device) -> None:
    """Strings and torch.device objects resolve to the device tensors report."""
    assert expected == resolve_device(spec)  # type: ignore[arg-type]
    assert expected == torch.empty(0, device=resolve_device(spec)).device  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", ["meta", "cpu", " meta ", META, CPU])
def test_a_spec_naming_one_device_is_resolved_once(spec: object) -> None:
    """A spec that names one device for good is looked up after its first resolution
    (``on_device("meta")`` is entered at every call of a function): the same device."""
    first = resolve_device(spec)  # type: ignore[arg-type]
    assert first is resolve_device(spec)  # type: ignore[arg-type]
    assert first in (CPU, META)


def test_specs_that_can_name_another_device_are_resolved_each_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``"auto"`` (and None) follow the environment at every call; kept specs do not."""
    monkeypatch.setenv("DEVICECTX_DEVICE", "meta")
    assert META == resolve_device("auto") == resolve_device(None)
    monkeypatch.setenv("DEVICECTX_DEVICE", "cpu")
    assert CPU == resolve_device("auto") == resolve_device(None)
    assert META == resolve_device("meta")


@pytest.mark.parametrize("spec", ["gpu", [0], True, "cpu:1"])
def test_a_refused_spec_is_refused_at_every_call(spec: object) -> None:
    """A malformed or unavailable spec is never kept: it raises at each call."""
    for _ in range(2):
        with pytest.raises(DeviceError):
            resolve_device(spec)  # type: ignore[arg-type]


def test_auto_without_accelerator_is_cpu() -> None:
    """With no accelerator and nothing set, auto (and None) is the CPU."""
    if HAS_ACCELERATOR:
        pytest.skip("this machine has an accelerator")
    assert CPU == resolve_device() == resolve_device("auto") == resolve_device(None)
    expected = "cpu: no accelerator found, so the CPU (set DEVICECTX_DEVICE to choose)"
    assert expected == explain_device()


def test_env_var_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """DEVICECTX_DEVICE decides auto, and explain_device says so."""
    monkeypatch.setenv("DEVICECTX_DEVICE", "meta")
    assert META == resolve_device("auto")
    assert "meta: environment variable DEVICECTX_DEVICE='meta'" == explain_device()


@pytest.mark.parametrize("value", ["", "  ", "auto"])
def test_empty_or_auto_env_var_is_ignored(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """An empty DEVICECTX_DEVICE (as `DEVICECTX_DEVICE= cmd` sets it) means unset."""
    monkeypatch.setenv("DEVICECTX_DEVICE", value)
    assert resolve_device() == resolve_device(None)
    assert "environment variable" not in explain_device()


def test_env_var_does_not_affect_explicit_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit spec is used as given, whatever DEVICECTX_DEVICE says."""
    monkeypatch.setenv("DEVICECTX_DEVICE", "meta")
    assert CPU == resolve_device("cpu")


ENV_FORMS = (
    "DEVICECTX_DEVICE takes: 'auto', a device type torch knows ('cpu', 'cuda', 'mps', 'xpu', "
    "'meta', ...) with an optional ':index' ('cuda:1'), or an index on the accelerator ('1')"
)
ENV_FIX = "fix: set DEVICECTX_DEVICE to one of the devices above (cpu always works), or unset it"


def test_invalid_env_var_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A malformed DEVICECTX_DEVICE raises an error naming the variable and its value, what
    the variable takes (not the forms only code can pass: a torch.device, None), and the
    devices there are, which the fix names."""
    monkeypatch.setenv("DEVICECTX_DEVICE", "gpu")
    with pytest.raises(InvalidDeviceError) as info:
        resolve_device()
    expected = [
        "environment variable DEVICECTX_DEVICE='gpu' is not a usable device:",
        f"invalid device 'gpu': unknown device type 'gpu', {GPU_HINT}",
        ENV_FORMS,
        f"available here: {HERE}",
        ENV_FIX,
    ]
    assert expected == str(info.value).splitlines()


@pytest.mark.parametrize("value", ["gpu", "cuda:7", "EMU:1", "-1", "99", "1.5", "cpu:1"])
def test_following_the_env_var_fix_works(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """The fix of a refused DEVICECTX_DEVICE, followed: each device it lists as available
    here, set in the variable, resolves to that device."""
    monkeypatch.setenv("DEVICECTX_DEVICE", value)
    with pytest.raises(DeviceError) as info:
        resolve_device()
    assert ENV_FIX == str(info.value).splitlines()[-1]
    (listed,) = [
        line for line in str(info.value).splitlines() if line.startswith("available here: ")
    ]
    for shown in listed.removeprefix("available here: ").split(", "):
        monkeypatch.setenv("DEVICECTX_DEVICE", shown)
        assert torch.device(shown) == resolve_device()


@pytest.mark.requires_device("accelerator")
@pytest.mark.parametrize("local_rank", [None, "0", "3"])
def test_a_bare_index_in_the_env_var_is_the_accelerator_at_that_index(
    monkeypatch: pytest.MonkeyPatch, local_rank: str | None
) -> None:
    """DEVICECTX_DEVICE=1 is the accelerator's device 1, as resolve_device(1) is; like
    any value of the variable, it names one device whatever LOCAL_RANK says."""
    monkeypatch.setenv("DEVICECTX_DEVICE", "1")
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    if torch.accelerator.device_count() < 2:
        pytest.skip("needs two devices of the accelerator")
    assert resolve_device(1) == resolve_device()
    kind = resolve_device(1).type
    expected = f"{kind}:1: environment variable DEVICECTX_DEVICE='1', index 1 of the accelerator"
    assert expected == explain_device()


def test_a_bare_index_in_the_env_var_without_an_accelerator_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without an accelerator, DEVICECTX_DEVICE=0 is refused as resolve_device(0) is: an
    index names an accelerator's device."""
    if HAS_ACCELERATOR:
        pytest.skip("this machine has an accelerator")
    monkeypatch.setenv("DEVICECTX_DEVICE", "0")
    with pytest.raises(DeviceUnavailableError) as info:
        resolve_device()
    assert [
        "environment variable DEVICECTX_DEVICE='0' is not a usable device:",
        "device 0 is not available: index 0 names an accelerator, and none was found",
        f"available here: {HERE}",
        ENV_FIX,
    ] == str(info.value).splitlines()


def test_unavailable_env_var_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DEVICECTX_DEVICE this machine lacks raises DeviceUnavailableError naming it."""
    monkeypatch.setenv("DEVICECTX_DEVICE", "cuda:7")
    with pytest.raises(DeviceUnavailableError) as info:
        resolve_device()
    lines = str(info.value).splitlines()
    assert "environment variable DEVICECTX_DEVICE='cuda:7' is not a usable device:" == lines[0]
    assert lines[1].startswith("device 'cuda:7' is not available: ")
    assert f"available here: {HERE}" == lines[2]
    assert [ENV_FIX] == lines[3:]


def test_local_rank_without_accelerator_is_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun with no accelerator, every rank gets the CPU, and says why."""
    if HAS_ACCELERATOR:
        pytest.skip("this machine has an accelerator")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert CPU == resolve_device()
    expected = "cpu: LOCAL_RANK=3 (torchrun) but no accelerator found, so the CPU"
    assert expected == explain_device()


@pytest.mark.skipif(not HAS_ACCELERATOR, reason="needs an accelerator")
@given(rank=st.integers(0, 64))
def test_local_rank_picks_rank_modulo_count(rank: int) -> None:
    """Under torchrun, auto is the accelerator at LOCAL_RANK % device_count."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("DEVICECTX_DEVICE", raising=False)
        patch.setenv("LOCAL_RANK", str(rank))
        device = resolve_device()
    assert rank % torch.accelerator.device_count() == device.index


def test_env_var_beats_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """DEVICECTX_DEVICE is consulted before LOCAL_RANK."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("DEVICECTX_DEVICE", "meta")
    assert META == resolve_device()


@pytest.mark.parametrize("value", ["x", "-1", "1.5"])
def test_bad_local_rank(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """A LOCAL_RANK that is not a rank raises an error naming it."""
    monkeypatch.setenv("LOCAL_RANK", value)
    with pytest.raises(InvalidDeviceError) as info:
        resolve_device()
    expected = (
        f"environment variable LOCAL_RANK={value!r} is not a rank: torchrun sets it to "
        "0, 1, 2, ...\nfix: unset LOCAL_RANK, or set DEVICECTX_DEVICE to the device to use"
    )
    assert expected == str(info.value)


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_local_rank_is_unset(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """LOCAL_RANK set to nothing (an env file's LOCAL_RANK=) counts as unset, as
    DEVICECTX_DEVICE and the device report's job line count it."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    unset = explain_device()
    monkeypatch.setenv("LOCAL_RANK", value)
    assert unset == explain_device()
    assert "LOCAL_RANK" not in explain_device()


def test_resolve_never_sets_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolution reads the environment and leaves it exactly as it was."""
    import os

    monkeypatch.setenv("LOCAL_RANK", "0")
    before = dict(os.environ)
    resolve_device()
    explain_device()
    assert before == dict(os.environ)


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("gpu", f"unknown device type 'gpu', {GPU_HINT}"),
        ("GPU", f"unknown device type 'GPU', {GPU_HINT}"),
        ("AUTO", "unknown device type 'AUTO', did you mean 'auto'?"),
        (" Auto ", "unknown device type 'Auto', did you mean 'auto'?"),
        (
            "tpu",
            "unknown device type 'tpu', did you mean 'xla' (TPUs are XLA devices, with "
            "torch_xla installed)?",
        ),
        ("cuda0", "unknown device type 'cuda0', did you mean 'cuda:0'?"),
        ("CUDA1", "unknown device type 'CUDA1', did you mean 'cuda:1'?"),
        ("cuda 1", "unknown device type 'cuda 1', did you mean 'cuda:1'?"),
        ("Cuda:0", "unknown device type 'Cuda', did you mean 'cuda:0'?"),
        (
            "npu:0",
            "unknown device type 'npu' (the Huawei Ascend package torch_npu adds it to "
            "torch: `import torch_npu` before naming the device)",
        ),
        ("cdua", "unknown device type 'cdua', did you mean 'cuda'?"),
        ("cdua:1", "unknown device type 'cdua', did you mean 'cuda:1'?"),
        ("mpss", "unknown device type 'mpss', did you mean 'mps'?"),
        ("meat", "unknown device type 'meat', did you mean 'meta'?"),
        ("auot", "unknown device type 'auot', did you mean 'auto'?"),
        ("foo", "unknown device type 'foo'"),
        ("cuda:-1", "the index after ':' must be a whole number >= 0"),
        ("cuda:x", "the index after ':' must be a whole number >= 0"),
        ("", "an empty string"),
        (3.5, "a float is not a device"),
        (True, "a bool is not a device"),
        ([0], "a list is not a device"),
        (-1, "an index cannot be negative"),
    ],
)
def test_malformed_specs(spec: object, problem: str) -> None:
    """A malformed spec raises InvalidDeviceError (a ValueError) listing the valid forms."""
    with pytest.raises(InvalidDeviceError) as info:
        resolve_device(spec)  # type: ignore[arg-type]
    assert f"invalid device {spec!r}: {problem}\n{VALID_FORMS}\n{FIX_INVALID}" == str(info.value)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, DeviceError)


@pytest.mark.skipif(HAS_ACCELERATOR, reason="checks a CPU-only machine")
@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("cuda", f"this torch build ({torch.__version__}) has no usable 'cuda' device"),
        ("cuda:3", f"this torch build ({torch.__version__}) has no usable 'cuda' device"),
        ("mps", f"this torch build ({torch.__version__}) has no usable 'mps' device"),
        ("xpu:0", f"this torch build ({torch.__version__}) has no usable 'xpu' device"),
        ("hpu", f"this torch build ({torch.__version__}) has no usable 'hpu' device"),
        ("cpu:1", "there is one CPU device, 'cpu'"),
        (0, "index 0 names an accelerator, and none was found"),
    ],
)
def test_unavailable_devices(spec: object, problem: str) -> None:
    """A device this machine lacks raises DeviceUnavailableError saying what is available."""
    with pytest.raises(DeviceUnavailableError) as info:
        resolve_device(spec)  # type: ignore[arg-type]
    shown = repr(spec)
    expected = (
        f"device {shown} is not available: {problem}\n"
        f"available here: {HERE}\n"
        'fix: pass one of those, or "auto", which picks the accelerator here, else the CPU '
        "(DEVICECTX_DEVICE overrides it)"
    )
    assert expected == str(info.value)
    assert isinstance(info.value, RuntimeError)


def test_unavailable_torch_device_is_shown_as_a_string() -> None:
    """A torch.device in an error is shown the way the user would type it."""
    if HAS_ACCELERATOR:
        pytest.skip("checks a CPU-only machine")
    with pytest.raises(DeviceUnavailableError, match=r"^device 'cuda:1' is not available"):
        resolve_device(torch.device("cuda", 1))


@pytest.mark.skipif(not HAS_ACCELERATOR, reason="needs an accelerator")
def test_type_without_index_gets_the_current_index() -> None:
    """``"cuda"`` resolves to ``cuda:<current>``, equal to a tensor's device there."""
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None
    device = resolve_device(accelerator.type)
    assert torch.accelerator.current_device_index() == device.index
    assert torch.empty(0, device=accelerator.type).device == device
    assert device == resolve_device(0 if device.index == 0 else device.index)


def test_available_devices_lists_cpu_first() -> None:
    """available_devices starts with the CPU and lists every accelerator index."""
    devices = available_devices()
    assert CPU == devices[0]
    # (A CUDA build on a machine with no driver raises when asked for its device count.)
    assert (torch.accelerator.device_count() if HAS_ACCELERATOR else 0) == len(devices) - 1


def test_explain_explicit_spec() -> None:
    """explain_device on an explicit spec says it was asked for."""
    assert "meta: asked for 'meta'" == explain_device("meta")


# --- under torch.compile -----------------------------------------------------------------


def test_compiled_code_asks_the_driver_outside_its_graph() -> None:
    """Code that resolves devices compiles with ``fullgraph=True``, and its graph calls nothing
    of ``torch.accelerator`` or ``torch.cuda``: dynamo asked the driver while tracing."""
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward  # type: ignore[no-any-return]

    def resolving(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        here = resolve_device("auto")
        with on_device("auto"):
            made = torch.zeros(1)
        return x.to(here) + len(available_devices()), made

    expected = resolving(torch.ones(1))
    torch._dynamo.reset()
    try:
        got = torch.compile(resolving, backend=keep, fullgraph=True)(torch.ones(1))
    finally:
        torch._dynamo.reset()
    assert [(t.device, t.tolist()) for t in expected] == [(t.device, t.tolist()) for t in got]
    called = [
        node.target
        for gm in graphs
        for node in gm.graph.nodes
        if node.op in ("call_function", "call_method")
    ]
    driver = ("torch.accelerator", "torch.cuda", "torch._C._cuda", "torch._C._accelerator")
    assert [] == [t for t in called if str(getattr(t, "__module__", "")).startswith(driver)]


def _asks_the_driver(node: ast.AST) -> bool:
    """Whether this code reads ``torch.accelerator``/``torch.cuda`` or ``getattr(torch, ...)``."""
    for inner in ast.walk(node):
        if (
            isinstance(inner, ast.Attribute)
            and isinstance(inner.value, ast.Name)
            and inner.value.id == "torch"
            and inner.attr in ("accelerator", "cuda", "mps", "xpu")
        ):
            return True
        if (
            isinstance(inner, ast.Call)
            and isinstance(inner.func, ast.Name)
            and inner.func.id == "getattr"
            and isinstance(inner.args[0], ast.Name)
            and inner.args[0].id == "torch"
        ):
            return True
    return False


def test_every_driver_query_is_a_trace_time_constant() -> None:
    """Each function of the resolver that asks the driver is one dynamo calls once while
    tracing and keeps the answer of (``assume_constant_result``), not one it traces."""
    tree = ast.parse(inspect.getsource(_resolve))
    asking = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and _asks_the_driver(node)
    ]
    expected = [
        "_device_count",
        "_current_index",
        "_accelerator_count",
        "_accelerator_index",
        "accelerator_type",
        "autocast_dtypes",
        "device_name",
    ]
    assert expected == asking
    for name in asking:
        assert getattr(getattr(_resolve, name), "_dynamo_marked_constant", False), name


@pytest.mark.requires_device("cuda")
def test_cuda_resolves_inside_fullgraph() -> None:
    """``on_device("cuda:0")``, ``on_device("cuda")`` and ``resolve_device("cuda")`` compile
    with ``fullgraph=True`` on a GPU, and agree with eager code."""

    def resolving(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with on_device("cuda:0"):
            first = torch.zeros(1)
        with on_device("cuda"):
            current = torch.zeros(1)
        return first, current, x.to(resolve_device("cuda"))

    expected = [t.device for t in resolving(torch.ones(1))]
    torch._dynamo.reset()
    try:
        compiled = torch.compile(resolving, backend="eager", fullgraph=True)
        assert expected == [t.device for t in compiled(torch.ones(1))]
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("spec", ["gpu", "GPU", "gpu:0", "gpu:99", "AUTO"])
def test_the_first_suggestion_for_a_misnamed_device_works_here(spec: str) -> None:
    """The first device a did-you-mean names resolves on this machine (the accelerator it
    has, else the CPU), where 'cuda' fails on a machine without CUDA."""
    with pytest.raises(InvalidDeviceError) as info:
        resolve_device(spec)
    suggested = str(info.value).split("did you mean ", 1)[1].split("'")[1]
    assert resolve_device(suggested) in available_devices()


def test_an_index_as_text_suggests_that_device() -> None:
    """'1' (what argparse gives for --device 1) is refused as torch refuses it, with the
    device at that index of this machine's accelerator as the fix, which works."""
    with pytest.raises(InvalidDeviceError) as info:
        resolve_device("1")
    problem = str(info.value).splitlines()[0]
    count = torch.accelerator.device_count() if ACCELERATOR is not None else 0
    if ACCELERATOR is None:
        expected = (
            "invalid device '1': an index as text, and an index names an accelerator's device: "
            "there is none here, did you mean 'cpu'?"
        )
    elif count > 1:
        expected = (
            f"invalid device '1': an index as text, did you mean '{ACCELERATOR}:1' (or the "
            "int 1: index 1 of this machine's accelerator)?"
        )
    else:
        expected = (
            f"invalid device '1': an index as text, and this machine's accelerator has "
            f"{count} device(s), did you mean '{ACCELERATOR}:0'?"
        )
    assert expected == problem
    suggested = problem.split("did you mean ", 1)[1].split("'")[1]
    assert resolve_device(suggested) in available_devices()
