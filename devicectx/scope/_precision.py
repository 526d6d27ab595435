"""Mixed precision on any device: what a precision name means on a device, and why.

Scripts write ``torch.autocast("cuda", dtype=torch.float16)``, which fails or does nothing
on a CPU, MPS or XPU machine. Here a precision is named as Lightning names it, and turned
into the ``torch.autocast`` of the device at hand:

- ``"bf16-mixed"``: autocast to bfloat16 (float32's range: no loss scaling needed);
- ``"16-mixed"``: autocast to float16 (scale the loss with ``torch.amp.GradScaler``);
- ``"32"``, or Lightning's ``"32-true"``: full precision, autocast off;
- ``"auto"``: ``"bf16-mixed"`` where the device computes in bfloat16, else ``"16-mixed"``
  where its autocast has float16, else ``"32"``; the CPU stays in ``"32"``
  (:func:`choose_precision` says why).

The decision is :func:`_decide`, a pure function of the device and the dtypes its autocast
computes in; those facts come from :func:`devicectx.devices._resolve.autocast_dtypes`, the one place
that asks the driver (a trace-time constant under ``torch.compile``).
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal, NoReturn, TypeAlias

import torch

from devicectx._errors import DeviceError, InvalidPrecisionError, PrecisionUnsupportedError
from devicectx._torch.dynamo import constant, graph_break, tracing
from devicectx.devices._capabilities import CAPABILITIES
from devicectx.devices._resolve import DeviceLike, autocast_dtypes, device_name, resolve_device

PrecisionName: TypeAlias = Literal["auto", "bf16-mixed", "16-mixed", "32", "32-true"]
"""Every name :func:`choose_precision` accepts."""

_DTYPES: dict[str, torch.dtype | None] = {
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
    "32": None,
}
_ALIASES = {"32-true": "32"}
_VALID_NAMES = "'auto', 'bf16-mixed', '16-mixed', '32' (or '32-true')"
_AUTO_FIX = 'precision="auto" to pick what each device supports'
# Lightning's other names, and the usual spellings of dtypes: what to write instead.
_HINTS: dict[object, str] = {
    "16": 'precision="16-mixed" (Lightning reads "16" so; devicectx wants it spelled out)',
    "bf16": 'precision="bf16-mixed" (Lightning reads "bf16" so; devicectx wants it spelled out)',
    "fp16": 'precision="16-mixed"',
    "float16": 'precision="16-mixed"',
    "bfloat16": 'precision="bf16-mixed"',
    "fp32": 'precision="32"',
    "float32": 'precision="32"',
    16: 'precision="16-mixed"',
    32: 'precision="32"',
    torch.float16: 'precision="16-mixed"',
    torch.bfloat16: 'precision="bf16-mixed"',
    torch.float32: 'precision="32"',
    "16-true": (
        'precision="16-mixed", or cast the model yourself: model.to(torch.float16) '
        "(devicectx runs autocast only)"
    ),
    "bf16-true": (
        'precision="bf16-mixed", or cast the model yourself: model.to(torch.bfloat16) '
        "(devicectx runs autocast only)"
    ),
    "64-true": 'model.to(torch.float64) and precision="32" (devicectx runs autocast only)',
    "64": 'model.to(torch.float64) and precision="32" (devicectx runs autocast only)',
}


@dataclass(frozen=True)
class Precision:
    """The precision a block runs in on one kind of device, and why it was chosen.

    Example:
        >>> precision = choose_precision("cpu", "bf16-mixed")
        >>> precision.name, precision.dtype, precision.device_type
        ('bf16-mixed', torch.bfloat16, 'cpu')
        >>> print(precision)
        bf16-mixed: asked for 'bf16-mixed' on cpu
        >>> with precision.autocast():
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.bfloat16

    Attributes:
        name: what runs: ``"bf16-mixed"``, ``"16-mixed"`` or ``"32"`` (never ``"auto"``,
            nor an alias).
        dtype: the autocast dtype, or None for full precision.
        device_type: the device type autocast is entered for (``"cuda"``, ``"cpu"``, ...).
        reason: why, in words; ``str(precision)`` is ``"{name}: {reason}"``.
    """

    name: Literal["bf16-mixed", "16-mixed", "32"]
    dtype: torch.dtype | None
    device_type: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name}: {self.reason}"

    @property
    def needs_grad_scaler(self) -> bool:
        """Whether to scale the loss (``torch.amp.GradScaler``): float16 only.

        float16's smallest normal number is about 6e-5, so small gradients underflow to
        zero on every device; bfloat16 has float32's range.

        Example:
            >>> choose_precision("cpu", "16-mixed").needs_grad_scaler
            True
            >>> choose_precision("cpu", "bf16-mixed").needs_grad_scaler
            False
        """
        return self.dtype == torch.float16

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context manager that runs a block in this precision.

        ``torch.autocast(device_type, dtype=dtype)`` for a mixed precision;
        ``torch.autocast(device_type, enabled=False)`` for ``"32"`` inside an outer
        autocast region, so a block that asks for full precision gets it there too; a
        context that does nothing elsewhere (no region to leave: entering one would cost
        more than most decorated calls), on ``meta`` and on device types without autocast.
        """
        if self.dtype is not None:
            return torch.autocast(self.device_type, dtype=self.dtype)
        kind = self.device_type
        if kind != "meta" and _has_autocast(kind) and _autocasting(kind):
            return torch.autocast(kind, enabled=False)
        return contextlib.nullcontext()


