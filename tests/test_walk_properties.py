"""Each hand-specialised walk of the move engine agrees with the full walk.

``devicectx.move._walk`` has one full walk, :func:`~devicectx.move._walk.iter_tensors`
(every tensor with its path), and seven walks written out again for speed, each for one
question or one kind of batch. Each is checked here against the full walk, over generated
structures of every container kind: a change to one copy that the others do not follow
fails here.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from devicectx import device_agnostic, find_devices, to_device
from devicectx.move import _containers, _kinds, _walk
from devicectx.testing.strategies import nested, tensors

CPU = torch.device("cpu")
META = torch.device("meta")

mixed_batches = nested(tensors(devices=["cpu", "meta"]))
plain_leaves = tensors(devices=["cpu", "meta"]) | st.integers() | st.none() | st.text(max_size=2)
plain_batches = st.recursive(
    plain_leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=2), inner, max_size=3)
    ),
    max_leaves=10,
)
"""Plain dicts, lists and tuples of tensors and scalars: the batches the fast walks take."""


def full_paths(obj: Any, name: str = "batch") -> dict[torch.device, list[str]]:
    """The full walk's tensors, grouped by device, in the order it meets them."""
    found: dict[torch.device, list[str]] = {}
    for path, tensor in _walk.iter_tensors(obj, name, modules=True):
        found.setdefault(tensor.device, []).append(path)
    return found


def full_devices(obj: Any) -> set[torch.device]:
    return {tensor.device for _, tensor in _walk.iter_tensors(obj, modules=True)}


def is_plain(obj: Any) -> bool:
    """Whether ``obj`` is a plain batch: dicts, lists, tuples, plain tensors and scalars."""
    if type(obj) in (dict, list, tuple):
        return all(map(is_plain, obj.values() if type(obj) is dict else obj))
    kind = _containers.kind_for(type(obj))
    return type(obj) is torch.Tensor or kind is _containers.LEAF_KIND


@given(batch=mixed_batches)
def test_shared_device_agrees_with_the_full_walk(batch: Any) -> None:
    """shared_device gives the one device of the full walk's tensors, None for none,
    MIXED for several; all_on says whether that one device is the one asked."""
    devices = full_devices(batch)
    expected = _walk.MIXED if len(devices) > 1 else next(iter(devices), None)
    event(f"{len(devices)} devices")
    assert expected == _walk.shared_device(batch)
    for device in (CPU, META):
        assert (devices <= {device}) == _walk.all_on(batch, device)


@given(batch=plain_batches)
def test_plain_walk_answers_exactly_when_the_batch_is_on_one_device(batch: Any) -> None:
    """The decorator's fast walk over plain dicts, lists and tuples gives the one device
    of the tensors (None for none), and hands over exactly where they disagree."""
    found = full_devices(batch)
    if len(found) > 1:
        with pytest.raises(_walk.NotPlain):
            _walk.plain_device((batch,))
    else:
        assert next(iter(found), None) == _walk.plain_device((batch,))


@given(
    batch=plain_batches | mixed_batches,
    casts=st.frozensets(st.sampled_from([torch.float64, torch.float32, torch.int64]), max_size=2),
)
def test_uncast_walk_answers_exactly_when_nothing_is_to_cast(
    batch: Any, casts: frozenset[torch.dtype]
) -> None:
    """The fast walk of a decorator with a dtype mapping gives the plain walk's device
    where no tensor has a dtype to cast, and hands over exactly where one has or where the
    plain walk hands over."""
    to_cast = any(tensor.dtype in casts for _, tensor in _walk.iter_tensors(batch))
    try:
        device = _walk.plain_device((batch,))
    except _walk.NotPlain:
        to_cast = True
        event("the plain walk hands over")
    if to_cast:
        with pytest.raises(_walk.NotPlain):
            _walk.plain_device_uncast((batch,), casts)
    else:
        assert device == _walk.plain_device_uncast((batch,), casts)


@given(batch=mixed_batches)
def test_plain_walk_agrees_with_the_full_walk(batch: Any) -> None:
    """Over every container kind, the fast walk gives the full walk's answer, or hands
    over, and only where the batch is not plain or its tensors are on several devices."""
    try:
        device = _walk.plain_device((batch,))
    except _walk.NotPlain:
        event("handed over to the full walk")
        assert not is_plain(batch) or len(full_devices(batch)) > 1
        return
    event("answered by the plain walk")
    assert is_plain(batch)
    assert device == _walk.shared_device(batch)


@given(batch=mixed_batches)
def test_find_devices_agrees_with_the_full_walk(batch: Any) -> None:
    """find_devices (a recursive fast path for plain batches, its own stack walk for the
    rest) lists the same devices and paths, in the same order, as the full walk."""
    event("plain" if is_plain(batch) else "not plain")
    assert full_paths(batch) == find_devices(batch, name="batch")


@given(batch=mixed_batches)
def test_find_devices_stack_walk_agrees_with_the_full_walk(batch: Any) -> None:
    """find_devices' own stack walk, taken for every batch (the fast path switched off as
    a registered dict, list or tuple does), lists what the full walk lists."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_containers, "PLAIN_BUILTINS", False)
        assert full_paths(batch) == find_devices(batch, name="batch")


@pytest.mark.parametrize("root", [dict, list, tuple])
@given(batch=plain_batches)
def test_find_devices_plain_walks_agree_with_the_full_walk(batch: Any, root: type) -> None:
    """The recursive walks for a plain dict and for a plain list or tuple (whose
    ``[i]`` paths are written once for all) answer, and list what the full walk lists."""
    top = {"x": batch, "y": [batch]} if root is dict else root([batch, (batch,), batch])
    found: dict[torch.device, list[str]] = {}
    assert _walk._plain_devices(top, "batch", found, None, 0)
    assert full_paths(top) == found


@dataclasses.dataclass
class OwnMove:
    """An object moved by its own ``.to``, whose children the walks read as fields."""

    value: Any

    def to(self, device: torch.device, non_blocking: bool = False) -> OwnMove:
        return OwnMove(to_device(self.value, device, non_blocking=non_blocking))


class OwnAttributes:
    """An object moved by its own ``.to`` whose children no rule reads: walks that read
    it read its attributes."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.pair = (value, 1)

    def to(self, device: torch.device) -> OwnAttributes:
        return OwnAttributes(to_device(self.value, device))


