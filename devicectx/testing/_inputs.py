"""One device's inputs for ``assert_device_agnostic``: its own copies of the modules in
the call, the tensors moved (and cast, as ``dtypes=`` says), the caller's objects untouched."""

from __future__ import annotations

import copy
import inspect
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from devicectx._errors import DtypeUnsupportedError
from devicectx.devices._capabilities import nearest_dtype
from devicectx.move._containers import CONTAINER, MODULE, kind_for
from devicectx.move._dtypes import DtypesLike, policy_for
from devicectx.move._move import iter_tensors, move_call
from devicectx.testing._sets import Holds


def holds_for(dtypes: DtypesLike, device: torch.device) -> Holds:
    """What ``device`` holds of each dtype it cannot hold, where ``dtypes="device"`` cast
    the inputs to it; nothing elsewhere (a mapping casts on every device alike)."""
    if not (isinstance(dtypes, str) and dtypes == "device"):
        return {}
    policy = policy_for(dtypes, device)
    return {} if policy is None else policy.cast


def name_of(fn: object) -> str:
    qualname = getattr(fn, "__qualname__", None)
    if not isinstance(qualname, str):
        qualname = type(fn).__qualname__
    # A function defined in a test reads better as `scale` than `test_x.<locals>.scale`.
    return qualname.rpartition("<locals>.")[2]


def inputs_for(
    device: torch.device,
    fn: Callable[..., object],
    args: tuple[object, ...],
    kwargs: dict[str, object],
    dtypes: DtypesLike,
    devices: list[torch.device],
) -> tuple[Callable[..., object], tuple[object, ...], dict[str, object]]:
    """``fn``, ``args`` and ``kwargs`` for one run on ``device``, leaving the caller's alone."""
    __tracebackhide__ = True
    policy = policy_for(dtypes, device)
    if policy is not None and policy.missing:
        _refuse_dtypes(device, policy.missing, fn, args, kwargs, dtypes, devices)
    copies = _Copies(device, {} if policy is None else policy.cast)
    call_fn = copies.of_callable(fn)
    call_args: tuple[object, ...] = copies.within(args)
    call_kwargs: dict[str, object] = copies.within(kwargs)
    # Moved as one structure, so a tensor passed twice stays one tensor.
    # The same inputs go to each device on purpose: no repeated-move warning.
    try:
        moved_args, moved_kwargs = move_call(
            call_args,
            call_kwargs,
            device,
            check_repeats=False,
            who=f"assert_device_agnostic({name_of(fn)})",
            dtypes=dtypes,
        )
    except DtypeUnsupportedError as error:
        # Only where the look above missed a tensor (one the move finds in an object of
        # its own): the move's fix is written for @device_agnostic.
        lines = str(error).splitlines()[:-1]
        fix = _dtype_fix(device, error.paths, name_of(fn), dtypes, devices)
        msg = "\n".join([*lines, f"fix: {fix}"])
        raise DtypeUnsupportedError(msg, device=device, paths=error.paths) from None
    return call_fn, moved_args, moved_kwargs


class _Copies:
    """One device's copies of the modules in a call, each module copied once (a module
    passed twice, or shared by two, stays one), in containers rebuilt around them.

    ``to_device`` moves a module in place; a copy keeps the caller's model where it is, and
    intact (moving to meta drops the weights; on a backend registered out of tree the move
    puts new parameters in the caller's model).
    """

    def __init__(self, device: torch.device, cast: Mapping[torch.dtype, torch.dtype]) -> None:
        self.device = device
        self.cast = cast
        self.memo: dict[int, Any] = {}  # deepcopy's: modules that share parts keep sharing
        self.done: dict[int, Any] = {}  # id(original) -> what stands in for it

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
        """``obj`` with each module in it, at any depth of containers, a copy."""
        done = self.done.get(id(obj))
        if done is not None:
            return done
        kind = kind_for(type(obj))
        if kind.role == MODULE:
            return self.module(obj)
        if kind.role != CONTAINER or kind.split is None or kind.rebuild is None:
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
                    f"assert_device_agnostic copies each nn.Module in the arguments to each "
                    f"device; a {kept} holding one cannot be rebuilt around the copy: "
                    f"{type(error).__name__}: {error}\n"
                    f"fix: pass the module as an argument of its own: "
                    f"assert_device_agnostic(fn, model, ...)"
                )
                raise TypeError(msg) from error
        self.done[id(obj)] = result
        return result

    def module(self, module: nn.Module) -> nn.Module:
        done = self.done.get(id(module))
        if done is None:
            done = self.done[id(module)] = self._copy(module)
        copied: nn.Module = done
        return copied

    def _copy(self, module: nn.Module) -> nn.Module:
        try:
            copied = copy.deepcopy(module, self.memo)
            if self.cast:
                _cast(copied, self.cast)
            return copied.to(self.device)
        except Exception as error:
            kind = type(module).__qualname__
            msg = (
                f"assert_device_agnostic copies each nn.Module argument to each device; "
                f"copying the {kind} to {self.device} failed: {type(error).__name__}: {error}\n"
                f"fix: make the module deep-copyable, or create it inside fn"
            )
            raise TypeError(msg) from error


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
    count = 0
    for name, value in named_arguments(fn, args, kwargs):
        for path, tensor in iter_tensors(value, name, modules=True):
            if tensor.dtype in missing:
                paths.setdefault(tensor.dtype, []).append(path)
                count += 1
    if not paths:
        return
    width = max(len(str(dtype)) for dtype in paths)
    what = "a tensor" if count == 1 else f"{count} tensors"
    lines = [
        f"assert_device_agnostic({name_of(fn)}) cannot move {what} to {device}, which holds "
        f"no {' or '.join(str(dtype) for dtype in paths)}:",
        *(f"    {dtype!s:<{width}} <- {', '.join(p)}" for dtype, p in paths.items()),
        f"fix: {_dtype_fix(device, paths, name_of(fn), dtypes, devices)}",
    ]
    raise DtypeUnsupportedError("\n".join(lines), device=device, paths=paths)


def _dtype_fix(
    device: torch.device,
    paths: dict[torch.dtype, list[str]],
    name: str,
    dtypes: DtypesLike,
    devices: list[torch.device],
) -> str:
    others = [str(d) for d in devices if d != device]
    if len(others) < 2 and "meta" not in others:
        others.append("meta")
    leave_out = f"leave {device} out: devices={others!r}"
    nearest = {dtype: nearest_dtype(device, dtype) for dtype in paths}
    held = {dtype: to for dtype, to in nearest.items() if to is not None}
    if len(held) < len(nearest):
        return leave_out
    if dtypes is None:
        casts = ", ".join(f"{dtype} to {to}" for dtype, to in held.items())
        return (
            f'assert_device_agnostic({name}, ..., dtypes="device"), which casts {casts} on '
            f"{device} only, or {leave_out}"
        )
    mapping = {**(dtypes if isinstance(dtypes, Mapping) else {}), **held}
    pairs = ", ".join(f"{k}: {v}" for k, v in mapping.items())  # torch.float64: ...
    return f"assert_device_agnostic({name}, ..., dtypes={{{pairs}}}), or {leave_out}"


def named_arguments(
    fn: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]
) -> list[tuple[str, object]]:
    """Each argument by the name ``fn`` gives it (``args[0]`` where it cannot be told)."""
    named: list[tuple[str, object]] = []
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module) or isinstance(fn, nn.Module):
        named.append(("self", fn if isinstance(fn, nn.Module) else owner))
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
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
