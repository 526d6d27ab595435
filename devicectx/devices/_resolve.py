"""Device resolution: how a spec (``"auto"``, ``"cuda:1"``, ``0``, ...) becomes a real device.

The rules, in the order ``"auto"`` tries them:

1. the environment variable ``DEVICECTX_DEVICE``, when set and not empty: a device
   (``"cuda:1"``), or a bare index of the accelerator (``"1"``, as ``resolve_device(1)``);
2. XLA, where ``torch_xla`` is installed and ``PJRT_DEVICE`` is set: torch_xla's default
   device for this process (:mod:`devicectx.devices._xla`);
3. under ``torchrun`` (``LOCAL_RANK`` set and not empty), the accelerator at
   ``LOCAL_RANK % device_count``;
4. the current accelerator (:mod:`torch.accelerator`) at its current index;
5. the CPU.

Every device that comes back carries an index where tensors allocated on it
do (``"cuda"`` becomes ``cuda:0``), so it compares equal to ``tensor.device``.

Everything asked of the driver (is there an accelerator, how many devices, which is
current) is asked in a few small functions, :func:`accelerator_type` and those next to it.
Under ``torch.compile`` dynamo calls each once while tracing and keeps the answer as a
constant (it cannot trace them: they return no tensor), so ``on_device("cuda")`` and
``@device_agnostic(device="cuda")`` compile with ``fullgraph=True``; like ``"auto"``, the
answer is read at trace time, with no guard.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
from typing import TypeAlias

import torch

from devicectx._errors import DeviceError, DeviceUnavailableError, InvalidDeviceError
from devicectx._torch.backends import privateuse1_name
from devicectx._torch.dynamo import constant
from devicectx.devices import _xla

DeviceLike: TypeAlias = torch.device | str | int | None
"""Anything :func:`resolve_device` accepts."""

ENV_VAR = "DEVICECTX_DEVICE"

_VALID_FORMS = (
    "valid forms: 'auto', 'cpu', 'cuda', 'cuda:1', 'mps', 'xpu', 'meta' (any device type torch "
    "knows, with an optional ':index'), an int index on the current accelerator, "
    "a torch.device, or None (same as 'auto')"
)
_CPU = torch.device("cpu")
_META = torch.device("meta")


def resolve_device(spec: DeviceLike = "auto") -> torch.device:
    """Turn a device spec into a ``torch.device`` that exists on this machine.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
        >>> resolve_device("meta")
        device(type='meta')

    Args:
        spec: a ``torch.device``; a string such as ``"cpu"``, ``"cuda:1"``, ``"mps"``;
            an int, the index of a device of the current accelerator; ``None`` or
            ``"auto"`` to pick the best device here (see :func:`explain_device`).

    Returns:
        The device. An accelerator device always has its index (``"cuda"`` -> ``cuda:0``).

    Raises:
        InvalidDeviceError: the spec is malformed (``"gpu"``, ``"cuda:-1"``, ``3.5``,
            ``True``), or ``DEVICECTX_DEVICE``/``LOCAL_RANK`` holds a malformed value.
        DeviceUnavailableError: the device is well formed but this machine lacks it.

    A spec that names one device for the life of the process (``"meta"``, ``"cpu"``,
    ``"cuda:1"``, a ``torch.device`` with its index) is resolved once, then looked up:
    ``on_device("meta")`` is entered at every call of a function, and a decorated call
    resolves its ``device=`` at every call.
    """
    __tracebackhide__ = True  # errors point at the caller's line
    device = _known(spec)
    return _resolve(spec)[0] if device is None else device


def explain_device(spec: DeviceLike = "auto") -> str:
    """Say in words which device ``spec`` resolves to here, and why.

    Example:
        >>> explain_device("meta")
        "meta: asked for 'meta'"

    Raises:
        The same errors as :func:`resolve_device`.
    """
    device, why = _resolve(spec)
    return f"{device}: {why}"


def available_devices() -> list[torch.device]:
    """The CPU, every index of this machine's accelerator, then the XLA devices, in order.

    XLA devices are listed where XLA is in use (``torch_xla`` installed and ``PJRT_DEVICE``
    set, the rule of ``"auto"``). ``meta`` is not listed, although it is always usable: it
    holds no data.

    Example:
        >>> available_devices()[0]
        device(type='cpu')
    """
    accelerator = accelerator_type()
    xla = _xla.devices() if _xla.in_use() else []
    if accelerator is None:
        return [_CPU, *xla]
    count = _accelerator_count()
    return [_CPU, *(torch.device(accelerator, i) for i in range(count)), *xla]


_FIXED: dict[object, torch.device | None] = {}
"""Specs looked at by :func:`_known`: the device of one that names a device for good, None
for one that does not (``"auto"``, ``"cuda"``, an int, a malformed spec)."""
_FIXED_MAX = 64  # a bound, for code that makes a new spec string at every call
_UNSEEN = object()


@constant  # dynamo calls it once while tracing and keeps the answer
def _known(spec: object) -> torch.device | None:
    """The device of a spec that names one device for good (resolved at its first look,
    where that succeeds), or None: resolve the spec the long way."""
    try:
        known = _FIXED.get(spec, _UNSEEN)
    except TypeError:  # unhashable: not a device spec, which the long way says
        return None
    if known is not _UNSEEN:
        return known  # type: ignore[return-value]
    if len(_FIXED) >= _FIXED_MAX:
        return None
    device = None
    if type(spec) is torch.device or (type(spec) is str and spec.strip() != "auto"):
        try:
            named = _parse(spec)
            device = _explicit(spec)
        except DeviceUnavailableError:
            return None  # not kept: a backend registered later may provide it
        except InvalidDeviceError:
            device = None
        if device is not None and device != named:
            device = None  # "cuda", "cpu:0": the index (or its absence) is worked out
    _FIXED[spec] = device
    return device


_WELL_FORMED: set[object] = set()
"""Specs :func:`check_form` passed, so that a block made in a loop parses its spec once."""


def check_form(spec: object) -> None:
    """Raise :class:`InvalidDeviceError` where ``spec`` is malformed: a typo refused where
    the code names the device, not where it first runs. Whether the device is on this
    machine is left to :func:`resolve_device` at use (it may be on another machine).

    Example:
        >>> check_form("cuda:7")  # well formed, wherever it exists
        >>> check_form("cdua")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        devicectx.InvalidDeviceError: invalid device 'cdua': ..., did you mean 'cuda'?
        ...
    """
    __tracebackhide__ = True  # errors point at the caller's line
    if spec is None or type(spec) is torch.device:
        return
    hashable = type(spec) in (str, int)
    if hashable and spec in _WELL_FORMED:
        return
    if not (isinstance(spec, str) and spec.strip() == "auto"):
        # An index with no accelerator here is left to resolve_device, at use.
        with contextlib.suppress(DeviceUnavailableError):
            _parse(spec)
    if hashable and len(_WELL_FORMED) < _FIXED_MAX:
        _WELL_FORMED.add(spec)


def _resolve(spec: object) -> tuple[torch.device, str]:
    """Resolve ``spec``, and say why in words."""
    __tracebackhide__ = True  # errors point at the caller's line
    if spec is None or (isinstance(spec, str) and spec.strip() == "auto"):
        return _auto()
    return _explicit(spec), f"asked for {_show(spec)}"


def _auto() -> tuple[torch.device, str]:
    env_value = os.environ.get(ENV_VAR, "").strip()
    if env_value and env_value != "auto":
        # A bare index is an int spec, as resolve_device(1) takes it: text is all a
        # variable holds. It names one device for every process, as "cuda:1" does.
        index = _index_text(env_value)
        try:
            device = _explicit(env_value if index is None else index)
        except (InvalidDeviceError, DeviceUnavailableError) as error:
            raise type(error)(_env_message(env_value, error)) from None
        why = f"environment variable {ENV_VAR}={env_value!r}"
        if index is not None:
            why = f"{why}, index {index} of the accelerator"
        return device, why

    if _xla.in_use():
        return _auto_xla()

    accelerator = accelerator_type()
    # Empty counts as unset, as for DEVICECTX_DEVICE and in the device report's job line.
    local_rank = os.environ.get("LOCAL_RANK", "").strip()
    if local_rank:
        rank = _parse_local_rank(local_rank)
        if accelerator is None:
            return _CPU, f"LOCAL_RANK={rank} (torchrun) but no accelerator found, so the CPU"
        count = _accelerator_count()
        device = torch.device(accelerator, rank % count)
        return device, (
            f"LOCAL_RANK={rank} (torchrun) on {count} visible {accelerator} device(s): "
            f"index {rank} % {count} = {device.index}"
        )

    if accelerator is not None:
        index = _accelerator_index()
        return torch.device(accelerator, index), (
            f"accelerator {accelerator!r} found, at its current index {index}"
        )
    return _CPU, f"no accelerator found, so the CPU (set {ENV_VAR} to choose)"


_ENV_FORMS = (
    f"{ENV_VAR} takes: 'auto', a device type torch knows ('cpu', 'cuda', 'mps', 'xpu', "
    "'meta', ...) with an optional ':index' ('cuda:1'), or an index on the accelerator ('1')"
)


def _index_text(text: str) -> int | None:
    """The int a variable's text spells (``"1"``, ``"-1"``), else None."""
    digits = text.removeprefix("-")
    if digits.isascii() and digits.isdigit():
        return int(text)
    return None


