"""The objects ``@device_agnostic`` returns: wrapt wrappers that ``torch.compile`` sees.

The trap. A wrapt ``FunctionWrapper`` passes itself off as the function it wraps (its
``__class__`` and ``__code__`` are the function's), so dynamo, meeting a decorated helper
inside a compiled caller, would inline the wrapped code and silently drop the wrapper:
inputs not moved, nothing checked, the body not scoped.

What dynamo is given instead, the *entry* of :func:`devicectx.decorator._compiled.entry_function`:

- every wrapper is the one instance of a class made for it, which carries the entry as
  ``_torchdynamo_inline`` and ``_torchdynamo_orig_callable``
  (:func:`devicectx._torch.dynamo.install`): dynamo inlines the entry wherever it meets the
  wrapper as a value, a method found on a class (``Module.forward`` included) or a module
  attribute, and ``torch.compile(decorated)`` compiles it;
- reached through its class, a decorated ``forward`` or ``staticmethod`` is a function's
  wrapper, the same at each access, not a new bound wrapper each time (which dynamo would
  inline without the hook, or guard by an id that changes at every access); a
  ``classmethod``'s wrapper answers ``__func__`` (which dynamo calls) with the entry.

Whether the installed torch honours all that is checked once, at first use: the probe
(:mod:`devicectx.decorator._probe`) runs when dynamo first asks a wrapper its ``__class__``,
which it does before it decides what an object is. Where it does not, the fallback, for the rest of
the process (tests force it with :func:`use_fallback`):

- the entry makes the eager call, behind ``torch.compiler.disable`` (a graph break);
- while dynamo traces, a wrapper stops passing for a function (its ``__class__`` is its
  own), so that a torch which ignores the hooks cannot inline the wrapped code either: it
  calls the wrapper as an opaque object, which runs the eager call;
- a decorated method binds in Python (as ``forward`` always does), since dynamo takes a
  C-level ``__get__`` of an opaque object for none and would call the method unbound.

Generators and async functions run eagerly on either branch
(:func:`devicectx.decorator._compiled.under_compile`).
"""

from __future__ import annotations

import copy
import functools
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from types import BuiltinFunctionType, FunctionType, MethodType
from typing import TYPE_CHECKING, Any, SupportsIndex, cast

import torch
import wrapt

from devicectx._torch import dynamo as _dynamo_hooks
from devicectx.decorator import _compiled, _probe
from devicectx.decorator._plan import UNBOUND, Plan

_log = logging.getLogger("devicectx")
_wrapt_get = wrapt.FunctionWrapper.__get__
_partial = functools.partial
# wrapt without its C extension binds in Python anyway: ours then costs nothing more.
_PYTHON_BINDING = isinstance(_wrapt_get, FunctionType)
_is_traced = torch.compiler.is_dynamo_compiling  # False but where dynamo traces the call
# The bindings for which wrapt calls an unbound wrapper with ``wrapped.__self__``.
_SELF_BINDINGS = frozenset({"function", "instancemethod", "callable", "classmethod"})

# wrapt's wrappers are generic from wrapt 2.0 on; the 1.x classes cannot be subscripted.
if TYPE_CHECKING:
    _FunctionWrapper = wrapt.FunctionWrapper[..., Any]
    _BoundFunctionWrapper = wrapt.BoundFunctionWrapper[..., Any]
else:
    _FunctionWrapper = wrapt.FunctionWrapper
    _BoundFunctionWrapper = wrapt.BoundFunctionWrapper


class _Probing(threading.local):
    """Whether this thread is running the probe (its wrappers must pass for functions)."""

    active = False


_PROBING = _Probing()


def _class_of(self: wrapt.ObjectProxy[Any]) -> type:
    """A wrapper's ``__class__``: the wrapped function's (as wrapt has it), or its own
    where passing for a function would drop it: in the fallback, while dynamo traces (so
    that dynamo cannot inline the wrapped code), and to cloudpickle's reducer, which
    pickles a function of ``__main__`` by value from its code, the wrapper left out
    (Ray, joblib and Dask ship a notebook's functions so)."""
    if _dynamo_hooks.tracing() and _falls_back():
        return type(self)
    caller = sys._getframe(1)
    if caller.f_code.co_name == "reducer_override" and caller.f_globals.get(
        "__name__", ""
    ).startswith("cloudpickle"):
        if issubclass(type(self), DeviceAgnosticWrapper):  # a bound one pickles as its own
            _BY_VALUE.wrapper = self  # read (and let go) by its __reduce_ex__, next
        return type(self)
    return cast(type, self.__wrapped__.__class__)


