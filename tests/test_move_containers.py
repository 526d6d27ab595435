"""``to_device`` on every container kind, and ``register_container``: one example per kind,
with what each keeps (types, factories, fields, views of one object) and where the engine
refuses rather than half-moves.

``meta`` is the second device: tensors there have shapes but no values, so a move from
the CPU to meta is a real move.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import keyword
import re
import types
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from helpers import placed, tensors_of
from hypothesis import given
from hypothesis import strategies as st
from move_subjects import Batch, Frozen, Holder, Pair, SubHolder, on_meta
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence

from devicectx import (
    DeviceMismatchError,
    DeviceWarning,
    MoveError,
    device_agnostic,
    find_devices,
    prefetch,
    register_container,
    to_device,
)
from devicectx._errors import with_article
from devicectx.move import _containers
from devicectx.testing.strategies import nested, tensors

CPU = torch.device("cpu")
META = torch.device("meta")


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


def test_a_state_dicts_metadata_is_kept() -> None:
    """A module's ``state_dict()`` is an OrderedDict holding ``_metadata`` (module
    versions, which ``load_state_dict`` reads) beside its entries: moved, it keeps it, as
    a dict subclass keeps its attributes; the original keeps its own."""
    state = nn.BatchNorm1d(3).state_dict()
    moved = to_device(state, "meta")
    assert state._metadata == moved._metadata  # type: ignore[attr-defined]
    assert on_meta(list(moved.values()))
    assert all(t.device == torch.device("cpu") for t in state.values())


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


@dataclasses.dataclass(frozen=True, slots=True)
class Slotted:
    x: torch.Tensor
    label: str = "s"


@dataclasses.dataclass
class Unset:
    x: torch.Tensor
    later: torch.Tensor = dataclasses.field(init=False)


def test_dataclass_with_init_false_field() -> None:
    """A dataclass keeps its type; fields (init=False ones too) move, a plain value set
    beside them comes back as it is."""
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


def test_distributions_are_moved_with_their_parameters() -> None:
    """A ``torch.distributions`` object (an RL policy's output) is moved: a new one of its
    class, its parameters and cached values on the target (``logits`` and ``_param``, one
    tensor, stay one), a wrapped distribution and a transform's tensors too; sampling it
    works there, and the original is unchanged. find_devices sees its tensors."""
    dist = torch.distributions
    logits = torch.randn(2, 3, requires_grad=True)
    categorical = dist.Categorical(logits=logits)
    categorical.probs  # noqa: B018  (a lazy property: cached in the object once read)
    normal = dist.Independent(dist.Normal(torch.zeros(2), torch.ones(2)), 1)
    affine = dist.transforms.AffineTransform(torch.zeros(2), torch.full((2,), 2.0))
    squashed = dist.TransformedDistribution(dist.Normal(torch.zeros(2), torch.ones(2)), [affine])
    step = {"pi": categorical, "value": normal, "action": squashed}
    assert {CPU} == set(find_devices(step))

    moved = to_device(step, "meta")

    assert type(moved["pi"]) is dist.Categorical
    assert moved["pi"] is not categorical
    assert moved["pi"].logits is moved["pi"]._param
    assert META == moved["pi"].logits.device == moved["pi"].probs.device
    assert moved["pi"].logits.requires_grad
    assert META == moved["value"].base_dist.loc.device == moved["value"].base_dist.scale.device
    assert META == moved["action"].transforms[0].loc.device
    assert META == moved["action"].base_dist.scale.device
    sample = moved["pi"].sample()
    assert ((2,), META) == (sample.shape, sample.device)
    assert CPU == categorical.logits.device == categorical.probs.device
    assert CPU == affine.scale.device
    assert {META} == set(find_devices(moved))


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
        "    KeywordMap cannot be rebuilt with its tensors moved: a copy of it takes no item "
        "assignment (it is no MutableMapping), and "
        "KeywordMap(dict(new_items)) raised TypeError: KeywordMap takes keywords only",
        "fix: teach it with devicectx.register_container(KeywordMap, "
        "children=keywordmap_children, rebuild=keywordmap_rebuild), where you write def "
        "keywordmap_children(obj) giving its (key, child) pairs and def keywordmap_rebuild(obj, "
        "new) giving a new KeywordMap of the moved children; or leave it where it is: "
        "to_device(obj, 'meta', skip=[\"obj['m']\"])",
    ] == str(raised.value).splitlines()
    assert isinstance(raised.value.__cause__, _containers.CannotRebuild)


class LazyCheckpoint(Mapping[str, torch.Tensor]):
    """A Mapping that reads each tensor from its source when asked (a lazy checkpoint
    loader): its constructor takes the source, not its items."""

    def __init__(self, source: Any, names: tuple[str, ...] = ("w", "b")) -> None:
        self.source, self.names = source, names

    def __getitem__(self, name: str) -> torch.Tensor:
        return torch.full((2,), float(len(name)))  # stands in for a read of self.source

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class LazyRows(Sequence[torch.Tensor]):
    """A Sequence that makes each row when asked, from a count its constructor takes."""

    def __init__(self, count: Any) -> None:
        self.count = 2 if not isinstance(count, int) else count

    def __getitem__(self, index: Any) -> Any:
        if not 0 <= index < self.count:
            raise IndexError(index)
        return torch.zeros(1)

    def __len__(self) -> int:
        return self.count


@pytest.mark.parametrize("lazy", [LazyCheckpoint("model.safetensors"), LazyRows(2)])
def test_a_container_whose_constructor_takes_no_items_is_refused_not_rebuilt_wrong(
    lazy: Any,
) -> None:
    """A read-only container whose constructor takes something else first (a lazy loader's
    source) accepts the moved items as that, of the right length, and keeps reading its
    tensors where they were: refused with MoveError, not returned as a broken object."""
    with pytest.raises(MoveError) as raised:
        to_device({"ckpt": lazy}, "meta")
    kind = type(lazy).__qualname__
    key = "'w'" if isinstance(lazy, LazyCheckpoint) else "0"
    assert (
        f"gave one whose [{key}] is a Tensor on cpu, not the tensor moved to meta: "
        f"{kind}(...) does not take its items first"
    ) in str(raised.value).splitlines()[1]
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


class AttrDict(dict[str, Any]):
    """A dict whose entries are its attributes: it is its own ``__dict__``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.__dict__ = self


def test_dict_that_is_its_own_attributes_is_moved_through_both() -> None:
    """A dict that is its own ``__dict__`` comes back so: its attributes are its moved
    entries, not a stale copy of them; the input is left alone."""
    batch = AttrDict(x=torch.ones(3), y=torch.zeros(2))
    moved = to_device(batch, "meta")
    assert type(moved) is AttrDict
    assert moved.__dict__ is moved
    assert ["x", "y"] == list(moved)
    assert moved.x is moved["x"]  # type: ignore[attr-defined]
    assert moved.y is moved["y"]  # type: ignore[attr-defined]
    assert (META, META) == (moved["x"].device, moved["y"].device)
    assert batch.__dict__ is batch
    assert CPU == batch.x.device == batch["x"].device  # type: ignore[attr-defined]


class Scopes(collections.ChainMap[str, Any]):
    tag = "class"


@pytest.mark.parametrize("make", [collections.ChainMap, Scopes])
def test_chain_map_moves_every_map_and_keeps_them_apart(make: Any) -> None:
    """A ChainMap's tensors are those of its maps, shadowed ones too: each map is moved,
    keeping its own keys; the chain keeps its type and attributes; the input is left alone."""
    first, second = {"x": torch.zeros(1)}, {"x": torch.zeros(2), "w": torch.zeros(3)}
    chain = make(first, second)
    chain.note = "kept"
    paths = ["chain.maps[0]['x']", "chain.maps[1]['x']", "chain.maps[1]['w']"]
    assert {CPU: paths} == find_devices(chain, name="chain")
    moved = to_device(chain, "meta")
    assert type(moved) is make
    assert "kept" == moved.note
    assert [["x"], ["x", "w"]] == [list(m) for m in moved.maps]
    assert [[(1,)], [(2,), (3,)]] == [[tuple(t.shape) for t in m.values()] for m in moved.maps]
    assert {META: paths} == find_devices(moved, name="chain")
    assert moved["x"] is moved.maps[0]["x"]
    assert moved["w"] is moved.maps[1]["w"]
    assert chain.maps == [first, second]
    assert chain.maps[0] is first
    assert chain.maps[1] is second
    assert ["x"] == list(first)
    assert {CPU} == {t.device for t in (*first.values(), *second.values())}


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


class BoxedEncoding(Encoding):
    """An encoding whose entries are read through ``__getitem__``: ``data`` holds boxes."""

    def __getitem__(self, key: str) -> Any:
        return self.data[key][0]

    def to(self, device: Any) -> BoxedEncoding:
        self.data = {k: (v[0].to(device),) for k, v in self.data.items()}
        return self


class ItemsEncoding(Encoding):
    """An encoding whose ``items()`` is its own: the entries in reverse, one left out."""

    def items(self) -> Any:
        return list(reversed(self.data.items()))[1:]


@given(entries=st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=4))
@pytest.mark.parametrize("tp", [Encoding, BoxedEncoding, ItemsEncoding])
def test_a_mapping_with_its_own_to_is_read_as_its_items_give_it(
    tp: type[Encoding], entries: dict[str, int]
) -> None:
    """What the engine reads of a ``UserDict`` with its own ``.to`` (to know whether it is
    on the target, what its ``.to`` copies, and what it left) is what its ``items()``
    gives: read from ``data`` only where that is the same."""
    boxed = tp is BoxedEncoding
    data = {k: (torch.full((1,), n),) if boxed else torch.full((1,), n) for k, n in entries.items()}
    encoding = tp(data)
    keys, values = _containers.kind_for(tp).split(encoding)  # type: ignore[misc]
    assert list(zip(keys, values, strict=True)) == list(encoding.items())
    paths = [f"enc[{key!r}]" for key, _ in encoding.items()]
    assert ({CPU: paths} if paths else {}) == find_devices(encoding, name="enc")


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
        "fix: teach it with devicectx.register_container(HalfMover, children=halfmover_children, "
        "rebuild=halfmover_rebuild), where you write def halfmover_children(obj) giving its (key, "
        "child) pairs and def halfmover_rebuild(obj, new) giving a new HalfMover of the moved "
        "children; or leave it where it is: to_device(obj, 'meta', skip=[\"obj['h']\"])",
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
        "fix: teach it with devicectx.register_container(Output, children=output_children, "
        "rebuild=output_rebuild), where you write def output_children(obj) giving its (key, "
        "child) pairs and def output_rebuild(obj, new) giving a new Output of the moved children; "
        "or leave it where it is: do not move obj",
    ] == str(raised.value).splitlines()


