"""``on_device``: torch's default device for a block, isolated per thread and asyncio task.

How it works. Each block is a ``_Scope`` listed in ``_ACTIVE``, a context variable: asyncio
gives each task its own copy, and each thread starts with an empty one. The scope of a
decorated call (``@device_agnostic``, a plain function) is a ``_Call`` on a list of the
thread (``_CALLS``) instead: its body runs to its end before any other task of the thread
runs, and a context variable costs each change an allocation (half the cost of a decorated
call to an accelerator); a call knows the blocks open at its start, so a block entered in its
body is the inner one. From the first scope of the process that changes the device,
torch's tensor constructors are wrappers (:mod:`devicectx.scope._constructors`) that ask
:func:`scope_device` for the running task's device and fill in ``device=``; no
mode sits on torch's stack, so every other torch call costs what it costs outside a block.
torch's own default-device state (``with torch.device``, ``set_default_device``) is read
and composed with in :mod:`devicectx._torch.modes`: a ``with torch.device`` block entered
inside a scope wins inside it, and ``set_default_device`` inside a scope takes effect at once.
``exact=True`` adds a mode, as torch's own default device does, for code that holds one of
torch's constructors in an object since before the first scope opened.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Iterator
from contextlib import AbstractContextManager
from contextvars import ContextVar
from types import TracebackType
from typing import Any, TypeVar, cast

import torch
from torch.overrides import TorchFunctionMode

from devicectx._torch import modes as _torch_modes
from devicectx._torch.constructors import device_constructors
from devicectx._torch.dynamo import (
    constant,
    disable,
    faking,
    graph_break,
    traced_mode_stack,
    tracing,
)
from devicectx._torch.modes import (
    DEVICE_MODULE_GLOBALS,
    EMPTY_SLOT,
    GLOBAL_DEVICE_CONTEXT,
    SLOT_KEY,
    DeviceContext,
    default_slot,
    innermost_device_mode,
    innermost_of,
    stack_length,
    swap_current_device,
)
from devicectx.devices._resolve import DeviceLike, accelerator_type, resolve_device, with_index
from devicectx.scope._audit import AuditLevel, AuditOption, Auditor, check_audit
from devicectx.scope._constructors import constructor_patch
from devicectx.scope._precision import PrecisionName, check_precision_name, choose_precision
from devicectx.scope._resumed import async_resumed, resumed

_F = TypeVar("_F", bound=Callable[..., Any])
_CPU = torch.device("cpu")
_is_compiling = torch.compiler.is_compiling


_UNCHANGED = object()
# A block whose device torch gives already, on its own (no block, no mode around it: the
# CPU): constructors in it need no device, and are left to torch at once.
_TORCH_OWN = object()
"""A scope's ``previous`` where it changed nothing (its device already was the default)."""


class _Scope:
    """One scope entered by ``@device_agnostic`` (or the base of a block): its target, and
    what it changed to get there. Five slots: it is made at every decorated call."""

    __slots__ = ("below", "closed", "default", "previous", "target")

    # What only a block (:class:`_Block`) sets; read as None here.
    audit: AuditLevel | None = None  # audit=True: "warn"; audit="raise": "raise"
    mode: _ExactMode | None = None  # exact=True: a mode on torch's stack
    previous_index: int | None = None  # the accelerator's index it made current

    def __init__(
        self, target: torch.device, below: DeviceContext | None, default: object, previous: object
    ) -> None:
        self.target = target
        # torch's innermost DeviceContext when the block was entered: a different one later
        # means a `with torch.device` block was entered inside this one, and it wins.
        self.below = below
        # What torch's per-thread default slot held: set_default_device called inside the
        # block puts another object there, and takes over at once.
        self.default = default
        # dynamo's CURRENT_DEVICE before the block, given back at exit; _UNCHANGED where the
        # block changed nothing, _TORCH_OWN where torch gives its device by itself.
        self.previous = previous
        self.closed = False  # left (a task created inside may still list it)


class _Block(_Scope):
    """An entered ``on_device`` block, or a scope that made an accelerator index current."""

    __slots__ = ("audit", "mode", "previous_index")

    def __init__(
        self, target: torch.device, below: DeviceContext | None, default: object, previous: object
    ) -> None:
        # _Scope.__init__'s lines, not a call of it: a block is entered per call too.
        self.target = target
        self.below = below
        self.default = default
        self.previous = previous
        self.closed = False
        self.audit = None
        self.mode = None
        self.previous_index = None


