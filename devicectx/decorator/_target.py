"""Which device a ``@device_agnostic`` call runs on: the pieces of the choice.

The rules, the first that applies:

1. the decorator's ``device=`` (:class:`DeviceOption`, resolved at call time);
2. the device of the ``nn.Module`` involved (:func:`involved_module`, :func:`module_device`):
   for a model spread over devices on purpose, where it starts
   (:mod:`devicectx.decorator._spread`);
3. the innermost active ``on_device`` (asked of :mod:`devicectx.scope._stack`);
4. the device the argument tensors agree on (found by the caller, in
   :mod:`devicectx.decorator._plan`).
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Mapping
from itertools import chain
from typing import Any, TypeAlias

import torch
from torch import nn

from devicectx._errors import DeviceUnavailableError, InvalidDeviceError, without_fix
from devicectx._torch.module_tree import buffers_of, children_of, parameters_of, tensors
from devicectx.decorator._module_watch import Mark, ModuleCache, Sample
from devicectx.decorator._spread import SpreadModel, Unmaterialised, analyse
from devicectx.devices._resolve import DeviceLike, explain_device, resolve_device
from devicectx.move._distributed import fsdp_compute_device, fsdp_label
from devicectx.move._hooks import HOOK
from devicectx.move._paths import keyed_modules, module_path

# Their ``.module`` is the model the user wrote; the wrapper adds no parameters of its own.
_PARALLEL_WRAPPERS: tuple[type[nn.Module], ...] = (
    nn.DataParallel,
    nn.parallel.DistributedDataParallel,
)
# Device types whose resolution cannot change while the process runs: no current index.
_INDEXLESS = frozenset({"cpu", "meta"})
_CPU = torch.device("cpu")  # where CPU offload keeps an FSDP2 module's parameters


class DeviceOption:
    """A device spec given to the decorator (``device=`` or ``output=``), resolved per call.

    ``"auto"`` and ``"cuda"`` (no index) can name another device from one call to the next
    (the environment, ``torch.cuda.set_device``), so they are resolved at every call; a
    fully explicit spec (``"cpu"``, ``"meta"``, ``"cuda:1"``) is resolved once, at the
    first call that succeeds, and kept.
    """

    __slots__ = ("fixed", "label", "owner", "spec")

    def __init__(self, spec: DeviceLike, *, argument: str, owner: str = "") -> None:
        self.spec = spec
        shown = f'"{spec}"' if isinstance(spec, (str, torch.device)) else repr(spec)
        self.label = f"@device_agnostic({argument}={shown})"
        self.owner = owner  # the decorated function's name, for an error at a call
        # The resolved device, once it is known not to change; None until then.
        self.fixed: torch.device | None = None
        if _is_fixed(spec):
            # A malformed spec is a bug in the decorating code: say so at import time. An
            # unavailable one may be fine on another machine, so that waits for a call.
            try:
                self.fixed = resolve_device(spec)
            except DeviceUnavailableError:
                pass
            except InvalidDeviceError as error:
                facts = without_fix(error)
                fix = str(error).removeprefix(facts)  # resolve_device's, its last line
                if argument == "output":  # its one value that is no device, maybe mistyped
                    facts += '\noutput= also takes "input": the device the inputs came from'
                    if isinstance(spec, str) and difflib.get_close_matches(spec, ["input"]):
                        fix = '\nfix: output="input"'
                raise InvalidDeviceError(f"{self.label}: {facts}{fix}") from None

    def resolve(self) -> torch.device:
        """The device the spec names now."""
        fixed = self.fixed
        if fixed is not None:
            return fixed
        try:
            device = resolve_device(self.spec)
        except DeviceUnavailableError as error:  # at a call: say whose option it is
            where = f"{self.label} of {self.owner}()" if self.owner else self.label
            raise DeviceUnavailableError(f"{where}: {error}") from None
        if _is_fixed(self.spec):
            self.fixed = device
        return device

    def reason(self) -> str:
        """Why this device, in words, for an error message."""
        if self.spec is None or (isinstance(self.spec, str) and self.spec.strip() == "auto"):
            return f"{self.label}: {explain_device(self.spec).partition(': ')[2]}"
        return self.label


def _is_fixed(spec: DeviceLike) -> bool:
    if isinstance(spec, torch.device):
        return spec.index is not None or spec.type in _INDEXLESS
    if isinstance(spec, int) and not isinstance(spec, bool):
        return spec < 0  # a negative index is malformed: refused at decoration
    if spec is not None and not isinstance(spec, str):
        return True  # no device at all (a float, a bool): refused at decoration
    if spec is None or spec.strip() == "auto":
        return False  # None and "auto" follow the environment
    try:
        parsed = torch.device(spec.strip())
    except RuntimeError:
        return True  # malformed: resolve now, so the InvalidDeviceError comes at decoration
    return parsed.index is not None or parsed.type in _INDEXLESS


def involved_module(
    instance: object, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> tuple[nn.Module, int | str | None] | None:
    """The module a call is about, and where it came from.

    Returns:
        ``(module, where)``: ``where`` is ``None`` for the instance of a decorated method,
        a position in ``args`` or a key of ``kwargs`` for an argument; or ``None`` when no
        module is involved. Parallel wrappers are looked through to the model they hold.
    """
    if isinstance(instance, nn.Module):
        return unwrap(instance), None
    for position, value in enumerate(args):
        if isinstance(value, nn.Module):
            return unwrap(value), position
    for key, value in kwargs.items():
        if isinstance(value, nn.Module):
            return unwrap(value), key
    return None


def unwrap(module: nn.Module) -> nn.Module:
    """The model a parallel wrapper holds (``DataParallel(model)`` -> ``model``)."""
    while isinstance(module, _PARALLEL_WRAPPERS):
        inner = module.module
        assert isinstance(inner, nn.Module)
        module = inner
    return module


class Spread(enum.Enum):
    """What :func:`module_device` returns for a module on several devices by mistake."""

    SPREAD = "spread"


Placed: TypeAlias = "torch.device | Spread | SpreadModel | Unmaterialised | None"


def module_device(module: nn.Module) -> torch.device | Spread | None:
    """The device ``module`` runs on: the one all its parameters and buffers are on, or,
    for a model spread over devices on purpose, where it starts.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> module_device(model)
        device(type='cpu')
        >>> module_device(model[1].to("meta"))
        device(type='meta')
        >>> module_device(model)
        <Spread.SPREAD: 'spread'>

    Returns:
        That device; ``None`` for a module without any; for a model spread on purpose
        (accelerate's hooks, :func:`~devicectx.declare_spread`) the device its inputs go
        to (:mod:`devicectx.decorator._spread` says how it is chosen); ``meta`` for an
        FSDP2 module whose shards are not made yet; ``Spread.SPREAD`` when the tensors are
        on several devices and nothing says why (then :func:`module_devices` names them).

    Cached per module: a call costs the same for any size of module until
    torch reports a change to some module's tensors (a move, a registration), and the
    answer is checked at every call against one of the module's tensors, which catches
    the other ways a whole module changes device. Not noticed until the next move or
    registration of any module: a tensor written around torch's hooks
    (``module._parameters[name] = t``, ``param.data = t`` on another tensor than the one
    checked, ``functional_call`` given only some of the parameters) and deletions
    (``del module.weight``); :mod:`devicectx.decorator._module_watch` has the details.
    """
    found = placed(module)
    if found is None or type(found) is torch.device:
        return found
    if isinstance(found, SpreadModel):
        return found.entry if found.entry is not None else Spread.SPREAD
    if isinstance(found, Unmaterialised):
        return torch.device("meta")
    return found


def _walk(module: nn.Module) -> tuple[torch.device | Spread | None, Sample | None, bool]:
    """:func:`module_device`'s answer, from the tensors themselves, its first tensor, and
    whether accelerate hooked some module of it (met before the walk stopped).

    The walk reads the ``_parameters``, ``_buffers`` and ``_modules`` dicts that
    ``Module.parameters()`` reads, without its generators: three times faster (still about
    time a submodule: see docs/performance.md). The accessors are bound to locals: the walk
    runs at every decorated call that follows a change to some module.
    """
    params_of, bufs_of, kids_of, hook = parameters_of, buffers_of, children_of, HOOK
    found: torch.device | None = None
    sample: Sample | None = None
    hooked = False
    pending = [module]
    seen: set[int] | None = None  # made at the first submodule: a leaf module needs none
    for current in pending:  # grows as children are found: a breadth-first walk
        # A model gathered onto one device may still have a part whose hook runs it on
        # another: its hooks are read (once per change) wherever there are any.
        if hook in current.__dict__:
            hooked = True
        # Parameters and buffers in two loops, not one over both: a fifth faster, and most
        # modules have no buffers.
        for tensor in params_of(current).values():
            if tensor is not None:
                device = tensor.device
                if found is None:
                    found, sample = device, Sample(current, False, tensor, device)
                elif device != found:
                    return Spread.SPREAD, sample, hooked
        buffers = bufs_of(current)
        if buffers:
            for buffer in buffers.values():
                if buffer is not None:
                    device = buffer.device
                    if found is None:
                        found, sample = device, Sample(current, True, buffer, device)
                    elif device != found:
                        return Spread.SPREAD, sample, hooked
        children = kids_of(current)
        if children:
            if seen is None:
                seen = {id(module)}
            for child in children.values():
                if child is not None and id(child) not in seen:
                    seen.add(id(child))
                    pending.append(child)
    return found, sample, hooked


def _walk_placed(module: nn.Module) -> tuple[Placed, Sample | None]:
    """:func:`_walk`, and what its answer means where it is not one device's.

    An FSDP2 module's answer is where it computes (the device fully_shard fixed), which
    differs from where its parameters sit under CPU offload; one whose shards are all still
    on ``meta`` is :class:`~devicectx.decorator._spread.Unmaterialised`; one wholly on
    another device than those two (moved after fully_shard) is ``Spread.SPREAD``, a
    mistake the call refuses. A module on several devices, on ``meta``, or with
    accelerate's hooks is analysed (:func:`~devicectx.decorator._spread.analyse`): on
    purpose, or a mistake. One wholly on a device where its hooks run every part of it is
    a module on that device like any other.
    """
    found, sample, hooked = _walk(module)
    if found is None:
        return found, sample
    compute = fsdp_compute_device(module)
    if compute is not None:
        if found is not Spread.SPREAD and found.type == "meta" and compute.type != "meta":
            return Unmaterialised(compute), sample
        if found is not Spread.SPREAD:
            # Off its compute device and not offloaded: moved after fully_shard, a mistake.
            return (compute if found in (compute, _CPU) else Spread.SPREAD), sample
        if _offloaded(module, compute):
            return compute, sample
    if found is Spread.SPREAD or found.type == "meta" or hooked:
        analysed = analyse(module, on_one_device=found is not Spread.SPREAD)
        if analysed is not None and not _hooked_in_place(analysed, found):
            return analysed, _marked(sample, module, analysed)
    return found, sample


def _marked(sample: Sample | None, module: nn.Module, analysed: SpreadModel) -> Sample | None:
    """``sample``, and the hook that says where a dispatched model starts: removed
    (``remove_hook_from_module``, which tells torch nothing), the answer is stale."""
    if sample is None or analysed.kind != "accelerate":
        return sample
    first = module.get_submodule(analysed.first) if analysed.first else module
    return sample._replace(mark=Mark(first, HOOK, first.__dict__.get(HOOK)))


def _hooked_in_place(analysed: SpreadModel, found: torch.device | Spread) -> bool:
    """Whether a module wholly on ``found`` (not ``meta``) starts there and its hooks run
    every part of it there: nothing to say beyond that device."""
    return (
        found is not Spread.SPREAD
        and found.type != "meta"
        and analysed.entry == found
        and not analysed.strays(None)
    )


def _offloaded(module: nn.Module, compute: torch.device) -> bool:
    """Whether an FSDP2 module on two devices is CPU-offloaded, as ``fully_shard`` places
    one: its parameters on the CPU (or the compute device), its buffers on the compute
    device (offload keeps the sharded parameters alone on the CPU)."""
    cpu = torch.device("cpu")
    return all(buffer.device == compute for buffer in module.buffers()) and all(
        param.device in (compute, cpu) for param in module.parameters()
    )


placed: ModuleCache[Placed] = ModuleCache(_walk_placed)
"""What :func:`module_device` reads, cached: a device, ``None``, or, for a module that is
neither empty nor wholly on one device, the record that says why (the decorator's slow path
reads it)."""
_devices = placed


def module_devices(module: nn.Module, name: str) -> dict[torch.device, list[str]]:
    """Each device holding some of ``module``'s tensors, with their paths (``model.fc[0].weight``).

    For error messages only: a module wholly on one device is listed by ``name`` alone.
    """
    found: dict[torch.device, list[str]] = {}
    keyed = keyed_modules(module.named_modules())
    named = chain(module.named_parameters(), module.named_buffers())
    for path, tensor in named:
        found.setdefault(tensor.device, []).append(module_path(name, path, keyed))
    if len(found) == 1:
        return {device: [name] for device in found}
    return found


def module_dtypes(module: nn.Module, name: str) -> tuple[tuple[str, torch.dtype], ...]:
    """Each of ``module``'s tensors by path, with its dtype: for a fix that casts what the
    target cannot hold before moving the module (error messages only)."""
    keyed = keyed_modules(module.named_modules())
    named = chain(module.named_parameters(), module.named_buffers())
    return tuple((module_path(name, path, keyed), tensor.dtype) for path, tensor in named)


def shared_devices(module: nn.Module) -> tuple[torch.device, ...]:
    """The devices of the tensors ``module`` holds at several places (a tied weight: an
    embedding and the output head of a language model), each once: where ``module.to``
    would give each place a copy of its own, the fix moves it with ``to_device`` (error
    messages only)."""
    met: set[int] = set()
    found: dict[torch.device, None] = {}
    for _, tensor in tensors(module):
        if id(tensor) in met:
            found[tensor.device] = None
        met.add(id(tensor))
    return tuple(found)


def module_label(module: nn.Module, name: str) -> str:
    """``model (Linear)``: how a message names the module a target came from."""
    fsdp = fsdp_label(unwrap(module), name)
    if fsdp is not None:
        return fsdp
    found = placed(unwrap(module))
    if isinstance(found, SpreadModel):
        return found.rule(name)
    return f"the parameters of {name} ({type(module).__name__})"
