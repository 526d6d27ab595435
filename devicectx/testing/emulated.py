"""An emulated accelerator: a device that is not the CPU, for machines without a GPU.

``enable()`` builds (at first use, then cached) and registers a small torch backend named
``"emu"``, with two devices by default (up to 16). Device-agnostic code then runs on a
device that is not the CPU and has an accelerator's semantics:

- device memory of its own (``x.to("emu").data_ptr()`` is a new block), counted by
  :func:`memory_allocated`; freed memory is filled with 0xFF bytes (NaN in floating
  dtypes, -1 in integers) and kept a while before the real free, so a late reader reads
  poison; a block used on another stream (``Tensor.record_stream``) is poisoned only once
  that stream ran past the free, as CUDA's caching allocator reuses it;
- streams that run in order on worker threads (a default stream per device, a pool,
  ``torch.Stream(device="emu:0")``), a current stream per thread and device; events
  (record, query, synchronize, wait, elapsed time) are markers queued on a stream;
- pinned host memory (``pin_memory()``, ``is_pinned()``);
- copies: blocking ones are complete on return, as CUDA's are; a ``non_blocking=True``
  copy to or from pinned memory completes later, on the current stream of the device,
  ``delay_ms`` after the stream reaches it, so that code reading a destination too early
  reads old bytes, and code overwriting a source too early sends new ones;
- every op on the device waits for the device's current stream to drain, then runs on
  the CPU (the values are real); work on other streams is not waited for, so races
  between streams show as they do on a GPU; the fused recurrent cells torch calls for
  ``nn.LSTM`` and ``nn.GRU`` (and their cells) off the CPU, which have no CPU kernels,
  are the device's own, forward and backward; where torch gives a backend out of tree no
  kernel or a composite one, the CPU's kernel runs (convolutions, layer and group norm),
  and an argument an op writes reaches the device though its schema does not mark it
  (batch norm's running statistics), so a layer computes the CPU's values bit for bit
  (``scaled_dot_product_attention`` takes torch's math path, as on a device without a
  fused kernel: close to the CPU's, not equal);
- random numbers of its own, as CUDA's and MPS's: ``torch.Generator(device="emu")``, and a
  default generator per device (``torch.emu.manual_seed``, ``get_rng_state``, ...), which
  ``torch.manual_seed`` seeds and a random op draws from without ``generator=``; an emu
  generator holds a CPU generator (torch's Mersenne Twister), which the op's CPU kernel
  draws from, seeded with the seed mixed with a constant: a seed draws the same numbers
  on every emu device, and other numbers than on the CPU, as on CUDA (not CUDA's numbers);
  a random op refuses a generator of another device (a CPU ``torch.Generator``), as
  CUDA's do;
- ``torch.accelerator``, ``devicectx.resolve_device("auto")``, ``available_devices()``
  and the pytest plugin see it (torch prefers a registered PrivateUse1 backend, so it is
  the accelerator even on a machine with a GPU); ``torch.autocast("emu")`` casts the ops
  it casts on CUDA; contexts are created as CUDA creates them (:func:`initialized_devices`).

Example::

    import torch
    from devicectx.testing import emulated

    device = emulated.enable()                       # emu:0
    x = torch.arange(4.0).to(device)
    with emulated.paused(device):                    # nothing on emu:0 runs until the end
        y = x.to("cpu", non_blocking=True)           # pinned memory, copied later
        assert y.tolist() != [0.0, 1.0, 2.0, 3.0]    # not there yet
    torch.accelerator.synchronize()
    assert y.tolist() == [0.0, 1.0, 2.0, 3.0]

It plays the devices users have, by :data:`PROFILES` (``enable(profile="mps")``, or
``with profile("mps"):`` for a block) or by single switches of :func:`configure`:

- ``"cuda"`` (the default): every dtype, ``record_stream``, pinned memory, events, generators;
- ``"mps"``: no float64 and no complex128, as Apple's MPS: making such a tensor on the
  device (a factory, ``.to()``, an op's result) raises ``TypeError`` with MPS's words
  (printing a tensor works, as on MPS); and no ``Tensor.record_stream``
  (``NotImplementedError``), as MPS and some other backends;
- ``configure(memory_limit=bytes)``: each device holds that many bytes of live tensors;
  an allocation past it raises ``torch.OutOfMemoryError`` worded as CUDA's;
- ``configure(generators=False)``: a backend without a ``torch.Generator`` of its own
  (some backends registered out of tree): ``torch.Generator(device="emu")`` raises
  ``NotImplementedError``.

The rule: torch allows one PrivateUse1 backend per process, so the backend and its device
count are fixed at the first :func:`enable`; everything a profile or :func:`configure`
sets can change at run time, so one process (one test session) tests several profiles.

What it does not emulate: timings (a kernel costs what the CPU takes, a copy's delay is
fixed), CUDA graphs, the sync-debug mode, real GPU kernels and their numerics (TF32,
reduction orders), device-side asserts, a caching allocator's fragmentation (the memory
limit counts live tensors' bytes), peer access, IPC, ``torch.compile`` for the device,
CUDA's ``Module.to`` keeping each parameter object (to ``emu``, as to every backend out of
tree and to ``meta``, torch makes new ``Parameter`` objects: an optimizer built before the
move steps the old ones, and a lazy module's uninitialized parameters become empty ordinary
ones, so ``nn.LazyLinear(3).to("emu")`` fails at its first call; make a lazy module on the
device, ``nn.LazyLinear(3, device=device)``, or call it once before ``.to()``), an
MPS device's single queue (the "mps" profile keeps the streams), collectives and process
groups on the device (torch.distributed has no backend for ``emu``: ``all_reduce`` of an
``emu`` tensor, and ``DistributedDataParallel`` or ``fully_shard`` over two ranks of a
model on it, raise; under ``torchrun ... -m devicectx.testing.emulate``, run the
collectives on CPU tensors and a CPU mesh). Ops queue no work on streams: only copies and
events do. Where a CUDA GPU is present, two of its errors crash the process instead of
raising (a segmentation fault, seen with torch 2.11 on an H100): the out-of-memory error
(so :func:`configure` refuses a memory limit there) and ``torch.Generator(device="emu:N")``
for a device that does not exist.

Build cost: about 40-60 s of a C++ compiler the first time per torch and Python (cached
under ``~/.cache/devicectx/emulated``), then a fraction of a second to load. It needs a
C++17 compiler (g++ or clang), ``ninja`` (in the ``testing`` extra), torch's headers
(every wheel ships them), and Linux or macOS. Once enabled in a process, it cannot be
turned off: torch allows one PrivateUse1 backend per process, under one name.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType, TracebackType
from typing import Any

import torch
from packaging.version import Version

from devicectx._errors import DeviceUnavailableError
from devicectx._torch.backends import privateuse1_name, register_device_module

__all__ = [
    "DEVICE_TYPE",
    "PROFILES",
    "EmulatedUnavailable",
    "configure",
    "enable",
    "enabled",
    "initialized_devices",
    "memory_allocated",
    "paused",
    "pinned_memory_allocated",
    "profile",
    "settings",
]

DEVICE_TYPE = "emu"
_DEFAULT_NAME = "privateuseone"  # PrivateUse1's name until a backend renames it

_lock = threading.Lock()
_extension: Any = None

PROFILES: Mapping[str, Mapping[str, bool | int]] = MappingProxyType(
    {
        "cuda": MappingProxyType(
            {
                "pinned": True,
                "events": True,
                "float64": True,
                "record_stream": True,
                "memory_limit": 0,
                "generators": True,
            }
        ),
        "mps": MappingProxyType(
            {
                "pinned": True,
                "events": True,
                "float64": False,
                "record_stream": False,
                "memory_limit": 0,
                "generators": True,
            }
        ),
    }
)
"""The devices the emulated accelerator plays, by name: the :func:`configure` switches
each sets. Every profile sets every switch it names, so a profile undoes another's."""