class _Call(_Scope):
    """The scope of a decorated call running in this thread (:func:`call_scoped`).

    Not in the context variable: a call's body runs to its end before any other task of
    the thread runs, so a list per thread holds these, and nothing is left to close when
    the call returns (a task created in the body, which runs later, never sees it).
    """

    __slots__ = ("outer",)

    def __init__(
        self,
        target: torch.device,
        below: DeviceContext | None,
        default: object,
        outer: tuple[_Scope, ...],
    ) -> None:
        self.target = target
        self.below = below
        self.default = default
        # The task's blocks when the call began: a block not among them was entered inside.
        self.outer = outer
        # (``closed`` and ``previous`` stay unset: a call's scope is never read for them.)


class _Calls(threading.local):
    """The scopes of the decorated calls running in this thread, innermost last."""

    def __init__(self) -> None:
        self.scopes: list[_Call] = []


class _ExactMode(TorchFunctionMode):
    """``on_device(..., exact=True)``: torch's own mechanism, reading the running task's scope.

    Every torch call in the thread passes through it, as through torch's ``DeviceContext``,
    so constructors bound to other names are covered too.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if kwargs.get("device") is None and func in _CONSTRUCTORS:
            device = scope_device()
            if device is not None:
                kwargs["device"] = device
        return func(*args, **kwargs)


# The factory functions torch's own DeviceContext fills in ``device=`` for; read once,
# as a frozenset, so the per-op check is one hash lookup (torch calls an lru_cache each time).
_CONSTRUCTORS: frozenset[Callable[..., Any]] = frozenset(device_constructors())

# The scopes entered in this thread or task, innermost last. A tuple, so that tasks
# (which copy the context) never share a mutable list.
_ACTIVE: ContextVar[tuple[_Scope, ...]] = ContextVar("devicectx_active_scopes", default=())


_active = _ACTIVE.get


_CALLS = _Calls()


def _open_scope() -> _Scope | None:
    """The innermost open scope here: a block of the running task, or a decorated call
    running in this thread, whichever was entered last; None outside every scope."""
    active = _active()
    calls = _CALLS.scopes
    if calls:
        call = calls[-1]
        outer = call.outer
        # No block entered in the call's body (or each left again: a block is pushed once,
        # and only on top, so the same length and last block mean the same blocks).
        if len(active) == len(outer) and (not outer or active[-1] is outer[-1]):
            return call
        return next(_open_scopes(active, calls), None)
    for scope in reversed(active):
        if not scope.closed:
            return scope
    return None


def _open_scopes(active: tuple[_Scope, ...], calls: list[_Call]) -> Iterator[_Scope]:
    """The open scopes here, innermost first: the task's open blocks, and the thread's
    decorated calls placed among them by the blocks each call began inside."""
    index = len(calls) - 1
    for scope in reversed(active):
        while index >= 0 and scope in calls[index].outer:
            yield calls[index]
            index -= 1
        if not scope.closed:
            yield scope
    yield from reversed(calls[: index + 1])


def scope_device() -> torch.device | None:
    """The device a constructor called here without ``device=`` gets from on_device.

    None where no block applies, and torch's own default (``with torch.device``,
    ``set_default_device``, or the CPU) decides. Code dynamo traces asks
    :func:`traced_scope_device` instead.
    """
    scope = _open_scope()
    if scope is None or (type(scope) is _Block and scope.previous is _TORCH_OWN):
        return None
    if tracing():
        # Code that runs while dynamo compiles: its own (not in the block), or a call of a
        # constructor in its graph, run on fake tensors (as traced code, in the block).
        return traced_scope_device() if faking() else None
    if innermost_device_mode() is not scope.below or default_slot() is not scope.default:
        return None  # torch.device entered, or set_default_device called, inside the block
    return scope.target


@constant  # dynamo cannot trace a context variable: it runs this while tracing
def traced_scope_device() -> torch.device | None:
    """:func:`scope_device` for code dynamo traces, which has its own mode stack."""
    scope = _open_scope()
    if scope is None or default_slot() is not scope.default:
        return None
    return scope.target if innermost_of(traced_mode_stack()) is scope.below else None


def _torch_default() -> torch.device:
    """The device torch's own state gives, without any on_device block."""
    mode = innermost_device_mode()
    return _CPU if mode is None else with_index(mode.device)


