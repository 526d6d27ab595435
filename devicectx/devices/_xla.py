"""XLA devices (TPU, and any PJRT device), which the ``torch_xla`` package provides.

torch knows the device type ``xla`` (``torch.device("xla")`` parses) but has no backend
for it: ``torch_xla`` registers one when imported, and its PJRT runtime picks the hardware
from the environment variable ``PJRT_DEVICE`` (``TPU``, ``CPU``, ``CUDA``, ...). XLA is no
``torch.accelerator``: it has no streams, events or pinned host memory of its own.

The rule for ``"auto"`` (and for :func:`~devicectx.available_devices`): XLA is *in use*
where ``torch_xla`` is installed and ``PJRT_DEVICE`` is set. The variable is torch_xla's
alone, so setting it says "this process runs on XLA"; torch_xla also sets it itself the
first time a program uses an XLA device without it (to the hardware it found). Without it,
``torch_xla`` is never imported by devicectx unless an ``xla`` device is asked for by name,
so merely having it installed changes nothing.

Example:
    >>> import os
    >>> in_use() == (installed() and bool(os.environ.get("PJRT_DEVICE", "").strip()))
    True
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from types import ModuleType
from typing import Any

import torch
from packaging.version import Version

__all__ = [
    "ENV_VAR",
    "count",
    "default_device",
    "devices",
    "hardware",
    "in_use",
    "installed",
    "memory",
    "pjrt_device",
    "problem",
    "version",
]

ENV_VAR = "PJRT_DEVICE"
_TORCH = Version(torch.__version__).release
FIX_INSTALL = f'pip install "torch-xla=={_TORCH[0]}.{_TORCH[1]}.*"'
"""The fix for a missing or mismatched torch_xla: each torch_xla release is built for the
torch release of the same number, and imports with no other."""


class _Found:
    """What is known of torch_xla in this process, found once: whether it is installed,
    and, once imported, the module or why it did not import. Tests swap the one instance
    (``STATE``) to play a machine with or without it."""

    __slots__ = ("error", "installed", "module")

    def __init__(self) -> None:
        self.installed: bool | None = None
        self.module: ModuleType | None = None
        self.error: str | None = None


STATE = _Found()


def installed() -> bool:
    """Whether ``torch_xla`` can be imported here (found on the path, not imported)."""
    state = STATE
    if state.installed is None:
        state.installed = importlib.util.find_spec("torch_xla") is not None
    return state.installed


def pjrt_device() -> str | None:
    """The PJRT device ``PJRT_DEVICE`` names (``"CPU"``, ``"TPU"``), or None when unset."""
    value = os.environ.get(ENV_VAR, "").strip()
    return value or None


def in_use() -> bool:
    """Whether XLA is this process's device: ``torch_xla`` installed, ``PJRT_DEVICE`` set.

    Asked at every ``"auto"``: where torch_xla is absent, one attribute read (the found
    answer), not a look at the environment.
    """
    return installed() and pjrt_device() is not None


def version() -> str | None:
    """The installed ``torch_xla`` release, without importing it; None where absent."""
    if not installed():
        return None
    try:
        return _version("torch_xla")
    except PackageNotFoundError:  # on the path without its metadata (a source checkout)
        return "unknown release"


def problem() -> str | None:
    """Why no XLA device can be used here, in words; None where ``torch_xla`` imports."""
    if not installed():
        return "'xla' devices come from the torch_xla package, which is not installed here"
    _module()
    return STATE.error


def count() -> int:
    """How many XLA devices this process can address; 0 where ``torch_xla`` is unusable."""
    module = _module()
    return 0 if module is None else int(module.device_count())


def devices() -> list[torch.device]:
    """This process's XLA devices (``xla:0``, ...); empty where ``torch_xla`` is unusable."""
    module = _module()
    return [] if module is None else [torch.device(d) for d in module.devices()]


def default_device() -> torch.device:
    """torch_xla's default device for this process (what ``"xla"`` means), with its index.

    ``torch_xla.device()`` with no index reads the default without changing it.
    """
    module = _module()
    if module is None:  # callers check count() first
        return torch.device("xla", 0)
    device: torch.device = module.device()
    return device


def hardware(device: torch.device) -> str | None:
    """What runs ``device``: ``"CPU"``, ``"TPU"``, ``"CUDA"`` (torch_xla's ``xla_device_hw``)."""
    if _module() is None:
        return None
    xla_model: Any = importlib.import_module("torch_xla.core.xla_model")
    return str(xla_model.xla_device_hw(device))


def memory(device: torch.device) -> int | None:
    """The device's memory in bytes where its PJRT plug-in tells (not the CPU's)."""
    if _module() is None:
        return None
    xla_model: Any = importlib.import_module("torch_xla.core.xla_model")
    limit = xla_model.get_memory_info(device).get("bytes_limit")
    return limit if isinstance(limit, int) else None


def _module() -> Any:
    """``torch_xla``, imported at the first question about an XLA device; None where it is
    not installed or does not import (``STATE.error`` says why)."""
    state = STATE
    if state.module is not None or state.error is not None:
        return state.module
    if not installed():
        return None
    try:
        state.module = importlib.import_module("torch_xla")
    except Exception as error:  # a release built for another torch: ImportError, OSError
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        state.error = f"torch_xla is installed but does not import: {type(error).__name__}"
        state.error += f": {first}" if first else ""
    return state.module
