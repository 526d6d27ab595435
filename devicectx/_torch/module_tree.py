"""A module's tree walked by identity: its submodules and tensors, without hashing modules.

``nn.Module.named_modules`` (and so ``named_parameters``, ``named_buffers`` and
``named_children``) keeps the modules it has met in a ``set``, which a module class that
defines ``__eq__`` without ``__hash__`` cannot enter (``TypeError: unhashable type``). These
walks read the tables those methods read (``_modules``, ``_parameters``, ``_buffers``, the
dicts behind ``Module.__getattr__``), in the same order, and tell modules apart by ``id``.
Checked on torch 2.6.0, 2.13.0 and 2.15.0.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    >>> [path for path, _ in submodules(model)]
    ['', '0', '1']
    >>> [path for path, _ in tensors(model)]
    ['0.weight', '0.bias']
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = ["buffers_of", "children_of", "parameters_of", "submodules", "tensors"]

#: ``module._parameters``: the module's own parameters by name (``None`` for a registered
#: empty slot). Attrgetters, so the decorator's per-call checks pay no Python call frame.
parameters_of: Callable[[nn.Module], dict[str, nn.Parameter | None]] = operator.attrgetter(
    "_parameters"
)
#: ``module._buffers``: the module's own buffers by name.
buffers_of: Callable[[nn.Module], dict[str, torch.Tensor | None]] = operator.attrgetter("_buffers")
#: ``module._modules``: the module's direct children by name.
children_of: Callable[[nn.Module], dict[str, nn.Module | None]] = operator.attrgetter("_modules")


def submodules(module: nn.Module, *, each_place: bool = False) -> Iterator[tuple[str, nn.Module]]:
    """``module`` (as ``""``) and every module under it, by qualified name, depth first in
    registration order, as ``named_modules`` lists them.

    Args:
        each_place: list a module held at several places at each (else at the first).
    """
    seen: set[int] = set()
    pending: list[tuple[str, nn.Module]] = [("", module)]
    while pending:
        path, current = pending.pop()
        if not each_place:
            if id(current) in seen:
                continue
            seen.add(id(current))
        yield path, current
        children = [
            (f"{path}.{name}" if path else name, child)
            for name, child in current._modules.items()
            if child is not None
        ]
        pending.extend(reversed(children))


def tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter, then every buffer, of ``module`` and its submodules, at each place
    it is held (``named_parameters(remove_duplicate=False)``, then the buffers)."""
    places = list(submodules(module, each_place=True))
    for table in ("_parameters", "_buffers"):
        for path, current in places:
            for name, tensor in getattr(current, table).items():
                if tensor is not None:
                    yield (f"{path}.{name}" if path else name), tensor
