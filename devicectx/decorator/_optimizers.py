"""An optimizer argument left holding the parameters that a move replaced.

torch's ``module.to``, and
:func:`~devicectx.to_device`, keep each parameter object only between the CPU, CUDA, MPS,
XPU and HPU. To ``meta``, or to a device registered out of tree (an Ascend NPU, the
emulated accelerator), they make new parameters. An optimizer built before such a move
holds the old ones, and a step with it runs without error and trains nothing, where the
same program on CUDA trains. A call whose arguments include a module and an optimizer (or
a method of a module given an optimizer) is stopped before the body where:

- a group of the optimizer starts with a parameter off the target, and no group starts
  with one of the module's (:func:`off_target`, the look every such call takes: one
  parameter per group); and then
- the optimizer holds none of the parameters of the call's modules, and some of its
  parameters are off the target and are not arguments of the call themselves
  (:func:`left_behind`).

So these run as before: an optimizer built after the move; one over a model spread over
devices on purpose (its parameters off the target are the model's); one over a loose
parameter passed as an argument of its own (a learned temperature, stepped where it is).

Between the devices that keep parameter objects (the CPU and CUDA), the optimizer keeps
its parameters, but its state (Adam's moments) stays where it was made: torch's step then
fails, after changing part of that state (foreach Adam counts the step first), so the run
that follows the fix differs from one that never failed. Such a call is stopped before the
body (:func:`state_off`, one look per group; :func:`state_left_behind`), for torch's own
optimizers: one of a library's may keep its state elsewhere on purpose (offloaded).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from devicectx._errors import DeviceMismatchError
from devicectx._torch.module_tree import parameters_of, submodules
from devicectx.decorator import _mismatch
from devicectx.decorator._module_watch import ModuleCache, Sample
from devicectx.move import _move
from devicectx.move._paths import key_text, keyed_modules, module_path
from devicectx.move._unseen import optimizer_state_fix

__all__ = ["left_behind", "off_target", "state_left_behind", "state_off"]

_Optimizer = torch.optim.Optimizer
_Tensor = torch.Tensor


def off_target(
    optimizers: Iterable[torch.optim.Optimizer], module: nn.Module, target: torch.device
) -> bool:
    """Whether one of ``optimizers`` may hold parameters a move replaced: a group of it
    starts with a parameter off ``target`` (a left-behind optimizer has all of them off),
    and no group starts with one of ``module``'s (as over a model spread on purpose, whose
    parameters off the target are its own). The look at each call with an optimizer: one
    parameter per group, and ``module``'s parameters cached until torch reports a change."""
    for optimizer in optimizers:
        groups = optimizer.param_groups
        for group in groups:
            params = group["params"]
            if params and params[0].device != target:
                break
        else:
            continue  # every group starts on the target: the common case
        held = _parameter_ids(module)
        if not any(group["params"] and id(group["params"][0]) in held for group in groups):
            return True
    return False


def state_off(optimizers: Iterable[torch.optim.Optimizer]) -> bool:
    """Whether one of torch's ``optimizers`` may hold state off its parameters' devices:
    the state of a group's first parameter is (the look at each call with an optimizer)."""
    for optimizer in optimizers:
        state = optimizer.state
        if not state:
            continue
        for group in optimizer.param_groups:
            params = group["params"]
            held = state.get(params[0]) if params else None
            if not held:
                continue
            device = params[0].device
            for value in held.values():
                if _off(value, device) and _torchs(optimizer):
                    return True
    return False


def _torchs(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer).__module__.startswith("torch.optim")


def _off(value: object, device: torch.device) -> bool:
    """Whether ``value``, in the state of a parameter on ``device``, is a tensor off it; a
    0-dim CPU tensor (Adam's step counter) is at home anywhere, as torch keeps it."""
    return (
        isinstance(value, _Tensor)
        and value.device != device
        and (value.dim() != 0 or value.device.type != "cpu")
    )


