"""torch's PrivateUse1 backend: the name it goes by (``torch.utils.rename_privateuse1_backend``),
and the registration of its device module (``torch.<name>``).

``torch._C._get_privateuse1_backend_name`` is private; autocast itself calls it to find the
renamed backend's dtypes. ``torch._register_device_module`` is private too; it is what
out-of-tree backends call to make ``torch.<name>`` their device module (the testing kit's
emulated accelerator does). Both checked on torch 2.6.0 to 2.15.0.

Example:
    >>> privateuse1_name() in ("privateuseone", "emu")
    True
"""

from types import ModuleType

import torch

__all__ = ["privateuse1_name", "register_device_module"]


def privateuse1_name() -> str:
    """The device type of the PrivateUse1 backend: ``"privateuseone"`` unless renamed."""
    name: str = torch._C._get_privateuse1_backend_name()
    return name


def register_device_module(device_type: str, module: ModuleType) -> None:
    """Make ``module`` the device module of ``device_type`` (``torch.<device_type>``), as an
    out-of-tree backend does; once per process (torch refuses a second)."""
    torch._register_device_module(device_type, module)  # type: ignore[no-untyped-call]