class _ByValue(threading.local):
    """The wrapper cloudpickle's reducer just asked for its class: it is pickled next,
    by value (:meth:`DeviceAgnosticWrapper.__reduce_ex__`)."""

    wrapper: object = None


_BY_VALUE = _ByValue()


def _falls_back() -> bool:
    """Whether decorated calls run eagerly under ``torch.compile``; probe on the first ask."""
    decided = _compiled.fallback()
    if decided is not None:
        return decided
    if _PROBING.active:  # the probe's own wrappers: they test the traced path
        return False
    reason = probe()
    use_fallback(reason is not None)
    if reason is not None:
        _log.warning(
            "torch %s does not trace @device_agnostic calls as devicectx expects (%s): "
            "under torch.compile they run eagerly, as graph breaks",
            torch.__version__,
            reason,
        )
    return reason is not None


def probe() -> str | None:
    """Run the probe (:mod:`devicectx.decorator._probe`): None where the traced path works here."""
    _PROBING.active = True
    try:
        return _probe.run(_decorate)
    finally:
        _PROBING.active = False


def _decorate(function: Callable[..., Any], **options: Any) -> Any:
    """``@device_agnostic(**options)``, for the probe."""
    return wrap(function, Plan(function, **options))


class _BoundWrapper(_BoundFunctionWrapper):
    """A decorated method bound to its instance (or class): pickled and copied as a bound
    method is, by looking the name up again on the instance (deep-copied, for deepcopy).

    Its ``__func__`` is the decorated function, as for a method of any decorated function:
    ``types.MethodType(m.__func__, m.__self__)`` makes a method that moves and checks, and
    ``inspect`` reads the signature and the kind (a coroutine function) from it.
    ``weakref.WeakMethod`` calls ``type(m)(m.__func__, m.__self__)``, which wrapt's C
    constructor refuses: taking two arguments would cost every binding a Python call.
    """

    __class__ = property(_class_of)

    @property
    def __func__(self) -> Any:
        # wrapt's would be the raw function (or, for wrapt 2 and a classmethod, the
        # entry, which inspect reads as ``(*args, **kwargs)`` and not as a coroutine).
        if self._self_binding == "classmethod":
            return self._self_parent._self_function
        if self._self_binding == "function" and self._self_instance is not None:
            return self._self_parent  # the wrapper in the class's __dict__
        wrapped: Any = self.__wrapped__
        return wrapped.__func__  # raises for a function reached through its class, as it would

    @property
    def _torchdynamo_inline(self) -> Callable[..., Any]:
        # wrapt would answer with the parent's (the entry, unbound): bind it as this is.
        entry: Callable[..., Any] = self._self_parent._self_entry
        if self._self_binding == "classmethod":
            return functools.partial(entry, self._owner())
        instance = self._self_instance
        return entry if instance is None else functools.partial(entry, instance)

    def _owner(self) -> object:
        """The class the method was reached through: wrapt 2 keeps it; for wrapt 1, a
        classmethod's bound function has it as ``__self__``, and a function's class is
        found by its qualified name, as pickle finds a class."""
        owner = getattr(self, "_self_owner", None)
        if owner is None:
            owner = getattr(self.__wrapped__, "__self__", None)
        if owner is None:
            owner = sys.modules.get(self.__module__)
            for name in self.__qualname__.split(".")[:-1]:
                owner = getattr(owner, name, None)
        return owner

    def _bound_to(self) -> object:
        instance = self._self_instance  # None where reached through the class
        return self._owner() if instance is None else instance

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        return getattr, (self._bound_to(), self.__name__)

    def __repr__(self) -> str:  # as Python shows the method (wrapt's names two addresses)
        if self._self_binding == "function" and self._self_instance is None:
            return f"<function {self.__qualname__} at {id(self._self_parent):#x}>"
        owner = self._owner() if self._self_binding == "classmethod" else self._bound_to()
        return f"<bound method {self.__qualname__} of {owner!r}>"

    def __copy__(self) -> _BoundWrapper:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return getattr(copy.deepcopy(self._bound_to(), memo), self.__name__)


