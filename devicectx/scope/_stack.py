"""The scope stack: which device each thread, asyncio task and decorated call has asked for.

How it works. Each ``on_device`` block is a :class:`Block` listed in ``_ACTIVE``, a context
variable: asyncio gives each task its own copy, and each thread starts with an empty one. The
scope of a decorated call (``@device_agnostic``, a plain function) is a ``_Call`` on a list of
the thread (``_THREAD``) instead: its body runs to its end before any other task of the thread
runs, and a context variable costs each change an allocation (half the cost of a decorated
call to an accelerator); a call knows the blocks open at its start, so a block entered in its
body is the inner one. From the first scope of the process that changes the device, torch's
tensor constructors are wrappers (:mod:`devicectx.scope._constructors`) that ask
:func:`scope_device` for the running task's device and fill in ``device=``; no mode sits on
torch's stack, so every other torch call costs what it costs outside a block. torch's own
default-device state (``with torch.device``, ``set_default_device``) is read and composed with
in :mod:`devicectx._torch.modes`: a ``with torch.device`` block entered inside a scope wins
inside it, and ``set_default_device`` inside a scope takes effect at once. ``exact=True`` adds
a mode, as torch's own default device does, for code that holds one of torch's constructors in
an object since before the first scope opened.

The public ``on_device`` (:mod:`devicectx.scope._context`) and ``@device_agnostic``
(:mod:`devicectx.decorator._plan`) enter and leave scopes through the functions here.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from types import FrameType
from typing import Any, cast

import torch
from torch.overrides import TorchFunctionMode

from devicectx._torch import modes as _torch_modes
from devicectx._torch.constructors import device_constructors
from devicectx._torch.dynamo import (
    constant,
    faking,
    traced_mode_device,
    traced_mode_stack,
    tracing,
)
from devicectx._torch.modes import (
    CURRENT_DEVICE_KEY,
    DEVICE_MODULE_GLOBALS,
    EMPTY_SLOT,
    GLOBAL_DEVICE_CONTEXT,
    SLOT_KEY,
    DeviceContext,
    default_slot,
    innermost_device_mode,
    innermost_of,
    stack_length,
)
from devicectx.devices._resolve import with_index
from devicectx.scope import _index
from devicectx.scope._audit import AuditLevel, Auditor
from devicectx.scope._constructors import constructor_patch
from devicectx.scope._index import INDEX_READERS, ThreadIndex, learn_index_reader
from devicectx.scope._suspended import Suspended, inside

_CPU = torch.device("cpu")
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling

_UNCHANGED = object()
"""A scope's ``previous`` where it changed nothing (its device already was the default)."""
_TORCH_OWN = object()
"""A block's ``previous`` where torch gives its device already, on its own (no block, no mode
around it: the CPU): constructors in it need no device, and are left to torch at once."""


class Scope:
    """A scope: its target, and what it changed to get there. The base of :class:`Block`
    and :class:`_Call`; a plain ``Scope`` is what :func:`push_nested` enters on the task's
    context variable, for ``@device_agnostic`` at every resume of a generator or coroutine
    and around a call with ``precision=`` (a plain call makes a :class:`_Call`)."""

    __slots__ = ("closed", "previous", "target", "torch_mode_at_entry", "torch_slot_at_entry")

    # What only a block (:class:`Block`) sets; read as None here.
    audit: AuditLevel | None = None  # audit=True: "warn"; audit="raise": "raise"
    mode: _ExactMode | None = None  # exact=True: a mode on torch's stack
    previous_index: int | None = None  # the index that was current before it made its own
    # A block on an indexed device of an accelerator with several: the thread where its
    # index is current (its list of call scopes, as :class:`_ThreadScopes` says). Another thread
    # that sees the block (in a copy of the context) follows it: :mod:`._index`.
    index_thread: list[_Call] | None = None

    def __init__(
        self,
        target: torch.device,
        torch_mode: DeviceContext | None,
        torch_slot: object,
        previous: object,
    ) -> None:
        self.target = target
        # torch's innermost DeviceContext when the block was entered: a different one later
        # means a `with torch.device` block was entered inside this one, and it wins.
        self.torch_mode_at_entry = torch_mode
        # What torch's per-thread default slot held: set_default_device called inside the
        # block puts another object there, and takes over at once.
        self.torch_slot_at_entry = torch_slot
        # dynamo's CURRENT_DEVICE before the block, given back at exit; _UNCHANGED where the
        # block changed nothing, _TORCH_OWN where torch gives its device by itself.
        self.previous = previous
        self.closed = False  # left (a task created inside may still list it)


