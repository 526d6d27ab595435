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
    >>> tied = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4, bias=False))
    >>> tied[1].weight = tied[0].weight
    >>> moved = move(tied, torch.device("meta"))  # torch's tied.to("meta") unties them
    >>> tied[1].weight is tied[0].weight
    True
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "buffers_of",
    "children_of",
    "makes_new_parameters",
    "move",
    "parameters_of",
    "restorer",
    "submodules",
    "tensors",
]

#: ``module._parameters``: the module's own parameters by name (``None`` for a registered
#: empty slot). Attrgetters, so the decorator's per-call checks pay no Python call frame.
parameters_of: Callable[[nn.Module], dict[str, nn.Parameter | None]] = operator.attrgetter(
    "_parameters"
)
#: ``module._buffers``: the module's own buffers by name.
buffers_of: Callable[[nn.Module], dict[str, torch.Tensor | None]] = operator.attrgetter("_buffers")
#: ``module._modules``: the module's direct children by name.
children_of: Callable[[nn.Module], dict[str, nn.Module | None]] = operator.attrgetter("_modules")


# The device types between which torch's ``Module.to`` changes a parameter's data in place,
# keeping the Parameter object (and so a tied weight, one object at several places, and an
# optimizer's hold on it): the backends c10's ``TensorImpl::has_compatible_shallow_copy_type``
# counts as dense (torch 2.6 to 2.15). Between any others (meta, a backend registered out of
# tree, XLA) it makes a new Parameter at each place.
_CHANGED_IN_PLACE = ("cpu", "cuda", "mps", "xpu", "hpu", "mtia")


def makes_new_parameters(source: torch.device, destination: torch.device) -> bool:
    """Whether ``module.to(destination)`` replaces a parameter on ``source`` with a new
    Parameter object (at each place a tied weight is held), rather than keeping it.

    torch keeps the object where it can change its data in place (between the dense
    backends), or swaps its contents under
    ``torch.__future__.set_swap_module_params_on_conversion(True)``; it makes a new one
    under ``set_overwrite_module_params_on_conversion(True)``.

    Example:
        >>> makes_new_parameters(torch.device("cpu"), torch.device("meta"))
        True
        >>> makes_new_parameters(torch.device("cpu"), torch.device("cpu"))
        False
    """
    if torch.__future__.get_swap_module_params_on_conversion():
        return False
    if torch.__future__.get_overwrite_module_params_on_conversion():
        return True
    if source.type == destination.type:
        return False
    return source.type not in _CHANGED_IN_PLACE or destination.type not in _CHANGED_IN_PLACE


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


def move(
    module: nn.Module,
    device: torch.device,
    *,
    non_blocking: bool = False,
    earlier: Callable[[torch.Tensor], torch.Tensor | None] = lambda tensor: None,
) -> nn.Module:
    """``module.to(device)``, with each tensor that modules share (a tied weight: an
    embedding and the output head of a language model) still one tensor after the move.

    torch's ``Module.to`` keeps a parameter object only where it can change its data in
    place (between CPU, CUDA, MPS, XPU, HPU tensors): to ``meta``, or to a device registered
    out of tree (PrivateUse1: Ascend NPUs, the emulated accelerator), it gives every place
    a parameter of its own, and a tied weight trains as two. Each place that held the
    shared tensor gets the one its first place got, in :func:`tensors`' order.

    Args:
        earlier: what an earlier move of another module made of a tensor this module shares
            with it (``None`` if nothing): the places holding that tensor get that result,
            so modules moved one by one stay tied to each other too.
    """
    shared = _places(module, earlier)
    module.to(device, non_blocking=non_blocking)
    for original, places in shared:
        (owner, table, name), *others = places
        kept = earlier(original)
        if kept is None:
            kept = getattr(owner, table)[name]
            places = others
        for owner, table, name in places:
            slots = getattr(owner, table)
            if slots.get(name) is not kept:
                slots[name] = kept
    return module


def restorer(module: nn.Module) -> Callable[[], None]:
    """What puts ``module``'s tensors back as they are now, called after a ``module.to``
    that failed midway (out of memory at its fifth layer) or a move that failed after it.

    Each place holds its tensor object again (``module.to`` gives a place a new object
    between most devices); a parameter that ``module.to`` kept, moving its data in place
    (CPU and CUDA: ``set_data``; ``torch.__future__``'s swap: ``swap_tensors``), gets
    its memory back, and its gradient with it. RNNs list their weights apart from their
    tables (``_flat_weights``): listed again, as their own ``_apply`` does.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> weight = model[0].weight
        >>> put_back = restorer(model)
        >>> _ = model.to("meta")
        >>> put_back()
        >>> model[0].weight is weight, weight.device.type
        (True, 'cpu')
    """
    owners = [current for _, current in submodules(module)]
    tables: list[tuple[dict[str, Any], dict[str, Any]]] = [
        (table, dict(table)) for owner in owners for table in (owner._parameters, owner._buffers)
    ]
    kept: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]
    kept = {}
    for owner in owners:
        for tensor in owner._parameters.values():
            if tensor is not None and id(tensor) not in kept:
                grad = tensor.grad
                data = tensor.data
                kept[id(tensor)] = (tensor, data, grad, None if grad is None else grad.data)

    rnns = [owner for owner in owners if hasattr(owner, "_flat_weights_names")]

    def restore() -> None:
        for table, saved in tables:
            table.update(saved)
        for rnn in rnns:  # its weak references to its weights: swap_tensors refuses those
            rnn.__dict__["_flat_weight_refs"] = []
        for tensor, data, grad, grad_data in kept.values():
            _give_back(tensor, data)
            if grad is not None and grad_data is not None:
                _give_back(grad, grad_data)
                if tensor.grad is not grad:
                    tensor.grad = grad
        for rnn in rnns:  # an RNN lists its weights apart, as its own _apply does again
            getattr(rnn, "_init_flat_weights")()  # noqa: B009  (typed as a tensor)

    return restore


def _give_back(tensor: torch.Tensor, data: torch.Tensor) -> None:
    """``tensor`` made to hold ``data``'s memory again, where ``module.to`` moved it in place."""
    if tensor.device == data.device:  # a move in place changes the device
        return
    with torch.no_grad():
        try:
            tensor.data = data  # between devices whose tensors take each other's data
        except RuntimeError:  # swapped (torch.__future__), or a subclass's own .data
            torch.utils.swap_tensors(tensor, _alike(tensor, data))  # type: ignore[no-untyped-call]


def _alike(tensor: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """A tensor of ``tensor``'s kind holding ``data``, for ``swap_tensors``."""
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(data, requires_grad=tensor.requires_grad)
    return data


_Place = tuple[nn.Module, str, str]
"""A tensor's place in a module: its owner, ``"_parameters"`` or ``"_buffers"``, its name."""


def _places(
    module: nn.Module, earlier: Callable[[torch.Tensor], torch.Tensor | None]
) -> list[tuple[torch.Tensor, list[_Place]]]:
    """The tensors of ``module`` to tie again after its move, with their places in
    :func:`tensors`' order: each held at several places, or moved already (``earlier``)."""
    places: dict[int, tuple[torch.Tensor, list[_Place]]] = {}
    owners = [current for _, current in submodules(module)]
    for table in ("_parameters", "_buffers"):
        for current in owners:
            for name, tensor in getattr(current, table).items():
                if tensor is not None:
                    places.setdefault(id(tensor), (tensor, []))[1].append((current, table, name))
    return [
        (tensor, held)
        for tensor, held in places.values()
        if len(held) > 1 or earlier(tensor) is not None
    ]
