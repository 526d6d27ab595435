"""One device's inputs for ``assert_device_agnostic``: its own copies of the modules in
the call (and of the optimizers and LR schedulers that hold their parameters), its own
copies of the tensors already on the device, the others moved (and cast, as ``dtypes=``
says), the caller's objects untouched."""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from devicectx._errors import (
    DtypeUnsupportedError,
    MoveError,
    MoveOutOfMemoryError,
    with_article,
)
from devicectx._torch.module_tree import move as move_module
from devicectx._torch.module_tree import tensors as module_tensors
from devicectx._torch.optim import keep_step_tracking
from devicectx._torch.tensors import base_of
from devicectx.decorator._params import Params
from devicectx.devices._capabilities import CAPABILITIES, nearest_dtype
from devicectx.devices._resolve import available_devices
from devicectx.move._alias import anchor_among, view_of
from devicectx.move._containers import kind_for
from devicectx.move._dtypes import DtypesLike, policy_for
from devicectx.move._hooks import HOOK as _HOOK
from devicectx.move._kinds import CONTAINER, LEAF, MODULE, TENSOR
from devicectx.move._move import iter_tensors, move_call
from devicectx.move._paths import join
from devicectx.testing._sets import Holds


def holds_for(dtypes: DtypesLike, device: torch.device) -> Holds:
    """What ``device`` holds of each dtype it cannot hold, where ``dtypes="device"`` cast
    the inputs to it; nothing elsewhere (a mapping casts on every device alike)."""
    if not (isinstance(dtypes, str) and dtypes == "device"):
        return {}
    policy = policy_for(dtypes, device)
    return {} if policy is None else policy.cast


def name_of(fn: object) -> str:
    while isinstance(fn, functools.partial):  # named for the function it calls
        fn = fn.func
    qualname = getattr(fn, "__qualname__", None)
    if not isinstance(qualname, str):
        qualname = type(fn).__qualname__
    # A function defined in a test reads better as `scale` than `test_x.<locals>.scale`.
    return qualname.rpartition("<locals>.")[2]