class DeviceAgnosticWrapper(_FunctionWrapper):
    """The object ``@device_agnostic`` returns: a wrapt ``FunctionWrapper`` dynamo can see."""

    __class__ = property(_class_of)

    def __init__(self, wrapped: Callable[..., Any], plan: Plan, entry: Callable[..., Any]) -> None:
        super().__init__(wrapped, plan.call)
        # wrapt's call of an unbound wrapper whose instance is None looks up
        # ``wrapped.__self__`` every time, to find the instance of a bound method; for a
        # plain function that raises and clears an AttributeError at every call
        # (wrapt 1.16 to 2.x, ``WraptFunctionWrapperBase_call``). What it would find cannot
        # change, so it is looked up once, here, and set as the instance (re-initialising
        # the base as ``FunctionWrapper.__init__`` does, binding kept); where there is
        # none, :data:`UNBOUND` stands in, which :meth:`Plan.call` reads as None.
        binding = self._self_binding
        instance = getattr(wrapped, "__self__", None) if binding in _SELF_BINDINGS else None
        # (wrapt's stubs leave out its ``_FunctionWrapperBase``, the next class up.)
        super(wrapt.FunctionWrapper, self).__init__(  # type: ignore[call-arg]
            wrapped, UNBOUND if instance is None else instance, plan.call, None, binding
        )
        self._self_entry = entry
        self._self_plan = plan

    __bound_function_wrapper__ = _BoundWrapper

    # Pickled by reference and never copied, as functions are: a decorated function can
    # then be sent to another process (``torch.multiprocessing.spawn``, a spawned
    # ``DataLoader``'s ``collate_fn``), where its module holds the decorated object again,
    # and ``copy.deepcopy`` of a model holding one as an attribute works. wrapt's proxy
    # refuses both. Where its name does not lead to it (decorated under another name, a
    # partial, a classmethod reached through its class), or for cloudpickle, which ships a
    # function of ``__main__`` by value, it is the function pickled and decorated again.
    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        by_value = _BY_VALUE.wrapper is self
        _BY_VALUE.wrapper = None
        if by_value or not _named_so(self):
            return _decorated_again, (self.__wrapped__, self._self_plan.options)
        return self.__qualname__

    def __repr__(self) -> str:  # as Python shows what it wraps (wrapt's names two addresses)
        wrapped = self.__wrapped__
        if isinstance(wrapped, MethodType):
            return f"<bound method {self.__qualname__} of {wrapped.__self__!r}>"
        if isinstance(wrapped, (FunctionType, staticmethod)):
            return f"<function {self.__qualname__} at {id(self):#x}>"
        return f"<device_agnostic of {wrapped!r}>"

    def __copy__(self) -> DeviceAgnosticWrapper:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> DeviceAgnosticWrapper:
        wrapped = self.__wrapped__
        if isinstance(wrapped, _SHARED_CALLABLES):
            return self  # a function is never copied, decorated or not
        # A bound method (``device_agnostic(model.forward)`` kept on the model), a partial
        # holding tensors, a callable object: copied as Python copies it undecorated, so
        # that a copied model's wrapper calls the copy, and decorated again.
        return cast(
            DeviceAgnosticWrapper,
            _decorated_again(copy.deepcopy(wrapped, memo), self._self_plan.options),
        )


_SHARED_CALLABLES = (FunctionType, BuiltinFunctionType, type)
"""What ``copy.deepcopy`` gives back as it is: a wrapper of one is not copied either."""


def _named_so(wrapper: DeviceAgnosticWrapper) -> bool:
    """Whether ``wrapper``'s module and qualified name lead to ``wrapper`` itself."""
    found: Any = sys.modules.get(getattr(wrapper, "__module__", None) or "")
    for part in str(getattr(wrapper, "__qualname__", "<locals>")).split("."):
        found = getattr(found, part, None)
    return found is wrapper