class Block(Scope):
    """An entered ``on_device`` block, or a scope on an accelerator with several devices
    (which keeps its index current)."""

    __slots__ = ("audit", "index_thread", "mode", "previous_index")

    def __init__(
        self,
        target: torch.device,
        torch_mode: DeviceContext | None,
        torch_slot: object,
        previous: object,
    ) -> None:
        # Scope.__init__'s lines, not a call of it: a block is entered per call too.
        self.target = target
        self.torch_mode_at_entry = torch_mode
        self.torch_slot_at_entry = torch_slot
        self.previous = previous
        self.closed = False
        self.audit = None
        self.mode = None
        self.previous_index = None
        self.index_thread = None


class _Call(Scope):
    """The scope of a decorated call running in this thread (:func:`call_scoped`).

    Not in the context variable: a call's body runs to its end before any other task of
    the thread runs, so a list per thread holds these, and nothing is left to close when
    the call returns (a task created in the body, which runs later, never sees it).
    """

    __slots__ = ("outer",)

    def __init__(
        self,
        target: torch.device,
        torch_mode: DeviceContext | None,
        torch_slot: object,
        outer: tuple[Scope, ...],
    ) -> None:
        self.target = target
        self.torch_mode_at_entry = torch_mode
        self.torch_slot_at_entry = torch_slot
        # The task's blocks when the call began: a block not among them was entered inside.
        self.outer = outer
        # (``closed`` and ``previous`` stay unset: a call's scope is never read for them.)


class _ThreadScopes(threading.local):
    """What the scopes keep per thread: the scopes of the decorated calls running in this
    thread, innermost last; and the thread's accelerator index
    (:mod:`devicectx.scope._index`).

    A block records ``scopes``, the list, as the thread where its index is current: the
    reads of a scope have it at hand already (``index`` would cost a look-up more).
    """

    def __init__(self) -> None:
        self.scopes: list[_Call] = []
        self.index = ThreadIndex()
        # A seed torch.utils.data draws, being made on the host (the constructors' own
        # replacement says so): exact=True's mode, which sees the call next, leaves it there.
        self.seeding = False


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
        if kwargs.get("device") is None:
            if _is_dynamo_compiling():
                # dynamo traces this method into the graph of every call it meets: it
                # cannot hash some of torch's constructors (a set look-up) nor read a
                # context variable, so both are answered once, at trace time.
                device = _traced_device_of(func)
            else:
                exempt = func not in _CONSTRUCTORS or _THREAD.seeding
                device = None if exempt else scope_device()
            if device is not None:
                kwargs["device"] = device
        return func(*args, **kwargs)


@constant
def _traced_device_of(func: Callable[..., Any]) -> torch.device | None:
    """For :class:`_ExactMode` in traced code: the device a call of ``func`` without
    ``device=`` gets, None where ``func`` is no constructor or no scope applies."""
    return traced_scope_device() if func in _CONSTRUCTORS else None


# The factory functions torch's own DeviceContext fills in ``device=`` for; read once,
# as a frozenset, so the per-op check is one hash lookup (torch calls an lru_cache each time).
_CONSTRUCTORS: frozenset[Callable[..., Any]] = frozenset(device_constructors())

