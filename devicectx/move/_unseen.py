"""Tensors the move engine cannot see: held in attributes of plain objects.

The engine looks into containers it knows (:mod:`devicectx.move._containers`) and leaves
every other object as it is, unmoved and unchecked; an object with a ``.to`` of its own and
no children a rule reads, it moves with that ``.to``, trusting it, and never checks. Where
torch then fails with a device mismatch, :func:`unseen_tensors` looks into the attributes
of those objects (``__dict__`` and ``__slots__``, a few levels deep), into the plain tensor
attributes of modules (a tensor set as ``self.scale = ...``, not registered as a buffer,
which ``module.to`` does not move), and at the tensors their classes hold (``table =
torch.ones(2)`` in a class body, one tensor every instance shares), so that the error can
name them. It runs on the failure path only: a call that succeeds never takes it.

Example:
    >>> import torch
    >>> class Config:
    ...     def __init__(self):
    ...         self.scale = torch.ones(2, device="meta")
    >>> [(u.path, str(u.device), u.holder.__name__) for u in unseen_tensors([("cfg", Config())])]
    [('cfg.scale', 'meta', 'Config')]
"""

from __future__ import annotations

import re
import sys
from collections.abc import Collection, Iterable, Sequence
from itertools import chain
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.optim import Optimizer

from devicectx._errors import with_article
from devicectx._torch.module_tree import submodules
from devicectx._torch.module_tree import tensors as module_tensors
from devicectx.move._attributes import slot_names
from devicectx.move._containers import is_plain_leaf, kind_for
from devicectx.move._kinds import CONTAINER, LEAF, MODULE, OWN, TENSOR, only_atoms
from devicectx.move._own_to import shallow_copy
from devicectx.move._paths import ATTR, ITEM, join, keyed_modules, module_path

# The two devices named by torch's mismatch errors: the dispatcher's, a kernel's check, and
# the argument check of newer releases.
_TWO_DEVICES = re.compile(
    r"found at least two devices, (?P<a>[\w:]+) and (?P<b>[\w:]+)!"
    r"|Tensor on device (?P<c>[\w:]+) is not on the expected device (?P<d>[\w:]+)!"
    r"|but got \w+ is on (?P<e>[\w:]+), different from other tensors on (?P<f>[\w:]+)"
)
# torch's words for tensors on different devices, across its releases and backends.
_MISMATCH_WORDS = (
    "Expected all tensors to be on the same device",
    "is not on the expected device",
    "Expected object of device type",
    "but expected it to be on",
    "found at least two devices",
    "should be either on cpu or on the same device",
    "expected to be in the same device",  # index_add_, index_copy_, ...
    # The _foreach ops of optimizers (their default on an accelerator); the same words for
    # a dtype mismatch, which the look then finds no tensor off the device for.
    "Tensors of the same index must be on the same device",
)
# Bounds of the look: an argument's object graph can be large (a model's config holding a
# tokenizer), and the look must stay quick even on the failure path.
_MAX_OBJECTS = 512
_MAX_DEPTH = 4
# What an nn.Module keeps in its __dict__ for itself: not the user's attributes.
# What a module's own state holds, and accelerate's hook (``_hf_hook``): the tensors a hook
# keeps (offloaded weights, the copies of a tied weight per device) are accelerate's, put
# in place by the hook at each call; no move of the caller's reaches them.
_MODULE_STATE = frozenset(vars(nn.Module())) | {"_hf_hook"}
# Packages whose classes hold no tensor of the user's in their bodies.
_NOT_USERS = frozenset({"builtins", "torch"})
_MISSING = object()


