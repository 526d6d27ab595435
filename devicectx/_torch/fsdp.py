"""FSDP2's module class, found where torch has imported it.

``FSDPModule`` is looked up in ``torch.distributed.fsdp`` and in the private
``torch.distributed._composable.fsdp``, where torch releases have kept it; both in
``sys.modules`` only, so that devicectx never imports torch.distributed.

Example:
    >>> fsdp_module_type() is None or isinstance(fsdp_module_type(), type)
    True
"""

from __future__ import annotations

import sys

__all__ = ["fsdp_module_type"]


def fsdp_module_type() -> type | None:
    """FSDP2's ``FSDPModule``, where torch has imported it."""
    for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        found = getattr(sys.modules.get(name), "FSDPModule", None)
        if isinstance(found, type):
            return found
    return None
