"""``torch.emu``: the device module torch looks up for the emulated accelerator.

torch asks a renamed PrivateUse1 backend's module for these names
(``torch.utils.backend_registration``, ``torch.amp.autocast_mode``, ``torch.random``,
``Tensor.emu()``, ``torch.distributed``): the device count and current index, streams and
events, the dtypes autocast accepts, and the default generators (``torch.manual_seed``
calls :func:`manual_seed_all`; ``torch.random.fork_rng`` calls :func:`get_rng_state` and
:func:`set_rng_state`), named as ``torch.cuda`` names them. Registered with
``torch._register_device_module("emu", this module)``.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

_extension: Any = None  # the built extension, set by devicectx.testing.emulated.enable
_initialized = False
"""True once enabled, as ``torch.cuda._initialized`` after CUDA's lazy start: torch's generic
device code reads it (``torch.utils.checkpoint`` saves and restores a device's random state
for the recompute only where it is True; without it, dropout drew another mask there)."""


def _index(device: torch.device | str | int | None) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return current_device() if device.index is None else device.index


def is_available() -> bool:
    """True: the emulated devices exist once enabled."""
    return _extension is not None


def is_initialized() -> bool:
    """True: nothing is initialised lazily at the module level."""
    return _extension is not None


def _lazy_init() -> None:
    """Nothing to do: the backend is ready when enabled."""


def _is_in_bad_fork() -> bool:
    """False: the worker threads are not carried into a forked child, nor used there."""
    return False


def device_count() -> int:
    """How many emulated devices there are."""
    return int(_extension.device_count())


def current_device() -> int:
    """This thread's current emulated device index."""
    return int(_extension.current_device())


def set_device(device: torch.device | str | int) -> None:
    """Make ``device`` this thread's current emulated device."""
    _extension.set_device(_index(device))


class device:  # torch.cuda.device's name and form
    """A block with ``index`` as this thread's current emulated device, as
    ``torch.cuda.device`` (what devicectx uses on torch releases without
    ``torch.accelerator.device_index``). Making a device current initialises nothing."""

    def __init__(self, index: torch.device | str | int | None) -> None:
        self.index = None if index is None else _index(index)
        self.previous = -1

    def __enter__(self) -> None:
        if self.index is not None:
            self.previous = current_device()
            set_device(self.index)

    def __exit__(self, *exc_info: object) -> None:
        if self.index is not None:
            set_device(self.previous)


class DeviceProperties(NamedTuple):
    """What :func:`get_device_properties` reports, in ``torch.cuda``'s field names."""

    name: str
    total_memory: int
    """The memory limit (``emulated.configure(memory_limit=...)``), else the host's memory,
    which the device's memory is."""


def get_device_properties(device: torch.device | str | int | None = None) -> DeviceProperties:
    """The name and memory of an emulated device, as ``torch.cuda.get_device_properties``
    gives a GPU's (the device report shows them)."""
    index, count = _index(device), device_count()
    if not 0 <= index < count:
        msg = (
            f"emu:{index} does not exist: there are {count} emulated devices\n"
            f"fix: pass emu:0 to emu:{count - 1}"
        )
        raise ValueError(msg)
    limit = int(_extension.memory_limit())
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return DeviceProperties(
        name="devicectx emulated accelerator",
        total_memory=limit or host,
    )


def synchronize(device: torch.device | str | int | None = None) -> None:
    """Wait for every stream of ``device`` (default: the current one) to finish its work."""
    _extension.synchronize(_index(device))


def current_stream(device: torch.device | str | int | None = None) -> torch.Stream:
    """This thread's current stream on ``device``."""
    return torch.accelerator.current_stream(_index(device))


# torch.distributed (checkpoint writers, FSDP2) calls torch.cuda's stream API on the
# accelerator's module: torch.Stream and torch.Event already take the emulated device.
Stream = torch.Stream
Event = torch.Event


