"""``on_device``: torch's default device for a block or a function, per thread and task.

The block enters and leaves its scope through :mod:`devicectx.scope._stack`, which keeps the
scopes of each thread and asyncio task; this module adds what a block has beyond a scope
(torch's mode for ``exact=True``, the autocast of ``precision=``, the audit), entry from
compiled code, and the decorator form (a function, coroutine or generator re-enters its
block at each call or resume: :mod:`devicectx.scope._resumed`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import AsyncGenerator, Callable, Generator
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, TypeVar, cast

import torch

from devicectx._errors import InvalidDeviceError, ScopeExitError, check_switches
from devicectx._torch.dynamo import constant, disable, graph_break
from devicectx._torch.modes import DeviceContext
from devicectx.devices._resolve import DeviceLike, check_form, resolve_device
from devicectx.scope._audit import AuditLevel, AuditOption, check_audit
from devicectx.scope._precision import PrecisionName, check_precision_name, choose_precision
from devicectx.scope._resumed import resumed, resumed_async_generator_function
from devicectx.scope._stack import (
    Block,
    Scope,
    current_device,
    finish_leaving,
    leave_opened_since,
    open_here,
    open_scopes,
    pop_device,
    push_block,
    push_device,
)

# current_device: pickles made by devicectx 0.1.0 name it in this module (as
# ``devicectx._context.current_device``), and load it from here.
__all__ = ["current_device", "on_device"]

_F = TypeVar("_F", bound=Callable[..., Any])
_is_compiling = torch.compiler.is_compiling

_Amp = AbstractContextManager[Any]
_EAGER_BLOCKS = threading.local()  # blocks with a precision entered from compiled code


def _enter_block(
    device: torch.device, exact: bool, precision: str | None, audit: AuditLevel | None = None
) -> tuple[Scope, _Amp | None]:
    """Enter the scope for ``device``, then the autocast for ``precision``."""
    amp = None
    if precision is not None:
        amp = choose_precision(device, cast(PrecisionName, precision)).autocast()
    scope = push_device(device, exact=exact, audit=audit)
    if amp is not None:
        try:
            amp.__enter__()
        except BaseException:
            pop_device(scope)
            raise
    return scope, amp


def _leave_block(scope: Scope, amp: _Amp | None) -> None:
    try:
        if amp is not None:
            amp.__exit__(None, None, None)
    finally:
        pop_device(scope)


def _enter_eagerly(device: torch.device, exact: bool, precision: str) -> None:
    _EAGER_BLOCKS.__dict__.setdefault("entered", []).append(_enter_block(device, exact, precision))


def _exit_eagerly() -> None:
    _leave_block(*_EAGER_BLOCKS.entered.pop())


# Compiled code enters and leaves a block with a precision through these, run eagerly
# behind graph breaks (they take and keep nothing dynamo would have to rebuild). Made
# while dynamo traces: torch.compiler.disable imports dynamo, which import devicectx must not.
_EAGERLY: dict[str, Callable[..., None]] = {}


@constant
def _prepare_eagerly() -> bool:
    if not _EAGERLY:
        _EAGERLY.update(enter=disable(_enter_eagerly), exit=disable(_exit_eagerly))
    return True


_NOT_TAKEN = object()  # an exit interrupted before it took its entry


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
        >>> import numpy as np
        >>> with on_device("meta", audit="raise"):  # doctest: +ELLIPSIS
        ...     torch.from_numpy(np.zeros(2))
        Traceback (most recent call last):
        ...
        devicectx.StrayTensorError: torch.from_numpy at ...:2 made a tensor on cpu ...
        fix: torch.as_tensor(array, device="meta")

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
        exact: also put a mode on torch's stack, as ``with torch.device`` does (see the
            cost below), for code that called a constructor by a name bound before the
            first block opened.
        precision: also run the block under ``torch.autocast`` for ``device``'s type, the
            precision named as Lightning names it: ``"bf16-mixed"``, ``"16-mixed"``,
            ``"32"`` (or ``"32-true"``: autocast off, an outer one included), or ``"auto"``,
            what the device runs best (:func:`~devicectx.choose_precision` says which, and
            why). None (the default) leaves autocast as it is.
        audit: ``True`` warns (``StrayTensorWarning``, once per line and op), ``"raise"``
            raises ``StrayTensorError`` (every time, before the tensor reaches the code),
            where code in the block makes a tensor that does not land on ``device``:
            ``torch.from_numpy``, ``torch.frombuffer``, ``*_like`` and ``Tensor.new_*`` of a
            tensor elsewhere, an explicit ``device=``, a ``generator=`` on another device,
            a buffer or parameter registered on another device. Results of ops on existing
            tensors are not reported (they follow their inputs; ``@device_agnostic``
            reports mixed inputs where they meet), nor tensors torch's own code makes on
            purpose. See :mod:`devicectx.scope._audit`.

    What it costs. Only the tensor constructors change inside a block: they are replaced
    at the first block of the process that changes the device (and stay, costing a call
    outside blocks one Python call), and fill in the device inside (about what torch's
    ``DeviceContext`` costs a constructor). Entering and leaving a block is a push on a
    context variable (a fixed spec such as ``"meta"`` is resolved once per process;
    docs/performance.md compares it with ``with torch.device``). Every other
    torch call costs what it costs outside: ``with torch.device`` instead sends every torch
    call in the thread through a Python mode, which slows the launch of small ops. With
    ``exact=True`` the block costs what ``with torch.device`` does. With ``audit``, the
    thread has a mode on torch's stack while the block is open: every torch call in it
    pays a mode dispatch, and a call that makes tensors a look at their device.
    ``audit=False`` costs nothing.

    Raises:
        InvalidDeviceError: ``device`` is malformed (``"cdua"``, ``3.5``), raised where the
            block is made (at the ``def`` for ``@on_device(...)``); so is a function given
            as the device (``@on_device`` written without its parentheses).
        DeviceUnavailableError: this machine lacks ``device``, raised where the block is
            entered.
        InvalidPrecisionError: ``precision`` is not one of those names (a ``ValueError``),
            raised where the block is made.
        PrecisionUnsupportedError: ``device`` cannot run ``precision`` (a
            ``RuntimeError``), raised where the block is entered.
        ValueError: ``audit`` is not ``False``, ``True`` or ``"raise"``.
        TypeError: decorating a class; ``exact`` is not a bool (``"no"`` reads as True).

    Caveats:
        - Each thread and each asyncio task sees only its own blocks; a task created inside
          a block sees it while the block is open, not after it has closed (unlike a
          context variable's value, which the task keeps).
        - Code run in a copy of the context in another thread (``asyncio.to_thread``,
          ``contextvars.copy_context().run``) sees the block as such a task does. On an
          accelerator with several devices, the block's index becomes current there at its
          first constructor or devicectx call (``.cuda()`` before any finds the thread's
          own), and the thread has its own back when a ``concurrent.futures`` job ends.
          ``loop.run_in_executor`` copies no context: its function sees no block. There
          ``exact=True`` does not apply (a constructor held in an object gets torch's
          default) and nothing is audited.
        - A generator that yields inside a ``with on_device(...)`` block leaks the device to
          its caller between items, as any context manager would; decorate the generator
          function instead: the device is then entered at every resume and left at every
          yield.
        - Above ``@contextlib.contextmanager`` it is refused; below, the block is left at the
          ``yield``, so the ``with`` body runs outside it: write ``with on_device(...):``
          around the ``yield`` instead.
        - ``precision=`` is autocast, torch's per-thread state: a block or a decorated
          coroutine held across an ``await`` computes other tasks' code in it meanwhile (the
          tasks it creates or gathers too).
        - torch's default device does not reach ``*_like`` functions, ``torch.from_numpy``,
          ``torch.frombuffer`` or ``torch.Generator``; nor do ops on existing tensors.
        - A reference to one of torch's constructors held inside an object, a closure or
          a default argument since before the first block (``self.op = torch.ones``) is
          torch's own function and allocates on torch's default: call the constructor by
          its name, or pass ``exact=True``. Module-level names, in any module, are covered.
        - One ``on_device`` object may be re-entered (nested) and shared: threads and
          tasks that enter it at once each leave their own block on exit.
        - Audit: nested blocks audit against the innermost block's device, audited or
          not, while any enclosing block of the task audits (the innermost audited block
          sets warn or raise). ``with torch.device`` and ``set_default_device`` inside do
          not change what is audited against. Only the thread or task that entered the
          block is audited. Compiled code (``torch.compile``) is not audited, and a block
          entered inside compiled code does not audit. ``torch.from_numpy`` bound to
          an object before the block opened is not seen.
    """

    def __init__(
        self,
        device: DeviceLike = "auto",
        *,
        exact: bool = False,
        precision: PrecisionName | None = None,
        audit: AuditOption = False,
    ) -> None:
        if callable(device):
            _refuse_callable(device)
        check_switches("on_device", lead="device, ", exact=exact)
        check_form(device)  # a misspelt device fails where the block is written
        self.spec = device
        self.exact = exact
        # A misspelt name fails here, where the block is written, not at its first entry.
        self.precision = None if precision is None else check_precision_name(precision)
        self._audit = check_audit(audit)
        self.audit = audit
        self._plain = not exact and self.precision is None and self._audit is None
        # What each entry (nested entries of this object included) left to undo: a block; a
        # block and the autocast entered with it; the DeviceContext of a traced entry; None
        # for a block with a precision entered from compiled code.
        self._entered: list[Block | tuple[Scope, _Amp | None] | DeviceContext | None] = []

    def __reduce__(self) -> tuple[Callable[..., on_device], tuple[Any, ...]]:
        # What the block is made of; what entering it left to undo stays in this process.
        return _rebuilt, (self.spec, self.exact, self.precision, self.audit)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Load an object pickled by devicectx 0.1.0, which pickled every attribute."""
        self.__init__(  # type: ignore[misc]
            state["spec"],
            exact=state.get("exact", False),
            precision=state.get("precision"),
            audit=state.get("audit", False),
        )

    def __repr__(self) -> str:
        options = ", exact=True" if self.exact else ""
        if self.precision is not None:
            options += f", precision={self.precision!r}"
        if self._audit is not None:
            options += f", audit={self.audit!r}"
        return f"on_device({self.spec!r}{options})"

    def __enter__(self) -> torch.device:
        device = resolve_device(self.spec)
        if _is_compiling():
            if self.precision is not None:
                # dynamo traces autocast only as a `with` statement of the traced code: the
                # block is entered eagerly, behind a graph break (an error with fullgraph).
                graph_break(
                    f"on_device(precision={self.precision!r}) cannot be traced: in compiled "
                    f"code write `with on_device(d), precision_scope(d, {self.precision!r}):`"
                )
                _prepare_eagerly()
                _EAGERLY["enter"](device, self.exact, self.precision)
                self._entered.append(None)
                return device
            # dynamo cannot trace context variables; it does trace a plain DeviceContext.
            plain = DeviceContext(device)
            plain.__enter__()  # type: ignore[no-untyped-call]
            self._entered.append(plain)
            return device
        # An interrupt (Ctrl-C) that lands after the scope is open but before this returns
        # gets no __exit__ from the with statement: the entry is undone here.
        before = open_scopes()
        try:
            if self._plain:  # the common block: no mode, no autocast, no audit
                self._entered.append(push_block(device))
            else:
                self._entered.append(_enter_block(device, self.exact, self.precision, self._audit))
            return device
        except BaseException:
            leave_opened_since(before)
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        entered: Any = _NOT_TAKEN
        try:
            entered = self._entered.pop() if len(self._entered) == 1 else self._own_entry()
            if type(entered) is Block:
                pop_device(entered)
            elif type(entered) is tuple:
                _leave_block(*entered)
            elif entered is None:
                _EAGERLY["exit"]()
            else:
                entered.__exit__(exc_type, exc, traceback)
        except ScopeExitError:
            raise
        except BaseException:
            # An interrupt cut the exit short: the block's device must not outlive it.
            if entered is _NOT_TAKEN and len(self._entered) == 1:
                entered = self._entered.pop()
            scope = entered[0] if type(entered) is tuple else entered
            if isinstance(scope, Scope):
                finish_leaving(scope)
            raise

    def _own_entry(self) -> Block | tuple[Scope, _Amp | None] | DeviceContext | None:
        """The latest entry of this object made in this thread or task: one object shared
        by tasks (or threads) is entered by each in turn, and their exits interleave."""
        for index in range(len(self._entered) - 1, -1, -1):
            entry = self._entered[index]
            scope = entry if type(entry) is Block else entry[0] if type(entry) is tuple else None
            if scope is not None and open_here(scope):
                return self._entered.pop(index)
        if not self._entered:
            raise _extra_exit(self)
        return self._entered.pop()  # traced entries: the latest, as nesting makes it

    def __call__(self, func: _F) -> _F:
        if inspect.isclass(func):
            raise TypeError(_class_refusal(func))
        made_by = _CONTEXT_MANAGER_FACTORIES.get(getattr(func, "__code__", None))
        if made_by is not None:
            raise TypeError(_context_manager_refusal(self, func, made_by))
        if inspect.isasyncgenfunction(func):
            return cast(_F, self._wrap_async_generator(func))
        if inspect.isgeneratorfunction(func):
            return cast(_F, self._wrap_generator(func))
        if inspect.iscoroutinefunction(func):
            return cast(_F, self._wrap_coroutine(func))
        return cast(_F, self._wrap_function(func))

    def _again(self) -> on_device:
        """A fresh block like this one: a decorated function may run in several threads."""
        return on_device(
            self.spec,
            exact=self.exact,
            precision=self.precision,  # type: ignore[arg-type]
            audit=self.audit,
        )

    def _resumable(self) -> tuple[Callable[[], Any], Callable[[Any], None]]:
        """How a generator enters a block at every resume and leaves it at every yield."""
        block = self._again()
        block.spec = resolve_device(self.spec)  # resolved once, at the generator's creation
        return block.__enter__, lambda _device: block.__exit__(None, None, None)

    def _wrap_function(self, func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            with self._again():
                return func(*args, **kwargs)

        return run

    def _wrap_coroutine(self, func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        async def run(*args: Any, **kwargs: Any) -> Any:
            with self._again():
                return await func(*args, **kwargs)

        return run

    def _wrap_generator(self, func: Callable[..., Generator[Any, Any, Any]]) -> Callable[..., Any]:
        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
            enter, leave = self._resumable()
            inner = func(*args, **kwargs)  # runs none of the body yet
            return (yield from resumed(inner, enter, leave))

        return run

    def _wrap_async_generator(
        self, func: Callable[..., AsyncGenerator[Any, Any]]
    ) -> Callable[..., Any]:
        return resumed_async_generator_function(func, self._resumable)


def _made_by(factory: Callable[..., Any]) -> object:
    """The code of the functions ``factory`` returns (one code object for all of them)."""
    return getattr(factory(lambda: None), "__code__", None)


# What @contextmanager returns makes the context manager object and returns: decorated, it
# would be in the block for that alone (its generator runs at the `with`, after it).
_CONTEXT_MANAGER_FACTORIES = {
    _made_by(contextlib.contextmanager): "contextmanager",
    _made_by(contextlib.asynccontextmanager): "asynccontextmanager",
}


def _context_manager_refusal(block: on_device, factory: Callable[..., Any], made_by: str) -> str:
    """Why ``@on_device`` cannot go above ``@contextmanager``, and the form that works."""
    name = getattr(factory, "__name__", "the generator")
    return (
        f"@{block!r} written above @{made_by} would be in the block only while "
        f"{name}() makes its context manager: the generator's code and the `with` body "
        f"run after, outside it (below @{made_by}, the block is left at the `yield`, so "
        f"the `with` body runs outside it too)\n"
        f"fix: in `{'async def' if made_by.startswith('async') else 'def'} {name}`, write "
        f"`with {block!r}:` around the `yield`"
    )


def _extra_exit(block: on_device) -> ScopeExitError:
    """The error for an ``__exit__`` of ``block`` with none of its entries open."""
    msg = (
        f"{block!r}.__exit__() was called once more than its __enter__(): no entry of this "
        f"object is open\n"
        f"fix: call __exit__ once per __enter__, or write `with {block!r}:`"
    )
    return ScopeExitError(msg)


def _class_refusal(cls: type) -> str:
    """Why a class cannot take ``@on_device``, and what can."""
    return (
        f"on_device cannot decorate the class {cls.__name__}: decorate its methods instead "
        f"(`@on_device(...)` on `def forward`), or use `with on_device(...):` inside them"
    )


def _refuse_callable(device: Callable[..., Any]) -> None:
    """Refuse a function (or a class) given as the device: ``@on_device`` written without
    its parentheses passes the function it decorates. Refused where it is written, not at
    the first call. A module, which is callable too, is left to the device's resolution,
    which says that it is not a device.

    Raises:
        TypeError: a class, as decorating one is refused.
        InvalidDeviceError: anything else callable but a module, with the fix.
    """
    __tracebackhide__ = True
    if inspect.isclass(device):
        raise TypeError(_class_refusal(device))
    if isinstance(device, torch.nn.Module):
        return
    name = getattr(device, "__qualname__", None)
    what = f"the function {name}" if name is not None else f"a {type(device).__qualname__}"
    above = f"`def {name.rpartition('.')[2]}`" if name is not None else "its `def`"
    msg = (
        f"on_device got {what} where the device goes (@on_device written without "
        f"parentheses?)\n"
        f'fix: @on_device("auto") above {above}, or name the device: @on_device("cuda:0")'
    )
    raise InvalidDeviceError(msg)


def _rebuilt(
    spec: DeviceLike, exact: bool, precision: PrecisionName | None, audit: AuditOption
) -> on_device:
    """An ``on_device`` object loaded from a pickle."""
    return on_device(spec, exact=exact, precision=precision, audit=audit)