# The scopes entered in this thread or task, innermost last. A tuple, so that tasks
# (which copy the context) never share a mutable list.
_ACTIVE: ContextVar[tuple[Scope, ...]] = ContextVar("devicectx_active_scopes", default=())


_active = _ACTIVE.get


_THREAD = _ThreadScopes()


def _start_outside_every_scope() -> None:
    """In a child forked inside scopes (a ``DataLoader``'s workers forked in a decorated
    call's body or a block, a fork-started pool's workers): no scope of the parent's is open
    there, as in a spawned child. The child runs the worker's loop, not the body: a scope
    kept would put the dataset's tensors on the device, where CUDA refuses a forked child.

    What each scope did to this thread's state is undone for the child (its mode off
    torch's stack, its audit released, dynamo's current device torch's own again); the
    accelerator's index is left as it is (setting it would start the device in a child
    that may not use it), as is ``precision=``'s autocast. Code that goes on in the
    child's copy of the body (a bare ``os.fork()``) leaves its scopes without error.
    """
    active = _active()
    if not active and not _THREAD.scopes:
        return
    _ACTIVE.set(())
    _THREAD.scopes = []  # a new list: a call's exit pops its own, the parent's copy
    _THREAD.index = ThreadIndex()
    for scope in active:
        if type(scope) is Block:
            if scope.mode is not None:
                _torch_modes.remove_mode(scope.mode)
                scope.mode = None
            if scope.audit is not None:
                _AUDITOR.release()
                scope.audit = None
            scope.previous_index = None
    mode = innermost_device_mode()
    _DEVICE_GLOBALS[_CURRENT] = None if mode is None else mode.device


def _open_scope() -> Scope | None:
    """The innermost open scope here: a block of the running task, or a decorated call
    running in this thread, whichever was entered last; None outside every scope."""
    active = _active()
    calls = _THREAD.scopes
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


def _open_scopes(active: tuple[Scope, ...], calls: list[_Call]) -> Iterator[Scope]:
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
    # Asked at every constructor called in a block: _open_scope (its last loop: change both
    # together), innermost_device_mode and default_slot are written out here for the
    # common case (no decorated call running, no mode on torch's stack).
    calls = _THREAD.scopes
    if calls:
        scope = _open_scope()
        if scope is None or (type(scope) is Block and scope.previous is _TORCH_OWN):
            return None
    else:
        for scope in reversed(_active()):  # blocks and resumed calls: each has .previous
            if not scope.closed:
                break
        else:
            return None
        if scope.previous is _TORCH_OWN:
            return None
    if tracing():
        # Code that runs while dynamo compiles: its own (not in the block), or a call of a
        # constructor in its graph, run on fake tensors (as traced code, in the block).
        return traced_scope_device() if faking() else None
    torch_mode = innermost_device_mode() if _stack_length() else None
    at_entry = scope.torch_slot_at_entry
    if (
        (torch_mode is not scope.torch_mode_at_entry and _entered_since(scope, torch_mode))
        or _SLOT.__dict__.get(_SLOT_KEY, _EMPTY_SLOT) is not at_entry
    ) and (type(at_entry) is not Suspended or _set_aside(scope, at_entry, calls, torch_mode)):
        # torch.device entered, or set_default_device called, inside the block; or the
        # block is set aside for a call running here (an optimizer's step)
        return None
    owner = scope.index_thread
    if owner is not None and owner is not calls:  # a block of another thread
        _follow(scope)  # type: ignore[arg-type]
    return scope.target


def _set_aside(
    scope: Scope, marker: Suspended, calls: list[_Call], torch_mode: DeviceContext | None
) -> bool:
    """For :func:`scope_device`, where ``scope`` is set aside: whether it does not apply.

    Set aside for a call running here: it does not. Set aside by a call of this thread that
    has ended (it raised): given back now. Set aside by another thread: it applies here, as
    far as torch's own state lets it (the slot it recorded at entry, compared as usual).
    """
    if marker.thread is calls:
        if inside(marker):
            return True
        scope.torch_slot_at_entry = marker.slot
    return (
        torch_mode is not scope.torch_mode_at_entry
        or _SLOT.__dict__.get(_SLOT_KEY, _EMPTY_SLOT) is not marker.slot
    )