def _env_message(value: str, error: DeviceError) -> str:
    """``error``'s facts, about ``DEVICECTX_DEVICE=value``: what the variable takes, in
    place of the forms a spec in code takes; the devices there are, which any fix names."""
    facts = [
        line
        for line in str(error).splitlines()
        if not line.startswith(("fix:", "valid forms:"))  # the fix is said once, here
    ]
    if isinstance(error, InvalidDeviceError):
        facts.append(_ENV_FORMS)
    if not any(line.startswith("available here:") for line in facts):
        facts.append(f"available here: {_here()}")
    return "\n".join(
        [
            f"environment variable {ENV_VAR}={value!r} is not a usable device:",
            *facts,
            # "available here" is always among the lines above: the devices the fix means.
            f"fix: set {ENV_VAR} to one of the devices above (cpu always works), or unset it",
        ]
    )


def _auto_xla() -> tuple[torch.device, str]:
    """XLA's default device, where ``PJRT_DEVICE`` asks for XLA and torch_xla is installed."""
    setting = f"{_xla.ENV_VAR}={_xla.pjrt_device()!r}"
    problem = _xla.problem() or ("torch_xla finds no device" if _xla.count() == 0 else None)
    if problem is not None:
        msg = (
            f"environment variable {setting} asks for an XLA device, and {problem}\n"
            f"fix: {_xla.FIX_INSTALL}, or unset {_xla.ENV_VAR} to use torch's own devices"
        )
        raise DeviceUnavailableError(msg)
    device = _xla.default_device()
    return device, f"environment variable {setting}: torch_xla's default device"


