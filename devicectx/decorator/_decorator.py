"""``@device_agnostic``: run a function on one device, moving (or checking) its inputs.

The decorator is a wrapt ``FunctionWrapper`` (:mod:`devicectx.decorator._wrappers`), so functions,
methods, classmethods, staticmethods and ``nn.Module.forward`` all arrive as
``(wrapped, instance, args, kwargs)``. What a call does is settled at decoration
(:mod:`devicectx.decorator._plan`); under ``torch.compile`` the call takes the path of
:mod:`devicectx.decorator._compiled`, which dynamo can trace.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterable
from itertools import chain
from types import FrameType
from typing import Any, ParamSpec, TypeVar, overload

import torch
from torch import nn

from devicectx._errors import check_switches
from devicectx._torch import dynamo as _dynamo_hooks
from devicectx._torch.module_tree import children_of
from devicectx.decorator._plan import Plan
from devicectx.decorator._target import DeviceOption
from devicectx.decorator._wrappers import wrap
from devicectx.devices._resolve import DeviceLike
from devicectx.move._dtypes import DtypesLike, check_dtypes
from devicectx.scope._precision import PrecisionName, check_precision_name

_P = ParamSpec("_P")
_R = TypeVar("_R")


@overload
def device_agnostic(wrapped: Callable[_P, _R], /) -> Callable[_P, _R]: ...


@overload
def device_agnostic(
    wrapped: None = None,
    /,
    *,
    device: DeviceLike = None,
    move: bool = True,
    output: DeviceLike = None,
    exclude: str | Iterable[str] = (),
    non_blocking: bool = False,
    scope: bool = True,
    coalesce: bool = True,
    precision: PrecisionName | None = None,
    dtypes: DtypesLike = None,
) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]: ...


def device_agnostic(
    wrapped: Callable[..., Any] | None = None,
    /,
    *,
    device: DeviceLike = None,
    move: bool = True,
    output: DeviceLike = None,
    exclude: str | Iterable[str] = (),
    non_blocking: bool = False,
    scope: bool = True,
    coalesce: bool = True,
    precision: PrecisionName | None = None,
    dtypes: DtypesLike = None,
) -> Any:
    """Run a function on one device: its tensor inputs moved (or checked), its body scoped.

    Example:
        >>> import torch
        >>> @device_agnostic(device="meta")
        ... def affine(x, w, b):
        ...     return x @ w + b + torch.ones(2)  # torch.ones lands on meta too
        >>> affine(torch.ones(2), torch.eye(2), torch.zeros(2)).device
        device(type='meta')

    The device, the first rule that applies:

    1. ``device=``;
    2. the ``nn.Module`` involved: the instance of a decorated method, else the first
       module argument (one bound in a decorated ``functools.partial`` counts;
       ``DataParallel`` and ``DistributedDataParallel`` looked through;
       a model spread over devices on purpose, by accelerate or
       :func:`~devicectx.declare_spread`, where it starts);
    3. the innermost active :func:`~devicectx.on_device` (a decorated call's own scope
       counts: a decorated function called from another one's body follows it);
    4. the device the argument tensors agree on (0-dim CPU tensors, which PyTorch mixes
       with any device, do not count).

    Args:
        wrapped: the function; given when used bare, as ``@device_agnostic``.
        device: any :func:`~devicectx.resolve_device` spec, resolved at each call
            (``"auto"`` follows the environment); ``None``: rules 2 to 4 choose.
        move: ``True``: move every tensor in every argument, at any depth, to the target
            (aliasing kept, nothing mutated); ``False``: move nothing, and raise if a
            tensor is elsewhere (a 0-dim CPU tensor is allowed, as PyTorch allows it).
        output: ``None`` leaves the result alone; a device spec moves it there;
            ``"input"`` moves it to the device the tensor inputs came from (the CPU
            where the inputs are host data: numpy arrays, numbers). For a
            generator, each yielded item; for an async function, the awaited result.
        exclude: names of parameters whose values are neither moved nor checked.
        non_blocking: passed to the copies to an accelerator (see
            :func:`~devicectx.to_device` for when devicectx makes a copy safe anyway).
        scope: run the body under ``on_device(target)``, so tensors it creates without
            ``device=`` land on the target. Ops on existing tensors inside pay nothing
            for it (only constructors are redirected, so a model's forward scoped to a
            device other than the default costs what the plain one does); entering and
            leaving costs a little on each call where the target is not the default,
            nothing where it is.
            ``scope=False`` saves that, for hot paths that pass devices.
        coalesce: stage the moves of many tensors between the host and an accelerator,
            inputs and results alike, into a few large copies through pinned memory
            (see :func:`~devicectx.to_device`); ``False``: one copy per tensor.
        precision: run the body under ``torch.autocast`` for the target's device type:
            ``"bf16-mixed"``, ``"16-mixed"``, ``"32"`` or ``"auto"`` (see
            :func:`~devicectx.choose_precision`); ``None`` leaves autocast alone.
        dtypes: what the move does with a dtype the target cannot hold (float64 on
            MPS), as :func:`~devicectx.to_device` takes it: ``None`` refuses the call
            before the body, naming every such argument path; ``"device"`` casts each to
            the nearest dtype the target holds (nothing changes on a device that holds
            every dtype); a mapping (``{torch.float64: torch.float32}``) casts every
            tensor argument of a key's dtype, on every device. Results are not cast.

    Returns:
        The decorated function, with the same name, docstring, signature and static type
        (for a ``functools.partial`` holding a module: the same partial of the decorated
        function).

    Raises:
        DeviceMismatchError: before the body runs, when ``move=False`` and a tensor is
            off the target; when nothing chooses a target and the inputs disagree; when
            the module involved is not on the target or is spread over several devices
            by mistake (modules are never moved implicitly).
        InvalidDeviceError: at decoration, for a malformed ``device=`` or ``output=``.
        TypeError: at decoration, for what is not a function or method: a device in its
            place (``@device_agnostic("cuda")``: the device goes by keyword), a class, or
            a module instance (decorate its ``forward``, or ``device_agnostic(model.forward)``).
        InvalidPrecisionError: at decoration, for an unknown ``precision=``.
        PrecisionUnsupportedError: at a call, for a precision the target cannot run.
        ValueError: at decoration, for an ``exclude`` name the function does not take,
            or ``dtypes=`` with ``move=False``.
        DtypeUnsupportedError: at a call, for tensor arguments of a dtype the target
            cannot hold (with ``dtypes=None``).

    Caveats:
        - Each call scans its arguments and checks the device of the module involved.
          That check is cached per module, re-read when torch reports a move or a
          registration (``.to()``, assigning a parameter), and one of the module's
          tensors is checked at every call; tensors written around torch's hooks
          (``module._parameters[name] = t``) are noticed at the next such report.
        - ``output="input"`` with inputs on several devices: the device of the first
          tensor argument (0-dim CPU tensors aside); with no tensor argument, the CPU where
          every argument is host data (a numpy array, Python numbers, the model), else
          (a plain object, an excluded argument) the result is left where it is.
        - A generator's or async function's inputs are moved or checked at the call; its
          body is scoped at every resume, and left at every yield.
        - Under ``torch.compile`` the target is chosen while tracing, and with
          ``fullgraph=True`` a mismatch surfaces as torch's ``Unsupported`` quoting ours.
          Write ``@device_agnostic`` above ``@classmethod``/``@staticmethod`` there; see
          :mod:`devicectx.decorator._compiled` for all that changes. Where the installed torch does
          not trace decorated calls as devicectx expects (checked once per process, at
          first use), they run eagerly instead: graph breaks.
    """
    check_switches(
        "@device_agnostic", move=move, non_blocking=non_blocking, scope=scope, coalesce=coalesce
    )
    options: dict[str, Any] = {
        "device": device,
        "move": move,
        "output": output,
        "exclude": exclude,
        "non_blocking": non_blocking,
        "scope": scope,
        "coalesce": coalesce,
        "precision": precision,
        "dtypes": dtypes,
    }
    if wrapped is None:
        for spec, argument in ((device, "device"), (output, "output")):
            if spec is not None and not (argument == "output" and spec == "input"):
                DeviceOption(spec, argument=argument)  # a malformed spec fails here, at once
        if precision is not None:
            check_precision_name(precision)
        check_dtypes(dtypes)
        return functools.partial(device_agnostic, **options)
    check_wrapped(wrapped)
    if type(wrapped) is functools.partial and _binds_module(wrapped):
        # The bound arguments are fixed: the function decorated and the partial rebuilt
        # around it is the same call, with the module an argument the rules read.
        decorated = device_agnostic(wrapped.func, **options)
        return functools.partial(decorated, *wrapped.args, **wrapped.keywords)
    plan = Plan(
        wrapped, device, move, output, exclude, non_blocking, scope, coalesce, precision, dtypes
    )
    return wrap(wrapped, plan)


def _binds_module(wrapped: functools.partial[Any]) -> bool:
    """Whether a partial holds an ``nn.Module`` among its bound arguments."""
    bound = (*wrapped.args, *wrapped.keywords.values())
    return any(isinstance(value, nn.Module) for value in bound)


def _where_to_write(wrapped: object) -> str:
    """Where ``@device_agnostic`` goes, written above ``wrapped``: below the decorators that
    make descriptors (unlike ``@classmethod``, they take no wrapper above them)."""
    if isinstance(wrapped, functools.singledispatchmethod):
        name = getattr(wrapped.func, "__name__", "method")
        return (
            f"write @device_agnostic on each implementation, below its @{name}.register "
            f"(the method dispatches, then the implementation moves)"
        )
    for kind in (property, functools.cached_property):
        if isinstance(wrapped, kind):
            return f"write @device_agnostic below @{kind.__name__}, on the line above its `def`"
    return "write @device_agnostic on the line above the `def` of the function to decorate"


def check_wrapped(wrapped: object) -> None:
    """Refuse, where it is written, what ``@device_agnostic`` cannot decorate: a device in
    the function's place, anything else not callable, a class, a module instance.

    Raises:
        TypeError: with what it got, and the fix.
    """
    __tracebackhide__ = True
    if isinstance(wrapped, (classmethod, staticmethod)):  # a classmethod is not callable
        return
    if isinstance(wrapped, (str, torch.device)) or (
        isinstance(wrapped, int) and not isinstance(wrapped, bool)
    ):
        written = wrapped if isinstance(wrapped, int) else f'"{wrapped}"'
        msg = (
            f"@device_agnostic takes the device by keyword, and got {wrapped!r} where the "
            f"function to decorate goes\n"
            f"fix: @device_agnostic(device={written})"
        )
        raise TypeError(msg)
    if not callable(wrapped):
        msg = (
            f"@device_agnostic decorates functions and methods, and got a "
            f"{type(wrapped).__qualname__}, which cannot be called\n"
            f"fix: {_where_to_write(wrapped)}"
        )
        raise TypeError(msg)
    if inspect.isclass(wrapped):
        name = wrapped.__name__
        msg = (
            f"@device_agnostic cannot decorate the class {name}: decorate the methods that "
            f"take tensors instead (`@device_agnostic` on `def forward`)"
        )
        raise TypeError(msg)
    if isinstance(wrapped, nn.Module):
        raise TypeError(_module_refusal(wrapped, _name_in_caller(wrapped)))
    below = _belongs_below(wrapped)
    if below is not None:
        name, why = below
        msg = (
            f"@device_agnostic written above @{name} would {why}\n"
            f"fix: write @device_agnostic below @{name}, on the line above the `def`"
        )
        raise TypeError(msg)


def _made_by(decorator: Callable[..., Any]) -> object:
    """The code of the functions ``decorator`` returns (one code object for all of them)."""
    return getattr(decorator(lambda: None), "__code__", None)


# Decorators whose result @device_agnostic cannot sit on: what they wrap must be decorated.
_CONTEXT_MANAGER_CODES = {
    _made_by(contextlib.contextmanager): "contextmanager",
    _made_by(contextlib.asynccontextmanager): "asynccontextmanager",
}
_CACHE_TYPE = type(functools.lru_cache(maxsize=None)(lambda: None))


def _belongs_below(wrapped: object) -> tuple[str, str] | None:
    """``(decorator, what goes wrong)`` where ``wrapped`` is the result of a decorator that
    ``@device_agnostic`` must go below: a context manager's factory (its body runs at the
    ``with``, after the decorated call returned) or a cache (each call's moved copies are
    new keys). None for anything else."""
    name = _CONTEXT_MANAGER_CODES.get(getattr(wrapped, "__code__", None))
    if name is not None:
        return name, (
            "move the inputs and return, leaving the body to run at the `with` statement, "
            "outside the call's scope and checks (below it, the generator's own code runs in "
            "the call's scope; the `with` body, run at its `yield`, does not: put "
            "`with on_device(...):` around the `yield` for that)"
        )
    if isinstance(wrapped, _CACHE_TYPE):
        return "lru_cache (or @cache)", (
            "make each call's moved copies new keys: the cache would never hit, and would "
            "keep every copy on the device"
        )
    return None


def _module_refusal(module: nn.Module, name: str | None) -> str:
    """The refusal of a module instance: its bound ``forward`` decorated is what works
    (assigned back to ``model.forward``, it would stay bound to the original in a deep
    copy, and ``torch.save`` of the model would fail).

    A compiled module's ``forward`` is dynamo's function, no method of the module: there
    the original module's ``forward`` is decorated, then compiled.
    """
    held = name if name is not None else "model"
    original = _dynamo_hooks.compiled_original(module)
    if isinstance(original, nn.Module):
        module = original
        kind = f"{type(module).__qualname__} compiled by torch.compile"
        decorated = f"torch.compile(device_agnostic({held}._orig_mod.forward))"
    else:
        kind = type(module).__qualname__
        decorated = f"device_agnostic({held}.forward)"
    label = f"{name} (a {kind})" if name is not None else f"a {kind}"
    bound = f"forward = {decorated}, then call forward(...)"
    if type(module).__module__.split(".")[0] == "torch":
        fix = f"{bound} where you called {held}(...)"
    else:  # the user's own class can take the decorator on its forward
        own = type(module).__qualname__
        fix = f"@device_agnostic above `def forward` in class {own}, or {bound}"
    return (
        f"@device_agnostic cannot decorate a module instance, {label}: it decorates "
        f"functions and methods\n"
        f"fix: {fix}"
    )


def _name_in_caller(value: object) -> str | None:
    """The name the code that called the decorator holds ``value`` by (a local, an
    attribute of a local: ``self.model``, else a global), for the fix; None where it holds
    it by none. Only on the way to an error."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    if frame is None:
        return None
    local = frame.f_locals
    for name, held in local.items():
        if held is value and not name.startswith("_"):
            return name
    for name, held in local.items():
        attributes = getattr(held, "__dict__", None)
        if name.startswith("_") or not isinstance(attributes, dict) or isinstance(held, type):
            continue
        # A module holds its submodules in a table of their own, not as attributes.
        modules = children_of(held).items() if isinstance(held, nn.Module) else ()
        for attribute, inner in chain(attributes.items(), modules):
            if inner is value and not attribute.startswith("_"):
                return f"{name}.{attribute}"
    for name, held in frame.f_globals.items():
        if held is value and not name.startswith("_"):
            return name
    return None
