"""The guarantees of ``to_device``, over generated structures of every container kind.

The structures come from :mod:`devicectx.testing.strategies`: every kind ``to_device``
supports, nested, with the same tensor at several places, views with and without their
base (before it or after it), and plain values. They are moved from cpu (or meta) to meta,
and each guarantee is checked with a walk written here, independent of the engine's own.
The properties are checked on the engine's recursive walk; its explicit-stack walk (used
below a depth of 100) is checked to give the same results, by forcing it from the top.
Dataclasses that are also mappings (as transformers' ``ModelOutput`` is) are generated
here, in the four ways such types keep their two views, and checked view by view.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.utils.rnn import PackedSequence

from devicectx import find_devices, to_device
from devicectx.move import _rebuild
from devicectx.move._move import move_call
from devicectx.testing.strategies import nested, tensors

CPU = torch.device("cpu")
META = torch.device("meta")

batches = nested(tensors(devices=["cpu"]))
mixed_batches = nested(tensors(devices=["cpu", "meta"]))
grad_batches = nested(tensors(devices=["cpu"], dtypes=[torch.float32], requires_grad=True))


def children(obj: Any) -> list[tuple[Any, Any]] | None:
    """``(key, child)`` pairs of a container the strategies build; None for a leaf."""
    if isinstance(obj, (torch.Tensor, torch.Size, str, bytes)):
        return None
    if isinstance(obj, PackedSequence):  # batch_sizes stays on the CPU, by design
        return [
            ("data", obj.data),
            ("sorted_indices", obj.sorted_indices),
            ("unsorted_indices", obj.unsorted_indices),
        ]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if isinstance(obj, Mapping):
        return list(obj.items())
    if isinstance(obj, (set, frozenset)):
        return [(None, member) for member in obj]  # no positions: the order is arbitrary
    if isinstance(obj, (list, tuple, collections.deque, collections.UserList)):
        return list(enumerate(obj))
    return None


def skeleton(obj: Any) -> Any:
    """The structure: types and keys, tensors by shape/dtype/grad, other leaves by identity."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), obj.dtype, obj.requires_grad, type(obj))
    pairs = children(obj)
    if pairs is None:
        return ("leaf", id(obj))
    if isinstance(obj, (set, frozenset)):
        members = collections.Counter(repr(skeleton(member)) for _, member in pairs)
        return (type(obj), sorted(members.items()))
    extra = obj.batch_sizes.device if isinstance(obj, PackedSequence) else None
    return (type(obj), extra, [(key, skeleton(child)) for key, child in pairs])


