"""Knowing when a module's tensors may have moved, so what they say can be cached per module.

``@device_agnostic`` asks which device a module is on at every call of its ``forward``.
Walking every submodule costs time in proportion to the model; this module answers in
constant time instead, from a cache that two things keep honest:

- a **token**, a fresh object put in place of the last one whenever torch tells us a
  module's tensors may have changed: when ``Module._apply`` returns (``.to()``, ``.cuda()``,
  ``.cpu()``, ``.half()``, ``to_empty()``, ``share_memory()``; with or without
  ``torch.__future__.set_swap_module_params_on_conversion``), and when a parameter, buffer
  or submodule is registered (``setattr``, ``register_buffer``, ``add_module``,
  ``load_state_dict(assign=True)``). A cache entry holds the token it was computed under,
  and the ids of the modules it was walked over; another token means walk again, unless
  the token remembers every change since the entry's (its last 64, each to a module
  named by id) and none was to one of those modules (a loss module built at each step,
  another model moved);
- a **sample**: the first tensor the walk met, checked at every hit to still sit in its
  slot (the same object, by id: the cache holds no reference to it, not even a weak one)
  on the device it had. That catches what torch does not report, where it changes every
  tensor of a module on one device: ``load_state_dict(assign=True)`` with swapping on,
  ``torch.func.functional_call`` given all the parameters, ``param.data = ...`` or
  ``torch.utils.swap_tensors`` on the sample itself. A module wholly on one device that
  ends up wholly on another has moved its sample too. An answer that rests on something
  other than tensors (accelerate's hook on the module that says where a dispatched model
  starts, which ``remove_hook_from_module`` deletes without telling torch) is checked by
  that too (a :class:`Mark`): still held, by id.

Example:
    >>> import torch
    >>> from torch import nn
    >>> first_device = ModuleCache(lambda m: (next(m.parameters()).device, None))
    >>> model = nn.Linear(2, 2)
    >>> first_device(model)
    device(type='cpu')
    >>> first_device(model.to("meta"))
    device(type='meta')

Threads: every token is a new object, replaced under a lock and never reused, so an entry
is only ever compared by identity. A walk reads the token before it starts and stores its
answer under that token: a move that ends during the walk replaces the token after the
change, so the entry is stale at once. Registration hooks run *before* torch writes the new
tensor; the token they put in place carries that pending write, and no answer is stored
under it until the write has landed (or the thread that made it has moved on).

Not seen, until the next change to the module: a tensor it shares with a module outside it
(two models sharing a weight), moved through that one. Nor, until the next token: tensors
written without torch's hooks
(``module._parameters[name] = t``, ``param.data = t`` on a tensor other than the sample,
``torch.utils.swap_tensors`` called directly, ``functional_call`` given some of the
parameters, ``ModuleList.insert``), and deletions (``del module.weight``,
``module.weight = None``). Most of them end with the module on several devices, which the
model's own forward then reports. Nothing is stored while torch compiles (no fake tensor
is kept), and where torch lacks the hooks (none so far) nothing is cached at all: every
call walks. Dynamo never traces a lookup (a decorated call under dynamo takes
:mod:`devicectx.decorator._compiled`, which reads the parameters itself), but it does trace
the hooks of a module built or changed in compiled code: there they replace the token without the
lock, a store dynamo replays after the graph runs.

What tells of a move and of a registration is :mod:`devicectx._torch.module_hooks` (it wraps
``torch.nn.Module._apply``, a private method). Nothing is installed until the first module
is looked up: importing devicectx changes nothing in torch.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar

import torch
from torch import nn

from devicectx._torch.module_hooks import watch_modules
from devicectx._torch.module_tree import buffers_of, parameters_of, submodules

_T = TypeVar("_T")


class Mark(NamedTuple):
    """An attribute (not a tensor) a cached answer rests on, such as accelerate's hook on
    a module: checked at every hit to still hold the same object, since removing it tells
    torch nothing."""

    owner: nn.Module
    name: str
    value: object


class Sample(NamedTuple):
    """The tensor a cached answer is checked by: the first one the walk met; and the
    attribute it rests on, where it rests on one."""

    owner: nn.Module
    in_buffers: bool
    tensor: torch.Tensor
    device: torch.device
    mark: Mark | None = None


class _Held:
    """A :class:`Mark`, as an entry keeps it: its owner weakly, its value by id."""

    __slots__ = ("name", "owner", "value")

    def __init__(self, mark: Mark) -> None:
        self.owner = weakref.ref(mark.owner)
        self.name = mark.name
        self.value = id(mark.value)

    def holds(self) -> bool:
        """Whether the owner still holds the same object under the name."""
        owner = self.owner()
        return owner is not None and id(owner.__dict__.get(self.name)) == self.value


_ABSENT = object()


class _Write:
    """A registration torch announced: it writes ``table[name]`` after its hooks return."""

    __slots__ = ("name", "new", "old", "owner", "table", "thread")

    def __init__(self, module: nn.Module, table: str, name: str, new: object) -> None:
        self.owner = weakref.ref(module)
        self.table = table
        self.name = name
        self.thread = threading.get_ident()
        # Ids, not the objects (which must be free to go), nor weak references to them
        # (torch.utils.swap_tensors refuses a tensor that has any).
        self.old = id(_held(module, table, name))
        self.new = id(new)

    def landed(self) -> bool:
        """Whether the write is done, or can no longer happen behind a reader's back."""
        module = self.owner()
        if module is None or self.thread == threading.get_ident():
            return True  # the registering thread asks: its statement has finished (or raised)
        current = _held(module, self.table, self.name)
        # Another global hook, registered after ours, may replace the value written.
        return id(current) == self.new or id(current) != self.old


