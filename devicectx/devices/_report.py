"""The device report: what torch was built with, what it sees here, and where ``"auto"`` goes.

:func:`gather_report` collects the facts into a :class:`DeviceReport`; the CLI
(``python -m devicectx``) only formats it, as text or as JSON.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version as _version
from typing import Any, TypeVar

import torch

from devicectx._errors import DeviceError
from devicectx.devices import _xla
from devicectx.devices._capabilities import ORDINARY, missing_dtypes
from devicectx.devices._resolve import (
    ENV_VAR,
    _accelerator_count,
    _resolve,
    accelerator_type,
    available_devices,
)
from devicectx.move._distributed import job
from devicectx.scope._stack import current_device

# The variables that decide which device a process gets, in the order they matter
# (torch_xla's PJRT_DEVICE only where torch_xla is installed: it decides nothing elsewhere).
ENV_VARS = (
    ENV_VAR,
    *([_xla.ENV_VAR] if _xla.installed() else []),
    "LOCAL_RANK",
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
)

# torchrun's variables that place a process in its job (whole numbers).
JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

# Device types whose devices are not asked which dtypes they hold (they hold every ordinary
# one): asking (a one-element tensor per dtype) would create a context on every GPU, hundreds
# of MiB each, in each process that prints the report (every rank of a job).
_NOT_PROBED = frozenset({"cpu", "cuda"})

_T = TypeVar("_T")


@dataclass(frozen=True)
class BuildInfo:
    """What this torch was compiled with.

    Attributes:
        torch_version: ``torch.__version__``.
        summary: the backends in words: ``"CUDA 12.4"``, ``"ROCm 6.2"``, ``"MPS"``, ``"XPU"``,
            several joined by ``", "``, or ``"CPU only"``.
        cuda: ``torch.version.cuda``, or ``None`` when not built with CUDA.
        hip: ``torch.version.hip``, or ``None`` when not built with ROCm.
        mps: ``torch.backends.mps.is_built()``.
        xpu: ``torch.version.xpu`` (the SYCL version), or ``None`` when not built with XPU.
        cudnn: ``torch.backends.cudnn.version()`` where cuDNN (or MIOpen) is usable, else ``None``.
        accelerator: the accelerator torch uses here (``torch.accelerator``), or ``None``.
        xla: the ``torch_xla`` release installed beside torch, or ``None``; its devices are
            listed (``xla:0``, named for their PJRT device) where ``PJRT_DEVICE`` is set.
    """

    torch_version: str
    summary: str
    cuda: str | None
    hip: str | None
    mps: bool
    xpu: str | None
    cudnn: int | None
    accelerator: str | None
    xla: str | None = None


@dataclass(frozen=True)
class DeviceInfo:
    """One device this process can use, with what its backend says about it.

    Every field but ``device`` is ``None`` where the backend does not report it
    (or fails to: a report never dies on one unreadable property).

    Attributes:
        device: ``"cpu"``, ``"cuda:0"``, ...
        name: the product name (``"NVIDIA H100 80GB HBM3"``); the machine type for the CPU;
            the PJRT device for XLA (``"PJRT TPU"``, ``"PJRT CPU"``).
        memory: total memory in bytes; for MPS the recommended maximum working set
            (``torch.mps.recommended_max_memory()``); ``None`` for the CPU.
        capability: CUDA compute capability (``"9.0"``), ROCm architecture
            (``"gfx90a"``), or the CPU's vector extension (``"AVX2"``).
        missing_dtypes: the ordinary dtypes the device cannot hold, by name
            (``("float64", "complex128")`` on MPS), as :func:`~devicectx.supports_dtype`
            answers; empty where it holds them all (the CPU, every CUDA and ROCm GPU), or
            where the backend failed to answer.
    """

    device: str
    name: str | None
    memory: int | None
    capability: str | None
    missing_dtypes: tuple[str, ...] = ()


@dataclass(frozen=True)
class AutoChoice:
    """Where ``resolve_device("auto")`` goes here, and why (see ``explain_device``)."""

    device: str
    reason: str


@dataclass(frozen=True)
class Problem:
    """Why the set-up is broken: our exception's type name and its full text."""

    error: str
    message: str