class FieldOrderCopy:
    """Copied as transformers' ``ModelOutput`` is: made anew from its fields, whose
    entries the constructor sets in field order, then given its entries again, which
    keeps that order."""

    def __reduce__(self) -> Any:
        fields = tuple(getattr(self, f.name) for f in dataclasses.fields(self))  # type: ignore[arg-type]
        return type(self), fields, dict(vars(self)), None, iter(self.items())  # type: ignore[attr-defined]


@dataclasses.dataclass
class FieldOrderOutput(FieldOrderCopy, Output):
    pass


@dataclasses.dataclass
class FieldOrderDict(FieldOrderCopy, dict[str, Any]):
    """Like :class:`Output`, on a dict rather than an OrderedDict."""

    logits: Any = None
    loss: Any = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)


@pytest.mark.parametrize("make", [FieldOrderOutput, FieldOrderDict])
def test_entries_set_out_of_field_order_keep_the_callers_order(make: Any) -> None:
    """Where the type's own copy lists the entries in field order (ModelOutput's does),
    the moved object lists them in the order the caller set them, every view moved."""
    out = make(loss=torch.zeros(()))
    out["logits"] = torch.zeros(2)
    assert ["logits", "loss"] == list(copy.copy(out).keys())
    moved = to_device(out, "meta")
    assert type(moved) is make
    assert ["loss", "logits"] == list(moved.keys())
    assert moved.logits is moved["logits"]
    assert moved.loss is moved["loss"]
    assert (META, META) == (moved.logits.device, moved.loss.device)
    assert ["loss", "logits"] == list(out.keys())
    assert CPU == out.logits.device == out["logits"].device