def placed(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every tensor with its position, preorder; members of sets have no position."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    for key, child in children(obj) or ():
        if isinstance(obj, (set, frozenset)):
            yield from ((None, t) for _, t in placed(child, ()))
        else:
            yield from placed(child, (*path, key))


def positioned(obj: Any) -> list[torch.Tensor]:
    """Every tensor that has a position (not in a set), in preorder."""
    return [tensor for path, tensor in placed(obj) if path is not None]


def all_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor, set members included."""
    return [tensor for _, tensor in placed(obj)]


def unordered(path: str) -> str:
    """``path`` without set members' positions, which depend on the members' hashes."""
    return re.sub(r"\)\[\d+\]", ")[_]", path)


def span(tensor: torch.Tensor) -> int:
    """Bytes from the first to the last element of ``tensor`` in its storage."""
    if tensor.numel() == 0:
        return 0
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return (last + 1) * tensor.element_size()


@given(batches)
def test_same_structure_types_and_plain_values(batch: Any) -> None:
    """The result has the input's structure and types; non-tensors come back by identity."""
    assert skeleton(batch) == skeleton(to_device(batch, META))


@given(mixed_batches)
def test_every_tensor_lands_on_target(batch: Any) -> None:
    """Every tensor of the result is on the target, and find_devices lists the same paths."""
    before = find_devices(batch)
    moved = to_device(batch, "meta")
    assert {t.device for t in all_tensors(moved)} <= {META}
    expected = sorted(unordered(path) for paths in before.values() for path in paths)
    assert expected == sorted(unordered(path) for path in find_devices(moved).get(META, []))


@given(mixed_batches)
def test_input_unchanged(batch: Any) -> None:
    """Moving leaves the input as it was: same structure, same tensors, same devices."""
    shape_before = skeleton(batch)
    tensors_before = [(path, t, t.device) for path, t in placed(batch)]
    to_device(batch, META)
    assert shape_before == skeleton(batch)
    assert tensors_before == [(path, t, t.device) for path, t in placed(batch)]


@given(batches)
def test_aliasing_kept(batch: Any) -> None:
    """Places holding one tensor hold one moved tensor; places holding two hold two."""
    moved = to_device(batch, META)
    before, after = positioned(batch), positioned(moved)
    assert len(before) == len(after)
    for i, (a, a_moved) in enumerate(zip(before, after, strict=True)):
        for b, b_moved in zip(before[i + 1 :], after[i + 1 :], strict=True):
            assert (a is b) == (a_moved is b_moved)


@given(batches)
def test_views_of_present_tensors_stay_views(batch: Any) -> None:
    """A view whose base is in the structure is a view of the moved base, same geometry."""
    moved = to_device(batch, META)
    pairs = list(zip(positioned(batch), positioned(moved), strict=True))
    result_of = {id(t): t_moved for t, t_moved in pairs}
    for t, t_moved in pairs:
        base = t._base
        if base is not None and id(base) in result_of:
            assert t_moved._base is result_of[id(base)]
            geometry = (t.shape, t.stride(), t.storage_offset())
            assert geometry == (t_moved.shape, t_moved.stride(), t_moved.storage_offset())


@given(batches)
def test_views_without_their_base_move_only_what_the_structure_holds(batch: Any) -> None:
    """A view whose base is absent is not copied with its base: only its own elements,
    or those of the largest tensor of the structure on the same base."""
    moved = to_device(batch, META)
    present = {id(t) for t in all_tensors(batch)}
    by_root: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
    for t in all_tensors(batch):
        by_root[id(t._base if t._base is not None else t)].append(t)
    for t, t_moved in zip(positioned(batch), positioned(moved), strict=True):
        if t._base is None or id(t._base) in present:
            continue
        # .to makes an overlapping view (expand) dense: then its own elements, in full.
        largest = max(t.numel() * t.element_size(), *(span(s) for s in by_root[id(t._base)]))
        assert t_moved.untyped_storage().nbytes() <= largest


@given(mixed_batches)
def test_moving_twice_is_moving_once(batch: Any) -> None:
    """A second move returns the first result itself: nothing is copied again."""
    once = to_device(batch, META)
    assert to_device(once, META) is once


@given(batches)
def test_nothing_to_move_returns_the_input(batch: Any) -> None:
    """A structure already on the target comes back as the very same object."""
    assert to_device(batch, CPU) is batch


@given(grad_batches)
def test_autograd_kept(batch: Any) -> None:
    """requires_grad is kept, and every moved tensor that requires grad has history."""
    moved = to_device(batch, META)
    for t, t_moved in zip(positioned(batch), positioned(moved), strict=True):
        assert t.requires_grad == t_moved.requires_grad
        if t_moved.requires_grad:
            assert t_moved.grad_fn is not None


@given(batches)
def test_explicit_stack_walk_gives_the_same(batch: Any) -> None:
    """The walk used for deep structures gives what the recursive walk gives."""
    recursive = to_device(batch, META)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_rebuild, "_DEPTH", -1)
        explicit = to_device(batch, META)
    assert_same_moves(recursive, explicit)