class Inputs:
    """The call ``assert_device_agnostic`` checks, and its inputs for each device, each
    made from the caller's untouched objects."""

    def __init__(
        self,
        fn: Callable[..., object],
        args: tuple[object, ...],
        kwargs: dict[str, object],
        dtypes: DtypesLike,
        devices: list[torch.device],
    ) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.dtypes = dtypes
        self.devices = devices
        self.name = name_of(fn)
        self.names, self.rest = positional_names(fn)
        self._groups: dict[int, list[torch.Tensor]] | None = None
        self._paths: dict[int, str] | None = None  # id(module) -> its path, found once

    def anchor_of(self, view: torch.Tensor) -> torch.Tensor | None:
        """The input tensor that ``view``'s copy is made a view of, as the move chooses it
        (the largest tensor of the inputs that covers its memory); None where ``view`` is
        copied alone."""
        if self._groups is None:  # found once, and only for inputs with views in them
            groups: dict[int, list[torch.Tensor]] = {}
            met: set[int] = set()
            for _, tensor in iter_tensors((self.args, self.kwargs)):
                if id(tensor) not in met:
                    met.add(id(tensor))
                    base = base_of(tensor)
                    groups.setdefault(id(tensor if base is None else base), []).append(tensor)
            self._groups = groups
        members = self._groups.get(id(base_of(view)), [])
        return anchor_among(members, view) if any(m is view for m in members) else None

    def on(self, device: torch.device) -> RunInputs:
        """``fn``, ``args`` and ``kwargs`` for one run on ``device``, with its module copies."""
        __tracebackhide__ = True
        fn, args, kwargs, dtypes = self.fn, self.args, self.kwargs, self.dtypes
        policy = policy_for(dtypes, device)
        if policy is not None and policy.missing:
            _refuse_dtypes(device, policy.missing, fn, args, kwargs, dtypes, self.devices)
        copies = _Copies(device, {} if policy is None else policy.cast, self)
        call_fn, call_args, call_kwargs = copies.call(fn, args, kwargs)
        # Moved as one structure, so a tensor passed twice stays one tensor.
        # The same inputs go to each device on purpose: no repeated-move warning.
        try:
            moved_args, moved_kwargs = move_call(
                call_args,
                call_kwargs,
                device,
                names=self.names,
                rest=self.rest,
                check_repeats=False,
                who=f"assert_device_agnostic({self.name})",
                dtypes=dtypes,
            )
        except DtypeUnsupportedError as error:
            # Only where the look above missed a tensor (one the move finds in an object of
            # its own): the move's fix is written for @device_agnostic.
            lines = str(error).splitlines()[:-1]
            fix = _dtype_fix(device, error.paths, self.name, dtypes, self.devices)
            msg = "\n".join([*lines, f"fix: {fix}"])
            raise DtypeUnsupportedError(msg, device=device, paths=error.paths) from None
        except MoveError as error:
            raise self._move_error(error, device) from error.__cause__
        modules = [(self._path_of(m), m, copied) for m, copied in copies.modules]
        return RunInputs(call_fn, moved_args, moved_kwargs, modules)

    def _path_of(self, module: nn.Module) -> str:
        """Where ``module`` is in the call (``model``, ``batch['model']``; ``self`` for
        ``fn`` itself or its module): its first path, as the checks' messages write it."""
        if self._paths is None:
            named = named_arguments(self.fn, self.args, self.kwargs)
            self._paths = {}
            for path, value in walk_arguments(named):
                if isinstance(value, nn.Module):
                    self._paths.setdefault(id(value), path)
        return self._paths.get(id(module), type(module).__qualname__)

    def _move_error(self, error: MoveError, device: torch.device) -> MoveError:
        """``error`` with a fix for this kit: the move's is written for ``@device_agnostic``
        (``exclude=``, which the kit has not)."""
        *lines, fix = str(error).splitlines()
        left_out = leave_out(device, self.devices)
        if isinstance(error, MoveOutOfMemoryError):
            fix = (
                f"fix: give {self.name} smaller inputs (a smaller batch, a smaller model) that "
                f"fit on {device}, or {left_out}"
            )
            return MoveOutOfMemoryError("\n".join([*lines, fix]))
        decorators = fix.find(_CALL_FIX)
        if decorators >= 0:
            kept = fix[:decorators].removesuffix("; or ")
            ours = f"make it inside {self.name} rather than pass it, or {left_out}"
            fix = f"{kept}; or {ours}" if kept != "fix: " else f"fix: {ours}"
        return MoveError("\n".join([*lines, fix]))


# How the move's fix for an argument begins (devicectx.move._move's, for @device_agnostic).
_CALL_FIX = "move it yourself, or leave the argument out of the move"


class RunInputs(NamedTuple):
    """One run's call, and each module in it: its path, the caller's, and the run's copy."""

    fn: Callable[..., object]
    args: tuple[object, ...]
    kwargs: dict[str, object]
    modules: list[tuple[str, nn.Module, nn.Module]]


def positional_names(fn: Callable[..., object]) -> tuple[list[str], str]:
    """The names of ``fn``'s positional parameters (a module's: its ``forward``'s), and of
    its ``*args`` (``"args"`` where it has none, or its signature cannot be read), as the
    decorator reads them."""
    target = fn.forward if isinstance(fn, nn.Module) else fn
    params = Params.of(target, "")
    return list(params.positional), params.varargs or "args"