@dataclasses.dataclass
class SortedCopy(Mapping[str, Any]):
    """A dataclass whose entries live in a dict of its own, which its copy sorts: an
    order only the type itself could put back."""

    logits: Any = None
    loss: Any = None

    def __post_init__(self) -> None:
        self._entries: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        return self._entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __setitem__(self, key: str, value: Any) -> None:
        self._entries[key] = value
        setattr(self, key, value)

    def __copy__(self) -> SortedCopy:
        clone = SortedCopy(self.logits, self.loss)
        clone._entries = dict(sorted(self._entries.items()))
        return clone


def test_entries_a_copy_reorders_where_the_order_cannot_be_put_back_are_refused() -> None:
    """A two-view object whose copy lists its entries in another order, kept where only
    the type could reorder them, raises MoveError rather than come back reordered."""
    out = SortedCopy()
    out["loss"] = torch.zeros(())
    out["logits"] = torch.zeros(2)
    with pytest.raises(MoveError) as raised:
        to_device(out, "meta")
    assert [
        "to_device() could not move obj (a SortedCopy) to meta:",
        "    SortedCopy cannot be rebuilt with its tensors moved: "
        "a copy given the moved children lists them in another order",
        "fix: teach it with devicectx.register_container(SortedCopy, "
        "children=sortedcopy_children, rebuild=sortedcopy_rebuild), where you write def "
        "sortedcopy_children(obj) giving its (key, child) pairs and def sortedcopy_rebuild(obj, "
        "new) giving a new SortedCopy of the moved children; or leave it where it is: do not move "
        "obj",
    ] == str(raised.value).splitlines()
    assert ["loss", "logits"] == list(out)


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
        "fix: teach it with devicectx.register_container(Snapshot, children=snapshot_children, "
        "rebuild=snapshot_rebuild), where you write def snapshot_children(obj) giving its (key, "
        "child) pairs and def snapshot_rebuild(obj, new) giving a new Snapshot of the moved "
        "children; or leave it where it is: to_device(obj, 'meta', skip=['obj[0]'])",
    ] == str(raised.value).splitlines()
    assert CPU == snapshot["x"].device == snapshot.x.device