def _behind(parameter: torch.Tensor, held: dict[Any, Any]) -> list[tuple[Any, torch.device]]:
    """The keys of ``held`` (a parameter's state) whose tensors are off its device."""
    device = parameter.device
    return [(key, value.device) for key, value in held.items() if _off(value, device)]


def state_left_behind(
    function: str, named: Sequence[tuple[str, Any]], target: torch.device, reason: str
) -> DeviceMismatchError | None:
    """The error for the first of torch's optimizer arguments holding state off its
    parameters' devices; None where none does."""
    for name, optimizer in named:
        if not isinstance(optimizer, _Optimizer) or not _torchs(optimizer):
            continue
        found: dict[torch.device, list[str]] = {}
        for parameter, held in optimizer.state.items():
            if not isinstance(parameter, torch.Tensor) or not isinstance(held, dict):
                continue
            for key, device in _behind(parameter, held):
                path = f"{name}.state[{key_text(parameter)}][{key_text(key)}]"
                found.setdefault(device, []).append(path)
        if not found:
            continue
        kind = type(optimizer).__name__
        off_cpu = [
            path for device, paths in found.items() if device.type != "cpu" for path in paths
        ]
        fix = optimizer_state_fix(name, kind, off_cpu)
        what = (
            f"{name} ({kind}) with state off its parameters' devices (a step would fail in "
            f"torch after changing part of it)"
        )
        return _mismatch.optimizer_stopped(function, what, found, target, reason, fix)
    return None


def _walk_parameter_ids(module: nn.Module) -> tuple[frozenset[int], Sample | None]:
    """The ids of ``module``'s parameters, and the first one, which a cached answer is
    checked by (:class:`~devicectx.decorator._module_watch.ModuleCache`)."""
    owned = _parameters(module)
    if not owned:
        return frozenset(), None
    owner, parameter = owned[0]
    return frozenset(id(p) for _, p in owned), Sample(owner, False, parameter, parameter.device)


def _parameters(module: nn.Module) -> list[tuple[nn.Module, nn.Parameter]]:
    """``module.parameters()``, each with its owner, walked by identity (a module class
    with ``__eq__`` and no ``__hash__`` breaks ``parameters()``)."""
    seen: set[int] = set()
    owned: list[tuple[nn.Module, nn.Parameter]] = []
    for _, owner in submodules(module):
        for parameter in parameters_of(owner).values():
            if parameter is not None and id(parameter) not in seen:
                seen.add(id(parameter))
                owned.append((owner, parameter))
    return owned


# Kept per module till torch reports a move or a registration: the ids are those of
# parameters the module holds, alive, so no other live object has one of them.
_parameter_ids: ModuleCache[frozenset[int]] = ModuleCache(_walk_parameter_ids)


def left_behind(
    function: str, named: Sequence[tuple[str, Any]], target: torch.device, reason: str
) -> DeviceMismatchError | None:
    """The error for the first optimizer argument that holds none of the parameters of
    the call's modules and some off ``target`` that no argument is; None where none does.

    Args:
        function: the qualname of the decorated function.
        named: the call's arguments by name (``self`` first, for a method).
        target: the device the call runs on.
        reason: why ``target``, in words.
    """
    modules = [(name, value) for name, value in named if isinstance(value, nn.Module)]
    if not modules:
        return None
    held = {id(p) for _, module in modules for _, p in _parameters(module)}
    passed = {
        id(tensor)
        for _, value in named
        if not isinstance(value, (nn.Module, _Optimizer))
        for _, tensor in _move.iter_tensors(value)
    }
    for name, optimizer in named:
        if not isinstance(optimizer, _Optimizer):
            continue
        places = [
            (g, i, p)
            for g, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"])
        ]
        if any(id(p) in held for _, _, p in places):
            continue
        strays = [(g, i, p) for g, i, p in places if p.device != target and id(p) not in passed]
        if not strays:
            continue
        found: dict[torch.device, list[str]] = {}
        for g, i, p in strays:
            found.setdefault(p.device, []).append(f"{name}.param_groups[{g}]['params'][{i}]")
        stale = {g for g, _, _ in strays}
        fix = _fix(name, optimizer, stale, modules, target)
        kind = type(optimizer).__name__
        what = f"{name} ({kind}) stepping parameters no module of the call holds"
        return _mismatch.optimizer_stopped(function, what, found, target, reason, fix)
    return None


