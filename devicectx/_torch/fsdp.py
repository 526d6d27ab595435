"""FSDP2's module class, and the device an FSDP2 module computes on, where torch has them.

``FSDPModule`` is looked up in ``torch.distributed.fsdp`` and in the private
``torch.distributed._composable.fsdp``, where torch releases have kept it; both in
``sys.modules`` only, so that devicectx never imports torch.distributed.

Where an FSDP2 module computes is private to torch: ``fully_shard`` fixes it when it runs
(its mesh's device type at the index current then) and keeps it as the module's state's
``_device`` (``FSDPModule._get_fsdp_state()``), which FSDP2 moves the inputs and gathers
the parameters to at each forward. Read here only, checked on torch 2.13 and 2.15 (and
present, as read, since the state was added in 2.4); on a torch without it the answer is
None and the caller falls back on the mesh.

Example:
    >>> fsdp_module_type() is None or isinstance(fsdp_module_type(), type)
    True
"""

from __future__ import annotations

import sys

import torch
from torch import nn

__all__ = ["fsdp_module_type", "fsdp_state_device"]


def fsdp_module_type() -> type | None:
    """FSDP2's ``FSDPModule``, where torch has imported it."""
    for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        found = getattr(sys.modules.get(name), "FSDPModule", None)
        if isinstance(found, type):
            return found
    return None


def fsdp_state_device(module: nn.Module) -> torch.device | None:
    """The device FSDP2 computes ``module`` on, as ``fully_shard`` fixed it; None where
    ``module`` is no FSDP2 module or this torch keeps it elsewhere."""
    fsdp = fsdp_module_type()
    if fsdp is None or not isinstance(module, fsdp):
        return None
    try:
        device = module._get_fsdp_state()._device  # type: ignore[operator]
    except Exception:  # another torch's layout: the caller has another way
        return None
    return device if isinstance(device, torch.device) else None