@constant  # dynamo cannot trace the C function: it calls this once, while tracing
def _has_autocast(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type)


def _autocasting(device_type: str) -> bool:
    """Whether an autocast region is on for ``device_type`` here; while dynamo traces,
    taken to be (the region is left, as before: no guard on torch's state to add)."""
    if torch.compiler.is_compiling():
        return True
    return bool(torch.is_autocast_enabled(device_type))


def choose_precision(device: DeviceLike, precision: PrecisionName) -> Precision:
    """Choose the autocast dtype that ``precision`` means on ``device``, and say why.

    Example:
        >>> print(choose_precision("cpu", "auto"))
        32: 'auto' on the CPU, where autocast is mostly slower (to use it: 'bf16-mixed')
        >>> print(choose_precision("meta", "bf16-mixed"))
        32: asked for 'bf16-mixed' on meta, which holds no data: no autocast

    Args:
        device: the device the block runs on; anything :func:`resolve_device` takes.
        precision: ``"bf16-mixed"``, ``"16-mixed"``, ``"32"`` (or ``"32-true"``), or
            ``"auto"``. ``"auto"`` picks ``"bf16-mixed"`` where the device computes in
            bfloat16 (a CUDA GPU from Ampere on, ROCm, MPS on macOS 14, XPU, HPU, XLA),
            else ``"16-mixed"`` where its autocast has float16 (a CUDA GPU before Ampere),
            else ``"32"``.

    Returns:
        The :class:`Precision`: its ``autocast()`` runs a block in it.

    Raises:
        InvalidPrecisionError: ``precision`` is not one of those names (a ``ValueError``).
        PrecisionUnsupportedError: the device cannot run it: float16 or bfloat16 where
            its autocast lacks that dtype, or bfloat16 on a CUDA GPU before Ampere, where
            torch would emulate it (a ``RuntimeError``).
        InvalidDeviceError, DeviceUnavailableError: as :func:`resolve_device`.

    Caveats:
        - ``"auto"`` keeps the CPU in float32. CPU autocast runs on any CPU, but is faster
          than float32 only on CPUs with bfloat16 instructions (AMX, AVX512-BF16), and even
          there mostly for large matrix products; most laptops and CI machines have none,
          and there bfloat16 autocast is many times slower (docs/performance.md has a
          measured step). Training on the CPU is rarely
          short of memory, and a float32 run there is the reference a GPU run is checked
          against, the same on every CPU. Ask for ``"bf16-mixed"`` (or ``"16-mixed"``) to
          autocast on the CPU anyway.
        - ``meta`` runs no autocast, whatever is asked (the name is still checked): its
          tensors hold no data, so shapes and dtypes are checked in float32.
        - bfloat16 on a CUDA GPU before Ampere is refused rather than emulated: it would be
          slower than float16 there. ``torch.autocast`` itself takes it, if you need it.
        - A dtype the device cannot hold (:func:`~devicectx.supports_dtype`) is never
          chosen, whatever its autocast lists.
    """
    target = resolve_device(device)
    return _decide(
        target,
        precision,
        _held_autocast_dtypes(target.type, target.index),
        describe=lambda: device_name(target.type, target.index),
    )


