"""torch's device mismatch inside a decorated body, told in devicectx's words.

Where the body of a decorated call fails with torch's "Expected all tensors to be on the
same device" (or "... is not on the expected device ..."), the cause is often a tensor
the decorator could not see: held in an attribute of a plain object, or set on a module
without ``register_buffer``. :func:`explain` finds them
(:func:`devicectx.move._unseen.unseen_tensors`) and makes the error that names them, their
devices and the fix; the caller raises it from torch's. :func:`own_to_mend` serves the check of
a call that moves nothing. Only the failure path gets here.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from itertools import chain
from typing import Any

import torch
from torch.optim import Optimizer

from devicectx._errors import DeviceError, DeviceMismatchError
from devicectx._torch.tensors import is_cpu_scalar
from devicectx.decorator._mismatch import method_call, move_code
from devicectx.move._paths import keyed_modules, module_path
from devicectx.move._unseen import (
    Unseen,
    attribute_of,
    fix_for,
    is_device_mismatch,
    own_to_fix,
    stored_device_fix,
    stored_devices,
    stray_device,
    unseen_tensors,
)
from devicectx.move._walk import iter_tensors


def own_to_mend(named: Iterable[tuple[str, Any, object]], target: torch.device) -> str | None:
    """For a call that moves nothing, with tensors off ``target`` in an argument whose own
    ``.to`` would leave them there (tried on a copy): how to write that ``.to``; else None.
    On the error path only.

    Args:
        named: ``(name, value, default)`` for each argument.
        target: the device the call needs.
    """
    unseen = unseen_tensors((name, value) for name, value, _ in named)
    return own_to_fix([u for u in unseen if u.device != target], target)


def argument_dtypes(named: Iterable[tuple[str, Any, object]]) -> dict[str, set[torch.dtype]]:
    """The dtypes of each argument's tensors, by the argument's name (``extra`` for the
    values of ``*extra``), for a fix that writes their moves. On the error path only."""
    dtypes: dict[str, set[torch.dtype]] = {}
    for name, value, _ in named:
        held = dtypes.setdefault(name.partition("[")[0], set())
        held.update(tensor.dtype for _, tensor in iter_tensors(value, name))
    return dtypes


def explain(
    error: BaseException,
    function: str,
    named: Iterable[tuple[str, Any]],
    target: torch.device | None,
    reason: str,
    checked: Collection[int] = (),
    follow: bool = False,
    excluded: Sequence[tuple[str, Any]] = (),
    scoped: bool = True,
    body: Callable[..., Any] | None = None,
    instance: bool = False,
) -> DeviceMismatchError | None:
    """The error to raise instead of torch's ``error``, or None to let it through.

    None where ``error`` is not a device mismatch, or no argument holds a tensor the
    decorator cannot see off ``target``.

    Args:
        error: what the body raised.
        function: the decorated function's qualname.
        named: ``(name, value)`` for each argument the body got (``self`` included).
        target: the device the call ran for; None where nothing chose one.
        reason: why ``target``, in words.
        checked: the ids of the modules whose devices the call checked (the module its
            rules read, with its submodules); other modules are looked into as unseen.
        follow: whether the inputs chose ``target`` (no device named, no block, no
            module): a module elsewhere is then better followed than moved.
        excluded: ``(name, value)`` of each argument ``exclude=`` held out: its tensors
            off ``target`` are named as excluded, and the fix says to stop excluding it.
        scoped: whether the body ran in the target's scope (``scope=True``), which puts
            tensors made without ``device=`` there.
        body: the decorated function, whose globals and closure are looked through for
            the tensor no argument holds.
        instance: ``named`` starts with ``("self", instance)``, a decorated method's
            instance that is no module: the caller's object, which the call never moves,
            so the fix for the tensors in its attributes moves them before the call.
    """
    if isinstance(error, DeviceError) or not is_device_mismatch(error):
        return None
    named = list(named)
    unseen = [u for u in unseen_tensors(named, checked) if target is None or u.device != target]
    held = _held_out(excluded, target)
    if not unseen and not held:
        if target is None:
            return None
        cycled = _left_by_cycles(named, target, {name for name, _ in excluded})
        if cycled:
            return _cycles_error(error, function, cycled, target, reason)
        if not follow:
            return _made_elsewhere(error, function, named, target, reason, scoped, body)
        scalars = _scalars_left(named, target)
        if scalars:
            return _scalars_error(error, function, scalars, target, reason)
        return _made_elsewhere(error, function, named, target, reason, scoped, body)
    names = {name for name, _ in excluded}
    found = _by_device(unseen)
    shown = _shown(found, names)
    for device, paths in held.items():
        listed = ", ".join(f"{path} (excluded)" for path in paths)
        shown[device] = f"{shown[device]}, {listed}" if device in shown else listed
    width = max(len(str(device)) for device in shown)
    torch_said = _first_line(error)
    roots = {attribute_of(u.path) for u in unseen}
    held_out = "" if not held and not names & roots else " or excludes"
    lines = [f"{function}() failed in torch on tensors @device_agnostic cannot see into{held_out}:"]
    lines += [f"    {device!s:<{width}} <- {paths}" for device, paths in shown.items()]
    lines.append(
        f"target {target} (from {reason})" if target is not None else f"no target: {reason}"
    )
    lines.append(f"torch said: {torch_said}")
    fix = _self_fix(unseen, named[0][1], function, target) if instance and not held else None
    if fix is None:
        fix = _excluded_fix(unseen, held, excluded, target, follow)
        once = _moved_once(unseen[0], target) if "register_container(" in fix else None
        if once is not None:
            fix = f"{fix}; where the call writes into them (an EMA's update), {once}"
    lines.append(f"fix: {fix}")
    devices = {device: [u.path for u in group] for device, group in found.items()}
    for device, paths in held.items():
        devices.setdefault(device, []).extend(paths)
    return DeviceMismatchError("\n".join(lines), devices=devices, target=target, reason=reason)


def _scalars_left(named: Sequence[tuple[str, Any]], target: torch.device) -> list[tuple[str, Any]]:
    """``(path, argument value)`` of each 0-dim CPU tensor in the arguments, where
    ``target`` (which the inputs chose) is elsewhere: left on the host, as PyTorch mixes
    such a tensor with any device, it fails an op that needs it on the target."""
    if target.type == "cpu":
        return []
    return [(path, value) for path, value, tensor in _reached(named) if is_cpu_scalar(tensor)]


def _left_by_cycles(
    named: Sequence[tuple[str, Any]], target: torch.device, excluded: Collection[str]
) -> list[tuple[str, torch.device]]:
    """``(path, device)`` of each tensor off ``target`` that the moved arguments still
    reach through their containers (0-dim CPU tensors aside): where a structure holds
    itself, its copy's link back leads to the original, which the move left."""
    kept = [(name, value) for name, value in named if name not in excluded and name != "self"]
    return [
        (path, tensor.device)
        for path, _, tensor in _reached(kept)
        if tensor.device != target and not is_cpu_scalar(tensor)
    ]


