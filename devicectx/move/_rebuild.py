"""The rebuilding walk of the move engine: a structure with its tensors moved.

Containers are rebuilt only where a child changed, and each container met again (shared,
or a cycle) gives its first result, so a cycle ends and shared containers stay shared.
Tensors go to a :class:`~devicectx.move._alias.TensorMover`, which copies each once and keeps
views views.

The walk is recursive, which is the fastest way through a batch in CPython, down to
``_DEPTH`` containers; below that it goes on with an explicit stack, so depth is not
limited by Python's recursion limit. The explicit stack also serves a ``skip`` that
needs each child's key or path checked. A failed move unwinds as :class:`_Failed`, each
level adding its key, and surfaces as a ``MoveError`` that names the whole path (one for
want of memory is a ``torch.OutOfMemoryError`` too); so does a container that cannot be
rebuilt faithfully, and an object whose own ``.to`` left tensors behind. A ``skip``
predicate that raises is reported as the predicate's error.

Modules move in place (``module.to``), which stops at the first tensor it cannot copy, the
tensors before it moved: at the first module that moves, a walk that only reads finds
every module the move will move, and :mod:`devicectx.move._unmaterialised` refuses the
move as a whole where one holds tensors on ``meta``, :mod:`devicectx.move._wrapped` where
DDP or FSDP2 wrapped one at another device, :mod:`devicectx.move._hooks` where
accelerate's hooks run a part of one on another device. A batch without modules never pays.
A tensor of a module that the structure also holds (``{"model": m, "w": m.weight}``), or a
view of one, comes back as the module's moved tensor (or a view of it), wherever the walk
meets it: each module's tensors are adopted by the mover as it moves
(:meth:`~devicectx.move._alias.TensorMover.adopt`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from devicectx._errors import (
    SMALLER_BATCHES,
    MoveError,
    MoveOutOfMemoryError,
    RegistrationError,
    with_article,
)
from devicectx._torch.module_tree import move as move_module
from devicectx._torch.module_tree import restorer
from devicectx._torch.module_tree import tensors as module_tensors
from devicectx._torch.tensors import base_of
from devicectx.devices._capabilities import CAPABILITIES, nearest_dtype
from devicectx.move import _containers
from devicectx.move._alias import CannotCast, EngineBug, TensorMover
from devicectx.move._containers import is_registered, kind_for
from devicectx.move._hooks import dispatched
from devicectx.move._kinds import (
    CONTAINER,
    DICT_KIND,
    LEAF,
    LIST_KIND,
    MODULE,
    OWN,
    TENSOR,
    TUPLE_KIND,
    CannotRebuild,
    Kind,
    only_atoms,
)
from devicectx.move._own_to import left_behind, lost_lock, off, own_to
from devicectx.move._paths import ITEM, MEMBER, NAME, build, join
from devicectx.move._skip import PredicateFailed, Skip
from devicectx.move._unmaterialised import unmaterialised
from devicectx.move._unseen import importable_class, registrable_class
from devicectx.move._walk import all_on, iter_tensors, module_on, tensors_within
from devicectx.move._wrapped import wrapped

_Tensor = torch.Tensor
_Optimizer = torch.optim.Optimizer
_CACHE = _containers.KIND_CACHE
_DEPTH = 100  # containers deeper than this go on with an explicit stack
_BUSY = object()  # a container whose rebuild is under way: meeting it again is a cycle
_PUSHED = object()  # the explicit-stack walk started a container: descend into it
_FAST_KINDS = (DICT_KIND, LIST_KIND, TUPLE_KIND)

Fix = Callable[[str], str]
"""Given the path of what failed to move, the fix to print, written as code."""


class _Failed(Exception):
    """A move that failed, on its way up: ``parts`` gets each level's key, innermost first."""

    def __init__(self, obj: object, error: Exception) -> None:
        super().__init__()
        self.obj = obj
        self.error = error
        self.parts: list[tuple[int, Any]] = []


class _TensorOfModule(Exception):
    """``module.to`` failed on one of the module's tensors: which, and torch's error."""

    def __init__(self, name: str, tensor: torch.Tensor, error: Exception) -> None:
        super().__init__()
        self.name, self.tensor, self.error = name, tensor, error


