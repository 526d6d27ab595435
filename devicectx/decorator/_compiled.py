"""``@device_agnostic`` under ``torch.compile``: the call as dynamo traces it.

A decorated function has an *entry* (:func:`entry_function`): a real function, with a code
object of its own, that dynamo inlines in place of the wrapper (:mod:`devicectx.decorator._wrappers`
says how it is led there). Traced, the entry makes the call with :func:`traced_call`, the
decorator's call written for dynamo: no context variables, no caches, containers walked
with ``torch.utils._pytree``, the device scope entered with a plain ``DeviceContext`` (which
dynamo traces, unlike ``with torch.device(...)``). Run for real (dynamo gave up on a frame),
it makes the eager call.

Where the installed torch cannot be trusted to trace it (the probe of
:mod:`devicectx.decorator._probe` failed, or a test forced it:
:func:`devicectx.decorator._wrappers.use_fallback`), and for generators, async functions
and calls with ``dtypes=``, the call runs eagerly instead, behind
``torch.compiler.disable``: a graph break, and the same meaning as without
``torch.compile``; with ``fullgraph=True`` torch's error quotes why (:func:`_eager_message`).

What differs from eager code, all decided while tracing (dynamo guards on the devices of
tensors and on torch's default device, so a change there recompiles):

- ``device="auto"`` and the innermost ``on_device`` are read once, at trace time, with no
  guard; an ``on_device`` block that does not change torch's default device (say
  ``on_device("cpu")`` on a CPU default) is not told apart from no block by the guards.
  A decorated call's own scope does not count as ``on_device`` for decorated functions
  its body calls (their inputs decide; the tensors the outer body makes are on its target).
- containers are those pytree knows (list, tuple, namedtuple, dict, OrderedDict,
  defaultdict, deque). An argument holding, as a pytree leaf, an object the eager walk
  would look into for tensors (a dataclass holding tensors, an object with its own
  ``.to`` such as ``BatchEncoding``, a registered type, another mapping or sequence) is a
  graph break, and the eager call serves it (:func:`_unwalked`); a dataclass without
  tensors, and a set (dynamo traces no set of tensors), are left as they are.
  A tensor passed twice is moved once. Each tensor is moved with its own ``.to``: moves
  are never staged (``coalesce=`` changes nothing here), since staging is host code,
  with pinned buffers and events, that has no place in a graph. As in the eager call,
  only a target a rule chose moves anything.
- on a device that cannot hold a dtype (float64 on MPS), a tensor of it that would move
  is refused as a mismatch is, below: the eager call raises the real
  :class:`~devicectx.DtypeUnsupportedError`.
- a mismatch found while tracing is a graph break, and the call then runs eagerly, which
  raises the real :class:`~devicectx.DeviceMismatchError`; with ``fullgraph=True`` the
  graph break is torch's ``Unsupported`` error, which quotes our message (:func:`_refuse`);
  torch 2.6, whose graph break takes no message, raises a stand-in of the error instead
  (:mod:`devicectx.decorator._stand_ins`).
- a model spread over devices on purpose (accelerate's hooks, ``declare_spread``: read
  with :func:`~devicectx.decorator._spread.marked`) is a graph break too, and the eager
  call serves it, as is one gathered onto one device behind hooks that run a part
  elsewhere (:func:`~devicectx.decorator._spread.hooked_elsewhere`), which it stops;
  with ``fullgraph=True`` torch's error quotes why (from torch 2.7: 2.6's graph break
  takes no message, and its error names the eager call only).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import FunctionType, MethodType
from typing import TYPE_CHECKING, Any

import torch
from packaging.version import Version
from torch import nn

from devicectx import _errors
from devicectx._torch import dynamo as _dynamo_hooks
from devicectx._torch import pytree
from devicectx._torch.modes import DeviceContext
from devicectx.decorator import _mismatch
from devicectx.decorator._params import self_offset
from devicectx.decorator._plan import COROUTINE, FUNCTION, GENERATOR
from devicectx.decorator._spread import hooked_elsewhere, marked
from devicectx.decorator._stand_ins import MADE, TracedDtypeError, TracedMismatchError
from devicectx.decorator._target import (
    involved_module,
    module_devices,
    module_dtypes,
    shared_devices,
)
from devicectx.devices._capabilities import missing_dtypes
from devicectx.devices._resolve import DeviceLike, resolve_device
from devicectx.move import _move
from devicectx.move._containers import is_registered, kind_for
from devicectx.move._kinds import CONTAINER, OWN
from devicectx.move._paths import ATTR, MEMBER
from devicectx.scope._stack import active_device

if TYPE_CHECKING:
    from devicectx.decorator._plan import Plan

_META = torch.device("meta")
# True only where dynamo traces the code that calls it (not for code run during a compile).
_is_traced = torch.compiler.is_dynamo_compiling

_CPU = torch.device("cpu")  # output="input" where no input is a tensor: the host's data
# Whether decorated calls run eagerly under torch.compile (graph breaks) instead of being
# traced: None until decided (by the probe, at first use), then a bool for the process.
_FALLBACK: bool | None = None
# ``_run_eagerly`` behind ``torch.compiler.disable``, made on first need (disable imports
# dynamo, which ``import devicectx`` must not).
_EAGER: Callable[..., Any] | None = None


def fallback() -> bool | None:
    """Whether decorated calls run eagerly under ``torch.compile``; None: not decided yet."""
    return _FALLBACK


def set_fallback_flag(value: bool | None) -> None:
    """Set (or, with None, unset) the flag :func:`fallback` answers, and nothing more.

    The switch is :func:`devicectx.decorator._wrappers.use_fallback`, which sets this flag
    and also rebinds the wrappers of methods for the branch: call that one.
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
    function does; for a bound method decorated (``device_agnostic(model.forward)``, which
    ``torch.compile`` of it reaches), the instance is its ``__self__``, as wrapt hands it to
    the eager call. A copy of :func:`_entry` whose globals hold the plan. Where dynamo
    traces the plan's own eager call instead, the plan hands the call to
    :func:`under_compile`.
    """
    plan.when_traced = functools.partial(under_compile, plan)
    if isinstance(function, (classmethod, staticmethod)):
        function = function.__func__
    instance = function.__self__ if isinstance(function, MethodType) else None
    names = {
        "_plan": plan,
        "_function": function,
        "_instance": instance,
        "_is_traced": _is_traced,
        "under_compile": under_compile,
        "_run_disabled": _run_disabled,
    }
    entry = copy_with_globals(_entry, names, getattr(function, "__name__", "function"))
    # What torch.compile(decorated) copies onto the function it returns: the decorated
    # function's own qualified name, docstring and signature (help(), IDEs, autospec).
    entry.__qualname__ = getattr(function, "__qualname__", plan.name)
    entry.__doc__ = getattr(function, "__doc__", None)
    with contextlib.suppress(TypeError, ValueError):  # a callable Python cannot read
        entry.__signature__ = inspect.signature(function)  # type: ignore[attr-defined]
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
        return _run_disabled(_plan, _function, _instance, args, kwargs)  # type: ignore[name-defined]  # noqa: F821
    return under_compile(_plan, _function, _instance, args, kwargs)  # type: ignore[name-defined]  # noqa: F821


def under_compile(
    plan: Plan,
    wrapped: Callable[..., Any],
    instance: object,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """A decorated call as dynamo traces it: :func:`traced_call`, or a graph break whose
    ``fullgraph=True`` error says why the call runs eagerly."""
    __tracebackhide__ = True
    if plan.traceable and not _FALLBACK:
        return traced_call(plan, wrapped, instance, args, kwargs)
    message = _eager_message(plan.name, plan.kind, plan.dtypes is not None)
    return _break_to_eager(message, plan, wrapped, instance, args, kwargs)


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
    """A decorated call, written so dynamo can trace it: see the module docstring.

    In steps: the tensor defaults the call leaves out, added as keywords (as the eager call
    adds them); the tensors of the arguments (:func:`_traced_leaves`); the target and what
    it refuses; the move (:func:`_dtype_refused` first); the body (:func:`_traced_body`);
    then the result placed.
    """
    __tracebackhide__ = True
    if plan.defaults is not None:  # moved and checked as if passed, as in the eager call
        kwargs = plan.with_defaults(wrapped, instance, args, kwargs)
    offset = self_offset(wrapped, instance)
    leaves, unwalked = _traced_leaves(plan, args, kwargs, offset)
    if unwalked is not None:  # served in eager code: a graph break, the eager call
        return _break_to_eager(unwalked, plan, wrapped, instance, args, kwargs)
    found: dict[torch.device, list[str]] = {}
    for path, tensor in leaves:
        if not (tensor.device.type == "cpu" and tensor.dim() == 0):
            found.setdefault(tensor.device, []).append(path)

    target, reason, refusal, spread = _trace_target(plan, instance, args, kwargs, offset)
    if spread and refusal is not None:  # served in eager code: a graph break, the eager call
        return _break_to_eager(refusal, plan, wrapped, instance, args, kwargs)
    if refusal is not None:
        return _refuse(TracedMismatchError, refusal, plan, wrapped, instance, args, kwargs)
    # As in the eager call, only a target a rule chose moves anything: one the inputs agree
    # on leaves them where they are (0-dim CPU tensors included).
    chosen = target
    if target is None:
        if len(found) > 1:
            message = _message("common", plan.name, _frozen(found), None, "", plan.move)
            return _refuse(TracedMismatchError, message, plan, wrapped, instance, args, kwargs)
        target = _first(found, None)
    elif not plan.move and any(device != target for device in found):
        message = _message("off", plan.name, _frozen(found), target, reason)
        return _refuse(TracedMismatchError, message, plan, wrapped, instance, args, kwargs)
    # Found empty: no tensor input but 0-dim CPU ones, or none (numpy arrays, numbers: the
    # host's data); with exclude=, what the excluded hold was not looked at: the result stays.
    home = _CPU if plan.exclude is None else None
    back = _first(found, home) if plan.to_input else None
    if plan.output is not None:
        back = _resolve_while_tracing(plan.output.spec)

    if plan.move and chosen is not None:
        refused = _dtype_refused(leaves, chosen, plan.written, f"{plan.name}()")
        if refused is not None:
            return _refuse(TracedDtypeError, refused, plan, wrapped, instance, args, kwargs)
        # Shapes only, to a device with data: the eager move refuses it, with the fix.
        empty = [path for path, tensor in leaves if tensor.is_meta and tensor.device != chosen]
        if empty:
            message = _meta_message(plan.name, empty, chosen)
            return _break_to_eager(message, plan, wrapped, instance, args, kwargs)
        args, kwargs = _traced_move(plan, (args, kwargs), chosen, offset)
    result = _traced_body(plan, target, wrapped, args, kwargs)
    if back is None:
        return result
    return pytree.tree_map(lambda leaf: _to(leaf, back, plan.non_blocking), result)


def _traced_leaves(
    plan: Plan, args: tuple[Any, ...], kwargs: dict[str, Any], offset: int
) -> tuple[list[tuple[str, torch.Tensor]], str | None]:
    """Each tensor of the arguments not held out, with its path; or no tensors and why the
    call needs the eager walk (an argument holds something pytree does not walk into)."""
    leaves: list[tuple[str, torch.Tensor]] = []
    for name, value, where in plan.params.named(args, kwargs, offset):
        if _held(plan, value, where, offset):
            continue
        for keys, leaf in pytree.tree_flatten_with_path(value)[0]:
            if isinstance(leaf, torch.Tensor):
                leaves.append((name + pytree.keystr(keys), leaf))
            elif _unwalked(leaf, 0):
                return [], _unwalked_message(plan.name, name + pytree.keystr(keys), type(leaf))
    return leaves, None


def _dtype_refused(
    leaves: list[tuple[str, torch.Tensor]], target: torch.device, written: str, who: str
) -> str | None:
    """The message refusing the tensors that would move to ``target``, which cannot hold
    their dtype (float64 on MPS), as the eager move refuses them; None: nothing refused.
    ``written``: the decorator's other arguments, as its fix writes them; ``who``: the
    decorated function, as the message starts (``"step()"``)."""
    missing = _missing_while_tracing(target)
    if not missing:
        return None
    refused = [
        (path, tensor)
        for path, tensor in leaves
        if tensor.dtype in missing and tensor.device != target
    ]
    if not refused:
        return None
    return _dtype_message(target, _dtype_refusals(refused), written, who)


def _traced_body(
    plan: Plan,
    target: torch.device | None,
    wrapped: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The body as the eager call runs it: in the target's scope (unless ``scope=False``,
    or no target), inside the autocast of ``precision=``; the scope a plain
    ``DeviceContext``, which dynamo traces."""
    __tracebackhide__ = True
    # As the eager call does, no scope where the target is the default already: entering
    # one would change nothing made in the body, but a strict torch.export reports the
    # mode pushed and popped as a side effect of the model's forward (a warning each).
    scoped = plan.scope and target is not None and target != _default_while_tracing()
    if plan.precision is not None:
        if scoped:
            with DeviceContext(target), plan.autocast(target):
                return wrapped(*args, **kwargs)
        with plan.autocast(target):
            return wrapped(*args, **kwargs)
    if scoped:
        with DeviceContext(target):
            return wrapped(*args, **kwargs)
    return wrapped(*args, **kwargs)