class EmulatedUnavailable(DeviceUnavailableError):
    """The emulated accelerator cannot be built or registered here; says why and the fix."""


def enable(devices: int = 2, *, delay_ms: float = 2.0, profile: str | None = None) -> torch.device:
    """Build (at first use), load and register the emulated accelerator; return ``emu:0``.

    Idempotent: a later call returns the same device, and sets ``delay_ms`` (and
    ``profile`` where given).

    Example::

        device = enable()
        torch.ones(2, device=device) + 1           # computed on the CPU, stored on emu:0
        enable(profile="mps")                      # from now on, a device without float64

    Args:
        devices: how many ``emu`` devices (1 to 16); fixed for the process.
        delay_ms: how long a non_blocking copy to or from pinned memory takes, from the
            moment its stream reaches it (see :func:`configure`).
        profile: a name of :data:`PROFILES` to play (``"cuda"``, ``"mps"``); None leaves
            the switches as they are (at the first call: ``"cuda"``'s).

    Returns:
        ``torch.device("emu", 0)``.

    Raises:
        EmulatedUnavailable: the build failed (the compiler's last lines are in the
            message), or another PrivateUse1 backend is registered in this process.
        ValueError: ``devices`` is out of range, or differs from an earlier call's;
            ``profile`` is no name of :data:`PROFILES`.
    """
    if profile is not None:
        _profile_switches(profile)  # a bad name fails before the build
    if not 1 <= devices <= 16:
        raise ValueError(f"enable(devices={devices}): between 1 and 16 emulated devices")
    with _lock:
        if _extension is None:
            _register(devices)
        elif _extension.device_count() != devices:
            msg = (
                f"enable(devices={devices}): the emulated accelerator is already enabled with "
                f"{_extension.device_count()} devices, a count fixed for the process\n"
                f"fix: call enable({_extension.device_count()}), or set the count in a new process"
            )
            raise ValueError(msg)
    configure(delay_ms=delay_ms)
    if profile is not None:
        configure(**_profile_switches(profile))
    return torch.device(DEVICE_TYPE, 0)


