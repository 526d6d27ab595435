"""Refusing a move of modules that hold tensors on ``meta``, before any module moves.

``module.to`` moves a module in place and stops at the first tensor it cannot copy, with
the tensors before it already moved: a module holding tensors on ``meta`` (not
materialised: no data to copy) would be left half-moved, and modules met earlier in the
walk moved. :class:`~devicectx.move._rebuild.Rebuild` asks :func:`unmaterialised` before
the first module moves, with every module the move would move, and raises what it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch import nn

from devicectx._errors import MoveError, with_article
from devicectx._torch.module_tree import buffers_of, parameters_of, submodules
from devicectx.move._hooks import hooked, runs_on, unhook_fix
from devicectx.move._paths import keyed_modules, module_path
from devicectx.move._walk import module_paths

Fix = Callable[[str], str]  # a failed move's fix for a path, as Rebuild takes it

# How much a refusal of modules on meta shows: the names of a module's tensors there, and
# the modules, before a count of the rest; and how many parts of one module its fix makes
# anew one by one, before it makes the whole module anew.
_SHOWN_TENSORS = 3
_SHOWN_MODULES = 5
_PARTS_FIXED = 3


def unmaterialised(
    root: Any, modules: list[Any], device: torch.device, name: str, fix: Fix, who: str
) -> MoveError | None:
    """The refusal of a move of ``modules`` (those a walk of ``root`` will move) where some
    hold tensors on meta; None where none does.

    A module accelerate offloaded (its weights on meta behind its hooks, on purpose) is
    refused by :func:`_offloaded`, with accelerate's way out: ``cpu_offload`` patches no
    ``.to`` that would refuse first, and a buffer moved before the first weight would be
    left behind.
    """
    meta = [m for m in modules if _holds_meta(m)]
    if not meta:
        return None
    offloaded = [m for m in meta if hooked(m)]
    if offloaded:
        return _offloaded(root, offloaded, device, name, fix, who)
    held = {id(m): m for m in meta}
    paths = module_paths(root, held, name)
    lines: list[str] = []
    made: list[tuple[str, nn.Module]] = []  # what the fix makes anew on the target
    count = 0
    for key, module in held.items():
        path = paths.get(key, name)
        parts: list[tuple[str, nn.Module, list[str]]] = []
        _meta_parts(module, "", parts, set())
        count += sum(len(names) for _, _, names in parts)
        lines += [_meta_line(_below(path, q), part, names) for q, part, names in parts]
        # A few parts are made anew one by one, keeping the weights beside them; past
        # that, the whole module, whose weights are then all to load.
        whole = len(parts) > _PARTS_FIXED
        made += [(path, module)] if whole else [(_below(path, q), p) for q, p, _ in parts]
    if len(lines) > _SHOWN_MODULES + 1:
        lines[_SHOWN_MODULES:] = [f"    and {len(lines) - _SHOWN_MODULES} more modules"]
    (key, first), one = next(iter(held.items())), len(held) == 1
    what = (
        f"{paths.get(key, name)} ({with_article(type(first).__qualname__)})"
        if one
        else f"{len(held)} modules"
    )
    whose = "its" if one else "their"
    tensors = f"one of {whose} tensors is" if count == 1 else f"{count} of {whose} tensors are"
    remedy = _meta_fix(made, device)
    if one:  # the fix a failed move gives, true now that nothing moved
        remedy = f"{remedy}; or {fix(paths.get(key, name))}"
    head = f"{who} cannot move {what} to {device}, and moved nothing: {tensors} on meta,"
    return MoveError("\n".join([f"{head} with no data to copy:", *lines, f"fix: {remedy}"]))


def _offloaded(
    root: Any, modules: list[nn.Module], device: torch.device, name: str, fix: Fix, who: str
) -> MoveError:
    """The refusal of a move of ``modules``, offloaded by accelerate: its hooks load their
    weights onto an execution device at each forward, and removing them
    (``remove_hook_from_module``) puts the weights back in the module, which can then move."""
    paths = module_paths(root, {id(m): m for m in modules}, name)
    lines: list[str] = []
    runs: dict[str, None] = {}
    for module in modules:
        path = paths.get(id(module), name)
        parts: list[tuple[str, nn.Module, list[str]]] = []
        _meta_parts(module, "", parts, set())
        lines += [_meta_line(_below(path, q), part, names) for q, part, names in parts]
        for part in module.modules():
            placed = runs_on(part)
            if placed is not None and placed[1]:  # where an offloading hook loads them
                runs[str(placed[0])] = None
    if len(lines) > _SHOWN_MODULES + 1:
        lines[_SHOWN_MODULES:] = [f"    and {len(lines) - _SHOWN_MODULES} more modules"]
    first = paths.get(id(modules[0]), name)
    one = len(modules) == 1
    what = (
        f"{first} ({with_article(type(modules[0]).__qualname__)})"
        if one
        else f"{len(modules)} modules"
    )
    whose = "its" if one else "their"
    onto = f" onto {' or '.join(runs)}" if runs else ""
    head = (
        f"{who} cannot move {what} to {device}, and moved nothing: accelerate offloaded "
        f"{'it' if one else 'them'} ({whose} hooks load {whose} weights{onto} at each forward; "
        f"the module{'' if one else 's'} hold{'s' if one else ''} them on meta):"
    )
    also = f", which puts the weights back in {'it' if one else 'them'}"
    remedy = unhook_fix([paths.get(id(m), name) for m in modules], name, fix, also)
    return MoveError("\n".join([head, *lines, f"fix: {remedy}"]))


def _meta_line(path: str, part: nn.Module, names: list[str]) -> str:
    """The line naming a part and (a few of) its tensors on meta."""
    shown = ", ".join(names[:_SHOWN_TENSORS])
    if len(names) > _SHOWN_TENSORS:
        shown = f"{shown} and {len(names) - _SHOWN_TENSORS} more"
    return f"    {path} ({type(part).__qualname__}): {shown}"


def _meta_fix(made: list[tuple[str, nn.Module]], device: torch.device) -> str:
    """The fix: each part made anew on ``device`` with ``to_empty`` (what torch's own error
    asks for), then initialised, as a model built on meta is."""
    remade = "; ".join(f"{path}.to_empty(device={str(device)!r})" for path, _ in made)
    retie = _retie(made)
    if retie:
        remade = f"{remade}; {'; '.join(retie)} (to_empty unties tied weights)"
    resettable = all(hasattr(part, "reset_parameters") for _, part in made)
    if len(made) == 1:
        path = made[0][0]
        how = f"load a state dict, or {path}.reset_parameters()" if resettable else ""
        init = f"initialise it ({how or 'load a state dict'})"
    else:
        how = "load a state dict, or each one's reset_parameters()" if resettable else ""
        init = f"initialise them ({how or 'load a state dict'})"
    return f"{remade}, then {init}, before the move"


def _retie(made: list[tuple[str, nn.Module]]) -> list[str]:
    """The code that ties again what ``to_empty`` of the parts ``made`` unties: each tensor
    on meta held at several places (a tied weight) gets a tensor of its own at each.

    A part with ``tie_weights()`` (a transformers model) ties its own; elsewhere each
    other place is assigned the first one's parameter (or buffer).
    """
    places: dict[int, list[tuple[int, str]]] = {}  # id(tensor): (part, path) at each place
    owners: set[int] = set()  # a module held at several places is made anew once
    for index, (path, part) in enumerate(made):
        named = list(submodules(part))
        keyed = keyed_modules(named)
        for qualified, owner in named:
            if id(owner) in owners:
                continue
            owners.add(id(owner))
            for name, tensor in chain(parameters_of(owner).items(), buffers_of(owner).items()):
                if tensor is not None and tensor.is_meta:
                    at = module_path(path, f"{qualified}.{name}" if qualified else name, keyed)
                    places.setdefault(id(tensor), []).append((index, at))
    lines: dict[str, None] = {}  # each once, in order
    for held in places.values():
        if len(held) < 2:
            continue
        parts = {index for index, _ in held}
        (index, first), *others = held
        if len(parts) == 1 and callable(getattr(made[index][1], "tie_weights", None)):
            lines[f"{made[index][0]}.tie_weights()"] = None
        else:
            lines.update((f"{at} = {first}", None) for _, at in others)
    return list(lines)


def _holds_meta(module: nn.Module) -> bool:
    """Whether a parameter or buffer of ``module`` is on meta. Read from each module's own
    tables, as ``module.to`` reads them: this runs at every move of a module, and
    ``parameters()`` costs three times more."""
    for part in module.modules():
        for tensor in chain(parameters_of(part).values(), buffers_of(part).values()):
            if tensor is not None and tensor.is_meta:
                return True
    return False


def _meta_parts(
    module: nn.Module,
    qualified: str,
    parts: list[tuple[str, nn.Module, list[str]]],
    seen: set[int],
) -> None:
    """Add to ``parts`` the parts of ``module`` (at ``qualified``) that hold tensors on meta,
    as ``(qualified name, part, names of those tensors)``: a part whose tensors are all on
    meta whole, as ``to_empty`` can make it anew with nothing lost; else each module's own
    tensors there, its submodules looked into."""
    if id(module) in seen:
        return
    seen.add(id(module))
    named = list(chain(module.named_parameters(), module.named_buffers()))
    if not any(t.is_meta for _, t in named):
        return
    if all(t.is_meta for _, t in named):
        parts.append((qualified, module, [name for name, _ in named]))
        return
    own = chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False))
    names = [name for name, t in own if t.is_meta]
    if names:
        parts.append((qualified, module, names))
    for name, child in module.named_children():
        _meta_parts(child, f"{qualified}.{name}" if qualified else name, parts, seen)


def _below(path: str, qualified: str) -> str:
    """The path of the submodule at ``qualified`` (``""``: itself) of the module at ``path``."""
    return module_path(path, qualified) if qualified else path