class Unseen(NamedTuple):
    """A tensor the engine cannot see, where it is, and the object that holds it."""

    path: str
    """Its path from the argument: ``cfg.scale``, ``self.offset``."""
    device: torch.device
    holder: type
    """The type of the object whose attribute holds it (the nearest plain object, or the
    module whose plain attribute it is)."""
    holder_path: str
    """The path of that object: ``cfg``, ``self``."""
    module: type | None = None
    """For a whole module that nothing checked (held by a plain object, or not read by the
    decorator's rules), with parameters or buffers on ``device``: its type; else None."""
    holders: tuple[tuple[type, str], ...] = ()
    """Each object whose attributes the path goes through, outermost first, with its path,
    ending with ``holder``: what a walk must be taught to enter, from the argument (or the
    module whose plain attribute starts it) down."""
    shared_by: type | None = None
    """For a class attribute (reached as ``self.table``, held in a class body): the class
    that holds it, one tensor for every instance; else None."""
    tied: bool = False
    """For a whole module: whether it holds a tensor at several places (a tied weight),
    which ``module.to`` unties off the devices where torch keeps parameter objects."""
    own: object = None
    """The outermost object on the path with a ``.to`` of its own whose attributes were
    read (no rule reads its children), for a fix that tries that ``.to``; else None."""


def is_device_mismatch(error: BaseException) -> bool:
    """Whether ``error`` is torch's complaint about tensors on different devices."""
    if not isinstance(error, RuntimeError):
        return False
    text = str(error)
    return any(words in text for words in _MISMATCH_WORDS)


def mismatched_devices(error: BaseException) -> tuple[torch.device, torch.device] | None:
    """The two devices torch's mismatch error names (the dispatcher's "found at least two
    devices, A and B", a kernel's "Tensor on device A is not on the expected device B");
    None where its words name no two."""
    found = _TWO_DEVICES.search(str(error))
    if found is None:
        return None
    first, second = next(
        found.group(one, other)
        for one, other in (("a", "b"), ("c", "d"), ("e", "f"))
        if found[one] is not None
    )
    try:
        return torch.device(first), torch.device(second)
    except RuntimeError:
        return None


def stray_device(error: BaseException, device: torch.device) -> torch.device | None:
    """The device torch's mismatch error names beside ``device`` (the one a call ran
    for); None where its words do not name exactly one other."""
    pair = mismatched_devices(error)
    others = [] if pair is None else [d for d in pair if d != device]
    return others[0] if len(others) == 1 else None


def stored_device_fix(path: str) -> str:
    """The fix for a tensor put off the device by a ``torch.device`` stored at ``path``
    (``self.device``) when its object was built."""
    return (
        f"read the device where the tensors are made, from the inputs (device=x.device) or "
        f"the module's parameters (next(self.parameters()).device), not {path}: model.to() "
        f"moves a module's tensors, not a device it stored when it was built"
    )


def stored_devices(named: Iterable[tuple[str, Any]], stray: torch.device) -> list[str]:
    """The paths of ``torch.device`` attributes that put a tensor on ``stray``, in the
    modules (and their submodules) and the plain objects of ``named`` arguments
    (``self.device``): a device stored when they were built, which ``model.to`` leaves.
    ``cuda`` without an index counts for ``cuda:0``, the current device unless set."""
    paths: list[str] = []
    for name, value in named:
        holders = (
            [(module_path(name, sub) if sub else name, m) for sub, m in submodules(value)]
            if isinstance(value, nn.Module)
            else [(name, value)]
        )
        for path, holder in holders:
            attributes = getattr(holder, "__dict__", None)
            if not isinstance(attributes, dict):
                continue
            paths += [
                f"{path}.{attribute}"
                for attribute, held in attributes.items()
                if isinstance(held, torch.device)
                and (held == stray or (held.index is None and held.type == stray.type))
            ]
    return paths