def enabled() -> bool:
    """Whether :func:`enable` has registered the emulated accelerator in this process."""
    return _extension is not None


class _Settings:
    """What :func:`configure` set; restores the previous settings when used as a context."""

    def __init__(self, previous: dict[str, Any]) -> None:
        self._previous = previous

    def __enter__(self) -> _Settings:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        _apply(self._previous)


def configure(
    *,
    delay_ms: float | None = None,
    pinned: bool | None = None,
    events: bool | None = None,
    poison: bool | None = None,
    float64: bool | None = None,
    record_stream: bool | None = None,
    memory_limit: int | None = None,
    generators: bool | None = None,
) -> _Settings:
    """Change the emulated device's behaviour at run time; as a context, only in the block.

    Example::

        with configure(pinned=False):              # a device without pinned memory
            torch.ones(2).pin_memory()             # raises RuntimeError
        with configure(memory_limit=2**20):        # 1 MiB per device
            torch.empty(2**21, dtype=torch.uint8, device="emu")  # torch.OutOfMemoryError
        configure(delay_ms=0)                      # for the rest of the process

    Args:
        delay_ms: how long a non_blocking copy to or from pinned memory takes once its
            stream reaches it (default 2). Tests should not rely on it: use
            :func:`paused` to hold copies back deterministically.
        pinned: False emulates a device without pinned memory: ``pin_memory()`` raises,
            ``is_pinned()`` is False, non_blocking copies are blocking.
        events: False emulates a device without events: recording one raises.
        poison: False leaves freed memory as it was (it is still kept a while).
        float64: False emulates a device without float64 and complex128 (MPS): making such
            a tensor on the device raises ``TypeError``, as MPS does.
        record_stream: False emulates a backend without ``Tensor.record_stream``: it
            raises ``NotImplementedError``, as torch's CPU fallback does there.
        memory_limit: bytes of live tensors each device holds (0: no limit); an
            allocation past it raises ``torch.OutOfMemoryError``, worded as CUDA's.
            Lowering it below what is allocated frees nothing: the next allocation fails.
            Refused where a CUDA GPU is present: that error crashes the process there.
        generators: False emulates a backend without generators of its own:
            ``torch.Generator(device="emu")`` raises ``NotImplementedError``, as torch
            does for such a backend (random ops still draw from each device's default
            generator).

    Returns:
        An object whose ``with`` block restores the previous settings on exit.

    Raises:
        EmulatedUnavailable: the emulated accelerator is not enabled; or a memory limit
            is asked for where a CUDA GPU is present.
    """
    asked = {
        "delay_ms": delay_ms,
        "pinned": pinned,
        "events": events,
        "poison": poison,
        "float64": float64,
        "record_stream": record_stream,
        "memory_limit": memory_limit,
        "generators": generators,
    }
    _check(asked)
    previous: dict[str, Any] = settings()
    _apply(asked)
    return _Settings(previous)