def test_tensordict() -> None:
    """A TensorDict is moved with its own .to."""
    tensordict = pytest.importorskip("tensordict")
    td = tensordict.TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2])
    moved = to_device({"td": td}, "meta")["td"]
    assert type(moved) is tensordict.TensorDict
    assert moved["x"].device == META


def ragged_stack(dtype: torch.dtype = torch.float32) -> Any:
    """A tensordict lazy stack of two trajectories of different lengths (2 and 3 steps),
    each with a nested entry: ``items()`` cannot stack them."""
    tensordict = pytest.importorskip("tensordict")
    return tensordict.LazyStackedTensorDict.lazy_stack(
        [
            tensordict.TensorDict(
                {"obs": torch.randn(n, 3, dtype=dtype), "next": {"reward": torch.ones(n)}}, []
            )
            for n in (2, 3)
        ],
        0,
    )


def test_ragged_lazy_stack_is_moved_with_its_own_to() -> None:
    """A lazy stack of tensordicts of different shapes is moved whole, each of its
    tensordicts on the target; the input is left as it was."""
    lazy = ragged_stack()
    moved = to_device({"lazy": lazy}, "meta")["lazy"]
    assert type(moved) is type(lazy)
    assert (0, [2, 3]) == (moved.stack_dim, [len(o) for o in moved.get("obs", as_list=True)])
    assert {META} == {t.device for td in moved.tensordicts for t in td.values(True, True)}
    assert {CPU} == {t.device for td in lazy.tensordicts for t in td.values(True, True)}


def test_ragged_lazy_stack_is_cast_by_the_dtype_policy() -> None:
    """dtypes= casts the tensors of each stacked tensordict, the stack keeping its type."""
    lazy = ragged_stack(torch.float64)
    moved = to_device(lazy, "meta", dtypes={torch.float64: torch.float32})
    assert type(moved) is type(lazy)
    assert [torch.float32] * 2 == [o.dtype for o in moved.get("obs", as_list=True)]
    assert [torch.float64] * 2 == [o.dtype for o in lazy.get("obs", as_list=True)]


def test_ragged_lazy_stacks_are_prefetched() -> None:
    """prefetch over a loader that lazy-stacks trajectories of different lengths."""
    batches = list(prefetch([ragged_stack(), ragged_stack()], "meta"))
    assert 2 == len(batches)
    assert [[META] * 4] * 2 == [
        [t.device for td in b.tensordicts for t in td.values(True, True)] for b in batches
    ]


def test_ragged_lazy_stack_under_the_decorator() -> None:
    """A decorated step gets a ragged lazy stack moved to its module's device."""

    @device_agnostic
    def step(model: nn.Module, lazy: Any) -> list[torch.Tensor]:
        return [model(obs) for obs in lazy.get("obs", as_list=True)]

    assert [META, META] == [y.device for y in step(nn.Linear(3, 1).to(META), ragged_stack())]