def _reached(named: Sequence[tuple[str, Any]]) -> Iterator[tuple[str, Any, torch.Tensor]]:
    """``(path, argument value, tensor)`` for each tensor the arguments reach through their
    containers."""
    for name, value in named:
        for path, tensor in iter_tensors(value, name):
            yield path, value, tensor


def _cycles_error(
    error: BaseException,
    function: str,
    cycled: list[tuple[str, torch.device]],
    target: torch.device,
    reason: str,
) -> DeviceMismatchError:
    found: dict[torch.device, list[str]] = {}
    for path, device in cycled:
        found.setdefault(device, []).append(path)
    width = max(len(str(device)) for device in found)
    first_path, first_device = cycled[0]
    root = attribute_of(first_path)
    lines = [
        f"{function}() failed in torch on tensors its move left where they were, reached "
        f"through a structure that holds itself:",
        *(
            f"    {device!s:<{width}} <- {', '.join(paths[:_MAX_PATHS])}"
            + (f" and {len(paths) - _MAX_PATHS} more" if len(paths) > _MAX_PATHS else "")
            for device, paths in found.items()
        ),
        f"target {target} (from {reason})",
        f"torch said: {_first_line(error)}",
        f"fix: {first_path} is reached through a link back to a container above it, and "
        f"the move copies each container once: the copy's link still leads to the original, "
        f"on {first_device}; read the tensor where {root} holds it first (not through the "
        f"link back), or pass it as an argument of its own",
    ]
    return DeviceMismatchError("\n".join(lines), devices=found, target=target, reason=reason)