def profile(name: str) -> _Settings:
    """Play the device :data:`PROFILES` names; as a context, only in the block.

    Example::

        with profile("mps"):
            torch.zeros(2, dtype=torch.float64, device="emu")   # raises TypeError
        torch.zeros(2, dtype=torch.float64, device="emu")       # works again

    Raises:
        ValueError: ``name`` is no profile.
        EmulatedUnavailable: the emulated accelerator is not enabled.
    """
    return configure(**_profile_switches(name))


def _profile_switches(name: str) -> dict[str, Any]:
    try:
        return dict(PROFILES[name])
    except KeyError:
        names = ", ".join(map(repr, PROFILES))
        msg = (
            f"emulated profile {name!r} does not exist: the profiles are {names}\n"
            f'fix: profile("mps"), or configure() for single switches'
        )
        raise ValueError(msg) from None


def settings() -> dict[str, float | bool]:
    """The current settings, by :func:`configure`'s argument names.

    Example::

        settings()["float64"]  # True, False in the "mps" profile
        # {'delay_ms': 2.0, 'pinned': True, 'events': True, 'poison': True,
        #  'float64': True, 'record_stream': True, 'memory_limit': 0, 'generators': True}
    """
    extension = _require()
    return {
        "delay_ms": float(extension.delay_ms()),
        "pinned": bool(extension.pinned_enabled()),
        "events": bool(extension.events_enabled()),
        "poison": bool(extension.poison_enabled()),
        "float64": bool(extension.float64_enabled()),
        "record_stream": bool(extension.record_stream_enabled()),
        "memory_limit": int(extension.memory_limit()),
        "generators": bool(extension.generators_enabled()),
    }


def _check(settings: dict[str, Any], gpu_present: bool | None = None) -> None:
    """Refuse a bad value before any switch changes; ``gpu_present``: whether a CUDA GPU
    is here (None: ask torch)."""
    delay, limit = settings["delay_ms"], settings["memory_limit"]
    if delay is not None and delay < 0:
        raise ValueError(f"configure(delay_ms={delay}): must be >= 0")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        msg = (
            f"configure(memory_limit={limit!r}): bytes per device, an int >= 0 (0: no limit)\n"
            f"fix: configure(memory_limit=64 * 2**20)"
        )
        raise ValueError(msg)
    if gpu_present is None:
        gpu_present = bool(limit) and torch.cuda.is_available()
    if limit and gpu_present:
        msg = (
            f"configure(memory_limit={limit}): the emulated device's out-of-memory error "
            "crashes the process (a segmentation fault) where a CUDA GPU is present (seen "
            "with torch 2.11 on an H100); the limit is not set\n"
            "fix: test memory limits on the emulated device where there is no GPU, or on "
            "the GPU itself"
        )
        raise EmulatedUnavailable(msg)