@dataclass(frozen=True)
class JobInfo:
    """This process's place in a distributed job (torchrun), where it is in one.

    Attributes:
        rank: the global rank (``RANK``, or the initialised process group's).
        world_size: the number of processes (``WORLD_SIZE``, or the process group's).
        local_rank: the rank on this machine (``LOCAL_RANK``).
        local_world_size: the processes on this machine (``LOCAL_WORLD_SIZE``).
        backend: the process group's backend (``"nccl"``, ``"gloo"``) where one is
            initialised in this process, else ``None``.
        prefix: what starts every line of the text report: ``"[rank 1] "`` where the
            world is larger than one, so that the ranks' reports can be told apart.
        malformed: the torchrun variables set to something that is not a whole number
            (``{"WORLD_SIZE": "abc"}``), by name, with their values as set.
    """

    rank: int | None
    world_size: int | None
    local_rank: int | None
    local_world_size: int | None
    backend: str | None
    prefix: str
    malformed: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DeviceReport:
    """Everything ``python -m devicectx`` prints.

    Attributes:
        devicectx: the installed devicectx version.
        python: the Python version (``platform.python_version()``).
        platform: the operating system and machine (``platform.platform()``).
        build: how torch was built (:class:`BuildInfo`).
        devices: every device this process can use, the CPU first.
        auto: where ``"auto"`` resolves, and why; ``None`` when it cannot resolve.
        default_device: where factory functions called without ``device=`` allocate: what
            ``torch.get_default_device()`` reports on torch >= 2.8 (2.6 and 2.7 report
            only ``set_default_device``'s device, not a ``with torch.device`` scope's).
        environment: the variables that steer the choice (``DEVICECTX_DEVICE``,
            ``LOCAL_RANK``, ``CUDA_VISIBLE_DEVICES``, ``HIP_VISIBLE_DEVICES``), ``None`` if unset.
        problem: what is wrong with the set-up, or ``None`` when nothing is.
        job: the ranks and sizes of a distributed job and its process group's backend
            (:class:`JobInfo`); ``None`` outside one (no torchrun variable set, malformed
            or not, and no process group initialised).
        warnings: what may go wrong though ``"auto"`` resolves (local ranks that share a
            device), one sentence each, with its fix; empty when nothing may.
    """

    devicectx: str
    build: BuildInfo
    devices: list[DeviceInfo]
    auto: AutoChoice | None
    default_device: str
    environment: dict[str, str | None]
    problem: Problem | None
    job: JobInfo | None = None
    python: str = field(default_factory=platform.python_version)
    platform: str = field(default_factory=platform.platform)
    warnings: list[str] = field(default_factory=list)


def gather_report() -> DeviceReport:
    """Collect the device report of this process.

    A broken set-up (``DEVICECTX_DEVICE`` naming a device this machine lacks, a
    malformed ``LOCAL_RANK``) does not raise: it comes back as ``problem``, with
    ``auto`` set to ``None``, so the rest of the report still says what is there.

    Example:
        >>> report = gather_report()
        >>> report.devices[0].device
        'cpu'

    Returns:
        The report. ``default_device`` is read at call time, so inside
        ``on_device("meta")`` it says ``"meta"``.
    """
    auto: AutoChoice | None = None
    problem: Problem | None = None
    try:
        device, reason = _resolve("auto")
    except DeviceError as error:
        problem = Problem(error=type(error).__name__, message=str(error))
    else:
        auto = AutoChoice(device=str(device), reason=reason)
    job_info = _job_info()
    found = (_shared_device(job_info), _type_alone(job_info)) if auto is not None else ()
    return DeviceReport(
        devicectx=_version("devicectx"),
        build=_build_info(),
        devices=[_device_info(device) for device in available_devices()],
        auto=auto,
        default_device=str(current_device()),
        environment={name: os.environ.get(name) for name in ENV_VARS},
        problem=problem,
        job=job_info,
        warnings=[warning for warning in found if warning is not None],
    )


def _shared_device(job_info: JobInfo | None) -> str | None:
    """Where "auto" puts more local ranks than there are devices (``LOCAL_RANK % count``),
    which ranks share a device, in a sentence with its fix; else None.

    Not a problem (exit 1): gloo runs two ranks on one device, and some share on purpose
    (small models); NCCL refuses it, as torchrun users mostly run.
    """
    accelerator = accelerator_type()
    if job_info is None or job_info.local_rank is None or accelerator is None:
        return None
    # LOCAL_RANK places the rank only where neither DEVICECTX_DEVICE nor XLA does (the
    # order of "auto"'s rules, devicectx.devices._resolve).
    if os.environ.get(ENV_VAR, "").strip() not in ("", "auto") or _xla.in_use():
        return None
    count = _accelerator_count()
    rank = job_info.local_rank
    ranks = max(job_info.local_world_size or 0, rank + 1)
    if ranks <= count:
        return None
    device = f"{accelerator}:{rank % count}"
    others = [other for other in range(ranks) if other % count == rank % count and other != rank]
    if others:
        here = f"local rank {rank} shares {device} with local rank {_and(others)}"
    else:
        crowded = [r for r in range(ranks) if r >= count or r + count < ranks]
        here = f"local rank {rank} has {device} to itself; local ranks {_and(crowded)} share theirs"
    # Without LOCAL_WORLD_SIZE, the ranks below this one are all that is known to be there.
    counted = str(ranks) if job_info.local_world_size else f"at least {ranks}"
    return (
        f"{counted} local ranks on {count} {accelerator} device(s), placed by LOCAL_RANK % "
        f'{count}: {here}; NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); '
        f"fix: start {count} processes per machine (torchrun --nproc_per_node {count}), or "
        f"make {ranks} devices visible"
    )


