"""Models wrapped for distributed training, and the refusal of a move of them.

``DistributedDataParallel`` and FSDP2's ``fully_shard`` take a model already on its device
and hold on to that placement: DDP's reducer keeps syncing the parameters it was given
(``module.to`` to ``meta`` or to an out-of-tree device makes new ones, which it never
sees, so each rank trains alone), and ``fully_shard`` fixes the device it computes on
when it runs (a moved model fails at its next forward, in torch). :func:`wrapped` refuses a
move that would change where such a model's tensors are, before any module moves, with
the decorator's fix: move the model, then wrap it. A wrapped model already on the target
moves nothing and is not refused. ``DataParallel`` is not refused: it copies its model
onto its devices at each forward, and torch's own recipe moves it after wrapping.

Example:
    >>> from torch import nn
    >>> model = nn.Linear(2, 2)
    >>> wrapped(model, [model], torch.device("meta"), "obj", str, "to_device()") is None
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from devicectx._errors import MoveError, with_article
from devicectx._torch.fsdp import fsdp_module_type
from devicectx._torch.module_tree import submodules, tensors
from devicectx.move._distributed import fsdp_compute_device
from devicectx.move._paths import module_path
from devicectx.move._walk import module_paths

__all__ = ["wrapped"]

Fix = Callable[[str], str]  # a failed move's fix for a path, as Rebuild takes it

_SHOWN = 5  # how many wrapped modules a refusal names before a count of the rest


def wrapped(
    root: Any, modules: list[nn.Module], device: torch.device, name: str, fix: Fix, who: str
) -> MoveError | None:
    """The refusal of a move of ``modules`` (those a walk of ``root`` will move) to
    ``device`` where one is, or holds, a DDP or FSDP2 module with tensors elsewhere; None
    where none does (the common case: one look at each submodule's type)."""
    found: list[tuple[nn.Module, str, nn.Module, str]] = []  # (module, qualname, part, wrapper)
    for module in modules:
        found += _moving_wrappers(module, device)
    if not found:
        return None
    paths = module_paths(root, {id(m): m for m, _, _, _ in found}, name)
    named = [
        (_below(paths.get(id(module), name), q), part, wrapper)
        for module, q, part, wrapper in found
    ]
    lines = [
        f"    {path} ({type(part).__qualname__}): parameters on {_devices(part, device)}"
        for path, part, _ in named
    ]
    if len(lines) > _SHOWN + 1:
        lines[_SHOWN:] = [f"    and {len(lines) - _SHOWN} more modules"]
    first_path, first, wrapper = named[0]
    what = (
        f"{first_path} ({with_article(type(first).__qualname__)})"
        if len(named) == 1
        else f"{len(named)} wrapped modules"
    )
    head = f"{who} cannot move {what} to {device}, and moved nothing: {_why(first, wrapper)}:"
    leave = f"leave it where it is: do not move {name}" if first_path == name else fix(first_path)
    return MoveError("\n".join([head, *lines, f"fix: {leave}; or {wrap_fix(wrapper, device)}"]))


def wrap_fix(wrapper: str, device: torch.device) -> str:
    """Move the model, then wrap it: as the decorator's refusal of a wrapped model off its
    target words it (:func:`devicectx.decorator._mismatch.module_off_target`)."""
    wrap = f"{wrapper}(model, ...)" if wrapper[:1].isupper() else f"{wrapper}(model)"
    return (
        f'move the model before wrapping it: model.to("{device}"), then {wrap}; a wrapped '
        f"model is not moved afterwards (and never implicitly)"
    )


def _moving_wrappers(
    module: nn.Module, device: torch.device
) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """The outermost DDP and FSDP2 modules of ``module`` (itself included) with a tensor
    off ``device``: ``(module, qualified name, the wrapped module, what wrapped it)``."""
    found: list[tuple[nn.Module, str, nn.Module, str]] = []
    for qualified, part in submodules(module):
        if any(not q or qualified.startswith(f"{q}.") for _, q, _, _ in found):
            continue  # inside one found already: its outermost wrapper says it all
        wrapper = _wrapper(part)
        if wrapper is not None and any(t.device != device for _, t in tensors(part)):
            found.append((module, qualified, part, wrapper))
    return found


def _wrapper(module: nn.Module) -> str | None:
    """``"DistributedDataParallel"`` or ``"fully_shard"``: what wrapped ``module`` and
    keeps its placement; None for any other module."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return "DistributedDataParallel"
    fsdp = fsdp_module_type()
    if fsdp is not None and isinstance(module, fsdp):
        return "fully_shard"
    return None


def _why(module: nn.Module, wrapper: str) -> str:
    """Why a move of a model ``wrapper`` wrapped breaks it."""
    if wrapper == "fully_shard":
        compute = fsdp_compute_device(module)
        return (
            f"fully_shard fixed the device it computes on ({compute}) when it ran, so a moved "
            f"model would fail at its next forward"
        )
    return (
        f"{wrapper} keeps syncing the parameters it was given, so a moved model's gradients "
        f"would no longer be averaged across processes"
    )


def _devices(module: nn.Module, device: torch.device) -> str:
    """The devices of ``module``'s tensors off ``device``, in the order met."""
    found = dict.fromkeys(str(t.device) for _, t in tensors(module) if t.device != device)
    return ", ".join(found)


def _below(path: str, qualified: str) -> str:
    """The path of the submodule at ``qualified`` (``""``: itself) of the module at ``path``."""
    return module_path(path, qualified) if qualified else path