def _scalars_error(
    error: BaseException,
    function: str,
    scalars: list[tuple[str, Any]],
    target: torch.device,
    reason: str,
) -> DeviceMismatchError:
    one = len(scalars) == 1
    what = "a 0-dim CPU tensor" if one else "0-dim CPU tensors"
    paths = ", ".join(path for path, _ in scalars[:_MAX_PATHS])
    more = f" and {len(scalars) - _MAX_PATHS} more" if len(scalars) > _MAX_PATHS else ""
    moves: list[str] = []
    for path, value in scalars:
        argument = attribute_of(path)
        move = move_code(argument, isinstance(value, torch.Tensor), target)
        if move not in moves:
            moves.append(move)
    torch_said = _first_line(error)
    lines = [
        f"{function}() failed in torch on {what} @device_agnostic leaves where "
        f"{'it is' if one else 'they are'}:",
        f"    cpu <- {paths}{more} (0-dim: mixes with any device, so "
        f"{'it is' if one else 'they are'} not moved)",
        f"target {target} (from {reason})",
        f"torch said: {torch_said}",
        f"fix: pass {', '.join(moves)}, or give the call a target, to which every tensor "
        'moves: @device_agnostic(device="auto"), or the call inside an on_device block',
    ]
    devices = {torch.device("cpu"): [path for path, _ in scalars]}
    return DeviceMismatchError("\n".join(lines), devices=devices, target=target, reason=reason)


def _made_elsewhere(
    error: BaseException,
    function: str,
    named: Sequence[tuple[str, Any]],
    target: torch.device,
    reason: str,
    scoped: bool,
    body: Callable[..., Any] | None = None,
) -> DeviceMismatchError | None:
    """For a tensor off ``target`` that no argument holds: one the body put on a device by
    name (a device its arguments stored, ``self.device``, named as such), made over numpy's
    memory, or read from a global or a closure, none of which the scope or the move
    reaches. None where torch's words do not name such a device."""
    stray = stray_device(error, target)
    if stray is None:
        return None
    stored = stored_devices(named, stray)
    if stored:
        lines = [
            f"{function}() failed in torch on a tensor on {stray}, where devices stored in "
            f"its arguments point:",
            f"    {stray} <- {', '.join(stored)}",
            f"target {target} (from {reason})",
            f"torch said: {_first_line(error)}",
            f"fix: {stored_device_fix(stored[0])}",
        ]
        return DeviceMismatchError(
            "\n".join(lines), devices={stray: stored}, target=target, reason=reason
        )
    read = [] if body is None else read_by_name(body, stray)
    hooked = [] if read else read_by_hooks(named, stray)
    if hooked:
        name, _, _, module = hooked[0]
        names = ", ".join(f"{n} (a {k} of a {h} of {m})" for n, k, h, m in hooked)
        lines = [
            f"{function}() failed in torch on {'a tensor' if len(hooked) == 1 else 'tensors'} "
            f"on {stray} that a hook of its module reads by name, where @device_agnostic "
            f"does not look:",
            f"    {stray} <- {names}",
            f"target {target} (from {reason})",
            f"torch said: {_first_line(error)}",
            f'fix: {module}.register_buffer("{name}", {name}) and read it in the hook as '
            f"module.{name} (its first argument), so that {module}.to() moves it with the "
            f"model; or move {name} to {target} once, where it is made",
        ]
        return DeviceMismatchError(
            "\n".join(lines),
            devices={stray: [n for n, _, _, _ in hooked]},
            target=target,
            reason=reason,
        )
    if read:
        names = ", ".join(f"{name} (a {kind} of {function})" for name, kind in read)
        lines = [
            f"{function}() failed in torch on {'a tensor' if len(read) == 1 else 'tensors'} "
            f"on {stray} that its body reads by name, where @device_agnostic does not look:",
            f"    {stray} <- {names}",
            f"target {target} (from {reason})",
            f"torch said: {_first_line(error)}",
            f"fix: pass {read[0][0]} as an argument, which the call then moves (or checks); "
            f"or move it to {target} once, where it is made",
        ]
        return DeviceMismatchError(
            "\n".join(lines),
            devices={stray: [name for name, _ in read]},
            target=target,
            reason=reason,
        )
    lines = [
        f"{function}() failed in torch on a tensor on {stray} that @device_agnostic found "
        f"in none of its arguments: made in the body on {stray} by name, from numpy, or "
        f"read from a global or a closure (or held deeper in an argument than it looks)",
        f"target {target} (from {reason})",
        f"torch said: {_first_line(error)}",
        f"fix: {_body_fix(named, stray, scoped)}",
    ]
    return DeviceMismatchError("\n".join(lines), devices={stray: []}, target=target, reason=reason)


