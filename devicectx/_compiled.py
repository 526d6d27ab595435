"""``@device_agnostic`` under ``torch.compile``: the wrapper class, and a path dynamo can trace.

The trap. A wrapt ``FunctionWrapper`` passes itself off as the function it wraps (its
``__class__`` and ``__code__`` are the function's), so dynamo, meeting a decorated helper
inside a compiled caller, inlines the wrapped code and silently drops the wrapper: inputs
are not moved, nothing is checked, the body is not scoped.

The fix, in two parts:

- :class:`DeviceAgnosticWrapper` (the ``FunctionWrapper`` every decorated function is)
  answers ``_torchdynamo_inline`` with :func:`traced_call` bound to its plan. dynamo
  inlines whatever that attribute holds in place of the object, both for a function it
  meets as a value and for a method it finds on a class (``Module.forward``): the hook
  ``torch.jit.script`` and ``torch.compile`` use for their own wrappers. For
  ``torch.compile(decorated)`` itself it answers ``_torchdynamo_orig_callable`` (with
  ``_torchdynamo_wrapper_id``) the same way, which ``torch.compile`` follows to what it
  compiles. Both are private to dynamo: checked on torch 2.13
  (``torch/_dynamo/variables/builder.py``, ``variables/user_defined.py`` and
  ``eval_frame.innermost_fn``); the tests in ``tests/test_decorator_compile.py`` catch a
  torch that drops them.
- :func:`traced_call` is the decorator's call written for dynamo: no context variables,
  no caches, containers walked with ``torch.utils._pytree``, the device scope entered with a
  plain ``DeviceContext`` (which dynamo traces, unlike ``with torch.device(...)``). The
  eager wrapper switches to it when ``torch.compile`` traces the decorated function itself.

What differs from eager code, all decided while tracing (dynamo guards on the devices of
tensors and on torch's default device, so a change there recompiles):

- ``device="auto"`` and the innermost ``on_device`` are read once, at trace time, with no
  guard; an ``on_device`` block that does not change torch's default device (say
  ``on_device("cpu")`` on a CPU default) is not told apart from no block by the guards.
  A decorated call's own scope does not count as ``on_device`` for decorated functions
  its body calls (their inputs decide; the tensors the outer body makes are on its target).
- containers are those pytree knows (list, tuple, namedtuple, dict, OrderedDict,
  defaultdict, deque); tensors in dataclasses and other objects are not moved or checked.
  A tensor passed twice is moved once.
- a mismatch raises while tracing. Without ``fullgraph=True`` dynamo falls back to eager
  code for the call, which raises the real :class:`~devicectx.DeviceMismatchError`; with
  ``fullgraph=True`` torch reports any exception in traced code as
  ``torch._dynamo.exc.Unsupported`` ("Observed exception"), quoting ours.
- generator and async functions are not traced: their call and each resume of a
  generator run eagerly (graph breaks, so ``fullgraph=True`` refuses them) rather than
  skip the wrapper.
- class and static methods: write ``@device_agnostic`` above ``@classmethod`` (wrapt's
  advice too). Below it, dynamo reads the hook with ``inspect.getattr_static`` and fails
  (``InternalTorchDynamoError``); an instance-level hook would have to live in the wrapped
  function's ``__dict__``, which ``functools.wraps`` copies onto any decorator stacked
  above, silently redirecting it.
"""

from __future__ import annotations

import builtins
import copy
import functools
from collections.abc import Callable
from types import FunctionType, MethodType
from typing import TYPE_CHECKING, Any, SupportsIndex, TypeVar

import torch
import torch.utils._pytree as pytree
import wrapt
from torch import nn

from devicectx import _errors, _mismatch
from devicectx._context import active_device
from devicectx._resolve import DeviceLike, resolve_device
from devicectx._target import involved_module, module_devices
from devicectx._torch_modes import DeviceContext