def _unmovable(module: nn.Module, device: torch.device) -> tuple[str, torch.Tensor] | None:
    """The first tensor of ``module`` whose ``.to(device)`` raises, with its name; None if
    none does (the failure was the module's own code). Called only where ``module.to`` has
    failed, on an error other than out of memory."""
    for name, tensor in module_tensors(module):
        try:
            tensor.to(device)
        except Exception:
            return name, tensor
    return None


class _Refused(_Failed):
    """A move refused before anything moved: :meth:`Rebuild.run` raises its ``error``
    as it is, each level's key unused (the error names its own paths)."""

    error: MoveError


def _failed(obj: object, error: Exception, style: int, key: Any) -> _Failed:
    failed = _Failed(obj, error)
    failed.parts.append((style, key))
    return failed


class _Frame:
    """A container of the explicit-stack walk whose children are being rebuilt; the child
    being visited is ``old[len(new)]``."""

    __slots__ = ("changed", "keys", "kind", "new", "obj", "old", "path")

    def __init__(self, obj: Any, kind: Kind, keys: Any, old: Sequence[Any], path: str) -> None:
        self.obj = obj
        self.kind = kind
        self.keys = keys  # the children's keys, as the kind's split gave them (None: indices)
        self.old = old  # the children before the walk
        self.new: list[Any] = []  # those rebuilt so far
        self.changed = False  # whether one of ``new`` is not its old child
        self.path = path  # the container's path, where ``skip`` needs paths