def _decorated_again(wrapped: Callable[..., Any], options: dict[str, Any]) -> Any:
    """A decorated function unpickled: the function, decorated as it was."""
    from devicectx.decorator._decorator import device_agnostic  # which imports this module

    return device_agnostic(wrapped, **options)


def _script_refusal(wrapper: DeviceAgnosticWrapper) -> str:
    """Why ``torch.jit.script`` refuses a decorated function, and the fix."""
    name = wrapper.__qualname__
    return (
        f"@device_agnostic cannot be compiled by torch.jit.script, which would run {name}() "
        f"without it (no move, no check, no scope)\n"
        f"fix: torch.jit.trace({name}, example_inputs) records its moves, or call {name}() "
        f"outside the scripted code"
    )


_dynamo_hooks.refuse_script(DeviceAgnosticWrapper, _script_refusal)


class _ForwardWrapper(DeviceAgnosticWrapper):
    """The wrapper of a function named ``forward``: what dynamo gets when it binds it.

    dynamo calls ``type(module).forward``: there the wrapper itself, not a new bound wrapper
    at each access, which dynamo would inline without the hook (torch 2.6 to 2.12) and guard
    by an id that changes (the wrapper itself is what ``Class.forward`` is for a plain
    function anyway). Where dynamo traces the binding (``torch.compile(module)``), it gets
    the entry bound to the module; wrapt's binding is C code it cannot trace. Only
    ``forward`` gets this: a Python ``__get__`` slows each access, so other
    methods keep wrapt's, but in the fallback. (:func:`wrap` gives each its ``__get__``.)
    """


def _method_get(
    self: DeviceAgnosticWrapper, instance: object, owner: type | None = None
) -> Any:  # pragma: no cover - a template: _binding() makes copies of it, with their globals
    """The ``__get__`` of a decorated function, where it is Python's: through the class, the
    wrapper itself; where dynamo traces it, the entry bound to the instance (wrapt's binding
    is C code dynamo cannot trace); else wrapt's binding."""
    if instance is None:
        return self
    if _is_traced():
        return _partial(_entry, instance)  # type: ignore[name-defined]  # noqa: F821
    return _wrapt_get(self, instance, owner)


def _classmethod_get(
    self: DeviceAgnosticWrapper, instance: object, owner: type | None = None
) -> Any:  # pragma: no cover - a template: _binding() makes copies of it, with their globals
    """:func:`_method_get` for a classmethod: bound to the class."""
    if _is_traced():
        return _partial(_entry, type(instance) if owner is None else owner)  # type: ignore[name-defined]  # noqa: F821
    return _wrapt_get(self, instance, owner)