def _entered_since(scope: Scope, torch_mode: DeviceContext | None) -> bool:
    """Whether ``torch_mode``, torch's innermost ``DeviceContext`` here and not the one at
    ``scope``'s entry, was entered since (a ``with torch.device`` inside the block: it wins).

    False where the one at entry has ended and left none innermost, or the one
    ``set_default_device`` entered before the block (the slot the block recorded): a
    ``torch.device`` scope around the block, held by another task across an ``await`` or by
    a suspended generator, that closed while the block is open. The block still applies.
    Another ``torch.device`` scope left innermost cannot be told from one entered since.
    Asked only where the innermost one differs from the one at entry.
    """
    if torch_mode is None:
        return False
    slot = scope.torch_slot_at_entry
    if type(slot) is Suspended:
        slot = slot.slot
    return torch_mode is not slot


def set_aside(frame: FrameType) -> tuple[Scope, Suspended] | None:
    """Set the innermost open scope here aside for the call running ``frame``: constructors
    called below it, in this thread, get torch's own default device, as outside every scope
    (:mod:`devicectx.scope._suspended`). Returns what :func:`give_back` takes; None where
    no scope that changes the device is open, or where it is set aside already."""
    calls = _THREAD.scopes
    if not calls and not _active():
        return None
    scope = _open_scope()
    if scope is None or (type(scope) is Block and scope.previous is _TORCH_OWN):
        return None
    at_entry = scope.torch_slot_at_entry
    if type(at_entry) is Suspended:
        if at_entry.thread is calls and inside(at_entry):
            return None
        at_entry = at_entry.slot  # set aside by a call that has ended, or another thread
    marker = Suspended(at_entry, frame, calls)
    scope.torch_slot_at_entry = marker
    return scope, marker


def give_back(scope: Scope, marker: Suspended) -> None:
    """Undo :func:`set_aside` (nothing where the scope was given back already)."""
    if scope.torch_slot_at_entry is marker:
        scope.torch_slot_at_entry = marker.slot


def take_again(scope: Scope, marker: Suspended) -> None:
    """Set ``scope`` aside again for the call that :func:`set_aside` gave ``marker`` (after
    code of the caller's that it runs in the scope: an optimizer's closure)."""
    scope.torch_slot_at_entry = marker


def _follow(scope: Block) -> None:
    """:func:`scope_device` in a thread that runs a copy of the context of the thread that
    entered ``scope``: its index followed here, where its device has one (a block entered
    as changing nothing records the thread of the block below, which may be on another
    device)."""
    if _index_reader(scope.target) is not None:
        _index.follow(scope, _THREAD.index)


@constant  # dynamo cannot trace a context variable: it runs this while tracing
def traced_scope_device() -> torch.device | None:
    """:func:`scope_device` for code dynamo traces, which has its own mode stack."""
    scope = _open_scope()
    if scope is None:
        return None
    at_entry = scope.torch_slot_at_entry
    if type(at_entry) is Suspended:
        if at_entry.thread is _THREAD.scopes and inside(at_entry):
            return None
        at_entry = at_entry.slot
    if default_slot() is not at_entry:
        return None
    mode = innermost_of(traced_mode_stack())
    if mode is not scope.torch_mode_at_entry and _entered_since(scope, mode):
        return None
    return scope.target


def _torch_default() -> torch.device:
    """The device torch's own state gives, without any on_device block."""
    mode = innermost_device_mode()
    return _CPU if mode is None else with_index(mode.device)


