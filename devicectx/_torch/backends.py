"""The name torch's PrivateUse1 backend goes by (``torch.utils.rename_privateuse1_backend``).

``torch._C._get_privateuse1_backend_name`` is private; autocast itself calls it to find the
renamed backend's dtypes. Checked on torch 2.6.0 to 2.15.0.

Example:
    >>> privateuse1_name() in ("privateuseone", "emu")
    True
"""

import torch

__all__ = ["privateuse1_name"]


def privateuse1_name() -> str:
    """The device type of the PrivateUse1 backend: ``"privateuseone"`` unless renamed."""
    name: str = torch._C._get_privateuse1_backend_name()
    return name