# SimpleNamespace: a container of its attributes.


def test_simple_namespace_is_moved_into_a_new_namespace() -> None:
    """A SimpleNamespace comes back a new one, its attributes in order, tensors moved,
    views kept, other values by identity; the input is left as it was."""
    x = torch.arange(4.0)
    note = ["kept"]
    ns = types.SimpleNamespace(x=x, head=x[:2], note=note, inner=types.SimpleNamespace(y=x))
    moved = to_device(ns, "meta")
    assert type(moved) is types.SimpleNamespace
    assert ["x", "head", "note", "inner"] == list(vars(moved))
    assert (META, META, META) == (moved.x.device, moved.head.device, moved.inner.y.device)
    assert moved.head._base is moved.x
    assert moved.inner.y is moved.x
    assert moved.note is note
    assert (ns.x, ns.inner.y, CPU) == (x, x, ns.head.device)
    assert find_devices(ns, name="ns") == {CPU: ["ns.x", "ns.head", "ns.inner.y"]}
    assert to_device(ns, "cpu") is ns


class Settings(types.SimpleNamespace):
    """A namespace subclass whose constructor takes other arguments."""

    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__(scale=scale, name="s")


def test_simple_namespace_subclass_keeps_its_type_without_its_init() -> None:
    """A subclass comes back as itself, not made again by its __init__."""
    moved = to_device(Settings(torch.ones(1)), "meta")
    assert type(moved) is Settings
    assert (META, "s") == (moved.scale.device, moved.name)


def test_simple_namespace_under_the_decorator_and_prefetch() -> None:
    """The decorator and prefetch move a namespace as they move a dataclass."""

    @device_agnostic
    def step(model: nn.Module, batch: types.SimpleNamespace) -> torch.Tensor:
        y: torch.Tensor = model(batch.x)
        return torch.sum(y * batch.mask)

    model = nn.Linear(4, 1).to(META)
    assert META == step(model, types.SimpleNamespace(x=torch.randn(4), mask=torch.ones(1))).device
    moved = list(prefetch([types.SimpleNamespace(x=torch.ones(2), i=i) for i in range(2)], "meta"))
    assert [(META, 0), (META, 1)] == [(b.x.device, b.i) for b in moved]


identifiers = st.from_regex(r"[a-z][a-z0-9_]{0,4}", fullmatch=True).filter(
    lambda name: not keyword.iskeyword(name)
)


@st.composite
def namespaces(draw: st.DrawFn) -> types.SimpleNamespace:
    """A tree of namespaces whose attributes are parts of one drawn structure: the whole
    structure, its tensors (so a tensor, or a view of one, is held at several places, in
    several namespaces), views of them, plain values, and namespaces again."""
    batch = draw(nested(tensors(devices=["cpu"]), max_depth=2))
    held = tensors_of(batch)
    parts = [batch, *held, *(t[...] for t in held)]

    def build(depth: int) -> types.SimpleNamespace:
        attributes: dict[str, Any] = {}
        for name in draw(st.lists(identifiers, max_size=4, unique=True)):
            pick = draw(st.integers(0, 2 if depth else 1))
            if pick == 0:
                attributes[name] = draw(st.sampled_from(parts))
            elif pick == 1:
                attributes[name] = draw(st.sampled_from([1, "s", None, held]))
            else:
                attributes[name] = build(depth - 1)
        return types.SimpleNamespace(**attributes)

    return build(2)