@constant
def current_device() -> torch.device:
    """The device that tensors created here without ``device=`` land on.

    The same answer as ``torch.get_default_device()``, with the index filled in.

    Example:
        >>> with on_device("meta"):
        ...     current_device()
        device(type='meta')
    """
    if tracing():
        modes = traced_mode_stack()
        device = traced_scope_device()
        if device is None:
            mode = innermost_of(modes)
            device = _CPU if mode is None else with_index(mode.device)
        return device
    device = scope_device()
    return _torch_default() if device is None else device


_PATCH = constructor_patch(_active, _CALLS, scope_device, traced_scope_device, current_device)
_MODULES = sys.modules
_stack_length = stack_length
# torch's state a scope reads and sets at entry, read here directly (a function call costs
# as much as the read): see :mod:`devicectx._torch.modes`.
_DEVICE_GLOBALS = DEVICE_MODULE_GLOBALS
_CURRENT = "CURRENT_DEVICE"
_SLOT = GLOBAL_DEVICE_CONTEXT
_SLOT_KEY, _EMPTY_SLOT = SLOT_KEY, EMPTY_SLOT


def audit_state() -> tuple[AuditLevel, torch.device] | None:
    """The running task's audit: the innermost audited block's level, and the device of
    its innermost block (audited or not); None where no open block of the task audits."""
    device = None
    for scope in _open_scopes(_active(), _CALLS.scopes):
        if device is None:
            device = scope.target
        if scope.audit is not None:
            return scope.audit, device
    return None


_AUDITOR = Auditor(audit_state)


def active_device() -> torch.device | None:
    """The target of the innermost ``on_device`` block entered here, or None outside any.

    Unlike :func:`current_device`, this ignores torch's own default (``set_default_device``,
    ``with torch.device``): it answers "did the caller ask for a device with on_device?".
    """
    if not _active() and not _CALLS.scopes:  # the common case, on every decorated call
        return None
    scope = _open_scope()
    return None if scope is None else scope.target


def push_device(
    device: torch.device, *, exact: bool = False, audit: AuditLevel | None = None
) -> _Block:
    """Enter a scope for an already resolved ``device``; undo it with :func:`pop_device`.

    Where ``device`` differs from the effective default, the constructors' replacements
    are put in place (once per process; modules loaded since the last block are looked
    through) and dynamo is told the new default; where it is the default already, the
    scope is only recorded (for :func:`active_device`). With ``audit``, the thread's audit
    mode is on until :func:`pop_device`.
    """
    scope = _push_block(device)
    if exact and scope.previous is not _UNCHANGED and scope.previous is not _TORCH_OWN:
        scope.mode = _ExactMode()
        _torch_modes.push_mode(scope.mode)
    if audit is not None:
        scope.audit = audit
        _AUDITOR.acquire()
    return scope


def _push_block(device: torch.device) -> _Block:
    """:func:`push_device` without ``exact`` or ``audit``: every plain ``with on_device``."""
    active = _active()
    if active or _stack_length() or _CALLS.scopes:
        below = innermost_device_mode()
        unchanged = current_device() == device
    else:  # no block, no mode: torch's default is the CPU
        below = None
        unchanged = device == _CPU
        if unchanged:
            scope = _Block(device, below, default_slot(), _TORCH_OWN)
            _ACTIVE.set((*active, scope))
            return scope
    if unchanged:
        scope = _Block(device, below, default_slot(), _UNCHANGED)
        _ACTIVE.set((*active, scope))
        return scope
    return cast(_Block, _enter(device, active, below, _Block))


def _enter(
    device: torch.device,
    active: tuple[_Scope, ...],
    below: DeviceContext | None,
    kind: type[_Scope] = _Scope,
) -> _Scope:
    """Enter a scope that changes the device: the hot path of a decorated call and a block."""
    if len(_MODULES) != _PATCH.seen:  # the first block, or modules loaded since the last
        _PATCH.install()
    # None for a device whose index a scope never changes (the CPU, meta, a machine's only
    # accelerator): one look-up, no call.
    if _index_reader(device, _UNKNOWN) is not None and _makes_index_current(device):
        return _enter_index(device, active, below)
    # As torch's DeviceContext does: dynamo guards compiled code on CURRENT_DEVICE.
    previous = _DEVICE_GLOBALS[_CURRENT]
    _DEVICE_GLOBALS[_CURRENT] = device
    scope = kind(device, below, _SLOT.__dict__.get(_SLOT_KEY, _EMPTY_SLOT), previous)
    _ACTIVE.set((*active, scope))
    return scope