def _binding(template: Callable[..., Any], entry: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of a ``__get__`` template with ``entry`` among its globals: dynamo, tracing it,
    can read neither a wrapt proxy's attributes nor a closure of a ``__get__`` (torch 2.10)."""
    names = {
        "_entry": entry,
        "_partial": _partial,
        "_is_traced": _is_traced,
        "_wrapt_get": _wrapt_get,
    }
    return _compiled.copy_with_globals(template, names)


class _ClassMethodWrapper(DeviceAgnosticWrapper):
    """The wrapper of a ``classmethod`` object.

    dynamo sees one (it passes for a ``classmethod``) and calls its ``__func__``, which
    wrapt would pass on to the raw function, dropping the wrapper: here ``__func__`` is the
    entry, which takes ``cls`` as the raw function does, and whose ``__wrapped__`` is the
    raw function (``mock``'s autospec reads its signature). Eager code does not call it:
    wrapt binds through ``__wrapped__``, and the bound method answers ``__func__`` with the
    function decorated (:class:`_BoundWrapper`).
    """

    @property
    def __func__(self) -> Callable[..., Any]:
        entry: Callable[..., Any] = self._self_entry
        return entry


def wrap(wrapped: Callable[..., Any], plan: Plan) -> Any:
    """Decorate ``wrapped`` with ``plan``: the wrapper, of a class of its own."""
    if isinstance(wrapped, staticmethod):
        # A real staticmethod of a function's wrapper: what dynamo and Python bind it to is
        # that wrapper, the same at each access.
        return staticmethod(wrap(wrapped.__func__, plan))
    if isinstance(wrapped, classmethod):
        base: type[DeviceAgnosticWrapper] = _ClassMethodWrapper
    elif getattr(wrapped, "__name__", None) == "forward":
        base = _ForwardWrapper
    else:
        base = DeviceAgnosticWrapper
    entry = _compiled.entry_function(plan, wrapped)
    namespace: dict[str, Any] = {"__module__": base.__module__, "__qualname__": base.__qualname__}
    if base is _ForwardWrapper:
        namespace["__get__"] = _binding(_method_get, entry)
    cls = type(base.__name__, (base,), namespace)
    wrapper = cls(wrapped, plan, entry)
    if base is _ClassMethodWrapper:
        # Its bound method's ``__func__``: the function decorated, as ``@classmethod``
        # written above the decorator holds it. The classmethod's own is the entry (for
        # dynamo), whose signature, for mock's autospec, is the function's.
        function = cast(Any, wrapped).__func__
        wrapper._self_function = wrap(function, plan)
        entry.__wrapped__ = function  # type: ignore[attr-defined]
    _dynamo_hooks.install(cls, wrapper, entry)
    # A class is freed by the cycle collector only; what it holds (the entry, and through
    # it the plan and the function) is let go with the wrapper, as a function's would be.
    weakref.finalize(wrapper, _forget, cls)
    if base is _ClassMethodWrapper or (base is DeviceAgnosticWrapper and _in_class(plan.name)):
        _REBINDABLE.add(cls)
        if _PYTHON_BINDING or _compiled.fallback():
            _bind_in_python(cls, True)
    return wrapper


def _forget(cls: type[DeviceAgnosticWrapper]) -> None:
    """Drop what a dead wrapper's class holds of its function."""
    _REBINDABLE.discard(cls)
    for name in (*_dynamo_hooks.CLASS_HOOKS, "__get__"):
        if name in vars(cls):
            delattr(cls, name)


def _in_class(qualname: str) -> bool:
    """Whether a function of this ``__qualname__`` was defined in a class body: a method.

    Only methods get a Python ``__get__`` in the fallback: torch 2.6 binds one even where
    Python does not, for a function kept in an instance's ``__dict__``.
    """
    parts = qualname.split(".")
    return len(parts) > 1 and parts[-2] != "<locals>"


def use_fallback(value: bool | None) -> None:
    """Decide whether decorated calls run eagerly under ``torch.compile`` (None: probe again).

    The probe decides at first use; tests force either branch. This sets the flag
    (:func:`devicectx.decorator._compiled.set_fallback_flag`) and rebinds the wrappers of
    methods for the branch. Code compiled before is not recompiled: call
    ``torch._dynamo.reset()`` as well.
    """
    _compiled.set_fallback_flag(value)
    for cls in list(_REBINDABLE):
        _bind_in_python(cls, _PYTHON_BINDING or bool(value))


def _bind_in_python(cls: type[DeviceAgnosticWrapper], python: bool) -> None:
    """Give a wrapper's class a Python ``__get__`` (in the fallback), or wrapt's (C) back.

    In the fallback a wrapper does not pass for a function while dynamo traces, so dynamo
    binds a decorated method by tracing its ``__get__``: wrapt's is C code it cannot trace.
    Elsewhere wrapt's is kept: a Python one slows each access of a method.
    """
    if not python:
        if "__get__" in vars(cls):
            del cls.__get__
        return
    template = _classmethod_get if issubclass(cls, _ClassMethodWrapper) else _method_get
    entry = getattr(cls, _dynamo_hooks.INLINE)
    cls.__get__ = _binding(template, entry)  # type: ignore[method-assign]


# The classes of wrappers of methods, whose binding changes with the fallback (forward's is
# always Python); weakly held, as a class lives as long as its one wrapper.
_REBINDABLE: weakref.WeakSet[type[DeviceAgnosticWrapper]] = weakref.WeakSet()
