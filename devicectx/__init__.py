"""devicectx: device-agnostic PyTorch.

- :func:`on_device`: torch's default device for a block, isolated per thread and asyncio task;
- :func:`device_agnostic`: move (or check) every tensor argument of a call to one device;
- :func:`to_device` and :func:`find_devices`: a structure-preserving move that loses nothing;
- :func:`resolve_device`: ``"auto"``, ``LOCAL_RANK`` under torchrun, ``DEVICECTX_DEVICE``;
- :func:`precision_scope` and :func:`choose_precision`: mixed precision named as Lightning
  names it (``"bf16-mixed"``, ``"16-mixed"``, ``"32"``, ``"auto"``), on any device;
- :func:`prefetch`: batches moved to the device ahead of the step, on a copy stream;
- :func:`supports_dtype` and :func:`device_capabilities`: what a device can hold (MPS: no
  float64), for the ``dtypes=`` policy of moves;
- :func:`track_transfers`: every copy between devices, by place; a
  :class:`RepeatedMoveWarning` for an unchanged tensor copied again and again.

The optional testing kit lives in :mod:`devicectx.testing` (from a clone:
``pip install -e '.[testing]'``).
"""

from importlib.metadata import version as _version

from devicectx import _moved
from devicectx._errors import (
    BatchTooLargeError,
    DeviceError,
    DeviceMismatchError,
    DeviceUnavailableError,
    DeviceWarning,
    DtypeUnsupportedError,
    InvalidDeviceError,
    InvalidPrecisionError,
    MoveError,
    MoveOutOfMemoryError,
    PrecisionUnsupportedError,
    RegistrationError,
    RepeatedMoveWarning,
    ScopeExitError,
    StrayTensorError,
    StrayTensorWarning,
)
from devicectx.decorator._decorator import device_agnostic
from devicectx.decorator._spread import declare_spread, module_placement
from devicectx.devices._capabilities import (
    DeviceCapabilities,
    device_capabilities,
    supports_dtype,
)
from devicectx.devices._oom import shrink_batch_on_oom
from devicectx.devices._resolve import DeviceLike, available_devices, explain_device, resolve_device
from devicectx.move._containers import unregister_container
from devicectx.move._distributed import Layout
from devicectx.move._move import find_devices, register_container, to_device
from devicectx.move._pinned import release_staging, staging_memory
from devicectx.move._prefetch import prefetch
from devicectx.move._repeats import set_repeated_move_warning
from devicectx.move._transfers import Transfer, TransferLog, track_transfers
from devicectx.move._walk import find_layouts
from devicectx.scope._context import on_device
from devicectx.scope._precision import Precision, PrecisionName, choose_precision, precision_scope
from devicectx.scope._stack import current_device

__version__ = _version("devicectx")
_moved.install()  # the module paths before 0.2, for pickles made with them

__all__ = [
    "BatchTooLargeError",
    "DeviceCapabilities",
    "DeviceError",
    "DeviceLike",
    "DeviceMismatchError",
    "DeviceUnavailableError",
    "DeviceWarning",
    "DtypeUnsupportedError",
    "InvalidDeviceError",
    "InvalidPrecisionError",
    "Layout",
    "MoveError",
    "MoveOutOfMemoryError",
    "Precision",
    "PrecisionName",
    "PrecisionUnsupportedError",
    "RegistrationError",
    "RepeatedMoveWarning",
    "ScopeExitError",
    "StrayTensorError",
    "StrayTensorWarning",
    "Transfer",
    "TransferLog",
    "__version__",
    "available_devices",
    "choose_precision",
    "current_device",
    "declare_spread",
    "device_agnostic",
    "device_capabilities",
    "explain_device",
    "find_devices",
    "find_layouts",
    "module_placement",
    "on_device",
    "precision_scope",
    "prefetch",
    "register_container",
    "release_staging",
    "resolve_device",
    "set_repeated_move_warning",
    "shrink_batch_on_oom",
    "staging_memory",
    "supports_dtype",
    "to_device",
    "track_transfers",
    "unregister_container",
]