def unseen_tensors(
    named: Iterable[tuple[str, Any]], checked: Collection[int] | None = None
) -> list[Unseen]:
    """Every tensor below ``named`` arguments that the move engine does not see, in order.

    An object with a ``.to`` of its own and no children a rule reads is looked into as a
    plain object is, by its attributes: the engine trusts its ``.to``, which may not have
    run (``move=False``) or may have left them where they were. Those whose children a
    rule reads (a TensorDict, a ``BatchEncoding``, torch_geometric's ``Data``) are not:
    the engine checks what their ``.to`` did.

    A module held by a plain object is unseen as a whole: one entry per device its
    parameters and buffers are on, and those tensors are not listed again where something
    else holds them too (an optimizer's ``param_groups``). A tensor in a class body is
    listed once, at the first instance met: every instance reads the same one.

    Args:
        named: ``(name, value)`` for each argument (``("self", model)`` for a method).
        checked: the ids of the modules whose devices the caller checked (the decorator's
            module rule reads one); any other module argument, or module in a container,
            is then unseen as a whole too. None: every module reached through arguments
            and containers counts as seen (a move moves it).

    Bounded: at most a few hundred objects, a few attribute levels below the argument.
    """
    found: list[Unseen] = []
    ids: list[int] = []  # each found entry's tensor (0 for a whole module)
    owned: set[int] = set()  # the tensors of the modules listed whole
    covered: set[int] = set()  # those modules and their submodules
    seen: set[int] = set()
    shared: set[tuple[type, str]] = set()  # the class attributes named (once, not per instance)
    held: dict[type, list[tuple[str, torch.Tensor, type]]] = {}  # per type, for this look
    stack = [_Step(value, name, 0, ()) for name, value in reversed(list(named))]
    budget = _MAX_OBJECTS
    while stack and budget > 0:
        value, path, depth, holders, shared_by, own = stack.pop()
        kind = kind_for(type(value))
        role = kind.role
        if role == TENSOR:
            if shared_by is not None:
                name = path.rpartition(".")[2]
                if (shared_by, name) in shared:
                    continue
                shared.add((shared_by, name))
            if holders:
                if value.dim() == 0 and value.is_cpu and issubclass(holders[0][0], Optimizer):
                    # An optimizer's 0-dim CPU tensors (Adam's `step` counters): torch keeps
                    # them there on purpose, and its kernels take CPU scalars on any device.
                    continue
                holder, holder_path = holders[-1]
                found.append(
                    Unseen(
                        path, value.device, holder, holder_path, None, holders, shared_by, own=own
                    )
                )
                ids.append(id(value))
            continue
        if role == LEAF and is_plain_leaf(type(value)):
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        budget -= 1
        children: Sequence[_Step]
        if role == MODULE:
            unchecked = bool(holders) or (checked is not None and id(value) not in checked)
            if unchecked and id(value) not in covered:
                owner = holders[-1] if holders else (type(value), path)
                tied = _ties(value)
                for device, tensors in _by_device(value).items():
                    found.append(
                        Unseen(path, device, owner[0], owner[1], type(value), holders, None, tied)
                    )
                    ids.append(0)
                    owned.update(tensors)
                covered.update(id(module) for module in value.modules())
            children = _module_children(value, path, depth, held)
        elif role == CONTAINER and kind.split is not None:
            keys, values = kind.split(value)
            if (type(values) is list or type(values) is tuple) and only_atoms(values):
                values = ()  # a million token ids: nothing to look at, and no path to write
            keys = range(len(values)) if keys is None or not values else keys
            children = [
                _Step(child, join(path, kind.style, key), depth, holders, None, own)
                for key, child in zip(keys, values, strict=True)
            ]
            state = getattr(value, "__dict__", None)
            if kind.style == ITEM and state and depth < _MAX_DEPTH:
                # A dict or list subclass's attributes (a collate_fn's batch.mask): the
                # move takes its entries only, and leaves these where they are.
                here = (*holders, (type(value), path))
                children += [
                    _Step(child, join(path, ATTR, name), depth + 1, here, None, own)
                    for name, child in state.items()
                ]
        elif (role == LEAF or (role == OWN and kind.split is None)) and depth < _MAX_DEPTH:
            here = (*holders, (type(value), path))
            if own is None and role == OWN:
                own = value
            children = [
                _Step(child, join(path, ATTR, name), depth + 1, here, by, own)
                for name, child, by in _attributes(value, held)
            ]
        else:  # too deep, or an own .to whose work the engine checks through its children
            continue
        stack.extend(reversed(children))
    return [item for item, tensor in zip(found, ids, strict=True) if tensor not in owned]


class _Step(NamedTuple):
    """An object for the look to visit: where it is, and what holds it."""

    value: Any
    path: str
    depth: int
    """Attribute levels below the argument."""
    holders: tuple[tuple[type, str], ...]
    """The objects whose attributes led here, outermost first (:attr:`Unseen.holders`)."""
    shared_by: type | None = None
    """The class holding ``value`` in its body, for a class attribute."""
    own: object = None
    """:attr:`Unseen.own` for what is found below."""