def _held(module: nn.Module, table: str, name: str) -> object:
    # Through __dict__, as torch does: a module's __getattr__ may answer anything. A
    # ScriptModule's tables are no dicts, but answer `in` and `[]`.
    held = module.__dict__.get(table)
    return held[name] if held is not None and name in held else _ABSENT


# How many changes a token remembers: an entry older than that is walked again.
_REMEMBERED = 64


class _Token:
    """What cache entries are stored under; replaced, never changed, at each change.

    It remembers which modules the last changes were made to (by id; None: not known,
    which concerns every module): an entry stored under an earlier token whose module
    holds none of them is still true, and is carried over without a walk.
    """

    __slots__ = ("changed", "pending", "serial")

    def __init__(
        self,
        pending: tuple[_Write, ...] = (),
        previous: _Token | None = None,
        changed: int | None = None,
    ) -> None:
        self.pending = pending
        self.serial: int = 0 if previous is None else previous.serial + 1
        # Oldest first, the change that made this token last.
        self.changed: tuple[int | None, ...] = (
            () if previous is None else (*previous.changed[1 - _REMEMBERED :], changed)
        )

    def since(self, earlier: _Token) -> tuple[int | None, ...] | None:
        """The modules changed since ``earlier`` (this token's own change included); None
        where this token no longer remembers them all."""
        count = self.serial - earlier.serial
        if count <= 0 or count > len(self.changed):
            return None
        return self.changed[-count:]

    def settled(self) -> bool:
        """Whether an answer walked from now on may be stored under this token."""
        if self.pending and all(write.landed() for write in self.pending):
            self.pending = ()
        return not self.pending


# The current token, in a list of one rather than a global of its own: dynamo replays the
# item stores of a traced hook, but torch 2.6's drops its stores to another module's globals.
_current = [_Token()]
# Dynamo traces the code calling it (a hook, a move): twice cheaper than is_compiling().
_traced = torch.compiler.is_dynamo_compiling
_lock = threading.Lock()
_installed = False
_watching = False  # True once torch's hooks are in: only then is anything cached


def _bump(module: nn.Module | None = None, write: _Write | None = None) -> None:
    """Replace the token: ``module`` changed (None: some module did)."""
    changed = None if module is None else id(module)
    if _traced():
        # Dynamo traces a module built or moved in a compiled function: no lock (it cannot
        # enter one), and a plain store, which it replays after the graph. The change is
        # recorded as to no module in particular: every entry is walked again.
        previous = _current[0]
        _current[0] = _Token(previous.pending, previous, None)
        return
    with _lock:  # so no bump is lost, and no pending write dropped
        previous = _current[0]
        pending = previous.pending
        if pending:
            pending = tuple(w for w in pending if not w.landed())
        pending = (*pending, write) if write is not None else pending
        _current[0] = _Token(pending, previous, changed)


def note_change(module: nn.Module | None = None) -> None:
    """Tell the caches that ``module`` (None: some module) changed in a way torch does not
    report (an attribute devicectx reads, such as :func:`~devicectx.declare_spread`'s)."""
    _bump(module)