class Call:
    """The arguments of one call, as a container whose children are named by parameter."""

    __slots__ = ("args", "kwargs", "names", "rest")

    def __init__(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], names: Sequence[str], rest: str
    ) -> None:
        self.args = args
        self.kwargs = dict(kwargs)
        self.names = names
        self.rest = rest

    def with_values(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        """The same call with other argument values."""
        return Call(args, kwargs, self.names, self.rest)

    def keys(self) -> list[str]:
        """The name of each argument, in order: only a walk that names them needs them."""
        named = len(self.names)
        positional = [
            self.names[i] if i < named else f"{self.rest}[{i - named}]"
            for i in range(len(self.args))
        ]
        return positional + list(self.kwargs)


class Rebuild:
    """One walk that rebuilds a structure with its tensors moved (or replaced).

    Made by one of its two constructors: :meth:`moving` (with a :class:`TensorMover`,
    tensors not on ``device`` are moved, and so are modules, in place, and objects with
    their own ``.to``) or :meth:`replacing` (it only puts the tensors listed in ``replace``
    in place of the ones a first walk gave, by identity).
    """

    __slots__ = (
        "device",
        "fast",
        "fix",
        "groups",
        "keep",
        "memo",
        "modules",
        "moved",
        "mover",
        "name",
        "replace",
        "root",
        "sent",
        "skip",
        "skip_types",
        "top",
        "undo",
        "who",
    )

    def __init__(
        self,
        device: torch.device | None,
        mover: TensorMover | None,
        skip: Skip | None,
        name: str,
        fix: Fix,
        replace: dict[int, torch.Tensor] | None,
        who: str,
    ) -> None:
        self.who = who
        self.device = device
        self.mover = mover
        self.skip = skip
        self.skip_types = () if skip is None else skip.types
        self.name = name
        self.fix = fix
        self.replace = replace
        self.memo: dict[int, Any] = {}
        # Children a container's split made on the fly are kept here till the walk ends,
        # so that no id in `memo` or in the mover is reused by a new object meanwhile.
        self.keep: list[Any] = []
        # A plain tensor met once that is no view is moved right here (while no view has
        # been met: then all go to the mover, which groups them); else by the mover.
        self.moved = mover.moved if mover is not None and not mover.non_blocking else None
        self.groups = mover.groups if mover is not None else {}
        self.sent: list[torch.Tensor] = mover.sent if mover is not None else []
        self.fast = (_containers.FAST_DICT, _containers.FAST_LIST, _containers.FAST_TUPLE)
        # The dtype policy's cast walk lists the modules it meets here: module.to moves
        # them in place, uncast, so their tensors are checked before anything moves.
        self.modules: list[Any] | None = None
        # The root being moved, until the modules in it are checked (at the first module
        # that moves, so that a batch with none never pays for it); then None.
        self.root: Any = None
        # The root, for good: a module that is the whole structure shares its tensors with
        # nothing else in it.
        self.top: Any = None
        # What puts each module moved in place back as it was, should the move fail after.
        self.undo: list[Callable[[], None]] = []

    @classmethod
    def moving(
        cls,
        device: torch.device | None,
        mover: TensorMover,
        skip: Skip | None,
        name: str,
        fix: Fix,
        who: str = "to_device()",
    ) -> Rebuild:
        """The walk that moves: tensors off ``device`` go to ``mover``; modules and objects
        with their own ``.to`` are moved by it; what ``skip`` names stays. With ``device`` None
        every tensor goes to ``mover`` (the dtype policy's cast, made where each tensor is)."""
        return cls(device, mover, skip, name, fix, None, who)

    @classmethod
    def replacing(
        cls, replace: dict[int, torch.Tensor], name: str, fix: Fix, who: str = "to_device()"
    ) -> Rebuild:
        """The walk that puts ``replace[id(t)]`` in place of each tensor ``t`` listed there,
        and moves nothing itself (a second walk over what a first one returned)."""
        return cls(None, None, None, name, fix, replace, who)

    def run(self, root: Any) -> Any:
        """The rebuilt ``root``."""
        __tracebackhide__ = True  # errors point at the caller's line
        self.root = self.top = root
        try:
            if self.skip is not None and self.skip.slow:
                if self._skipped(None, False, self.name, root):
                    return root
                return self._iterate(root, self.name)
            return self._any(root, 0)
        except _Refused as refused:  # made before anything moved: no path of ours to add
            raise refused.error from None
        except _Failed as failed:
            raise self._error(failed) from failed.error
        except PredicateFailed as failed:
            raise MoveError(failed.message(self.who)) from failed.error
        except Exception as error:  # the root's own split or rebuild
            raise self._error(_Failed(root, error)) from error

    # The recursive walk: twin of the explicit stack walk (_iterate_frames), which takes over
    # past _DEPTH and for slow skips; change both together.
    # test_explicit_stack_walk_gives_the_same holds them to the same results.

    def _any(self, obj: Any, depth: int) -> Any:
        tp = type(obj)
        if tp is _Tensor:
            return obj if obj.device == self.device else self._tensor(obj)
        fast_dict, fast_list, fast_tuple = self.fast
        if tp is fast_dict:
            return self._dict(obj, depth)
        if tp is fast_list or tp is fast_tuple:
            return self._sequence(obj, depth)
        if tp is Call:
            return self._call(obj)
        kind = _CACHE.get(tp) or kind_for(tp)
        role = kind.role
        if role == LEAF or (self.skip_types and isinstance(obj, self.skip_types)):
            if self.mover is not None and isinstance(obj, _Optimizer):
                self._left_optimizer(obj)
            return obj
        if role == TENSOR:
            return obj if obj.device == self.device else self._tensor(obj)
        memo = self.memo
        done = memo.get(id(obj), memo)
        if done is not memo:
            return obj if done is _BUSY else done
        if role == CONTAINER:
            if depth > _DEPTH:
                return self._iterate(obj, "")
            memo[id(obj)] = _BUSY
            result = self._container(obj, kind, depth)
        else:
            result = self._moved_whole(obj, kind)
        memo[id(obj)] = result
        return result

    def _dict(self, obj: dict[Any, Any], depth: int) -> Any:
        memo = self.memo
        done = memo.get(id(obj))
        if done is not None:
            return obj if done is _BUSY else done
        if depth > _DEPTH:
            return self._iterate(obj, "")
        memo[id(obj)] = _BUSY
        device, walk = self.device, self._any
        moved, groups, sent = self.moved, self.groups, self.sent
        out = {}
        changed = False
        key = None
        try:
            for key, value in obj.items():
                if type(value) is _Tensor:
                    # The hot loop. A plain tensor that is no view (while no view has been
                    # met) skips the device test: .to returns it as it is when it is on
                    # the target already, and a walk that moves usually moves them all.
                    if moved is not None and not groups and base_of(value) is None:
                        result = moved.get(id(value))
                        if result is None:
                            result = moved[id(value)] = value.to(device)
                            if result is not value:
                                sent.append(value)
                    elif value.device == device:
                        result = value
                    else:
                        result = self._tensor(value)
                    out[key] = result
                    if result is not value:
                        changed = True
                    continue
                result = walk(value, depth + 1)
                out[key] = result
                if result is not value:
                    changed = True
        except _Failed as failed:
            failed.parts.append((ITEM, key))
            raise
        except Exception as error:  # from the inlined .to, or a container's own code
            raise _failed(value, error, ITEM, key) from error
        rebuilt = out if changed else obj
        memo[id(obj)] = rebuilt
        return rebuilt

    def _left_optimizer(self, optimizer: Any) -> None:
        """Notes an optimizer the walk left where it was, for the warning that its state
        stays behind a module the walk moves; one the caller skipped by type is theirs."""
        if not (self.skip_types and isinstance(optimizer, self.skip_types)):
            assert self.mover is not None
            self.mover.optimizer = optimizer

    def _call(self, call: Call) -> Any:
        """A call's arguments, the root of the walk: the positional ones walked as a tuple and
        the keyword ones as a dict, by the hot loops; a failure's path starts at the
        parameter's name (as the call's kind names its children, in the other walks)."""
        try:
            args = self._sequence(call.args, 0)
        except _Failed as failed:  # the tuple's level gave the index: the name replaces it
            _, index = failed.parts.pop()
            failed.parts.append((NAME, call.keys()[index]))
            raise
        try:
            kwargs = self._dict(call.kwargs, 0)
        except _Failed as failed:
            _, keyword = failed.parts.pop()
            failed.parts.append((NAME, keyword))
            raise
        if args is call.args and kwargs is call.kwargs:
            return call
        return call.with_values(args, kwargs)

    def _sequence(self, obj: list[Any] | tuple[Any, ...], depth: int) -> Any:
        memo = self.memo
        done = memo.get(id(obj))
        if done is not None:
            return obj if done is _BUSY else done
        if only_atoms(obj):
            return obj
        if depth > _DEPTH:
            return self._iterate(obj, "")
        memo[id(obj)] = _BUSY
        device, walk = self.device, self._any
        moved, groups, sent = self.moved, self.groups, self.sent
        out: list[Any] = []
        append = out.append
        changed = False
        try:
            for value in obj:
                if type(value) is _Tensor:
                    # The hot loop: as in _dict.
                    if moved is not None and not groups and base_of(value) is None:
                        result = moved.get(id(value))
                        if result is None:
                            result = moved[id(value)] = value.to(device)
                            if result is not value:
                                sent.append(value)
                    elif value.device == device:
                        result = value
                    else:
                        result = self._tensor(value)
                    append(result)
                    if result is not value:
                        changed = True
                    continue
                result = walk(value, depth + 1)
                append(result)
                if result is not value:
                    changed = True
        except _Failed as failed:
            failed.parts.append((ITEM, len(out)))
            raise
        except Exception as error:  # from the inlined .to, or a container's own code
            raise _failed(value, error, ITEM, len(out)) from error
        rebuilt = obj if not changed else (out if type(obj) is list else tuple(out))
        memo[id(obj)] = rebuilt
        return rebuilt

    def _container(self, obj: Any, kind: Kind, depth: int) -> Any:
        keys, old = kind.split(obj)  # type: ignore[misc]
        walk = self._any
        new: list[Any] = []
        changed = False
        try:
            for value in old:
                result = walk(value, depth + 1)
                new.append(result)
                if result is not value:
                    changed = True
        except _Failed as failed:
            index = len(new)
            failed.parts.append((kind.style, index if keys is None else keys[index]))
            raise
        except Exception as error:  # a child's own split or rebuild
            index = len(new)
            key = index if keys is None else keys[index]
            raise _failed(old[index], error, kind.style, key) from error
        self.keep.append(old)
        return _rebuilt(kind, obj, keys, old, new) if changed else obj

    def _iterate(self, root: Any, path: str) -> Any:
        frames: list[_Frame] = []
        try:
            return self._iterate_frames(root, path, frames)
        except PredicateFailed:
            raise
        except Exception as error:
            failed = error
            if not isinstance(failed, _Failed):  # a split or rebuild: blame what it was for,
                # the child being visited (a rebuilt frame is popped before it rebuilds).
                top = frames[-1] if frames else None
                culprit = root if top is None else top.old[len(top.new)]
                failed = _Failed(culprit, error)
            for frame in reversed(frames):
                index, keys = len(frame.new), frame.keys
                failed.parts.append((frame.kind.style, index if keys is None else keys[index]))
            raise failed from failed.error

    def _iterate_frames(self, root: Any, path: str, frames: list[_Frame]) -> Any:
        # Twin of the recursive walk (_any, _dict, _sequence): change both together.
        value = self._visit(root, path, frames)
        if value is not _PUSHED:
            return value
        slow = self.skip is not None and self.skip.slow
        memo, keep = self.memo, self.keep
        while True:
            frame = frames[-1]
            old, new = frame.old, frame.new
            changed = frame.changed
            for index in range(len(new), len(old)):
                child = old[index]
                if slow:
                    result = self._slow(frame, index, child, frames)
                elif type(child) is _Tensor:
                    result = child if child.device == self.device else self._tensor(child)
                else:
                    result = self._visit(child, "", frames)
                if result is _PUSHED:
                    frame.changed = changed
                    break
                new.append(result)
                if result is not child:
                    changed = True
            else:
                frames.pop()
                obj, kind = frame.obj, frame.kind
                if kind not in _FAST_KINDS:
                    keep.append(old)
                result = _rebuilt(kind, obj, frame.keys, old, new) if changed else obj
                memo[id(obj)] = result
                if not frames:
                    return result
                parent = frames[-1]
                parent.new.append(result)
                if result is not obj:
                    parent.changed = True

    def _visit(self, obj: Any, path: str, frames: list[_Frame]) -> Any:
        """``obj`` moved; or ``_PUSHED`` after starting a frame for a container."""
        tp = type(obj)
        if tp is Call:
            return self._call(obj)
        kind = _CACHE.get(tp) or kind_for(tp)
        role = kind.role
        if role == LEAF or (self.skip_types and isinstance(obj, self.skip_types)):
            if self.mover is not None and isinstance(obj, _Optimizer):
                self._left_optimizer(obj)
            return obj
        if role == TENSOR:
            return obj if obj.device == self.device else self._tensor(obj)
        memo = self.memo
        done = memo.get(id(obj), memo)
        if done is not memo:
            return obj if done is _BUSY else done
        if role == CONTAINER:
            if (tp is self.fast[1] or tp is self.fast[2]) and only_atoms(obj):
                return obj
            keys, old = kind.split(obj)  # type: ignore[misc]
            if not old:
                return obj
            memo[id(obj)] = _BUSY
            frames.append(_Frame(obj, kind, keys, old, path))
            return _PUSHED
        result = self._moved_whole(obj, kind)
        memo[id(obj)] = result
        return result

    def _slow(self, frame: _Frame, index: int, child: Any, frames: list[_Frame]) -> Any:
        """Visit a child when ``skip`` needs its key or path checked."""
        keys, style = frame.keys, frame.kind.style
        key = index if keys is None else keys[index]
        skip = self.skip
        path = join(frame.path, style, key) if skip is not None and skip.needs_paths else ""
        if self._skipped(key, style != MEMBER, path, child):
            return child
        if type(child) is _Tensor:
            return child if child.device == self.device else self._tensor(child)
        return self._visit(child, path, frames)

    def _skipped(self, key: Any, keyed: bool, path: str, value: Any) -> bool:
        skip = self.skip
        assert skip is not None
        if keyed and skip.keys:
            try:
                if key in skip.keys:
                    return True
            except TypeError:  # an unhashable key
                pass
        return skip.skips(path, value)

    # Moving what is not a container.

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, not on the target, moved (or replaced)."""
        if self.replace is not None:
            return self.replace.get(id(tensor), tensor)
        moved = self.moved
        if (
            moved is not None
            and not self.groups
            and type(tensor) is _Tensor
            and base_of(tensor) is None
        ):
            result = moved.get(id(tensor))
            if result is None:
                result = moved[id(tensor)] = self._to(tensor)
                self.sent.append(tensor)
            return result
        assert self.mover is not None
        try:
            return self.mover.move(tensor)
        except Exception as error:
            raise _Failed(tensor, error) from error

    def _to(self, tensor: torch.Tensor) -> torch.Tensor:
        """A plain tensor met for the first time, that is no view, moved with ``.to``."""
        try:
            return tensor.to(self.device)
        except Exception as error:
            raise _Failed(tensor, error) from error

    def _moved_whole(self, obj: Any, kind: Kind) -> Any:
        """A module (in place) or an object with its own ``.to``, moved."""
        mover, device = self.mover, self.device
        if mover is None or device is None:  # replacing: only what the engine itself moved
            if kind.role == MODULE:
                if self.modules is not None:
                    self.modules.append(obj)
                if mover is not None:  # the dtype policy's cast: modules are not cast, nor
                    # their tensors where the structure holds them too
                    for _, tensor in module_tensors(obj):
                        mover.adopt(tensor, tensor, tensor)
                return obj
            if kind.rebuild is None:
                return obj
            return self._container(obj, kind, 0)
        try:
            if kind.role == MODULE:
                if not module_on(obj, device):
                    if self.root is not None:
                        self._check_modules(device)
                    self._module_to(obj, device, mover)
                return obj
            # One walk lists its tensors that its .to copies; only where it finds none,
            # a second asks whether anything it cannot read is off the device.
            if not self._sending(obj) and (
                kind.split is not None and all_on(kind.split(obj)[1], device)
            ):
                return obj
            result = own_to(obj, device, mover.non_blocking)
            if kind.split is None or not off(result, device):
                return result
        except _Refused:
            raise
        except Exception as error:
            raise _Failed(obj, error) from error
        # Its .to left tensors behind (a BatchEncoding moves only the tensors it holds
        # directly, not a list of them): those are moved as children, where the type's
        # own protocol can take them back; else the object is refused, not half-moved.
        if kind.rebuild is not None and type(result) is type(obj):
            result = self._container(result, kind, 0)
        try:
            if off(result, device):
                raise left_behind(result, device)
        except Exception as error:
            raise _Failed(obj, error) from error
        return result

    def _check_modules(self, device: torch.device) -> None:
        """Before the first module moves: refuse the move if a module it would move holds
        tensors on meta, which ``module.to`` cannot copy, is or holds a DDP or FSDP2
        module off ``device`` (which keeps the placement it was wrapped at), or has a part
        that accelerate's hook runs on another device (which would fail at its next
        forward). ``module.to`` stops at the first tensor on meta, the tensors before it
        moved in place, and so would this walk, the modules before it moved: checked
        here, nothing in place has moved yet.

        Raises:
            _Refused: with the :class:`MoveError` naming each such module.
        """
        root, self.root = self.root, None
        # The modules this walk will move: a walk that only reads, with the same skip.
        met: list[Any] = []
        reader = Rebuild(None, None, self.skip, self.name, self.fix, {}, self.who)
        reader.modules = met
        # A reading walk that fails fails where this one will: the modules met before
        # that point are still all the modules this walk can move, and are checked.
        with contextlib.suppress(MoveError):
            reader.run(root)
        error = None
        if device.type != "meta":  # anything goes to meta, meta tensors as they are
            error = unmaterialised(root, met, device, self.name, self.fix, self.who)
        if error is None:  # to meta too: module.to makes new parameters there
            error = wrapped(root, met, device, self.name, self.fix, self.who)
        if error is None and device.type != "meta":
            error = dispatched(root, met, device, self.name, self.fix, self.who)
        if error is not None:
            raise _Refused(root, error)

    def _module_to(self, module: nn.Module, device: torch.device, mover: TensorMover) -> None:
        """``module.to(device)``, in place, tensors it shares with modules moved before (tied
        weights) still shared; then each of its tensors that moved is adopted by
        ``mover``, so that the structure's own references to them (and views of them) come
        back as the module's moved tensors, wherever the walk meets them."""
        held = module is not self.top  # as the root it is the whole structure
        sent, seen = self.sent, set()
        before: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for name, tensor in module_tensors(module):
            if tensor.device == device:
                continue
            if id(tensor) not in seen:
                seen.add(id(tensor))
                sent.append(tensor)
            if held:
                # A parameter that module.to keeps, moving it in place (set_data, as between
                # two CUDA devices; swap_tensors), loses its place in its old memory, which
                # its views still have: a detached alias made now keeps it. module.to
                # never keeps a view (a buffer can be one).
                was = tensor if base_of(tensor) is not None else tensor.detach()
                before.append((name, tensor, was))
        self.undo.append(restorer(module))
        try:
            move_module(
                module, device, non_blocking=mover.non_blocking, earlier=mover.adopted_result
            )
        except Exception as error:
            # torch's error names no tensor: the one that cannot move, found by trying each.
            culprit = (
                None if isinstance(error, torch.OutOfMemoryError) else _unmovable(module, device)
            )
            if culprit is None:
                raise
            raise _TensorOfModule(*culprit, error) from error
        if not before:
            return
        self.keep.append(before)  # no id adopted is reused by a new object during the walk
        after = dict(module_tensors(module))
        for name, tensor, was in before:
            result = after.get(name)
            if result is not None and result.device == device:
                mover.adopt(tensor, was if result is tensor else tensor, result)

    def put_modules_back(self) -> None:
        """Every module this walk moved in place, as it was before: for a move that fails
        after (out of memory, a leaf that cannot move), which leaves nothing half-moved."""
        undo, self.undo = self.undo, []
        for restore in reversed(undo):
            # What the user sees is the move's own error: a module that cannot be put back
            # (its own code raising) must not hide it.
            with contextlib.suppress(Exception):
                restore()

    def _sending(self, obj: Any) -> int:
        """List the tensors an object's own ``.to`` is about to copy (a module's are listed
        by :meth:`_module_to`); how many."""
        device, before = self.device, len(self.sent)
        self.sent.extend(tensor for tensor in tensors_within(obj) if tensor.device != device)
        return len(self.sent) - before

    def _error(self, failed: _Failed) -> MoveError:
        path = build(self.name, reversed(failed.parts))
        error = failed.error
        # skip= leaves parts of a structure where they are, never the whole object.
        whole = bool(self.name) and path == self.name
        fix = f"leave it where it is: do not move {path}" if whole else self.fix(path)
        if isinstance(error, EngineBug):
            detail = str(error)
            fix = (
                "none needed in your code: this is a bug in devicectx; please report it "
                f"with this message. Meanwhile, {fix}"
            )
        elif isinstance(error, CannotRebuild):
            detail = str(error)
            if error.left:
                places = ", ".join(f"{path}{below} ({device})" for below, device in error.left)
                detail = f"{detail}: {places}"
            fix = f"teach it with {_registration(error.tp)}; or {fix}"
        elif isinstance(error, (RegistrationError, CannotCast)):  # their own fix, not a skip
            detail, _, fix = str(error).partition("\nfix: ")
        elif isinstance(error, _TensorOfModule):
            kind = "parameter" if isinstance(error.tensor, nn.Parameter) else "buffer"
            inner = f"{type(error.error).__name__}: {_shortened(str(error.error))}"
            detail = f"its {kind} {error.name!r} ({_describe(error.tensor)}): {inner}"
            detail = detail.replace("\n", "\n    ")
        else:
            detail = f"{type(error).__name__}: {_shortened(str(error))}".replace("\n", "\n    ")
            other = _whole_fix(failed.obj, path) if whole else None
            if other is not None:
                fix = f"{other}; or {fix}"
            if self.device is not None and not isinstance(failed.obj, torch.Tensor):
                cast = _cast_fix(failed.obj, path, self.device)
                if cast is not None:  # an object's own .to met a dtype the device lacks
                    fix = f"{cast}; or {fix}"
            if isinstance(failed.obj, torch.Tensor) and failed.obj.is_meta:
                # Shapes only, no values: no move of it works, by hand either.
                fix = (
                    f"give {path} values: it is on meta, which holds shapes only (made under "
                    f"torch.device('meta') or with device='meta'); make it where it has data, "
                    f"or load its values into torch.empty_like({path}, "
                    f"device={str(self.device)!r}); or {fix.removeprefix('move it yourself, or ')}"
                )
            if isinstance(error, torch.OutOfMemoryError):
                # Memory first; leaving the whole batch where it is (its root) moves nothing.
                room = (
                    f"free memory on {self.device} (del what you no longer need there), or "
                    f"{SMALLER_BATCHES}"
                )
                fix = room if path == self.name else f"{room}; or {fix}"
        # A walk with no device only casts (a dtype mapping where nothing moves).
        what = f"move {path}" if self.device is not None else f"cast {path}"
        where = f" to {self.device}" if self.device is not None else ""
        msg = (
            f"{self.who} could not {what} ({_describe(failed.obj)}){where}:\n"
            f"    {detail}\n"
            f"fix: {fix}"
        )
        # Out of memory stays torch's own error too: `except torch.OutOfMemoryError` around
        # a move then works as around `.to`, and shrink_batch_on_oom knows it by its type.
        if isinstance(error, torch.OutOfMemoryError):
            return MoveOutOfMemoryError(msg)
        return MoveError(msg)


