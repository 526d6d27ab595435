"""``to_device``'s guarantees: identity where nothing moves, the input unchanged, dtypes,
strides, autograd, aliasing and views kept, cycles and deep nesting, ``skip=``,
``non_blocking=``, ``coalesce=``, and a move traced by ``torch.compile``.

``meta`` is the second device: tensors there have shapes but no values, so a move from
the CPU to meta is a real move.
"""

from __future__ import annotations

import re
import warnings
from itertools import chain
from typing import Any

import pytest
import torch
from helpers import accelerator
from hypothesis import given
from hypothesis import strategies as st
from move_subjects import Pair, on_meta
from torch import nn

from devicectx import (
    DeviceWarning,
    MoveError,
    RepeatedMoveWarning,
    find_devices,
    to_device,
)
from devicectx.move import _staging
from devicectx.move._alias import TensorMover
from devicectx.move._move import all_on, iter_tensors, move_call, move_to
from devicectx.testing.strategies import nested, tensors

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


@pytest.mark.parametrize("base_first", [True, False])
def test_under_no_grad_a_view_moved_with_its_base_requires_no_grad(base_first: bool) -> None:
    """Under ``no_grad``, a view of a tensor that requires grad, moved with its base, comes
    back requiring no grad, as ``.to``'s copies do and as its moved base does: an in-place
    op on it later, with grad enabled, works as on ``.to``'s copy."""
    weight = torch.randn(4, requires_grad=True)
    view = weight[:2]
    with torch.no_grad():
        moved = to_device([weight, view] if base_first else [view, weight], "meta")
    assert [False, False] == [tensor.requires_grad for tensor in moved]
    moved[1 if base_first else 0].mul_(2)


def test_parameter_stays_a_parameter() -> None:
    """An nn.Parameter comes back an nn.Parameter, with its requires_grad and attributes."""
    frozen = nn.Parameter(torch.zeros(2), requires_grad=False)
    frozen.tag = "kept"  # type: ignore[attr-defined]
    moved = to_device([nn.Parameter(torch.zeros(2)), frozen], "meta")
    assert [type(p) for p in moved] == [nn.Parameter, nn.Parameter]
    assert [p.requires_grad for p in moved] == [True, False]
    assert moved[1].tag == "kept"


def test_a_parameters_gradient_moves_with_it_as_module_to_moves_it() -> None:
    """A parameter moved outside its module keeps its ``.grad``, moved (and cast) with it,
    as ``module.to`` keeps it; a parameter without one gets none."""
    model = nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    moved = to_device(dict(model.named_parameters()), "meta")
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None
        grad = moved[name].grad
        assert grad is not None
        assert (META, parameter.grad.shape) == (grad.device, grad.shape)
    double = nn.Parameter(torch.ones(2, dtype=torch.float64))
    double.grad = torch.full((2,), 0.5, dtype=torch.float64)
    cast = to_device(double, "cpu", dtypes={torch.float64: torch.float32})
    assert cast.grad is not None
    assert (torch.float32, [0.5, 0.5]) == (cast.grad.dtype, cast.grad.tolist())
    assert to_device(nn.Parameter(torch.ones(2)), "meta").grad is None


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


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("ckpt['rng']", "obj['rng']"),  # the path as find_devices(ckpt, name="ckpt") wrote it
        ("obj.rng", "obj['rng']"),  # an attribute's path for a dict's key
        ("rgn", "rng"),  # a typo
        ("ckpt.opt", "obj['opt']"),
    ],
)
def test_a_skip_entry_that_names_nothing_warns_with_what_it_meant(given: str, meant: str) -> None:
    """A key or path in ``skip=`` that names nothing in the argument leaves nothing in
    place, which the caller meant to: a warning at the call names it, how paths are written
    and the ``skip=`` with the entry it most likely meant, which, run as printed, keeps it."""
    ckpt = {"weights": torch.zeros(2), "rng": torch.get_rng_state(), "opt": {"m": torch.ones(1)}}
    with pytest.warns(DeviceWarning) as warned:
        moved = to_device(ckpt, "meta", skip=["weights", given])
    assert 1 == len(warned)
    assert __file__ == warned[0].filename
    assert [
        f"to_device(): skip= entries name nothing in obj, and left nothing in place: "
        f"{given!r} (did you mean {meant!r}?)",
        "paths in skip= start at obj (obj['x'], obj.x), as find_devices(obj) writes them; a "
        "key or attribute name matches at any depth",
        f"fix: skip={['weights', meant]!r}",
    ] == str(warned[0].message).splitlines()
    assert META == moved["rng"].device  # moved: the entry named nothing
    fixed = eval(str(warned[0].message).splitlines()[-1].removeprefix("fix: skip="))
    kept = to_device(ckpt, "meta", skip=fixed)
    assert {"obj['weights']"} < set(find_devices(kept).get(CPU, []))
    assert len(find_devices(kept)[CPU]) == 2


