"""What the peers' own test suites expect of a move, restated for to_device and find_devices.

Read from accelerate's ``tests/test_utils.py`` (``send_to_device``, ``find_device``,
``honor_type`` through ``recursively_apply``), lightning-utilities'
``tests/unittests/core/test_apply_func.py`` and Lightning Fabric's
``tests/tests_fabric/utilities/test_apply_func.py`` (``apply_to_collection``,
``move_data_to_device``), and optree's container kinds. Each test says which expectation
it restates. Where devicectx differs by design, the test pins our behaviour and says why
(docs/guarantees.md's "Where devicectx differs from its peers" says it too).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections import OrderedDict, UserDict, defaultdict, deque, namedtuple
from dataclasses import InitVar
from typing import Any, ClassVar, NamedTuple

import pytest
import torch

from devicectx import MoveError, device_agnostic, find_devices, to_device

CPU = torch.device("cpu")
META = torch.device("meta")
ExampleNamedTuple = namedtuple("ExampleNamedTuple", "a b c")


def devices(obj: Any) -> set[torch.device]:
    return set(find_devices(obj))


# accelerate: send_to_device, find_device, honor_type.


def test_accelerate_send_to_device_keeps_tuples_lists_and_scalars() -> None:
    """send_to_device((t, [t, t], 1)): a tuple holding a list, the int left as it is."""
    tensor = torch.randn(5, 2)

    moved = to_device((tensor, [tensor, tensor], 1), "meta")

    assert (tuple, list, 1) == (type(moved), type(moved[1]), moved[2])
    assert {META} == devices(moved)


def test_accelerate_send_to_device_keeps_dicts() -> None:
    """send_to_device({"a": t, "b": [t, t], "c": 1}): the same keys, values in place."""
    tensor = torch.randn(5, 2)

    moved = to_device({"a": tensor, "b": [tensor, tensor], "c": 1}, "meta")

    assert ["a", "b", "c"] == list(moved)
    assert 1 == moved["c"]
    assert {META} == devices(moved)


def test_accelerate_send_to_device_keeps_namedtuples() -> None:
    """send_to_device(ExampleNamedTuple(a=t, b=[t, t], c=1)): the namedtuple's type."""
    tensor = torch.randn(5, 2)

    moved = to_device(ExampleNamedTuple(a=tensor, b=[tensor, tensor], c=1), "meta")

    assert ExampleNamedTuple is type(moved)
    assert 1 == moved.c
    assert {META} == devices(moved)


def test_accelerate_send_to_device_keeps_userdict() -> None:
    """send_to_device(UserDict(...)): a UserDict comes back, moved."""
    tensor = torch.randn(5, 2)

    moved = to_device(UserDict({"a": tensor, "b": [tensor, tensor], "c": 1}), "meta")

    assert UserDict is type(moved)
    assert 1 == moved["c"]
    assert {META} == devices(moved)


def test_accelerate_send_to_device_moves_one_tensor_once() -> None:
    """Where accelerate copies a tensor held at three places three times, we copy it
    once: a difference by design (aliasing is kept, docs/guarantees.md)."""
    tensor = torch.randn(5, 2)

    moved = to_device({"a": tensor, "b": [tensor, tensor]}, "meta")

    assert moved["a"] is moved["b"][0] is moved["b"][1]


def test_accelerate_send_to_device_compiles() -> None:
    """torch.compile(send_to_device, fullgraph=True) of a bfloat16 tensor to the CPU, and
    of a batch moved for real (to meta): the walk that moves is traced too."""
    compiled = torch.compile(to_device, fullgraph=True)

    moved = compiled(torch.zeros([1], dtype=torch.bfloat16), "cpu")
    batch = compiled({"x": torch.zeros([1], dtype=torch.bfloat16), "y": [torch.ones(2)]}, "meta")

    assert (CPU, torch.bfloat16) == (moved.device, moved.dtype)
    assert [META, META] == [batch["x"].device, batch["y"][0].device]


def test_accelerate_named_tuple_subclass_is_a_namedtuple() -> None:
    """A subclass of a typing.NamedTuple is still a namedtuple: rebuilt as its own type,
    its None fields kept."""

    class QuantTensorBase(NamedTuple):
        value: torch.Tensor
        scale: torch.Tensor | None
        zero_point: torch.Tensor | None

    class Second(QuantTensorBase):
        pass

    moved = to_device(Second(torch.tensor(1.0), None, None), "meta")

    assert Second is type(moved)
    assert (META, None, None) == (moved.value.device, moved.scale, moved.zero_point)


