"""Tensors the move engine cannot see: held in attributes of plain objects.

The engine looks into containers it knows (:mod:`devicectx.move._containers`) and leaves
every other object as it is, unmoved and unchecked. Where torch then fails with a device
mismatch, :func:`unseen_tensors` looks into the attributes of those objects (``__dict__``
and ``__slots__``, a few levels deep) and into the plain tensor attributes of modules (a
tensor set as ``self.scale = ...``, not registered as a buffer, which ``module.to`` does
not move), so that the error can name them. It runs on the failure path only: a call that
succeeds never takes it.

Example:
    >>> import torch
    >>> class Config:
    ...     def __init__(self):
    ...         self.scale = torch.ones(2, device="meta")
    >>> [(u.path, str(u.device), u.holder.__name__) for u in unseen_tensors([("cfg", Config())])]
    [('cfg.scale', 'meta', 'Config')]
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from itertools import chain
from typing import Any, NamedTuple

import torch
from torch import nn

from devicectx.move._containers import (
    CONTAINER,
    LEAF,
    MODULE,
    TENSOR,
    is_plain_leaf,
    kind_for,
    slot_names,
)
from devicectx.move._paths import ATTR, join, keyed_modules, module_path

# torch's words for tensors on different devices, across its releases and backends.
_MISMATCH_WORDS = (
    "Expected all tensors to be on the same device",
    "is not on the expected device",
    "Expected object of device type",
    "but expected it to be on",
    "found at least two devices",
    "should be either on cpu or on the same device",
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


def is_device_mismatch(error: BaseException) -> bool:
    """Whether ``error`` is torch's complaint about tensors on different devices."""
    if not isinstance(error, RuntimeError):
        return False
    text = str(error)
    return any(words in text for words in _MISMATCH_WORDS)


def unseen_tensors(
    named: Iterable[tuple[str, Any]], checked: Collection[int] | None = None
) -> list[Unseen]:
    """Every tensor below ``named`` arguments that the move engine does not see, in order.

    A module held by a plain object is unseen as a whole: one entry per device its
    parameters and buffers are on, and those tensors are not listed again where something
    else holds them too (an optimizer's ``param_groups``).

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
    # (value, path, attribute depth, the plain object holding it and its path, or None)
    stack: list[tuple[Any, str, int, tuple[type, str] | None]] = [
        (value, name, 0, None) for name, value in reversed(list(named))
    ]
    budget = _MAX_OBJECTS
    while stack and budget > 0:
        value, path, depth, holder = stack.pop()
        kind = kind_for(type(value))
        role = kind.role
        if role == TENSOR:
            if holder is not None:
                found.append(Unseen(path, value.device, holder[0], holder[1]))
                ids.append(id(value))
            continue
        if role == LEAF and is_plain_leaf(type(value)):
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        budget -= 1
        children: Sequence[tuple[Any, str, int, tuple[type, str] | None]]
        if role == MODULE:
            unchecked = holder is not None or (checked is not None and id(value) not in checked)
            if unchecked and id(value) not in covered:
                owner = holder if holder is not None else (type(value), path)
                for device, tensors in _by_device(value).items():
                    found.append(Unseen(path, device, owner[0], owner[1], type(value)))
                    ids.append(0)
                    owned.update(tensors)
                covered.update(id(module) for module in value.modules())
            children = _module_children(value, path, depth)
        elif role == CONTAINER and kind.split is not None:
            keys, values = kind.split(value)
            keys = range(len(values)) if keys is None else keys
            children = [
                (child, join(path, kind.style, key), depth, holder)
                for key, child in zip(keys, values, strict=True)
            ]
        elif role == LEAF and depth < _MAX_DEPTH:
            here = (type(value), path)
            children = [
                (child, join(path, ATTR, name), depth + 1, here)
                for name, child in _attributes(value)
            ]
        else:  # an object with its own .to: what it holds is its .to's business
            continue
        stack.extend(reversed(children))
    return [item for item, tensor in zip(found, ids, strict=True) if tensor not in owned]


def _by_device(module: nn.Module) -> dict[torch.device, set[int]]:
    """The ids of a module's parameters and buffers, by device."""
    devices: dict[torch.device, set[int]] = {}
    for tensor in chain(module.parameters(), module.buffers()):
        devices.setdefault(tensor.device, set()).add(id(tensor))
    return devices


def _module_children(
    module: nn.Module, path: str, depth: int
) -> list[tuple[Any, str, int, tuple[type, str] | None]]:
    """A module's plain attributes (a tensor there is not moved by ``module.to``), then its
    submodules. Parameters and buffers are seen: they are not listed."""
    here = (type(module), path)
    children: list[tuple[Any, str, int, tuple[type, str] | None]] = [
        (value, join(path, ATTR, name), depth + 1, here)
        for name, value in vars(module).items()
        if name not in _MODULE_STATE and depth < _MAX_DEPTH
    ]
    # Written as find_devices writes them (model.enc[0]), so that a fix names code that runs.
    keyed = keyed_modules([("", module)])  # a ModuleDict's children are its keys
    children += [
        (child, module_path(path, name, keyed), depth, None)
        for name, child in module.named_children()
    ]
    return children


def _attributes(obj: object) -> list[tuple[str, Any]]:
    """An object's attributes: its ``__dict__``, then its ``__slots__`` that are set."""
    state = getattr(obj, "__dict__", None)
    pairs = list(state.items()) if isinstance(state, dict) else []
    for name in slot_names(type(obj)):
        try:
            value = object.__getattribute__(obj, name)
        except AttributeError:  # a slot never set
            continue
        pairs.append((name, value))
    return [(name, value) for name, value in pairs if isinstance(name, str)]


def fix_for(
    unseen: Sequence[Unseen], target: torch.device | None = None, follow: bool = True
) -> str:
    """The ``fix:`` text for tensors the engine cannot see (the first holder's).

    For a whole module: where the target was chosen (``follow`` False: a device named, a
    block, the module rule), the module goes to it; where the inputs chose it, the call
    names the module's device, or takes the module as an argument so that the inputs follow.
    """
    first = unseen[0]
    holder = first.holder
    if first.module is not None:
        if target is not None and not follow:
            return (
                f'{first.path}.to("{target}") before the call: modules are never moved implicitly'
            )
        return (
            f'@device_agnostic(device="{first.device}"), or pass {first.path} as the first '
            "module argument, so that the inputs follow it"
        )
    names = [
        _attribute_of(u.path[len(first.holder_path) + 1 :])
        for u in unseen
        if u.holder_path == first.holder_path
    ]
    if issubclass(holder, nn.Module):
        name = names[0]
        return (
            f'self.register_buffer("{name}", ...) in {holder.__qualname__}.__init__, not '
            f"self.{name} = ..., so that {first.holder_path}.to(...) moves it"
        )
    listed = ", ".join(f'("{name}", obj.{name})' for name in dict.fromkeys(names))
    return (
        f"register_container({holder.__qualname__}, children=lambda obj: [{listed}], "
        f"rebuild=...), pass {first.path} as an argument, or give {holder.__qualname__} a "
        f".to(device) method"
    )


def _attribute_of(path: str) -> str:
    """The attribute a path below an object starts with: ``items`` for ``items[0].x``."""
    for index, char in enumerate(path):
        if char in "[.":
            return path[:index]
    return path
