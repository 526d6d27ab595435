"""``to_device``, ``find_devices`` and ``register_container``: one example per container
kind, per guarantee and per error, messages asserted line by line.

``meta`` is the second device: tensors there have shapes but no values, so a move from
the CPU to meta is a real move, and a move off meta fails as a move to a lost GPU would.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import types
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from helpers import accelerator
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence

from devicectx import (
    DeviceUnavailableError,
    InvalidDeviceError,
    MoveError,
    device_agnostic,
    find_devices,
    register_container,
    to_device,
    unregister_container,
)
from devicectx.move import _containers
from devicectx.move._alias import TensorMover
from devicectx.move._move import all_on, iter_tensors, move_call, move_to, shared_device
from devicectx.move._walk import NotPlain, plain_device

CPU = torch.device("cpu")
META = torch.device("meta")


class Pair(NamedTuple):
    first: Any
    second: Any


def on_meta(obj: Any) -> bool:
    """Whether every tensor of ``obj`` (by the engine's own listing) is on meta."""
    return all(t.device == META for _, t in iter_tensors(obj))


# Container kinds.


def test_list_and_tuple() -> None:
    """Lists and tuples come back as lists and tuples, every tensor moved."""
    moved = to_device([torch.zeros(2), (torch.ones(1), 3)], "meta")
    assert type(moved) is list
    assert type(moved[1]) is tuple
    assert moved[1][1] == 3
    assert on_meta(moved)


def test_namedtuple() -> None:
    """A namedtuple stays that namedtuple."""
    moved = to_device(Pair(torch.zeros(1), "x"), "meta")
    assert type(moved) is Pair
    assert moved.first.device == META
    assert moved.second == "x"


def test_return_types() -> None:
    """torch.return_types (a structseq) keep their type and field names."""
    result = torch.tensor([[1.0, 5.0], [3.0, 2.0]]).max(dim=0)
    moved = to_device(result, "meta")
    assert type(moved) is type(result)
    assert (moved.values.device, moved.indices.device) == (META, META)


def test_dict_and_ordered_dict() -> None:
    """dict and OrderedDict keep their type, keys and key order."""
    plain = {"b": torch.zeros(1), "a": 1}
    ordered = collections.OrderedDict([("z", torch.zeros(1)), ("y", torch.ones(1))])
    moved_plain, moved_ordered = to_device((plain, ordered), "meta")
    assert list(moved_plain) == ["b", "a"]
    assert type(moved_ordered) is collections.OrderedDict
    assert list(moved_ordered) == ["z", "y"]
    assert on_meta((moved_plain, moved_ordered))


def test_defaultdict_keeps_its_factory() -> None:
    """A defaultdict comes back a defaultdict with the same default factory."""
    moved = to_device(collections.defaultdict(list, {"x": torch.zeros(1)}), "meta")
    assert type(moved) is collections.defaultdict
    assert moved.default_factory is list
    assert moved["missing"] == []


def test_deque_keeps_its_maxlen() -> None:
    """A deque comes back a deque with the same maxlen."""
    moved = to_device(collections.deque([torch.zeros(1), 2], maxlen=4), "meta")
    assert type(moved) is collections.deque
    assert moved.maxlen == 4
    assert moved[0].device == META


def test_set_and_frozenset() -> None:
    """Sets and frozensets of tensors come back as sets and frozensets of moved tensors."""
    moved_set, moved_frozen = to_device(({torch.zeros(1), 1}, frozenset([torch.ones(1)])), "meta")
    assert type(moved_set) is set
    assert type(moved_frozen) is frozenset
    assert on_meta((moved_set, moved_frozen))
    assert 1 in moved_set


@dataclasses.dataclass
class Batch:
    inputs: torch.Tensor
    name: str = "b"
    cache: Any = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        self.extra = "not a field"


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor


@dataclasses.dataclass(frozen=True, slots=True)
class Slotted:
    x: torch.Tensor
    label: str = "s"


@dataclasses.dataclass
class Unset:
    x: torch.Tensor
    later: torch.Tensor = dataclasses.field(init=False)


def test_dataclass_with_init_false_field() -> None:
    """A dataclass keeps its type; fields (init=False ones too) move, other attributes stay."""
    batch = Batch(torch.zeros(1))
    batch.cache = torch.ones(1)
    moved = to_device(batch, "meta")
    assert type(moved) is Batch
    assert (moved.inputs.device, moved.cache.device) == (META, META)
    assert (moved.name, moved.extra) == ("b", "not a field")


def test_frozen_and_slots_dataclasses() -> None:
    """Frozen dataclasses, with or without slots, are rebuilt without calling their setters."""
    frozen, slotted = to_device((Frozen(torch.zeros(1)), Slotted(torch.zeros(1), "k")), "meta")
    assert type(frozen) is Frozen
    assert type(slotted) is Slotted
    assert (frozen.x.device, slotted.x.device, slotted.label) == (META, META, "k")


def test_dataclass_with_a_field_never_set() -> None:
    """An init=False field that was never set is skipped, and stays unset."""
    moved = to_device(Unset(torch.zeros(1)), "meta")
    assert moved.x.device == META
    assert not hasattr(moved, "later")


def test_packed_sequence_keeps_batch_sizes_on_cpu() -> None:
    """A PackedSequence moves its data and indices; batch_sizes stays on the CPU, as torch needs."""
    packed = pack_sequence([torch.ones(3), torch.ones(2)], enforce_sorted=False)
    moved = to_device(packed, "meta")
    assert type(moved) is PackedSequence
    assert (moved.data.device, moved.sorted_indices.device) == (META, META)
    assert moved.batch_sizes is packed.batch_sizes


class TaggedDict(dict[str, Any]):
    tag = "class"


class ReadOnlyMap(Mapping[str, Any]):
    def __init__(self, items: Mapping[str, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def test_mapping_subclasses_are_rebuilt() -> None:
    """A dict subclass keeps its type and attributes; an immutable Mapping is rebuilt."""
    tagged = TaggedDict(x=torch.zeros(1))
    tagged.note = "kept"  # type: ignore[attr-defined]
    moved_tagged, moved_map = to_device((tagged, ReadOnlyMap({"x": torch.zeros(1)})), "meta")
    assert type(moved_tagged) is TaggedDict
    assert moved_tagged.note == "kept"  # type: ignore[attr-defined]
    assert type(moved_map) is ReadOnlyMap
    assert on_meta((moved_tagged, moved_map))


def test_sequence_subclasses_are_rebuilt() -> None:
    """UserList, list and tuple subclasses keep their type."""

    class Row(tuple[Any, ...]):
        pass

    rows = (collections.UserList([torch.zeros(1)]), Row((torch.zeros(1),)))
    user_list, row = to_device(rows, "meta")
    assert (type(user_list), type(row)) == (collections.UserList, Row)
    assert on_meta((user_list, row))


class KeywordMap(ReadOnlyMap):
    """A Mapping whose constructor takes keywords only: it cannot be rebuilt from a dict."""

    def __init__(self, *args: Any, **items: Any) -> None:
        if args:
            raise TypeError("KeywordMap takes keywords only")
        super().__init__(items)


def test_mapping_that_cannot_be_rebuilt_is_refused_not_half_moved() -> None:
    """A Mapping type that takes neither item assignment nor a dict raises MoveError
    saying why, with register_container as the fix; it is not returned half-moved."""
    with pytest.raises(MoveError) as raised:
        to_device({"m": KeywordMap(x=torch.zeros(1))}, "meta")
    assert [
        "to_device() could not move obj['m'] (a KeywordMap) to meta:",
        "    KeywordMap cannot be rebuilt with its tensors moved: it is immutable, and "
        "KeywordMap(dict(new_items)) raised TypeError: KeywordMap takes keywords only",
        "fix: teach it with devicectx.register_container(KeywordMap, children=..., "
        "rebuild=...); or leave it where it is: to_device(obj, 'meta', skip=[\"obj['m']\"])",
    ] == str(raised.value).splitlines()
    assert isinstance(raised.value.__cause__, _containers.CannotRebuild)


def test_mapping_with_nothing_to_move_is_not_rebuilt() -> None:
    """A Mapping that cannot be rebuilt is fine where nothing in it moves."""
    stuck = KeywordMap(x=torch.zeros(1, device="meta"), n=1)
    assert to_device(stuck, "meta") is stuck


def test_mapping_proxy_is_rebuilt_with_its_constructor() -> None:
    """An immutable Mapping that takes a dict, such as a mappingproxy, is rebuilt."""
    proxy = to_device(types.MappingProxyType({"x": torch.zeros(1)}), "meta")
    assert type(proxy) is types.MappingProxyType
    assert META == proxy["x"].device


class Encoding(collections.UserDict[str, Any]):
    """Like Hugging Face's BatchEncoding: a mapping with a .to that works in place."""

    def __init__(self, data: dict[str, Any], encodings: object = None) -> None:
        super().__init__(data)
        self.encodings = encodings

    def to(self, device: Any) -> Encoding:
        self.data = {k: v.to(device) for k, v in self.data.items()}
        return self


def test_object_with_own_to_is_moved_with_it_without_changing_the_input() -> None:
    """An object with its own .to is moved with it, on a copy: the input is left alone."""
    encoding = Encoding({"ids": torch.zeros(2)}, encodings="fast")
    moved = to_device({"enc": encoding}, "meta")["enc"]
    assert type(moved) is Encoding
    assert (moved["ids"].device, moved.encodings) == (META, "fast")
    assert encoding["ids"].device == CPU


def test_object_with_own_to_already_there_comes_back_as_it_is() -> None:
    """An object with a .to whose tensors are on the target already is not moved again."""
    encoding = Encoding({"ids": torch.zeros(2, device="meta")})
    assert to_device(encoding, "meta") is encoding


class ShallowEncoding(Encoding):
    """Like BatchEncoding: its .to moves only the tensors it holds directly."""

    def to(self, device: Any) -> ShallowEncoding:
        self.data = {
            k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.data.items()
        }
        return self


def test_what_an_own_to_leaves_behind_is_moved_as_children() -> None:
    """Tensors an object's own .to leaves behind (a list of them) are moved by the engine,
    sharing copies with the rest of the structure; the input is left alone."""
    x = torch.zeros(3)
    encoding = ShallowEncoding({"ids": torch.zeros(2), "pixels": [x, x[:2]]}, encodings="fast")
    moved = to_device({"enc": encoding, "x": x}, "meta")
    enc = moved["enc"]
    assert (type(enc), enc.encodings) == (ShallowEncoding, "fast")
    assert enc["pixels"][0] is moved["x"]
    assert enc["pixels"][1]._base is moved["x"]
    assert [META] == list(find_devices(moved))
    assert [CPU] == list(find_devices(encoding))


@dataclasses.dataclass
class HalfMover:
    """A dataclass whose .to moves one field and forgets the other."""

    head: torch.Tensor
    rest: list[torch.Tensor]

    def to(self, device: Any) -> HalfMover:
        return HalfMover(self.head.to(device), self.rest)


def test_own_to_that_leaves_tensors_behind_is_refused() -> None:
    """Where the engine cannot finish what an object's own .to left, MoveError names what
    was left behind."""
    with pytest.raises(MoveError) as raised:
        to_device({"h": HalfMover(torch.zeros(1), [torch.zeros(2)])}, "meta")
    assert [
        "to_device() could not move obj['h'] (a HalfMover) to meta:",
        "    HalfMover cannot be rebuilt with its tensors moved: its own .to('meta') left "
        "tensors where they were: obj['h'].rest[0] (cpu)",
        "fix: teach it with devicectx.register_container(HalfMover, children=..., "
        "rebuild=...); or leave it where it is: to_device(obj, 'meta', skip=[\"obj['h']\"])",
    ] == str(raised.value).splitlines()


class Opaque:
    """An object with a .to of its own and no readable children."""

    moves = 0

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def to(self, device: Any) -> Opaque:
        Opaque.moves += 1
        return Opaque(self._tensor.to(device))


def test_own_to_is_trusted_with_what_cannot_be_read() -> None:
    """What an object's own .to moved but the engine cannot read inside it is neither
    moved again nor refused."""
    Opaque.moves = 0
    moved = to_device(Encoding({"opaque": Opaque(torch.zeros(1))}), "meta")
    assert META == moved["opaque"]._tensor.device
    assert 1 == Opaque.moves


@dataclasses.dataclass
class Output(collections.OrderedDict[str, Any]):
    """Like transformers' ModelOutput: a dataclass and an OrderedDict, whose fields that
    are not None are also entries, and whose entries and attributes are set together."""

    logits: Any = None
    loss: Any = None
    hidden: Any = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)


def test_dataclass_that_is_a_mapping_moves_every_view() -> None:
    """Fields, entries, indices of entries and other attributes holding a child all show
    the moved tensor, once each; an entry that is no field is listed by key."""
    out = Output(logits=torch.zeros(2), hidden=(torch.ones(3), torch.ones(4)))
    out["extra"] = torch.zeros(5)
    out.cache = out.logits  # type: ignore[attr-defined]
    moved = to_device(out, "meta")
    assert type(moved) is Output
    assert ["logits", "hidden", "extra"] == list(moved.keys())
    assert META == moved.logits.device
    assert moved.logits is moved["logits"] is moved.cache  # type: ignore[attr-defined]
    assert moved.hidden is moved["hidden"]
    assert moved["extra"] is moved.extra  # type: ignore[attr-defined]
    assert moved.loss is None
    assert "loss" not in moved
    paths = ["out.logits", "out.hidden[0]", "out.hidden[1]", "out['extra']"]
    assert {META: paths} == find_devices(moved, name="out")
    assert CPU == out["logits"].device == out.logits.device


@dataclasses.dataclass
class PlainOutput(dict[str, Any]):
    """A dataclass and a dict whose fields become entries once, at construction."""

    logits: Any = None

    def __post_init__(self) -> None:
        if self.logits is not None:
            self["logits"] = self.logits


def test_views_that_disagree_each_get_their_own_moved_object() -> None:
    """An entry and the field of its name that hold different tensors are two places, and
    each shows its own tensor moved."""
    out = PlainOutput(logits=torch.zeros(2))
    out["logits"] = torch.zeros(3)
    assert {CPU: ["out['logits']", "out.logits"]} == find_devices(out, name="out")
    moved = to_device(out, "meta")
    assert ((3,), (2,)) == (tuple(moved["logits"].shape), tuple(moved.logits.shape))
    assert META == moved["logits"].device == moved.logits.device


def test_views_that_disagree_where_the_type_joins_them_are_refused() -> None:
    """Where the type's own copy makes an entry and a field agree (ModelOutput's does),
    views that disagreed cannot be rebuilt as they were: MoveError says where."""
    out = Output(logits=torch.zeros(2))
    dict.__setitem__(out, "logits", torch.zeros(3))
    with pytest.raises(MoveError) as raised:
        to_device(out, "meta")
    assert [
        "to_device() could not move obj (an Output) to meta:",
        "    Output cannot be rebuilt with its tensors moved: "
        "a copy given the moved children shows another object at .logits",
        "fix: teach it with devicectx.register_container(Output, children=..., "
        "rebuild=...); or leave it where it is: to_device(obj, 'meta', skip=['obj'])",
    ] == str(raised.value).splitlines()


@dataclasses.dataclass
class Snapshot(Mapping[str, Any]):
    """A dataclass whose entries are a copy of its fields taken once: two storages, and
    no way to set an entry."""

    x: Any

    def __post_init__(self) -> None:
        self._entries = {"x": self.x}

    def __getitem__(self, key: str) -> Any:
        return self._entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


@pytest.mark.parametrize("depth_limit", [100, -1])
def test_two_views_that_cannot_agree_are_refused(
    depth_limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dataclass and mapping whose entries cannot be set raises MoveError, on both
    walks, rather than come back with its field moved and its entry not."""
    from devicectx.move import _rebuild

    monkeypatch.setattr(_rebuild, "_DEPTH", depth_limit)
    snapshot = Snapshot(torch.zeros(1))
    with pytest.raises(MoveError) as raised:
        to_device([snapshot], "meta")
    assert [
        "to_device() could not move obj[0] (a Snapshot) to meta:",
        "    Snapshot cannot be rebuilt with its tensors moved: its entry 'x' cannot be set: "
        "TypeError: 'Snapshot' object does not support item assignment",
        "fix: teach it with devicectx.register_container(Snapshot, children=..., "
        "rebuild=...); or leave it where it is: to_device(obj, 'meta', skip=['obj[0]'])",
    ] == str(raised.value).splitlines()
    assert CPU == snapshot["x"].device == snapshot.x.device


def test_tensordict() -> None:
    """A TensorDict is moved with its own .to."""
    tensordict = pytest.importorskip("tensordict")
    td = tensordict.TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2])
    moved = to_device({"td": td}, "meta")["td"]
    assert type(moved) is tensordict.TensorDict
    assert moved["x"].device == META


def test_module_is_moved_in_place() -> None:
    """An nn.Module is moved with module.to, in place: the same module comes back."""
    model = nn.Linear(2, 2)
    moved = to_device({"model": model}, "meta")
    assert moved["model"] is model
    assert model.weight.device == META


def test_skipped_module_stays() -> None:
    """skip=nn.Module leaves modules where they are."""
    model = nn.Linear(2, 2)
    moved = to_device({"model": model, "x": torch.zeros(1)}, "meta", skip=nn.Module)
    assert moved["model"].weight.device == CPU
    assert moved["x"].device == META


def test_non_tensors_come_back_by_identity_and_unconsumed() -> None:
    """Plain values come back as the same objects; iterators and generators are not consumed."""
    iterator = iter([1, 2])
    generator = (i for i in range(2))
    plain = [
        "s",
        b"b",
        3,
        2.5,
        None,
        np.zeros(2),
        range(3),
        torch.Size([2]),
        torch.float16,
        CPU,
        iterator,
        generator,
    ]
    moved = to_device([*plain, torch.zeros(1)], "meta")
    assert all(a is b for a, b in zip(plain, moved, strict=False))
    assert (list(iterator), list(generator)) == ([1, 2], [0, 1])


# Registered containers.


class Holder:
    def __init__(self, left: Any, right: Any, note: str = "") -> None:
        self.left, self.right, self.note = left, right, note


class SubHolder(Holder):
    pass


register_container(
    Holder,
    children=lambda h: [("left", h.left), ("right", h.right)],
    rebuild=lambda h, new: type(h)(*new, note=h.note),
)


class Bag(dict[str, Any]):
    def to(self, device: Any) -> Bag:
        raise AssertionError("a registered type is walked, not moved with .to")


register_container(
    Bag,
    children=lambda b: list(b.items()),
    rebuild=lambda b, new: Bag(zip(b, new, strict=True)),
    keys="item",
)


def test_registered_container_is_moved_and_listed() -> None:
    """A registered type is rebuilt with its own function, and find_devices names its keys."""
    holder = Holder(torch.zeros(1), [torch.zeros(1)], note="n")
    moved = to_device(holder, "meta")
    assert type(moved) is Holder
    assert (moved.left.device, moved.right[0].device, moved.note) == (META, META, "n")
    assert find_devices(holder, name="h") == {CPU: ["h.left", "h.right[0]"]}


def test_registration_covers_subclasses() -> None:
    """A subclass of a registered type uses its registration."""
    moved = to_device(SubHolder(torch.zeros(1), 1), "meta")
    assert type(moved) is SubHolder
    assert moved.left.device == META


def test_registration_wins_over_built_in_rules() -> None:
    """A registered dict subclass with a .to is walked by its registration, not its .to."""
    moved = to_device(Bag(x=torch.zeros(1)), "meta")
    assert type(moved) is Bag
    assert moved["x"].device == META
    assert find_devices(Bag(x=torch.zeros(1)), name="bag") == {CPU: ["bag['x']"]}


@pytest.mark.parametrize(
    ("cls", "kwargs", "error", "expected"),
    [
        (
            object,
            {},
            TypeError,
            [
                "register_container() needs a container class, got <class 'object'>",
                "fix: register_container(MyBatch, children=..., rebuild=...)",
            ],
        ),
        (
            Holder,
            {"children": None},
            TypeError,
            [
                "register_container(Holder, ...): children=None is not callable",
                "fix: pass a function, e.g. children=lambda obj: ...",
            ],
        ),
        (
            Holder,
            {"keys": "index"},
            ValueError,
            [
                "register_container(Holder, ...): keys='index' is not a key style",
                "fix: keys='attr' (paths like obj.left) or keys='item' (paths like obj['left'])",
            ],
        ),
    ],
)
def test_register_container_errors(
    cls: type, kwargs: dict[str, Any], error: type[Exception], expected: list[str]
) -> None:
    """register_container refuses what it cannot use, saying what to pass instead."""
    arguments: dict[str, Any] = {"children": lambda o: [], "rebuild": lambda o, new: o}
    with pytest.raises(error) as raised:
        register_container(cls, **{**arguments, **kwargs})
    assert expected == str(raised.value).splitlines()


# Guarantees.


def test_on_target_comes_back_by_identity() -> None:
    """A tensor, and a structure, with nothing to move come back as the same objects."""
    tensor = torch.zeros(1)
    batch = {"a": [tensor, (tensor, 1)], "b": Pair(tensor, None)}
    assert to_device(tensor, "cpu") is tensor
    assert to_device(batch, "cpu") is batch


def test_unchanged_parts_keep_their_identity() -> None:
    """Containers with nothing to move inside a moved structure come back as themselves."""
    on_meta_already = {"k": torch.zeros(1, device="meta")}
    moved = to_device({"x": torch.zeros(1), "done": on_meta_already}, "meta")
    assert moved["done"] is on_meta_already


def test_input_is_not_changed() -> None:
    """The input structure and its tensors are left as they were."""
    tensor = torch.zeros(2)
    batch = {"x": tensor, "list": [tensor]}
    to_device(batch, "meta")
    assert batch == {"x": tensor, "list": [tensor]}
    assert tensor.device == CPU


def test_dtype_shape_and_strides_kept() -> None:
    """dtype, shape and the strides of a dense non-contiguous tensor are kept."""
    tensor = torch.zeros(2, 3, dtype=torch.float16).t()
    moved = to_device(tensor, "meta")
    assert (moved.dtype, moved.shape, moved.stride()) == (torch.float16, (3, 2), (1, 3))


def test_autograd_history_kept() -> None:
    """A tensor that requires grad moves differentiably: the copy has autograd history."""
    leaf = torch.zeros(2, requires_grad=True)
    moved = to_device(leaf, "meta")
    assert moved.requires_grad
    assert type(moved.grad_fn).__name__ == "ToCopyBackward0"


def test_parameter_stays_a_parameter() -> None:
    """An nn.Parameter comes back an nn.Parameter, with its requires_grad and attributes."""
    frozen = nn.Parameter(torch.zeros(2), requires_grad=False)
    frozen.tag = "kept"  # type: ignore[attr-defined]
    moved = to_device([nn.Parameter(torch.zeros(2)), frozen], "meta")
    assert [type(p) for p in moved] == [nn.Parameter, nn.Parameter]
    assert [p.requires_grad for p in moved] == [True, False]
    assert moved[1].tag == "kept"


def test_one_tensor_twice_is_one_copy() -> None:
    """One tensor reachable at several places becomes one moved tensor at all of them."""
    tensor = torch.zeros(2)
    moved = to_device({"a": tensor, "b": [tensor], "c": Pair(tensor, tensor)}, "meta")
    assert moved["a"] is moved["b"][0] is moved["c"].first is moved["c"].second


def test_shared_container_stays_shared() -> None:
    """One container reachable at several places becomes one rebuilt container."""
    shared = {"x": torch.zeros(1)}
    moved = to_device([shared, shared], "meta")
    assert moved[0] is moved[1]


@pytest.mark.parametrize("base_first", [True, False])
def test_view_and_base_stay_linked(base_first: bool) -> None:
    """A view and its base arrive as a view of the moved base, whichever comes first."""
    base = torch.zeros(4, 4)
    view = base[1:, ::2]
    moved = to_device([base, view] if base_first else [view, base], "meta")
    moved_base, moved_view = moved if base_first else moved[::-1]
    assert moved_view._base is moved_base
    geometry = (view.shape, view.stride(), view.storage_offset())
    assert geometry == (moved_view.shape, moved_view.stride(), moved_view.storage_offset())


def test_view_of_a_view_links_to_the_larger_one() -> None:
    """A slice inside a larger slice of the same (absent) base becomes a view of its copy."""
    base = torch.zeros(10)
    outer = base[2:8]
    inner = outer[1:3]
    moved_inner, moved_outer = to_device([inner, outer], "meta")
    assert moved_inner._base is moved_outer
    assert moved_outer.untyped_storage().nbytes() == 6 * 4


def test_view_without_its_base_moves_only_its_elements() -> None:
    """A view whose base is not in the structure is copied alone, never its whole base."""
    base = torch.zeros(1000)
    moved = to_device({"row": base[:10]}, "meta")["row"]
    assert moved._base is None
    assert moved.untyped_storage().nbytes() == 10 * 4


def test_view_of_a_parameter_links_to_the_moved_parameter() -> None:
    """A view of a parameter in the same structure is a view of the moved parameter."""
    param = nn.Parameter(torch.zeros(4))
    moved_view, moved_param = to_device([param[:2], param], "meta")
    assert type(moved_param) is nn.Parameter
    assert moved_view._base is moved_param


def test_views_are_differentiable() -> None:
    """A view re-made on its moved base keeps requires_grad and has autograd history."""
    base = torch.zeros(4, requires_grad=True)
    moved_base, moved_view = to_device([base, base[1:]], "meta")
    assert moved_view._base is moved_base
    assert moved_view.requires_grad
    assert type(moved_view.grad_fn).__name__ == "AsStridedBackward0"


def test_cycle_does_not_loop() -> None:
    """A list that holds itself is moved; the inner reference is the original list."""
    cyclic: list[Any] = [torch.zeros(1)]
    cyclic.append(cyclic)
    moved = to_device(cyclic, "meta")
    assert moved[0].device == META
    assert moved[1] is cyclic
    assert find_devices(cyclic) == {CPU: ["obj[0]"]}
    assert not all_on(cyclic, META)


def test_depth_beyond_the_recursion_limit() -> None:
    """A 100,000-deep nested list is moved, listed and checked."""
    deep: Any = torch.zeros(1)
    for _ in range(100_000):
        deep = [deep]
    moved = to_device(deep, "meta")
    while isinstance(moved, list):
        moved = moved[0]
    assert moved.device == META
    assert list(find_devices(deep)) == [CPU]
    assert not all_on(deep, META)


# skip=.


# The same inputs moved again, on purpose.
@pytest.mark.filterwarnings("ignore::devicectx.RepeatedMoveWarning")
def test_skip_forms() -> None:
    """skip takes a type, a key, a path, a predicate, or a list of them."""
    batch = {
        "x": torch.zeros(1),
        "meta": {"ids": torch.zeros(1)},
        "p": nn.Parameter(torch.zeros(1)),
    }
    cases: list[tuple[Any, set[str]]] = [
        (nn.Parameter, {"obj['p']"}),
        ("meta", {"obj['meta']['ids']"}),
        ("ids", {"obj['meta']['ids']"}),
        ("obj['x']", {"obj['x']"}),
        (lambda path, value: path.endswith("['p']"), {"obj['p']"}),
        (["x", nn.Parameter], {"obj['x']", "obj['p']"}),
    ]
    for skip, expected_kept in cases:
        moved = to_device(batch, "meta", skip=skip)
        assert expected_kept == set(find_devices(moved).get(CPU, [])), skip


def test_skip_everything_returns_the_input() -> None:
    """A skip that matches the root leaves the whole input as it is."""
    batch = {"x": torch.zeros(1)}
    assert to_device(batch, "meta", skip=lambda path, value: path == "obj") is batch


def test_skip_error() -> None:
    """A skip item that is no type, path, key or predicate is refused, with the forms listed."""
    with pytest.raises(TypeError) as raised:
        to_device([], "meta", skip=[["not hashable"]])
    assert [
        "skip=[['not hashable']]: ['not hashable'] is not a type, a path, a key or a predicate",
        "fix: skip=[torch.nn.Module, \"obj['meta']\", 'labels', lambda path, value: ...]",
    ] == str(raised.value).splitlines()


def is_big(value: torch.Tensor) -> bool:
    """A skip predicate with the wrong signature: it takes the value only."""
    return value.numel() > 10


def test_skip_predicate_with_a_wrong_signature_is_named() -> None:
    """A predicate that cannot take (path, value) is reported as the predicate's error,
    with the signature it must have, the original error chained."""
    with pytest.raises(TypeError) as direct:
        is_big("obj", {})  # type: ignore[call-arg]
    with pytest.raises(MoveError) as raised:
        to_device({"x": torch.zeros(2)}, "meta", skip=is_big)
    line = is_big.__code__.co_firstlineno
    assert [
        f"to_device(): the skip predicate is_big (test_move.py:{line}) raised on obj:",
        f"    TypeError: {direct.value}",
        "skip predicates are called as predicate(path, value) -> bool, "
        "for every object from the root down",
        "fix: def is_big(path: str, value: object) -> bool: ...",
    ] == str(raised.value).splitlines()
    assert isinstance(raised.value.__cause__, TypeError)


def test_skip_predicate_that_raises_inside_is_named_with_the_path() -> None:
    """A predicate of the right signature that raises is named with the path it was
    asked about; the fix is in its body."""

    def needs_tensors(path: str, value: Any) -> bool:
        return bool(value.numel() > 10)

    with pytest.raises(MoveError) as raised:
        to_device({"x": torch.zeros(2), "n": 3}, "meta", skip=["n", needs_tensors])
    line = needs_tensors.__code__.co_firstlineno
    name = "test_skip_predicate_that_raises_inside_is_named_with_the_path.<locals>.needs_tensors"
    assert [
        f"to_device(): the skip predicate {name} (test_move.py:{line}) raised on obj:",
        "    AttributeError: 'dict' object has no attribute 'numel'",
        "skip predicates are called as predicate(path, value) -> bool, "
        "for every object from the root down",
        f"fix: make {name} return True or False for every (path, value) it is given",
    ] == str(raised.value).splitlines()
    assert isinstance(raised.value.__cause__, AttributeError)


def per_dimension(path: str, value: Any) -> bool:
    """A skip predicate that fails on a 0-dim tensor."""
    return isinstance(value, torch.Tensor) and 1 / value.dim() > 0.5


def test_skip_predicate_error_below_the_root_names_the_path() -> None:
    """The path in a predicate's error is where the object it failed on sits."""
    with pytest.raises(MoveError) as raised:
        to_device({"ids": [torch.zeros(2), torch.tensor(1)]}, "meta", skip=per_dimension)
    line = per_dimension.__code__.co_firstlineno
    assert [
        f"to_device(): the skip predicate per_dimension (test_move.py:{line}) raised on "
        "obj['ids'][1]:",
        "    ZeroDivisionError: division by zero",
        "skip predicates are called as predicate(path, value) -> bool, "
        "for every object from the root down",
        "fix: make per_dimension return True or False for every (path, value) it is given",
    ] == str(raised.value).splitlines()


# non_blocking.


@pytest.mark.parametrize(
    ("target", "asked", "used"),
    [
        ("cuda:0", True, True),
        ("xpu:0", True, True),
        ("cuda:0", False, False),
        ("cpu", True, False),
        ("mps:0", True, False),
        ("meta", True, False),
    ],
)
def test_non_blocking_only_to_accelerators_other_than_mps(
    target: str, asked: bool, used: bool
) -> None:
    """non_blocking is honoured for copies to CUDA-like accelerators, never to CPU or MPS."""
    assert used == TensorMover(torch.device(target), asked).non_blocking


@pytest.mark.requires_device("accelerator")
def test_accelerator_round_trip_keeps_values_views_and_gradients() -> None:
    """cpu -> accelerator -> cpu keeps shared memory, and gradients reach the originals."""
    device = accelerator()
    base = torch.arange(6.0)
    moved = to_device({"base": base, "view": base[2:4], "again": base}, device, non_blocking=True)
    assert moved["view"]._base is moved["base"] is moved["again"]
    moved["base"][2] = 100.0
    assert moved["view"][0].item() == 100.0
    leaf = torch.arange(6.0, requires_grad=True)
    back = to_device(to_device([leaf, leaf[2:4]], device), "cpu", non_blocking=True)
    back[1].sum().backward()
    assert leaf.grad is not None
    assert leaf.grad.tolist() == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]


# coalesce= (staged moves are tested in test_staging.py).


def test_coalesce_false_is_taken_by_every_entry_point() -> None:
    """to_device, move_to and move_call take coalesce=False, and keep every guarantee."""
    ids = torch.ones(1)
    batch = {"x": torch.zeros(2), "ids": [ids, ids]}
    for moved in (
        to_device(batch, "meta", coalesce=False),
        move_to(batch, META, coalesce=False),
        move_call((batch,), {}, META, coalesce=False)[0][0],
    ):
        assert on_meta(moved)
        assert moved["ids"][0] is moved["ids"][1]


@pytest.mark.requires_device("accelerator")
def test_coalesce_false_and_true_give_the_same_values_on_the_accelerator() -> None:
    """To the accelerator, the staged move and the per-tensor one give the same tensors."""
    device = accelerator()
    batch = {"ids": [torch.arange(i + 1) for i in range(16)], "x": torch.randn(512, 512)}
    staged, alone = to_device(batch, device), to_device(batch, device, coalesce=False)
    for a, b in zip(iter_tensors(staged), iter_tensors(alone), strict=True):
        assert a[0] == b[0]
        assert torch.equal(a[1], b[1])
        assert a[1].stride() == b[1].stride()


# Errors.


class Refusing(torch.Tensor):
    """A tensor subclass whose .to fails."""

    def to(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("cannot leave\nthis device")


class CountingTo:
    """An object with a .to that counts its calls."""

    calls = 0

    def to(self, device: Any) -> CountingTo:
        CountingTo.calls += 1
        return self


def test_unknown_device_raises_before_anything_moves() -> None:
    """A malformed or missing device raises resolve_device's error before any .to runs."""
    with pytest.raises(InvalidDeviceError) as raised:
        to_device(CountingTo(), "gpu")
    assert str(raised.value).startswith("invalid device 'gpu': unknown device type 'gpu'")
    with pytest.raises(DeviceUnavailableError):
        to_device(CountingTo(), "cpu:3")
    assert CountingTo.calls == 0


def test_move_error_names_the_path() -> None:
    """A tensor whose .to fails raises MoveError naming its path, the original error chained."""
    refusing = torch.zeros(2, 3).as_subclass(Refusing)
    with pytest.raises(MoveError) as raised:
        to_device({"feats": [1, 2, refusing]}, "meta")
    assert [
        "to_device() could not move obj['feats'][2] (a Refusing of shape (2, 3), "
        "torch.float32, on cpu) to meta:",
        "    RuntimeError: cannot leave",
        "    this device",
        "fix: leave it where it is: to_device(obj, 'meta', skip=[\"obj['feats'][2]\"])",
    ] == str(raised.value).splitlines()
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert isinstance(raised.value, RuntimeError)


@pytest.mark.parametrize("depth_limit", [100, -1])
def test_move_error_path_through_every_kind(
    depth_limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path in a MoveError is right through each kind of container, on both walks."""
    from devicectx.move import _rebuild

    monkeypatch.setattr(_rebuild, "_DEPTH", depth_limit)
    stuck = torch.zeros(1, device="meta")
    batch = {"a": [Pair(1, Frozen(Holder(0, (stuck,))))]}
    with pytest.raises(MoveError) as raised:
        to_device(batch, "cpu")
    first = str(raised.value).splitlines()[0]
    assert first.startswith("to_device() could not move obj['a'][0].second.x.right[0] (")


class Broken:
    """A registered container whose children function fails."""


register_container(Broken, children=lambda b: 1 / 0, rebuild=lambda b, new: b)


@pytest.mark.parametrize("depth_limit", [100, -1])
def test_move_error_from_a_registered_container(
    depth_limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registered container whose functions fail raises MoveError naming it, on both walks."""
    from devicectx.move import _rebuild

    monkeypatch.setattr(_rebuild, "_DEPTH", depth_limit)
    for batch, path in [({"k": [Broken()]}, "obj['k'][0]"), (Broken(), "obj")]:
        with pytest.raises(MoveError) as raised:
            to_device(batch, "meta")
        assert [
            f"to_device() could not move {path} (a Broken) to meta:",
            "    ZeroDivisionError: division by zero",
            f"fix: leave it where it is: to_device(obj, 'meta', skip=[{path!r}])",
        ] == str(raised.value).splitlines()


def test_move_error_from_a_module() -> None:
    """A module that cannot be moved raises MoveError naming where it sits."""
    with pytest.raises(MoveError) as raised:
        to_device({"model": nn.Linear(1, 1, device="meta")}, "cpu")
    assert [
        "to_device() could not move obj['model'] (a Linear) to cpu:",
        "    NotImplementedError: Cannot copy out of meta tensor; no data! Please use "
        "torch.nn.Module.to_empty() instead of torch.nn.Module.to() when moving module from "
        "meta to a different device.",
        "fix: leave it where it is: to_device(obj, 'cpu', skip=[\"obj['model']\"])",
    ] == str(raised.value).splitlines()


# find_devices.


def test_find_devices_paths_as_a_user_writes_them() -> None:
    """Paths use [key], [index], .field and list(set)[i]; devices and paths in walk order."""
    model = nn.Sequential(nn.Linear(1, 1, bias=False))
    batch = {
        "mask": torch.zeros(1, device="meta"),
        "xs": [0, 1, torch.zeros(1)],
        "out": Batch(torch.zeros(1)),
        "pair": Pair(torch.zeros(1), None),
        "tags": {torch.zeros(1)},
        "model": model,
    }
    assert find_devices(batch, name="batch") == {
        META: ["batch['mask']"],
        CPU: [
            "batch['xs'][2]",
            "batch['out'].inputs",
            "batch['pair'].first",
            "list(batch['tags'])[0]",
            "batch['model'][0].weight",
        ],
    }


def test_find_devices_of_a_bare_tensor_and_of_nothing() -> None:
    """A bare tensor's path is the name; a structure without tensors finds nothing."""
    assert find_devices(torch.zeros(1), name="x") == {CPU: ["x"]}
    assert find_devices({"a": [1, "b"]}) == {}


def test_find_devices_lists_every_place() -> None:
    """A tensor held at two places is listed at both."""
    tensor = torch.zeros(1)
    assert find_devices([tensor, {"k": tensor}]) == {CPU: ["obj[0]", "obj[1]['k']"]}


@pytest.mark.parametrize("length", [1, 255, 256, 257, 600])
def test_find_devices_indexes_long_lists(length: int) -> None:
    """Every index is right in a list of any length, and in a list nested at any index."""
    tensor = torch.zeros(1)
    xs: list[object] = [tensor] * length
    xs[-1] = (tensor, tensor)
    expected = [f"xs[{i}]" for i in range(length - 1)] + [f"xs[{length - 1}][{i}]" for i in (0, 1)]
    assert find_devices(xs, name="xs") == {CPU: expected}


# The internal API of the decorator.


def test_iter_tensors_leaves_modules_unless_asked() -> None:
    """iter_tensors does not look into modules unless modules=True."""
    batch = {"model": nn.Linear(1, 1), "x": torch.zeros(1)}
    assert [path for path, _ in iter_tensors(batch, "b")] == ["b['x']"]
    listed = [path for path, _ in iter_tensors(batch, "b", modules=True)]
    assert listed == ["b['model'].weight", "b['model'].bias", "b['x']"]


def test_all_on() -> None:
    """all_on is True exactly when every tensor is on the device; skip_types are ignored."""
    model = nn.Linear(1, 1)
    assert all_on({"a": [torch.zeros(1)], "b": (1, "x")}, CPU)
    assert not all_on({"a": [torch.zeros(1, device="meta")]}, CPU)
    assert not all_on([model], META)
    assert all_on([model, torch.zeros(1, device="meta")], META, (nn.Module,))
    assert not all_on([CountingTo()], CPU)  # a .to whose tensors cannot be read


def test_move_to_with_a_resolved_device_and_type_skip() -> None:
    """move_to takes a resolved device and leaves skipped types alone."""
    model = nn.Linear(1, 1)
    args = (torch.zeros(1), model)
    moved_args, moved_kwargs = move_to((args, {"k": torch.zeros(1)}), META, skip=nn.Module)
    assert moved_args[0].device == META
    assert moved_args[1] is model
    assert model.weight.device == CPU
    assert moved_kwargs["k"].device == META


def test_move_call_shares_copies_and_names_parameters() -> None:
    """move_call moves a call's arguments as one structure; errors name the parameter."""
    tensor = torch.zeros(1)
    args, kwargs = move_call((tensor, 1, tensor), {"again": tensor}, META, names=["x"])
    assert args[0] is args[2] is kwargs["again"]
    same = (torch.zeros(1, device="meta"),), {}
    assert move_call(*same, META) == same
    with pytest.raises(MoveError) as raised:
        move_call((1, torch.zeros(1, device="meta")), {}, CPU, names=["x"], rest="xs", who="f()")
    assert [
        "f() could not move xs[0] (a Tensor of shape (1,), torch.float32, on meta) to cpu:",
        "    NotImplementedError: Cannot copy out of meta tensor; no data!",
        "fix: move it yourself, or leave the argument out of the move: "
        "@device_agnostic(exclude=('xs',))",
    ] == str(raised.value).splitlines()


def test_plain_device_answers_for_plain_batches_only() -> None:
    """The decorator's fast walk gives the one device of a batch of dicts, lists, tuples,
    tensors and scalars; at anything else, or tensors on two devices, it hands over."""
    cpu, meta = torch.zeros(1), torch.zeros(1, device="meta")
    assert CPU == plain_device(({"a": [cpu, (cpu, 1)], "b": "x"}, cpu))
    assert plain_device(({"a": [1, None]}, 2.0)) is None
    for values in [
        (cpu, {"a": [meta]}),  # two devices
        (nn.Parameter(torch.zeros(1)),),  # a tensor subclass
        (nn.Linear(1, 1),),  # a module
        (collections.OrderedDict(a=cpu),),  # a dict subclass
        (Pair(cpu, cpu),),  # a namedtuple
    ]:
        with pytest.raises(NotPlain):
            plain_device(values)


def test_plain_device_hands_over_cycles_and_deep_nesting() -> None:
    """A cycle, or nesting past the fast walk's depth, goes to the full walk: no
    RecursionError."""
    cycle: list[Any] = [torch.zeros(1)]
    cycle.append(cycle)
    deep: list[Any] = [torch.zeros(1)]
    for _ in range(100):
        deep = [deep]
    for values in [(cycle,), (deep,)]:
        with pytest.raises(NotPlain):
            plain_device(values)
        assert CPU == shared_device(values)


@pytest.fixture
def registry_restored() -> Iterator[None]:
    """The test's registration of ``dict`` is taken back afterwards."""
    yield
    unregister_container(dict)


@pytest.mark.usefixtures("registry_restored")
def test_registering_a_builtin_container_turns_the_fast_walk_off() -> None:
    """A registered ``dict`` is walked the registered way, by the decorator too: a tensor
    under its hidden key does not choose the target."""
    register_container(
        dict,
        children=lambda d: [(k, v) for k, v in d.items() if k != "hidden"],
        rebuild=lambda d, new: {
            **d,
            **dict(zip([k for k in d if k != "hidden"], new, strict=True)),
        },
        keys="item",
    )
    with pytest.raises(NotPlain):
        plain_device(({"seen": torch.zeros(1)},))

    @device_agnostic
    def make(batch: dict[str, torch.Tensor]) -> torch.device:
        return torch.zeros(1).device

    assert CPU == make({"hidden": torch.zeros(1, device="meta")})


def test_find_devices_looks_into_a_shared_container_once() -> None:
    """A plain container held at several places, or reached again through a cycle below
    the top, is listed at the first place only."""
    tensor = torch.zeros(1)
    inner = [tensor]
    assert {CPU: ["obj['a'][0]"]} == find_devices({"a": inner, "b": (inner, {"c": inner})})
    looped: dict[str, Any] = {"x": tensor}
    outer = [looped]
    looped["loop"] = outer
    assert {CPU: ["obj[0]['x']"]} == find_devices(outer)


# What the peer libraries' suites showed missing.


class MovesInPlace:
    """An object whose .to moves its tensor in place and forgets `return self`."""

    def __init__(self) -> None:
        self.a = torch.ones(2)

    def to(self, device: Any) -> None:
        self.a = self.a.to(device)


@dataclasses.dataclass
class MovesInPlaceData:
    """The same as a dataclass: its field can be read, so what its .to did is checked."""

    a: torch.Tensor
    b: torch.Tensor

    def to(self, device: Any) -> None:
        self.a = self.a.to(device)


def test_an_own_to_that_returns_none_keeps_the_object() -> None:
    """A .to that moves in place and returns None gives the object, moved, never None,
    and the input is untouched (its copy was moved)."""
    obj = MovesInPlace()

    moved = to_device({"b": obj}, "meta")["b"]

    assert type(moved) is MovesInPlace
    assert META == moved.a.device
    assert CPU == obj.a.device


def test_an_own_to_that_returns_none_is_checked_like_any_other() -> None:
    """What such a .to leaves behind is found, as for any object with its own .to."""
    obj = MovesInPlaceData(torch.ones(2), torch.ones(2))

    with pytest.raises(MoveError, match=r"its own \.to\('meta'\) left tensors where they were"):
        to_device(obj, "meta")


def test_an_own_to_that_returns_none_under_the_decorator() -> None:
    """The decorated body gets the object moved, not None."""

    @device_agnostic(device="meta")
    def body(obj: MovesInPlace) -> torch.device:
        return obj.a.device

    assert META == body(MovesInPlace())


def test_structseq_with_hidden_fields_is_moved_and_listed() -> None:
    """time.struct_time holds fields no position shows (tm_zone): rebuilt through
    __reduce__, with its type and hidden fields, and find_devices sees its tensors."""
    import time

    st = time.struct_time((torch.ones(1), *range(2, 10)), {"tm_zone": "UTC", "tm_gmtoff": 0})

    moved = to_device(st, "meta")

    assert type(moved) is time.struct_time
    assert META == moved[0].device
    assert ("UTC", 0, 2) == (moved.tm_zone, moved.tm_gmtoff, moved.tm_mon)
    assert {CPU: ["st[0]"]} == find_devices(st, name="st")


def test_structseq_with_hidden_fields_and_no_tensor_comes_back_as_itself() -> None:
    """os.stat_result has hidden fields and no tensor: nothing to rebuild."""
    import os

    stat = os.stat(".")

    assert stat is to_device(stat, "meta")


def test_to_device_with_a_real_move_traces_with_fullgraph() -> None:
    """to_device moving a batch compiles with fullgraph=True (no graph break), as
    accelerate's send_to_device does: on torch 2.6 too, whose dynamo cannot trace id()
    of a dict."""
    compiled = torch.compile(lambda batch: to_device(batch, "meta"), fullgraph=True)

    moved = compiled({"a": torch.zeros(2), "b": [torch.ones(3)]})

    assert [META, META] == [moved["a"].device, moved["b"][0].device]


def test_traced_move_copies_a_shared_tensor_once_and_compiles_once_per_structure() -> None:
    """Under torch.compile a tensor held at three places is moved once (one copy at each
    place), what holds no tensor to move comes back as itself, and a new batch of the
    same structure runs the same compiled code: no id() guard on its tensors."""
    compiles = []

    def backend(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        compiles.append(graph)
        return graph.forward

    compiled = torch.compile(lambda batch: to_device(batch, "meta"), backend=backend)
    to_device({}, "meta")  # the resolution cache filled: it is read, and guarded, when tracing
    for _ in range(3):
        tensor = torch.ones(2)
        done = {"x": torch.zeros(1, device="meta")}
        batch = {"t": tensor, "again": [tensor, (tensor, 3)], "done": done}
        moved = compiled(batch)

    assert 1 == len(compiles)
    assert META == moved["t"].device
    assert moved["t"] is moved["again"][0] is moved["again"][1][0]
    assert done is moved["done"]
    assert CPU == tensor.device


@dataclasses.dataclass
class WithCache:
    x: torch.Tensor

    @functools.cached_property
    def doubled(self) -> torch.Tensor:
        return self.x * 2


def test_cached_property_is_dropped_and_recomputed_on_the_new_device() -> None:
    """A dataclass's cached_property holding a tensor is not carried to the moved copy:
    read again, it is worked out from the moved fields; the input keeps its own."""
    obj = WithCache(torch.ones(2))
    cached = obj.doubled

    moved = to_device(obj, "meta")

    assert "doubled" not in vars(moved)
    assert META == moved.doubled.device
    assert obj.doubled is cached


def test_cached_property_of_a_frozen_dataclass_is_dropped_too() -> None:
    """Frozen dataclasses keep cached values in their __dict__ too: dropped the same."""

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        x: torch.Tensor

        @functools.cached_property
        def total(self) -> torch.Tensor:
            return self.x.sum()

    obj = Frozen(torch.ones(2))
    _ = obj.total

    assert META == to_device(obj, "meta").total.device


class CachedTotal:
    """A container's sum of its tensors, cached as a cached_property caches it."""

    @functools.cached_property
    def total(self) -> torch.Tensor:
        values = self.values() if isinstance(self, Mapping) else self
        return sum(values)  # type: ignore[call-overload, no-any-return]


class CachedDict(CachedTotal, dict):  # type: ignore[type-arg]
    pass


class CachedList(CachedTotal, list):  # type: ignore[type-arg]
    pass


class CachedUserDict(CachedTotal, collections.UserDict):  # type: ignore[type-arg]
    pass


class CachedSet(CachedTotal, set):  # type: ignore[type-arg]
    pass


@pytest.mark.parametrize(
    "make",
    [
        lambda: CachedDict(a=torch.ones(2), b=torch.ones(2)),
        lambda: CachedList([torch.ones(2), torch.ones(2)]),
        lambda: CachedUserDict(a=torch.ones(2), b=torch.ones(2)),
        lambda: CachedSet([torch.ones(2), torch.ones(2)]),
    ],
    ids=["dict", "list", "UserDict", "set"],
)
def test_cached_property_of_a_container_subclass_is_dropped_too(make: Any) -> None:
    """A dict, list, set or UserDict subclass's cached_property is worked out again from
    the moved entries, as a dataclass's is: no tensor is left on the old device."""
    obj = make()
    cached = obj.total

    moved = to_device(obj, "meta")

    assert "total" not in vars(moved)
    assert {META} == set(find_devices(moved))
    assert META == moved.total.device
    assert obj.total is cached


class LabelledParameter(nn.Parameter):
    """A subclass of nn.Parameter: rebuilt by its own type."""


def test_parameter_subclass_stays_its_type_with_its_attributes() -> None:
    """A Parameter subclass moves as its own type, a leaf, with its attributes."""
    param = LabelledParameter(torch.ones(2))
    param.note = "kept"  # type: ignore[attr-defined]

    moved = to_device(param, "meta")

    assert type(moved) is LabelledParameter
    assert (True, True, "kept") == (moved.is_leaf, moved.requires_grad, moved.note)


class Wrapped(torch.Tensor):
    """A tensor subclass whose constructor is not Parameter's: as DTensor's is not."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Wrapped:  # type: ignore[misc]
        return torch.Tensor._make_subclass(cls, data)


def test_parameter_of_a_tensor_subclass_stays_a_parameter_of_it() -> None:
    """nn.Parameter(subclass instance) is the subclass flagged as a parameter (how every
    FSDP2 and tensor-parallel parameter is made): it moves, and stays both."""
    param = nn.Parameter(Wrapped(torch.ones(2)))
    assert type(param) is Wrapped

    moved = to_device({"w": param}, "meta")["w"]

    assert type(moved) is Wrapped
    assert isinstance(moved, nn.Parameter)
    assert META == moved.device


def test_a_failure_in_our_own_rebuild_says_it_is_our_bug(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where devicectx's own code fails, the fix says so, instead of telling the user to
    leave their tensor behind as if it were their mistake."""
    from devicectx.move import _alias

    def broken(tensor: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
        raise TypeError("boom")

    monkeypatch.setattr(_alias, "_parameter", broken)

    with pytest.raises(MoveError) as caught:
        to_device({"w": nn.Parameter(torch.ones(2))}, "meta")

    expected = [
        "to_device() could not move obj['w'] (a Parameter of shape (2,), torch.float32, on cpu)"
        " to meta:",
        "    TypeError: boom",
        "fix: none needed in your code: this is a bug in devicectx; please report it with "
        "this message. Meanwhile, leave it where it is: "
        "to_device(obj, 'meta', skip=[\"obj['w']\"])",
    ]
    assert expected == str(caught.value).splitlines()