def _install() -> None:
    global _installed, _watching
    with _lock:
        if _installed:
            return
        _installed = True
        # False on a torch we do not know: walk at every call rather than guess.
        _watching = watch_modules(_bump, _on)


def _on(table: str) -> Callable[[nn.Module, str, object], None]:
    def hook(module: nn.Module, name: str, value: object) -> None:
        _bump(module, None if _traced() else _Write(module, table, name, value))

    return hook


class _Entry(Generic[_T]):
    __slots__ = (
        "device", "in_buffers", "mark", "members", "module", "name", "owner", "tensor",
        "token", "value",
    )  # fmt: skip

    def __init__(
        self,
        module: weakref.ref[nn.Module],
        token: _Token,
        value: _T,
        members: frozenset[int],
    ) -> None:
        self.module = module
        self.token = token
        self.value = value
        # The ids of the module and of every module under it when walked: a change to
        # another module leaves the answer true.
        self.members = members
        # The sample; owner None: the module had no tensor. The tensor by its id: a weak
        # reference would make torch.utils.swap_tensors (and so .to()) refuse it.
        self.owner: weakref.ref[nn.Module] | None = None
        self.in_buffers = False
        self.name = ""
        self.tensor = 0
        self.device: torch.device | None = None
        self.mark: _Held | None = None  # read only past the sample: a plain module has none


def _forget(entries: dict[int, Any], key: int) -> Callable[[object], None]:
    return lambda _: entries.pop(key, None)  # called as the module goes, before its id is free


class ModuleCache(Generic[_T]):
    """What ``walk`` says of a module, walked again only when the module may have changed.

    ``walk(module)`` returns its answer and the :class:`Sample` it is checked by (``None``
    for a module without tensors). Entries go with their modules (weakly held, by
    identity: a module's ``__eq__`` and ``__hash__`` play no part).
    """

    __slots__ = ("_entries", "_walk")

    def __init__(self, walk: Callable[[nn.Module], tuple[_T, Sample | None]]) -> None:
        self._walk = walk
        self._entries: dict[int, _Entry[_T]] = {}

    def __call__(self, module: nn.Module) -> _T:
        entry = self._entries.get(id(module))
        if entry is not None and entry.token is not _current[0]:
            current = _current[0]
            changed = current.since(entry.token)
            if changed is not None and None not in changed and entry.members.isdisjoint(changed):
                entry.token = current  # other modules changed: still true
        if entry is not None and entry.token is _current[0]:
            owner = entry.owner
            if owner is None:
                return entry.value
            holder = owner()
            if holder is not None:
                table = buffers_of(holder) if entry.in_buffers else parameters_of(holder)
                tensor = table.get(entry.name)
                if (
                    tensor is not None
                    and id(tensor) == entry.tensor
                    and tensor.device == entry.device
                ):
                    mark = entry.mark
                    if mark is None or mark.holds():
                        return entry.value
        return self._refresh(module, entry)

    def __len__(self) -> int:
        return len(self._entries)

    def _refresh(self, module: nn.Module, entry: _Entry[_T] | None) -> _T:
        if not _installed:
            _install()
        token = _current[0]  # before the walk: see the module docstring
        settled = _watching and token.settled()
        value, sample = self._walk(module)
        if not settled or torch.compiler.is_compiling():
            return value
        key = id(module)
        if entry is not None and entry.module() is module:
            ref = entry.module
        else:
            ref = weakref.ref(module, _forget(self._entries, key))
        # By identity: a module class with __eq__ and no __hash__ breaks modules().
        members = frozenset(id(part) for _, part in submodules(module))
        fresh = _Entry(ref, token, value, members)
        if sample is not None:
            owner, in_buffers, tensor, device, mark = sample
            table = buffers_of(owner) if in_buffers else parameters_of(owner)
            if not isinstance(table, dict):
                return value  # a ScriptModule's tables: walk every time
            try:
                name = next((name for name, held in table.items() if held is tensor), None)
            except RuntimeError:  # another thread registers into this very table
                return value
            if name is None:
                return value  # replaced since the walk saw it: the token has changed too
            fresh.owner = weakref.ref(owner)
            fresh.tensor = id(tensor)
            fresh.name = name
            fresh.in_buffers = in_buffers
            fresh.device = device  # as the walk saw it, not as it may be now
            if mark is not None:
                fresh.mark = _Held(mark)
        self._entries[key] = fresh
        return value
