"""What a device can hold: :func:`supports_dtype` and :func:`device_capabilities`.

MPS (every Apple laptop) and several NPUs hold no float64, and MPS no complex128 either;
an op that would make one there raises (MPS: ``TypeError``). Where torch itself knows the
answer it is used (the CPU and ``meta`` hold every dtype; MPS none of float64 and
complex128); anywhere else the device is asked once per dtype with a one-element tensor,
and the answer is kept for the process (a device does not learn new dtypes). A refusal
names the dtype; an allocation that fails for another reason (a full device) is no answer:
the dtype counts as held, and is asked about again next time.

The answers live in one :class:`Capabilities` object, ``CAPABILITIES``: a test that
needs a fresh start calls its ``clear()``.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from devicectx._torch.dynamo import constant
from devicectx.devices._resolve import DeviceLike, accelerator_type, resolve_device

__all__ = [
    "ALWAYS_BLOCKING",
    "CAPABILITIES",
    "Capabilities",
    "DeviceCapabilities",
    "device_capabilities",
    "holds_every_dtype",
    "missing_dtypes",
    "nearest_dtype",
    "supports_dtype",
]

# The dtypes batches are made of: a device that holds all of these holds everything a
# dtype policy would ever change (quantized and sub-byte dtypes are left to their users).
ORDINARY: tuple[torch.dtype, ...] = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.complex128,
    torch.complex64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# Known without asking: MPS has neither (torch raises TypeError for each, on every macOS).
_KNOWN_MISSING = {"mps": frozenset({torch.float64, torch.complex128})}
# Known without asking: these hold every dtype (and, being no accelerator, pin nothing).
_HOLD_EVERY_DTYPE = frozenset({"cpu", "meta"})
# Where a dtype goes when the device cannot hold it: the dtypes that keep the most of it,
# best first (float32 holds every bfloat16 and float16 every float8 value exactly).
_NEAREST: dict[torch.dtype, tuple[torch.dtype, ...]] = {
    torch.float64: (torch.float32,),
    torch.complex128: (torch.complex64,),
    torch.bfloat16: (torch.float32,),
    torch.float8_e4m3fn: (torch.float16, torch.float32),
    torch.float8_e5m2: (torch.float16, torch.float32),
}
# The device types whose copies devicectx always makes blocking, ``non_blocking=True`` or
# not: the host reads a copy to the CPU as soon as it returns, a non-blocking copy to MPS
# can arrive after the tensor is read, and meta copies nothing. Read on every move's path
# (devicectx.move._alias), so a frozenset of type names, looked up once per move.
ALWAYS_BLOCKING = frozenset({"cpu", "mps", "meta"})


class DeviceCapabilities(NamedTuple):
    """What one device can hold and do, as :func:`device_capabilities` reports it.

    Attributes:
        device: the device described.
        float64: it holds ``torch.float64`` tensors.
        complex128: it holds ``torch.complex128`` tensors.
        complex64: it holds ``torch.complex64`` tensors.
        bfloat16: it holds ``torch.bfloat16`` tensors (holding is not computing fast:
            :func:`~devicectx.choose_precision` says which autocast runs).
        float8: it holds ``float8_e4m3fn`` and ``float8_e5m2`` tensors.
        pinned_memory: host memory can be pinned for copies to it.
        non_blocking: ``non_blocking=True`` copies to it are safe, by devicectx's rule
            (never to the CPU, ``meta`` or MPS).
        missing: every ordinary dtype it cannot hold.
    """

    device: torch.device
    float64: bool
    complex128: bool
    complex64: bool
    bfloat16: bool
    float8: bool
    pinned_memory: bool
    non_blocking: bool
    missing: frozenset[torch.dtype]


class Capabilities:
    """The answers for every device asked about, kept for the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[torch.device, torch.dtype], bool] = {}
        self._missing: dict[torch.device, frozenset[torch.dtype]] = {}
        self._pins: dict[str, bool] = {}
        self.derived: dict[object, object] = {}
        """What other parts work out from these answers and keep (the dtype policies of
        moves, per device): forgotten with them."""
        self.probes = 0
        """How many tensors were made to ask a device (tests check that it asks once)."""

    def holds(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether ``device`` (resolved) holds ``dtype``: from the cache, else found out."""
        key = (device, dtype)
        held = self._held.get(key)
        if held is None:
            with self._lock:
                held = self._held.get(key)
                if held is None:
                    found = self._find_out(device, dtype)
                    if found is None:  # no answer (the device was busy or full): ask again
                        return True
                    held = self._held[key] = found
        return held

    def missing(self, device: torch.device) -> frozenset[torch.dtype]:
        """The ordinary dtypes ``device`` cannot hold; empty for a device that holds them all."""
        missing = self._missing.get(device)
        if missing is None:
            # A loop, not a generator: torch 2.6's dynamo, active around a compiled call,
            # refuses a generator's frame run inside it.
            lacking = []
            for dtype in ORDINARY:
                if not self.holds(device, dtype):
                    lacking.append(dtype)
            missing = self._missing[device] = frozenset(lacking)
        return missing

    def pins(self, device_type: str) -> bool:
        """Whether host memory can be pinned for copies to devices of this type: torch
        pins for its current accelerator only."""
        pins = self._pins.get(device_type)
        if pins is None:
            pins = False
            if device_type not in _HOLD_EVERY_DTYPE and device_type == accelerator_type():
                try:
                    pins = torch.empty(1, dtype=torch.uint8, pin_memory=True).is_pinned()
                except Exception:  # no pinned allocator for it
                    pins = False
            self._pins[device_type] = pins
        return pins

    def tell(self, device: torch.device, dtype: torch.dtype, held: bool) -> None:
        """Record what ``device`` holds instead of asking it: for a backend whose answer
        changes at run time (the emulated accelerator's switches), or a test."""
        with self._lock:
            self._held[(device, dtype)] = held
            self._missing.pop(device, None)
            self.derived.clear()

    def clear(self) -> None:
        """Forget every answer (a test's fresh start; after switching a backend's dtypes)."""
        with self._lock:
            self._held.clear()
            self._missing.clear()
            self._pins.clear()
            self.derived.clear()
            self.probes = 0

    def _find_out(self, device: torch.device, dtype: torch.dtype) -> bool | None:
        """Whether ``device`` holds ``dtype``; None where the device gave no answer."""
        if device.type in _HOLD_EVERY_DTYPE:
            return True
        known = _KNOWN_MISSING.get(device.type)
        if known is not None and dtype in known:
            return False
        self.probes += 1
        try:
            # An allocation alone, where backends refuse a dtype (MPS, the emulated device
            # playing it): no kernel, so nothing waits for the device's queued work.
            torch.empty(1, dtype=dtype, device=device)
        except (TypeError, RuntimeError, NotImplementedError) as error:
            # A refusal names the dtype; anything else (out of memory, a device that
            # cannot take work now) says nothing about it, and is not kept.
            if isinstance(error, TypeError) or _names(error, dtype):
                return False
            return None
        return True


def _names(error: Exception, dtype: torch.dtype) -> bool:
    """Whether ``error``'s text names ``dtype`` (``float64``, ``torch.float64``, ``Double``)."""
    text = str(error).lower()
    short = str(dtype).removeprefix("torch.")
    scalar = {torch.float64: "double", torch.complex128: "complexdouble"}.get(dtype, short)
    return short in text or scalar in text


CAPABILITIES = Capabilities()
# Its answers' dict, read directly on the hot path (cleared in place, never replaced).
_known_missing = CAPABILITIES._missing.get


@constant
def supports_dtype(device: DeviceLike, dtype: torch.dtype) -> bool:
    """Whether ``device`` can hold tensors of ``dtype``.

    Example:
        >>> import torch
        >>> supports_dtype("cpu", torch.float64), supports_dtype("meta", torch.complex128)
        (True, True)

    Args:
        device: anything :func:`~devicectx.resolve_device` takes.
        dtype: a ``torch.dtype``.

    Returns:
        From torch's own knowledge where it has it (MPS holds no float64 and no
        complex128); elsewhere the device is asked once, by making a one-element tensor
        of ``dtype`` on it, and the answer is kept for the process.

    Raises:
        InvalidDeviceError, DeviceUnavailableError: ``device`` is no device here.
        TypeError: ``dtype`` is no ``torch.dtype``.

    Holding is not computing fast: bfloat16 is held by every CUDA GPU, computed natively
    from Ampere on (:func:`~devicectx.choose_precision` knows that).
    """
    if not isinstance(dtype, torch.dtype):
        msg = (
            f"supports_dtype() takes a torch.dtype, got {dtype!r}\n"
            f"fix: supports_dtype(device, torch.float64)"
        )
        raise TypeError(msg)
    return CAPABILITIES.holds(resolve_device(device), dtype)


def device_capabilities(device: DeviceLike) -> DeviceCapabilities:
    """What ``device`` can hold and do, in one record.

    Example:
        >>> caps = device_capabilities("meta")
        >>> caps.float64, caps.pinned_memory, sorted(caps.missing)
        (True, False, [])

    Args:
        device: anything :func:`~devicectx.resolve_device` takes.

    The dtypes are answered as :func:`supports_dtype` answers them (asked once each, the
    first time). ``pinned_memory`` is true for torch's current accelerator where a
    pinned buffer can be made (asked once).
    """
    target = resolve_device(device)
    holds = CAPABILITIES.holds
    return DeviceCapabilities(
        device=target,
        float64=holds(target, torch.float64),
        complex128=holds(target, torch.complex128),
        complex64=holds(target, torch.complex64),
        bfloat16=holds(target, torch.bfloat16),
        float8=all(holds(target, d) for d in _FLOAT8),
        pinned_memory=CAPABILITIES.pins(target.type),
        non_blocking=target.type not in ALWAYS_BLOCKING,
        missing=CAPABILITIES.missing(target),
    )


# What moves ask, as constants where dynamo traces them: the answers' caches are read (and
# a first answer found out, under a lock dynamo cannot enter) outside the graph.


@constant
def holds_every_dtype(device: torch.device) -> bool:
    """Whether ``device`` (resolved) holds every ordinary dtype: the check on every move's
    path, one dict lookup once the device is known."""
    missing = _known_missing(device)
    return not (CAPABILITIES.missing(device) if missing is None else missing)


@constant
def missing_dtypes(device: torch.device) -> frozenset[torch.dtype]:
    """The ordinary dtypes ``device`` (resolved) cannot hold."""
    return CAPABILITIES.missing(device)


def nearest_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype ``device`` holds that keeps the most of ``dtype`` (float64 -> float32,
    complex128 -> complex64, bfloat16 -> float32, float8 -> float16); None if none."""
    for candidate in _NEAREST.get(dtype, ()):
        if CAPABILITIES.holds(device, candidate):
            return candidate
    return None