def spots(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Each tensor of a namespace tree with its position, preorder (not in sets)."""
    if type(obj) is types.SimpleNamespace:
        for name, value in vars(obj).items():
            yield from spots(value, (*path, name))
    else:
        for where, tensor in placed(obj):
            yield (*path, *where), tensor


def outline(obj: Any) -> Any:
    """Namespaces by type and attribute names; other values by type, and by identity
    where no tensor is in them (those must come back as they are)."""
    if type(obj) is types.SimpleNamespace:
        return [(name, outline(value)) for name, value in vars(obj).items()]
    if isinstance(obj, torch.Tensor) or find_devices(obj):
        return type(obj)
    return id(obj)


@given(namespaces())
def test_simple_namespace_round_trip_keeps_identity_and_views(ns: types.SimpleNamespace) -> None:
    """Moved to meta: the same outline; every tensor on meta; places that held one tensor
    hold one moved tensor, and views of a tensor in the tree are views of its copy; the
    input is left as it was; moving back to where it is gives the same object."""
    before = list(spots(ns))
    devices = [t.device for _, t in before]
    moved = to_device(ns, META)
    after = list(spots(moved))
    assert outline(ns) == outline(moved)
    assert [path for path, _ in before] == [path for path, _ in after]
    assert all(t.device == META for _, t in after)
    pairs = [(a, b) for (_, a), (_, b) in zip(before, after, strict=True)]
    result_of = {id(a): b for a, b in pairs}
    for i, (a, a_moved) in enumerate(pairs):
        assert [a is b for b, _ in pairs[i + 1 :]] == [a_moved is b for _, b in pairs[i + 1 :]]
        if a._base is not None and id(a._base) in result_of:
            assert a_moved._base is result_of[id(a._base)]
    assert devices == [t.device for _, t in spots(ns)]
    assert to_device(ns, CPU) is ns
    assert to_device(moved, META) is moved
    # A set member's position follows its hash, which the move changes.
    paths = [re.sub(r"\)\[\d+\]", ")[_]", p) for p in find_devices(ns, name="ns").get(CPU, [])]
    found = find_devices(moved, name="ns").get(META, [])
    assert sorted(paths) == sorted(re.sub(r"\)\[\d+\]", ")[_]", p) for p in found)


# Attributes beside a dataclass's fields, a UserDict's or a UserList's entries.


@dataclasses.dataclass
class Derived:
    x: torch.Tensor

    def __post_init__(self) -> None:
        self.mask = self.x > 0  # derived, not a field
        self.head = self.x[:2]
        self.label = "d"


@dataclasses.dataclass(frozen=True)
class FrozenDerived:
    x: torch.Tensor

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", self.x.sum())


class ScaledDict(collections.UserDict[str, Any]):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scale = torch.ones(1)


class ScaledList(collections.UserList[Any]):
    def __init__(self, items: Any = ()) -> None:
        super().__init__(items)
        self.scale = torch.ones(1)


def test_attributes_beside_dataclass_fields_are_moved() -> None:
    """Tensors a dataclass's __post_init__ sets beside its fields move with them (a view
    of a field stays a view of the moved field), mutable and frozen; plain values stay."""
    batch, frozen = Derived(torch.arange(4.0)), FrozenDerived(torch.ones(2))
    moved, moved_frozen = to_device((batch, frozen), "meta")
    assert (META, META, META) == (moved.x.device, moved.mask.device, moved.head.device)
    assert moved.head._base is moved.x
    assert ["x", "mask", "head", "label"] == list(vars(moved))
    assert "d" == moved.label
    assert META == vars(moved_frozen)["total"].device
    assert (CPU, CPU) == (batch.mask.device, vars(frozen)["total"].device)


class Boxed:
    """A data descriptor that keeps a field's value in the __dict__ under the field's own
    name, boxed in a list: getattr and the __dict__ disagree."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None or self.name not in vars(obj):
            raise AttributeError(self.name)  # no default, or not set
        return vars(obj)[self.name][0]

    def __set__(self, obj: Any, value: Any) -> None:
        vars(obj)[self.name] = [value]


@dataclasses.dataclass
class Fields:
    a: Any
    b: Any = None
    late: Any = dataclasses.field(init=False, default=None)
    never: Any = dataclasses.field(init=False)


@dataclasses.dataclass
class MoreFields(Fields):
    c: Any = None

    @functools.cached_property
    def total(self) -> Any:
        return list(vars(self).values())


@dataclasses.dataclass
class DescribedFields:
    a: Any = Boxed()
    b: Any = None


@dataclasses.dataclass
class LookedUpFields:
    a: Any
    b: Any = None

    def __getattribute__(self, name: str) -> Any:
        return object.__getattribute__(self, "b" if name == "a" else name)