def _by_device(module: nn.Module) -> dict[torch.device, set[int]]:
    """The ids of a module's parameters and buffers, by device."""
    devices: dict[torch.device, set[int]] = {}
    for tensor in chain(module.parameters(), module.buffers()):
        devices.setdefault(tensor.device, set()).add(id(tensor))
    return devices


def _module_children(
    module: nn.Module, path: str, depth: int, held: dict[type, list[tuple[str, torch.Tensor, type]]]
) -> list[_Step]:
    """A module's plain attributes and the tensors its class holds (``module.to`` moves
    neither), then its submodules. Parameters and buffers are seen: they are not listed."""
    here = ((type(module), path),)
    state = vars(module)
    children: list[_Step] = []
    if depth < _MAX_DEPTH:
        pairs: list[tuple[str, Any, type | None]] = [
            (name, value, None) for name, value in state.items() if name not in _MODULE_STATE
        ]
        pairs += _class_tensors(type(module), state, held)
        children = [
            _Step(value, join(path, ATTR, name), depth + 1, here, by) for name, value, by in pairs
        ]
    # Written as find_devices writes them (model.enc[0]), so that a fix names code that runs.
    keyed = keyed_modules([("", module)])  # a ModuleDict's children are its keys
    children += [
        _Step(child, module_path(path, name, keyed), depth, ())
        for name, child in module.named_children()
    ]
    return children


def _attributes(
    obj: object, held: dict[type, list[tuple[str, torch.Tensor, type]]]
) -> list[tuple[str, Any, type | None]]:
    """An object's attributes: its ``__dict__``, then its ``__slots__`` that are set, then
    the tensors its class holds; with the class holding each, for those."""
    state = getattr(obj, "__dict__", None)
    pairs = list(state.items()) if isinstance(state, dict) else []
    for name in slot_names(type(obj)):
        try:
            value = object.__getattribute__(obj, name)
        except AttributeError:  # a slot never set
            continue
        pairs.append((name, value))
    own: list[tuple[str, Any, type | None]] = [
        (name, value, None) for name, value in pairs if isinstance(name, str)
    ]
    return own + _class_tensors(type(obj), {name for name, _, _ in own}, held)


def _class_tensors(
    tp: type, own: Collection[str], held: dict[type, list[tuple[str, torch.Tensor, type]]]
) -> list[tuple[str, Any, type | None]]:
    """The tensors in the class bodies of ``tp``'s MRO that an instance reads as its own
    attributes (not where ``own``, the instance's attributes, or a class before shadows
    them), with the class holding each. torch's classes (``nn.Module``) hold none of the
    user's; ``held`` keeps each type's answer for the rest of the look."""
    tensors = held.get(tp)
    if tensors is None:
        tensors = []
        names: set[str] = set()
        for klass in tp.__mro__:
            mine = str(getattr(klass, "__module__", "")).partition(".")[0] not in _NOT_USERS
            for name, value in vars(klass).items():
                if name not in names and mine and isinstance(value, torch.Tensor):
                    tensors.append((name, value, klass))
                names.add(name)
        held[tp] = tensors
    return [(name, value, klass) for name, value, klass in tensors if name not in own]


def _ties(module: nn.Module) -> bool:
    """Whether ``module`` holds a parameter or buffer at several places (a tied weight)."""
    every = [id(tensor) for _, tensor in module_tensors(module)]
    return len(set(every)) < len(every)


def optimizer_state_fix(name: str, kind: str, paths: Sequence[str], failed: bool = False) -> str:
    """The fix for the state of the optimizer ``name`` (a ``kind``) off its parameters'
    devices, ``paths`` those of its tensors off the CPU: reloaded, as torch puts it.
    ``failed``: told after torch's step failed on it, which may have changed the state
    already (a momentum scaled, a counter counted, weights decayed), so the fix says so.

    Its state follows its parameters only when loaded; a container registered for it would
    move the state into a copy at every call, and the updates would be lost.
    """
    fix = (
        f"{name}.load_state_dict({name}.state_dict()) once the model is on its device "
        f"(torch puts an optimizer's state on its parameters' devices as it loads it), or "
        f"build the {kind} after moving the model"
    )
    if any(path.endswith("['step']") for path in paths):
        # Made on a device by a step run under a scope (a decorated training step):
        # load_state_dict leaves a step counter where it is, unless capturable or fused.
        fix += (
            f"; then its step counters, which load_state_dict leaves where they are, "
            f"back to the CPU: for s in {name}.state.values(): "
            f's["step"] = s["step"].cpu() (not with capturable=True or fused=True)'
        )
    if failed:
        fix += (
            "; the failed step may have changed the state already (a momentum scaled, a "
            "counter counted, weights decayed): where that matters, load it from your last "
            "checkpoint instead"
        )
    return fix


