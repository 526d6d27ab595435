"""``@device_agnostic`` under ``torch.compile``: the call as dynamo traces it.

A decorated function has an *entry* (:func:`entry_function`): a real function, with a code
object of its own, that dynamo inlines in place of the wrapper (:mod:`devicectx.decorator._wrappers`
says how it is led there). Traced, the entry makes the call with :func:`traced_call`, the
decorator's call written for dynamo: no context variables, no caches, containers walked
with ``torch.utils._pytree``, the device scope entered with a plain ``DeviceContext`` (which
dynamo traces, unlike ``with torch.device(...)``). Run for real (dynamo gave up on a frame),
it makes the eager call.

Where the installed torch cannot be trusted to trace it (the probe of
:mod:`devicectx.decorator._probe` failed, or a test forced it: :func:`use_fallback`), and for
generators and async functions, the call runs eagerly instead, behind
``torch.compiler.disable``: a graph break, and the same meaning as without
``torch.compile``.

What differs from eager code, all decided while tracing (dynamo guards on the devices of
tensors and on torch's default device, so a change there recompiles):

- ``device="auto"`` and the innermost ``on_device`` are read once, at trace time, with no
  guard; an ``on_device`` block that does not change torch's default device (say
  ``on_device("cpu")`` on a CPU default) is not told apart from no block by the guards.
  A decorated call's own scope does not count as ``on_device`` for decorated functions
  its body calls (their inputs decide; the tensors the outer body makes are on its target).
- containers are those pytree knows (list, tuple, namedtuple, dict, OrderedDict,
  defaultdict, deque); tensors in dataclasses and other objects are not moved or checked.
  A tensor passed twice is moved once. Each tensor is moved with its own ``.to``: moves
  are never staged (``coalesce=`` changes nothing here), since staging is host code,
  with pinned buffers and events, that has no place in a graph.
- a mismatch found while tracing is a graph break, and the call then runs eagerly, which
  raises the real :class:`~devicectx.DeviceMismatchError`; with ``fullgraph=True`` the
  graph break is torch's ``Unsupported`` error, which quotes our message (:func:`_refuse`).
- a model spread over devices on purpose (accelerate's hooks, ``declare_spread``: read
  with :func:`~devicectx.decorator._spread.marked`) is a graph break too, and the eager
  call serves it; with ``fullgraph=True`` torch's error quotes why.
"""

from __future__ import annotations

import builtins
import functools
from collections.abc import Callable, Iterable
from types import FunctionType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from devicectx import _errors
from devicectx._torch import dynamo as _dynamo_hooks
from devicectx._torch import pytree
from devicectx._torch.modes import DeviceContext
from devicectx.decorator import _mismatch
from devicectx.decorator._params import self_offset
from devicectx.decorator._spread import marked
from devicectx.decorator._target import involved_module, module_devices, module_dtypes
from devicectx.devices._resolve import DeviceLike, resolve_device
from devicectx.scope._stack import active_device

if TYPE_CHECKING:
    from devicectx.decorator._plan import Plan

_META = torch.device("meta")
# True only where dynamo traces the code that calls it (not for code run during a compile).
_is_traced = torch.compiler.is_dynamo_compiling

# Whether decorated calls run eagerly under torch.compile (graph breaks) instead of being
# traced: None until decided (by the probe, at first use), then a bool for the process.
_FALLBACK: bool | None = None
# ``_run_eagerly`` behind ``torch.compiler.disable``, made on first need (disable imports
# dynamo, which ``import devicectx`` must not).
_EAGER: Callable[..., Any] | None = None


def fallback() -> bool | None:
    """Whether decorated calls run eagerly under ``torch.compile``; None: not decided yet."""
    return _FALLBACK


def use_fallback(value: bool | None) -> None:
    """Decide (or, with None, undecide) whether decorated calls run eagerly when compiled.

    The probe decides at first use; tests force either branch. Code compiled before a change
    is not recompiled: call ``torch._dynamo.reset()`` as well.
    """
    global _FALLBACK
    _FALLBACK = value


def prepare_eager() -> None:
    """Make the disabled eager runner (it imports dynamo: not at import time)."""
    global _EAGER
    if _EAGER is None:
        _EAGER = _dynamo_hooks.disable(_run_eagerly)


@_dynamo_hooks.constant
def _prepare_while_tracing() -> bool:
    """:func:`prepare_eager`, called for real by dynamo while it traces (so before the
    runner is needed for real), and by eager code at no cost once done."""
    prepare_eager()
    return True


