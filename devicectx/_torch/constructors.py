"""torch's list of tensor constructors, and TorchScript's table of them.

- :func:`device_constructors`: ``torch.utils._device._device_constructors()``, the set of
  functions torch's own ``DeviceContext`` fills ``device=`` in for. The set itself, not a
  copy: a function added to it is treated by torch's mode, traced or not, as a
  constructor (the scope adds its replacements).
- :func:`keep_builtin_ops`: ``torch.jit._builtins._builtin_table`` maps a function to its
  aten op; a replacement mapped as its original lets ``torch.jit.script`` compile code
  that calls it.

Checked on torch 2.6.0 to 2.15.0 (36 constructors, the same set).

Example:
    >>> import torch
    >>> torch.zeros in device_constructors()
    True
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch.utils._device

__all__ = ["device_constructors", "keep_builtin_ops"]


def device_constructors() -> set[Callable[..., Any]]:
    """The functions torch's ``DeviceContext`` fills in ``device=`` for (torch's own set)."""
    return cast(set[Callable[..., Any]], torch.utils._device._device_constructors())


def keep_builtin_ops(pairs: Iterable[tuple[object, Callable[..., Any]]]) -> None:
    """Map each replacement to its original's aten op in TorchScript's table of builtins,
    where it is built already (built later, it looks names up in torch: the replacements)."""
    builtins = sys.modules.get("torch.jit._builtins")
    table = getattr(builtins, "_builtin_table", None)
    if isinstance(table, dict):
        for original, replacement in pairs:
            op = table.get(id(original))
            if op is not None:
                table.setdefault(id(replacement), op)