def _apply(settings: dict[str, Any]) -> None:
    extension = _require()
    if settings["delay_ms"] is not None:
        extension.set_delay_ms(float(settings["delay_ms"]))
    if settings["pinned"] is not None:
        extension.set_pinned_enabled(bool(settings["pinned"]))
    if settings["events"] is not None:
        extension.set_events_enabled(bool(settings["events"]))
    if settings["poison"] is not None:
        extension.set_poison_enabled(bool(settings["poison"]))
    if settings["float64"] is not None:
        extension.set_float64_enabled(bool(settings["float64"]))
    if settings["record_stream"] is not None:
        extension.set_record_stream_enabled(bool(settings["record_stream"]))
    if settings["memory_limit"] is not None:
        extension.set_memory_limit(int(settings["memory_limit"]))
    if settings["generators"] is not None:
        extension.set_generators_enabled(bool(settings["generators"]))
    if settings["float64"] is not None:
        # devicectx asked once which dtypes the device holds: ask again.
        from devicectx.devices._capabilities import CAPABILITIES

        CAPABILITIES.clear()
    if settings["events"] is not None or settings["record_stream"] is not None:
        # devicectx asked once whether the device has a copy stream: ask again.
        from devicectx.move import _streams

        _streams.forget()


@contextmanager
def paused(
    device: torch.device | str | int | None = None, *, stream: torch.Stream | None = None
) -> Iterator[None]:
    """Hold back the work queued on a device's streams (or on one stream) until the block ends.

    Deterministic where a delay is not: a non_blocking copy queued in the block has not
    happened until the block ends, whatever the machine's speed.

    Example::

        with paused("emu:0"):
            y = x.to("cpu", non_blocking=True)     # queued, not done
            ...                                    # y still holds old bytes here
        torch.accelerator.synchronize()            # now y is right

    Anything that would wait for a paused stream inside the block (an op on the device,
    a blocking copy, ``synchronize()``) raises instead of hanging.

    Args:
        device: the device whose streams to pause (default: the current emu device).
        stream: pause only this stream (an ``emu`` ``torch.Stream``) instead.
    """
    extension = _require()
    if stream is not None:
        index, stream_id = stream.device_index, stream.stream_id
    else:
        index, stream_id = _index(device), -1
    was_paused = extension.is_paused(index, stream_id)
    extension.set_paused(index, stream_id, True)
    try:
        yield
    finally:
        extension.set_paused(index, stream_id, was_paused)


def memory_allocated(device: torch.device | str | int | None = None) -> int:
    """Bytes of live device memory on ``device`` (default: the current emu device).

    Freed memory stops counting at once, even while it waits, poisoned, for its streams.
    """
    return int(_require().memory_allocated(_index(device)))


def pinned_memory_allocated() -> int:
    """Bytes of live pinned host memory allocated by the emulated backend."""
    return int(_require().memory_allocated(-1))


def initialized_devices() -> list[torch.device]:
    """The emu devices with a context: where memory, a stream or an event was made, or
    pinned memory allocated while the device was current (as CUDA creates contexts)."""
    return [torch.device(DEVICE_TYPE, i) for i in _require().initialized_devices()]


def _index(device: torch.device | str | int | None) -> int:
    extension = _require()
    if device is None:
        return int(extension.current_device())
    if isinstance(device, int):
        index = device
    else:
        parsed = torch.device(device)
        if parsed.type != DEVICE_TYPE:
            raise ValueError(f"{device!r} is not an emulated device; fix: pass 'emu:0'")
        index = int(extension.current_device()) if parsed.index is None else parsed.index
    if not 0 <= index < extension.device_count():
        msg = (
            f"emu:{index} does not exist: there are {extension.device_count()} emulated "
            f"devices\nfix: pass emu:0 to emu:{extension.device_count() - 1}, or "
            f"enable(devices={index + 1}) in a new process"
        )
        raise ValueError(msg)
    return index


def _require() -> Any:
    if _extension is None:
        msg = (
            "the emulated accelerator is not enabled in this process\n"
            "fix: call devicectx.testing.emulated.enable() first, or run pytest with "
            "--devicectx-accelerator=emulated"
        )
        raise EmulatedUnavailable(msg)
    return _extension