def entry_function(plan: Plan, function: Callable[..., Any]) -> Callable[..., Any]:
    """What dynamo inlines for a call of the function ``plan`` decorates (``function``).

    Reached as a method, it gets the instance (or class) as its first argument, as the raw
    function does. A copy of :func:`_entry` whose globals hold the plan. Where dynamo traces
    the plan's own eager call instead, the plan hands the call to :func:`under_compile`.
    """
    plan.when_traced = functools.partial(under_compile, plan)
    function = getattr(function, "__func__", function)  # classmethod, staticmethod
    names = {
        "_plan": plan,
        "_function": function,
        "_is_traced": _is_traced,
        "under_compile": under_compile,
        "_run_disabled": _run_disabled,
    }
    entry = copy_with_globals(_entry, names, getattr(function, "__name__", "function"))
    entry.__qualname__ = f"{plan.name}.<traced>"
    return entry


def copy_with_globals(
    template: Callable[..., Any], names: dict[str, Any], name: str | None = None
) -> FunctionType:
    """A copy of ``template`` that sees ``names`` as its globals, with a code object of its own.

    Its own code object: dynamo guards a frame's globals by the dict it compiled with and
    keeps compiled code on the code object, so copies sharing one would run each other's
    compiled code (with the other's globals: a ``NameError`` for its graph).
    """
    assert isinstance(template, FunctionType)
    name = name or template.__name__
    code = template.__code__.replace(co_name=name)
    copied = FunctionType(code, {"__builtins__": builtins, **names}, name, template.__defaults__)
    # Not from a ``__name__`` in its globals: dynamo would then look the globals up as that
    # module's, and miss the names.
    copied.__module__ = template.__module__
    copied.__qualname__ = template.__qualname__
    return copied


def _entry(*args: Any, **kwargs: Any) -> Any:
    __tracebackhide__ = True
    if not _is_traced():  # run for real: dynamo gave up on a frame and runs it eagerly
        # dynamo off for the whole call, or it would compile the eager code frame by frame
        return _run_disabled(_plan, _function, None, args, kwargs)  # type: ignore[name-defined]  # noqa: F821
    return under_compile(_plan, _function, None, args, kwargs)  # type: ignore[name-defined]  # noqa: F821