def _parse_local_rank(value: str) -> int:
    try:
        rank = int(value)
    except ValueError:
        rank = -1
    if rank < 0:
        msg = (
            f"environment variable LOCAL_RANK={value!r} is not a rank: torchrun sets it to "
            f"0, 1, 2, ...\nfix: unset LOCAL_RANK, or set {ENV_VAR} to the device to use"
        )
        raise InvalidDeviceError(msg)
    return rank


def _explicit(spec: object) -> torch.device:
    """Resolve anything but ``"auto"``: parse, then check the device exists."""
    __tracebackhide__ = True  # errors point at the caller's line
    device = _parse(spec)
    if device.type == "cpu":
        if device.index not in (None, 0):
            raise _unavailable(spec, "there is one CPU device, 'cpu'")
        return _CPU
    if device.type == "meta":
        return _META
    return _check_accelerator(spec, device)


def _parse(spec: object) -> torch.device:
    if isinstance(spec, torch.device):
        return spec
    if isinstance(spec, bool) or not isinstance(spec, (str, int)):
        kind = type(spec).__name__
        raise _invalid(spec, f"a {kind} is not a device")
    if isinstance(spec, int):
        if spec < 0:
            raise _invalid(spec, "an index cannot be negative")
        accelerator = accelerator_type()
        if accelerator is None:
            raise _unavailable(spec, f"index {spec} names an accelerator, and none was found")
        return torch.device(accelerator, spec)
    text = spec.strip()
    try:
        return torch.device(text)
    except RuntimeError:
        kind = text.partition(":")[0]
        problem = "an empty string" if not text else f"unknown device type {kind!r}"
        if text and _is_known_type(kind):
            problem = "the index after ':' must be a whole number >= 0"
        elif text.isascii() and text.isdigit():
            problem = f"an index as text{_index_hint(int(text))}"
        elif text:
            problem += _hint(text, kind)
        raise _invalid(spec, problem) from None


# Device types that exist only once their package is imported (each renames torch's
# PrivateUse1 backend), and the words people use for a kind of device torch names otherwise.
_PACKAGED = {
    "npu": ("torch_npu", "Huawei Ascend"),
    "mlu": ("torch_mlu", "Cambricon"),
    "musa": ("torch_musa", "Moore Threads"),
    "gcu": ("torch_gcu", "Enflame"),
}
_OTHER_NAMES = {
    "tpu": "'xla' (TPUs are XLA devices, with torch_xla installed)",
}
_COMMON_TYPES = ("cpu", "cuda", "mps", "xpu", "meta", "xla", "hpu", "mtia")
_GLUED = re.compile(r"^([A-Za-z_]+)\s*(\d+)$")  # cuda0, emu 1: an index without its colon