@given(
    tp=st.sampled_from([Fields, MoreFields, DescribedFields, LookedUpFields]),
    moves=st.lists(
        st.tuples(st.sampled_from(["set", "del", "cache"]), st.sampled_from("abcxy")), max_size=5
    ),
)
def test_dataclass_split_reads_what_getattr_reads(tp: type, moves: list[tuple[str, str]]) -> None:
    """A dataclass's children are its fields as getattr reads them, in field order, then
    the other attributes of its __dict__, in order, but cached values: whether the split
    reads them from the __dict__ at once (fields only, in order) or one by one."""
    obj = tp(torch.zeros(1))
    for move, name in moves:
        if move == "set":
            setattr(obj, name, torch.ones(1))
        elif move == "del" and name in vars(obj):
            del vars(obj)[name]
        elif move == "cache" and tp is MoreFields:
            _ = obj.total
    names = [f.name for f in dataclasses.fields(tp)]
    expected = [(name, getattr(obj, name)) for name in names if hasattr(obj, name)]
    expected += [(k, v) for k, v in vars(obj).items() if k not in {*names, "total"}]
    keys, values = _containers.kind_for(tp).split(obj)  # type: ignore[misc]
    assert [k for k, _ in expected] == list(keys)
    assert all(a is b for (_, a), b in zip(expected, values, strict=True))


@pytest.mark.parametrize(
    ("obj", "key", "entry"),
    [(ScaledDict(a=torch.zeros(1)), "a", "['a']"), (ScaledList([torch.zeros(1)]), 0, "[0]")],
    ids=["UserDict", "UserList"],
)
def test_attributes_beside_user_collection_entries_are_moved(
    obj: Any, key: Any, entry: str
) -> None:
    """A UserDict or UserList subclass's own attributes (set in its __init__) move with
    its entries, and find_devices lists them after the entries."""
    moved = to_device(obj, "meta")
    assert type(moved) is type(obj)
    assert (META, META) == (moved[key].device, moved.scale.device)
    assert (CPU, CPU) == (obj[key].device, obj.scale.device)
    assert {CPU: [f"obj{entry}", "obj.scale"]} == find_devices(obj, name="obj")


def test_attributes_beside_fields_and_entries_under_the_decorator() -> None:
    """A decorated step reading such attributes gets them on its module's device, where
    torch failed on them before."""

    @device_agnostic
    def step(model: nn.Module, batch: Derived, scaled: ScaledDict) -> torch.Tensor:
        y: torch.Tensor = model(batch.x)
        return torch.sum(y * batch.mask * scaled.scale * scaled["w"])

    model = nn.Linear(4, 4).to(META)
    assert META == step(model, Derived(torch.randn(4)), ScaledDict(w=torch.ones(4))).device


class Helper:
    """A plain object: no container to the walk."""

    def __init__(self) -> None:
        self.t = torch.ones(1)


@dataclasses.dataclass
class Helped:
    x: torch.Tensor

    def __post_init__(self) -> None:
        self.helper = Helper()


def test_a_plain_object_beside_dataclass_fields_is_named_by_the_decorator() -> None:
    """A plain object set beside a dataclass's fields is looked into when torch fails on
    a tensor it holds: the error names it by its path through the attribute."""

    @device_agnostic
    def step(model: nn.Module, batch: Helped) -> torch.Tensor:
        y: torch.Tensor = model(batch.x)
        return y * batch.helper.t

    with pytest.raises(DeviceMismatchError) as raised:
        step(nn.Linear(1, 1).to(META), Helped(torch.ones(1)))
    assert "    cpu <- batch.helper.t (in Helper)" in str(raised.value).splitlines()


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


def test_an_iterator_given_whole_is_warned_of_with_a_fix_that_moves_its_items() -> None:
    """``to_device(generator)`` cannot move what it yields without using it up: it comes
    back unread, with a warning whose fixes move the items; nested ones (above) come back
    quietly, beside the tensors that moved."""
    batches = [torch.ones(2), torch.zeros(2)]
    for iterator in ((b for b in batches), map(torch.clone, batches), iter(batches)):
        with pytest.warns(DeviceWarning) as caught:
            assert iterator is to_device(iterator, "meta")
        (warning,) = caught
        kind = with_article(type(iterator).__qualname__)
        assert (
            f"to_device() got obj, {kind}, an iterator: it is not read (its items would be "
            f"used up), and comes back as it was, what it yields not moved to meta\n"
            f"fix: to_device(list(obj), 'meta') to move its items now, or prefetch(obj, "
            f"'meta') to move each as it is read"
        ) == str(warning.message)
        assert [b.shape for b in batches] == [b.shape for b in iterator]  # not used up
    assert all(META == b.device for b in to_device(list(iter(batches)), "meta"))
    assert all(META == b.device for b in prefetch(iter(batches), "meta"))