def _type_alone(job_info: JobInfo | None) -> str | None:
    """Where ``DEVICECTX_DEVICE`` names the accelerator's type without an index, with
    several local ranks: each takes the current index, the same device for all (the
    variable overrides ``LOCAL_RANK``), in a sentence with its fix; else None."""
    accelerator = accelerator_type()
    if job_info is None or job_info.local_rank is None or accelerator is None:
        return None
    if os.environ.get(ENV_VAR, "").strip() != accelerator:
        return None
    ranks = job_info.local_world_size or job_info.local_rank + 1
    if ranks < 2:
        return None
    current = f"{accelerator}:{torch.accelerator.current_device_index()}"
    return (
        f"{ENV_VAR}={accelerator} (a device type without an index) puts every one of the "
        f"{ranks} local ranks on the current {accelerator} device, {current} here; NCCL "
        f'refuses two ranks on one GPU ("Duplicate GPU detected"); fix: unset {ENV_VAR}, so '
        f"that each rank takes {accelerator}:LOCAL_RANK, or set it to {accelerator}:LOCAL_RANK "
        "in each rank"
    )


def _and(numbers: list[int]) -> str:
    """``1``, ``1 and 3``, ``0, 2 and 4``."""
    shown = [str(number) for number in numbers]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}"


def _job_info() -> JobInfo | None:
    found = _guarded(job)
    # A variable set to what job() cannot read is still a sign of a job, and of a broken
    # one: shown, not dropped (job() reads whole numbers only).
    malformed = {}
    for name in JOB_VARS:
        value = os.environ.get(name, "")
        if value.strip() and not value.strip().isdigit():
            malformed[name] = value
    if found is None or (all(value is None for value in found) and not malformed):
        return None
    return JobInfo(*found, prefix=found.prefix, malformed=malformed)


def _build_info() -> BuildInfo:
    cuda = torch.version.cuda
    hip = torch.version.hip
    mps = torch.backends.mps.is_built()
    # torch.version.xpu appeared after torch 2.6, the floor; older builds have no XPU version.
    xpu: str | None = getattr(torch.version, "xpu", None)
    rocm: str | None = getattr(torch.version, "rocm", None) or hip
    backends = [
        *([f"CUDA {cuda}"] if cuda else []),
        *([f"ROCm {rocm}"] if hip else []),
        *(["MPS"] if mps else []),
        *([f"XPU {xpu}"] if xpu else []),
    ]
    return BuildInfo(
        torch_version=torch.__version__,
        summary=", ".join(backends) or "CPU only",
        cuda=cuda,
        hip=hip,
        mps=mps,
        xpu=xpu,
        cudnn=_guarded(_cudnn_version),
        accelerator=accelerator_type(),
        xla=_xla.version(),
    )


def _cudnn_version() -> int | None:
    cudnn: Any = torch.backends.cudnn  # its functions carry no annotations
    return _int_or_none(cudnn.version()) if cudnn.is_available() else None


def _device_info(device: torch.device) -> DeviceInfo:
    info = _properties(device)
    missing = () if device.type in _NOT_PROBED else _guarded(lambda: _missing(device))
    return dataclasses.replace(info, missing_dtypes=missing or ())


def _missing(device: torch.device) -> tuple[str, ...]:
    """The dtypes ``device`` cannot hold, by name, in :data:`ORDINARY`'s order."""
    missing = missing_dtypes(device)
    return tuple(str(dtype).removeprefix("torch.") for dtype in ORDINARY if dtype in missing)


def _properties(device: torch.device) -> DeviceInfo:
    if device.type == "cpu":
        return DeviceInfo(
            device="cpu",
            name=platform.machine() or None,
            memory=None,
            capability=_guarded(torch.backends.cpu.get_cpu_capability),
        )
    if device.type == "mps":
        # MPS has no per-device properties (not even a name); its memory limit is the
        # recommended working set of the whole GPU.
        return DeviceInfo(
            device=str(device),
            name=None,
            memory=_guarded(torch.mps.recommended_max_memory),
            capability=None,
        )
    if device.type == "xla":
        hardware = _guarded(lambda: _xla.hardware(device))
        return DeviceInfo(
            device=str(device),
            name=None if hardware is None else f"PJRT {hardware}",
            memory=_guarded(lambda: _xla.memory(device)),
            capability=None,
        )
    backend = getattr(torch, device.type, None)
    get_properties = getattr(backend, "get_device_properties", None)
    properties = _guarded(lambda: get_properties(device.index)) if get_properties else None
    return DeviceInfo(
        device=str(device),
        name=_str_or_none(getattr(properties, "name", None)),
        memory=_int_or_none(getattr(properties, "total_memory", None)),
        capability=_capability(device, properties),
    )


def _capability(device: torch.device, properties: object) -> str | None:
    if device.type != "cuda" or properties is None:
        return None
    if torch.version.hip:
        # On ROCm, major/minor are a CUDA-compatibility fiction; the real one is the gfx name.
        return _str_or_none(getattr(properties, "gcnArchName", None))
    major, minor = getattr(properties, "major", None), getattr(properties, "minor", None)
    return None if major is None or minor is None else f"{major}.{minor}"


def _guarded(query: Callable[[], _T]) -> _T | None:
    """``query()``, or ``None`` when it fails.

    A backend that is compiled in but broken (no driver, a device lost mid-run) raises
    from its property calls with whatever it likes; the report should still print.
    """
    try:
        return query()
    except Exception:
        return None


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) else None