def _hint(text: str, kind: str) -> str:
    """What an unknown device type most likely meant, as the end of the message."""
    lower = text.lower()
    glued = _GLUED.match(lower)
    if glued is not None and _is_known_type(glued.group(1)):
        return f", did you mean '{glued.group(1)}:{glued.group(2)}'?"
    if kind != kind.lower() and _is_known_type(kind.lower()):  # torch's types are lower case
        return f", did you mean {lower!r}?"
    named = kind.lower()
    if named == "auto":
        return ", did you mean 'auto'?"
    if named == "gpu":
        return _gpu_hint(text.partition(":")[2])
    if named in _PACKAGED:
        package, maker = _PACKAGED[named]
        return (
            f" (the {maker} package {package} adds it to torch: `import {package}` before "
            "naming the device)"
        )
    if named in _OTHER_NAMES:
        return f", did you mean {_OTHER_NAMES[named]}?"
    # A misspelt type ('cdua', 'mpss'): the nearest of the types people name, the index kept.
    types = [*_COMMON_TYPES, privateuse1_name(), "auto"]
    close = difflib.get_close_matches(named, types, n=1, cutoff=0.6)
    if close:
        index = text.partition(":")[2]
        return f", did you mean {close[0] + (':' + index if index else '')!r}?"
    return ""


def _gpu_hint(index: str) -> str:
    """What "gpu" (with ``index`` after its colon, or none) means here: the accelerator this
    machine has, else the CPU; a name that works here first, not 'cuda' everywhere."""
    accelerator = accelerator_type()
    if accelerator is None:
        return (
            ", did you mean 'cpu' (no accelerator here; a GPU is 'cuda' on NVIDIA and AMD, "
            "'mps' on Apple, 'xpu' on Intel) or 'auto'?"
        )
    # An index past this machine's devices is left out: the fix should resolve here.
    usable = index.isascii() and index.isdigit() and int(index) < _accelerator_count()
    named = f"{accelerator}:{int(index)}" if usable else accelerator
    return f", did you mean {named!r} (this machine's accelerator) or 'auto'?"


def _index_hint(index: int) -> str:
    """What ``"1"`` (an index as text, as argparse and YAML give it) means here: the device
    at that index of this machine's accelerator, where there is one."""
    accelerator = accelerator_type()
    if accelerator is None:
        return (
            ", and an index names an accelerator's device: there is none here, did you mean 'cpu'?"
        )
    count = _accelerator_count()
    if index >= count:
        return (
            f", and this machine's accelerator has {count} device(s), did you mean "
            f"'{accelerator}:0'?"
        )
    return (
        f", did you mean '{accelerator}:{index}' (or the int {index}: index {index} of this "
        "machine's accelerator)?"
    )


def _is_known_type(kind: str) -> bool:
    try:
        torch.device(kind)
    except RuntimeError:
        return False
    return True


def _check_accelerator(spec: object, device: torch.device) -> torch.device:
    count = _device_count(device.type)
    if count == 0 and device.type == "xla":  # XLA: the torch_xla package's devices
        problem = _xla.problem() or "torch_xla finds no device"
        raise _unavailable(spec, problem, f"{_xla.FIX_INSTALL}, or pass one of those")
    if count == 0:
        build = f"this torch build ({torch.__version__})"
        raise _unavailable(spec, f"{build} has no usable {device.type!r} device")
    if device.index is None:
        return torch.device(device.type, _current_index(device.type))
    if device.index >= count:
        raise _unavailable(spec, f"there are {count} {device.type!r} device(s), 0 to {count - 1}")
    return device


@constant
def _device_count(device_type: str) -> int:
    """How many devices of this type torch can use here; 0 when none or unknown."""
    if device_type == accelerator_type():
        return _accelerator_count()
    if device_type == "xla":
        return _xla.count()
    backend = getattr(torch, device_type, None)
    is_available = getattr(backend, "is_available", None)
    device_count = getattr(backend, "device_count", None)
    if not callable(is_available) or not callable(device_count):
        return 0
    try:
        return int(device_count()) if is_available() else 0
    except RuntimeError:  # a backend that is compiled in but broken (no driver)
        return 0


@constant
def _current_index(device_type: str) -> int:
    """The current index of this device type (what ``"cuda"`` means)."""
    if device_type == accelerator_type():
        return _accelerator_index()
    if device_type == "xla":
        return _xla.default_device().index or 0
    backend = getattr(torch, device_type, None)
    current = getattr(backend, "current_device", None)
    return int(current()) if callable(current) else 0