def _enter_index(
    device: torch.device, active: tuple[_Scope, ...], below: DeviceContext | None
) -> _Block:
    """:func:`_enter` for an accelerator device whose index is not the current one."""
    scope = _Block(device, below, default_slot(), swap_current_device(device))
    _ACTIVE.set((*active, scope))
    scope.previous_index = torch.accelerator.current_device_index()
    torch.accelerator.set_device_index(device.index)
    return scope


def _makes_index_current(device: torch.device) -> bool:
    """Whether entering ``device`` changes the accelerator's current index. torch's own
    scope does not (pytorch/pytorch#148864), but `.cuda()`, streams and synchronize()
    follow the current index."""
    index_of = _index_reader(device, _UNKNOWN)
    if index_of is _UNKNOWN:  # asking torch costs 2-4 us a block (the driver, on CUDA)
        index_of = INDEX_READERS[device] = _current_index_of(device)
    return index_of is not None and index_of() != device.index  # type: ignore[operator]


def _current_index_of(device: torch.device) -> Callable[[], int] | None:
    """How to read the current index of ``device``'s type where a scope may have to change
    it; None where it never does: ``device`` has no index, its type is not torch's
    accelerator, or the accelerator has one device, whose index is always the current one
    (a single-GPU machine: the read, 1.6 us on an H100 with torch 2.11, is then saved at
    every scope). The count is fixed for the process (``CUDA_VISIBLE_DEVICES`` is read
    once)."""
    if (
        device.index is None
        or device.type != accelerator_type()
        or torch.accelerator.device_count() < 2
    ):
        return None
    return torch.accelerator.current_device_index


_UNKNOWN = object()
INDEX_READERS: dict[torch.device, object] = {}
"""For each device met, how to read the current index of its type where a scope may have to
change it, else None (:func:`_current_index_of`). Keyed by the device, not its type:
``device.type`` costs 0.2 µs (a new string each time), about a third of a decorated call's
scope, and a device's hash is cheap. Asked once per device: the answer changes only when a
PrivateUse1 backend registers (the emulated accelerator's ``enable()`` clears it)."""
_index_reader = INDEX_READERS.get


def pop_device(scope: _Scope) -> None:
    """Leave a scope entered with :func:`push_device` or :func:`push_nested`, whatever was
    entered since."""
    scope.closed = True
    active = _active()
    _ACTIVE.set(
        active[:-1]
        if active and active[-1] is scope
        else tuple(s for s in active if s is not scope)
    )
    previous = scope.previous
    if previous is not _UNCHANGED and previous is not _TORCH_OWN:
        _DEVICE_GLOBALS[_CURRENT] = previous  # what dynamo read before the block, back
    if type(scope) is _Block and (
        scope.mode is not None or scope.previous_index is not None or scope.audit is not None
    ):
        _leave_extras(scope)


def _leave_extras(scope: _Block) -> None:
    """Undo what a block did beyond the scope: its mode, the accelerator's index, the audit."""
    if scope.mode is not None:
        _torch_modes.remove_mode(scope.mode)
        scope.mode = None
    if scope.previous_index is not None:
        torch.accelerator.set_device_index(scope.previous_index)
    if scope.audit is not None:
        _AUDITOR.release()


def push_nested(device: torch.device) -> _Scope | None:
    """:func:`push_device` for ``@device_agnostic``, which enters a scope on every call.

    Where ``device`` already is the effective default, nothing is entered at all (it would
    change nothing), so the common case costs one look at the task's scopes; None comes back.
    """
    active = _active()
    if active or _stack_length() or _CALLS.scopes:
        if current_device() == device:
            return None
        return _enter(device, active, innermost_device_mode())
    if device == _CPU:
        return None
    return _enter(device, active, None)