@constant
def current_device() -> torch.device:
    """The device that tensors created here without ``device=`` land on.

    The same answer as ``torch.get_default_device()``, with the index filled in.

    Example:
        >>> from devicectx import on_device
        >>> with on_device("meta"):
        ...     current_device()
        device(type='meta')
    """
    if tracing():
        modes = traced_mode_stack()
        device = traced_scope_device()
        if device is None:
            mode = innermost_of(modes)
            found = None if mode is None else traced_mode_device(mode)
            device = _CPU if found is None else with_index(found)
        return device
    device = scope_device()
    return _torch_default() if device is None else device


def _watch_optimizer_steps() -> None:
    # Imported here: the hooks' module builds on this one.
    from devicectx.scope._optimizer_step import watch_optimizer_steps

    watch_optimizer_steps()


_PATCH = constructor_patch(
    _active, _THREAD, scope_device, traced_scope_device, current_device, _TORCH_OWN
)
_MODULES = sys.modules
_stack_length = stack_length
# torch's state a scope reads and sets at entry, read here directly (a function call costs
# as much as the read): see :mod:`devicectx._torch.modes`.
_DEVICE_GLOBALS = DEVICE_MODULE_GLOBALS
_CURRENT = CURRENT_DEVICE_KEY
_SLOT = GLOBAL_DEVICE_CONTEXT
_SLOT_KEY, _EMPTY_SLOT = SLOT_KEY, EMPTY_SLOT


def audit_state() -> tuple[AuditLevel, torch.device] | None:
    """The running task's audit: the innermost audited block's level, and the device of
    its innermost block (audited or not); None where no open block of the task audits."""
    device = None
    for scope in _open_scopes(_active(), _THREAD.scopes):
        if device is None:
            device = scope.target
        if scope.audit is not None:
            return scope.audit, device
    return None


_AUDITOR = Auditor(audit_state)
os.register_at_fork(after_in_child=_start_outside_every_scope)


def active_device() -> torch.device | None:
    """The target of the innermost ``on_device`` block entered here, or None outside any.

    Unlike :func:`current_device`, this ignores torch's own default (``set_default_device``,
    ``with torch.device``): it answers "did the caller ask for a device with on_device?".
    """
    if not _active() and not _THREAD.scopes:  # the common case, on every decorated call
        return None
    scope = _open_scope()
    return None if scope is None else scope.target


def push_device(
    device: torch.device, *, exact: bool = False, audit: AuditLevel | None = None
) -> Block:
    """Enter a scope for an already resolved ``device``; undo it with :func:`pop_device`.

    Where ``device`` differs from the effective default, the constructors' replacements
    are put in place (once per process; modules loaded since the last block are looked
    through) and dynamo is told the new default; where it is the default already, the
    scope is only recorded (for :func:`active_device`). With ``audit``, the thread's audit
    mode is on until :func:`pop_device`.
    """
    scope = push_block(device)
    if exact and scope.previous is not _UNCHANGED and scope.previous is not _TORCH_OWN:
        scope.mode = _ExactMode()
        _torch_modes.push_mode(scope.mode)
    if audit is not None:
        scope.audit = audit
        _AUDITOR.acquire()
    return scope


def push_block(device: torch.device) -> Block:
    """:func:`push_device` without ``exact`` or ``audit``: every plain ``with on_device``."""
    active = _active()
    calls = _THREAD.scopes
    effect = _entry_effect(device, active, calls)
    if effect is _UNCHANGED or effect is _TORCH_OWN:  # recorded, for active_device
        torch_mode = None if effect is _TORCH_OWN else innermost_device_mode()
        scope = Block(device, torch_mode, default_slot(), effect)
        if active:  # the device in force already, mostly the last block's: its index too
            scope.index_thread = active[-1].index_thread
        _ACTIVE.set((*active, scope))
        return scope
    return cast(Block, _enter(device, active, effect, calls, Block))  # type: ignore[arg-type]