_SHOWN_LINES = 4
"""The most lines of torch's error a MoveError quotes whole; a longer one (torch's
dispatcher lists every backend an op has: some 50 lines) is quoted by its first line, the
rest being in the error the MoveError is raised from."""


def _shortened(text: str) -> str:
    lines = text.strip().splitlines()
    if len(lines) <= _SHOWN_LINES:
        return text
    return f"{lines[0]}\n... ({len(lines) - 1} more lines: in the error above)"


def _whole_fix(obj: object, path: str) -> str | None:
    """What else to do with the object a move could not take as a whole (its root)."""
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:
            return f"give it a layout the device takes first ({path}.to_dense())"
        return None
    kind = type(obj).__qualname__
    if is_registered(type(obj)):
        return f"mend the children= and rebuild= that register_container({kind}, ...) got"
    if isinstance(obj, nn.Module):
        return None
    return f"teach devicectx how to take it apart: {_registration(type(obj))}"


def _registration(tp: type) -> str:
    """The ``register_container`` call for a type the move knows nothing of, with the two
    functions the user writes named: only its author knows its children and how it is
    built from them."""
    named = registrable_class(tp)
    base = importable_class(tp)
    shown = named.__qualname__
    made = ""
    if named is not tp:
        made = f" (a {tp.__name__}, made at run time, is a {named.__name__})"
    elif base is not tp:  # made at run time over one of Python's own containers
        shown = tp.__name__  # as the code that made it most likely holds it
        made = (
            f" ({shown} itself, the class your code made at run time, each one it makes; not "
            f"{base.__name__}, whose registration would change how every {base.__name__} "
            f"is walked)"
        )
    stem = named.__name__.lower()
    return (
        f"devicectx.register_container({shown}, children={stem}_children, "
        f"rebuild={stem}_rebuild){made}, where you write def {stem}_children(obj) giving "
        f"its (key, child) pairs and def {stem}_rebuild(obj, new) giving a new "
        f"{tp.__name__} of the moved children"
    )