def call_scoped(
    device: torch.device, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``fn(*args, **kwargs)`` inside a scope for ``device``: a decorated call's body.

    The hot path of every decorated call whose target is not the default device (every
    training step on an accelerator). The body of a plain function runs to its end before
    any other task of the thread runs, so its scope is pushed on a list of the thread
    (:class:`_Call`), not on the task's context variable, whose every change allocates.
    """
    __tracebackhide__ = True
    active = _active()
    calls = _CALLS.scopes
    if active or calls or _stack_length():
        if current_device() == device:
            return fn(*args, **kwargs)
        below = innermost_device_mode()
    elif device == _CPU:
        return fn(*args, **kwargs)
    else:
        below = None
    if len(_MODULES) != _PATCH.seen:
        _PATCH.install()
    if _index_reader(device, _UNKNOWN) is not None and _makes_index_current(device):
        entered = _enter_index(device, active, below)
        try:
            return fn(*args, **kwargs)
        finally:
            pop_device(entered)
    # As torch's DeviceContext does: dynamo guards compiled code on CURRENT_DEVICE.
    previous = _DEVICE_GLOBALS[_CURRENT]
    _DEVICE_GLOBALS[_CURRENT] = device
    scope = _Call(device, below, _SLOT.__dict__.get(_SLOT_KEY, _EMPTY_SLOT), active)
    calls.append(scope)
    try:
        return fn(*args, **kwargs)
    finally:
        if calls[-1] is scope:
            calls.pop()
        else:  # pragma: no cover - a body that switched greenlets, say
            calls.remove(scope)
        _DEVICE_GLOBALS[_CURRENT] = previous


def pop_nested(entered: _Scope | None) -> None:
    """Leave a scope entered with :func:`push_nested`."""
    if entered is not None:
        pop_device(entered)


_Amp = AbstractContextManager[Any]
_EAGER_BLOCKS = threading.local()  # blocks with a precision entered from compiled code


def _enter_block(
    device: torch.device, exact: bool, precision: str | None, audit: AuditLevel | None = None
) -> tuple[_Scope, _Amp | None]:
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


def _leave_block(scope: _Scope, amp: _Amp | None) -> None:
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
        devicectx._errors.StrayTensorError: torch.from_numpy at ...:2 made a tensor on cpu ...
        fix: torch.from_numpy(array).to("meta"), or torch.as_tensor(array, device="meta")

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
    outside blocks about 0.2 µs), and fill in the device inside (about what torch's
    ``DeviceContext`` costs a constructor). Entering and leaving a block is a push on a
    context variable (about 1.4x ``with torch.device``'s cost on a 2-core CPU; a fixed
    spec such as ``"meta"`` is resolved once per process). Every other
    torch call costs what it costs outside: ``with torch.device`` instead sends every torch
    call in the thread through a Python mode (1.3x to 1.7x on small ops). With
    ``exact=True`` the block costs what ``with torch.device`` does. With ``audit``, the
    thread has a mode on torch's stack while the block is open: every torch call in it
    pays a mode dispatch, and a call that makes tensors a look at their device.
    ``audit=False`` costs nothing.

    Raises:
        InvalidDeviceError: ``device`` is malformed.
        DeviceUnavailableError: this machine lacks ``device``.
        ValueError: ``audit`` is not ``False``, ``True`` or ``"raise"``.
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
        - A reference to one of torch's constructors held inside an object, a closure or
          a default argument since before the first block (``self.op = torch.ones``) is
          torch's own function and allocates on torch's default: call the constructor by
          its name, or pass ``exact=True``. Module-level names, in any module, are covered.
        - One ``on_device`` object may be re-entered (nested), but not entered from several
          threads at once: create one per block, or use the decorator form.
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
        self._entered: list[_Block | tuple[_Scope, _Amp | None] | DeviceContext | None] = []

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
        if self._plain:  # the common block: no mode, no autocast, no audit
            self._entered.append(_push_block(device))
        else:
            self._entered.append(_enter_block(device, self.exact, self.precision, self._audit))
        return device

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        entered = self._entered.pop()
        if type(entered) is _Block:
            pop_device(entered)
        elif type(entered) is tuple:
            _leave_block(*entered)
        elif entered is None:
            _EAGERLY["exit"]()
        else:
            entered.__exit__(exc_type, exc, traceback)  # type: ignore[union-attr]

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
        # An async generator function itself (not a function returning one), so that
        # inspect.isasyncgenfunction, which frameworks test, still says True.
        @functools.wraps(func)
        async def run(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, Any]:
            enter, leave = self._resumable()
            driver = async_resumed(func(*args, **kwargs), enter, leave)
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


def _rebuilt(
    spec: DeviceLike, exact: bool, precision: PrecisionName | None, audit: AuditOption
) -> on_device:
    """An ``on_device`` object loaded from a pickle."""
    return on_device(spec, exact=exact, precision=precision, audit=audit)