def _fix(
    name: str,
    optimizer: torch.optim.Optimizer,
    stale: set[int],
    modules: Sequence[tuple[str, nn.Module]],
    target: torch.device,
) -> str:
    """Point each stale group at the module's parameters, keeping the state (which
    ``load_state_dict`` puts beside them), where one expression gives a group's
    parameters back; else say how to build the optimizer anew."""
    why = (
        f"the model's parameters are new ones (a move to {target} makes them, as does "
        f"load_state_dict(..., assign=True)), and {name} steps the old ones: it would "
        "train nothing"
    )
    groups: list[str] = []
    ties: list[str] = []
    for g, group in enumerate(optimizer.param_groups):
        if g not in stale:
            continue
        source = _source(group["params"], modules)
        if source is None:
            retied = _retied(group["params"], modules)
            if retied is not None:
                ties += [line for line in retied[0] if line not in ties]
                source = retied[1]
        if source is None:
            return (
                f"build the optimizer after the move, from {modules[0][0]}'s parameters "
                f"({why}); to keep its state, take state = {name}.state_dict() now and "
                f"{name}.load_state_dict(state) on the new optimizer"
            )
        groups.append(f"{name}.param_groups[{g}]['params'] = {source}")
    retie = f"{'; '.join(ties)} (the move untied its tied weights); " if ties else ""
    return (
        f"{retie}state = {name}.state_dict(); {'; '.join(groups)}; "
        f"{name}.load_state_dict(state) ({why}), or build the optimizer after the move"
    )


def _retied(
    params: Sequence[torch.Tensor], modules: Sequence[tuple[str, nn.Module]]
) -> tuple[list[str], str] | None:
    """Where the move untied a tied weight (``module.to`` to ``meta`` or a device out of
    tree copies each place of it apart), so that a module has more parameters than
    ``params``: the code that ties them again, and the module's parameters then; None
    where no pairing of twins (equal shape, dtype and values) accounts for every extra one.
    """
    shapes = [p.shape for p in params]
    for name, module in modules:
        named = list(module.named_parameters())
        extra = len(named) - len(params)
        if extra <= 0:
            continue
        twins: list[tuple[str, str]] = []  # (later place, the earlier one it was)
        for i, (later, tensor) in enumerate(named):
            earlier = next((q for q, p in named[:i] if _twins(p, tensor)), None)
            if earlier is not None:
                twins.append((later, earlier))
        dropped = {later for later, _ in twins}
        if len(twins) != extra or [p.shape for q, p in named if q not in dropped] != shapes:
            continue
        if callable(getattr(module, "tie_weights", None)):  # a transformers model ties its own
            return [f"{name}.tie_weights()"], f"list({name}.parameters())"
        keyed = keyed_modules(list(submodules(module)))
        lines = [
            f"{module_path(name, later, keyed)} = {module_path(name, earlier, keyed)}"
            for later, earlier in twins
        ]
        return lines, f"list({name}.parameters())"
    return None


def _twins(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may be the copies of one tied weight (on ``meta``, by kind)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    return a.is_meta or bool(torch.equal(a, b))


def _source(params: Sequence[torch.Tensor], modules: Sequence[tuple[str, nn.Module]]) -> str | None:
    """The code of a module's parameters that stand, one for one, where ``params`` (the
    old ones) stood: all of a module's, or those that require grad; None where none
    matches (a group of some of a module's parameters cannot be told from another)."""
    shapes = [p.shape for p in params]
    for name, module in modules:
        own = [p for _, p in _parameters(module)]
        if shapes == [p.shape for p in own]:
            return f"list({name}.parameters())"
        trained = [p for p in own if p.requires_grad]
        if len(trained) < len(own) and shapes == [p.shape for p in trained]:
            return f"[p for p in {name}.parameters() if p.requires_grad]"
    return None