def test_a_skip_key_that_is_a_word_of_a_key_suggests_that_key() -> None:
    """``skip=["rng", "step"]`` on a checkpoint keyed ``"rng_state"`` (as many are): the
    warning suggests that key, too long beside "rng" for a typo's likeness, rather than a
    fix that drops the entry; run as printed, the RNG state stays where torch takes it."""
    optimizer = {"state": {0: {"step": torch.tensor(1.0)}}}
    ckpt = {
        "model": {"w": torch.ones(2)},
        "optimizer": optimizer,
        "rng_state": torch.get_rng_state(),
    }
    with pytest.warns(DeviceWarning) as warned:
        to_device(ckpt, "meta", skip=["rng", "step"])
    lines = str(warned[0].message).splitlines()
    assert "'rng' (did you mean 'rng_state'?)" in lines[0]
    assert "fix: skip=['rng_state', 'step']" == lines[-1]
    kept = to_device(ckpt, "meta", skip=eval(lines[-1].removeprefix("fix: skip=")))
    torch.set_rng_state(kept["rng_state"])  # torch refuses a state moved off the CPU

    # Two such keys (the CPU's and a GPU's RNG states): both, shortest and then by name.
    two = {"w": torch.ones(2), "rng_state_gpu": ckpt["rng_state"], "rng_state": ckpt["rng_state"]}
    with pytest.warns(DeviceWarning) as warned:
        to_device(two, "meta", skip=["rng"])
    lines = str(warned[0].message).splitlines()
    assert "'rng' (did you mean 'rng_state' or 'rng_state_gpu'?)" in lines[0]
    assert "fix: skip=['rng_state', 'rng_state_gpu']" == lines[-1]


def test_a_skip_entry_with_nothing_near_is_named_and_left_out_of_the_fix() -> None:
    """An entry with nothing near it in the structure: named, and the fix keeps the rest."""
    with pytest.warns(DeviceWarning, match="'labels'\n") as warned:
        to_device({"x": torch.zeros(1), "y": torch.zeros(1)}, "meta", skip=["x", "labels"])
    assert "fix: skip=['x']" == str(warned[0].message).splitlines()[-1]


def test_skip_entries_that_name_something_do_not_warn() -> None:
    """Keys met at any depth (also one holding no tensor), paths met, types and predicates
    matching nothing: no warning."""
    batch = {"x": torch.zeros(1), "meta": {"ids": torch.zeros(1), "name": "b0"}, 3: [1]}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "to_device\\(\\): skip=", DeviceWarning)
        for skip in ["ids", "name", 3, "obj['meta']['name']", nn.Module, lambda p, v: False]:
            to_device(batch, "meta", skip=skip)
        to_device(torch.zeros(1), "meta", skip=nn.Module)


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


# A module's own tensors held elsewhere in the structure.


def owned_model() -> nn.Sequential:
    """A module with parameters, buffers (one an integer) and a submodule's of each."""
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


#: What a structure may hold of :func:`owned_model`: (name of the module's tensor, how the
#: structure's tensor is made of it): the tensor itself, or a view of it.
OWNED: list[tuple[str, Any]] = [
    ("0.weight", None),
    ("0.bias", None),
    ("1.weight", None),
    ("1.running_mean", None),
    ("1.running_var", None),
    ("1.num_batches_tracked", None),
    ("0.weight", lambda t: t[1]),
    ("0.weight", lambda t: t.T),
    ("0.weight", lambda t: t[:, 1:]),
    ("0.bias", lambda t: t[2:2]),
    ("1.running_mean", lambda t: t[1:]),
]