@constant
def _held_autocast_dtypes(device_type: str, index: int | None) -> tuple[torch.dtype, ...]:
    """The dtypes autocast computes in on the device that the device can hold."""
    listed = autocast_dtypes(device_type, index)
    if device_type == "meta" or not listed:
        return listed
    target = torch.device(device_type) if index is None else torch.device(device_type, index)
    return tuple(dtype for dtype in listed if CAPABILITIES.holds(target, dtype))


def precision_scope(
    device: DeviceLike, precision: PrecisionName
) -> contextlib.AbstractContextManager[Any]:
    """Run a block in ``precision`` on ``device``: ``choose_precision(...).autocast()``.

    Example:
        >>> with precision_scope("cpu", "bf16-mixed"):
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.bfloat16
        >>> with precision_scope("meta", "bf16-mixed"):  # checked, but no autocast on meta
        ...     (torch.ones(2, 2, device="meta") @ torch.ones(2, 2, device="meta")).dtype
        torch.float32

    Raises:
        The same errors as :func:`choose_precision`.

    Caveats:
        - Autocast is torch's per-thread state: threads started inside the block do not
          inherit it, and asyncio tasks that interleave on one thread share it.
        - Autocast belongs around the forward pass and the loss, not the backward pass
          (torch's advice): leave the block before ``loss.backward()``.
    """
    return choose_precision(device, precision).autocast()


def _decide(
    device: torch.device,
    precision: object,
    dtypes: Collection[torch.dtype],
    *,
    describe: Callable[[], str] = lambda: "",
) -> Precision:
    """The precision ``precision`` means on ``device``, whose autocast computes in ``dtypes``.

    Pure: the facts about the device are arguments, so every device type's decision is
    tested without its hardware. ``describe()`` names the hardware, for an error message.
    """
    name = check_precision_name(precision)
    kind = device.type
    if kind == "meta":
        return Precision(
            "32", None, kind, f"{_asked(precision, device)}, which holds no data: no autocast"
        )
    if name == "auto":
        return _auto(device, dtypes)
    if name == "32":
        return Precision("32", None, kind, _asked(precision, device))
    dtype = _DTYPES[name]
    if dtype not in dtypes:
        _raise(PrecisionUnsupportedError, _unsupported(device, name, dtypes, describe()))
    return Precision(
        "bf16-mixed" if name == "bf16-mixed" else "16-mixed", dtype, kind, _asked(name, device)
    )


def _auto(device: torch.device, dtypes: Collection[torch.dtype]) -> Precision:
    kind = device.type
    if kind == "cpu":
        # Why not bfloat16 here: the caveat in choose_precision's docstring.
        reason = "'auto' on the CPU, where autocast is mostly slower (to use it: 'bf16-mixed')"
        return Precision("32", None, kind, reason)
    if torch.bfloat16 in dtypes:
        return Precision(
            "bf16-mixed", torch.bfloat16, kind, f"'auto' on {device}, which computes in bfloat16"
        )
    if torch.float16 in dtypes:
        reason = (
            f"'auto' on {device}, which does not compute in bfloat16 "
            "(scale the loss with torch.amp.GradScaler)"
        )
        return Precision("16-mixed", torch.float16, kind, reason)
    return Precision("32", None, kind, f"'auto' on {device}, where torch.autocast does not run")