def default_stream(device: torch.device | str | int | None = None) -> torch.Stream:
    """The default stream of ``device`` (default: the current one): stream 0."""
    index = _index(device)
    kind = torch.accelerator.current_stream(index).device_type
    return torch.Stream(stream_id=0, device_index=index, device_type=kind)


def set_stream(stream: torch.Stream) -> None:
    """Make ``stream`` this thread's current stream, and its device the current device, as
    ``torch.cuda.set_stream`` does."""
    torch.accelerator.set_stream(stream)


class StreamContext:  # torch.cuda.StreamContext's name and form
    """A block with ``stream`` as this thread's current stream (``None``: nothing changes);
    on exit, the current stream of its device and, if another device was current, that
    device and its stream are restored."""

    def __init__(self, stream: torch.Stream | None) -> None:
        self.stream = stream
        self.previous: list[torch.Stream] = []

    def __enter__(self) -> None:
        if self.stream is None:
            return
        here = current_stream()
        self.previous = [here]
        if here.device_index != self.stream.device_index:  # restored first, then `here`
            self.previous.insert(0, current_stream(self.stream.device_index))
        set_stream(self.stream)

    def __exit__(self, *exc_info: object) -> None:
        for previous in self.previous:
            set_stream(previous)
        self.previous = []


def stream(stream: torch.Stream | None) -> StreamContext:
    """A block with ``stream`` current, as ``torch.cuda.stream``."""
    return StreamContext(stream)


def get_amp_supported_dtype() -> list[torch.dtype]:
    """The dtypes ``torch.autocast("emu", dtype=...)`` accepts."""
    return [torch.float16, torch.bfloat16]


default_generators: tuple[torch.Generator, ...] = ()
"""Each emulated device's default generator, by index (set by ``enable``), as
``torch.cuda.default_generators``: what a random op on the device draws from without
``generator=``."""


def _default_generator(device: torch.device | str | int | None) -> torch.Generator:
    if isinstance(device, (str, torch.device)) and torch.device(device).type != "emu":
        msg = f"{str(device)!r} is not an emulated device\nfix: pass 'emu', 'emu:0' or an index"
        raise ValueError(msg)
    index, count = _index(device), len(default_generators)
    if not 0 <= index < count:
        msg = (
            f"emu:{index} does not exist: there are {count} emulated devices\n"
            f"fix: pass emu:0 to emu:{count - 1}"
        )
        raise ValueError(msg)
    return default_generators[index]


def manual_seed(seed: int) -> None:
    """Seed the current emulated device's default generator (``torch.manual_seed`` seeds
    every device's, through :func:`manual_seed_all`)."""
    _default_generator(None).manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    """Seed every emulated device's default generator."""
    for generator in default_generators:
        generator.manual_seed(int(seed))


def seed() -> None:
    """Seed the current emulated device's default generator with a random number."""
    _default_generator(None).seed()


def seed_all() -> None:
    """Seed every emulated device's default generator with one random number."""
    manual_seed_all(default_generators[0].seed())


def initial_seed() -> int:
    """The seed of the current emulated device's default generator."""
    return _default_generator(None).initial_seed()


def get_rng_state(device: torch.device | str | int = "emu") -> torch.Tensor:
    """The state of ``device``'s default generator (default: the current device), a CPU
    ``torch.uint8`` tensor, as ``torch.cuda.get_rng_state`` gives."""
    return _default_generator(device).get_state()


def get_rng_state_all() -> list[torch.Tensor]:
    """The states of every emulated device's default generator, by index."""
    return [generator.get_state() for generator in default_generators]


def set_rng_state(new_state: torch.Tensor, device: torch.device | str | int = "emu") -> None:
    """Restore a state from :func:`get_rng_state` into ``device``'s default generator."""
    _default_generator(device).set_state(new_state)


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    """Restore the states from :func:`get_rng_state_all`."""
    for index, state in enumerate(new_states):
        set_rng_state(state, index)