def fix_for(
    unseen: Sequence[Unseen],
    target: torch.device | None = None,
    follow: bool = True,
    argument: bool = True,
    own_to: bool = True,
) -> str:
    """The ``fix:`` text for tensors the engine cannot see (those under the first one's
    outermost holder).

    For a whole module: where the target was chosen (``follow`` False: a device named, a
    block, the module rule), the module goes to it; where the inputs chose it, the call
    names the module's device, or takes the module as an argument so that the inputs follow.
    For tensors in plain objects: every type the walk must be taught to reach them, from
    the argument's own down, since it enters a type only where it knows its parent, and
    down to an object with a ``.to`` of its own only, which moves the rest. For tensors in
    such an object: its ``.to``, tried on a shallow copy as a move tries it, either moves
    them, and the fix calls it, or leaves them, and the fix says how to write it.
    ``argument`` False: the tensors are no call's arguments (a prefetched batch), and the
    fix does not offer passing one as an argument. ``own_to`` False: the fix for plain
    objects does not offer a ``.to`` of their own (which a move calls, but a walk that
    compares does not look through).
    """
    first = unseen[0]
    if first.module is not None:
        if target is not None and not follow:
            if first.tied:  # module.to may give each place of a tied weight its own copy
                return (
                    f'to_device({first.path}, "{target}") before the call, which keeps its '
                    f"tied weights tied ({first.path}.to() can untie them): modules are "
                    "never moved implicitly"
                )
            return (
                f'{first.path}.to("{target}") before the call: modules are never moved implicitly'
            )
        named = f'@device_agnostic(device="{first.device}")'
        if (
            target is None
            and first.holder_path == "self"
            and not issubclass(first.holder, nn.Module)
        ):
            # A method of an object holding its network, given no tensor (an RL agent's
            # act(obs) on a numpy array): as a module, its submodule chooses the target.
            kind = first.holder.__name__
            return (
                f"make {kind} an nn.Module (class {kind}(nn.Module), super().__init__() "
                f"first in its __init__), so that {first.path} chooses the target, or {named}"
            )
        return (
            f"{named}, or pass {first.path} as the first module argument, so that the "
            "inputs follow it"
        )
    holders = first.holders or ((first.holder, first.holder_path),)
    root, root_path = holders[0]
    if issubclass(root, nn.Module):
        return _buffer_fix(first, root, root_path, unseen)
    # An optimizer's state, held by the argument or by an object in it (a trainer's
    # self.optimizer): no container taught to the walk would reach it.
    held = next(((tp, at) for tp, at in holders if issubclass(tp, Optimizer)), None)
    if held is not None:
        counters = [u.path for u in unseen if u.device.type != "cpu"]
        return optimizer_state_fix(held[1], held[0].__qualname__, counters, failed=True)
    if _moves_itself(root):
        return _own_fix(first, root, root_path, unseen, target)
    # Held by a dict or list subclass's attribute, which the move does not take (nor would a
    # container taught to the walk in its place keep its entries): keep it as an entry.
    entries = next(((tp, at) for tp, at in holders if _holds_entries(tp)), None)
    if entries is not None:
        tp, at = entries
        name = attribute_of(first.path[len(at) + 1 :])
        kind = with_article(tp.__qualname__)
        entry = (
            f"keep it as an entry, {at}[{name!r}] (the move takes {kind}'s entries, not its "
            f"attributes)"
            if issubclass(tp, dict)
            else f"keep {at}.{name} out of the {tp.__qualname__} (the move takes its items, "
            f"not its attributes)"
        )
        return f"{entry}, or pass {first.path} as an argument" if argument else entry
    group = [
        u
        for u in unseen
        if u.module is None and (u.holders or ((u.holder, u.holder_path),))[0][1] == root_path
    ]
    children: dict[type, list[str]] = {}
    for u in group:
        chain = u.holders or ((u.holder, u.holder_path),)
        below = [path for _, path in chain[1:]] + [u.path]
        # The walk hands an object with a .to of its own to that .to: taught to reach it,
        # it needs no more.
        cut = next((i for i, (tp, _) in enumerate(chain) if _moves_itself(tp)), len(chain))
        for (tp, at), inner in zip(chain[:cut], below[:cut], strict=True):
            names = children.setdefault(tp, [])
            name = attribute_of(inner[len(at) + 1 :])
            if name not in names:
                names.append(name)
    calls = "; ".join(register_call(tp, names) for tp, names in children.items())
    passed = f", pass {first.path} as an argument" if len(group) == 1 and argument else ""
    imports = "import copy, torch" if any(_in_torch(tp) for tp in children) else "import copy"
    taught = f"{imports}; from devicectx import register_container; {calls}{passed}"
    return f"{taught}, or give {root.__qualname__} a .to(device) method" if own_to else taught