def read_by_name(body: Callable[..., Any], device: torch.device) -> list[tuple[str, str]]:
    """``(name, "global" or "closure variable")`` for each tensor on ``device``, or module
    with a parameter or buffer there, that ``body`` reads by name from its module's globals
    or its closure (a notebook's constants and model are globals). On the error path only."""
    function: Any = inspect.unwrap(getattr(body, "__func__", body))
    while isinstance(function, functools.partial):
        function = function.func
    code = getattr(function, "__code__", None)
    if code is None:
        return []
    found: list[tuple[str, str]] = []
    spaces = [
        ("global", getattr(function, "__globals__", {}), code.co_names),
        ("closure variable", _cells(function), code.co_freevars),
    ]
    for kind, space, names in spaces:
        for name in names:
            value = space.get(name)
            if isinstance(value, torch.Tensor):
                there = value.device == device
            elif isinstance(value, torch.nn.Module):
                tensors = chain(value.parameters(), value.buffers())
                there = any(tensor.device == device for tensor in tensors)
            else:
                continue
            if there and (name, kind) not in found:
                found.append((name, kind))
    return found


_HOOKS = (
    ("_forward_pre_hooks", "forward pre-hook"),
    ("_forward_hooks", "forward hook"),
    ("_backward_pre_hooks", "backward pre-hook"),
    ("_backward_hooks", "backward hook"),
)


def read_by_hooks(
    named: Iterable[tuple[str, Any]], device: torch.device
) -> list[tuple[str, str, str, str]]:
    """``(name, "global" or "closure variable", which hook, module path)`` for each tensor on
    ``device`` that a hook of a module among the arguments (or inside one) reads by name:
    a forward hook adding a constant made on the CPU. On the error path only."""
    found: list[tuple[str, str, str, str]] = []
    for argument, value in named:
        if not isinstance(value, torch.nn.Module):
            continue
        modules = list(value.named_modules())
        keyed = keyed_modules(modules)
        for qualified, module in modules:
            path = module_path(argument, qualified, keyed) if qualified else argument
            for attribute, which in _HOOKS:
                for hook in getattr(module, attribute, {}).values():
                    for name, kind in read_by_name(hook, device):
                        found.append((name, kind, which, path))
    return found


def _cells(function: Any) -> dict[str, Any]:
    """A function's closure, by name (an empty cell left out)."""
    values: dict[str, Any] = {}
    cells = function.__closure__ or ()
    for name, cell in zip(function.__code__.co_freevars, cells, strict=False):
        with contextlib.suppress(ValueError):  # a cell not yet filled
            values[name] = cell.cell_contents
    return values


