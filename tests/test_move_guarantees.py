"""``to_device``'s guarantees: identity where nothing moves, the input unchanged, dtypes,
strides, autograd, aliasing and views kept, cycles and deep nesting, ``skip=``,
``non_blocking=``, ``coalesce=``, and a move traced by ``torch.compile``.

``meta`` is the second device: tensors there have shapes but no values, so a move from
the CPU to meta is a real move.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import accelerator
from move_subjects import Pair, on_meta
from torch import nn

from devicectx import (
    MoveError,
    find_devices,
    to_device,
)
from devicectx.move._alias import TensorMover
from devicectx.move._move import all_on, iter_tensors, move_call, move_to

CPU = torch.device("cpu")
META = torch.device("meta")


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


class Features:
    """A batch type whose own ``.to`` moves, in place, the tensors of a dict and a list
    it holds, and returns itself."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.tensors = dict(tensors)
        self.order = list(tensors.values())

    def to(self, device: Any, non_blocking: bool = False) -> Features:
        for key, value in self.tensors.items():
            self.tensors[key] = value.to(device, non_blocking=non_blocking)
        self.order[:] = [value.to(device) for value in self.order]
        return self


def test_an_own_to_that_works_in_place_leaves_the_input_alone() -> None:
    """An object moved by its own ``.to``, which writes into a dict and a list it holds:
    the caller's object, and those containers, keep their tensors where they were."""
    features = Features(x=torch.ones(2))
    tensors, order = features.tensors, features.order
    moved = to_device({"f": features}, META)
    assert META == moved["f"].tensors["x"].device == moved["f"].order[0].device
    assert features.tensors is tensors
    assert features.order is order
    assert CPU == tensors["x"].device == order[0].device


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


def geometry(tensor: torch.Tensor) -> tuple[torch.Size, tuple[int, ...], int]:
    """Shape, strides and storage offset: where a view lies in its base."""
    return tensor.shape, tensor.stride(), tensor.storage_offset()


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("base_first", [True, False])
def test_empty_views_of_an_empty_base_stay_linked(base_first: bool, requires_grad: bool) -> None:
    """Views of an empty base arrive as views of the moved base, in place and with autograd."""
    base = torch.randn(0, 3, requires_grad=requires_grad)
    views = [base.unsqueeze(0), base[:, 1:], base.expand(2, 0, 3), base.t()]
    moved = to_device([base, *views] if base_first else [*views, base], "meta")
    moved_base, moved_views = (moved[0], moved[1:]) if base_first else (moved[-1], moved[:-1])
    for view, moved_view in zip(views, moved_views, strict=True):
        assert moved_view._base is moved_base
        assert geometry(view) == geometry(moved_view)
        assert requires_grad == moved_view.requires_grad
        assert requires_grad == (moved_view.grad_fn is not None)


@pytest.mark.parametrize("base_first", [True, False])
def test_empty_views_of_a_base_with_elements_stay_linked(base_first: bool) -> None:
    """Empty slices of a base, even one past its end, arrive as views of the moved base."""
    base = torch.zeros(2, 3)
    views = [base[2:], base[1:1], base[:, :0], base[:, 3:], base[2:, 3:]]
    moved = to_device([base, *views] if base_first else [*views, base], "meta")
    moved_base, moved_views = (moved[0], moved[1:]) if base_first else (moved[-1], moved[:-1])
    for view, moved_view in zip(views, moved_views, strict=True):
        assert moved_view._base is moved_base
        assert geometry(view) == geometry(moved_view)


def test_empty_tensors_that_are_no_views_stay_apart() -> None:
    """Empty tensors that are not views of one another arrive as separate tensors."""
    tensor = torch.zeros(0)
    moved = to_device([tensor, torch.zeros(0), tensor.detach(), torch.zeros(0, 2)], "meta")
    assert [None, None, None, None] == [t._base for t in moved]
    assert 4 == len({id(t) for t in moved})


def test_empty_view_of_an_empty_parameter_links_to_the_moved_parameter() -> None:
    """A view of an empty parameter is a view of the moved parameter, which stays one."""
    param = nn.Parameter(torch.zeros(0))
    moved_view, moved_param = to_device([param.unsqueeze(0), param], "meta")
    assert type(moved_param) is nn.Parameter
    assert moved_view._base is moved_param
    assert moved_view.requires_grad


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
        f"to_device(): the skip predicate is_big (test_move_guarantees.py:{line}) raised on obj:",
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
        f"to_device(): the skip predicate {name} (test_move_guarantees.py:{line}) raised on obj:",
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
        f"to_device(): the skip predicate per_dimension (test_move_guarantees.py:{line}) raised on "
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


@pytest.mark.requires_device("accelerator")
@pytest.mark.parametrize("coalesce", [True, False])
def test_accelerator_round_trip_keeps_empty_views(coalesce: bool) -> None:
    """Empty views, among many small tensors, stay views of their moved base both ways."""
    device = accelerator()
    empty, full = torch.zeros(0, 4, requires_grad=True), torch.arange(8.0)
    batch = {
        "ids": [torch.arange(i + 1) for i in range(32)],
        "alone": [torch.zeros(0) for _ in range(4)],
        "empty": [empty, empty.unsqueeze(0), empty[:, 2:]],
        "full": [full, full[8:], full[3:3], full[1:3]],
    }
    there = to_device(batch, device, coalesce=coalesce)
    back = to_device(there, "cpu", coalesce=coalesce)
    for moved in (there, back):
        for key in ("empty", "full"):
            base, *views = moved[key]
            assert [base] * len(views) == [view._base for view in views]
        assert [None] * 4 == [t._base for t in moved["alone"]]
        assert 4 == len({id(t) for t in moved["alone"]})
    assert all(torch.equal(a, b) for a, b in zip(batch["ids"], back["ids"], strict=True))
    back["empty"][1].sum().backward()
    assert empty.grad is not None
    assert empty.shape == empty.grad.shape


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