def _holds_entries(tp: type) -> bool:
    """Whether the move takes ``tp``'s entries or items and none of its attributes (a
    dict or list subclass)."""
    kind = kind_for(tp)
    return kind.role == CONTAINER and kind.style == ITEM


def _in_torch(tp: type) -> bool:
    return tp.__module__ == "torch" or tp.__module__.startswith("torch.")


def importable_class(tp: type) -> type:
    """``tp``, or where code cannot name it (a class made at run time, as torch_geometric
    makes ``DataBatch``) the nearest class above it that code can: registering that one
    reaches ``tp`` too, since registrations hold for subclasses.

    Example:
        >>> Made = type("Made", (dict,), {"__module__": "abc"})
        >>> importable_class(Made), importable_class(dict)
        (<class 'dict'>, <class 'dict'>)
    """
    for klass in tp.__mro__[:-1]:  # object, last, would name every class
        found: object = sys.modules.get(klass.__module__)
        for part in klass.__qualname__.split("."):
            found = getattr(found, part, None)
        if found is klass:
            return klass
    return tp


# Python's own containers, which the walk takes apart by itself: a fix never registers one
# for a subclass's sake, since the registration would change how every one is walked.
_PYTHONS_OWN = ("builtins", "collections")


def registrable_class(tp: type) -> type:
    """The class a ``register_container`` fix names for ``tp``: :func:`importable_class`,
    or ``tp`` itself where that is one of Python's own containers (a ``tuple`` subclass
    made at run time): registering ``tuple`` would change how every tuple is walked.

    Example:
        >>> Made = type("Made", (dict,), {"__module__": "abc"})
        >>> registrable_class(Made) is Made
        True
    """
    named = importable_class(tp)
    return tp if named is not tp and named.__module__ in _PYTHONS_OWN else named


def class_path(tp: type) -> str:
    """How code names ``tp``: its name, or for one of torch's types, the shortest public
    path to it (``torch.distributions.Categorical``), which needs only ``import torch``.

    Example:
        >>> from torch.distributions import Categorical
        >>> class Config: ...
        >>> class_path(Categorical), class_path(Config)
        ('torch.distributions.Categorical', 'Config')
    """
    if not _in_torch(tp):
        return tp.__qualname__
    parts = tp.__module__.split(".")
    top = tp.__qualname__.split(".")[0]  # the class at the module's top that holds tp
    outer = getattr(sys.modules[tp.__module__], top, None)
    for end in range(1, len(parts)):
        prefix = ".".join(parts[:end])
        if getattr(sys.modules.get(prefix), top, None) is outer:
            return f"{prefix}.{tp.__qualname__}"
    return f"{tp.__module__}.{tp.__qualname__}"