def test_accelerate_find_device() -> None:
    """find_device: the device of the first tensor, None without one; find_devices
    answers with every device and the paths."""
    assert {CPU: ["obj[2]"]} == find_devices([1, "a", torch.tensor([1, 2, 3])])
    assert {CPU: ["obj['b']"]} == find_devices({"a": 1, "b": torch.tensor([1, 2, 3])})
    assert {} == find_devices([1, "a"])


def test_accelerate_honor_type_leaves_other_types_alone() -> None:
    """recursively_apply(..., error_on_other_type=True) raises on an int; a move has no
    such mode: what is no tensor and no container comes back as itself, by design."""
    one = object()

    moved = to_device((torch.tensor(1), 1, one), "meta")

    assert (1, one) == (moved[1], moved[2])


# lightning-utilities: apply_to_collection.


@dataclasses.dataclass
class Feature:
    input_ids: torch.Tensor
    segment_ids: torch.Tensor


@dataclasses.dataclass
class ModelExample:
    example_ids: list[str]
    feature: Feature
    label: torch.Tensor
    some_constant: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.some_constant = 7


@dataclasses.dataclass
class WithClassVar:
    class_var: ClassVar[int] = 0
    dummy: Any = None


@dataclasses.dataclass
class WithInitVar:
    dummy: Any
    override: InitVar[Any | None] = None

    def __post_init__(self, override: Any | None) -> None:
        if override is not None:
            self.dummy = override


class CustomCollection(dict):  # type: ignore[type-arg]
    """A dict subclass whose constructor takes one positional dict, as Lightning's test's."""

    def __init__(self, initial: dict[str, Any]) -> None:
        super().__init__(initial)


def test_lightning_recursive_application_keeps_every_type() -> None:
    """The nested collection of Lightning's test: tensors, lists, tuples, a namedtuple of
    numbers, a string, a number, dataclasses nested, with an init=False field, a ClassVar
    and an InitVar: every type and every non-tensor value kept, every tensor moved."""
    ntc = namedtuple("Foo", ["bar", "baz"])
    example = ModelExample(["i-1"], Feature(torch.ones(3), torch.ones(3)), torch.ones(3))
    batch = {
        "a": torch.tensor([1.0]),
        "b": [torch.tensor([2.0])],
        "c": (torch.tensor([100.0]),),
        "d": ntc(bar=5.0, baz=10.0),
        "f": "this_is_a_dummy_str",
        "g": 12.0,
        "h": Feature(torch.ones(3), torch.ones(3)),
        "i": example,
        "j": WithClassVar(torch.arange(3)),
        "k": WithInitVar("overridden", torch.tensor([2.0])),
    }

    moved = to_device(batch, "meta")

    assert [type(v) for v in batch.values()] == [type(v) for v in moved.values()]
    assert (ntc(5.0, 10.0), "this_is_a_dummy_str", 12.0) == (moved["d"], moved["f"], moved["g"])
    assert (["i-1"], 7) == (moved["i"].example_ids, moved["i"].some_constant)
    assert 0 == WithClassVar.class_var
    assert {META} == devices(moved)


@pytest.mark.parametrize(
    "container",
    [
        OrderedDict([("b", torch.ones(1)), ("a", torch.ones(1))]),
        CustomCollection({"a": torch.ones(1), "b": torch.ones(1)}),
        defaultdict(int, {"a": torch.ones(1), "b": torch.ones(1)}),
    ],
    ids=["OrderedDict", "dict subclass", "defaultdict"],
)
def test_lightning_return_type_is_kept(container: dict[str, Any]) -> None:
    """apply_to_collection's return type test: the type, keys and order are kept."""
    moved = to_device(container, "meta")

    assert type(container) is type(moved)
    assert list(container) == list(moved)
    assert {META} == devices(moved)


def test_lightning_defaultdict_keeps_its_factory() -> None:
    """A defaultdict keeps its default_factory."""
    moved = to_device(defaultdict(list, {"a": torch.ones(1)}), "meta")

    assert list is moved.default_factory


def test_lightning_frozen_dataclass_is_moved() -> None:
    """Lightning refuses a frozen dataclass unless allow_frozen=True; a move never changes
    its input, so a frozen dataclass is moved as any other, by design."""

    @dataclasses.dataclass(frozen=True)
    class Foo:
        var: torch.Tensor

    foo = Foo(torch.ones(1))

    moved = to_device(foo, "meta")

    assert (Foo, META, CPU) == (type(moved), moved.var.device, foo.var.device)