def under_compile(
    plan: Plan,
    wrapped: Callable[..., Any],
    instance: object,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """A decorated call as dynamo traces it: :func:`traced_call`, or a graph break."""
    __tracebackhide__ = True
    if plan.traceable and not _FALLBACK:
        return traced_call(plan, wrapped, instance, args, kwargs)
    return _run_disabled(plan, wrapped, instance, args, kwargs)


def _run_disabled(
    plan: Plan,
    wrapped: Callable[..., Any],
    instance: object,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The eager call with dynamo off for all of it: traced, a graph break."""
    __tracebackhide__ = True
    _prepare_while_tracing()
    eager = _EAGER
    if eager is None:  # run for real, before any trace: dynamo is not in the way
        return plan.call(wrapped, instance, args, kwargs)
    return eager(plan, wrapped, instance, args, kwargs)


def _run_eagerly(
    plan: Plan,
    wrapped: Callable[..., Any],
    instance: object,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The eager call; disabled (:data:`_EAGER`), so a traced call of it is a graph break."""
    __tracebackhide__ = True
    return plan.call(wrapped, instance, args, kwargs)


def traced_call(
    plan: Plan,
    wrapped: Callable[..., Any],
    instance: object,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """A decorated call, written so dynamo can trace it: see the module docstring."""
    __tracebackhide__ = True
    offset = self_offset(wrapped, instance)
    named = [
        (name, value)
        for name, value, where in plan.params.named(args, kwargs, offset)
        if not _held(plan, value, where, offset)
    ]
    leaves = [
        (name + pytree.keystr(path), leaf)
        for name, value in named
        for path, leaf in pytree.tree_flatten_with_path(value)[0]
        if isinstance(leaf, torch.Tensor)
    ]
    found: dict[torch.device, list[str]] = {}
    for path, tensor in leaves:
        if not (tensor.device.type == "cpu" and tensor.dim() == 0):
            found.setdefault(tensor.device, []).append(path)

    target, reason, refusal, spread = _trace_target(plan, instance, args, kwargs, offset)
    if spread and refusal is not None:  # served in eager code: a graph break, the eager call
        _dynamo_hooks.graph_break(refusal)  # else (torch 2.6) calling the eager one breaks
        return _run_disabled(plan, wrapped, instance, args, kwargs)
    if refusal is not None:
        return _refuse(refusal, plan, wrapped, instance, args, kwargs)
    if target is None:
        if len(found) > 1:
            message = _message("common", plan.name, _frozen(found), None, "")
            return _refuse(message, plan, wrapped, instance, args, kwargs)
        target = _first(found, None)
    elif not plan.move and any(device != target for device in found):
        message = _message("off", plan.name, _frozen(found), target, reason)
        return _refuse(message, plan, wrapped, instance, args, kwargs)
    back = _first(found, target) if plan.to_input else None
    if plan.output is not None:
        back = _resolve_while_tracing(plan.output.spec)

    if plan.move and target is not None:
        args, kwargs = _traced_move(plan, (args, kwargs), target, offset)
    if plan.precision is not None:
        if plan.scope and target is not None:
            with DeviceContext(target), plan.autocast(target):
                result = wrapped(*args, **kwargs)
        else:
            with plan.autocast(target):
                result = wrapped(*args, **kwargs)
    elif plan.scope and target is not None:
        with DeviceContext(target):
            result = wrapped(*args, **kwargs)
    else:
        result = wrapped(*args, **kwargs)
    if back is None:
        return result
    return pytree.tree_map(lambda leaf: _to(leaf, back, plan.non_blocking), result)


def _refuse(
    message: str,
    plan: Plan,
    wrapped: Callable[..., Any],
    instance: object,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """A mismatch found while tracing: a graph break, then the eager call, which raises the
    real :class:`~devicectx.DeviceMismatchError`.

    Not a ``raise`` in traced code: dynamo would give up on the frame and run it with the
    frames it calls compiled one by one, the decorator's own eager code among them (torch
    2.6 to 2.8 then traced the body with the inputs unchecked); or, where the decorated
    function is the compiled one, raise the traced stand-in at run time. Under
    ``fullgraph=True`` the graph break is torch's ``Unsupported`` error, which quotes the
    message. torch 2.6's graph break takes no message: there the stand-in is raised.
    """
    __tracebackhide__ = True
    if not _dynamo_hooks.graph_break(f"devicectx.DeviceMismatchError: {message}"):
        raise DeviceMismatchError(message)
    return _run_disabled(plan, wrapped, instance, args, kwargs)


def _held(plan: Plan, value: Any, where: int | str, offset: int) -> bool:
    if isinstance(value, nn.Module):
        return True
    exclusion = plan.exclude
    if exclusion is None:
        return False
    if isinstance(where, str):
        return exclusion.holds_keyword(where)
    return exclusion.holds_position(where + offset)


def _trace_target(
    plan: Plan,
    instance: object,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    offset: int,
) -> tuple[torch.device | None, str, str | None, bool]:
    """Rules 1 to 3 of the eager path, read while tracing: the target, why, the message of
    a mismatch (a module off the target, or on several devices) or None, and whether the
    module is spread over devices on purpose (the message then says so: the eager call
    serves it)."""
    target: torch.device | None = None
    reason = ""
    if plan.device is not None:
        target = _resolve_while_tracing(plan.device.spec)
        reason = plan.device.label
    involved = involved_module(instance, args, kwargs)
    if involved is not None:
        module, where = involved
        devices = {t.device for t in module.parameters()} | {t.device for t in module.buffers()}
        # Spread, or offloaded (on meta, behind accelerate's hooks), on purpose.
        if (len(devices) > 1 or _META in devices) and marked(module):
            name = plan.params.argument_name(where, offset)
            found = _frozen(module_devices(module, name))
            message = _spread_message(plan.name, name, type(module).__name__, found)
            return target, reason, message, True
        if len(devices) > 1 or (target is not None and devices and target not in devices):
            name = plan.params.argument_name(where, offset)
            found = _frozen(module_devices(module, name))
            kind = type(module).__name__
            why = reason or "a module must be on one device"
            dtypes = module_dtypes(module, name)
            message = _module_message(plan.name, name, kind, found, target, why, dtypes)
            return target, reason, message, False
        if target is None and devices:
            target = _first(devices, None)
            reason = f"the parameters of {plan.params.argument_name(where, offset)}"
    if target is None:
        target = _active_while_tracing()
        reason = "the innermost on_device block"
    return target, reason, None, False


def _traced_move(
    plan: Plan, tree: Any, target: torch.device, offset: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Move ``(args, kwargs)`` without what is held out; a tensor met twice is moved once."""
    args, kwargs = tree
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def move(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.device == target:
            return leaf
        for original, moved in seen:
            if original is leaf:
                return moved
        moved = leaf.to(target, non_blocking=plan.non_blocking)
        seen.append((leaf, moved))
        return moved

    new_args = tuple(
        value if _held(plan, value, index, offset) else pytree.tree_map(move, value)
        for index, value in enumerate(args)
    )
    new_kwargs = {
        key: value if _held(plan, value, key, offset) else pytree.tree_map(move, value)
        for key, value in kwargs.items()
    }
    return new_args, new_kwargs


def _to(leaf: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(leaf, torch.Tensor) and leaf.device != device:
        return leaf.to(device, non_blocking=non_blocking)
    return leaf


def _first(devices: Iterable[torch.device], default: torch.device | None) -> torch.device | None:
    """The first of ``devices``, or ``default``: ``next(iter(...), default)``, which dynamo
    2.6 does not trace."""
    for device in devices:
        return device
    return default


def _frozen(
    found: dict[torch.device, list[str]],
) -> tuple[tuple[torch.device, tuple[str, ...]], ...]:
    """``found`` as nested tuples: constants dynamo can hand to a trace-time function."""
    return tuple((device, tuple(paths)) for device, paths in found.items())


# dynamo calls these once while tracing and keeps the result as a constant: they read
# state it cannot trace (the environment, context variables) or build long strings.


@_dynamo_hooks.constant
def _resolve_while_tracing(spec: DeviceLike) -> torch.device:
    return resolve_device(spec)


@_dynamo_hooks.constant
def _active_while_tracing() -> torch.device | None:
    return active_device()


@_dynamo_hooks.constant
def _message(
    kind: str,
    function: str,
    found: tuple[tuple[torch.device, tuple[str, ...]], ...],
    target: torch.device | None,
    reason: str,
) -> str:
    mapping = dict(found)
    if kind == "common" or target is None:
        return _keep(_mismatch.no_common_device(function, mapping))
    return _keep(_mismatch.tensors_off_target(function, mapping, target, reason))


@_dynamo_hooks.constant
def _module_message(
    function: str,
    module: str,
    kind: str,
    found: tuple[tuple[torch.device, tuple[str, ...]], ...],
    target: torch.device | None,
    reason: str,
    dtypes: tuple[tuple[str, torch.dtype], ...],
) -> str:
    error = _mismatch.module_off_target(
        function, module, kind, dict(found), target, reason, dtypes=dtypes
    )
    return _keep(error)


@_dynamo_hooks.constant
def _spread_message(
    function: str,
    module: str,
    kind: str,
    found: tuple[tuple[torch.device, tuple[str, ...]], ...],
) -> str:
    """Why a model placed on purpose makes a graph break (quoted under ``fullgraph=True``)."""
    devices = ", ".join(str(device) for device, _ in found)
    return (
        f"{function}() got {module} ({kind}) placed by accelerate's hooks or declare_spread, "
        f"its weights on {devices}: @device_agnostic serves such a model in eager code "
        "only, and torch.compile traces this call\n"
        f"fix: compile without fullgraph=True (this call then runs eagerly), or call "
        f"{function}() outside the compiled code"
    )


# The errors the messages above were made from, by message, for the stand-in to answer
# with their attributes; the latest few only (a function has a few kinds of mismatch).
_MADE: dict[str, _errors.DeviceMismatchError] = {}


def _keep(error: _errors.DeviceMismatchError) -> str:
    message = str(error)
    _MADE.pop(message, None)
    _MADE[message] = error
    while len(_MADE) > 64:
        del _MADE[next(iter(_MADE))]
    return message


class DeviceMismatchError(_errors.DeviceMismatchError):
    """The error as traced code raises it (torch 2.6 only): dynamo can build this one.

    Named as the public class, because torch's report quotes the name. Where it reaches
    the user (dynamo 2.6 raises it from compiled code), it answers ``devices``, ``target``
    and ``reason`` as the error its message was made from.
    """

    __init__ = RuntimeError.__init__  # dynamo cannot trace the keyword-only __init__

    @property
    def devices(self) -> dict[torch.device, list[str]]:  # type: ignore[override]
        made = _MADE.get(str(self))
        return {} if made is None else made.devices

    @property
    def target(self) -> torch.device | None:  # type: ignore[override]
        made = _MADE.get(str(self))
        return None if made is None else made.target

    @property
    def reason(self) -> str:  # type: ignore[override]
        made = _MADE.get(str(self))
        return "" if made is None else made.reason