def register_call(tp: type, names: Sequence[str]) -> str:
    """The ``register_container`` call that teaches the walk ``tp`` through its attributes
    ``names``, runnable as written (after ``import copy``, and ``import torch`` for one of
    torch's types): its rebuild sets the moved children on a shallow copy, which keeps
    every other attribute, as a plain object's copy needs."""
    listed = ", ".join(f'("{name}", obj.{name})' for name in names)
    # A type with a __setattr__ of its own (a frozen attrs class or pydantic model refuses
    # any) is set past it, as such classes set their own fields.
    own = vars(object)["__setattr__"]  # as the type holds it, unbound
    setter = "setattr" if getattr(tp, "__setattr__", own) is own else "object.__setattr__"
    sets = "".join(f', {setter}(clone, "{name}", new[{i}])' for i, name in enumerate(names))
    return (
        f"register_container({class_path(registrable_class(tp))}, "
        f"children=lambda obj: [{listed}], "
        f"rebuild=lambda obj, new: (clone := copy.copy(obj){sets})[0])"
    )


def _moves_itself(tp: type) -> bool:
    """Whether objects of ``tp`` are moved by a ``.to`` of their own, with no children a
    rule reads: the look reads their attributes."""
    kind = kind_for(tp)
    return kind.role == OWN and kind.split is None


# Where no target was chosen, the own .to is tried on meta: no memory, no copy.
_TRIED_ON = torch.device("meta")
# The tensors an own .to left named in a fix, in statements written for them.
_MAX_STATEMENTS = 4


def _own_fix(
    first: Unseen, root: type, at: str, unseen: Sequence[Unseen], target: torch.device | None
) -> str:
    """The fix for tensors in an object with its own ``.to`` (at ``at``, an argument or
    inside one): call it where it moves them, else write it so that it does."""
    written = _own_to_written(first, root, at, unseen, target)
    if written is not None:
        return written
    device = f'"{target}"' if target is not None else "device"
    argument = attribute_of(at)  # the argument it is in
    if argument == at:
        call, what = f"{at} = {at}.to({device})", "what it holds"
    else:
        call, what = f"{argument} = to_device({argument}, {device})", at
    name = root.__qualname__
    return f"{call} before the call ({name}.to moves {what}, and nothing called it for this call)"


def own_to_fix(unseen: Sequence[Unseen], target: torch.device) -> str | None:
    """For tensors in an object with its own ``.to`` that leaves them behind (the first
    such object's): the fix that says how to write that ``.to``; None where it moves them
    (then moving the object is the fix) or where no tensor is in such an object."""
    first = next((u for u in unseen if u.own is not None and u.holders), None)
    if first is None:
        return None
    root, at = first.holders[0]
    return _own_to_written(first, root, at, unseen, target)


def _own_to_written(
    first: Unseen, root: type, at: str, unseen: Sequence[Unseen], target: torch.device | None
) -> str | None:
    """How to write ``root``'s ``.to`` so that it moves the tensors it leaves (those under
    ``at``), tried on a shallow copy; None where it leaves none."""
    group = [u for u in unseen if u.module is None and u.holders and u.holders[0][1] == at]
    left = _left_by_own_to(first.own, at, target or _TRIED_ON)
    name = root.__qualname__
    stayed = [u for u in group if left is not None and u.path in left]
    if not stayed:
        return None
    paths = ", ".join(u.path for u in stayed)
    devices = ", ".join(dict.fromkeys(str(u.device) for u in stayed))
    places = [u.path[len(at) :] for u in stayed if u.path.startswith(at)]
    statements = "; ".join(f"self{p} = self{p}.to(device)" for p in places[:_MAX_STATEMENTS])
    more = len(places) - _MAX_STATEMENTS
    if more > 0:
        statements = f"{statements} (and likewise {more} more)"
    return (
        f"{name}.to left {paths} on {devices} (tensor.to returns a moved copy and moves "
        f"nothing in place): in {name}.to, {statements}, then return self (or return a new "
        f"{name} holding the moved tensors)"
    )


def _left_by_own_to(own: object, at: str, device: torch.device) -> set[str] | None:
    """The paths of the tensors that ``own``'s ``.to(device)`` leaves off ``device``, tried
    on a shallow copy as a move tries it (the caller's object is not changed); None where
    it raises. On the failure path only."""
    copied = shallow_copy(own)
    try:
        result = copied.to(device)
    except Exception:  # its own error: not this fix's to report
        return None
    if result is None:  # a .to that moves in place and returns nothing
        result = copied
    return {u.path for u in unseen_tensors([(at, result)]) if u.device != device}


