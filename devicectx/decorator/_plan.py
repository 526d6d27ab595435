"""What a ``@device_agnostic`` function does at each call: the plan, and the eager call.

Everything that can be worked out once (names of parameters, positions of excluded ones,
whether the function is a generator) is worked out at decoration, in :class:`Plan`; a call
only looks at its arguments. :meth:`Plan.call` is the wrapt wrapper of every decorated
function, and eager: under ``torch.compile`` the layer above,
:mod:`devicectx.decorator._compiled`, gives dynamo a call of its own
(:mod:`devicectx.decorator._wrappers` says how). Where dynamo traces :meth:`Plan.call`
anyway (a generator's call, the fallback), the call goes to :attr:`Plan.when_traced`, which
that layer set: this module imports nothing of it. (The question stays here because wrapt's
C wrapper calls the plan directly: asked a layer above, it would add a Python frame to
every eager call.)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
from torch import nn
from torch.autograd.function import FunctionCtx

from devicectx._errors import DeviceError, DeviceMismatchError
from devicectx._torch.tensors import is_cpu_scalar
from devicectx.decorator import _mismatch, _unseen
from devicectx.decorator._autograd import function_of
from devicectx.decorator._inputs import (
    Held,
    found_devices,
    host_only,
    instance_device,
    optimizer_arguments,
    scan,
    sees_into,
)
from devicectx.decorator._optimizers import (
    left_behind,
    off_target,
    state_left_behind,
    state_off,
)
from devicectx.decorator._params import Params, self_offset
from devicectx.decorator._spread import SpreadModel, Unmaterialised, stand_ins
from devicectx.decorator._target import (
    DeviceOption,
    Placed,
    module_device,
    module_devices,
    module_dtypes,
    module_label,
    placed,
    shared_devices,
    unwrap,
)
from devicectx.devices._capabilities import CAPABILITIES
from devicectx.devices._resolve import DeviceLike
from devicectx.move import _move, _repeats
from devicectx.move._containers import KIND_CACHE, kind_for
from devicectx.move._distributed import fsdp_compute_device, wrapper_name
from devicectx.move._dtypes import DtypesLike, arguments_code, check_dtypes, holds_any
from devicectx.move._kinds import LEAF_KIND, OWN
from devicectx.move._unseen import is_device_mismatch
from devicectx.move._walk import MIXED, NotPlain, plain_device_uncast
from devicectx.scope._precision import (
    Precision,
    PrecisionName,
    check_precision_name,
    choose_precision,
)
from devicectx.scope._resumed import async_resumed, awaited, disable_resume_under_compile, resumed
from devicectx.scope._stack import (
    active_device,
    call_scoped,
    current_device,
    pop_nested,
    push_nested,
)

_Module = nn.Module
_KINDS = KIND_CACHE  # each type's kind: a plain object's instance is a LEAF, looked at no more
# What Plan.call's look at a call's arguments found, handed to Plan.prepare.
_Scanned = tuple[
    torch.device | None, bool, nn.Module | None, tuple[Any, ...] | None, torch.device | None
]
_PRECISION = "precision"  # the key of a call's precision among CAPABILITIES.derived
_Tensor = torch.Tensor
_Device = torch.device
_CPU = torch.device("cpu")  # output="input" where no input is a tensor: the host's data
# Why the target is what it is, where no rule chose it: the tensor arguments agreed on it.
_FROM_INPUTS = "the tensor arguments"
# Why there is no target: none of the rules had anything to read.
_NOTHING_CHOSE = (
    "no device= argument, no nn.Module argument, no tensor argument and no on_device block "
    "to choose one"
)
# Not yet looked for: whether the function is the forward of an autograd.Function.
_UNKNOWN: Any = object()
# True only where dynamo traces the code that calls it (not for code run during a compile).
_is_traced = torch.compiler.is_dynamo_compiling
FUNCTION, GENERATOR, COROUTINE, ASYNC_GENERATOR = range(4)
UNBOUND = object()
"""The instance wrapt passes for a decorated function called unbound: not None (see
:class:`devicectx.decorator._wrappers.DeviceAgnosticWrapper`), read as None."""


def _untraced(*args: Any) -> Any:
    msg = "a Plan is traced only through the wrapper @device_agnostic gives it"
    raise RuntimeError(msg)


def grad_kept() -> bool:
    """Whether a copy made now keeps its source's autograd: not under the caller's
    ``torch.no_grad()``, where ``.to`` gives a tensor that requires no grad."""
    return torch.is_grad_enabled() or torch.is_inference_mode_enabled()


class Plan:
    """What a decorated function does at each call, settled at decoration."""

    __slots__ = (
        "casts",
        "coalesce",
        "defaults",
        "device",
        "dtypes",
        "exclude",
        "forward_of",
        "kind",
        "move",
        "move_fix",
        "name",
        "non_blocking",
        "options",
        "output",
        "params",
        "precision",
        "scope",
        "to_input",
        "traceable",
        "when_traced",
        "where",
        "where_result",
        "written",
    )

    def __init__(
        self,
        wrapped: Callable[..., Any],
        device: DeviceLike = None,
        move: bool = True,
        output: DeviceLike = None,
        exclude: str | Iterable[str] = (),
        non_blocking: bool = False,
        scope: bool = True,
        coalesce: bool = True,
        precision: str | None = None,
        dtypes: DtypesLike = None,
    ) -> None:
        function = getattr(wrapped, "__func__", wrapped)  # classmethod, staticmethod
        self.name: str = getattr(function, "__qualname__", repr(function))
        # As given, to decorate the function again where it is pickled by value.
        self.options: dict[str, Any] = {
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
        named = functools.partial(DeviceOption, owner=self.name)
        self.device = None if device is None else named(device, argument="device")
        self.move = move
        self.to_input = isinstance(output, str) and output == "input"
        self.output = None if output is None or self.to_input else named(output, argument="output")
        self.non_blocking = non_blocking
        self.scope = scope
        self.coalesce = coalesce
        self.precision = None if precision is None else check_precision_name(precision)
        self.params = Params.of(function, self.name)
        # Defaults that hold tensors (class weights as a default argument): a call that
        # leaves one out gets it passed, so that it is moved and checked as if written out.
        defaults = [
            (position, name, value)
            for position, name, value in self.params.defaults
            if next(_move.iter_tensors(value), None) is not None
        ]
        self.defaults = tuple(defaults) or None
        # The places that move, for the repeated-move check: this function's own, whatever
        # its name, and knowing which tensors are its defaults (their fix is the default).
        default_tensors = {
            id(tensor): name
            for _, name, value in defaults
            for _, tensor in _move.iter_tensors(value)
        }
        self.where = _repeats.Place(f"{self.name}()", default_tensors, home=_home(function))
        self.where_result = _repeats.Place(f"{self.name}() -> result")
        mapping = check_dtypes(dtypes)
        if dtypes is not None and not move:
            msg = (
                f"@device_agnostic(dtypes={dtypes!r}, move=False) on {self.name}(): dtypes= "
                f"says what a move does with dtypes, and move=False moves nothing\n"
                f"fix: @device_agnostic(move=False) and cast the inputs yourself, or "
                f"@device_agnostic(dtypes={dtypes!r})"
            )
            raise ValueError(msg)
        self.dtypes = dtypes
        # The decorator's other arguments as code, for the fixes that write it again: a
        # dtype refusal's adds dtypes= to them, a failed move's adds to exclude= (keeping
        # dtypes=): one dropped would change the call.
        others = [
            ("device", device, None),
            ("output", output, None),
            ("non_blocking", non_blocking, False),
            ("scope", scope, True),
            ("coalesce", coalesce, True),
            ("precision", precision, None),
        ]
        self.written = ", ".join(
            arguments_code([*others[:2], ("exclude", exclude or (), ()), *others[2:]])
        )
        # The dtypes an explicit mapping casts wherever the tensors are (on the target too):
        # a call with tensors of these is no fast call.
        self.casts = frozenset(mapping) or None
        names = (exclude,) if isinstance(exclude, str) else tuple(exclude)
        self.exclude = self.params.exclusion(names) if names else None
        kept = arguments_code([*others, ("dtypes", dtypes, None)])
        self.move_fix = _move.exclude_fix(kept, names)
        self.kind = (
            ASYNC_GENERATOR
            if inspect.isasyncgenfunction(function)
            else GENERATOR
            if inspect.isgeneratorfunction(function)
            else COROUTINE
            if inspect.iscoroutinefunction(function)
            else FUNCTION
        )
        # Whether dynamo may trace a call (a plain function), or must run it eagerly.
        self.traceable = self.kind == FUNCTION
        if dtypes is not None:  # the traced move casts nothing: such a call runs eagerly
            self.traceable = False
        if self.kind == GENERATOR:
            disable_resume_under_compile()
        # The call dynamo traces, set by the layer above (decorator._compiled), which knows
        # how; every plan @device_agnostic makes gets one.
        self.when_traced: Callable[..., Any] = _untraced
        self.forward_of: str | None = _UNKNOWN  # the autograd.Function, by function_of

    def call(
        self,
        wrapped: Callable[..., Any],
        instance: object,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """The wrapt wrapper: prepare the arguments, run the body scoped, place the result."""
        __tracebackhide__ = True
        if instance is UNBOUND:
            instance = None
        if self.defaults is not None:
            kwargs = self.with_defaults(wrapped, instance, args, kwargs)
        if _is_traced():  # dynamo traces this call after all (a generator, the fallback)
            return self.when_traced(wrapped, instance, args, kwargs)
        # The common case inline: nothing excluded, every tensor already on the target.
        # Anything else (moves, checks, errors, exclude=) takes prepare(), from scratch.
        option = self.device
        target = (option.fixed or option.resolve()) if option is not None else active_device()
        cast_free = True
        casts = self.casts
        if self.exclude is not None:
            first, uniform, module, optimizers = None, False, None, None
        elif casts is not None:
            # A dtype mapping: the devices and the dtypes to cast looked at together, inline
            # where every argument is a plain tensor on the target (twin of the loop below).
            values = (*args, *kwargs.values()) if kwargs else args
            for value in values:
                if type(value) is not _Tensor or value.device != target or value.dtype in casts:
                    first, uniform, module, optimizers, cast_free = self._scan_casts(
                        values, target, casts
                    )
                    break
            else:
                first, uniform, module, optimizers = (target if values else None), True, None, None
        elif kwargs or not args or target is None:
            first, uniform, module, optimizers = scan(
                (*args, *kwargs.values()) if kwargs else args, target
            )
        else:
            # scan()'s answer where every argument is a plain tensor on the target (a
            # training step's tensors on the accelerator), without its three calls.
            for value in args:
                if type(value) is not _Tensor or value.device != target:
                    first, uniform, module, optimizers = scan(args, target)
                    break
            else:
                first, uniform, module, optimizers = target, True, None, None
        held = None  # an instance that is no module, holding tensors the walk sees
        if instance is not None:
            if isinstance(instance, _Module):
                module = instance
                if optimizers is None:  # a method of the model: an optimizer argument beside it
                    optimizers = optimizer_arguments(args, kwargs)
            elif _KINDS.get(type(instance)) is not LEAF_KIND and sees_into(instance):
                held = instance  # a plain object (a LEAF) costs this call one look-up
        targeted = False
        if module is not None and uniform:
            targeted = True
            requested = target if option is not None else None
            target = self._target(module, requested, wrapped, instance, args, kwargs)
        if held is not None:
            # Checked, never moved: one off the target sends the call to prepare(), which
            # names it. Where nothing chose a target, its tensors count among the inputs.
            expected = target if target is not None else first
            shared = instance_device(held, expected) if uniform else MIXED
            if shared is MIXED:
                uniform = False
                held = None  # prepare() looks (again), by name
            elif target is None and first is None:
                target = shared
        if (
            uniform
            and (first is target or first is None or target is None or first == target)
            and cast_free
        ):
            if target is None:
                target = first
            if optimizers is not None and module is not None and target is not None:
                self._optimizers(optimizers, wrapped, instance, args, kwargs, module, target)
            back = self.output.resolve() if self.output is not None else None
            if self.to_input:
                back = first if first is not None else self._host(args, kwargs)
        else:
            # What the look above found is prepare()'s first step, where it looked at all
            # the arguments (nothing excluded) and chose the target by every rule.
            scanned = None
            if self.exclude is None and casts is None and (module is None or targeted):
                scanned = (first, uniform, module, optimizers, target)
            checked = held is not None  # the instance agreed with the target: no second look
            args, kwargs, target, back = self.prepare(
                wrapped, instance, args, kwargs, scanned, checked
            )
        if self.kind != FUNCTION:
            return self._start(wrapped, instance, args, kwargs, target, back, module)
        try:  # costs nothing where the body returns (Python 3.11's zero-cost try)
            if self.precision is not None:
                result = self._autocast_call(wrapped, args, kwargs, target)
            elif self.scope and target is not None:
                result = call_scoped(target, wrapped, args, kwargs)
            else:
                result = wrapped(*args, **kwargs)
        except RuntimeError as error:
            _repeats.forget(self.where, target)  # a retry of the batch is no repeat
            unseen = self.unseen(error, module, instance, args, kwargs, target, wrapped)
            if unseen is None:
                raise
            raise unseen from error
        except Exception:
            _repeats.forget(self.where, target)
            raise
        return result if back is None else self.place(result, back)

    def with_defaults(
        self,
        wrapped: Callable[..., Any],
        instance: object,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> dict[str, Any]:
        """``kwargs`` with each tensor-holding default the call left out, by keyword."""
        assert self.defaults is not None
        passed = len(args) + self_offset(wrapped, instance)
        added: dict[str, Any] | None = None
        for position, name, value in self.defaults:
            if name in kwargs or (position is not None and position < passed):
                continue
            if added is None:
                added = dict(kwargs)
            added[name] = value
        return kwargs if added is None else added

    def unseen(
        self,
        error: RuntimeError,
        module: nn.Module | None,
        instance: object,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: torch.device | None,
        wrapped: Callable[..., Any],
    ) -> DeviceMismatchError | None:
        """torch's device mismatch in the body, told with the tensors the call could not
        see (:mod:`devicectx.decorator._unseen`); None: let ``error`` through."""
        # Asked first (what explain() asks too): any other error (out of memory, a wrong
        # shape) goes through as it is, without a walk of a large model that could fail.
        if isinstance(error, DeviceError) or not is_device_mismatch(error):
            return None
        offset = self_offset(wrapped, instance)
        named = [(name, value) for name, value, _ in self.params.named(args, kwargs, offset)]
        named += self.params.defaults_taken(args, kwargs, offset)
        if instance is not None:
            named.insert(0, ("self", instance))
        excluded: list[tuple[str, Any]] = []
        if self.exclude is not None:
            excluded = self.params.excluded(self.exclude, args, kwargs, offset)
            if module is None:  # a call with exclude= chose its module in prepare()
                held = Held(self.exclude, args, kwargs, offset)
                module = scan((*held.args, *held.kwargs.values()), target)[2]
        reason = self._reason(module, instance, args, kwargs, offset)
        checked: set[int] = set()
        if module is not None:  # the module the rules read, through its wrappers
            checked.add(id(module))
            checked.update(id(part) for part in unwrap(module).modules())
        follow = reason == _FROM_INPUTS
        if follow and target is None:
            reason = _NOTHING_CHOSE
        mine = instance is not None and not isinstance(instance, _Module)
        return _unseen.explain(
            error,
            self.name,
            named,
            target,
            reason,
            checked,
            follow,
            excluded,
            self.scope,
            wrapped,
            instance=mine,
        )

    def _optimizers(
        self,
        optimizers: tuple[Any, ...],
        wrapped: Callable[..., Any],
        instance: object,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        module: nn.Module,
        target: torch.device,
    ) -> None:
        """Stop a call whose optimizer argument holds parameters that a move replaced
        (:func:`~devicectx.decorator._optimizers.left_behind`); one look per group where
        none does."""
        __tracebackhide__ = True
        behind = state_off(optimizers)
        if not behind and not off_target(optimizers, module, target):
            return
        offset = self_offset(wrapped, instance)
        named = [(name, value) for name, value, _ in self.params.named(args, kwargs, offset)]
        if instance is not None:
            named.insert(0, ("self", instance))
        reason = self._reason(module, instance, args, kwargs, offset)
        error = state_left_behind(self.name, named, target, reason) if behind else None
        if error is None:
            error = left_behind(self.name, named, target, reason)
        if error is not None:
            raise error

    def _autocast_call(
        self,
        wrapped: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: torch.device | None,
    ) -> Any:
        """The body, scoped (unless ``scope=False``), inside the autocast of ``precision=``."""
        __tracebackhide__ = True
        scope = push_nested(target) if self.scope and target is not None else None
        try:
            with self.autocast(target):
                return wrapped(*args, **kwargs)
        finally:
            pop_nested(scope)

    def autocast(self, target: torch.device | None) -> AbstractContextManager[Any]:
        """The autocast the body runs under, for the target (or, with none, the default)."""
        assert self.precision is not None
        device = target if target is not None else current_device()
        # Chosen once per device (a choice costs more than the call): kept with the
        # device's capabilities, and forgotten with them.
        key = (_PRECISION, device, self.precision)
        chosen = CAPABILITIES.derived.get(key)
        if chosen is None:
            chosen = choose_precision(device, cast(PrecisionName, self.precision))
            CAPABILITIES.derived[key] = chosen
        return cast(Precision, chosen).autocast()

    def prepare(
        self,
        wrapped: Callable[..., Any],
        instance: object,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        scanned: _Scanned | None = None,
        checked: bool = False,
    ) -> tuple[tuple[Any, ...], dict[str, Any], torch.device | None, torch.device | None]:
        """Choose the target, then move or check the inputs.

        ``scanned``: what :meth:`call`'s look at the arguments found (their first device,
        whether they agree, the module, the optimizers, and the target its rules chose),
        where it looked at them all; None: look here. ``checked``: :meth:`call` found the
        instance's tensors on that target (an instance :meth:`_instance` checks).

        Returns:
            ``(args, kwargs, target, back)``: the arguments to call with; the target
            (``None`` when no tensor and no rule named one); where the result goes
            (``None``: leave it).
        """
        __tracebackhide__ = True
        offset = self_offset(wrapped, instance)
        held = None if self.exclude is None else Held(self.exclude, args, kwargs, offset)
        seen_args, seen_kwargs = (args, kwargs) if held is None else (held.args, held.kwargs)
        if scanned is not None:
            first, uniform, module, optimizers, target = scanned
        else:
            option = self.device
            # Rules 1 and 3 first, so the scan can test the inputs against a known device.
            target = (option.fixed or option.resolve()) if option is not None else active_device()
            first, uniform, module, optimizers = scan(
                seen_args if not seen_kwargs else (*seen_args, *seen_kwargs.values()), target
            )
            if instance is not None and isinstance(instance, _Module):
                module = instance
                if optimizers is None:  # a method of the model: an optimizer argument beside it
                    optimizers = optimizer_arguments(seen_args, seen_kwargs)
            if module is not None:  # rule 2, between them
                requested = target if option is not None else None
                target = self._target(module, requested, wrapped, instance, args, kwargs)
        home = first
        if not uniform:  # the slow path: which tensors are where, by name
            found = self._found(seen_args, seen_kwargs, offset)
            home = next(iter(found), first)
            if home is None and self.to_input:  # 0-dim CPU tensors alone: they came from there
                seen = (seen_args, seen_kwargs)
                home = next((t.device for _, t in _move.iter_tensors(seen)), None)
            if target is None and len(found) > 1:  # rule 4: the inputs must agree
                raise _mismatch.no_common_device(self.name, found, self.move)
        chosen = target is not None
        if target is None:
            target = home
        if (
            not checked
            and instance is not None
            and not isinstance(instance, _Module)
            and sees_into(instance)
            and not (self.exclude is not None and self.exclude.holds_position(0))
        ):
            target = self._instance(
                instance, target, chosen, module, seen_args, seen_kwargs, offset
            )
        if optimizers is not None and module is not None and target is not None:
            self._optimizers(optimizers, wrapped, instance, seen_args, seen_kwargs, module, target)
        if target is not None and (
            self.casts is not None  # a mapping casts also where nothing moves
            or (chosen and not (uniform and (first is None or first == target)))
        ):
            if self.move:
                # The copies are the decorator's own: under the caller's no_grad they keep
                # autograd, so that a body turning it on sees them as the caller's tensors.
                lend_grad = not grad_kept()
                if lend_grad:  # as in an autograd.Function's forward, which runs without grad
                    self._refuse_in_function(
                        wrapped, module, instance, seen_args, seen_kwargs, offset, target
                    )
                    torch.set_grad_enabled(True)
                try:
                    moved = _move.move_call(
                        seen_args,
                        seen_kwargs,
                        target,
                        names=self.params.positional[offset:],
                        rest=self.params.varargs or "args",
                        non_blocking=self.non_blocking,
                        skip=_Module,
                        coalesce=self.coalesce,
                        where=self.where,
                        dtypes=self.dtypes,
                        parameters=False,  # a loose parameter's gradient reaches the caller's
                        written=self.written,
                        who=f"{self.name}()",
                        fix=self.move_fix,
                    )
                finally:
                    if lend_grad:
                        torch.set_grad_enabled(False)
                args, kwargs = moved if held is None else held.merge(*moved)
            else:
                if uniform:
                    found = self._found(seen_args, seen_kwargs, offset)
                if any(device != target for device in found):
                    reason = self._reason(module, instance, args, kwargs, offset)
                    named = list(self.params.named(seen_args, seen_kwargs, offset))
                    mend = _unseen.own_to_mend(named, target)
                    dtypes = _unseen.argument_dtypes(named)
                    raise _mismatch.tensors_off_target(
                        self.name, found, target, reason, mend, dtypes
                    )
        if self.output is not None:
            return args, kwargs, target, self.output.resolve()
        if self.to_input:
            return args, kwargs, target, home if home is not None else self._host(args, kwargs)
        return args, kwargs, target, None

    @staticmethod
    def _host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
        """Where ``output="input"`` sends a result when no input is a tensor: the CPU where
        every argument is host data (a numpy array from ``env.step``, numbers, the model);
        None (the result stays) where one may hold tensors the look did not see (a plain
        object, an excluded argument's contents)."""
        return _CPU if host_only((*args, *kwargs.values())) else None

    def _refuse_in_function(
        self,
        wrapped: Callable[..., Any],
        module: nn.Module | None,
        instance: object,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        offset: int,
        target: torch.device,
    ) -> None:
        """Refuse to move tensors that require grad in an ``autograd.Function``'s
        ``forward``: its backward would return their gradients on ``target``, and torch
        stops at the first with its "invalid gradient". Tensors that need no gradient move.
        A forward of the ``setup_context`` form gets no move at all: ``setup_context`` is
        given the inputs as passed to ``apply``, so what it saves is not on the target.

        A forward that takes a ctx says so at each call; one of the ``setup_context`` form
        is looked for among the Function classes once, at its first call without grad.
        """
        __tracebackhide__ = True
        code = getattr(wrapped, "__code__", None)
        if code is None:
            return
        first = args[0] if args else None
        set_up = not isinstance(first, FunctionCtx)
        owner = None if set_up else function_of(code, first)
        if set_up and code.co_name == "forward":
            if self.forward_of is _UNKNOWN:
                self.forward_of = function_of(code, None)
            owner = self.forward_of
        if owner is None:
            return
        found: dict[torch.device, list[str]] = {}
        named = list(self.params.named(args, kwargs, offset))
        for name, value, _ in named:
            for path, tensor in _move.iter_tensors(value, name):
                if tensor.device == target:
                    continue
                # A 0-dim CPU tensor saved unmoved mixes with any device; its gradient not.
                if tensor.requires_grad or (set_up and not is_cpu_scalar(tensor)):
                    found.setdefault(tensor.device, []).append(path)
        if found:
            dtypes = _unseen.argument_dtypes(named)
            reason = self._reason(module, instance, args, kwargs, offset)
            raise _mismatch.moved_in_function(
                self.name, owner, found, target, reason, dtypes, set_up=set_up
            )

    def _instance(
        self,
        instance: object,
        target: torch.device | None,
        chosen: bool,
        module: nn.Module | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        offset: int,
    ) -> torch.device | None:
        """Check a method's instance that is no module and holds tensors the walk sees (a
        dataclass, a NamedTuple, ...): the caller's object, never moved, so refused where
        one is off the target (``chosen``: a rule chose it). Where the inputs chose it, or
        none has a tensor, the instance's tensors count among them: they must agree.

        Returns:
            The target: ``target``, or where it is None, the instance's device.
        """
        __tracebackhide__ = True
        shared = instance_device(instance, target)
        if shared is not MIXED:
            return target if target is not None else shared
        mine = found_devices(self.name, [("self", instance, None)], attributes=True)
        if not any(device != target for device in mine):
            return target  # what sent it here is a 0-dim CPU tensor, which mixes
        if not chosen:  # rule 4: the inputs, self first, must agree
            found = {device: list(paths) for device, paths in mine.items()}
            for device, paths in self._found(args, kwargs, offset).items():
                found.setdefault(device, []).extend(paths)
            raise _mismatch.no_common_device(self.name, found, self.move)
        assert target is not None
        own = kind_for(type(instance)).role == OWN
        mend = _unseen.own_to_mend([("self", instance, None)], target) if own else None
        dtypes = _unseen.argument_dtypes([("self", instance, None)]).get("self", set())
        reason = self._reason(module, instance, args, kwargs, offset)
        kind = type(instance).__qualname__
        raise _mismatch.instance_off_target(
            self.name, kind, mine, target, reason, own, self.move, mend, dtypes
        )

    @staticmethod
    def _scan_casts(
        values: tuple[Any, ...], target: torch.device | None, casts: frozenset[torch.dtype]
    ) -> tuple[torch.device | None, bool, nn.Module | None, tuple[Any, ...] | None, bool]:
        """:func:`scan`'s answer, and whether no argument holds a tensor of a dtype in
        ``casts`` (else the call takes prepare(), whose move casts what it must): in one walk
        for plain batches."""
        try:
            return plain_device_uncast(values, casts), True, None, None, True
        except NotPlain:
            first, uniform, module, optimizers = scan(values, target)
            return first, uniform, module, optimizers, not holds_any(values, casts)

    def _target(
        self,
        module: nn.Module,
        requested: torch.device | None,
        wrapped: Callable[..., Any],
        instance: object,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> torch.device | None:
        """Rules 1 to 3 where a module is involved; ``None`` leaves the choice to the inputs.

        ``requested`` is the decorator's ``device=``, already resolved for this call. The
        arguments' names are worked out only for an error (this runs on every forward).
        """
        __tracebackhide__ = True
        target = requested
        device = placed(unwrap(module))
        if device is not None and (
            type(device) is not _Device or (target is not None and device != target)
        ):
            # Not one device's answer (a spread model, an FSDP2 one on meta), or off target.
            return self._not_plain(device, module, target, wrapped, instance, args, kwargs)
        if target is None:
            target = device if device is not None else active_device()
        return target

    def _not_plain(
        self,
        device: Placed,
        module: nn.Module,
        requested: torch.device | None,
        wrapped: Callable[..., Any],
        instance: object,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> torch.device:
        """:meth:`_target` for a module whose answer is not a plain device, or is off
        ``requested``: a spread model's target, or the error that says why there is none."""
        __tracebackhide__ = True
        offset = self_offset(wrapped, instance)
        return self.module_verdict(
            device,
            module,
            requested,
            lambda: self._module_name(module, instance, args, kwargs, offset),
        )

    def module_verdict(
        self,
        device: Placed,
        module: nn.Module,
        requested: torch.device | None,
        name: Callable[[], str],
    ) -> torch.device:
        """The target for ``module`` (placed at ``device``, not one plain device, or off
        ``requested``), or the error that says why there is none; ``name()`` says how the
        call names the module (asked only for an error). The eager and the traced call
        (:mod:`devicectx.decorator._compiled`) both ask it."""
        __tracebackhide__ = True
        option = self.device
        if isinstance(device, SpreadModel):
            strays = device.strays(requested)
            if device.entry is not None and not strays:  # spread on purpose, all in place
                return requested if requested is not None else device.entry
        called = name()
        kind = type(module).__name__
        if isinstance(device, SpreadModel):
            target = requested if requested is not None else device.home(None)
            reason = option.reason() if option is not None else device.rule(called)
            parts = device.parts(requested)
            on_purpose = device.entry is not None
            dtypes = module_dtypes(unwrap(module), called)
            raise _mismatch.spread_strays(
                self.name,
                called,
                kind,
                parts,
                target,
                reason,
                on_purpose,
                device.keyed,
                dtypes,
                stand_ins(unwrap(module)),
            )
        if isinstance(device, Unmaterialised):
            target = requested if requested is not None else device.compute
            reason = option.reason() if option is not None else module_label(module, called)
            resettable = hasattr(unwrap(module), "reset_parameters")
            raise _mismatch.not_materialised(self.name, called, kind, target, reason, resettable)
        # An FSDP2 module moved after fully_shard: its target is where FSDP2 computes.
        compute = fsdp_compute_device(unwrap(module)) if option is None else None
        if option is not None:
            reason = option.reason()
        elif compute is not None:
            reason = module_label(module, called)
        else:
            reason = "a module must be on one device"
        wanted = requested if compute is None else compute
        found = module_devices(unwrap(module), called)
        wrapper = wrapper_name(module)
        dtypes = module_dtypes(unwrap(module), called)
        shared = shared_devices(unwrap(module))
        raise _mismatch.module_off_target(
            self.name, called, kind, found, wanted, reason, wrapper, dtypes, shared
        )

    def _module_name(
        self,
        module: nn.Module,
        instance: object,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        offset: int,
    ) -> str:
        """How the call names ``module``: ``self``, or the parameter it came in."""
        if module is instance:
            return "self"
        for position, value in enumerate(args):
            if value is module:
                return self.params.argument_name(position, offset)
        return next((key for key, value in kwargs.items() if value is module), "module")

    def _reason(
        self,
        module: nn.Module | None,
        instance: object,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        offset: int,
    ) -> str:
        """Why the target is what it is: for messages, so only on the way to an error."""
        if self.device is not None:
            return self.device.reason()
        if module is not None and module_device(unwrap(module)) is not None:
            name = self._module_name(module, instance, args, kwargs, offset)
            return module_label(module, name)
        return "the innermost on_device block" if active_device() is not None else _FROM_INPUTS

    def _found(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], offset: int
    ) -> dict[torch.device, list[str]]:
        """Each device the inputs are on, with the paths of their tensors on it.

        0-dim CPU tensors are left out: PyTorch lets them mix with any device. Where the
        call moves nothing, the attributes of objects with their own ``.to`` are read too.
        """
        named = self.params.named(args, kwargs, offset)
        return found_devices(self.name, named, attributes=not self.move)

    def place(self, result: Any, back: torch.device) -> Any:
        """Move a result (or a yielded item) to where ``output=`` says: copied as ``.to``
        copies, through autograd (a returned parameter's gradient reaches it)."""
        lend_grad = not grad_kept()  # a result the body made under enable_grad keeps its path
        if lend_grad:
            torch.set_grad_enabled(True)
        try:
            return _move.move_to(
                result,
                back,
                non_blocking=self.non_blocking,
                skip=_Module,
                name="result",
                coalesce=self.coalesce,
                where=self.where_result,
                fix=self._result_fix,
                who=f"{self.name}()",
                parameters=False,
            )
        finally:
            if lend_grad:
                torch.set_grad_enabled(False)

    def _result_fix(self, path: str) -> str:
        """The fix of a result that cannot go where ``output=`` sends it (a sparse tensor a
        device cannot copy back): the decorated call's option, not a ``to_device`` one."""
        return (
            f"leave the result where the body made it, @device_agnostic(output=None), and "
            f"move what can move in your code (to_device(result, ..., skip=[{path!r}])); or "
            f"return {path} in a form that copies (a sparse tensor's .to_dense())"
        )

    def _start(
        self,
        wrapped: Callable[..., Any],
        instance: object,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: torch.device | None,
        back: torch.device | None,
        module: nn.Module | None,
    ) -> Any:
        """Call a generator or async function: its body runs later, scoped at each resume;
        torch's device mismatch at a resume is told as a plain call's is."""
        scoped = target if self.scope else None
        enter: Callable[[], Any] = (
            _no_scope if scoped is None else functools.partial(push_nested, scoped)
        )
        leave: Callable[[Any], None] = pop_nested
        if self.precision is not None:
            enter, leave = _with_autocast(enter, functools.partial(self.autocast, target))
        place = None if back is None else functools.partial(self.place, back=back)

        def explain(error: RuntimeError) -> DeviceMismatchError | None:
            return self.unseen(error, module, instance, args, kwargs, target, wrapped)

        inner = wrapped(*args, **kwargs)  # runs none of the body yet
        if self.kind == GENERATOR:
            return resumed(inner, enter, leave, place, explain)
        if self.kind == COROUTINE:
            return awaited(inner, enter, leave, place, explain)
        return async_resumed(inner, enter, leave, place, explain)


def _with_autocast(
    enter_scope: Callable[[], Any], make: Callable[[], AbstractContextManager[Any]]
) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """Enter and leave the scope and an autocast together, at every resume and yield."""

    def enter() -> tuple[Any, AbstractContextManager[Any]]:
        scope = enter_scope()
        amp = make()
        try:
            amp.__enter__()
        except BaseException:
            pop_nested(scope)
            raise
        return scope, amp

    def leave(entered: tuple[Any, AbstractContextManager[Any]]) -> None:
        scope, amp = entered
        try:
            amp.__exit__(None, None, None)
        finally:
            pop_nested(scope)

    return enter, leave


def _home(function: Callable[..., object]) -> tuple[str, int, dict[str, Any]] | None:
    """Where ``function`` is defined (its first decorator's line), with its module's
    globals; None where it has no code of its own (a builtin, a callable object)."""
    unwrapped = inspect.unwrap(function)
    code = getattr(unwrapped, "__code__", None)
    scope = getattr(unwrapped, "__globals__", None)
    if code is None or not isinstance(scope, dict):
        return None
    return code.co_filename, code.co_firstlineno, scope


def _no_scope() -> None:
    """The scope of a call with ``scope=False`` or no target: none."""