_is_compiling = torch.compiler.is_compiling
_wrapt_get = wrapt.FunctionWrapper.__get__
# The bindings for which wrapt calls an unbound wrapper with ``wrapped.__self__``.
_SELF_BINDINGS = frozenset({"function", "instancemethod", "callable", "classmethod"})
UNBOUND = object()
"""The instance wrapt passes for a decorated function called unbound: not None (see
:class:`DeviceAgnosticWrapper`), read as None."""

if TYPE_CHECKING:
    from devicectx._decorator import _Plan

_F = TypeVar("_F", bound=Callable[..., Any])


def _constant_result(fn: _F) -> _F:
    """``torch.compiler.assume_constant_result``, without importing dynamo at import time.

    That function imports ``torch._dynamo`` (a second on top of ``import torch``) only to
    set this one attribute, which is all dynamo reads (checked on torch 2.13).
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


class _BoundWrapper(wrapt.BoundFunctionWrapper[..., Any]):
    """A decorated method bound to its instance (or class): pickled and copied as a bound
    method is, by looking the name up again on the instance (deep-copied, for deepcopy)."""

    def _bound_to(self) -> object:
        instance = self._self_instance  # None where reached through the class
        return self._self_owner if instance is None else instance

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        return getattr, (self._bound_to(), self.__name__)

    def __copy__(self) -> _BoundWrapper:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return getattr(copy.deepcopy(self._bound_to(), memo), self.__name__)


class DeviceAgnosticWrapper(wrapt.FunctionWrapper[..., Any]):
    """The object ``@device_agnostic`` returns: a wrapt ``FunctionWrapper`` dynamo can see."""

    def __init__(self, wrapped: Callable[..., Any], plan: _Plan) -> None:
        super().__init__(wrapped, plan.call)
        # wrapt's call of an unbound wrapper whose instance is None looks up
        # ``wrapped.__self__`` every time, to find the instance of a bound method; for a
        # plain function that raises and clears an AttributeError, 0.3 us of every call
        # (wrapt 1.16 to 2.x, ``WraptFunctionWrapperBase_call``). What it would find cannot
        # change, so it is looked up once, here, and set as the instance (re-initialising
        # the base as ``FunctionWrapper.__init__`` does, binding kept); where there is
        # none, :data:`UNBOUND` stands in, which :meth:`_Plan.call` reads as None.
        binding = self._self_binding
        instance = getattr(wrapped, "__self__", None) if binding in _SELF_BINDINGS else None
        # (wrapt's stubs leave out its ``_FunctionWrapperBase``, the next class up.)
        super(wrapt.FunctionWrapper, self).__init__(  # type: ignore[call-arg]
            wrapped, UNBOUND if instance is None else instance, plan.call, None, binding
        )
        self._self_traced = _traced_function(plan, wrapped)

    __bound_function_wrapper__ = _BoundWrapper

    # Pickled by reference and never copied, as functions are: a decorated function can
    # then be sent to another process (``torch.multiprocessing.spawn``, a spawned
    # ``DataLoader``'s ``collate_fn``), where its module holds the decorated object again,
    # and ``copy.deepcopy`` of a model holding one as an attribute works. wrapt's proxy
    # refuses both.
    def __reduce_ex__(self, protocol: SupportsIndex) -> str:
        return self.__qualname__

    def __copy__(self) -> DeviceAgnosticWrapper:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> DeviceAgnosticWrapper:
        return self

    @property
    def _torchdynamo_inline(self) -> Callable[..., Any]:
        # Read by dynamo only (see the module docstring); stable, so its guard holds.
        traced: Callable[..., Any] = self._self_traced
        return traced

    # ``torch.compile(decorated)`` compiles what these two lead to, as for dynamo's own
    # wrappers (``innermost_fn``): the traced function. Else dynamo starts at the wrapper's
    # ``__call__``, which works where wrapt's is C, but fails where it is Python (wrapt
    # without its extension), as dynamo cannot read the proxy's attributes.
    @property
    def _torchdynamo_orig_callable(self) -> Callable[..., Any]:
        traced: Callable[..., Any] = self._self_traced
        return traced

    @property
    def _torchdynamo_wrapper_id(self) -> int:
        return id(self)


class _ForwardWrapper(DeviceAgnosticWrapper):
    """The wrapper of a function named ``forward``: also bound for dynamo.

    dynamo calls ``type(module).forward`` for a module called inside a compiled function,
    and would inline what wrapt returns there (a ``BoundFunctionWrapper``, which passes for
    the wrapped function) without the wrapper. While compiling, this class hands out the
    traced function instead; otherwise wrapt binds as always. (``torch.compiler.is_compiling``
    is true for the whole of a dynamo compile on torch 2.13, not only in traced code.) Only
    ``forward`` needs it, and a Python ``__get__`` costs each access about 0.5 us, so other
    functions get the plain wrapper.
    """

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        if _is_compiling():
            traced = self._torchdynamo_inline  # the one attribute dynamo reads on a wrapper
            return traced if instance is None else functools.partial(traced, instance)
        return _wrapt_get(self, instance, owner)


class _DescriptorWrapper(DeviceAgnosticWrapper):
    """The wrapper of a ``classmethod`` or ``staticmethod`` object.

    dynamo sees one (it passes for a ``classmethod``) and calls its ``__func__``, which
    wrapt would pass on to the raw function, dropping the wrapper: here ``__func__`` is the
    traced function, which takes ``cls`` (for a classmethod) as the raw function does.
    Eager code does not read it: wrapt binds through ``__wrapped__``, and ``inspect``
    unwraps to the real ``classmethod`` before it reads ``__func__``.
    """

    @property
    def __func__(self) -> Callable[..., Any]:
        return self._torchdynamo_inline


def wrap(wrapped: Callable[..., Any], plan: _Plan) -> Any:
    """Decorate ``wrapped`` with ``plan``."""
    if isinstance(wrapped, (classmethod, staticmethod)):
        return _DescriptorWrapper(wrapped, plan)
    if getattr(wrapped, "__name__", None) == "forward":
        return _ForwardWrapper(wrapped, plan)
    return DeviceAgnosticWrapper(wrapped, plan)


def _traced_function(plan: _Plan, function: Callable[..., Any]) -> Callable[..., Any]:
    """What dynamo inlines for a decorated function: ``function``'s call, done by ``plan``.

    Reached as a method, it gets the instance as its first argument, as ``function`` does.
    A copy of :func:`_inline` whose globals hold the plan: dynamo guards a closure through
    the attribute it found the function at (the wrapper, which passes on ``__closure__``
    to the wrapped function), but guards globals by the dict itself.
    """
    from devicectx._decorator import _FUNCTION

    function = getattr(function, "__func__", function)  # classmethod, staticmethod
    template = _inline if plan.kind == _FUNCTION else _eager
    scope = {
        "__builtins__": builtins,
        "_plan": plan,
        "_function": function,
        "_is_compiling": _is_compiling,
        "traced_call": traced_call,
    }
    traced = FunctionType(template.__code__, scope, template.__name__)
    traced.__qualname__ = f"{plan.name}.<traced>"
    if template is _eager:
        traced = torch.compiler.disable(traced)  # type: ignore[no-untyped-call]
    return traced


def _inline(*args: Any, **kwargs: Any) -> Any:
    __tracebackhide__ = True
    if not _is_compiling():  # dynamo gave up on a frame and runs it eagerly
        return _plan.call(_function, None, args, kwargs)  # type: ignore[name-defined]  # noqa: F821
    return traced_call(_plan, _function, None, args, kwargs)  # type: ignore[name-defined]  # noqa: F821


def _eager(*args: Any, **kwargs: Any) -> Any:
    return _plan.call(_function, None, args, kwargs)  # type: ignore[name-defined]  # noqa: F821


def traced_call(
    plan: _Plan,
    wrapped: Callable[..., Any],
    instance: object,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """A decorated call, written so dynamo can trace it: see the module docstring."""
    __tracebackhide__ = True
    offset = 1 if instance is not None and isinstance(wrapped, MethodType) else 0
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

    target, reason = _trace_target(plan, instance, args, kwargs, offset)
    if target is None:
        if len(found) > 1:
            raise DeviceMismatchError(_message("common", plan.name, _frozen(found), None, ""))
        target = next(iter(found), None)
    elif not plan.move and any(device != target for device in found):
        message = _message("off", plan.name, _frozen(found), target, reason)
        raise DeviceMismatchError(message)
    back = next(iter(found), target) if plan.to_input else None
    if plan.output is not None:
        back = _resolve_while_tracing(plan.output.spec)

    if plan.move and target is not None:
        args, kwargs = _traced_move(plan, (args, kwargs), target, offset)
    if plan.scope and target is not None:
        with DeviceContext(target):
            result = wrapped(*args, **kwargs)
    else:
        result = wrapped(*args, **kwargs)
    if back is None:
        return result
    return pytree.tree_map(lambda leaf: _to(leaf, back, plan.non_blocking), result)


def _held(plan: _Plan, value: Any, where: int | str, offset: int) -> bool:
    if isinstance(value, nn.Module):
        return True
    exclusion = plan.exclude
    if exclusion is None:
        return False
    if isinstance(where, str):
        return exclusion.holds_keyword(where)
    return exclusion.holds_position(where + offset)


def _trace_target(
    plan: _Plan,
    instance: object,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    offset: int,
) -> tuple[torch.device | None, str]:
    """Rules 1 to 3 of the eager path, and the reason, read while tracing."""
    target: torch.device | None = None
    reason = ""
    if plan.device is not None:
        target = _resolve_while_tracing(plan.device.spec)
        reason = plan.device.label
    involved = involved_module(instance, args, kwargs)
    if involved is not None:
        module, where = involved
        devices = {t.device for t in module.parameters()} | {t.device for t in module.buffers()}
        if len(devices) > 1 or (target is not None and devices and target not in devices):
            name = plan.params.argument_name(where, offset)
            found = _frozen(module_devices(module, name))
            why = reason or "a module must be on one device"
            kind = type(module).__name__
            raise DeviceMismatchError(_module_message(plan.name, name, kind, found, target, why))
        if target is None and devices:
            target = next(iter(devices))
            reason = f"the parameters of {plan.params.argument_name(where, offset)}"
    if target is None:
        target = _active_while_tracing()
        reason = "the innermost on_device block"
    return target, reason


def _traced_move(
    plan: _Plan, tree: Any, target: torch.device, offset: int
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


def _frozen(
    found: dict[torch.device, list[str]],
) -> tuple[tuple[torch.device, tuple[str, ...]], ...]:
    """``found`` as nested tuples: constants dynamo can hand to a trace-time function."""
    return tuple((device, tuple(paths)) for device, paths in found.items())


# dynamo calls these once while tracing and keeps the result as a constant: they read
# state it cannot trace (the environment, context variables) or build long strings.


@_constant_result
def _resolve_while_tracing(spec: DeviceLike) -> torch.device:
    return resolve_device(spec)


@_constant_result
def _active_while_tracing() -> torch.device | None:
    return active_device()


@_constant_result
def _message(
    kind: str,
    function: str,
    found: tuple[tuple[torch.device, tuple[str, ...]], ...],
    target: torch.device | None,
    reason: str,
) -> str:
    mapping = dict(found)
    if kind == "common" or target is None:
        return str(_mismatch.no_common_device(function, mapping))
    return str(_mismatch.tensors_off_target(function, mapping, target, reason))


@_constant_result
def _module_message(
    function: str,
    module: str,
    kind: str,
    found: tuple[tuple[torch.device, tuple[str, ...]], ...],
    target: torch.device | None,
    reason: str,
) -> str:
    return str(_mismatch.module_off_target(function, module, kind, dict(found), target, reason))


class DeviceMismatchError(_errors.DeviceMismatchError):
    """The error as traced code raises it: dynamo can build this one.

    Named as the public class, because torch's report quotes the name.

    It never reaches the user as such: without ``fullgraph=True`` dynamo reruns the call
    eagerly, which raises a full :class:`~devicectx.DeviceMismatchError`; with it, torch
    raises ``Unsupported`` and quotes this one's message.
    """

    __init__ = RuntimeError.__init__  # dynamo cannot trace the keyword-only __init__