@constant
def _accelerator_count() -> int:
    """How many devices the accelerator has (there is one: see :func:`accelerator_type`)."""
    return torch.accelerator.device_count()


@constant
def _accelerator_index() -> int:
    """The accelerator's current index (there is one: see :func:`accelerator_type`)."""
    return torch.accelerator.current_device_index()


@constant
def accelerator_type() -> str | None:
    """The type of this machine's accelerator (``"cuda"``, ``"mps"``, ...), or None."""
    # is_available() first: torch 2.6's current_accelerator() raises when there is none.
    if not torch.accelerator.is_available():
        return None
    accelerator = torch.accelerator.current_accelerator()
    return None if accelerator is None else accelerator.type


@constant
def autocast_dtypes(device_type: str, index: int | None = None) -> tuple[torch.dtype, ...]:
    """The dtypes ``torch.autocast`` computes in on this device, bfloat16 first; () for none.

    A dtype that torch accepts but emulates (bfloat16 on a CUDA GPU before Ampere) or turns
    off with a warning (bfloat16 on MPS before macOS 14, in torch 2.6) is left out. Read in
    ``torch/amp/autocast_mode.py`` of torch 2.6, 2.13 and 2.15: every device type with
    autocast takes both dtypes, except those cases and a ``privateuseone`` backend, which
    lists its own.
    """
    half, brain = torch.float16, torch.bfloat16
    if device_type == "meta" or not torch.amp.is_autocast_available(device_type):
        return ()
    if device_type == "cuda":
        # is_bf16_supported asks about the current device: make it the one asked about.
        with torch.cuda.device(index):
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        return (brain, half) if native else (half,)
    if device_type == "mps":
        return (brain, half) if torch.backends.mps.is_macos_or_newer(14, 0) else (half,)
    if device_type == "xpu":
        try:
            native = torch.xpu.is_bf16_supported(including_emulation=False)
        except TypeError:  # torch < 2.8 takes no argument (and answers True)
            native = torch.xpu.is_bf16_supported()
        return (brain, half) if native else (half,)
    # The renamed privateuseone backend (torch.utils.rename_privateuse1_backend), which
    # autocast asks for its dtypes.
    if device_type == privateuse1_name():
        listed = getattr(getattr(torch, device_type, None), "get_amp_supported_dtype", None)
        supported = listed() if callable(listed) else []
        return tuple(dtype for dtype in (brain, half) if dtype in supported)
    return (brain, half)


@constant
def device_name(device_type: str, index: int | None = None) -> str:
    """The hardware behind a device, for messages: ``"Tesla T4, compute capability 7.5"``.

    Empty where torch has no name for it (the CPU, meta, most device types).
    """
    if device_type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(index)
        return f"{torch.cuda.get_device_name(index)}, compute capability {major}.{minor}"
    if device_type == "xpu" and torch.xpu.is_available():
        return str(torch.xpu.get_device_name(index))
    return ""


# Not "set DEVICECTX_DEVICE=cpu": the variable is read by "auto" only, never for a named device.
_FIX_UNAVAILABLE = (
    f'pass one of those, or "auto", which picks the accelerator here, else the CPU '
    f"({ENV_VAR} overrides it)"
)


def _here() -> str:
    """The devices of this machine, ``meta`` included, as a message lists them."""
    return ", ".join(str(d) for d in [*available_devices(), _META])


def _invalid(spec: object, problem: str) -> InvalidDeviceError:
    """A malformed spec's error: what is wrong, the forms a spec takes, and the devices of
    this machine to name instead (the problem says which one was most likely meant)."""
    msg = (
        f"invalid device {spec!r}: {problem}\n{_VALID_FORMS}\n"
        f'fix: pass a device this machine has ({_here()}), or "auto", which picks its '
        "accelerator, else the CPU"
    )
    return InvalidDeviceError(msg)


def _unavailable(spec: object, problem: str, fix: str | None = None) -> DeviceUnavailableError:
    msg = (
        f"device {_show(spec)} is not available: {problem}\n"
        f"available here: {_here()}\n"
        f"fix: {fix or _FIX_UNAVAILABLE}"
    )
    return DeviceUnavailableError(msg)


def _show(spec: object) -> str:
    return repr(str(spec)) if isinstance(spec, torch.device) else repr(spec)


def with_index(device: torch.device) -> torch.device:
    """``device`` with its index filled in where tensors carry one (``cuda`` -> ``cuda:0``)."""
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    return torch.device(device.type, _current_index(device.type))
