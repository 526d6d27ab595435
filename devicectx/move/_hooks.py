"""Modules accelerate hooked: where each part runs, and the refusal of a move of them.

accelerate (``dispatch_model``, ``cpu_offload``, transformers' ``device_map=``) puts an
``AlignDevicesHook`` on each part it places, which moves the part's inputs to its
*execution device* at every forward, and, for a part it offloaded, loads its weights there
from ``meta``. Moving such a model as a whole breaks that: a part moved off its hook's
device gets its inputs on that device and fails inside the hook, in torch; an offloaded
part has no data on ``meta`` to copy. :func:`dispatched` refuses the first before any
module moves, with accelerate's way out (``remove_hook_from_module``);
:mod:`devicectx.move._unmaterialised` refuses the second, with the same way out, which
also puts the weights back in the modules.

accelerate is never imported: its hooks are read by duck typing from the attribute
``_hf_hook`` that ``add_hook_to_module`` sets on each hooked module (``execution_device``
and ``offload``; a ``SequentialHook``'s ``.hooks``), as in accelerate 0.20 to 1.15.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class AlignDevicesHook:  # accelerate's, as it reads to duck typing
    ...     execution_device, offload = torch.device("cpu"), False
    >>> placed = nn.Linear(2, 2)
    >>> placed._hf_hook = AlignDevicesHook()
    >>> runs_on(placed)
    (device(type='cpu'), False)
    >>> runs_on(nn.Linear(2, 2)) is None
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from devicectx._errors import DeviceError, MoveError, with_article
from devicectx._torch.module_tree import submodules
from devicectx.devices._resolve import resolve_device
from devicectx.move._paths import module_path
from devicectx.move._walk import module_paths

__all__ = ["HOOK", "dispatched", "hook_device", "hooked", "runs_on", "unhook_fix"]

Fix = Callable[[str], str]  # a failed move's fix for a path, as Rebuild takes it

HOOK = "_hf_hook"  # accelerate's add_hook_to_module sets it on every hooked module
# How many hooked parts a refusal names before a count of the rest.
_SHOWN = 5


def runs_on(module: nn.Module) -> tuple[torch.device, bool] | None:
    """Where accelerate's hook on ``module`` (not its parts) runs it, and whether it
    offloads its weights; None without such a hook (none, or one that places nothing:
    ``cpu_offload_with_hook``'s ``CpuOffload`` moves the whole module to its device at
    each forward, so anywhere is in place)."""
    hook = module.__dict__.get(HOOK)
    if hook is None:
        return None
    for each in getattr(hook, "hooks", None) or (hook,):  # a SequentialHook holds several
        device = getattr(each, "execution_device", None)
        if device is not None and hasattr(each, "offload"):  # an AlignDevicesHook
            return hook_device(device), bool(each.offload)
    return None


def hook_device(spec: object) -> torch.device:
    """accelerate's execution device (an int is an index of the accelerator, as torch
    and accelerate read it), as ``tensor.device`` writes it."""
    if isinstance(spec, torch.device) and (spec.index is not None or spec.type in ("cpu", "meta")):
        return spec
    try:
        return resolve_device(spec)  # type: ignore[arg-type]
    except DeviceError:
        # Not available here (a device ordinal this process cannot see): as written.
        return spec if isinstance(spec, torch.device) else torch.device(str(spec))


def hooked(module: nn.Module) -> bool:
    """Whether accelerate hooked ``module`` or a part of it."""
    return any(HOOK in vars(part) for part in module.modules())


def dispatched(
    root: Any, modules: list[nn.Module], device: torch.device, name: str, fix: Fix, who: str
) -> MoveError | None:
    """The refusal of a move of ``modules`` (those a walk of ``root`` will move, none
    holding tensors on ``meta``) to ``device`` where a part's hook runs it elsewhere; None
    where none does (the common case: one look at each part's attributes)."""
    elsewhere: list[tuple[nn.Module, list[tuple[str, nn.Module, torch.device]]]] = []
    for module in modules:
        if not hooked(module):
            continue
        away = [
            (q, part, placed[0])
            for q, part in submodules(module)
            if (placed := runs_on(part)) is not None and placed[0] != device
        ]
        if away:
            elsewhere.append((module, away))
    if not elsewhere:
        return None
    paths = module_paths(root, {id(m): m for m, _ in elsewhere}, name)
    lines: list[str] = []
    for module, away in elsewhere:
        path = paths.get(id(module), name)
        lines += [
            f"    {_below(path, q)} ({type(part).__qualname__}): its hook runs it on {where}"
            for q, part, where in away
        ]
    if len(lines) > _SHOWN + 1:
        lines[_SHOWN:] = [f"    and {len(lines) - _SHOWN} more parts"]
    one = len(elsewhere) == 1
    first = elsewhere[0][0]
    what = (
        f"{paths.get(id(first), name)} ({with_article(type(first).__qualname__)})"
        if one
        else f"{len(elsewhere)} modules"
    )
    head = (
        f"{who} cannot move {what} to {device}, and moved nothing: accelerate dispatched "
        f"{'it' if one else 'them'} (at each forward, each part's hook moves its inputs to "
        f"the device it names, so a part moved off that device would fail there, in torch):"
    )
    remedy = unhook_fix([paths.get(id(m), name) for m, _ in elsewhere], name, fix, "")
    return MoveError("\n".join([head, *lines, f"fix: {remedy}"]))


def unhook_fix(paths: list[str], name: str, fix: Fix, also: str) -> str:
    """The fix for hooked modules at ``paths``: leave them, or remove accelerate's hooks
    (which does ``also``) before moving them."""
    one = len(paths) == 1
    # skip= leaves parts of a structure where they are, never the whole object.
    leave = f"leave it where it is: do not move {name}" if paths[0] == name else fix(paths[0])
    removes = "; ".join(f"remove_hook_from_module({path}, recurse=True)" for path in paths)
    it = "it" if one else "them"
    return (
        f"{leave if one else 'leave them where they are'}; or, to move {it}, first remove "
        f"accelerate's hooks{also}: from accelerate.hooks import remove_hook_from_module; "
        f"{removes}"
    )


def _below(path: str, qualified: str) -> str:
    """The path of the submodule at ``qualified`` (``""``: itself) of the module at ``path``."""
    return module_path(path, qualified) if qualified else path
