"""``find_devices``, and the walks the decorator reads a call's arguments with
(``iter_tensors``, ``all_on``, ``plain_device``, ``shared_device``, ``move_call``).
"""

from __future__ import annotations

import collections
import dataclasses
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from move_subjects import Batch, CountingTo, Pair
from torch import nn

from devicectx import (
    DeviceMismatchError,
    MoveError,
    device_agnostic,
    find_devices,
    register_container,
    to_device,
    unregister_container,
)
from devicectx.move._move import all_on, iter_tensors, move_call, move_to, shared_device
from devicectx.move._walk import MIXED, NotPlain, plain_device

CPU = torch.device("cpu")
META = torch.device("meta")


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


def test_find_devices_writes_module_paths_python_can_evaluate() -> None:
    """Indices as [0], identifier names and keys as .name, any other ModuleDict key (digits
    too: its keys are strings) as ['key']."""
    model = nn.ModuleDict(
        {
            "layers": nn.Sequential(nn.Sequential(nn.Linear(1, 1, bias=False))),
            "heads": nn.ModuleDict(
                {name: nn.Linear(1, 1, bias=False) for name in ("cls", "cls-head", "class", "1")}
            ),
        }
    )
    model.register_parameter("weight", nn.Parameter(torch.zeros(1)))
    expected = [
        "model.weight",
        "model.layers[0][0].weight",
        "model.heads.cls.weight",
        "model.heads['cls-head'].weight",
        "model.heads['class'].weight",
        "model.heads['1'].weight",
    ]
    assert {CPU: expected} == find_devices(model, name="model")
    for path, tensor in iter_tensors(model, "model", modules=True):
        assert eval(path, {"model": model}) is tensor, path


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


@dataclasses.dataclass
class Derived:
    x: torch.Tensor

    def __post_init__(self) -> None:
        self.mask = torch.ones(1, device="meta")  # not a field


class Scaled(collections.UserDict[str, Any]):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scale = torch.ones(1, device="meta")  # not an entry


def test_find_devices_lists_attributes_beside_fields_and_entries() -> None:
    """A dataclass's attributes set beside its fields, a UserDict's beside its entries,
    and a SimpleNamespace's attributes are listed, each path code that reads its tensor;
    so are they seen by the decorator's check, which refuses the mixed call."""
    batch = {
        "d": Derived(torch.zeros(1)),
        "u": Scaled({"w": torch.zeros(1), "odd key": torch.zeros(1)}),
        "ns": types.SimpleNamespace(a=torch.zeros(1), b=[torch.ones(1, device="meta")]),
    }
    found = find_devices(batch, name="batch")
    assert {
        CPU: ["batch['d'].x", "batch['u']['w']", "batch['u']['odd key']", "batch['ns'].a"],
        META: ["batch['d'].mask", "batch['u'].scale", "batch['ns'].b[0]"],
    } == found
    for device, paths in found.items():
        assert [device] * len(paths) == [eval(path, {"batch": batch}).device for path in paths]
    assert MIXED is shared_device(batch)

    @device_agnostic(move=False, device="meta")
    def step(batch: Any) -> None:
        pass

    with pytest.raises(DeviceMismatchError) as raised:
        step(batch)
    assert found[CPU] == raised.value.devices[CPU]


def test_find_devices_lists_the_tensors_a_lazy_stack_holds() -> None:
    """A tensordict lazy stack, ragged or not, lists the tensors of its stacked
    tensordicts, not copies stacked for the look."""
    tensordict = pytest.importorskip("tensordict")
    tds = [tensordict.TensorDict({"a": torch.zeros(n)}, []) for n in (2, 2)]
    for lazy in [
        tensordict.LazyStackedTensorDict.lazy_stack(tds, 0),
        tensordict.LazyStackedTensorDict.lazy_stack(
            [tds[0], tensordict.TensorDict({"a": torch.zeros(3)}, [])], 0
        ),
    ]:
        paths = ["lazy.tensordicts[0]['a']", "lazy.tensordicts[1]['a']"]
        assert {CPU: paths} == find_devices(lazy, name="lazy")
        assert tds[0]["a"] is eval(paths[0], {"lazy": lazy})
        assert all_on(lazy, CPU)
        assert not all_on(lazy, META)


class OwnMoved:
    """An object moved by its own ``.to``, with no children a rule reads: its attributes."""

    def __init__(self, scale: torch.Tensor, extra: list[torch.Tensor]) -> None:
        self.scale = scale
        self.extra = extra
        self.note = "kept"

    def to(self, device: torch.device) -> OwnMoved:
        return OwnMoved(self.scale.to(device), [t.to(device) for t in self.extra])


class OwnSlots:
    """:class:`OwnMoved` with ``__slots__``, holding one of them."""

    __slots__ = ("inner", "offset")

    def __init__(self, offset: torch.Tensor, inner: OwnMoved) -> None:
        self.offset = offset
        self.inner = inner

    def to(self, device: torch.device) -> OwnSlots:
        return OwnSlots(self.offset.to(device), self.inner.to(device))


def test_find_devices_lists_the_attributes_of_an_object_with_its_own_to() -> None:
    """An object moved by its own ``.to`` whose children no rule reads (no mapping, no
    dataclass) has the tensors of its attributes listed, as ``to_device`` moves them: at
    the root, in a container, in slots and in another such object; each path reads its
    tensor."""
    cfg = OwnMoved(torch.zeros(1), [torch.ones(1, device="meta")])
    assert {CPU: ["cfg.scale"], META: ["cfg.extra[0]"]} == find_devices(cfg, name="cfg")
    batch = {"cfg": OwnSlots(torch.zeros(1), cfg), "x": torch.zeros(1)}
    found = find_devices(batch, name="b")
    assert {
        CPU: ["b['cfg'].inner.scale", "b['cfg'].offset", "b['x']"],
        META: ["b['cfg'].inner.extra[0]"],
    } == found
    for device, paths in found.items():
        assert [device] * len(paths) == [eval(path, {"b": batch}).device for path in paths]
    everywhere = sorted(path for paths in found.values() for path in paths)
    moved = find_devices(to_device(batch, "meta"), name="b")
    assert {META: everywhere} == {device: sorted(paths) for device, paths in moved.items()}


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
        "fix: give xs[0] values: it is on meta, which holds shapes only (made under "
        "torch.device('meta') or with device='meta'); make it where it has data, or load its "
        "values into torch.empty_like(xs[0], device='cpu'); or leave the argument out of the "
        "move: @device_agnostic(exclude=('xs',))",
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