def _entry_effect(device: torch.device, active: tuple[Scope, ...], calls: list[_Call]) -> object:
    """What entering a scope for ``device`` would do: ``_UNCHANGED`` where ``device``
    already is the effective default, ``_TORCH_OWN`` where nothing is open and ``device``
    is the CPU, torch's own default (entering either would change nothing); else it
    changes the device, above torch's innermost ``DeviceContext``, which comes back (None
    where there is none) for the scope to record. Asked at every scope's entry."""
    if active or calls or _stack_length():
        return _UNCHANGED if current_device() == device else innermost_device_mode()
    return _TORCH_OWN if device == _CPU else None


def _enter(
    device: torch.device,
    active: tuple[Scope, ...],
    torch_mode: DeviceContext | None,
    calls: list[_Call],
    kind: type[Scope] = Scope,
) -> Scope:
    """Enter a scope that changes the device, on the task's context variable (a block, or a
    resumed generator's call), above ``torch_mode`` (:func:`_entry_effect`)."""
    previous = _switch(device)
    if previous is _INDEXED:
        return _enter_index(device, active, torch_mode, calls, _current_index())
    scope = kind(device, torch_mode, _SLOT.__dict__.get(_SLOT_KEY, _EMPTY_SLOT), previous)
    _ACTIVE.set((*active, scope))
    return scope


def _switch(device: torch.device) -> object:
    """Make ``device`` the default, for a scope recorded right after: the entry of every
    scope that changes the device (:func:`_enter`, and :func:`call_scoped` which records
    its own). Returns dynamo's ``CURRENT_DEVICE`` before, to give back at exit; or
    ``_INDEXED`` (nothing done yet) for a device of an accelerator with several, whose
    index the scope keeps current (:func:`_enter_index`)."""
    if len(_MODULES) != _PATCH.seen:  # the first block, or modules loaded since the last
        _PATCH.install()
        _watch_optimizer_steps()
    # None for a device whose index a scope never changes (the CPU, meta, a machine's only
    # accelerator): one look-up, no call.
    index_of = _index_reader(device, _UNKNOWN)
    if index_of is not None and (index_of is not _UNKNOWN or learn_index_reader(device)):
        return _INDEXED
    # As torch's DeviceContext does: dynamo guards compiled code on CURRENT_DEVICE.
    previous = _DEVICE_GLOBALS[_CURRENT]
    _DEVICE_GLOBALS[_CURRENT] = device
    return previous


_INDEXED = object()
"""What :func:`_switch` returns for a device whose index the scope keeps current."""


def _enter_index(
    device: torch.device,
    active: tuple[Scope, ...],
    torch_mode: DeviceContext | None,
    calls: list[_Call],
    current: int,
) -> Block:
    """:func:`_enter` for a device of an accelerator with several, where ``current`` is the
    current index: the block makes its own current (listed, to give the old one back in
    order: :mod:`devicectx.scope._index`), and records its thread, where another thread
    that sees it follows it. torch's own scope leaves the index as it is, but ``.cuda()``,
    streams and ``synchronize()`` follow it."""
    previous = _DEVICE_GLOBALS[_CURRENT]
    _DEVICE_GLOBALS[_CURRENT] = device
    scope = Block(device, torch_mode, _SLOT.__dict__.get(_SLOT_KEY, _EMPTY_SLOT), previous)
    _ACTIVE.set((*active, scope))
    scope.index_thread = calls
    if current != device.index:
        scope.previous_index = current
        _set_index(device.index)
        _THREAD.index.changed.append(scope)
    return scope


# A device not yet in INDEX_READERS: learn_index_reader asks torch once.
_UNKNOWN = object()
_index_reader = INDEX_READERS.get
# The one reader a device there can have (torch's accelerator's), and its setter: read once,
# as a scope on such a device calls them at its entry and exit.
_current_index = torch.accelerator.current_device_index
_set_index = torch.accelerator.set_device_index


def open_here(scope: Scope) -> bool:
    """Whether ``scope`` is among the scopes open in this thread's or task's context."""
    return any(open_scope is scope for open_scope in _active())


