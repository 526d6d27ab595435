"""Modules spread over several devices: on purpose (accelerate, a declared split) or by mistake.

A module whose tensors sit on several devices is one of three things:

- **dispatched by accelerate** (``dispatch_model``, ``cpu_offload``, ``disk_offload``, and
  transformers' ``from_pretrained(device_map=...)``, which calls it): each part carries an
  ``AlignDevicesHook`` that moves the activations to the part's *execution device*, and
  an offloaded part keeps its weights on ``meta`` until its hook loads them. The model
  starts where its top-level hook runs; a tensor is in place where the hook of its nearest
  hooked module (itself or an ancestor) runs, or on ``meta`` behind an offloading hook.
  A tied weight (one tensor held by several modules) is in place where the hook of every
  module holding it accepts it: accelerate moves none of it per call (an offloaded one is
  loaded by each hook), so a device map that splits it fails in torch, and is named here.
- **declared** by the user with :func:`declare_spread` (a hand-made pipeline split): any
  tensor under the declared module is in place; it starts on ``inputs=``, else where its
  first parameter is.
- **a mistake**: nothing of the above. Its home is where most of its parameter elements
  are (or the decorator's ``device=``), and the strays are the largest submodules off it.

:func:`analyse` reads all of that once, into a :class:`SpreadModel` that
:mod:`devicectx.decorator._target` caches per module (until torch reports a move or a
registration, as for any module); the call then costs what a module on one device costs.

accelerate is never imported: its hooks are read by duck typing, from the attribute
``_hf_hook`` accelerate sets on each hooked module (``AlignDevicesHook.execution_device``
and ``.offload``; a ``SequentialHook``'s ``.hooks``), as in accelerate 0.20 to 1.15. A
model gathered onto one device after dispatch is read too: its hooks may still run a part
on another device, which torch would refuse inside the hook.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import NamedTuple

import torch
from torch import nn

from devicectx._torch.module_tree import buffers_of, submodules, tensors
from devicectx.decorator._module_watch import note_change
from devicectx.devices._resolve import DeviceLike, resolve_device
from devicectx.move._hooks import HOOK, runs_on
from devicectx.move._paths import keyed_modules, module_path, within

__all__ = [
    "Cover",
    "Part",
    "SpreadModel",
    "Unmaterialised",
    "analyse",
    "declare_spread",
    "hooked_elsewhere",
    "marked",
    "module_placement",
    "path_of",
]

# Where declare_spread writes its declaration, in the module's __dict__: an attribute of
# the module, so it goes wherever the module goes (deepcopy, pickle, a spawned process).
DECLARED = "_devicectx_spread"
_CPU = torch.device("cpu")
_META = "meta"


class Cover(NamedTuple):
    """What says a module's tensors may be where they are: a hook of accelerate, or a
    declaration.

    Attributes:
        path: the module's qualified name inside the analysed module (``""``: itself).
        runs_on: where an accelerate hook runs the module; a declaration's ``inputs=``
            (``None`` when it named none).
        offload: the hook keeps the module's weights off the device (on ``meta``).
        declared: from :func:`declare_spread`, which allows any device.
    """

    path: str
    runs_on: torch.device | None
    offload: bool
    declared: bool

    def accepts(self, device: torch.device) -> bool:
        """Whether a tensor on ``device`` under this cover is where it should be."""
        if self.declared:
            return True
        return device == self.runs_on or (self.offload and device.type == _META)


class _Place(NamedTuple):
    """One place a tensor is held at, judged."""

    path: str  # qualified name: "body.0.weight"
    owner: str  # its module's qualified name: "body.0"
    cover: Cover | None  # the nearest cover of the owner (None: nothing covers it)
    accepted: bool  # that cover accepts the tensor where it is


class _Seen(NamedTuple):
    """One tensor of the analysed module, judged at every place it is held (a tied weight
    has several), in registration order."""

    device: torch.device
    numel: int
    places: tuple[_Place, ...]
    buffer: bool = False  # a buffer of its module, not a parameter

    @property
    def path(self) -> str:
        return self.places[0].path

    @property
    def owner(self) -> str:
        return self.places[0].owner


class Part(NamedTuple):
    """A submodule (or a lone tensor) wholly on one device, as a message lists it.

    Attributes:
        path: qualified name inside the analysed module (``""``: the module itself).
        device: where its weights are kept (``cpu`` for weights accelerate offloaded).
        runs_on: where it computes (its hook's execution device), else ``device``.
        expected: for a stray, the device it should be on; else ``None``.
        hooked: for a stray, whether a hook of accelerate says where it runs (else the
            device the model starts on does).
        owner: the module whose ``.to()`` moves it (``path`` itself for a submodule).
        tied: for a stray, the modules that hold its weight too, in place there (a tied
            weight a device map split): moving it would move theirs.
        shared: some tensor of it is held at several places of the analysed module (a
            tied weight): ``module.to()`` may give each place a copy of its own.
        buffers: its tensors are all buffers, none a parameter.
    """

    path: str
    device: torch.device
    runs_on: torch.device
    expected: torch.device | None
    hooked: bool
    owner: str
    tied: tuple[str, ...] = ()
    shared: bool = False
    buffers: bool = False


class SpreadModel:
    """A module on several devices (or on ``meta`` behind accelerate's hooks), analysed.

    Attributes:
        entry: where the inputs go (the device the module starts on); ``None`` for a
            split nothing declares (a mistake).
        kind: ``"accelerate"``, ``"declared"`` or ``"mistake"``: what made it.
        first: the qualified name of what chose ``entry``: the hooked submodule, or the
            first parameter of a declared module (``""``: the top-level hook, or
            ``inputs=``).
        keyed: the qualified names of its ``ModuleDict`` and ``ParameterDict`` modules,
            to write paths with (:func:`path_of`): the module itself is not kept.
    """

    __slots__ = ("_on_purpose_strays", "entry", "first", "keyed", "kind", "kind_name", "seen")

    def __init__(
        self,
        entry: torch.device | None,
        kind: str,
        first: str,
        kind_name: str,
        seen: tuple[_Seen, ...],
        keyed: tuple[str, ...] = (),
    ) -> None:
        self.entry = entry
        self.kind = kind
        self.first = first
        self.kind_name = kind_name  # the class name of the module, for messages
        self.seen = seen
        self.keyed = keyed
        self._on_purpose_strays: tuple[Part, ...] | None = None

    def home(self, requested: torch.device | None) -> torch.device:
        """The device tensors nothing covers should be on: the entry where the split is
        on purpose, else ``requested`` (``device=``), else the device with most elements."""
        if self.entry is not None:
            return self.entry
        if requested is not None:
            return requested
        return self.majority()[0]

    def majority(self) -> tuple[torch.device, int, int]:
        """The device holding most parameter and buffer elements (the first met on a tie),
        with its count and the total."""
        counts: dict[torch.device, int] = {}
        for seen in self.seen:
            counts[seen.device] = counts.get(seen.device, 0) + seen.numel
        best = max(counts, key=counts.__getitem__)  # max keeps the first of equals
        return best, counts[best], sum(counts.values())

    def strays(self, requested: torch.device | None) -> tuple[Part, ...]:
        """The largest submodules (or lone tensors) off the device they should be on."""
        if self.entry is not None:
            if self._on_purpose_strays is None:  # the same at every call: kept
                self._on_purpose_strays = tuple(
                    part for part in self.parts(requested) if part.expected is not None
                )
            return self._on_purpose_strays
        return tuple(part for part in self.parts(requested) if part.expected is not None)

    def parts(self, requested: torch.device | None = None) -> list[Part]:
        """Every part, in registration order: the largest submodules whose tensors share
        one placement, and the tensors of a module whose own tensors do not."""
        home = self.home(requested)
        signature: dict[str, set[_Signature]] = {}
        direct: dict[str, list[str]] = {}
        tensors: dict[str, _Signature] = {}
        tied: dict[str, set[str]] = {}  # a stray's (and its ancestors') holders in place
        shared: set[str] = set()  # parts holding a tensor held at several places
        parameters: set[str] = set()  # parts holding a parameter
        for seen in self.seen:
            judged = [(place, _signature(seen.device, place, home)) for place in seen.places]
            in_place = [place.owner for place, sign in judged if sign.expected is None]
            several = len(seen.places) > 1
            for place, sign in judged:  # listed at each place it is held, as find_devices does
                owner = place.owner
                tensors[place.path] = sign
                direct.setdefault(owner, []).append(place.path)
                for ancestor in _ancestors(owner):
                    signature.setdefault(ancestor, set()).add(sign)
                marked = (place.path, *_ancestors(owner))
                if several:
                    shared.update(marked)
                if not seen.buffer:
                    parameters.update(marked)
                if sign.expected is not None and in_place:  # a tied weight split
                    for ancestor in (place.path, *_ancestors(owner)):
                        tied.setdefault(ancestor, set()).update(
                            other for other in in_place if not within(other, ancestor)
                        )
        children: dict[str, list[str]] = {}
        for path in signature:
            if path:
                children.setdefault(_parent(path), []).append(path)
        found: list[Part] = []
        pending = [""]
        while pending:
            path = pending.pop()
            placements = signature[path]
            if len(placements) == 1:
                found.append(
                    Part(
                        path,
                        *next(iter(placements)),
                        path,
                        _sorted(tied.get(path)),
                        path in shared,
                        path not in parameters,
                    )
                )
                continue
            for tensor in direct.get(path, ()):
                found.append(
                    Part(
                        tensor,
                        *tensors[tensor],
                        path,
                        _sorted(tied.get(tensor)),
                        tensor in shared,
                        tensor not in parameters,
                    )
                )
            pending.extend(reversed(children.get(path, [])))
        return found

    def placement(self, name: str) -> dict[torch.device, list[str]]:
        """Each device weights are kept on, with the parts there (as ``hf_device_map``);
        the device the model starts on first."""
        found: dict[torch.device, list[str]] = {} if self.entry is None else {self.entry: []}
        for part in self.parts():
            found.setdefault(part.device, []).append(path_of(name, part.path, self.keyed))
        return {device: paths for device, paths in found.items() if paths}

    def devices(self) -> list[torch.device]:
        """The devices weights are kept on, in the order met."""
        return list(dict.fromkeys(_kept(seen.device, seen.places[0]) for seen in self.seen))

    def rule(self, name: str) -> str:
        """Why the inputs go to :attr:`entry`, in words: the rule that chose the target."""
        what = f"{name} ({self.kind_name}), spread over {_listed(self.devices())}"
        if self.kind == "accelerate":
            if not self.first:
                return f"{what} by accelerate: where its top-level hook runs it"
            first = path_of(name, self.first, self.keyed)
            return f"{what} by accelerate: where {first}'s hook, its first hooked part, runs it"
        if self.kind == "declared":
            if not self.first:
                return f'{what} on purpose: declare_spread({name}, inputs="{self.entry}")'
            first = path_of(name, self.first, self.keyed)
            return f"{what} on purpose (declare_spread): where its first parameter, {first}, is"
        _, count, total = self.majority()
        return (
            f"the device holding the largest share of {name} ({self.kind_name})'s parameter "
            f"and buffer elements, {count:,} of {total:,}; nothing says it is spread on "
            "purpose: no accelerate hook, no declare_spread"
        )


class Unmaterialised(NamedTuple):
    """An FSDP2 module whose shards are all still on ``meta``: built under
    ``on_device("meta")`` and sharded before its tensors were made."""

    compute: torch.device  # where it will compute: its mesh's device


class _Signature(NamedTuple):
    """What a part's tensors share (:class:`Part`'s fields of the same names)."""

    device: torch.device
    runs_on: torch.device
    expected: torch.device | None  # None where the tensor is in place
    hooked: bool


def _signature(device: torch.device, place: _Place, home: torch.device) -> _Signature:
    """``(kept on, runs on, expected, hooked)``: what a part shares, for a tensor on
    ``device`` at ``place``; ``expected`` is None where the tensor is in place there."""
    cover = place.cover
    if cover is not None and place.accepted:
        runs = cover.runs_on if not cover.declared and cover.runs_on is not None else device
        return _Signature(_kept(device, place), runs, None, False)
    hooked = cover is not None and not cover.declared and cover.runs_on is not None
    expected = cover.runs_on if hooked and cover is not None else home
    if device == expected:
        return _Signature(device, device, None, False)
    return _Signature(device, device, expected, hooked)


def _kept(device: torch.device, place: _Place) -> torch.device:
    """Where a tensor's weights are: accelerate keeps an offloaded one on the CPU (in
    memory, or memory-mapped from disk), and leaves ``meta`` in the module."""
    cover = place.cover
    if cover is not None and cover.offload and device.type == _META:
        return _CPU
    return device


def _sorted(paths: set[str] | None) -> tuple[str, ...]:
    return tuple(sorted(paths)) if paths else ()


def _ancestors(owner: str) -> Iterator[str]:
    """``"a.b"``, ``"a"``, ``""``."""
    path = owner
    while path:
        yield path
        path = _parent(path)
    yield ""


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _listed(devices: list[torch.device]) -> str:
    count = f"{len(devices)} device{'s' if len(devices) != 1 else ''}"
    return f"{count} ({', '.join(str(device) for device in devices)})"


def path_of(name: str, qualified: str, keyed: Collection[str] = ()) -> str:
    """``model.h[0].attn`` for ``h.0.attn`` under ``model``; ``model`` for ``""``;
    ``keyed`` as :func:`~devicectx.move._paths.module_path` reads it."""
    return module_path(name, qualified, keyed) if qualified else name


# Reading the module.


def stand_ins(module: nn.Module) -> dict[str, torch.device]:
    """Plain tensors where ``module`` keeps its parameters, by qualified name, with their
    devices: put there for one call in place of the module's own (``torch.func.
    functional_call`` swaps a dict's tensors in so), not parameters a ``.to()`` would
    move. For messages only: it reads every parameter.

    Example:
        >>> from torch.func import functional_call
        >>> class Probe(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = nn.Linear(2, 2)
        ...     def forward(self, x):
        ...         return stand_ins(self)
        >>> functional_call(Probe(), {"lin.weight": torch.ones(2, 2, device="meta")}, (1,))
        {'lin.weight': device(type='meta')}
    """
    return {
        name: tensor.device
        for name, tensor in module.named_parameters(remove_duplicate=False)
        if not isinstance(tensor, nn.Parameter)
    }


def _hook_cover(path: str, module: nn.Module) -> Cover | None:
    """The cover of accelerate's hook on ``module``; None without one that places it."""
    placed = runs_on(module)
    return None if placed is None else Cover(path, placed[0], placed[1], False)


def _covers(module: nn.Module) -> dict[str, Cover]:
    """Every module under ``module`` (itself included) that a hook or a declaration
    covers, by qualified name, in registration order."""
    found: dict[str, Cover] = {}
    for path, child in submodules(module):
        attributes = child.__dict__
        if DECLARED in attributes:
            found[path] = Cover(path, attributes[DECLARED], False, True)
            continue
        cover = _hook_cover(path, child)
        if cover is not None:
            found[path] = cover
    return found


def analyse(module: nn.Module, *, on_one_device: bool = False) -> SpreadModel | None:
    """What the spread of ``module`` means; ``None`` where nothing covers any part of it
    and its tensors are on one device (``meta``, say): nothing to say beyond that device.

    ``on_one_device``: the caller found every tensor on one device, so that without a
    cover nothing is to say, and no tensor is read (a model behind hooks that place
    nothing, ``cpu_offload_with_hook``'s, moved by them at each forward).
    """
    covers = _covers(module)
    if on_one_device and not covers:
        return None
    named: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for path, tensor in tensors(module):
        named.setdefault(id(tensor), []).append((path, tensor))
    buffers = {
        id(buffer)
        for _, part in submodules(module)
        for buffer in buffers_of(part).values()
        if buffer is not None
    }
    seen: list[_Seen] = []
    for key, places in named.items():
        seen.append(_judge(places, covers, key in buffers))
    devices = {entry.device for entry in seen}
    if not seen or (not covers and len(devices) <= 1):
        return None
    entry, kind, first = _entry(module, covers, seen)
    keyed = keyed_modules(submodules(module, each_place=True))  # as tensors() walks
    return SpreadModel(entry, kind, first, type(module).__name__, tuple(seen), keyed)


def _judge(
    places: list[tuple[str, torch.Tensor]], covers: dict[str, Cover], buffer: bool = False
) -> _Seen:
    """One tensor, judged at each place it is held by the nearest cover of that place."""
    tensor = places[0][1]
    device = tensor.device
    judged = []
    for path, _ in places:
        owner = _parent(path)
        cover = next((covers[a] for a in _ancestors(owner) if a in covers), None)
        judged.append(_Place(path, owner, cover, cover is not None and cover.accepts(device)))
    return _Seen(device, tensor.numel(), tuple(judged), buffer)


def _entry(
    module: nn.Module, covers: dict[str, Cover], seen: list[_Seen]
) -> tuple[torch.device | None, str, str]:
    """Where the inputs go, what made the split, and the part that chose it."""
    top = covers.get("")
    if top is not None:
        if not top.declared:
            return top.runs_on, "accelerate", ""
        if top.runs_on is not None:
            return top.runs_on, "declared", ""
        first = seen[0]  # its first parameter (or buffer), in registration order
        return first.device, "declared", first.path
    for path, cover in covers.items():  # the first covered part, in registration order
        if cover.runs_on is not None:
            return cover.runs_on, "declared" if cover.declared else "accelerate", path
        for entry in seen:  # a declared part without inputs=: its first tensor
            if entry.owner == path or entry.owner.startswith(f"{path}."):
                return entry.device, "declared", entry.path
    return None, "mistake", ""


def marked(module: nn.Module) -> bool:
    """Whether a hook of accelerate or a declaration covers any part of ``module``: the look
    a traced call takes (dynamo traces it), where eager code takes :func:`analyse`."""
    for part in module.modules():
        attributes = part.__dict__
        if HOOK in attributes or DECLARED in attributes:
            return True
    return False


def hooked_elsewhere(module: nn.Module, device: torch.device) -> bool:
    """Whether accelerate's hook runs a part of ``module`` (all of whose tensors are on
    ``device``) elsewhere: a dispatched model gathered onto one device, whose hooks would
    send that part its inputs on the other. A look a traced call takes (dynamo traces it),
    as :func:`marked`; eager code takes :func:`analyse`. ``dispatch_model`` hooks the
    model it places, so a module with no hook of its own is taken for none: one look (and
    one guard of dynamo's) at each call of a model on one device."""
    if HOOK not in module.__dict__:
        return False
    for part in module.modules():
        placed = runs_on(part)
        if placed is not None and placed[0] != device:
            return True
    return False


# The public face.


def declare_spread(module: nn.Module, *, inputs: DeviceLike = None) -> nn.Module:
    """Declare that ``module`` is spread over several devices on purpose (a hand-made split).

    ``@device_agnostic`` then runs calls involving the module, sending their inputs to
    where it starts, instead of refusing it as a split made by mistake. Models dispatched
    by accelerate or loaded by transformers with a ``device_map`` need no declaration:
    their hooks say it.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from devicectx import declare_spread, device_agnostic
        >>> class Split(nn.Module):  # a stage on each device; the second one on meta
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.first = nn.Linear(2, 2)
        ...         self.second = nn.Linear(2, 2, device="meta")
        ...     def forward(self, x):
        ...         return self.second(self.first(x).to("meta"))
        >>> model = declare_spread(Split())
        >>> @device_agnostic
        ... def step(model, x):
        ...     return model(x)
        >>> step(model, torch.ones(2)).device
        device(type='meta')

    Args:
        module: the model (or a submodule: then only its own split is declared).
        inputs: where its inputs go, any :func:`~devicectx.resolve_device` spec, resolved
            now; ``None``: the device of its first parameter (in registration order).

    Returns:
        ``module`` itself, declared (an attribute of the module: deep copies and pickles
        keep it).

    Caveats:
        A declared module is trusted: none of its tensors is reported as a stray. Moved
        wholly onto one device, it is a module on that device like any other.
    """
    device = None if inputs is None else resolve_device(inputs)
    object.__setattr__(module, DECLARED, device)  # a plain attribute, not a registration
    note_change(module)  # cached answers about this module are stale
    return module


def module_placement(module: nn.Module, name: str = "model") -> dict[torch.device, list[str]]:
    """Each device ``module``'s weights are on, with the submodules there (as
    ``hf_device_map`` groups them): the spread at a glance.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
        >>> module_placement(model)
        {device(type='cpu'): ['model[0]'], device(type='meta'): ['model[1]']}
        >>> module_placement(model.to("meta"))
        {device(type='meta'): ['model']}

    Args:
        module: any module.
        name: how the paths start.

    Returns:
        ``{device: [path, ...]}``: the largest submodules wholly on each device (a
        tensor's own path where its module's tensors are on several), in registration
        order; for a model spread on purpose, the device it starts on first (where
        ``@device_agnostic`` sends its inputs). Weights accelerate offloaded are listed
        under ``cpu``, where it keeps them (``find_devices`` lists them on ``meta``, as the
        module holds them); a module wholly on one device is listed by ``name`` alone; a
        module without tensors gives ``{}``.
    """
    analysed = analyse(module)
    if analysed is not None:
        return analysed.placement(name)
    for _, tensor in tensors(module):
        return {tensor.device: [name]}
    return {}
