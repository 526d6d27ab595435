"""The text of ``@device_agnostic``'s errors: what was found where, the target, and the fix.

Every message has the same four parts, so a reader learns the shape once::

    train.loss() got tensors on 2 devices:
        meta <- pred, batch['mask']
        cpu  <- target
    target meta (from the parameters of model (Net))
    fix: pass target.to("meta"), or use @device_agnostic(move=True) to move the arguments

Only plain values (names, paths, devices) come in, so the same functions build the
message in eager code and, at trace time, for :mod:`devicectx.decorator._compiled`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from devicectx._errors import DeviceMismatchError
from devicectx._torch.module_tree import makes_new_parameters
from devicectx.decorator._spread import Part, path_of
from devicectx.devices._capabilities import missing_dtypes, nearest_dtype
from devicectx.move._dtypes import code_of, module_casts
from devicectx.move._paths import within

# Paths shown per device before "and N more": enough to find the culprit, short enough to read.
_MAX_PATHS = 6
# Arguments named in a "pass x.to(...)" fix before "...".
_MAX_FIXES = 3


def tensors_off_target(
    function: str,
    found: Mapping[torch.device, Sequence[str]],
    target: torch.device,
    reason: str,
    mend: str | None = None,
    dtypes: Mapping[str, Collection[torch.dtype]] | None = None,
) -> DeviceMismatchError:
    """``move=False`` and some tensors are not on ``target``.

    Args:
        function: the qualname of the decorated function.
        found: each device with the paths of the argument tensors on it, in the order met.
        target: the device the call needs.
        reason: why ``target``, in words (``"@device_agnostic(device=\\"meta\\")"``).
        mend: how to write an object's own ``.to`` that leaves its tensors behind, where
            one does: moving the object with it would not do, so the fix starts there.
        dtypes: the dtypes of each argument's tensors, where known: the fix's moves cast
            those ``target`` lacks.
    """
    off = [path for device, paths in found.items() if device != target for path in paths]
    calls = _to_calls(off, target, dtypes)
    fix = f"pass {calls}, or use @device_agnostic(move=True) to move the arguments"
    if mend is not None:
        fix = f"{mend}; then {fix}"
    if len(found) == 1:  # all on one device, the wrong one
        what = f"tensors on {next(iter(found))}, not on its target"
        return _error(function, what, found, target, reason, fix, count=False)
    return _error(function, "tensors", _target_first(found, target), target, reason, fix)


def instance_off_target(
    function: str,
    kind: str,
    found: Mapping[torch.device, Sequence[str]],
    target: torch.device,
    reason: str,
    own: bool,
    moves: bool,
    mend: str | None = None,
    dtypes: Collection[torch.dtype] = (),
) -> DeviceMismatchError:
    """A decorated method's instance (no module: a dataclass, a NamedTuple, a registered
    container, an object with a ``.to`` of its own) holds tensors off ``target``.

    The instance is the caller's object, which the call never moves (a copy would be lost
    to the caller, as a module's would): the fix moves it before the call, and keeps what
    the move returns.

    Args:
        function: the qualname of the decorated method.
        kind: the instance's class name.
        found: each device with the paths of the instance's tensors (``self.w``).
        target: the device the call needs.
        reason: why ``target``, in words.
        own: the instance moves with a ``.to`` of its own (else ``to_device`` moves it).
        moves: the decorator moves arguments (``move=True``): an argument holding the
            object would be moved, which the fix offers too.
        mend: how to write an own ``.to`` that leaves the tensors behind, where it does.
        dtypes: the dtypes of the instance's tensors, for a move that casts what
            ``target`` cannot hold.
    """
    called = method_call(function)
    move = f"obj.to({_quote(target)})" if own else move_code("obj", False, target, dtypes)
    fix = (
        f"obj = {move} before {called}, where obj is the {kind} you call it on "
        f"(@device_agnostic checks self but never moves it: it is the caller's object)"
    )
    if moves:
        fix += f", or take the {kind} as an argument of a decorated function, which moves it"
    if mend is not None:
        fix = f"{mend}; then {fix}"
    what = f"self ({kind}) with tensors"
    if len(found) == 1:
        what = f"{what} on {next(iter(found))}, not on its target"
        return _error(function, what, found, target, reason, fix, count=False)
    return _error(function, what, _target_first(found, target), target, reason, fix)


def moved_in_function(
    function: str,
    owner: str,
    found: Mapping[torch.device, Sequence[str]],
    target: torch.device,
    reason: str,
    dtypes: Mapping[str, Collection[torch.dtype]] | None = None,
    *,
    set_up: bool = False,
) -> DeviceMismatchError:
    """Tensors that require grad, to be moved inside the ``forward`` of the
    ``autograd.Function`` named ``owner``: its backward would return their gradients on
    ``target``, which torch refuses ("invalid gradient"), so the move belongs before
    ``apply``. With ``set_up`` (a forward of the ``setup_context`` form), any tensor:
    ``setup_context`` sees the inputs as passed to ``apply``, not the moved ones.

    Args:
        function: the qualname of the decorated function (``Scale.forward``).
        owner: the Function's name (``Scale``).
        found: each device with the paths of the tensors that require grad on it.
        target: the device the call would move them to.
        reason: why ``target``, in words.
        dtypes: the dtypes of each argument's tensors, where known.
    """
    off = [path for paths in found.values() for path in paths]
    why = (
        f"{owner}.setup_context is given the inputs as passed to {owner}.apply, not moved"
        if set_up
        else f"a move inside forward has no backward, and {owner}.backward must return "
        f"each gradient on its input's device"
    )
    fix = (
        f"pass {_to_calls(off, target, dtypes)} to {owner}.apply, or decorate the function "
        f"that calls {owner}.apply instead of {function}: {why}"
    )
    what = "tensors" if set_up else "tensors that require grad"
    if len(found) == 1:
        what = f"{what} on {next(iter(found))}, not on its target"
        return _error(function, what, found, target, reason, fix, count=False)
    return _error(function, what, found, target, reason, fix)


def method_call(function: str) -> str:
    """How code calls the decorated method ``function`` (a qualname) on an object ``obj``.

    Example:
        >>> method_call("Loss.__call__"), method_call("Affine.apply")
        ('obj(...)', 'obj.apply(...)')
    """
    method = function.rpartition(".")[2]
    return "obj(...)" if method == "__call__" else f"obj.{method}(...)"


def no_common_device(
    function: str,
    found: Mapping[torch.device, Sequence[str]],
    move: bool = True,
) -> DeviceMismatchError:
    """Nothing chose a target, and the argument tensors do not agree on one; ``move``: the
    decorator's option, without which a target moves nothing (the fix then passes the
    tensors on one device)."""
    reason = "no device= argument, no nn.Module involved and no on_device block to choose one"
    home = next(iter(found))
    first = _quote(home)
    if move:
        fix = (
            f"name the device with @device_agnostic(device={first}), "
            f"or call {function}() inside `with on_device({first}):`"
        )
    else:
        off = [path for device, paths in found.items() if device != home for path in paths]
        fix = (
            f"pass {_to_calls(off, home)}, or use @device_agnostic(device={first}) (without "
            f"move=False) to move the arguments there"
        )
    return _error(function, "tensors", found, None, reason, fix)


def module_off_target(
    function: str,
    module: str,
    kind: str,
    found: Mapping[torch.device, Sequence[str]],
    target: torch.device | None,
    reason: str,
    wrapper: str | None = None,
    dtypes: Sequence[tuple[str, torch.dtype]] = (),
    shared: Collection[torch.device] = (),
) -> DeviceMismatchError:
    """The module involved is spread over several devices, or is not on ``target``.

    Args:
        function: the qualname of the decorated function.
        module: how the call names the module: ``"model"``, or ``"self"`` for a method.
        kind: the module's class name (``"Linear"``).
        found: each device with the paths of the module's parameters and buffers on it
            (a module wholly on one device is listed by its own name).
        target: the device the call needs; ``None`` when only the module could choose.
        reason: why ``target`` (or, without one, why there is none), in words.
        wrapper: ``"DistributedDataParallel"``, ``"fully_shard"``, ...: what wrapped the
            module, which must be given a model already on its device.
        dtypes: the module's tensors by path, with their dtypes: where the destination
            cannot hold some (float64 on MPS), the fix casts their modules first.
        shared: the devices of the tensors the module holds at several places (a tied
            weight, :func:`~devicectx.decorator._target.shared_devices`): where
            ``module.to`` would give each place a copy of its own, the fix moves it with
            ``to_device``, which keeps them one tensor.
    """
    destination = target if target is not None else next(iter(found))
    keep = any(makes_new_parameters(device, destination) for device in shared)
    # Wholly on meta (made under init_empty_weights, not loaded): no data for .to to copy.
    from_meta = destination.type != "meta" and all(device.type == "meta" for device in found)
    move, unheld = _cast_and_move(module, destination, dtypes, keep, from_meta)
    if len(found) > 1:
        what = f"{module} ({kind}) with parameters on {len(found)} devices"
    else:
        what = f"{module} ({kind}) on {next(iter(found))}, not on its target"
    if wrapper is None:
        fix = f"{move} before calling {function}(): modules are never moved implicitly"
    else:
        wrap = f"{wrapper}(model, ...)" if wrapper[:1].isupper() else f"{wrapper}(model)"
        fix = (
            f"move the model before wrapping it: {move}, then "
            f"{wrap}; a wrapped model is not moved afterwards (and never implicitly)"
        )
    if unheld:
        fix = f"{fix} ({unheld})"
    shown = _target_first(found, target) if target is not None else found
    return _error(function, what, shown, target, reason, fix, count=False)


def spread_strays(
    function: str,
    module: str,
    kind: str,
    parts: Sequence[Part],
    target: torch.device,
    reason: str,
    on_purpose: bool,
    keyed: Collection[str] = (),
    dtypes: Sequence[tuple[str, torch.dtype]] = (),
    stand_ins: Mapping[str, torch.device] | None = None,
) -> DeviceMismatchError:
    """A module on several devices with parts off where they should be: a split nothing
    declares (``on_purpose`` False), or a part moved off the device its hook runs it on.

    Args:
        function: the qualname of the decorated function.
        module: how the call names the module (``"model"``, ``"self"``).
        kind: the module's class name.
        parts: every part of the module (:meth:`SpreadModel.parts`), strays marked.
        target: the device the call runs on.
        reason: the rule that chose ``target``, in words.
        on_purpose: accelerate's hooks or a declaration place the parts.
        keyed: the module's ``ModuleDict`` and ``ParameterDict`` modules, by qualified
            name (:attr:`SpreadModel.keyed`), for the paths.
        dtypes: the module's tensors by path, with their dtypes: where a part's destination
            cannot hold some (float64 on MPS), the fix casts them before moving the part.
        stand_ins: plain tensors in the module's parameters' places, by qualified name
            (:func:`~devicectx.decorator._spread.stand_ins`): where they alone are off the
            device of the module's own parameters, the fix is to pass them there, not to
            move the module.
    """
    found: dict[torch.device, list[str]] = {}
    for part in parts:
        path = path_of(module, part.path, keyed)
        if on_purpose and part.expected is not None and part.hooked:
            path = f"{path} (its hook runs it on {part.expected})"
        elif on_purpose and part.expected is not None:
            path = f"{path} (off where {module} starts, {part.expected})"
        elif part.device != part.runs_on:
            path = f"{path} (offloaded, runs on {part.runs_on})"
        found.setdefault(part.device, []).append(path)
    strays = [part for part in parts if part.expected is not None]
    # A tied weight in place for some of its modules: moving it would move theirs.
    movable = [part for part in strays if not part.tied]
    # Parts holding a tied weight that module.to() would untie on the way.
    untied = [
        p
        for p in movable
        if p.shared and p.expected is not None and makes_new_parameters(p.device, p.expected)
    ]
    # Where every part is off, or a tied weight's modules, moved one by one, would each get a
    # copy of their own, the module is moved whole (its parts in place stay as they are).
    whole = len(strays) == len(parts) or len(strays) > _MAX_FIXES or bool(untied)
    destinations: dict[tuple[str, torch.device], bool] = {}  # (path, to): keep its ties
    empty: set[tuple[str, torch.device]] = set()  # those with tensors on meta: no data to copy
    if not on_purpose and whole:
        destinations[module, target] = any(
            p.shared and makes_new_parameters(p.device, target) for p in parts
        )
        if target.type != "meta" and all(p.device.type == "meta" for p in parts):
            empty.add((module, target))
    else:
        for part in movable:
            if part.expected is not None:
                key = (path_of(module, part.owner, keyed), part.expected)
                destinations[key] = destinations.get(key, False) or part in untied
                if part.expected.type != "meta" and all(
                    p.device.type == "meta" for p in parts if within(p.path, part.owner)
                ):
                    empty.add(key)
    calls = dict(
        _cast_and_move(path, to, dtypes, keep, (path, to) in empty)
        for (path, to), keep in destinations.items()
    )
    unheld = "; ".join(dict.fromkeys(why for why in list(calls.values())[:_MAX_FIXES] if why))
    # Casts are statements parted by "; ": the moves are then parted so too, not by commas.
    parted = "; " if unheld else ", "
    moves = parted.join(list(calls)[:_MAX_FIXES])
    moves += f"{parted}..." if len(calls) > _MAX_FIXES else ""
    n = len({part.device for part in parts})
    if on_purpose:
        off = len(strays)
        # Gathered onto one device while hooks still run parts elsewhere: "on cuda:0".
        spread = f"spread over {n} devices" if n > 1 else f"on {parts[0].device}"
        what = f"{module} ({kind}) {spread}, {off} part{'s' if off != 1 else ''} off"
        where = (
            "on the device its hook runs it on"
            if all(p.hooked for p in movable)
            else "where it runs"
        )
        held = f" ({unheld})" if unheld else ""
        fixes = [f"{moves} before calling {function}(): each part {where}{held}"] if movable else []
        fixes.extend(_untie(module, part, keyed) for part in strays if part.tied)
        fix = "; ".join(dict.fromkeys(fixes))
    else:
        what = f"{module} ({kind}) with {_held(parts)} on {n} devices"
        held = f"; {unheld}" if unheld else ""
        fix = _stand_ins_fix(module, kind, parts, stand_ins or {}, keyed) or (
            f"{moves} before calling {function}() (modules are never moved implicitly{held}), "
            f"or declare_spread({module}) if the split is on purpose"
        )
    shown = _target_first(found, target)
    return _error(function, what, shown, target, reason, fix, count=False)


def _stand_ins_fix(
    module: str,
    kind: str,
    parts: Sequence[Part],
    stand_ins: Mapping[str, torch.device],
    keyed: Collection[str],
) -> str | None:
    """The fix where the tensors off the device of the module's own parameters are all
    stand-ins put in their places for the call (``functional_call``'s dict): moving the
    module, the usual fix, would move the model itself for good."""
    own = {
        part.device
        for part in parts
        if not any(within(name, part.path) or within(part.path, name) for name in stand_ins)
    }
    if len(own) != 1:
        return None
    (home,) = own
    off = [name for name, device in stand_ins.items() if device != home]
    if not off:
        return None
    paths = ", ".join(path_of(module, name, keyed) for name in off)
    these = "a tensor" if len(off) == 1 else "tensors"
    return (
        f"pass {', '.join(off)} on {home}, where {kind}'s own parameters are: {paths} "
        f"{'is' if len(off) == 1 else 'are'} {these} put in place of {kind}'s for this "
        f"call (the dict given to torch.func.functional_call, say): "
        f'{{"{off[0]}": tensor.to("{home}")}}'
    )


def optimizer_stopped(
    function: str,
    what: str,
    found: Mapping[torch.device, Sequence[str]],
    target: torch.device,
    reason: str,
    fix: str,
) -> DeviceMismatchError:
    """An optimizer argument stopped before the body
    (:mod:`devicectx.decorator._optimizers`): holding parameters a move replaced, or
    state off its parameters' devices.

    Args:
        what: the optimizer as the call names it, and what is wrong with it
            (``"optimizer (SGD) stepping parameters no module of the call holds"``).
        found: each device with the paths of what is there
            (``optimizer.param_groups[0]['params'][1]``,
            ``optimizer.state[<Parameter (2, 4) on cuda:0>]['exp_avg']``).
        fix: the code that mends it, or how to rebuild it.
    """
    return _error(function, what, found, target, reason, fix, count=False)


def not_materialised(
    function: str,
    module: str,
    kind: str,
    target: torch.device,
    reason: str,
    resettable: bool = True,
) -> DeviceMismatchError:
    """An FSDP2 module sharded while its tensors were on ``meta``: nothing to compute with.
    ``resettable``: the module has a ``reset_parameters()`` to initialise it with."""
    what = f"{module} ({kind}) not materialised, its shards on meta"
    how = (
        f"{module}.reset_parameters(), or load a state dict" if resettable else "load a state dict"
    )
    fix = (
        f"{module}.to_empty(device={_quote(target)}), then initialise it "
        f"({how}), before calling {function}()"
    )
    found = {torch.device("meta"): [module]}
    return _error(function, what, found, target, reason, fix, count=False)


def _error(
    function: str,
    what: str,
    found: Mapping[torch.device, Sequence[str]],
    target: torch.device | None,
    reason: str,
    fix: str,
    *,
    count: bool = True,
) -> DeviceMismatchError:
    """Lay out the four parts; ``count``: say on how many devices ``what`` was found."""
    n = len(found)
    width = max(len(str(device)) for device in found)
    on = f" on {n} device{'s' if n != 1 else ''}" if count else ""
    lines = [f"{function}() got {what}{on}:"]
    lines += [f"    {device!s:<{width}} <- {_paths(paths)}" for device, paths in found.items()]
    lines.append(
        f"target {target} (from {reason})" if target is not None else f"no target: {reason}"
    )
    lines.append(f"fix: {fix}")
    return DeviceMismatchError("\n".join(lines), devices=found, target=target, reason=reason)


def _cast_and_move(
    path: str,
    destination: torch.device,
    dtypes: Sequence[tuple[str, torch.dtype]],
    keep_ties: bool = False,
    from_meta: bool = False,
) -> tuple[str, str]:
    """The code that moves the module at ``path`` to ``destination``, and why it is not a
    plain ``module.to`` (``""`` where it is).

    It casts first where ``destination`` holds no dtype of some of the tensors under
    ``path`` (``"mps:0 holds no torch.float64"``): ``module.to`` stops at the first of them,
    with the tensors before it moved. With ``keep_ties`` (the module holds a tensor at
    several places, which ``module.to`` would copy apart) it moves with ``to_device``.
    With ``from_meta`` (some of its tensors on ``meta``, which hold no data to copy:
    ``module.to`` refuses) it makes them on ``destination`` with ``to_empty``, to be loaded.
    """
    if from_meta:
        move = f"{path}.to_empty(device={_quote(destination)})"
        why = f"then load or initialise its weights: {path}'s tensors on meta hold no data"
        return move, why
    under = [(at, dtype) for at, dtype in dtypes if within(at, path)]
    missing = missing_dtypes(destination)
    unheld = [str(dtype) for dtype in dict.fromkeys(d for _, d in under) if dtype in missing]
    reasons = [f"{destination} holds no {' or '.join(unheld)}"] if unheld else []
    if keep_ties:
        move = f"to_device({path}, {_quote(destination)})"
        reasons.append(f"{path}.to() would untie its tied weights")
    else:
        move = f"{path}.to({_quote(destination)})"
    if unheld:
        move = f"{'; '.join(module_casts(destination, under, path))}; {move}"
    return move, "; ".join(reasons)


def _held(parts: Sequence[Part]) -> str:
    """What a module's spread is of: ``"parameters"``, or ``"parameters and buffers"``
    where buffers alone put some tensors on a device (a stray buffer)."""
    everywhere = {part.device for part in parts}
    with_parameters = {part.device for part in parts if not part.buffers}
    if with_parameters == everywhere:
        return "parameters"
    return "parameters and buffers" if with_parameters else "buffers"


def _untie(module: str, part: Part, keyed: Collection[str]) -> str:
    """The fix for a tied weight a device map split: its modules on one device."""
    others = [path_of(module, path, keyed) for path in part.tied]
    shared = ", ".join(others[:-1]) + (" and " if len(others) > 1 else "") + others[-1]
    return (
        f"{path_of(module, part.owner, keyed)} shares its weight with {shared} (tied): give them "
        'one device in the device map (device_map="auto" keeps tied weights together)'
    )


def _target_first(
    found: Mapping[torch.device, Sequence[str]], target: torch.device | None
) -> dict[torch.device, Sequence[str]]:
    """The same mapping with ``target`` listed first: what is right, then what is not."""
    ordered: dict[torch.device, Sequence[str]] = {}
    if target is not None and target in found:
        ordered[target] = found[target]
    ordered.update((device, paths) for device, paths in found.items() if device != target)
    return ordered


def _paths(paths: Sequence[str]) -> str:
    if len(paths) <= _MAX_PATHS:
        return ", ".join(paths)
    return f"{', '.join(paths[:_MAX_PATHS])} and {len(paths) - _MAX_PATHS} more"


def move_code(
    argument: str, tensor: bool, target: torch.device, dtypes: Collection[torch.dtype] = ()
) -> str:
    """How to move one argument to ``target``, as code: ``x.to("meta")`` for a tensor,
    ``to_device(batch, "meta")`` for a nested one. Where ``dtypes`` (those of its tensors)
    hold one ``target`` lacks, the move casts it too, as the pasted line would otherwise
    meet torch's dtype error: ``x.to("mps:0", torch.float32)``, ``dtypes="device"``.

    Example:
        >>> move_code("batch", False, torch.device("meta"))
        'to_device(batch, "meta")'
    """
    lacked = [dtype for dtype in dtypes if dtype in missing_dtypes(target)]
    if not tensor:
        cast = ', dtypes="device"' if lacked else ""
        return f"to_device({argument}, {_quote(target)}{cast})"
    nearest = nearest_dtype(target, lacked[0]) if lacked else None
    cast = f", {code_of(nearest)}" if nearest is not None else ""
    return f"{argument}.to({_quote(target)}{cast})"


def _to_calls(
    paths: Sequence[str],
    target: torch.device,
    dtypes: Mapping[str, Collection[torch.dtype]] | None = None,
) -> str:
    """:func:`move_code` of each argument the ``paths`` start from, once each."""
    calls: list[str] = []
    for path in paths:
        argument = _argument_of(path)
        lacked = () if dtypes is None else dtypes.get(argument, ())
        call = move_code(argument, argument == path, target, lacked)
        if call not in calls:
            calls.append(call)
    shown = ", ".join(calls[:_MAX_FIXES])
    return shown + ", ..." if len(calls) > _MAX_FIXES else shown


def _argument_of(path: str) -> str:
    """The argument a path starts from: ``batch`` for ``batch['mask'][0]``, and for
    ``list(batch)[0]`` (a set member: ``to_device`` takes the set itself, and keeps it one)."""
    while path.startswith("list("):
        path = path[5:]
    for index, char in enumerate(path):
        if char in "[.)":
            return path[:index]
    return path


def _quote(device: torch.device) -> str:
    return f'"{device}"'
