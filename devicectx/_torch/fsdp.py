"""FSDP2's module class, found where torch has imported it.

``fully_shard`` lives in ``torch.distributed.fsdp`` from torch 2.6 on, and in the private
``torch.distributed._composable.fsdp`` before (still there, as an alias, up to 2.15); both
are looked up in ``sys.modules`` only, so that devicectx never imports torch.distributed.

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