def owned_tensor(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer ``name`` (a full name, ``"0.weight"``) of ``module``."""
    owned = dict(module.named_parameters()) | dict(module.named_buffers())
    return owned[name]


def assert_owned(module: nn.Module, picks: list[int], held: list[torch.Tensor]) -> None:
    """Each tensor ``held`` (made as ``OWNED[pick]`` says, before the move) is the module's
    moved tensor, or a view of it at the same place."""
    for pick, moved in zip(picks, held, strict=True):
        name, view = OWNED[pick]
        target = owned_tensor(module, name)
        if view is None:
            assert moved is target, name
        else:
            assert moved._base is target, name
            assert geometry(view(target)) == geometry(moved), name


@given(
    st.lists(st.integers(0, len(OWNED) - 1), max_size=8),
    st.integers(0, 8),
    st.booleans(),
    st.booleans(),
)
def test_a_modules_tensors_held_elsewhere_are_its_moved_tensors(
    picks: list[int], module_at: int, nested: bool, submodule_first: bool
) -> None:
    """Parameters and buffers of a module (and of its submodules) that the structure also
    holds, directly or in an optimizer-like dict, before or after the module (and after a
    submodule of it the structure also holds), come back as the module's moved tensors, and
    views of them as views of those, at the same places."""
    model = owned_model()
    held = []
    for name, view in (OWNED[pick] for pick in picks):
        tensor = owned_tensor(model, name)
        held.append(tensor if view is None else view(tensor))
    at = min(module_at, len(held))
    before, after = held[:at], held[at:]
    if nested:
        before = [{"param_groups": [{"params": before}]}] if before else []
    # A submodule met first moves first: the model then moves the rest of itself.
    batch: dict[str, Any] = {"layer": model[1]} if submodule_first else {}
    batch |= {"before": before, "model": model, "after": after}

    moved = to_device(batch, "meta")

    assert moved["model"] is model
    assert {META} == {t.device for t in chain(model.parameters(), model.buffers())}
    out = moved["before"][0]["param_groups"][0]["params"] if nested and at else moved["before"]
    assert_owned(model, picks, [*out, *moved["after"]])


@pytest.mark.parametrize("module_first", [True, False])
def test_a_modules_tensors_held_elsewhere_with_swapped_parameters(module_first: bool) -> None:
    """Where module.to keeps each parameter object and swaps its contents in
    (torch.__future__'s swap_tensors), a parameter held elsewhere is still that parameter."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model = nn.Linear(3, 2)
        weight = model.weight
        batch = {"model": model, "w": model.weight, "b": model.bias}
        if not module_first:
            batch = {"w": model.weight, "b": model.bias, "model": model}
        moved = to_device(batch, "meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    assert model.weight is weight
    assert moved["w"] is model.weight
    assert moved["b"] is model.bias


@pytest.mark.requires_device("accelerator")
@pytest.mark.parametrize("module_first", [True, False])
@pytest.mark.parametrize("start", ["cpu", "accelerator"])
def test_a_modules_tensors_held_elsewhere_on_the_accelerator(
    module_first: bool, start: str
) -> None:
    """To the accelerator from the host (module.to makes new parameters), and from one
    accelerator device to another (torch keeps each parameter object and swaps its memory:
    set_data), a parameter, a buffer and views of them come back as the module's tensors
    and views of them: a write into the module shows in the views."""
    source, target = torch.device("cpu"), accelerator()
    if start == "accelerator":
        if torch.accelerator.device_count() < 2:
            pytest.skip("needs two devices of the accelerator")
        source, target = accelerator(0), accelerator(1)
    model = nn.Module().to(source)
    # A parameter at an offset in its memory: a view's place in it must be the old one's.
    model.weight = nn.Parameter(torch.arange(12.0, device=source)[3:9].view(2, 3))
    model.register_buffer("counts", torch.arange(4.0, device=source))
    weight = model.weight
    held = {
        "w": model.weight,
        "row": model.weight[1],
        "t": model.weight.T,
        "c": model.counts,
        "tail": model.counts[2:],
    }
    values = {key: t.tolist() for key, t in held.items()}
    batch = {"model": model, **held} if module_first else {**held, "model": model}

    moved = to_device(batch, target)

    assert start == "cpu" or model.weight is weight  # torch's own in-place move, tested
    assert moved["w"] is model.weight
    assert moved["c"] is model.counts
    for key, base in [("row", model.weight), ("t", model.weight), ("tail", model.counts)]:
        assert moved[key]._base is base, key
    assert values == {key: moved[key].tolist() for key in held}
    with torch.no_grad():
        model.weight[1, 0] = 100.0
    assert 100.0 == moved["row"][0].item() == moved["t"][0, 1].item()


@pytest.mark.parametrize("rotation", [0, 1, 2])
def test_a_buffer_that_is_a_view_is_the_modules_moved_buffer(rotation: int) -> None:
    """A buffer registered as a view of a tensor the structure holds too comes back as the
    module's moved buffer (module.to copies it alone), not as a view of that tensor's copy."""
    memory = torch.arange(6.0)
    module = nn.Module()
    module.register_buffer("window", memory[1:3])
    items = [("memory", memory), ("window", module.window), ("module", module)]
    moved = to_device(dict(items[rotation:] + items[:rotation]), "meta")
    assert moved["window"] is module.window
    assert META == moved["memory"].device


@pytest.mark.parametrize("separate", [False, True])
def test_a_parameter_two_modules_share_stays_one(separate: bool) -> None:
    """A parameter two modules share (tied weights), which torch's module.to unties on meta,
    is one parameter after the move, whether one model holds both modules or the structure
    holds each (moved one by one); the structure's own reference to it is that parameter."""
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    second.weight = first.weight
    if separate:
        moved = to_device({"second": second, "first": first, "w": first.weight}, "meta")
    else:
        moved = to_device({"w": first.weight, "model": nn.Sequential(first, second)}, "meta")
    assert first.weight is second.weight
    assert moved["w"] is first.weight
    assert META == first.weight.device


def tied_layers(owners: list[int]) -> list[nn.Module]:
    """Layers each with a weight and a buffer; layer i holds the weight and the buffer of
    layer ``owners[i]`` (itself where ``owners[i] >= i``): tied weights and buffers."""
    layers = []
    for index, owner in enumerate(owners):
        layer = nn.Linear(2, 2, bias=False)
        layer.register_buffer("scale", torch.full((2,), float(index)))
        if owner < index:
            layer.weight = layers[owner].weight
            layer.register_buffer("scale", layers[owner].scale)
        layers.append(layer)
    return layers


def tie_classes(tensors: list[torch.Tensor]) -> list[int]:
    """For each tensor, the index of the first of ``tensors`` that is the same object."""
    return [next(i for i, other in enumerate(tensors) if other is tensor) for tensor in tensors]


@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=6),
    st.sampled_from(["model", "layers", "nested"]),
    st.randoms(use_true_random=False),
    st.booleans(),
)
def test_tied_tensors_stay_tied_after_any_move(
    owners: list[int], shape: str, random: Any, held: bool
) -> None:
    """Whichever layers share weights and buffers, held in one model, one by one in any
    order, or in a model nested in a list beside its own layers, the move keeps every
    sharing, values, and the structure's references to the shared weights; to meta, and
    to the accelerator where the machine has one."""
    targets = [META] + ([accelerator()] if torch.accelerator.is_available() else [])
    for target in targets:
        layers = tied_layers(owners)
        weights = [layer.weight for layer in layers]
        values = [layer.weight.detach().clone() for layer in layers]
        if shape == "model":
            batch: Any = {"model": nn.Sequential(*layers)}
        elif shape == "layers":
            batch = {
                str(i): layer for i, layer in random.sample(list(enumerate(layers)), len(layers))
            }
        else:
            batch = [layers[-1], nn.Sequential(*layers), layers[0]]
        if held:
            batch = {"refs": list(weights), "batch": batch}

        moved = to_device(batch, target)

        now = [layer.weight for layer in layers]
        assert tie_classes(weights) == tie_classes(now)
        assert tie_classes([layer.scale for layer in tied_layers(owners)]) == tie_classes(
            [layer.scale for layer in layers]
        )
        assert {target} == {t.device for layer in layers for t in layer.state_dict().values()}
        if held:
            assert all(ref is weight for ref, weight in zip(moved["refs"], now, strict=True))
        if target != META:
            assert all(torch.equal(v, w.cpu()) for v, w in zip(values, now, strict=True))


@pytest.mark.parametrize("module_first", [True, False])
def test_dtypes_casts_no_modules_tensor_held_elsewhere(module_first: bool) -> None:
    """A dtypes= mapping casts no module's tensor where the structure holds it too (nor its
    views): they come back as the module's own, uncast; the other tensors are cast."""
    model = nn.Linear(2, 2)
    held = {"w": model.weight, "row": model.weight[0], "x": torch.zeros(2)}
    batch = {"model": model, **held} if module_first else {**held, "model": model}

    moved = to_device(batch, "meta", dtypes={torch.float32: torch.float16})

    assert moved["w"] is model.weight
    assert torch.float32 == model.weight.dtype
    assert moved["row"]._base is model.weight
    assert torch.float16 == moved["x"].dtype


def test_a_staged_move_leaves_a_modules_tensors_to_the_module() -> None:
    """A staged move (many small tensors) stages no module's buffer held elsewhere, nor a
    view of one: they come back as the module's moved buffer and a view of it."""
    norm = nn.BatchNorm1d(3)
    batch = {
        "ids": [torch.zeros(3) for _ in range(8)],
        "mean": norm.running_mean,
        "var_tail": norm.running_var[1:],
        "norm": norm,
    }
    with _staging.forced():
        moved = to_device(batch, "meta")
    assert moved["mean"] is norm.running_mean
    assert moved["var_tail"]._base is norm.running_var


# Empty views, and views made where autograd recorded nothing.


@given(st.integers(0, 9), st.integers(1, 10), st.integers(0, 10), st.booleans())
def test_an_empty_view_of_an_absent_base_is_a_view_only_of_what_it_lies_in(
    start: int, length: int, at: int, empty_first: bool
) -> None:
    """An empty slice of an absent base becomes a view of the copy of a slice of that base
    it lies in (its ends included), and is copied alone where it lies outside every one."""
    base = torch.arange(10.0)
    stop = min(start + length, 10)
    full, empty = base[start:stop], base[at:at]
    moved = to_device([empty, full] if empty_first else [full, empty], "meta")
    moved_empty, moved_full = moved if empty_first else moved[::-1]
    if start <= at <= stop:
        assert moved_empty._base is moved_full
        assert at - start == moved_empty.storage_offset() - moved_full.storage_offset()
    else:
        assert moved_empty._base is None
    assert geometry(empty)[:2] == geometry(moved_empty)[:2]


def reaches(tensor: torch.Tensor, leaf: torch.Tensor) -> bool:
    """Whether the gradient of ``tensor`` reaches the leaf ``leaf`` (its autograd graph)."""
    stack = [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if getattr(node, "variable", None) is leaf:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


@pytest.mark.parametrize("grad_enabled", [True, False])
@pytest.mark.parametrize("recorded_first", [True, False])
def test_a_view_is_not_remade_on_a_view_autograd_did_not_record(
    grad_enabled: bool, recorded_first: bool
) -> None:
    """A view with history is not made a view of a larger view of its (absent) base made
    under no_grad, through whose copy its gradient would never reach the base: it is copied
    alone, with its history. Where the move records no history either, it is linked."""
    base = torch.arange(10.0, requires_grad=True)
    with torch.no_grad():
        unrecorded = base[2:8]
    recorded = base[3:5]
    batch = [recorded, unrecorded] if recorded_first else [unrecorded, recorded]

    with torch.set_grad_enabled(grad_enabled):
        moved = to_device(batch, "meta")

    moved_recorded, moved_unrecorded = moved if recorded_first else moved[::-1]
    if grad_enabled:
        assert moved_recorded._base is None
        assert reaches(moved_recorded, base)
    else:
        assert moved_recorded._base is moved_unrecorded


@given(batch=nested(tensors(devices=["cpu"])))
def test_every_path_find_devices_writes_is_a_skip_that_names_something(batch: Any) -> None:
    """Each path find_devices lists, given as ``skip=``, names something: no warning, and
    the tensor at it stays where it was (one in an object moved by its own ``.to`` aside,
    which that ``.to`` moves). A set's members are rebuilt, and a rebuilt set may list
    them in another order, so a member's place in its set is not compared."""
    for path in find_devices(batch).get(CPU, [])[:3]:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", "to_device\\(\\): skip=", DeviceWarning)
            warnings.simplefilter("ignore", RepeatedMoveWarning)
            moved = to_device(batch, "meta", skip=[path])
        left_behind = [any_set_member(p) for p in find_devices(moved).get(CPU, [])]
        assert any_set_member(path) in left_behind, path


def any_set_member(path: str) -> str:
    """``path`` with the place of each set member (``list(obj[0])[2]``) left out."""
    return re.sub(r"\)\[\d+\]", ")[*]", path)
