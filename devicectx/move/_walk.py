"""The reading walks of the move engine: is everything on a device, and where is each tensor.

The full walks are iterative, with an explicit stack, so depth is not limited by Python's
recursion limit, and each looks into a container once per call (by identity), so a cycle
ends and a container reachable twice costs once. The types a batch is made of (plain
tensors, lists, tuples, dicts) are tested first by exact type; every other type goes
through its cached :class:`~devicectx.move._kinds.Kind`. For the common batch (plain dicts,
lists and tuples only) two of them first try a shallow recursive walk, the fastest CPython
has, which hands over to the full walk at anything else.

- :func:`all_on`: is every tensor already on a device? No paths, no allocation per node;
  :func:`shared_device`, the same walk, also finds the one device when none is given.
- :func:`plain_device`: :func:`shared_device` for a plain batch only; the decorator's hot path.
- :func:`iter_tensors`: every tensor with its path, depth first, in structure order.
- :func:`find_devices`: the same, grouped by device (public, re-exported by the move engine).
- :func:`collect`: every distinct tensor a move can meet, for staged moves
  (:mod:`devicectx.move._staging`).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Iterator
from itertools import chain
from typing import Any

import torch
from torch import nn

from devicectx.move import _containers
from devicectx.move._attributes import slot_names
from devicectx.move._containers import kind_for
from devicectx.move._distributed import Layout, layout_of
from devicectx.move._kinds import (
    DICT_KIND,
    DTENSOR_KIND,
    LEAF,
    LEAF_KIND,
    MODULE,
    OWN,
    TENSOR,
    Kind,
    only_atoms,
)
from devicectx.move._paths import ATTR, ITEM, build, join, keyed_modules, module_path

_Tensor = torch.Tensor
_CACHE = _containers.KIND_CACHE


_UNTRACKED = 64
"""Containers :func:`all_on` looks into before it starts to remember them: a batch costs
nothing for it, and a cycle or a deeply shared structure is cut short soon after."""


def all_on(obj: object, device: torch.device, skip_types: tuple[type, ...] = ()) -> bool:
    """Whether every tensor in ``obj`` is on ``device`` (modules included, by parameters).

    Objects of ``skip_types`` are not looked into. An object moved by its own ``.to``
    whose tensors cannot be read counts as not on ``device``.
    """
    return shared_device(obj, device, skip_types) is not MIXED


class Mixed(enum.Enum):
    """The type of :data:`MIXED`."""

    MIXED = "mixed"


MIXED = Mixed.MIXED
"""What :func:`shared_device` returns when the tensors are not all on one device."""


def shared_device(
    obj: object,
    device: torch.device | None = None,
    skip_types: tuple[type, ...] = (),
    dtensor_mixes: bool = False,
) -> torch.device | Mixed | None:
    """The one device every tensor in ``obj`` is on: ``device`` if given, else the first met.

    Returns that device (``device`` itself when given, even if ``obj`` holds no tensor),
    None when no device was given and ``obj`` holds no tensor, or :data:`MIXED`, also at
    the first DTensor where ``dtensor_mixes`` (the decorator's check then looks closer).
    One walk serves both "is it all on X" and "is it all on one device, and which".
    """
    # Hand-specialised walk: its answer is the full walk's (iter_tensors), which
    # test_shared_device_agrees_with_the_full_walk holds; the container cases below are
    # written again in _gather and find_devices' stack walk: change them together.
    fast_dict, fast_list, fast_tuple = (
        _containers.FAST_DICT,
        _containers.FAST_LIST,
        _containers.FAST_TUPLE,
    )
    stack: list[Any] = [obj]
    pop, push = stack.pop, stack.append
    seen: set[int] | None = None
    budget = _UNTRACKED
    while stack:
        item = pop()
        tp = type(item)
        children: Any
        if tp is fast_dict:
            children = item.values()
        elif tp is fast_list or tp is fast_tuple:
            if only_atoms(item):
                continue
            children = item
        elif tp is _Tensor:
            found = item.device
            if found != device:
                if device is not None:
                    return MIXED
                device = found
            continue
        else:
            kind = _CACHE.get(tp) or kind_for(tp)
            role = kind.role
            if role == LEAF or (skip_types and isinstance(item, skip_types)):
                continue
            if role == TENSOR:  # a tensor subclass: plain tensors never come here
                if dtensor_mixes and kind is DTENSOR_KIND:
                    return MIXED
                found = item.device
                if found != device:
                    if device is not None:
                        return MIXED
                    device = found
                continue
            if role == MODULE:
                for tensor in chain(item.parameters(), item.buffers()):
                    found = tensor.device
                    if found != device:
                        if device is not None:
                            return MIXED
                        device = found
                continue
            if kind.split is None:
                return MIXED
            children = kind.split(item)[1]
        budget -= 1
        if budget < 0:
            if seen is None:
                seen = set()
            if id(item) in seen:
                continue
            seen.add(id(item))
        for child in children:
            tc = type(child)
            if tc is _Tensor:
                found = child.device
                if found != device:
                    if device is not None:
                        return MIXED
                    device = found
            elif (
                tc is fast_dict
                or tc is fast_list
                or tc is fast_tuple
                or (_CACHE.get(tc) or kind_for(tc)) is not LEAF_KIND
            ):
                push(child)
    return device


class NotPlain(Exception):
    """Raised by :func:`plain_device` where it cannot answer: the full walk must."""


def plain_device(values: Iterable[Any]) -> torch.device | None:
    """The one device of the tensors in ``values``, for the common batch only.

    The hot path of ``@device_agnostic``: plain dicts, lists and tuples of tensors and
    scalars, walked recursively, which is the fastest walk CPython has for a shallow tree
    (faster than :func:`shared_device` on the benchmark's nested batch). It keeps no
    set of the containers it has seen, so one held at several places is read at each: the
    answer is the same, at the cost of the structure as written out.

    Returns the device every tensor is on, or None where there is no tensor.

    Raises:
        NotPlain: at tensors on two devices, at any other type (a tensor subclass, a
            module, a registered or unknown container), and past :data:`_PLAIN_DEPTH`
            (which also ends a cycle); the caller then takes the full walk.
    """
    if not _containers.PLAIN_BUILTINS:
        raise NotPlain
    return _plain(values, None, _PLAIN_DEPTH)


def _plain(items: Iterable[Any], device: torch.device | None, depth: int) -> torch.device | None:
    # Twin of _plain_uncast (the same walk with a dtype check): change both together. Held
    # to the full walk by test_plain_walk_agrees_with_the_full_walk, and to each other by
    # test_uncast_walk_answers_exactly_when_nothing_is_to_cast.
    for item in items:
        tp = type(item)
        if tp is _Tensor:
            found = item.device
            if found != device:
                if device is not None:
                    raise NotPlain
                device = found
        elif tp is dict:
            if not depth:
                raise NotPlain
            device = _plain(item.values(), device, depth - 1)
        elif tp is list or tp is tuple:
            if not depth:
                raise NotPlain
            if not only_atoms(item):
                device = _plain(item, device, depth - 1)
        elif _CACHE.get(tp) is not LEAF_KIND:
            raise NotPlain
    return device


def plain_device_uncast(
    values: Iterable[Any], casts: frozenset[torch.dtype]
) -> torch.device | None:
    """:func:`plain_device` for a call with a dtype mapping: the same walk, which also
    raises :class:`NotPlain` at a tensor of a dtype in ``casts`` (the call must cast it), so
    that a call with nothing to cast is known so in one walk. Twin of :func:`_plain`: a change
    to one is a change to both."""
    if not _containers.PLAIN_BUILTINS:
        raise NotPlain
    return _plain_uncast(values, None, _PLAIN_DEPTH, casts)


def _plain_uncast(
    items: Iterable[Any], device: torch.device | None, depth: int, casts: frozenset[torch.dtype]
) -> torch.device | None:
    for item in items:
        tp = type(item)
        if tp is _Tensor:
            if item.dtype in casts:
                raise NotPlain
            found = item.device
            if found != device:
                if device is not None:
                    raise NotPlain
                device = found
        elif tp is dict:
            if not depth:
                raise NotPlain
            device = _plain_uncast(item.values(), device, depth - 1, casts)
        elif tp is list or tp is tuple:
            if not depth:
                raise NotPlain
            if not only_atoms(item):
                device = _plain_uncast(item, device, depth - 1, casts)
        elif _CACHE.get(tp) is not LEAF_KIND:
            raise NotPlain
    return device


def iter_tensors(
    obj: object, name: str = "obj", *, modules: bool = False, attributes: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``obj`` with its path, depth first, in the order of the structure.

    A tensor held at several places is listed at each; a container met again (shared,
    or a cycle) is not looked into again. Modules are looked into only when ``modules``;
    the attributes of objects moved by their own ``.to`` whose children no rule reads,
    only when ``attributes`` (a move leaves them to that ``.to``; a check cannot).
    """
    tp = type(obj)
    kind = _CACHE.get(tp) or kind_for(tp)
    if kind.role == TENSOR:
        yield name, obj  # type: ignore[misc]
        return
    if kind.role == MODULE:
        if modules:
            yield from _module_tensors(obj, name)  # type: ignore[arg-type]
        return
    if kind.split is None and not (attributes and kind.role == OWN):
        return
    seen = {id(obj)}
    stack: list[list[Any]] = [_listed(obj, kind, None, name)]
    while stack:
        style, children, _, path = stack[-1]
        for key, child in children:
            tp = type(child)
            if tp is _Tensor:
                path = path or _top_path(stack)
                yield (
                    (
                        f"{path}[{key!r}]"
                        if style == ITEM and type(key) in _PLAIN_KEYS
                        else join(path, style, key)
                    ),
                    child,
                )
                continue
            kind = _CACHE.get(tp) or kind_for(tp)
            role = kind.role
            if role == LEAF:
                continue
            if role == TENSOR:
                yield join(path or _top_path(stack), style, key), child
            elif role == MODULE:
                if modules:
                    yield from _module_tensors(child, join(path or _top_path(stack), style, key))
            elif (
                (kind.split is not None or (attributes and role == OWN))
                and id(child) not in seen
                and not ((tp is list or tp is tuple) and only_atoms(child))
            ):
                seen.add(id(child))
                stack.append(_listed(child, kind, key, _eager(stack, path, key)))
                break
        else:
            stack.pop()


def find_devices(obj: object, *, name: str = "obj") -> dict[torch.device, list[str]]:
    """Every device in ``obj``, with the paths of the tensors on it.

    Example:
        >>> import torch
        >>> from devicectx import find_devices
        >>> batch = {"ids": torch.zeros(2), "mask": torch.ones(2, device="meta")}
        >>> find_devices(batch, name="batch")
        {device(type='cpu'): ["batch['ids']"], device(type='meta'): ["batch['mask']"]}

    Args:
        obj: anything :func:`~devicectx.to_device` takes. Modules are looked into: a parameter is
            listed as ``model.layers[0].weight``.
        name: how the paths start: ``batch['mask']``, ``xs[2]``, ``out.logits``,
            ``pair.first``, ``list(tags)[0]`` (a set member); a bare tensor is ``name``.

    Returns:
        ``{device: [path, ...]}``, devices and paths in the order the walk meets them
        (depth first, in the order of the structure). A tensor held at several places is
        listed at each; a container held at several places is looked into at the first.

    Caveats:
        Tensors inside an object moved by its own ``.to`` are listed through its children
        where a rule reads them: a ``Mapping``, a dataclass, a tensordict lazy stack
        (through its ``tensordicts``), or torch_geometric's ``Data``, ``Batch`` and
        ``HeteroData``; for any other such object, through its attributes (``__dict__``
        and ``__slots__``: ``cfg.scale``), which its ``.to`` is trusted to move. A
        dataclass that is also a mapping lists each tensor once: ``out.logits`` where the
        entry and the field hold it, ``out['x']`` for an entry that is no field. Plain
        objects (no ``.to``, not registered) are not looked into: ``to_device`` does not
        move them.

    How: what :func:`iter_tensors` with ``modules=True`` yields, grouped by device, and
    the tensors in the attributes of objects with their own ``.to``, which the move
    engine's walks leave to that ``.to``; written out rather than built on it, as it is a
    hot path (no generator, one dict lookup per run of tensors on one device), with a
    recursive fast path for plain batches.
    """
    found: dict[torch.device, list[str]] = {}
    tp = type(obj)
    if tp is _Tensor:
        return {obj.device: [name]}  # type: ignore[attr-defined]
    if (
        (tp is dict or tp is list or tp is tuple)
        and _containers.PLAIN_BUILTINS
        and _plain_devices(obj, name, found, None, 0)
    ):
        return found
    found.clear()
    kind = _CACHE.get(tp) or kind_for(tp)
    if kind.role in (TENSOR, MODULE) or (kind.split is None and kind.role != OWN):
        for path, tensor in iter_tensors(obj, name, modules=True):
            found.setdefault(tensor.device, []).append(path)
        return found
    # The stack walk: its container cases written as shared_device's (change them together);
    # test_find_devices_stack_walk_agrees_with_the_full_walk holds it to the full walk.
    last: torch.device | None = None
    paths: list[str] = []
    seen = {id(obj)}
    fast_dict, fast_list, fast_tuple = (
        _containers.FAST_DICT,
        _containers.FAST_LIST,
        _containers.FAST_TUPLE,
    )
    stack: list[list[Any]] = [_listed(obj, kind, None, name)]
    while stack:
        style, children, _, path = stack[-1]
        for key, child in children:
            tp = type(child)
            if tp is _Tensor:
                device = child.device
                if device != last:
                    paths = found.setdefault(device, [])
                    last = device
                path = path or _top_path(stack)
                paths.append(
                    f"{path}[{key!r}]"
                    if style == ITEM and type(key) in _PLAIN_KEYS
                    else join(path, style, key)
                )
                continue
            if tp is fast_dict or tp is fast_list or tp is fast_tuple:
                if id(child) not in seen and (tp is fast_dict or not only_atoms(child)):
                    seen.add(id(child))
                    items = iter(child.items()) if tp is fast_dict else enumerate(child)
                    child_path = (
                        None
                        if path is None or len(stack) > _EAGER_DEPTH
                        else f"{path}[{key!r}]"
                        if style == ITEM and type(key) in _PLAIN_KEYS
                        else join(path, style, key)
                    )
                    stack.append([ITEM, items, key, child_path])
                    break
                continue
            kind = _CACHE.get(tp) or kind_for(tp)
            role = kind.role
            if role == LEAF:
                continue
            if role in (TENSOR, MODULE):
                child_path = join(path or _top_path(stack), style, key)
                for tensor_path, tensor in iter_tensors(child, child_path, modules=True):
                    device = tensor.device
                    if device != last:
                        paths = found.setdefault(device, [])
                        last = device
                    paths.append(tensor_path)
            elif (kind.split is not None or role == OWN) and id(child) not in seen:
                seen.add(id(child))
                stack.append(_listed(child, kind, key, _eager(stack, path, key)))
                break
        else:
            stack.pop()
    return found


def _listed(obj: Any, kind: Kind, key: Any, path: str | None) -> list[Any]:
    """A walk's frame for a container: its children, or for an object moved by its own
    ``.to`` whose children no rule reads, its attributes."""
    if kind.split is None:
        return [ATTR, _own_attributes(obj), key, path]
    return [kind.style, _children(obj, kind), key, path]


def _own_attributes(obj: Any) -> Iterator[tuple[str, Any]]:
    """An object's attributes: its ``__dict__``'s, then its ``__slots__`` that are set."""
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        yield from ((name, value) for name, value in list(state.items()) if type(name) is str)
    for name in slot_names(type(obj)):
        try:
            yield name, object.__getattribute__(obj, name)
        except AttributeError:  # a slot never set
            continue


def find_layouts(obj: object, *, name: str = "obj") -> dict[Layout, list[str]]:
    """:func:`find_devices` for distributed code: DTensors apart from plain tensors.

    Example:
        >>> import torch
        >>> from devicectx import find_layouts
        >>> find_layouts({"x": torch.zeros(2)}, name="batch")
        {Layout(device=device(type='cpu'), kind='plain', placements=(), mesh=None): ["batch['x']"]}

    Each key is a :class:`~devicectx.Layout`: the device of the tensor's data, its kind
    (``"plain"``, ``"replicated"``, ``"sharded"`` or ``"partial"``), its placements and
    its ``DeviceMesh``; ``str(layout)`` reads ``sharded [Shard(dim=0)] on mesh cpu [0, 1],
    local data on cpu``. A sharded and a replicated DTensor on one device, and a plain
    tensor beside them, land under three keys where :func:`find_devices` lists all three
    under the device. Same walk, order and paths as :func:`find_devices`.
    """
    found: dict[Layout, list[str]] = {}
    for path, tensor in iter_tensors(obj, name, modules=True):
        found.setdefault(layout_of(tensor), []).append(path)
    return found


_PLAIN_DEPTH = 24
"""How deep :func:`_plain_devices` recurses before it hands the structure to the full walk."""


def _plain_devices(
    obj: Any,  # a dict, list or tuple
    path: str,
    found: dict[torch.device, list[str]],
    seen: set[int] | None,
    depth: int,
) -> bool:
    """:func:`find_devices` for the common batch: plain dicts, lists and tuples of tensors.

    Recursive, which is the fastest walk CPython has for a shallow tree. It gives up
    (returns False, leaving ``found`` part-filled) at anything else: another type, a
    depth past :data:`_PLAIN_DEPTH`; the full walk then starts again from the top. The set
    of containers looked into (by which a shared one is looked into once and a cycle ends)
    is made at the first nested container: a flat batch needs none.
    """
    # Twin of _plain_sequence_devices (the same for a list or tuple): change both together;
    # test_find_devices_plain_walks_agree_with_the_full_walk holds both to the full walk.
    if type(obj) is not dict:
        return _plain_sequence_devices(obj, path, found, seen, depth)
    for key, child in obj.items():
        tp = type(child)
        if tp is _Tensor:
            device = child.device
            place = f"{path}[{key!r}]" if type(key) is str else join(path, ITEM, key)
            paths = found.get(device)
            if paths is None:
                found[device] = [place]
            else:
                paths.append(place)
        elif tp is dict or tp is list or tp is tuple:
            if tp is not dict and only_atoms(child):
                continue
            if seen is None:
                seen = {id(obj)}
            if id(child) in seen:  # shared, or a cycle: looked into at the first place only
                continue
            if depth >= _PLAIN_DEPTH:
                return False
            seen.add(id(child))
            if not _plain_devices(child, join(path, ITEM, key), found, seen, depth + 1):
                return False
        elif (_CACHE.get(tp) or kind_for(tp)) is not LEAF_KIND:
            return False
    return True


def _plain_sequence_devices(
    obj: list[Any] | tuple[Any, ...],
    path: str,
    found: dict[torch.device, list[str]],
    seen: set[int] | None,
    depth: int,
) -> bool:
    """:func:`_plain_devices` for a list or tuple: the same, with the ``[i]`` of the first
    positions written once for all (a flat batch is mostly paths). Twin of
    :func:`_plain_devices`: change both together."""
    for index, child in enumerate(obj):
        tp = type(child)
        if tp is _Tensor:
            device = child.device
            place = path + _INDICES[index] if index < _INDEXED else f"{path}[{index}]"
            paths = found.get(device)
            if paths is None:
                found[device] = [place]
            else:
                paths.append(place)
        elif tp is dict or tp is list or tp is tuple:
            if tp is not dict and only_atoms(child):
                continue
            if seen is None:
                seen = {id(obj)}
            if id(child) in seen:  # shared, or a cycle: looked into at the first place only
                continue
            if depth >= _PLAIN_DEPTH:
                return False
            seen.add(id(child))
            if not _plain_devices(child, f"{path}[{index}]", found, seen, depth + 1):
                return False
        elif (_CACHE.get(tp) or kind_for(tp)) is not LEAF_KIND:
            return False
    return True


_PLAIN_KEYS = frozenset({str, int})
"""Key types whose ``repr`` a path writes as it is (see :func:`~devicectx.move._paths.key_text`)."""

_INDEXED = 64
_INDICES = tuple(f"[{index}]" for index in range(_INDEXED))
"""``[0]`` to ``[63]``, written once: joining two strings costs less than formatting."""


_EAGER_DEPTH = 32
"""Down to this depth a container's path is built when it is entered (the fast way for a
batch); below, only when a tensor in it needs it (see :func:`_top_path`)."""


def _eager(stack: list[list[Any]], path: str | None, key: Any) -> str | None:
    """The path of a child container of the top frame, if it is built on entry."""
    if path is None or len(stack) > _EAGER_DEPTH:
        return None
    return join(path, stack[-1][0], key)


def _top_path(stack: list[list[Any]]) -> str:
    """The path of the container on top of ``stack``, built and kept on first use.

    A frame is ``[style of its children's paths, iterator of (key, child), its key in
    its parent, its path or None]``. Paths are built only for containers that hold a
    tensor, from the nearest one built, so that a structure 100,000 deep with a tensor at
    the bottom costs one path, not 100,000 ever longer ones.
    """
    top = len(stack) - 1
    known = top
    while stack[known][3] is None:
        known -= 1
    parts = ((stack[i - 1][0], stack[i][2]) for i in range(known + 1, top + 1))
    path: str = build(stack[known][3], parts)
    stack[top][3] = path
    return path


def _children(obj: Any, kind: Kind) -> Iterator[tuple[Any, Any]]:
    """``(key, child)`` pairs of a container, lazily where its type allows."""
    if kind is DICT_KIND:
        return iter(obj.items())
    keys, values = kind.split(obj)  # type: ignore[misc]
    return enumerate(values) if keys is None else zip(keys, values, strict=True)


def module_on(module: nn.Module, device: torch.device) -> bool:
    """Whether every parameter and buffer of ``module`` is on ``device``."""
    return all(t.device == device for t in chain(module.parameters(), module.buffers()))


def module_paths(obj: object, wanted: Collection[int], name: str = "obj") -> dict[int, str]:
    """The path of each module of ``wanted`` (ids) in ``obj``, where the walk of
    :func:`iter_tensors` meets it first: for messages, as the moving walk keeps no paths.

    A module in ``wanted`` that ``obj`` does not hold has none. Failure paths only: no
    fast path, and each container read once.
    """
    found: dict[int, str] = {}
    seen: set[int] = set()
    # What a split made on the fly is kept till the end, so that no id in `seen` is
    # reused meanwhile by another such container.
    keep: list[Any] = []
    stack: list[tuple[Any, str]] = [(obj, name)]
    while stack and len(found) < len(wanted):
        item, path = stack.pop()
        kind = _CACHE.get(type(item)) or kind_for(type(item))
        role = kind.role
        if role == MODULE:
            if id(item) in wanted and id(item) not in found:
                found[id(item)] = path
        elif role not in (LEAF, TENSOR) and kind.split is not None and id(item) not in seen:
            seen.add(id(item))
            children = list(_children(item, kind))
            keep.append(children)
            stack.extend((child, join(path, kind.style, key)) for key, child in reversed(children))
    return found


def _module_tensors(module: nn.Module, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    keyed = keyed_modules(module.named_modules())  # ModuleDict keys written as keys
    for name, tensor in chain(module.named_parameters(), module.named_buffers()):
        yield module_path(path, name, keyed), tensor


def collect(
    obj: object, skip_types: tuple[type, ...] = ()
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], list[Any]]:
    """Every distinct tensor a move of ``obj`` can meet, by id: what a staged move may copy.

    Returns ``(found, inside, keep)``: ``found``, the tensors the move engine itself moves
    (in containers, not of ``skip_types``); ``inside``, those met only inside objects moved
    by their own ``.to``, which a staged move must not copy but must know of, as a base a
    view elsewhere must stay a view of; ``keep``, what the walk made on the fly, to be
    held till the move ends so that no id above is reused meanwhile.

    Modules are not looked into as containers (``module.to`` moves them in place), but
    their parameters and buffers are in ``inside`` and never in ``found``: the move makes
    the structure's references to them the module's moved tensors, and views of them views
    of those. Iterative, each container looked into once, like :func:`shared_device`.
    """
    found: dict[int, torch.Tensor] = {}
    inside: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    keep: list[Any] = []
    modules: list[nn.Module] = []
    owns = _gather([obj], found, seen, keep, skip_types, False, modules)
    if owns:
        _gather(owns, inside, seen, keep, skip_types, True, modules)
        for key in found:
            inside.pop(key, None)
    for module in modules:
        for tensor in chain(module.parameters(), module.buffers()):
            found.pop(id(tensor), None)
            inside[id(tensor)] = tensor
    return found, inside, keep


def tensors_within(obj: object) -> Iterable[torch.Tensor]:
    """Every distinct tensor inside ``obj``, through objects with their own ``.to`` and
    modules (their parameters and buffers): what ``obj.to`` may copy. No paths, unlike
    :func:`iter_tensors`, and the same tensors (a tensor that both hold is listed once)."""
    found: dict[int, torch.Tensor] = {}
    keep: list[Any] = []
    modules: list[nn.Module] = []
    _gather([obj], found, set(), keep, (), True, modules)
    for module in modules:
        for tensor in chain(module.parameters(), module.buffers()):
            found.setdefault(id(tensor), tensor)
    return found.values()


def _gather(
    stack: list[Any],
    found: dict[int, torch.Tensor],
    seen: set[int],
    keep: list[Any],
    skip_types: tuple[type, ...],
    enter_own: bool,
    modules: list[nn.Module],
) -> list[Any]:
    """Tensors below ``stack`` into ``found``, the modules met into ``modules``; the objects
    with their own ``.to`` met, returned unopened (looked into, as containers, when
    ``enter_own``)."""
    # Hand-specialised walk, its container cases written as shared_device's: change them
    # together; test_collect_finds_each_tensor_of_the_full_walk_once holds it to the full walk.
    fast_dict, fast_list, fast_tuple = (
        _containers.FAST_DICT,
        _containers.FAST_LIST,
        _containers.FAST_TUPLE,
    )
    owns: list[Any] = []
    pop, push = stack.pop, stack.append
    while stack:
        item = pop()
        tp = type(item)
        children: Any
        if tp is fast_dict:
            children = item.values()
        elif tp is fast_list or tp is fast_tuple:
            if only_atoms(item):
                continue
            children = item
        elif tp is _Tensor:
            found[id(item)] = item
            continue
        else:
            kind = _CACHE.get(tp) or kind_for(tp)
            role = kind.role
            if role == LEAF or (skip_types and isinstance(item, skip_types)):
                continue
            if role == TENSOR:
                found[id(item)] = item
                continue
            if role == MODULE:
                modules.append(item)
                continue
            if role == OWN and not enter_own:
                owns.append(item)
                continue
            if kind.split is None:
                continue
            children = kind.split(item)[1]
            keep.append(children)
        if id(item) in seen:
            continue
        seen.add(id(item))
        for child in children:
            tc = type(child)
            if tc is _Tensor:
                found[id(child)] = child
            elif (
                tc is fast_dict
                or tc is fast_list
                or tc is fast_tuple
                or (_CACHE.get(tc) or kind_for(tc)) is not LEAF_KIND
            ):
                push(child)
    return owns