def _refuse(
    stand_in: type[TracedMismatchError | TracedDtypeError],
    message: str,
    plan: Plan,
    wrapped: Callable[..., Any],
    instance: object,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """A refusal found while tracing: a graph break, then the eager call, which raises the
    real error (:class:`~devicectx.DeviceMismatchError`, or
    :class:`~devicectx.DtypeUnsupportedError`: ``stand_in``, a subclass of the one it is
    printed as, names which: :mod:`devicectx.decorator._stand_ins`).

    Not a ``raise`` in traced code: dynamo would give up on the frame and run it with the
    frames it calls compiled one by one, the decorator's own eager code among them (torch
    2.6 to 2.8 then traced the body with the inputs unchecked); or, where the decorated
    function is the compiled one, raise the traced stand-in at run time. Under
    ``fullgraph=True`` the graph break is torch's ``Unsupported`` error, which quotes the
    message. torch 2.6's graph break takes no message: there the stand-in is raised.
    """
    __tracebackhide__ = True
    if not _dynamo_hooks.graph_break(f"devicectx.{stand_in.__name__}: {message}"):
        raise stand_in(message)
    return _run_disabled(plan, wrapped, instance, args, kwargs)


def _break_to_eager(
    message: str,
    plan: Plan,
    wrapped: Callable[..., Any],
    instance: object,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """A call served in eager code only: a graph break whose ``fullgraph=True`` error
    quotes ``message`` (why, and the fix), then the eager call. On torch 2.6, whose graph
    break takes no message, the eager call's own graph break is the only one."""
    __tracebackhide__ = True
    _dynamo_hooks.graph_break(message)
    return _run_disabled(plan, wrapped, instance, args, kwargs)


def _unwalked(leaf: Any, depth: int) -> bool:
    """Whether the eager call would look for tensors in ``leaf``, a pytree leaf that is no
    tensor, and may find one that the traced call, which walks only pytree's containers,
    would leave unmoved and unchecked.

    Told by its type (:func:`_entered`), and for a plain dataclass by its fields, read
    here as the eager walk reads them: a dataclass of settings is no reason for a graph
    break. Past :data:`_LOOK_DEPTH` dataclasses deep (a cycle, say) the answer is yes.
    """
    entered = _entered(type(leaf))
    if entered is False:
        return False
    if entered is True or depth == _LOOK_DEPTH:
        return True
    for name in entered:
        for _, value in pytree.tree_flatten_with_path(getattr(leaf, name, None))[0]:
            if isinstance(value, torch.Tensor) or _unwalked(value, depth + 1):
                return True
    return False


_LOOK_DEPTH = 4


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
        # Spread, or offloaded (on meta, behind accelerate's hooks), on purpose; or gathered
        # onto one device while accelerate's hooks still run a part elsewhere: the eager
        # call serves the first and stops the second before the body.
        if ((len(devices) > 1 or _META in devices) and marked(module)) or (
            len(devices) == 1 and hooked_elsewhere(module, *devices)
        ):
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
            shared = shared_devices(module)
            message = _module_message(plan.name, name, kind, found, target, why, dtypes, shared)
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
def _default_while_tracing() -> torch.device:
    return torch.get_default_device()


@_dynamo_hooks.constant
def _message(
    kind: str,
    function: str,
    found: tuple[tuple[torch.device, tuple[str, ...]], ...],
    target: torch.device | None,
    reason: str,
    move: bool = True,
) -> str:
    mapping = dict(found)
    if kind == "common" or target is None:
        return MADE.keep(_mismatch.no_common_device(function, mapping, move))
    return MADE.keep(_mismatch.tensors_off_target(function, mapping, target, reason))


@_dynamo_hooks.constant
def _module_message(
    function: str,
    module: str,
    kind: str,
    found: tuple[tuple[torch.device, tuple[str, ...]], ...],
    target: torch.device | None,
    reason: str,
    dtypes: tuple[tuple[str, torch.dtype], ...],
    shared: tuple[torch.device, ...],
) -> str:
    error = _mismatch.module_off_target(
        function, module, kind, dict(found), target, reason, dtypes=dtypes, shared=shared
    )
    return MADE.keep(error)


# The way out of a graph break's error: torch.compile's, and strict torch.export's (which
# traces with dynamo too, and quotes the same message).
_RUN_EAGERLY = "compile without fullgraph=True / export with strict=False"


@_dynamo_hooks.constant
def _meta_message(function: str, paths: list[str], target: torch.device) -> str:
    """Why a tensor on ``meta`` to move makes a graph break (quoted under ``fullgraph=True``):
    it holds no values to copy, and the eager call's error says what to do."""
    return (
        f"{function}() got {', '.join(paths)} on meta, which holds shapes only: nothing to "
        f"copy to {target}; the eager call raises the error with its fix\n"
        f"fix: give {paths[0]} values (make it where it has data) before calling {function}()"
    )


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
        f"fix: {_RUN_EAGERLY} (this call then runs eagerly), or call {function}() outside "
        f"the compiled code"
    )


@_dynamo_hooks.constant
def _missing_while_tracing(device: torch.device) -> tuple[torch.dtype, ...]:
    """The dtypes ``device`` cannot hold (float64 on MPS): most often none."""
    return tuple(missing_dtypes(device))


@_dynamo_hooks.constant
def _dtype_message(
    target: torch.device,
    refused: tuple[tuple[str, torch.dtype, int], ...],
    written: str,
    who: str,
) -> str:
    """The message of the eager call's :class:`~devicectx.DtypeUnsupportedError`, made by
    the eager move itself, given a stand-in for each tensor it refuses: an empty ``meta``
    tensor of its dtype (one per ``int``, which tells tensors apart), named by its path."""
    stand_ins: dict[int, torch.Tensor] = {}
    for _, dtype, which in refused:
        stand_ins.setdefault(which, torch.empty(0, dtype=dtype, device=_META))
    tensors = tuple(stand_ins[which] for _, _, which in refused)
    try:
        names = [path for path, _, _ in refused]
        _move.move_call(tensors, {}, target, names=names, written=written, who=who)
    except _errors.DtypeUnsupportedError as error:
        return MADE.keep(error)
    msg = f"the move to {target} refused none of {refused}"  # pragma: no cover - a bug
    raise AssertionError(msg)


def _dtype_refusals(
    refused: list[tuple[str, torch.Tensor]],
) -> tuple[tuple[str, torch.dtype, int], ...]:
    """``(path, dtype, which)`` of each refused tensor: constants for
    :func:`_dtype_message`, ``which`` alike for a tensor passed twice (told by ``is``)."""
    distinct: list[torch.Tensor] = []
    found: list[tuple[str, torch.dtype, int]] = []
    for path, tensor in refused:
        which = len(distinct)
        for index, other in enumerate(distinct):
            if other is tensor:
                which = index
                break
        else:
            distinct.append(tensor)
        found.append((path, tensor.dtype, which))
    return tuple(found)


@_dynamo_hooks.constant
def _entered(tp: type) -> tuple[str, ...] | bool:
    """What the eager walk does with a pytree leaf of type ``tp`` (no tensor): False where
    it leaves it as it is too; the names of its fields for a plain dataclass, which traced
    code reads as the eager walk does; True for anything else it enters or moves (a
    registered type, an object with its own ``.to``, a mapping or sequence pytree does not
    know, a dataclass that is also a mapping).

    Sets and frozensets are left alone: dynamo traces no set of tensors (2.6 to 2.15), so
    one left unmoved fails in the body's trace with dynamo's error, not silently.
    """
    try:
        kind = kind_for(tp)
    except Exception:  # the eager walk meets the same error, and says it
        return True
    if kind.role not in (CONTAINER, OWN) or kind.style == MEMBER:
        return False
    plain_dataclass = dataclasses.is_dataclass(tp) and not is_registered(tp)
    if kind.role == CONTAINER and kind.style == ATTR and plain_dataclass:
        # read by its fields, as the eager walk reads it
        return tuple(field.name for field in dataclasses.fields(tp))
    return True


_TORCH = Version(Version(torch.__version__).base_version)
# From where dynamo traces the walk of a dataclass registered by torch.export.register_dataclass
# (2.6 skips it as torch.export's code; 2.13 traces it; those between are not checked).
_TRACES_REGISTERED_DATACLASSES = Version("2.13")


@_dynamo_hooks.constant
def _unwalked_message(function: str, path: str, tp: type) -> str:
    """Why a call given a ``tp`` at ``path`` makes a graph break (quoted under
    ``fullgraph=True``), and how to keep the call traced."""
    name = tp.__name__
    if isinstance(_entered(tp), tuple) and _TORCH >= _TRACES_REGISTERED_DATACLASSES:
        instead = f"torch.export.register_dataclass({name}) before compiling or exporting"
    elif issubclass(tp, Mapping):
        instead = f"pass dict({path})"
    elif issubclass(tp, tuple):
        instead = f"pass tuple({path})"
    elif issubclass(tp, Sequence):
        instead = f"pass list({path})"
    else:
        instead = "pass the tensors it holds as arguments"
    return (
        f"{function}() got {path}, {_errors.with_article(name)}, whose tensors only the eager "
        f"call moves and checks: torch.compile's trace of the call walks only the containers "
        f"torch's pytree knows, and {_errors.with_article(name)} is none of them\n"
        f"fix: {instead} (the call is then traced), or {_RUN_EAGERLY} (this call then runs "
        f"eagerly)"
    )


@_dynamo_hooks.constant
def _eager_message(function: str, kind: int, dtypes: bool) -> str:
    """Why a call that is never traced makes a graph break (quoted under
    ``fullgraph=True``), and the fix."""
    outside = f"call {function}() outside the compiled code"
    if kind != FUNCTION:
        what = {GENERATOR: "a generator", COROUTINE: "an async"}.get(kind, "an async generator")
        why = (
            f"{function}() is {what} function: @device_agnostic runs its calls eagerly "
            f"under torch.compile (a graph break), entering its scope at each resume"
        )
    elif dtypes:
        why = (
            f"{function}() is decorated with dtypes=, whose casts the traced call does not "
            f"make: under torch.compile its calls run eagerly (a graph break)"
        )
        outside = "drop dtypes= and cast the inputs before the call (x.float())"
    else:
        why = (
            f"@device_agnostic runs {function}() eagerly under torch.compile (a graph "
            f"break): torch {torch.__version__} does not trace decorated calls as devicectx "
            f"expects (the warning on the devicectx logger says why)"
        )
    return f"{why}\nfix: {_RUN_EAGERLY} (its calls then run eagerly), or {outside}"
