"""``on_device``: torch's default device for a block, isolated per thread and asyncio task.

How it works. torch keeps the default device as ``DeviceContext`` modes on a per-thread
stack; ``with torch.device(d)`` pushes one and pops whatever is on top at exit, so two
asyncio tasks that leave their blocks out of order swap devices, and every task in the
thread sees every other task's device. Here each block is a ``_Scope`` (a ``DeviceContext``,
so ``torch.get_default_device()`` and dynamo understand it) that applies only where it is
listed in ``_ACTIVE``, a context variable: asyncio gives each task its own copy, and each
thread starts with an empty one. A scope that is not active in the running task passes
constructor calls through to the modes below it, and leaving a block removes its own
scope wherever it is, so exits in any order restore the right state
(:mod:`devicectx._torch_modes` does the stack work).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator
from contextvars import ContextVar
from types import TracebackType
from typing import Any, TypeVar, cast

import torch

from devicectx import _torch_modes
from devicectx._resolve import DeviceLike, accelerator_type, resolve_device, with_index
from devicectx._resumed import async_resumed, resumed
from devicectx._torch_modes import stack_length

_F = TypeVar("_F", bound=Callable[..., Any])
_CPU = torch.device("cpu")
_NEVER_ACCELERATOR = frozenset({"cpu", "meta"})

# The factory functions torch's own DeviceContext fills in ``device=`` for; read once,
# as a frozenset, so the per-op check is one hash lookup (torch calls an lru_cache each time).
_CONSTRUCTORS: frozenset[Callable[..., Any]] = frozenset(torch.utils._device._device_constructors())


class _Scope(_torch_modes.DeviceContext):
    """One entered ``on_device`` block: its target, and whether it is installed in torch."""

    def __init__(self, target: torch.device) -> None:
        # DeviceContext.__init__ would set ``self.device``, which here is a property.
        self.target = target
        self.installed = False
        self.closed = False
        self.previous_index: int | None = None

    # torch's DeviceContext has a plain attribute here; a scope computes it per task.
    @property
    def device(self) -> torch.device:  # type: ignore[override]
        """What ``torch.get_default_device()`` reports while this scope is the topmost."""
        if self in _ACTIVE.get():
            return self.target
        for position in range(_torch_modes.stack_length() - 1, -1, -1):
            if _torch_modes.mode_at(position) is self:
                return _device_below(position - 1) or _CPU
        return current_device()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        # A scope of another task passes the call on to the modes below, unchanged.
        if func in _CONSTRUCTORS and kwargs.get("device") is None and self in _ACTIVE.get():
            kwargs["device"] = self.target
        return func(*args, **kwargs)


# The scopes entered in this thread or task, innermost last. A tuple, so that tasks
# (which copy the context) never share a mutable list.
_ACTIVE: ContextVar[tuple[_Scope, ...]] = ContextVar("devicectx_active_scopes", default=())


def _device_below(position: int) -> torch.device | None:
    """The device the modes from ``position`` down give the running task, if any."""
    active = _ACTIVE.get()
    for below in range(position, -1, -1):
        mode = _torch_modes.mode_at(below)
        if isinstance(mode, _Scope):
            if mode in active:
                return mode.target
        elif isinstance(mode, _torch_modes.DeviceContext):
            return with_index(mode.device)
    return None


def current_device() -> torch.device:
    """The device that tensors created here without ``device=`` land on.

    The same answer as ``torch.get_default_device()``, with the index filled in.

    Example:
        >>> with on_device("meta"):
        ...     current_device()
        device(type='meta')
    """
    return _device_below(_torch_modes.stack_length() - 1) or _CPU


def active_device() -> torch.device | None:
    """The target of the innermost ``on_device`` block entered here, or None outside any.

    Unlike :func:`current_device`, this ignores torch's own default (``set_default_device``,
    ``with torch.device``): it answers "did the caller ask for a device with on_device?".
    """
    active = _ACTIVE.get()
    if not active:  # the common case, on every decorated call: answered at once
        return None
    for scope in reversed(active):
        if not scope.closed:
            return scope.target
    return None


def push_device(device: torch.device) -> _Scope:
    """Enter a scope for an already resolved ``device``; undo it with :func:`pop_device`.

    Where ``device`` already is the effective default, torch's mode stack is left alone,
    so code inside pays nothing per op; the scope is still recorded for
    :func:`active_device`.
    """
    scope = _Scope(device)
    if current_device() != device:
        _torch_modes.install(scope, device)
        scope.installed = True
        # The CPU and meta never are the accelerator: spare them the question (0.25 µs).
        if device.type not in _NEVER_ACCELERATOR and device.type == accelerator_type():
            # torch's own scope does not make the index current (pytorch/pytorch#148864),
            # but `.cuda()`, streams and synchronize() follow the current index.
            index = torch.accelerator.current_device_index()
            if device.index is not None and index != device.index:
                scope.previous_index = index
                torch.accelerator.set_device_index(device.index)
    _ACTIVE.set((*_ACTIVE.get(), scope))
    return scope


def pop_device(scope: _Scope) -> None:
    """Leave a scope entered with :func:`push_device`, whatever was entered since."""
    scope.closed = True
    active = _ACTIVE.get()
    if active and active[-1] is scope:
        _ACTIVE.set(active[:-1])
    else:
        _ACTIVE.set(tuple(s for s in active if s is not scope))
    if scope.installed:
        _torch_modes.uninstall(scope)
        if scope.previous_index is not None:
            torch.accelerator.set_device_index(scope.previous_index)


def push_nested(device: torch.device) -> _Scope | None:
    """:func:`push_device` for ``@device_agnostic``, which enters a scope on every call.

    Where ``device`` already is the effective default, nothing is entered at all (it would
    change nothing), so the common case costs one look at the mode stack; None comes back.
    """
    if (_CPU if not stack_length() else current_device()) == device:
        return None
    return push_device(device)


def pop_nested(entered: _Scope | None) -> None:
    """Leave a scope entered with :func:`push_nested`."""
    if entered is not None:
        pop_device(entered)


class on_device:
    """Make ``device`` torch's default device for a block or a function.

    Example:
        >>> import torch
        >>> with on_device("meta") as device:
        ...     torch.zeros(3).device == device
        True
        >>> @on_device("meta")
        ... def make():
        ...     return torch.ones(2)
        >>> make().device
        device(type='meta')

    Inside, torch factory functions called without ``device=`` (``torch.zeros``,
    ``torch.arange``, ``torch.tensor``, ...) allocate on ``device`` and
    ``torch.get_default_device()`` reports it; on an accelerator, the device's index is
    also made current. On exit, by return, exception or ``KeyboardInterrupt``, the previous
    state comes back exactly. Blocks nest to any depth, and compose with
    ``with torch.device(...)`` and ``torch.set_default_device`` in either order (a
    ``set_default_device`` call inside a block takes effect at once and outlives it).

    Args:
        device: any spec :func:`~devicectx.resolve_device` takes; ``"auto"`` (the
            default) picks this machine's accelerator, or the CPU. It is resolved when
            the block is entered, or at each call of a decorated function.

    Raises:
        InvalidDeviceError: ``device`` is malformed.
        DeviceUnavailableError: this machine lacks ``device``.
        TypeError: decorating a class.

    Caveats:
        - Each thread and each asyncio task sees only its own blocks; a task created inside
          a block inherits it, as it inherits every context variable.
        - A generator that yields inside a ``with on_device(...)`` block leaks the device to
          its caller between items, as any context manager would; decorate the generator
          function instead: the device is then entered at every resume and left at every
          yield.
        - torch's default device does not reach ``*_like`` functions, ``torch.from_numpy``,
          ``torch.frombuffer`` or ``torch.Generator``; nor do ops on existing tensors.
        - One ``on_device`` object may be re-entered (nested), but not entered from several
          threads at once: create one per block, or use the decorator form.
    """

    def __init__(self, device: DeviceLike = "auto") -> None:
        self.spec = device
        self._entered: list[_Scope | _torch_modes.DeviceContext] = []

    def __repr__(self) -> str:
        return f"on_device({self.spec!r})"

    def __enter__(self) -> torch.device:
        device = resolve_device(self.spec)
        if torch.compiler.is_compiling():
            # dynamo cannot trace context variables; it does trace a plain DeviceContext.
            plain = _torch_modes.DeviceContext(device)
            plain.__enter__()  # type: ignore[no-untyped-call]
            self._entered.append(plain)
        else:
            self._entered.append(push_device(device))
        return device

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        entered = self._entered.pop()
        if isinstance(entered, _Scope):
            pop_device(entered)
        else:
            entered.__exit__(exc_type, exc, traceback)  # type: ignore[no-untyped-call]

    def __call__(self, func: _F) -> _F:
        if inspect.isclass(func):
            name = func.__name__
            msg = (
                f"on_device cannot decorate the class {name}: decorate its methods instead "
                f"(`@on_device(...)` on `def forward`), or use `with on_device(...):` inside them"
            )
            raise TypeError(msg)
        if inspect.isasyncgenfunction(func):
            return cast(_F, self._wrap_async_generator(func))
        if inspect.isgeneratorfunction(func):
            return cast(_F, self._wrap_generator(func))
        if inspect.iscoroutinefunction(func):
            return cast(_F, self._wrap_coroutine(func))
        return cast(_F, self._wrap_function(func))

    def _wrap_function(self, func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            with on_device(self.spec):
                return func(*args, **kwargs)

        return run

    def _wrap_coroutine(self, func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        async def run(*args: Any, **kwargs: Any) -> Any:
            with on_device(self.spec):
                return await func(*args, **kwargs)

        return run

    def _wrap_generator(self, func: Callable[..., Generator[Any, Any, Any]]) -> Callable[..., Any]:
        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
            enter = functools.partial(push_device, resolve_device(self.spec))
            inner = func(*args, **kwargs)  # runs none of the body yet
            return (yield from resumed(inner, enter, pop_device))

        return run

    def _wrap_async_generator(
        self, func: Callable[..., AsyncGenerator[Any, Any]]
    ) -> Callable[..., Any]:
        # An async generator function itself (not a function returning one), so that
        # inspect.isasyncgenfunction, which frameworks test, still says True.
        @functools.wraps(func)
        async def run(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, Any]:
            enter = functools.partial(push_device, resolve_device(self.spec))
            driver = async_resumed(func(*args, **kwargs), enter, pop_device)
            step: Callable[[], Awaitable[Any]] = functools.partial(driver.asend, None)
            while True:
                try:
                    item = await step()
                except StopAsyncIteration:
                    return
                try:
                    sent = yield item
                except GeneratorExit:
                    await driver.aclose()
                    raise
                except BaseException as error:
                    step = functools.partial(driver.athrow, error)
                else:
                    step = functools.partial(driver.asend, sent)

        return run