def pop_device(scope: Scope) -> None:
    """Leave a scope entered with :func:`push_device`, :func:`push_block` or
    :func:`push_nested`, whatever was entered since."""
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
    if type(scope) is Block and (
        scope.mode is not None or scope.previous_index is not None or scope.audit is not None
    ):
        _leave_extras(scope)


open_scopes = _active
"""The scopes open in this thread's or task's context, outermost first (the context
variable's own ``get``: a block's entry reads it)."""


def leave_opened_since(before: tuple[Scope, ...]) -> None:
    """Leave every scope opened here since ``_active()`` was ``before``, innermost first:
    an entry an interrupt (Ctrl-C) cut short after it opened its scope, where the ``with``
    statement, whose ``__enter__`` raised, calls no ``__exit__``."""
    for scope in reversed(_active()):
        if not any(kept is scope for kept in before):
            pop_device(scope)


def finish_leaving(scope: Scope) -> None:
    """Finish leaving ``scope`` where an interrupt cut :func:`pop_device` short: off the
    open scopes, torch's default as before it, its mode off torch's stack. Each part is
    done only where it is still to do, so that this is safe after a whole ``pop_device``."""
    active = _active()
    if any(open_scope is scope for open_scope in active):
        _ACTIVE.set(tuple(open_scope for open_scope in active if open_scope is not scope))
    previous = scope.previous
    if previous is not _UNCHANGED and previous is not _TORCH_OWN:
        _DEVICE_GLOBALS[_CURRENT] = previous
    if type(scope) is Block and scope.mode is not None:
        _torch_modes.remove_mode(scope.mode)
        scope.mode = None


def _leave_extras(scope: Block) -> None:
    """Undo what a block did beyond the scope: its mode, the accelerator's index, the audit."""
    if scope.mode is not None:
        _torch_modes.remove_mode(scope.mode)
        scope.mode = None
    if scope.previous_index is not None:
        changed = _THREAD.index.changed
        if changed and changed[-1] is scope:  # the last entered here: blocks nest, mostly
            changed.pop()
            _set_index(scope.previous_index)
        else:
            _index.left_out_of_order(scope, changed)
    if scope.audit is not None:
        _AUDITOR.release()


def push_nested(device: torch.device) -> Scope | None:
    """:func:`push_device` for ``@device_agnostic``, which enters a scope on every call.

    Where ``device`` already is the effective default, nothing is entered at all (it would
    change nothing), so the common case costs one look at the task's scopes; None comes back.
    """
    active = _active()
    calls = _THREAD.scopes
    effect = _entry_effect(device, active, calls)
    if effect is _UNCHANGED or effect is _TORCH_OWN:
        return None
    return _enter(device, active, effect, calls)  # type: ignore[arg-type]


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
    calls = _THREAD.scopes
    effect = _entry_effect(device, active, calls)
    if effect is _UNCHANGED or effect is _TORCH_OWN:
        return fn(*args, **kwargs)
    previous = _switch(device)
    if previous is _INDEXED:
        current = _current_index()
        if current != device.index:
            entered = _enter_index(device, active, effect, calls, current)  # type: ignore[arg-type]
            try:
                return fn(*args, **kwargs)
            finally:
                pop_device(entered)
        # Its index current already: a call's scope, which no other thread sees.
        previous = _DEVICE_GLOBALS[_CURRENT]
        _DEVICE_GLOBALS[_CURRENT] = device
    slot = _SLOT.__dict__.get(_SLOT_KEY, _EMPTY_SLOT)
    scope = _Call(device, effect, slot, active)  # type: ignore[arg-type]
    calls.append(scope)
    try:
        return fn(*args, **kwargs)
    finally:
        if calls[-1] is scope:
            calls.pop()
        else:  # pragma: no cover - a body that switched greenlets, say
            calls.remove(scope)
        _DEVICE_GLOBALS[_CURRENT] = previous


def pop_nested(entered: Scope | None) -> None:
    """Leave a scope entered with :func:`push_nested`."""
    if entered is not None:
        pop_device(entered)