def _register(devices: int) -> None:
    global _extension
    name = privateuse1_name()
    if name != _DEFAULT_NAME:
        msg = (
            f"another PrivateUse1 backend, {name!r}, is registered in this process, and torch "
            "allows one\nfix: run the emulated accelerator's tests in a process that does not "
            f"load the {name!r} backend"
        )
        raise EmulatedUnavailable(msg)
    from devicectx.testing._emulated import _build, _device_module

    try:
        extension = _build.load()
    except _build.BuildFailed as error:
        raise EmulatedUnavailable(str(error)) from None
    from torch.utils.backend_registration import (
        generate_methods_for_privateuse1_backend,
        rename_privateuse1_backend,
    )

    # The order matters: the name first (the device module and the methods are looked up
    # by it), the hooks before the module (torch.accelerator asks them).
    rename_privateuse1_backend(DEVICE_TYPE)
    extension.register_backend(devices)
    _device_module._extension = extension
    _device_module._initialized = True
    _device_module.default_generators = tuple(map(extension.default_generator, range(devices)))
    register_device_module(DEVICE_TYPE, _device_module)
    generate_methods_for_privateuse1_backend(for_storage=True)
    _print_as_mps(extension)
    _scale_as_mps(extension)
    _extension = extension
    # torch's accelerator is now this one: forget what devicectx worked out before.
    from devicectx.move import _staging
    from devicectx.scope import _index

    _index.INDEX_READERS.clear()
    _staging.forget_accelerator()


def _scale_as_mps(extension: Any) -> None:
    """Let ``torch.amp.GradScaler.unscale_`` take its scale's reciprocal where the device
    holds no float64, as it does on MPS.

    From torch 2.8 it computes the reciprocal in float64 on every device but ``mps:0``,
    which it names (``torch/amp/grad_scaler.py``), so under the "mps" profile a mixed
    precision step with a scaler failed where a Mac runs it. Float64 is allowed on the
    thread only during ``unscale_``, as for printing; before torch 2.8, MPS fails there
    too, and so does the emulated device. Installed with the device, whatever its
    profile: under one that holds float64 it changes nothing.
    """
    if Version(torch.__version__).release < (2, 8):
        return
    scaler = torch.amp.GradScaler
    original: Callable[..., None] = scaler.unscale_

    def unscale_(self: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        # The scale's device, as torch decides (GradScaler("emu"), "emu:0" or a device
        # alike); _scale, set by scale(), read as torch 2.8 to 2.15 read it there.
        scale = self._scale
        if scale is None or scale.device.type != DEVICE_TYPE:
            return original(self, optimizer)
        previous = extension.set_float64_for_printing(True)
        try:
            return original(self, optimizer)
        finally:
            extension.set_float64_for_printing(previous)

    scaler.unscale_ = unscale_  # type: ignore[method-assign]


def _print_as_mps(extension: Any) -> None:
    """Let ``repr()`` and ``str()`` print emu tensors where the device holds no float64, as
    MPS's tensors print.

    torch's printing converts a tensor's values to float64 to size its columns, on every
    device but MPS, where it converts them to float32 (``torch/_tensor_str.py``). Without
    this, an emu tensor under the "mps" profile would fail to print with the float64
    ``TypeError``, and a failing test whose report shows one (pytest's assertion, a
    hypothesis example) would report that error instead of its failure. Float64 is allowed
    on the printing thread only while it prints: code that makes float64 on the device
    still fails, as on MPS. It costs every tensor's ``repr`` one device check.
    """
    original: Callable[..., str] = torch.Tensor.__repr__

    def __repr__(self: torch.Tensor, *, tensor_contents: Any = None) -> str:
        if self.device.type != DEVICE_TYPE:
            return original(self, tensor_contents=tensor_contents)
        previous = extension.set_float64_for_printing(True)
        try:
            return original(self, tensor_contents=tensor_contents)
        finally:
            extension.set_float64_for_printing(previous)

    torch.Tensor.__repr__ = __repr__  # type: ignore[method-assign, assignment]