class _Copies:
    """One device's copies of what a run may change: the modules in a call, each module
    copied once (a module passed twice, or shared by two, stays one), in containers rebuilt
    around them; the optimizers and LR schedulers, made to hold the copies' parameters; and
    the tensors already on the device, which the move would pass as they are.

    ``to_device`` moves a module in place; a copy keeps the caller's model where it is, and
    intact (moving to meta drops the weights; on a backend registered out of tree the move
    puts new parameters in the caller's model). A tensor on the device gets a copy of its
    own, so that an in-place write by ``fn`` reaches neither the caller's tensor nor another
    run (the same device listed twice). A module's parameter or buffer passed beside it is
    the copy's, on every device, as the move makes it of a module it moves.
    """

    def __init__(
        self, device: torch.device, cast: Mapping[torch.dtype, torch.dtype], inputs: Inputs
    ) -> None:
        self.device = device
        self.cast = cast
        self.inputs = inputs
        # deepcopy's: modules that share parts keep sharing, an optimizer holds its
        # module's copied parameters, and a module holds a tensor copied before it.
        self.memo: dict[int, Any] = {}
        self.copies: dict[int, Any] = {}  # id(module, optimizer, scheduler) -> its copy
        self.done: dict[int, Any] = {}  # id(tensor, container) -> what stands in for it
        self.modules: list[tuple[nn.Module, nn.Module]] = []  # (original, copy)
        self.optimizers: list[Optimizer] = []  # the originals, each once
        self.now: dict[int, torch.Tensor] = {}  # id(a module's tensor) -> the copy's, moved
        # id(a copy's tensor before its move) -> (that tensor, what the move made of it):
        # modules that share a weight stay tied across their moves (meta unties them).
        self.moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.passed: set[int] = set()  # the tensors left to the move, off the device

    def call(
        self, fn: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]
    ) -> tuple[Callable[..., object], tuple[object, ...], dict[str, object]]:
        """``fn``, ``args`` and ``kwargs`` with the copies in them."""
        call_fn = self.of_callable(fn)
        call_args: tuple[object, ...] = self.within(args)
        call_kwargs: dict[str, object] = self.within(kwargs)
        if not self.passed.isdisjoint(self.now):  # a module's tensor met before the module
            self.done = {}
            call_args, call_kwargs = self.within(args), self.within(kwargs)
        self.finish()
        return call_fn, call_args, call_kwargs

    def generator(self, original: torch.Generator) -> torch.Generator:
        """A generator of its own for this run, in the caller's generator's state: each
        device draws the numbers the caller's would draw next, and the caller's is not
        advanced."""
        copy: torch.Generator | None = self.copies.get(id(original))
        if copy is None:
            copy = torch.Generator(device=original.device)
            copy.set_state(original.get_state())
            self.copies[id(original)] = copy
        return copy

    def of_callable(self, fn: Callable[..., object]) -> Callable[..., object]:
        if isinstance(fn, nn.Module):
            module: Callable[..., object] = self.module(fn)
            return module
        owner = getattr(fn, "__self__", None)
        method_name = getattr(fn, "__name__", None)
        if isinstance(owner, nn.Module) and isinstance(method_name, str):
            # Looked up again on the copy, so a decorated method keeps its decorator.
            bound: Callable[..., object] = getattr(self.module(owner), method_name)
            return bound
        return fn

    def within(self, obj: Any) -> Any:
        """``obj`` with each module, optimizer, scheduler and tensor on the device in it, at
        any depth of containers, a copy."""
        done = self.done.get(id(obj))
        if done is not None:
            return done
        kind = kind_for(type(obj))
        role = kind.role
        if role == TENSOR:
            return self.tensor(obj)
        if role == MODULE:
            return self.module(obj)
        if role == LEAF and isinstance(obj, (Optimizer, LRScheduler)):
            return self.optimizing(obj)
        if isinstance(obj, torch.Generator):
            return self.generator(obj)
        if role != CONTAINER or kind.split is None or kind.rebuild is None:
            return obj
        self.done[id(obj)] = obj  # a cycle back to it meets the original
        keys, children = kind.split(obj)
        new = [self.within(child) for child in children]
        result = obj
        if any(n is not o for n, o in zip(new, children, strict=True)):
            try:
                result = kind.rebuild(obj, keys, children, new)
            except Exception as error:
                kept = type(obj).__qualname__
                msg = (
                    f"assert_device_agnostic copies each nn.Module in the arguments, and each "
                    f"tensor already on the device, for each device; a {kept} holding one "
                    f"cannot be rebuilt around the copy: {type(error).__name__}: {error}\n"
                    f"fix: pass it as an argument of its own: assert_device_agnostic(fn, "
                    f"model, x, ...)"
                )
                raise TypeError(msg) from error
        self.done[id(obj)] = result
        return result

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """What stands for ``tensor`` in this run: a module's tensor the copy's, one on
        the device a copy of its own; else ``tensor``, which the move copies."""
        copied = self.now.get(id(tensor))
        if copied is None:
            if tensor.device != self.device:
                self.passed.add(id(tensor))
                return tensor
            copied = self.memo.get(id(tensor))  # a copy a module holds already
            if copied is None:
                copied = self._own(tensor)
                self.memo[id(tensor)] = copied  # a module met later holds this copy
        self.done[id(tensor)] = copied
        return copied

    def _own(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` as the move makes one: a parameter as a new parameter (a
        leaf), another tensor through autograd, a view covered by a tensor of the inputs as
        a view of that one's copy; copied alone otherwise (never the rest of its base)."""
        if type(tensor) is not torch.Tensor and isinstance(tensor, nn.Parameter):
            parameter: torch.Tensor = copy.deepcopy(tensor, self.memo)
            return parameter
        if base_of(tensor) is not None:
            anchor = self.inputs.anchor_of(tensor)
            if anchor is not None:
                view = view_of(anchor, self.tensor(anchor), tensor)
                if view is not None:
                    return view
        if tensor.is_inference():
            # An inference tensor as the caller's: outside inference mode clone() makes a
            # normal one, and a run on the tensor's own device would pass where the
            # caller's call fails (torch saves no inference tensor for backward).
            with torch.inference_mode():
                return tensor.clone()
        return tensor.clone()

    def module(self, module: nn.Module) -> nn.Module:
        copied: nn.Module | None = self.copies.get(id(module))
        if copied is None:
            copied = self.copies[id(module)] = self._copy(module)
            self.modules.append((module, copied))
            mine = dict(module_tensors(copied))
            for name, tensor in module_tensors(module):
                self.now.setdefault(id(tensor), mine[name])
        return copied

    def _copy(self, module: nn.Module) -> nn.Module:
        _refuse_dispatched(module)
        try:
            copied = copy.deepcopy(module, self.memo)
            _own_methods(copied)
            if self.cast:
                _cast(copied, self.cast)
            before = dict(module_tensors(copied))
            moved = move_module(copied, self.device, earlier=self._earlier)
            after = dict(module_tensors(moved))
            for name, tensor in before.items():
                self.moved.setdefault(id(tensor), (tensor, after[name]))
            return moved
        except Exception as error:
            kind = type(module).__qualname__
            msg = (
                f"assert_device_agnostic copies each nn.Module argument to each device; "
                f"copying the {kind} to {self.device} failed: {type(error).__name__}: {error}\n"
                f"fix: make the module deep-copyable, or create it inside fn"
            )
            raise TypeError(msg) from error

    def _earlier(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """What the move of a module copied before made of ``tensor``, which it shares."""
        found = self.moved.get(id(tensor))
        return None if found is None else found[1]

    def optimizing(self, obj: Optimizer | LRScheduler) -> object:
        """A copy of an optimizer, or of an LR scheduler with its optimizer, in the modules'
        memo: its parameters are the copied modules' (see :meth:`finish`)."""
        copied = self.copies.get(id(obj))
        if copied is not None:
            return copied
        try:
            copied = copy.deepcopy(obj, self.memo)
        except Exception as error:
            kind = type(obj).__qualname__
            msg = (
                f"assert_device_agnostic copies each optimizer and LR scheduler in the "
                f"arguments with the modules, for each device; copying the {kind} failed: "
                f"{type(error).__name__}: {error}\n"
                f"fix: build the {kind} inside fn, from the model it is given"
            )
            raise TypeError(msg) from error
        self.copies[id(obj)] = copied
        optimizer = obj if isinstance(obj, Optimizer) else getattr(obj, "optimizer", None)
        if isinstance(optimizer, Optimizer) and all(o is not optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)
        return copied

    def finish(self) -> None:
        """Point each copied optimizer at the parameters of the copied modules, where they
        are now (``module.to`` replaces them on some devices: meta, backends out of tree),
        with its state moved there as ``load_state_dict`` moves it.

        Raises:
            TypeError: an optimizer holds a parameter of no module in the call: its copy
                would train a copy that nothing reads.
        """
        now = self.now
        for optimizer in self.optimizers:
            if any(id(p) not in now for group in optimizer.param_groups for p in group["params"]):
                raise TypeError(_unowned(optimizer, self.inputs))
            copied = self.memo[id(optimizer)]
            saved = copied.state_dict()  # by position; its tensors are this run's copies
            for group, kept in zip(copied.param_groups, optimizer.param_groups, strict=True):
                group["params"] = [now[id(p)] for p in kept["params"]]
            copied.load_state_dict(saved)
            keep_step_tracking(optimizer, copied)


def _unowned(optimizer: Optimizer, inputs: Inputs) -> str:
    """The message for an optimizer whose parameters are not all a module's in the call."""
    kind = type(optimizer).__qualname__
    path = _path_to(optimizer, named_arguments(inputs.fn, inputs.args, inputs.kwargs))
    name = inputs.name
    return (
        f"assert_device_agnostic({name}): {path} ({with_article(kind)}) holds parameters of "
        f"no module given to {name}: each device's run gets a copy of each module and of "
        f"the {kind}, and the copy would train parameters that {name} never reads\n"
        f"fix: pass the model too, assert_device_agnostic({name}, model, optimizer, ...), "
        f"or build the {kind} inside {name}, from the model it is given"
    )


def _path_to(target: object, named: list[tuple[str, object]]) -> str:
    """The path of ``target`` in the arguments (through containers, or as the optimizer of
    a scheduler there), for a message."""
    for path, value in walk_arguments(named):
        if value is target:
            return path
        if getattr(value, "optimizer", None) is target and isinstance(value, LRScheduler):
            return f"{path}.optimizer"
    return "an argument"


def walk_arguments(named: list[tuple[str, object]]) -> Iterator[tuple[str, object]]:
    """Every value in the ``named`` arguments, through containers, with its path, depth
    first; a container met again is not looked into again. For messages: slow."""
    stack = list(reversed(named))
    seen: set[int] = set()
    while stack:
        path, value = stack.pop()
        yield path, value
        kind = kind_for(type(value))
        if kind.role != CONTAINER or kind.split is None or id(value) in seen:
            continue
        seen.add(id(value))
        keys, children = kind.split(value)
        keys = range(len(children)) if keys is None else keys
        pairs = zip(keys, children, strict=True)
        stack += reversed([(join(path, kind.style, key), child) for key, child in pairs])


def _cast(module: nn.Module, cast: Mapping[torch.dtype, torch.dtype]) -> None:
    """Cast ``module``'s parameters and buffers (a copy's) in place, by dtype, keeping each
    object (and so weights tied by object): ``module.float()`` would cast float16 too, and
    complex128 has no such method."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        dtype = cast.get(tensor.dtype)
        if dtype is None:
            continue
        grad = tensor.grad if isinstance(tensor, nn.Parameter) else None
        tensor.data = tensor.data.to(dtype)
        if grad is not None:
            tensor.grad = grad.to(dtype)


def _refuse_dtypes(
    device: torch.device,
    missing: frozenset[torch.dtype],
    fn: Callable[..., object],
    args: tuple[object, ...],
    kwargs: dict[str, object],
    dtypes: DtypesLike,
    devices: list[torch.device],
) -> None:
    """Raise, naming every input tensor (modules' included) of a dtype in ``missing``: the
    dtypes ``device`` cannot hold that ``dtypes`` casts to none it holds."""
    paths: dict[torch.dtype, list[str]] = {}
    owned: list[str] = []  # a module's parameters and buffers, which its own .to moves
    modules: dict[torch.dtype, str] = {}  # floating point dtypes of modules' tensors
    count = 0
    for name, value in named_arguments(fn, args, kwargs):
        plain = {path for path, _ in iter_tensors(value, name)}
        for path, tensor in iter_tensors(value, name, modules=True):
            if path not in plain and tensor.is_floating_point():
                modules.setdefault(tensor.dtype, path)
            if tensor.dtype in missing:
                paths.setdefault(tensor.dtype, []).append(path)
                owned += [] if path in plain else [path]
                count += 1
    if not paths:
        return
    width = max(len(str(dtype)) for dtype in paths)
    what = "a tensor" if count == 1 else f"{count} tensors"
    lines = [
        f"assert_device_agnostic({name_of(fn)}) cannot move {what} to {device}, which holds "
        f"no {' or '.join(str(dtype) for dtype in paths)}:",
        *(f"    {dtype!s:<{width}} <- {', '.join(p)}" for dtype, p in paths.items()),
        f"fix: {_dtype_fix(device, paths, name_of(fn), dtypes, devices, owned, modules)}",
    ]
    raise DtypeUnsupportedError("\n".join(lines), device=device, paths=paths)


def _dtype_fix(
    device: torch.device,
    paths: dict[torch.dtype, list[str]],
    name: str,
    dtypes: DtypesLike,
    devices: list[torch.device],
    owned: Sequence[str] = (),
    modules: Mapping[torch.dtype, str] | None = None,
) -> str:
    """The fix of inputs of dtypes ``device`` cannot hold (``paths``): a module's own
    tensors made in one it holds (``owned``); then a ``dtypes=`` policy, or leaving the
    device out. ``modules``: the floating point dtypes of the modules' tensors, each with
    a path of one, where the inputs meet a module of the dtype the casts make (a float32
    model fed numpy's float64): there the mapping, which casts on every device, comes
    first, as ``"device"`` keeps the reference's inputs in their dtype, which the module
    refuses on the CPU itself."""
    left_out = leave_out(device, devices, paths)
    nearest = {dtype: nearest_dtype(device, dtype) for dtype in paths}
    held = {dtype: to for dtype, to in nearest.items() if to is not None}
    if len(held) < len(nearest):
        return left_out
    if owned:
        inputs = {
            dtype: [p for p in found if p not in owned]
            for dtype, found in paths.items()
            if any(p not in owned for p in found)
        }
        code = _owned_fix(device, owned, held)
        if not inputs:
            return f"{code}; or {left_out}"
        rest = _dtype_fix(device, inputs, name, dtypes, devices)
        return f"{code}; and for the other inputs: {rest}"
    if dtypes is None:
        casts = ", ".join(f"{dtype} to {to}" for dtype, to in held.items())
        lacking = ", ".join(str(d) for d in lacking_devices(device, devices, paths))
        which = " or ".join(str(dtype) for dtype in held)
        device_fix = (
            f'assert_device_agnostic({name}, ..., dtypes="device"), which casts {casts} on '
            f"each device that holds no {which} (here {lacking})"
        )
        met = [modules[to] for to in held.values() if modules and to in modules]
        if len(met) == len(held):  # a module of the dtypes the casts make meets the inputs
            pairs = ", ".join(f"{k}: {v}" for k, v in held.items())
            module = met[0].rpartition(".")[0] or met[0]
            return (
                f"assert_device_agnostic({name}, ..., dtypes={{{pairs}}}), which casts "
                f"{casts} on every device, as {module} ({next(iter(held.values()))}) needs; "
                f'dtypes="device" keeps them {which} on the devices that hold it, where '
                f"{module} refuses them; or {left_out}"
            )
        return f"{device_fix}, or {left_out}"
    mapping = {**(dtypes if isinstance(dtypes, Mapping) else {}), **held}
    pairs = ", ".join(f"{k}: {v}" for k, v in mapping.items())  # torch.float64: ...
    return f"assert_device_agnostic({name}, ..., dtypes={{{pairs}}}), or {left_out}"


def _owned_fix(
    device: torch.device, owned: Sequence[str], held: Mapping[torch.dtype, torch.dtype]
) -> str:
    """The fix for a module's own parameters or buffers of a dtype ``device`` cannot hold:
    make them in one it holds. ``dtypes="device"`` would cast the check's copies and pass,
    while the module itself still fails to move there (``model.to("mps")`` on a Mac)."""
    casts = ", ".join(f"{to} for {dtype}" for dtype, to in held.items())
    to = next(iter(held.values()))
    which = " and ".join(owned)
    return (
        f"make {which} in a dtype {device} holds ({casts}) where the module makes it "
        f"(torch.as_tensor(array, dtype={to}), or .to({to}) before register_buffer): "
        f'moving the module to {device} fails for it too, which dtypes="device" would '
        f"hide, as it casts the check's copies only"
    )


# Why a fix that leaves devices out lists meta (and the CPU, where no device is left),
# which the caller did not list.
_ADDED = (
    "{added} added: a check needs a second device to compare with, and meta compares "
    "structure, dtypes and shapes, not values"
)


def lacking_devices(
    device: torch.device, devices: list[torch.device], dtypes: Iterable[torch.dtype]
) -> list[torch.device]:
    """``device``, then every other device of ``devices`` that cannot hold one of
    ``dtypes``: leaving ``device`` alone out would fail the same way on those."""
    wanted = list(dtypes)
    lacking = [device]
    for other in devices:
        if other not in lacking and not all(CAPABILITIES.holds(other, d) for d in wanted):
            lacking.append(other)
    return lacking


def leave_out(
    device: torch.device, devices: list[torch.device], dtypes: Iterable[torch.dtype] = ()
) -> str:
    """A fix that leaves ``device`` out of ``devices`` (with every device that cannot hold
    one of ``dtypes``, where the failure is a dtype), keeping a second device to compare."""
    gone = lacking_devices(device, devices, dtypes)
    others = [str(d) for d in devices if d not in gone]
    names = " and ".join(str(d) for d in gone)
    if device.type == "meta" and len(set(others)) < 2:
        return _accelerator_for_meta(others)
    if len(others) >= 2 or "meta" in others:
        return f"leave {names} out: devices={others!r}"
    # Where no device is left, the CPU too: every machine has it, and it holds every dtype.
    cpu = [] if others or any(d.type == "cpu" for d in gone) else ["cpu"]
    added = [*cpu, "meta"]
    why = _ADDED.format(added=" and ".join(added))
    return f"leave {names} out: devices={others + added!r} ({why})"


def _accelerator_for_meta(others: list[str]) -> str:
    """The fix that replaces meta where it was the only second device: an accelerator, this
    machine's, else the emulated one (a check of one device against itself finds nothing)."""
    found = [str(d) for d in available_devices() if d.type != "cpu"]
    accelerator = found[0] if found else "emu:0"
    pair = [*others, *(d for d in ("cpu", accelerator) if d not in others)]
    where = "" if found else " under pytest --devicectx-accelerator=emulated"
    return f"check it on an accelerator instead of meta: devices={pair!r}{where}"


def named_arguments(
    fn: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]
) -> list[tuple[str, object]]:
    """Each argument by the name ``fn`` gives it (``args[0]`` where it cannot be told)."""
    named: list[tuple[str, object]] = []
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module) or isinstance(fn, nn.Module):
        named.append(("self", fn if isinstance(fn, nn.Module) else owner))
    try:
        target = fn.forward if isinstance(fn, nn.Module) else fn
        bound = inspect.signature(target).bind(*args, **kwargs)
    except (TypeError, ValueError):
        named += [(f"args[{i}]", value) for i, value in enumerate(args)]
        return named + list(kwargs.items())
    for parameter, value in bound.arguments.items():
        kind = bound.signature.parameters[parameter].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            named += [(f"{parameter}[{i}]", item) for i, item in enumerate(value)]
        elif kind is inspect.Parameter.VAR_KEYWORD:
            named += list(value.items())
        else:
            named.append((parameter, value))
    return named


# Module methods accelerate's dispatch_model replaces on the instance with wrappers that
# hold the original model: kept in a deep copy, they would move the caller's model.
_MOVES = ("to", "cuda", "cpu", "xpu", "npu", "half", "float", "double", "bfloat16", "type")


def _own_methods(copied: nn.Module) -> None:
    """Give a copied module its class's moving methods back, where its instance held others
    (accelerate's ``dispatch_model`` puts a ``.to`` that calls the original's)."""
    for part in copied.modules():
        for name in _MOVES:
            part.__dict__.pop(name, None)


def _refuse_dispatched(module: nn.Module) -> None:
    """Refuse a model accelerate placed with its hooks (``dispatch_model``, a ``device_map``,
    ``cpu_offload``): each hook moves its part's inputs, and loads offloaded weights, to the
    device it names, which a copy moved to each device in turn would not follow.

    Raises:
        TypeError: naming the model, with the fix.
    """
    hooked = next((name for name, part in module.named_modules() if _HOOK in vars(part)), None)
    if hooked is None:
        return
    kind = type(module).__qualname__
    where = f"on its submodule {hooked!r}" if hooked else "on it"
    msg = (
        f"assert_device_agnostic cannot run the {kind} on each device: accelerate placed it "
        f"(a hook {where}, from dispatch_model, a device_map or cpu_offload), and its hooks "
        f"run its parts on devices of their own, which a copy moved to each device would "
        f"not follow\n"
        f"fix: check the model as built, before accelerate places it "
        f"(assert_device_agnostic(fn, model, ...) before dispatch_model(model, ...))"
    )
    raise TypeError(msg)