def assert_same_moves(first: Any, second: Any) -> None:
    """Two results of moves of one input agree: the same structure, and the same tensors
    at the same places (aliasing), views of the same tensors."""
    assert skeleton(first) == skeleton(second)
    pairs = list(zip(positioned(first), positioned(second), strict=True))
    for i, (a, a_second) in enumerate(pairs):
        assert (a._base is None) == (a_second._base is None)
        for b, b_second in pairs[i + 1 :]:
            assert (a is b) == (a_second is b_second)
            assert (a._base is b) == (a_second._base is b_second)


@given(st.lists(batches, max_size=3), st.dictionaries(st.sampled_from("xyz"), batches, max_size=2))
def test_a_calls_arguments_move_as_the_same_structure_would(
    args: list[Any], kwargs: dict[str, Any]
) -> None:
    """A call's arguments, moved as one (the decorator's move, whose walk reads the
    positional ones as a tuple and the keyword ones as a dict), come back as
    ``to_device((args, kwargs))`` gives them: the same structure, aliasing and views
    across arguments; nothing moved gives back the very same objects."""
    whole = to_device((tuple(args), kwargs), META)
    moved = move_call(tuple(args), kwargs, META, names=("a", "b"))
    assert_same_moves(whole, moved)
    again = move_call(*moved, META, names=("a", "b"))
    assert all(x is y for x, y in zip(again, moved, strict=True))


# Dataclasses that are also mappings (transformers' ModelOutput is one): two views of the
# same children, in the four ways such types keep them.

FIELDS = ("first", "second", "third")


@dataclasses.dataclass
class Mirrored(collections.OrderedDict[str, Any]):
    """As ModelOutput: fields not None are entries, and setting one view sets the other."""

    first: Any = None
    second: Any = None
    third: Any = None

    def __post_init__(self) -> None:
        for name in FIELDS:
            if getattr(self, name) is not None:
                self[name] = getattr(self, name)

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in FIELDS and value is not None:
            super().__setitem__(name, value)
        super().__setattr__(name, value)


@dataclasses.dataclass
class Once(dict[Any, Any]):
    """Fields not None are entered once, at construction; the views then live apart."""

    first: Any = None
    second: Any = None
    third: Any = None

    def __post_init__(self) -> None:
        for name in FIELDS:
            if getattr(self, name) is not None:
                self[name] = getattr(self, name)


@dataclasses.dataclass(frozen=True)
class FrozenOnce(dict[Any, Any]):
    """A frozen dataclass whose entries are made once, as in :class:`Once`."""

    first: Any = None
    second: Any = None
    third: Any = None

    def __post_init__(self) -> None:
        for name in FIELDS:
            if getattr(self, name) is not None:
                dict.__setitem__(self, name, getattr(self, name))