def test_lightning_cached_property_is_recomputed() -> None:
    """A dataclass's cached_property is worked out again from the moved fields, as
    Lightning's test_apply_to_collection_with_cached_property_dataclass expects."""

    @dataclasses.dataclass
    class Foo:
        var: torch.Tensor

        @functools.cached_property
        def cached(self) -> torch.Tensor:
            return self.var * 2

    foo = Foo(torch.tensor(1.0))
    assert torch.equal(torch.tensor(2.0), foo.cached)

    moved = to_device(foo, "meta")

    assert META == moved.cached.device
    assert CPU == foo.cached.device


# Lightning Fabric: move_data_to_device.


class TensorObject:
    """An object with a .to that moves in place and returns nothing."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def to(self, device: Any) -> None:
        self.tensor = self.tensor.to(device)


def test_lightning_wrongly_implemented_transferable_data_type() -> None:
    """test_wrongly_implemented_transferable_data_type: a .to without `return self`
    gives the object back, moved, not None; the input is left as it was."""
    obj = TensorObject(torch.ones(2))

    moved = to_device(obj, "meta")

    assert TensorObject is type(moved)
    assert (META, CPU) == (moved.tensor.device, obj.tensor.device)


def test_lightning_transferable_object_under_the_decorator() -> None:
    """The same object given to a decorated function: the body gets it moved."""

    @device_agnostic(device="meta")
    def body(obj: TensorObject) -> torch.device:
        return obj.tensor.device

    assert META == body(TensorObject(torch.ones(2)))


def test_lightning_move_data_to_device_keeps_non_tensors() -> None:
    """move_data_to_device of a batch with strings and numbers: only tensors move."""
    batch = {"x": torch.ones(2), "name": "b0", "n": 3, "nothing": None}

    moved = to_device(batch, "meta")

    assert ("b0", 3, None) == (moved["name"], moved["n"], moved["nothing"])
    assert META == moved["x"].device


# optree: its container kinds.


def test_optree_deque_keeps_maxlen() -> None:
    """optree rebuilds a deque with its maxlen."""
    moved = to_device(deque([torch.ones(1), torch.ones(1)], maxlen=3), "meta")

    assert (deque, 3) == (type(moved), moved.maxlen)


def test_optree_structseq_is_a_container() -> None:
    """optree treats a structseq (torch.return_types, time.struct_time) as a node: its
    tensors move, and its hidden fields come back."""
    values = torch.return_types.max((torch.ones(2), torch.zeros(2, dtype=torch.long)))
    stamp = time.struct_time((torch.ones(1), *range(2, 10)))

    moved_values, moved_stamp = to_device((values, stamp), "meta")

    assert torch.return_types.max is type(moved_values)
    assert time.struct_time is type(moved_stamp)
    assert {META} == devices((moved_values, moved_stamp))
    assert (META, stamp.tm_zone) == (moved_stamp[0].device, moved_stamp.tm_zone)
    assert {torch.device("cpu")} == set(find_devices(stamp))  # seen where it is, too


def test_optree_none_is_an_empty_node() -> None:
    """optree makes None a node without children; for a move, it is a leaf left alone."""
    assert to_device(None, "meta") is None
    assert {} == find_devices(None)


def test_optree_ordered_dict_keeps_insertion_order() -> None:
    """optree keeps an OrderedDict's order (a dict's too): so does a move."""
    ordered = collections.OrderedDict([("z", torch.ones(1)), ("a", torch.ones(1))])

    assert ["z", "a"] == list(to_device(ordered, "meta"))


def test_optree_unknown_objects_are_leaves() -> None:
    """optree leaves unregistered objects as leaves; so does a move, by identity."""

    class Opaque:
        def __init__(self) -> None:
            self.tensor = torch.ones(1)

    opaque = Opaque()

    assert to_device({"o": opaque}, "meta")["o"] is opaque


def test_unrebuildable_containers_are_refused_not_half_moved() -> None:
    """Where a peer would return another type (optree cannot rebuild an unregistered
    Mapping), a move that cannot put a type back together raises MoveError naming it."""

    class ReadOnly(collections.abc.Mapping):  # type: ignore[type-arg]
        def __init__(self, a: Any, b: Any) -> None:
            self._data = {"a": a, "b": b}

        def __getitem__(self, key: str) -> Any:
            return self._data[key]

        def __iter__(self) -> Any:
            return iter(self._data)

        def __len__(self) -> int:
            return 2

    with pytest.raises(MoveError, match="ReadOnly cannot be rebuilt"):
        to_device(ReadOnly(torch.ones(1), torch.ones(1)), "meta")