def _body_fix(named: Sequence[tuple[str, Any]], stray: torch.device, scoped: bool) -> str:
    """The fix for a stray tensor the body made: a numpy argument's first, the commonest
    (``model(torch.from_numpy(obs))``). In the body, the scope puts what ``torch.as_tensor``
    makes of an array on the target; ``torch.from_numpy`` shares the array's memory, on the
    CPU."""
    arrays = [name for name, value in named if type(value).__module__ == "numpy"]
    array = arrays[0] if arrays and stray.type == "cpu" else "array"
    made = (
        f"torch.as_tensor({array}), which the scope puts on the target"
        if scoped
        else f"torch.as_tensor({array}, device=x.device)"
    )
    if array != "array":
        return (
            f"{array} is a numpy array, passed as it is: make its tensor with {made}, in "
            f"the body (torch.from_numpy stays on cpu)"
        )
    return (
        f"make it on the inputs' device in the body, torch.zeros(n, device=x.device), and "
        f"move none to {stray} by name; {made}, for a numpy array (torch.from_numpy stays "
        f"on cpu); pass a global or closure's tensor as an argument"
    )


def _first_line(error: BaseException) -> str:
    """What torch said, for the message: its first line, or the error's class."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _held_out(
    excluded: Sequence[tuple[str, Any]], target: torch.device | None
) -> dict[torch.device, list[str]]:
    """The paths of the tensors in excluded arguments (not in modules) off ``target``, by
    device: the decorator saw them, and left them where they are, as told."""
    held: dict[torch.device, list[str]] = {}
    for name, value in excluded:
        for path, tensor in iter_tensors(value, name):
            if target is None or tensor.device != target:
                held.setdefault(tensor.device, []).append(path)
    return held


def _moved_once(item: Unseen, target: torch.device | None) -> str | None:
    """The fix that moves the innermost attribute on ``item``'s path (the container or the
    tensor a plain object holds) once, before the calls (``ema.shadow =
    to_device(ema.shadow, "cuda:0")``, ``h.ema.shadow`` one object deeper): the object
    taught to the walk would be copied at each call, and what the body writes into it (an
    EMA's update, a running statistic) written into the copy, and lost. None where the
    path does not start with an argument's attribute, or no target is known."""
    argument = attribute_of(item.path)
    held, rest = argument, item.path[len(argument) :]
    while rest.startswith("."):  # down the attributes, to the container or the tensor
        name = attribute_of(rest[1:])
        if not name.isidentifier():
            return None
        held, rest = f"{held}.{name}", rest[1 + len(name) :]
    if target is None or argument == "self" or held == argument or "]." in rest:
        return None  # "]." : a plain object inside a list or dict, which to_device keeps
    return (
        f"move them once instead, before the calls: {held} = to_device({held}, "
        f"{str(target)!r}) (a move at each call writes into a copy, and the update is lost)"
    )


def _self_fix(
    unseen: Sequence[Unseen], instance: object, function: str, target: torch.device | None
) -> str | None:
    """The fix for tensors in the attributes of a decorated method's instance (a plain
    object, or a plain object inside a dataclass one), or in its class body: moved on the
    caller's object before the call, as the call never moves its instance (registering its
    type, or giving it a ``.to``, would only have it checked). None where the first tensor
    is not below ``self``, or the fix is another's: a module's, an optimizer's state."""
    first = unseen[0]
    if target is None or first.module is not None or not _in_self(first):
        return None
    kind = type(instance).__qualname__
    statements: list[str] = []
    for item in unseen:
        if item.module is not None or not _in_self(item) or "list(" in item.path:
            continue  # a set's member cannot be assigned in place
        if item.shared_by is not None:  # in the class body: one tensor for every instance
            where = f"{item.shared_by.__qualname__}.{item.path.rpartition('.')[2]}"
        else:
            where = f"obj{item.path[len('self') :]}"
        dtypes = _dtype_at(instance, item.path)
        statement = f"{where} = {move_code(where, True, target, dtypes)}"
        if statement not in statements:
            statements.append(statement)
    if not statements:
        return None
    shown = "; ".join(statements[:_MAX_STATEMENTS])
    if len(statements) > _MAX_STATEMENTS:
        shown += f" (and likewise {len(statements) - _MAX_STATEMENTS} more)"
    return (
        f"{shown} before {method_call(function)}, where obj is the {kind} you call it on "
        f"(@device_agnostic never moves self: it is the caller's object), or where the "
        f"{kind} is made"
    )


def _dtype_at(instance: object, path: str) -> tuple[torch.dtype, ...]:
    """The dtype of the tensor at ``path`` (``self.cfg.w``) below ``instance``, for a move
    that casts what the target cannot hold; none where the path is not attributes only."""
    found: object = instance
    for name in path.split(".")[1:]:
        if not name.isidentifier():
            return ()
        found = getattr(found, name, None)
    return (found.dtype,) if isinstance(found, torch.Tensor) else ()


def _in_self(item: Unseen) -> bool:
    """Whether ``item`` is in the attributes of the instance (``self.w``, ``self.cfg.w``),
    through plain objects only: no module or optimizer on the way, whose fixes differ."""
    holders = item.holders or ((item.holder, item.holder_path),)
    return attribute_of(holders[0][1]) == "self" and not any(
        issubclass(tp, (torch.nn.Module, Optimizer)) for tp, _ in holders
    )


# Statements written in a fix that moves an instance's tensors, before "and likewise N more".
_MAX_STATEMENTS = 3


def _excluded_fix(
    unseen: list[Unseen],
    held: dict[torch.device, list[str]],
    excluded: Sequence[tuple[str, Any]],
    target: torch.device | None,
    follow: bool,
) -> str:
    """The fix: for an excluded module, stop excluding it (modules are never moved, so
    excluding one only keeps it from choosing the target); for excluded tensors, move
    them (casting what ``target`` cannot hold); else what :func:`fix_for` says."""
    names = {name for name, _ in excluded}
    module = next(
        (u for u in unseen if u.module is not None and attribute_of(u.path) in names), None
    )
    if module is not None:
        name = attribute_of(module.path)
        return (
            f'drop "{name}" from exclude=, so that {name} chooses the target: modules are '
            f"never moved, and exclude= only kept {name} from being checked"
        )
    if held and target is not None:
        argument = attribute_of(next(iter(held.values()))[0])
        value = dict(excluded).get(argument)
        dtypes = {tensor.dtype for _, tensor in iter_tensors(value, argument)}
        move = move_code(argument, isinstance(value, torch.Tensor), target, dtypes)
        return (
            f'pass {move}, or drop "{argument}" from exclude= so '
            f"that it is moved: exclude= means neither moved nor checked"
        )
    return fix_for(unseen, target, follow)


def _by_device(unseen: list[Unseen]) -> dict[torch.device, list[Unseen]]:
    grouped: dict[torch.device, list[Unseen]] = {}
    for item in unseen:
        grouped.setdefault(item.device, []).append(item)
    return grouped


# Paths shown per device before "and N more", as the other mismatch messages do.
_MAX_PATHS = 6


def _shown(
    found: dict[torch.device, list[Unseen]], excluded: Collection[str] = ()
) -> dict[torch.device, str]:
    shown: dict[torch.device, str] = {}
    for device, group in found.items():
        paths = [f"{u.path} ({_held_by(u, excluded)})" for u in group[:_MAX_PATHS]]
        more = f" and {len(group) - _MAX_PATHS} more" if len(group) > _MAX_PATHS else ""
        shown[device] = ", ".join(paths) + more
    return shown


def _held_by(item: Unseen, excluded: Collection[str] = ()) -> str:
    if item.module is not None:
        kind = item.module.__qualname__
        if item.holder_path != item.path:
            return f"{kind}, in {item.holder.__qualname__}"
        if item.path in excluded:
            return f"{kind}, excluded: exclude= means not checked"
        return f"{kind}, a module @device_agnostic does not check"
    module = issubclass(item.holder, torch.nn.Module)
    if item.shared_by is not None:
        # Said so: the class holds it, so every instance shares it, and no move reaches it.
        buffer = ", not a buffer" if module else ""
        return f"a class attribute of {item.shared_by.__qualname__}{buffer}"
    if module:
        return f"a plain attribute of {item.holder.__qualname__}, not a buffer"
    return f"in {item.holder.__qualname__}"