@dataclasses.dataclass
class Derived(Mapping[str, Any]):
    """Entries read from the fields: one storage, two views."""

    first: Any = None
    second: Any = None
    third: Any = None

    def __getitem__(self, key: str) -> Any:
        if key in FIELDS and getattr(self, key) is not None:
            return getattr(self, key)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (name for name in FIELDS if getattr(self, name) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


@st.composite
def hybrids(draw: st.DrawFn) -> Any:
    """A two-view dataclass with tensors (some shared, on cpu or meta), lists of them,
    None and ints in its fields; maybe entries that are no fields, an entry that
    disagrees with its field, and another attribute holding a field's value."""
    cls = draw(st.sampled_from([Mirrored, Once, FrozenOnce, Derived]))
    pool = draw(st.lists(tensors(devices=["cpu", "meta"]), min_size=1, max_size=4))
    shared = st.sampled_from(pool)
    value = st.none() | st.integers(0, 3) | shared | st.lists(shared, max_size=3)
    obj = cls(**{name: draw(value) for name in FIELDS})
    if cls is not Derived:
        names = ["extra", "x y", "class"] + ([3] if cls is not Mirrored else [])
        extras = draw(
            st.dictionaries(st.sampled_from(names), shared | st.lists(shared), max_size=2)
        )
        for key, extra in extras.items():
            if cls is FrozenOnce:
                dict.__setitem__(obj, key, extra)
            else:
                obj[key] = extra
    entered = [name for name in FIELDS if name in obj]
    if cls in (Once, FrozenOnce) and entered and draw(st.booleans()):
        dict.__setitem__(obj, draw(st.sampled_from(entered)), draw(shared))
    if draw(st.booleans()):
        object.__setattr__(obj, "cache", getattr(obj, draw(st.sampled_from(FIELDS))))
    return obj


def hybrid_views(obj: Any) -> list[tuple[str, Any]]:
    """Every field, every entry, the extra attribute, and the members of lists in them."""
    views = [(f".{name}", getattr(obj, name)) for name in FIELDS]
    views += [(f"[{key!r}]", obj[key]) for key in obj]
    if "cache" in vars(obj):
        views.append((".cache", obj.cache))
    for label, value in list(views):
        if isinstance(value, list):
            views += [(f"{label}[{i}]", member) for i, member in enumerate(value)]
    return views


def hybrid_paths(obj: Any) -> dict[torch.device, list[str]]:
    """What find_devices must say, worked out from the rule: entries in order, an entry
    and the field of its name that hold one object written once as the field, then the
    other fields."""
    found: dict[torch.device, list[str]] = {}

    def add(path: str, value: Any) -> None:
        for index, member in enumerate(value) if isinstance(value, list) else [(None, value)]:
            if isinstance(member, torch.Tensor):
                place = path if index is None else f"{path}[{index}]"
                found.setdefault(member.device, []).append(place)

    named = set()
    for key in obj:
        if key in FIELDS and getattr(obj, key) is obj[key]:
            named.add(key)
            add(f"obj.{key}", obj[key])
        else:
            add(f"obj[{key!r}]", obj[key])
    for name in FIELDS:
        if name not in named:
            add(f"obj.{name}", getattr(obj, name))
    return found


def same_objects(views: list[tuple[str, Any]]) -> list[int]:
    """For each view, the position of the first view holding the same object."""
    values = [value for _, value in views]
    return [next(i for i, seen in enumerate(values) if seen is v) for v in values]


def view_skeleton(views: list[tuple[str, Any]]) -> list[Any]:
    """Each view's label and what it shows: tensors by shape and dtype, lists by length,
    plain values as they are."""
    return [
        (label, ("tensor", tuple(v.shape), v.dtype))
        if isinstance(v, torch.Tensor)
        else (label, ("list", len(v)))
        if isinstance(v, list)
        else (label, v)
        for label, v in views
    ]


@pytest.mark.parametrize("depth_limit", [100, -1])
@given(obj=hybrids())
def test_every_view_of_a_two_view_dataclass_agrees(obj: Any, depth_limit: int) -> None:
    """Moved, a dataclass that is also a mapping keeps its type and keys; every field,
    entry and attribute shows the moved object of what it showed, on meta, sharing
    exactly where it shared; the input is left alone; find_devices lists each place once,
    on both walks."""
    before = hybrid_views(obj)
    held = [(label, value, getattr(value, "device", None)) for label, value in before]
    assert hybrid_paths(obj) == find_devices(obj)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_rebuild, "_DEPTH", depth_limit)
        moved = to_device(obj, META)
    after = hybrid_views(moved)
    assert type(obj) is type(moved)
    assert list(obj) == list(moved)
    assert view_skeleton(before) == view_skeleton(after)
    assert same_objects(before) == same_objects(after)
    assert all(v.device == META for _, v in after if isinstance(v, torch.Tensor))
    assert held == [(label, value, getattr(value, "device", None)) for label, value in before]
    assert held == [
        (label, value, getattr(value, "device", None)) for label, value in hybrid_views(obj)
    ]
    assert hybrid_paths(moved) == find_devices(moved)
    assert to_device(moved, META) is moved