Transition = collections.namedtuple("Transition", "obs reward")


@pytest.mark.parametrize(
    ("batch", "shown"),
    [
        (np.zeros(3), "obj"),
        ({"obs": np.zeros(3), "reward": 1.0}, "obj['obs']"),
        (Transition(np.zeros(3), np.float32(1.0)), "obj.obs"),
        ([np.zeros(3), None, "tag"], "obj[0]"),
    ],
    ids=["array", "dict", "namedtuple", "list"],
)
def test_numpy_arrays_and_no_tensor_are_warned_of(batch: Any, shown: str) -> None:
    """A batch of numpy arrays (an RL replay buffer's sample) comes back as it was, the
    arrays left on the host: where they are all it holds, a warning says nothing moved,
    with the fix, which moves them when followed."""
    with pytest.warns(DeviceWarning) as caught:
        assert batch is to_device(batch, "meta")
    with pytest.warns(DeviceWarning):  # whatever else the call asks
        to_device(batch, "meta", skip=["other"], dtypes="device")
    (warning,) = caught
    assert (
        f"to_device() got numpy arrays and no tensor ({shown}): a move takes tensors and "
        f"leaves every other object as it is, so nothing went to meta\n"
        f"fix: torch.as_tensor(obj, device='meta') for one array; for a batch, make its "
        f"arrays tensors where it is made (torch.as_tensor(array), as a DataLoader's default "
        f"collate_fn does), then to_device(batch, 'meta')"
    ) == str(warning.message)
    assert META == torch.as_tensor(np.zeros(3), device="meta").device


def test_numpy_arrays_beside_a_tensor_are_no_warning() -> None:
    """An array beside a tensor (a batch's metadata), or an array's subclass, moves quietly,
    as arrays alone moved to the CPU: only a move to a device that got arrays alone is
    warned of."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        to_device({"x": torch.ones(2), "ids": np.arange(3)}, "meta")
        to_device([torch.ones(2), np.zeros(2)], "meta")
        to_device(np.ma.masked_array(np.zeros(2)), "meta")
        to_device({"x": 1.0}, "meta")
        to_device({"obs": np.zeros(3)}, "cpu")  # the host is where they are: nothing to say


def test_a_skip_entry_inside_an_object_with_its_own_to_is_warned_of() -> None:
    """A ``BatchEncoding``'s own ``.to`` moves all it holds, so a ``skip=`` key or path inside
    it cannot keep its entry: a warning says so, with a fix that works when followed."""
    transformers = pytest.importorskip("transformers")

    def encoded() -> Any:
        return transformers.BatchEncoding({"input_ids": torch.ones(2, 3), "labels": torch.ones(2)})

    for skip in ("labels", "obj['enc']['labels']"):
        batch = {"enc": encoded(), "labels": torch.ones(1)}  # new tensors: not a repeated move
        with pytest.warns(DeviceWarning) as caught:
            moved = to_device(batch, "meta", skip=skip)
        assert META == moved["enc"]["labels"].device
        assert [
            f"to_device() skip={skip!r} names obj['enc']['labels'], inside obj['enc'], a "
            f"BatchEncoding, whose own .to() moves what it holds: skip= does not reach inside "
            f"it, and obj['enc']['labels'] was moved to meta\n"
            f"fix: move dict(obj['enc']) in its place, a plain dict, which skip= reaches into; "
            f"or take 'labels' out of obj['enc'] before the move"
        ] == [str(warning.message) for warning in caught]
    batch = {"enc": encoded(), "labels": torch.ones(1)}
    fixed = to_device({**batch, "enc": dict(batch["enc"])}, "meta", skip="labels")
    assert (CPU, CPU, META) == (
        fixed["enc"]["labels"].device,
        fixed["labels"].device,
        fixed["enc"]["input_ids"].device,
    )
    with pytest.warns(DeviceWarning, match=r"^prefetch\(\) skip='labels' names batch\['enc'\]"):
        next(iter(prefetch([{"enc": encoded()}], "meta", skip="labels")))


# Registered containers.


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
                "fix: register_container(MyBatch, children=mybatch_children, "
                "rebuild=mybatch_rebuild), MyBatch your container class, with the two "
                "functions you write for it: obj -> its (key, child) pairs, and "
                "(obj, new children) -> a new MyBatch",
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