@given(batch=mixed_batches, own=mixed_batches)
def test_find_devices_reads_own_attributes_as_the_full_walk_asked_to(batch: Any, own: Any) -> None:
    """An object with its own ``.to`` and no rule for its children, in a batch: the full
    walk with ``attributes`` (a check that moves nothing) lists what find_devices lists,
    through its attributes; without, neither the object's tensors nor more."""
    top = [batch, OwnAttributes(own), {"cfg": OwnAttributes(own)}]
    found: dict[torch.device, list[str]] = {}
    for path, tensor in _walk.iter_tensors(top, "batch", modules=True, attributes=True):
        found.setdefault(tensor.device, []).append(path)
    assert found == find_devices(top, name="batch")
    assert full_paths(top) == full_paths([batch], "batch")
    event("the object holds tensors" if full_paths(own) else "the object holds none")


@given(batch=mixed_batches, own=st.none() | mixed_batches)
def test_collect_finds_each_tensor_of_the_full_walk_once(batch: Any, own: Any) -> None:
    """collect's two tables hold, between them and each once, every tensor the full walk
    meets outside modules; ``inside`` only those met in an object moved by its own ``.to``
    and nowhere else."""
    obj = batch if own is None else [batch, OwnMove(own), batch]
    found, inside, _ = _walk.collect(obj)
    assert not found.keys() & inside.keys()
    assert {id(t) for _, t in _walk.iter_tensors(obj)} == found.keys() | inside.keys()
    assert {id(t) for _, t in _walk.iter_tensors(batch)} == found.keys()
    event("some inside an own .to" if inside else "none inside an own .to")


@given(batch=mixed_batches, own=mixed_batches, with_module=st.booleans())
def test_tensors_within_lists_each_tensor_of_the_full_walk_once(
    batch: Any, own: Any, with_module: bool
) -> None:
    """What an object's own ``.to`` may copy, read without paths: each distinct tensor the
    full walk meets, inside objects with their own ``.to`` and modules too, once."""
    module = torch.nn.Linear(1, 1) if with_module else None
    obj = OwnMove([batch, OwnMove(own), module, batch])
    listed = [id(tensor) for tensor in _walk.tensors_within(obj)]
    assert len(listed) == len(set(listed))
    assert set(listed) == {id(t) for _, t in _walk.iter_tensors(obj, modules=True)}


atoms = st.lists(
    st.integers()
    | st.floats()
    | st.booleans()
    | st.none()
    | st.text(max_size=2)
    | st.binary(max_size=2),
    min_size=64,
    max_size=70,
)
"""Long lists of what never holds a tensor (token ids, file names): passed over whole."""


@given(batch=mixed_batches, ids=atoms, at=st.integers(0, 70), as_tuple=st.booleans())
def test_a_long_list_of_numbers_and_text_is_passed_over_and_anything_else_in_it_found(
    batch: Any, ids: list[Any], at: int, as_tuple: bool
) -> None:
    """A long list of numbers, strings and None is taken whole by every walk (the move gives
    it back as it is); one that also holds a tensor or a container, anywhere, is walked."""
    at = min(at, len(ids))
    long: list[Any] | tuple[Any, ...] = [*ids[:at], batch, *ids[at:]]
    long = tuple(long) if as_tuple else long
    holder = {"ids": ids, "long": long}
    inner = full_paths(batch, f"batch['long'][{at}]")
    assert inner == find_devices(holder, name="batch") == full_paths(holder)  # plain walk too
    assert _walk.shared_device(holder) == _walk.shared_device(batch)
    found, _, _ = _walk.collect(holder)
    assert {id(t) for _, t in _walk.iter_tensors(batch)} == found.keys()
    moved = to_device(holder, "meta")
    assert moved["ids"] is ids
    assert _walk.all_on(moved, META)
    passed = device_agnostic(device="meta")(lambda given: given)(holder)  # the decorator's walks
    assert passed["ids"] is ids
    assert _walk.all_on(passed, META)
    assert type(moved["long"]) is type(long)
    # the same objects (NaN included: a list compares its items by identity first)
    assert [*moved["long"][:at], *moved["long"][at + 1 :]] == [*ids[:at], *ids[at:]]
    event("tensors in it" if inner else "no tensor in it")


def test_a_long_list_holding_an_int_subclass_or_a_tensor_at_its_end_is_walked() -> None:
    """Only the exact types pass: an IntEnum or a numpy number may be registered or hold
    more, and a tensor after a thousand ints is still moved."""
    ints = list(range(1000))
    moved = to_device({"ids": [*ints, torch.ones(1)]}, "meta")
    assert META == moved["ids"][-1].device
    assert moved["ids"][:-1] == ints
    assert ["obj['ids'][1000]"] == find_devices({"ids": [*ints, torch.ones(1)]})[CPU]
    assert not _kinds.only_atoms([*ints, enum.IntEnum("Small", "A").A])
    assert not _kinds.only_atoms(ints[:63])  # short: walked as it always was
    assert _kinds.only_atoms(ints)
    assert _kinds.only_atoms(tuple(ints))