def check_precision_name(precision: object) -> str:
    """The name ``precision`` stands for (``"32-true"`` -> ``"32"``), or the error.

    For a check where the name is given (``@device_agnostic(precision=...)``), before any
    device is known.

    Example:
        >>> check_precision_name("32-true")
        '32'

    Raises:
        InvalidPrecisionError: not a name :func:`choose_precision` accepts.
    """
    if isinstance(precision, str) and (precision in _DTYPES or precision == "auto"):
        return precision
    if isinstance(precision, str) and precision in _ALIASES:
        return _ALIASES[precision]
    kind = type(precision).__name__
    article = "an" if kind[0] in "aeiou" else "a"
    problem = (
        "not a precision name"
        if isinstance(precision, str)
        else f"{article} {kind} is not a precision name"
    )
    hint: str | None
    if isinstance(precision, Precision):
        # Its name, not "auto": the precision it stands for, wherever a name is taken.
        hint = (
            f'precision="{precision.name}", its name (Precision.name); a block can also '
            "enter the Precision itself, with its .autocast()"
        )
    else:
        try:
            hint = _HINTS.get(precision)
        except TypeError:  # unhashable
            hint = None
        if hint is None and isinstance(precision, str):  # a misspelt name: "bf16_mixed"
            typed = precision.strip().lower().replace("_", "-")
            names = [*_DTYPES, *_ALIASES, "auto"]
            close = difflib.get_close_matches(typed, names, n=1, cutoff=0.6)
            hint = f'precision="{close[0]}"' if close else None
    fix = hint or 'one of those, such as precision="auto" (it picks what each device supports)'
    msg = f"invalid precision {precision!r}: {problem}\nvalid names: {_VALID_NAMES}\nfix: {fix}"
    _raise(InvalidPrecisionError, msg)


def _asked(precision: object, device: torch.device) -> str:
    return f"asked for {precision!r} on {device}"


def _raise(error: type[DeviceError], message: str) -> NoReturn:
    """Raise ``error``; in traced code, first a graph break that quotes the message.

    Under ``fullgraph=True`` dynamo reports a ``raise`` in traced code as its own
    ``Unsupported`` error, which does not say what went wrong; the graph break's error
    quotes the message (torch 2.7 on). Without ``fullgraph``, the code after the graph
    break runs eagerly and raises the real error.
    """
    __tracebackhide__ = True
    if tracing():
        graph_break(f"devicectx.{error.__name__}: {message}")
    raise error(message)


def _unsupported(
    device: torch.device, name: str, dtypes: Collection[torch.dtype], hardware: str
) -> str:
    dtype = _DTYPES[name]
    shown = f"{device} ({hardware})" if hardware else str(device)
    works = [mixed for mixed in ("bf16-mixed", "16-mixed") if _DTYPES[mixed] in dtypes]
    instead = f'precision="{works[0]}"' if works else 'precision="32"'
    return (
        f"precision {name!r} (autocast to {dtype}) is not supported on {shown}: "
        f"{_why_not(device.type, dtype, dtypes)}\n"
        f"works there: {', '.join(repr(n) for n in [*works, '32'])}\n"
        f"fix: {instead}, or {_AUTO_FIX}"
    )


def _why_not(kind: str, dtype: torch.dtype | None, dtypes: Collection[torch.dtype]) -> str:
    if not dtypes:
        return f"torch.autocast does not run on {kind!r} devices"
    if kind == "cuda" and dtype == torch.bfloat16:
        return (
            "bfloat16 needs compute capability 8.0 (Ampere) or newer; "
            "torch would emulate it, slower than float16"
        )
    if kind == "mps" and dtype == torch.bfloat16:
        return "bfloat16 autocast on MPS needs macOS 14 or newer"
    if kind == "xpu" and dtype == torch.bfloat16:
        return "this XPU has no bfloat16 arithmetic (torch.xpu.is_bf16_supported() is False)"
    return f"its autocast computes in {', '.join(str(d) for d in dtypes)} only"