def _buffer_fix(first: Unseen, module: type, at: str, unseen: Sequence[Unseen]) -> str:
    """The fix for a tensor a module's ``.to`` does not move: a buffer of the module.

    Non-persistent: the tensor was never in the module's ``state_dict``, and a persistent
    buffer would make ``load_state_dict`` of every checkpoint saved before miss it.
    """
    if first.holder is not module:  # in a plain object that a plain attribute holds
        name = attribute_of(first.path[len(first.holder_path) + 1 :])
        return (
            f'self.register_buffer("{name}", ..., persistent=False) in '
            f"{module.__qualname__}.__init__, read as self.{name}, not "
            f"{_read(first.path, at)[0]}, so that {at}.to(...) moves it "
            f"(.to does not look into plain attributes)"
        )
    below = _read(first.path, at)[1]
    name = attribute_of(below)
    if first.shared_by is not None:
        owner = first.shared_by if issubclass(first.shared_by, nn.Module) else module
        return (
            f'self.register_buffer("{name}", ..., persistent=False) in '
            f"{owner.__qualname__}.__init__, in place of the class attribute "
            f"{first.shared_by.__qualname__}.{name} (one tensor, shared by every instance), "
            f"so that {at}.to(...) moves it"
        )
    if below != name:  # in a list, dict or other container held as a plain attribute
        return _buffers_fix(first, module, at, name, unseen)
    return (
        f'self.register_buffer("{name}", ..., persistent=False) in {module.__qualname__}'
        f".__init__, not self.{name} = ..., so that {at}.to(...) moves it"
    )


# Tensors of one container attribute named in the fix after the first, before "and N more".
_MAX_LIKEWISE = 3


def _buffers_fix(first: Unseen, module: type, at: str, name: str, unseen: Sequence[Unseen]) -> str:
    """The fix for tensors in a container a module holds as a plain attribute
    (``self.consts = [...]``): a buffer for each, named for its place (``consts_0``).
    ``register_buffer`` takes a tensor, not the container; a ``ParameterList`` would add
    them to ``parameters()`` (an optimizer's) and to the ``state_dict``."""
    reads = [
        _read(u.path, at)
        for u in unseen
        if u.module is None and u.shared_by is None and u.holders == first.holders
    ]
    buffers: list[tuple[str, str]] = []
    used = {name}
    for read, below in dict.fromkeys(r for r in reads if attribute_of(r[1]) == name):
        buffer = _identifier(below)
        while buffer in used:  # a key with no letter or digit, or written like another's
            buffer = f"{buffer}_"
        used.add(buffer)
        buffers.append((buffer, read))
    (buffer, read), rest = buffers[0], buffers[1:]
    fix = (
        f'self.register_buffer("{buffer}", ..., persistent=False) in '
        f"{module.__qualname__}.__init__, read as self.{buffer}, not {read}"
    )
    if rest:
        shown = ", ".join(f"{buffer} for {read}" for buffer, read in rest[:_MAX_LIKEWISE])
        more = len(rest) - _MAX_LIKEWISE
        fix = f"{fix} (likewise {shown}{f' and {more} more' if more > 0 else ''})"
    them = "them" if rest else "it"
    return f"{fix}, so that {at}.to(...) moves {them} (.to does not look into plain attributes)"


def _read(path: str, at: str) -> tuple[str, str]:
    """How the code of the module at ``at`` reads the tensor at ``path``, and the part
    below ``self.``: ``("self.consts[0]", "consts[0]")``; a set's member is read
    ``list(self.consts)[0]``."""
    wrapped, _, below = path.partition(f"{at}.")
    return f"{wrapped}self.{below}", below


def _identifier(below: str) -> str:
    """A buffer name for a place below a module: ``consts_0`` for ``consts[0]``,
    ``consts_w`` for ``consts['w']``."""
    return "_".join(part for part in re.split(r"\W+", below) if part)


def attribute_of(path: str) -> str:
    """The attribute a path below an object starts with: ``items`` for ``items[0].x``."""
    for index, char in enumerate(path):
        if char in "[.":
            return path[:index]
    return path