def _rebuilt(kind: Kind, obj: Any, keys: Any, old: Sequence[Any], new: list[Any]) -> Any:
    """``kind.rebuild``'s result; a locked object with its own ``.to`` (a TensorDict, a
    lazy stack, taken apart to cast its tensors) comes back locked, as its ``.to`` keeps
    it."""
    result = kind.rebuild(obj, keys, old, new)  # type: ignore[misc]
    if kind.role == OWN and lost_lock(obj, result):
        result.lock_()
    return result


def _cast_fix(obj: object, path: str, device: torch.device) -> str | None:
    """Where ``obj`` (an object moved by its own ``.to``, which ``dtypes=`` does not cast)
    holds tensors of a dtype ``device`` cannot hold: the statements that cast them, as
    code; else None. Read on the failure path only."""
    lacking = CAPABILITIES.missing(device)
    if not lacking:
        return None
    casts = []
    with contextlib.suppress(Exception):  # its own code: the fix is a courtesy
        for inner, tensor in iter_tensors(obj, path):
            nearest = nearest_dtype(device, tensor.dtype) if tensor.dtype in lacking else None
            if nearest is not None:
                casts.append(f"{inner} = {inner}.to({nearest})")
    if not casts:
        return None
    more = f" (and {len(casts) - 4} more)" if len(casts) > 4 else ""
    return (
        f"{'; '.join(casts[:4])}{more} before the call, as {with_article(type(obj).__name__)} "
        f"moves with its own .to, which dtypes= does not cast ({device} holds no "
        f"{', '.join(sorted(str(dtype) for dtype in lacking))})"
    )


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        if is_lazy(obj):  # a lazy module's, before its first forward: no shape yet
            return f"an {type(obj).__name__} (not initialised: no shape yet)"
        if obj.is_nested:  # no shape of its own: torch raises at .shape
            count = obj.size(0)
            return f"a nested {type(obj).__name__} of {count} tensors, {obj.dtype}, on {obj.device}"
        shape = tuple(obj.shape)
        return f"{with_article(type(obj).__name__)} of shape {shape}, {obj.dtype}, on {obj.device}"
    return with_article(type(obj).__qualname__)
