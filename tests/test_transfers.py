"""Transfer accounting (``track_transfers``) and the repeated-move warning.

Moves go from the CPU to ``meta``, the second device of every machine; the counts and
bytes are checked against an oracle that reads only the input and the result.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import gc
import inspect
import pickle
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import devicectx
from devicectx import (
    DeviceWarning,
    RepeatedMoveWarning,
    device_agnostic,
    prefetch,
    set_repeated_move_warning,
    to_device,
    track_transfers,
)
from devicectx.move import _repeats as repeats_module
from devicectx.move import _staging
from devicectx.move._transfers import account
from devicectx.move._walk import iter_tensors
from devicectx.testing import assert_device_agnostic
from devicectx.testing.strategies import nested, tensors

CPU = torch.device("cpu")
META = torch.device("meta")
HERE = __file__.rsplit("/", 1)[-1]


def _line() -> int:
    """The line after the caller's: where the call under test is written."""
    frame = inspect.currentframe()
    assert frame is not None
    assert frame.f_back is not None
    return frame.f_back.f_lineno + 1


def _expected(original: Any, result: Any) -> dict[int, tuple[str, torch.Tensor]]:
    """The oracle: each tensor of ``original`` (by identity, with its first path) that is
    not on ``meta`` and does not appear, as itself, in ``result``: the ones copied."""
    kept = {id(tensor) for _, tensor in iter_tensors(result, modules=True)}
    copied: dict[int, tuple[str, torch.Tensor]] = {}
    for path, tensor in iter_tensors(original, modules=True):
        if tensor.device != META and id(tensor) not in kept:
            copied.setdefault(id(tensor), (path, tensor))
    return copied


@pytest.fixture
def recorded() -> Iterator[list[warnings.WarningMessage]]:
    """Every warning of the test, whatever filters pytest set."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def _repeats(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, RepeatedMoveWarning)]


# Accounting.

_LEAVES = tensors(devices=["cpu", "meta"])


@given(nested(_LEAVES, views=False))
def test_counts_and_bytes_are_exact_for_nested_batches(batch: Any) -> None:
    """Each tensor copied is counted once, with its bytes, at its first path."""
    with track_transfers() as log:
        result = to_device(batch, META, coalesce=False)
    copied = _expected(batch, result)
    assert len(copied) == log.total_tensors
    assert sum(t.nbytes for _, t in copied.values()) == log.total_bytes
    by_path: Counter[str] = Counter()
    for path, tensor in copied.values():
        by_path[path] += tensor.nbytes
    assert by_path == Counter({row.path: row.bytes for row in log.rows})
    assert all(row.source == CPU and row.target == META for row in log.rows)


@given(nested(_LEAVES, views=False))
def test_staged_moves_are_counted_as_tensor_by_tensor_ones(batch: Any) -> None:
    """A staged move counts each tensor with its own bytes, as a move one by one does."""
    with track_transfers() as alone:
        to_device(batch, META, coalesce=False)
    with _staging.forced(), track_transfers() as staged:
        to_device(batch, META)

    def rows(log: devicectx.TransferLog) -> list[tuple[str, int, int]]:
        return sorted((row.path, row.tensors, row.bytes) for row in log.rows)

    assert rows(alone) == rows(staged)


def test_views_of_a_moved_tensor_are_no_copies() -> None:
    """A view that arrives as a view of its base's copy costs no bytes; a view alone
    costs its own elements, as ``.to`` copies them."""
    base = torch.zeros(4, 4)
    with track_transfers() as log:
        to_device({"base": base, "row": base[1], "again": base}, META)
    assert [("obj['base']", 1, 64)] == [(r.path, r.tensors, r.bytes) for r in log.rows]
    with track_transfers() as log:
        to_device({"column": base[:, 0]}, META)
    assert (1, 16) == (log.total_tensors, log.total_bytes)


def test_the_place_is_the_decorated_function_and_its_parameter_path() -> None:
    """Arguments are counted under ``f()``, results under ``f() -> result``."""

    @device_agnostic(device="cpu", output="meta")
    def step(batch: dict[str, Any], scale: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": batch["x"] * scale}

    @device_agnostic(device="meta")
    def loss(pred: torch.Tensor, target: list[torch.Tensor]) -> torch.Tensor:
        return pred

    with track_transfers() as log:
        step({"x": torch.ones(3)}, torch.ones(()))
        loss(torch.ones(2), [torch.ones(5, dtype=torch.float64)])
    rows = {(r.where, r.path): (r.tensors, r.bytes) for r in log.rows}
    prefix = "test_the_place_is_the_decorated_function_and_its_parameter_path.<locals>"
    assert rows == {
        (f"{prefix}.step() -> result", "result['out']"): (1, 12),
        (f"{prefix}.loss()", "pred"): (1, 8),
        (f"{prefix}.loss()", "target[0]"): (1, 40),
    }


def test_the_place_of_to_device_is_the_line_that_called_it() -> None:
    """``to_device`` is counted under its caller's ``file:line``."""
    with track_transfers() as log:
        line = _line()
        to_device([torch.ones(2)], META)
    assert [(f"{HERE}:{line}", "obj[0]")] == [
        (r.where.rsplit("/", 1)[-1], r.path) for r in log.rows
    ]


def test_modules_and_objects_with_their_own_to_are_counted() -> None:
    """Tensors moved by a module's or an object's own ``.to`` count as found in them."""

    class Pair:
        def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
            self.a, self.b = a, b

        def to(self, device: torch.device) -> Pair:
            return Pair(self.a.to(device), self.b.to(device))

    model = nn.Linear(3, 2)  # 6 + 2 float32 parameters
    with track_transfers() as log:
        to_device({"model": model, "pair": Pair(torch.ones(1), torch.ones(2))}, META)
    assert (2, 32) == (log.total_tensors, log.total_bytes)  # the module; Pair is opaque
    assert {"obj['model'].weight": 24, "obj['model'].bias": 8} == {
        r.path: r.bytes for r in log.rows
    }


def test_nothing_is_recorded_outside_the_block_and_nested_blocks_each_record() -> None:
    """A log sees the moves of its block only; an inner block's moves reach both."""
    with track_transfers() as outer:
        to_device(torch.ones(1), META)
        with track_transfers() as inner:
            to_device(torch.ones(2), META)
        to_device(torch.ones(4), META)
    to_device(torch.ones(8), META)
    assert (3, 28) == (outer.total_tensors, outer.total_bytes)
    assert (1, 8) == (inner.total_tensors, inner.total_bytes)
    outer.clear()
    assert (0, 0, "no transfers") == (outer.total_tensors, outer.total_bytes, outer.table())


def test_compiled_code_records_nothing_and_eager_moves_around_it_are_counted() -> None:
    """A move that torch.compile traces into its graph is not seen (as the docstring
    says); the eager moves around the compiled call are, as usual."""
    compiled = torch.compile(lambda batch: to_device(batch, META), fullgraph=True)
    with track_transfers() as log:
        moved = compiled({"a": torch.zeros(2)})
        to_device({"b": torch.zeros(4)}, META)
    assert META == moved["a"].device
    assert (1, 16) == (log.total_tensors, log.total_bytes)


def test_a_log_sees_its_own_thread_only() -> None:
    """Moves in another thread are not recorded by this thread's log, and vice versa."""
    logs: dict[str, devicectx.TransferLog] = {}
    started, moved = threading.Event(), threading.Event()

    def worker() -> None:
        with track_transfers() as log:
            logs["worker"] = log
            started.set()
            to_device(torch.ones(4), META)
            moved.set()

    with track_transfers() as mine:
        thread = threading.Thread(target=worker)
        thread.start()
        assert started.wait(60)
        to_device(torch.ones(1), META)
        assert moved.wait(60)
        thread.join()
    assert (1, 4) == (mine.total_tensors, mine.total_bytes)
    assert (1, 16) == (logs["worker"].total_tensors, logs["worker"].total_bytes)


def test_each_asyncio_task_has_its_own_log() -> None:
    """Two tasks tracking at once record their own moves only."""

    async def task(size: int) -> tuple[int, int]:
        with track_transfers() as log:
            for _ in range(3):
                to_device(torch.ones(size), META)
                await asyncio.sleep(0)
        return log.total_tensors, log.total_bytes

    async def both() -> list[tuple[int, int]]:
        return list(await asyncio.gather(task(1), task(2)))

    assert [(3, 12), (3, 24)] == asyncio.run(both())


def test_the_table_and_the_dict() -> None:
    """The text table sums by place and direction; the dict holds the same, as plain values."""

    @device_agnostic(device="meta")
    def f(x: torch.Tensor) -> torch.Tensor:
        return x

    with track_transfers() as log:
        for _ in range(2):
            f(torch.ones(256))
    name = "test_the_table_and_the_dict.<locals>.f()"
    assert log.table().splitlines() == [
        f"where{' ' * (len(name) - 5)}  what  from -> to   tensors    bytes",
        f"{name}  x     cpu -> meta        2  2.0 KiB",
        f"total{' ' * (len(name) - 5)}        cpu -> meta        2  2.0 KiB",
    ]
    assert log.as_dict() == {
        "total_tensors": 2,
        "total_bytes": 2048,
        "directions": {"cpu -> meta": {"tensors": 2, "bytes": 2048}},
        "rows": [
            {"where": name, "path": "x", "source": "cpu", "target": "meta", "tensors": 2,
             "bytes": 2048},
        ],
    }  # fmt: skip
    assert str(log) == log.table()
    assert repr(log) == "<TransferLog: 2 tensors, 2.0 KiB>"


def test_a_log_pickles_and_copies_as_its_sums() -> None:
    """A log goes where a rank's results go (``all_gather_object``, a worker process's
    return value) and deep-copies: its rows come back, and the copy records on its own.
    It raised "cannot pickle '_thread.lock' object"."""
    with track_transfers() as log:
        to_device({"x": torch.zeros(4)}, META)
    for copied in (pickle.loads(pickle.dumps(log)), copy.deepcopy(log)):
        assert (copied.rows, copied.as_dict()) == (log.rows, log.as_dict())
        copied.add("here", "y", CPU, META, 8)
        assert (copied.total_tensors, log.total_tensors) == (2, 1)


# The bytes of a tensor that is not a plain strided one: what its copy carries.


def _by_hand(*parts: torch.Tensor) -> int:
    """The bytes of a copy's components, each a plain tensor: elements times their size."""
    return sum(part.numel() * part.element_size() for part in parts)


def _coo() -> torch.Tensor:
    indices = torch.tensor([[0, 1, 1, 999], [2, 0, 2, 999]])
    return torch.sparse_coo_tensor(indices, torch.tensor([3.0, 4.0, 5.0, 6.0]), (1000, 1000))


def _jagged_with_lengths() -> torch.Tensor:
    padded = torch.randn(2, 5, 3)
    starts, lengths = torch.tensor([0, 1]), torch.tensor([2, 3])
    return torch.nested.narrow(padded, 1, starts, lengths, layout=torch.jagged)


def _masked() -> torch.Tensor:
    return torch.masked.masked_tensor(torch.randn(10), torch.rand(10) > 0.5)


def _two_tensor() -> torch.Tensor:
    # torch's own test subclass: a traceable wrapper (``__tensor_flatten__``) of two tensors.
    from torch.testing._internal.two_tensor import TwoTensor

    return TwoTensor(torch.randn(4, 2), torch.randn(4, 2))


_DENSE = torch.arange(16.0).reshape(4, 4)

_KINDS: dict[str, tuple[Callable[[], torch.Tensor], Callable[[Any], list[torch.Tensor]]]] = {
    "strided": (lambda: torch.zeros(3, 5, dtype=torch.float64), lambda t: [t]),
    "sparse_coo": (_coo, lambda t: [t._indices(), t._values()]),
    "sparse_coo_coalesced": (lambda: _coo().coalesce(), lambda t: [t.indices(), t.values()]),
    "sparse_csr": (
        lambda: _coo().to_sparse_csr(),
        lambda t: [t.crow_indices(), t.col_indices(), t.values()],
    ),
    "sparse_csc": (
        lambda: _coo().to_sparse_csc(),
        lambda t: [t.ccol_indices(), t.row_indices(), t.values()],
    ),
    "sparse_bsr": (
        lambda: _DENSE.to_sparse_bsr((2, 2)),
        lambda t: [t.crow_indices(), t.col_indices(), t.values()],
    ),
    "sparse_bsc": (
        lambda: _DENSE.to_sparse_bsc((2, 2)),
        lambda t: [t.ccol_indices(), t.row_indices(), t.values()],
    ),
    "jagged": (
        lambda: torch.nested.nested_tensor(
            [torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged
        ),
        lambda t: [t.values(), t.offsets()],
    ),
    "jagged_with_lengths": (_jagged_with_lengths, lambda t: [t.values(), t.offsets(), t.lengths()]),
    "masked": (_masked, lambda t: [t.get_data(), t.get_mask()]),
    "traceable_wrapper": (_two_tensor, lambda t: [t.a, t.b]),
}


# torch's "in prototype" and "in beta" warnings for these layouts
_PROTOTYPES = pytest.mark.filterwarnings("ignore::UserWarning")


@_PROTOTYPES
@pytest.mark.parametrize("kind", list(_KINDS))
def test_a_tensors_bytes_are_what_its_copy_carries(kind: str) -> None:
    """A sparse, nested, masked or wrapper tensor counts the tensors it holds (indices and
    values, values and offsets, data and mask, inner tensors), not the dense size it stands
    for: a 1000 x 1000 sparse matrix of 4 nonzeros counted 4,000,000 bytes, a COO one
    failed the move, a jagged tensor left its offsets out, a masked one its mask."""
    make, parts = _KINDS[kind]
    tensor = make()
    with track_transfers() as log:
        moved = to_device({"t": tensor}, META)["t"]
    assert moved.device == META
    assert [("obj['t']", 1, _by_hand(*parts(tensor)))] == [
        (row.path, row.tensors, row.bytes) for row in log.rows
    ]


@_PROTOTYPES
def test_a_strided_nested_tensor_counts_its_buffer_and_sizes() -> None:
    """A nested tensor of the strided layout counts its buffer and the sizes of its
    tensors. It cannot move to ``meta``, so the move's accounting is given it directly."""
    tensor = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    expected = _by_hand(tensor.values(), tensor._nested_tensor_size())
    with track_transfers() as log:
        account([tensor], META, {"t": tensor}, "obj", None, check=False)
    assert (1, expected) == (log.total_tensors, log.total_bytes)
    assert 72 + 32 == expected  # 18 float32 elements; 2 tensors x 2 sizes of int64


@_PROTOTYPES
def test_the_repeated_move_warning_counts_a_sparse_tensors_bytes(
    recorded: list[warnings.WarningMessage],
) -> None:
    """A sparse constant moved on every call is named with the bytes its copy carries
    (compressed and plain indices, values: 7.9 KiB), not its dense size (3.8 MiB)."""

    @device_agnostic(device="meta")
    def step(x: torch.Tensor, adjacency: torch.Tensor) -> None:
        return None

    adjacency = _coo().to_sparse_csr()
    size = repeats_module.size_text(
        _by_hand(adjacency.crow_indices(), adjacency.col_indices(), adjacency.values())
    )
    assert "7.9 KiB" == size
    for _ in range(3):
        step(torch.zeros(3), adjacency)
    (warning,) = _repeats(recorded)
    assert str(warning.message).splitlines()[0] == (
        "test_the_repeated_move_warning_counts_a_sparse_tensors_bytes.<locals>.step() copied "
        f"the same unchanged tensor adjacency (shape (1000, 1000), torch.float32, {size}) "
        f"from cpu to meta again: {size} crosses on every call"
    )


# The repeated-move warning.


def test_an_unchanged_tensor_moved_again_by_a_place_warns_once(
    recorded: list[warnings.WarningMessage],
) -> None:
    """A constant moved on every call warns once, at the caller's line, naming it and the fix;
    the new batch of each call does not."""

    @device_agnostic(device="meta")
    def step(batch: dict[str, torch.Tensor], weight: torch.Tensor) -> None:
        return None

    weight = torch.ones(5)
    lines = []
    for _ in range(4):
        lines.append(_line())
        step({"x": torch.zeros(3)}, weight)
    (warning,) = _repeats(recorded)
    assert (warning.filename, warning.lineno) == (__file__, lines[1])
    place = "test_an_unchanged_tensor_moved_again_by_a_place_warns_once.<locals>.step()"
    assert str(warning.message).splitlines() == [
        f"{place} copied the same unchanged tensor weight (shape (5,), torch.float32, 20 B) "
        "from cpu to meta again: 20 B crosses on every call",
        "fix: pass it on meta already: weight = weight.to('meta') once, before the loop; for "
        "a model's constant, register it as a buffer (self.register_buffer(name, tensor)) so "
        "that model.to() moves it once",
    ]
    assert issubclass(warning.category, DeviceWarning)
    assert issubclass(warning.category, UserWarning)


@pytest.mark.parametrize("loose", [False, True])
def test_moved_parameters_can_still_be_swapped(loose: bool) -> None:
    """A parameter a move sent, in its module or alone, stays swappable: torch's
    swap_tensors (module.to and load_state_dict under torch.__future__'s swap flag, and
    module.to of tensor-subclass parameters) refuses any tensor with a weak reference."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model = nn.Linear(3, 2)
        to_device({"w": model.weight} if loose else model, "meta")
        assert weakref.getweakrefcount(model.weight) == 0
        model.to_empty(device="cpu")  # swaps each parameter in
        model.load_state_dict(nn.Linear(3, 2).state_dict())  # swaps again
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    assert torch.device("cpu") == model.weight.device


def test_a_tensor_changed_in_place_between_moves_does_not_warn(
    recorded: list[warnings.WarningMessage],
) -> None:
    """A tensor whose version counter moved (written in place) is new data: no warning."""
    state = torch.zeros(3)
    for step in range(3):
        state.add_(step)
        to_device(state, META)
    assert [] == _repeats(recorded)


@pytest.mark.parametrize(
    "share",
    [
        lambda a: torch.from_numpy(a),
        lambda a: torch.utils.dlpack.from_dlpack(a),
        lambda a: torch.frombuffer(a.data, dtype=torch.float32),
    ],
    ids=["from_numpy", "dlpack", "frombuffer"],
)
def test_memory_written_outside_torch_is_no_repeat(
    recorded: list[warnings.WarningMessage], share: Callable[[np.ndarray], torch.Tensor]
) -> None:
    """A tensor on memory torch does not own (a numpy array refilled in place at every
    step, a replay buffer's): its version counter never sees those writes, and moving it
    once before the loop (the warning's fix) would freeze the data. No warning; a tensor
    of torch's own, the same way, is warned of."""
    array = np.zeros(4, dtype=np.float32)
    shared, own = share(array), torch.zeros(4)
    for step in range(12):
        array[:] = step  # a new observation, written through numpy
        to_device({"obs": shared}, META)
    assert [] == _repeats(recorded)
    for _ in range(3):
        to_device({"own": own}, META)
    assert 1 == len(_repeats(recorded))


@pytest.mark.requires_device("accelerator")
def test_a_pinned_tensor_moved_again_unchanged_is_a_repeat(
    recorded: list[warnings.WarningMessage],
) -> None:
    """Pinned memory is torch's own (written by its ops, which the version counter sees),
    though torch never resizes it, as it never resizes memory it does not own."""
    pinned = torch.ones(4).pin_memory()
    for _ in range(3):
        to_device({"pinned": pinned}, torch.accelerator.current_accelerator())
    assert 1 == len(_repeats(recorded))


def test_to_device_warns_per_calling_line(recorded: list[warnings.WarningMessage]) -> None:
    """The same tensor moved from two lines is no repeat; moved twice from one line it is."""
    mask = torch.ones(2, dtype=torch.bool)
    to_device(mask, META)
    to_device(mask, META)
    assert [] == _repeats(recorded)
    for _ in range(3):
        line = _line()
        to_device({"mask": mask}, META)
    (warning,) = _repeats(recorded)
    assert (warning.filename, warning.lineno) == (__file__, line)
    assert f"{HERE}:{line} copied the same unchanged tensor obj['mask']" in str(warning.message)
    assert "fix: call to_device on it once, before the loop, and reuse the result" in str(
        warning.message
    )


class _Identity(nn.Module):
    @device_agnostic(device="meta")
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _Casting(nn.Module):
    # A dtype mapping: under torch.compile the call runs eagerly behind a graph break.
    @device_agnostic(device="meta", dtypes={torch.float64: torch.float32})
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("compiled", [False, True])
def test_a_decorated_forward_warns_at_the_line_that_calls_the_model(
    recorded: list[warnings.WarningMessage], compiled: bool
) -> None:
    """Called through nn.Module's __call__ (and through dynamo's frame, run eagerly behind
    a graph break), the warning is at the user's line, not in torch's files, and its fix
    names the caller's variable."""
    call = torch.compile(_Casting(), backend="eager") if compiled else _Identity()
    x = torch.ones(2)
    for _ in range(3):
        line = _line()
        call(x)
    (warning,) = _repeats(recorded)
    assert (warning.filename, warning.lineno) == (__file__, line)
    assert "x = x.to('meta') once, before the loop" in str(warning.message)


@pytest.mark.requires_device("accelerator")
def test_a_call_autograd_runs_again_warns_at_the_decorated_function(
    recorded: list[warnings.WarningMessage],
) -> None:
    """Under activation checkpointing, backward runs the decorated call again, from no
    line of the caller's: the second move's warning is given at the function's definition
    (it was at a line of devicectx's own source)."""
    from torch.utils.checkpoint import checkpoint

    model = nn.Linear(3, 1).to(torch.accelerator.current_accelerator())

    @device_agnostic
    def block(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)  # type: ignore[no-any-return]

    defined = inspect.getsourcelines(block)[1]
    x = torch.ones(2, 3, requires_grad=True)
    checkpoint(block, model, x, use_reentrant=False).sum().backward()
    assert [(__file__, defined)] == [(w.filename, w.lineno) for w in _repeats(recorded)]


def test_a_batch_of_constants_is_one_warning(recorded: list[warnings.WarningMessage]) -> None:
    """A cached batch moved again is one warning that names three of its tensors and counts
    the rest, with their bytes in all; a constant added later gets a warning of its own."""
    batch = {f"t{index}": torch.ones(2) for index in range(10)}

    def move() -> None:
        to_device(batch, META)

    line = move.__code__.co_firstlineno + 1
    for _ in range(2):
        move()
    (warning,) = _repeats(recorded)
    assert (warning.filename, warning.lineno) == (__file__, line)
    tensors = ", ".join(f"obj['t{index}'] (shape (2,), torch.float32, 8 B)" for index in range(3))
    first, fix = str(warning.message).splitlines()
    assert first.endswith(
        f"{HERE}:{line} copied the same 10 unchanged tensors {tensors} and 7 more from cpu "
        "to meta again: 80 B crosses on every call"
    )
    assert fix == (
        "fix: call to_device on them once, before the loop, and reuse the result; for a "
        "model's constant, register it as a buffer (self.register_buffer(name, tensor)) so "
        "that model.to() moves it once"
    )
    recorded.clear()
    batch["late"] = torch.zeros(3)
    for _ in range(2):
        move()
    (warning,) = _repeats(recorded)
    assert "the same unchanged tensor obj['late'] (shape (3,)" in str(warning.message)


def test_constants_of_a_decorated_call_are_one_warning_with_each_fix(
    recorded: list[warnings.WarningMessage],
) -> None:
    """Two constant arguments of a decorated call: one warning, the fix for each."""

    @device_agnostic(device="meta")
    def loss(logits: torch.Tensor, weight: torch.Tensor, table: torch.Tensor) -> None:
        return None

    weight, table = torch.ones(2), torch.ones(4)
    for _ in range(3):
        loss(torch.zeros(2), weight, table)
    (warning,) = _repeats(recorded)
    first, fix = str(warning.message).splitlines()
    assert first.endswith(
        "copied the same 2 unchanged tensors weight (shape (2,), torch.float32, 8 B), table "
        "(shape (4,), torch.float32, 16 B) from cpu to meta again: 24 B crosses on every call"
    )
    assert fix.startswith(
        "fix: pass them on meta already, each moved once before the loop: "
        "weight = weight.to('meta'), table = table.to('meta'); "
    )


@pytest.mark.parametrize("error", [RuntimeError, ValueError])
def test_a_retry_after_a_failed_call_is_no_repeat(
    recorded: list[warnings.WarningMessage], error: type[Exception]
) -> None:
    """A call whose body raised, retried with the same batch (after an out-of-memory, say):
    the batch crossed twice, for the two tries, and no warning says it crosses at every
    call; the same batch at the calls after a successful one still warns."""
    tries = []

    @device_agnostic(device="meta")
    def step(x: torch.Tensor) -> None:
        tries.append(1)
        if len(tries) == 1:
            raise error("a transient failure")

    x = torch.ones(2)
    with pytest.raises(error):
        step(x)
    step(x)
    assert [] == _repeats(recorded)
    step(x)
    (warning,) = _repeats(recorded)
    assert "the same unchanged tensor x (shape (2,)" in str(warning.message)


def test_a_default_and_an_argument_that_cross_get_each_their_fix(
    recorded: list[warnings.WarningMessage],
) -> None:
    """A constant argument and a tensor default moved at every call: one warning, whose fix
    moves the argument and makes the default on the device."""
    weights = torch.ones(3)

    @device_agnostic(device="meta")
    def loss(table: torch.Tensor, weight: torch.Tensor = weights) -> None:
        return None

    table = torch.ones(2)
    for _ in range(3):
        loss(table)
    (warning,) = _repeats(recorded)
    fix = str(warning.message).splitlines()[1]
    assert fix.startswith(
        "fix: have them on meta already, each moved once before the loop: "
        "table = table.to('meta'), weight's default made on meta in the def; "
    )


@given(st.lists(st.sampled_from(["same", "new", "bumped"]), min_size=1, max_size=8))
def test_the_warning_follows_identity_and_version(steps: list[str]) -> None:
    """Over any sequence of calls, the warning comes exactly when a tensor is moved twice
    in a row unchanged, and only the first time."""
    from devicectx.move._repeats import _reset_for_tests

    _reset_for_tests()
    tensor = torch.ones(2)
    expected, previous = 0, False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index, step in enumerate(steps):
            if step == "new":
                tensor = torch.ones(2)
            elif step == "bumped":
                tensor.mul_(1)
            repeat = index > 0 and step == "same" and previous
            if repeat and expected == 0:
                expected = 1
            previous = True
            to_device(tensor, META)
    assert expected == len(_repeats(caught))


def test_a_busy_place_is_checked_two_moves_in_a_row_in_eight(
    recorded: list[warnings.WarningMessage],
) -> None:
    """Past a place's first 9 moves, two moves in a row in every 8 are looked at: a
    constant that starts at the 21st move is reported at the 25th, compared with the 24th."""

    @device_agnostic(device="meta")
    def step(x: torch.Tensor) -> None:
        return None

    constant = torch.ones(2)
    reported_at = []
    for call in range(40):
        step(torch.ones(2) if call < 20 else constant)
        if _repeats(recorded) and not reported_at:
            reported_at.append(call)
    assert [24] == reported_at
    assert 1 == len(_repeats(recorded))


@pytest.mark.parametrize("batches", [2, 3, 4, 8])
def test_a_few_batches_cycled_are_no_constant(
    batches: int, recorded: list[warnings.WarningMessage]
) -> None:
    """A list of a few batches cycled through a step for many epochs moves each batch only
    every few calls: no warning, whatever the number of batches (it came for 2, 4 and 8)."""

    @device_agnostic(device="meta")
    def step(x: torch.Tensor) -> None:
        return None

    cycled = [torch.ones(2) for _ in range(batches)]
    for call in range(64):
        step(cycled[call % batches])
    assert [] == _repeats(recorded)


def test_two_functions_of_one_name_are_two_places(
    recorded: list[warnings.WarningMessage],
) -> None:
    """Two decorated functions named alike (loss_fn in two modules), each given the step's
    new tensor, are two places: no warning."""

    def make() -> Callable[[torch.Tensor], None]:
        @device_agnostic(device="meta")
        def loss_fn(y: torch.Tensor) -> None:
            return None

        return loss_fn

    train, metrics = make(), make()
    for _ in range(12):
        y = torch.ones(2)
        train(y)
        metrics(y)
    assert [] == _repeats(recorded)


def test_a_default_that_crosses_is_fixed_at_the_default(
    recorded: list[warnings.WarningMessage],
) -> None:
    """A tensor default moved at every call: the fix is to the default (rebinding a name
    in the loop cannot reach it), or to pass the argument on the device."""
    weights = torch.ones(3)

    @device_agnostic(device="meta")
    def loss(logits: torch.Tensor, weight: torch.Tensor = weights) -> None:
        return None

    for _ in range(3):
        loss(torch.zeros(3))
    (warning,) = _repeats(recorded)
    first, fix = str(warning.message).splitlines()
    assert first.endswith(
        "loss() copied the same unchanged tensor weight (shape (3,), torch.float32, 12 B) "
        "from cpu to meta again: 12 B crosses on every call"
    )
    assert fix.startswith(
        "fix: it is weight's default, which stays where it is: make the default on meta "
        "where the function is defined (weight=<the tensor>.to('meta')), or pass weight on "
        "meta already; "
    )


def test_threads_warn_once_per_place(recorded: list[warnings.WarningMessage]) -> None:
    """Threads that share a constant and call the same function warn once between them."""

    @device_agnostic(device="meta")
    def step(batch: torch.Tensor, table: torch.Tensor) -> None:
        return None

    table = torch.arange(10.0)
    barrier = threading.Barrier(4)

    def worker() -> None:
        barrier.wait(60)
        for _ in range(5):
            step(torch.zeros(2), table)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    (warning,) = _repeats(recorded)
    assert "tensor table (shape (10,)" in str(warning.message)


def test_the_check_can_be_turned_off(recorded: list[warnings.WarningMessage]) -> None:
    """``set_repeated_move_warning(False)`` stops the check; it returns the old setting."""
    weight = torch.ones(2)
    assert set_repeated_move_warning(False) is True
    for _ in range(3):
        to_device(weight, META)
    assert [] == _repeats(recorded)
    assert set_repeated_move_warning(True) is False
    for _ in range(2):
        to_device(weight, META)
    assert 1 == len(_repeats(recorded))


def test_a_warnings_filter_silences_it() -> None:
    """The warning class is filterable like any ``UserWarning``: the same moves warn without
    the filter and raise nothing with it."""
    unfiltered = torch.ones(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            to_device(unfiltered, META)
    assert _repeats(caught) != []
    weight = torch.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=DeviceWarning)
        for _ in range(3):
            to_device(weight, META)


def test_the_check_keeps_no_batch_alive() -> None:
    """A place remembers its last move weakly: the batch is freed when the caller drops it."""
    batch = {"x": torch.ones(3)}
    gone = weakref.ref(batch["x"])
    to_device(batch, META)
    del batch
    assert gone() is None


def test_a_places_memory_goes_with_its_function_and_its_prefetcher() -> None:
    """What the check remembers of a decorated function, or of a prefetcher, goes with it:
    a notebook that makes a prefetcher each epoch, or defines its step again in each run of
    a cell, keeps nothing of the old ones."""
    before = set(repeats_module._REMEMBERING)
    weight = torch.ones(2)

    def epoch() -> list[weakref.ref[Any]]:
        @device_agnostic(device=META)
        def step(batch: dict[str, torch.Tensor], w: torch.Tensor) -> int:
            return len(batch)

        batches = prefetch([{"x": torch.ones(2)}, {"x": torch.ones(2)}], META)
        for batch in batches:
            step(batch, weight)
        return [weakref.ref(place) for place in set(repeats_module._REMEMBERING) - before]

    made = epoch()
    assert len(made) == 2  # the step's, the prefetcher's
    gc.collect()
    assert [None, None] == [place() for place in made]


def test_the_lines_that_moved_are_remembered_up_to_a_bound(
    monkeypatch: pytest.MonkeyPatch, recorded: list[warnings.WarningMessage]
) -> None:
    """The lines that called ``to_device`` are remembered up to a bound, the oldest let go
    first (a notebook's cells are new files at each run); the newest still warn."""
    monkeypatch.setattr(repeats_module, "_LAST", {})
    monkeypatch.setattr(repeats_module, "_LINES", 4)
    weight = torch.ones(2)
    for run in range(10):
        code = compile("for _ in range(2): to_device(weight, META)", f"<cell {run}>", "exec")
        exec(code, {"to_device": to_device, "weight": weight, "META": META})
        assert len(repeats_module._LAST) <= 4
    assert [f"<cell {run}>" for run in range(10)] == [w.filename for w in _repeats(recorded)]


def test_turning_the_check_off_forgets_what_decorated_functions_moved(
    recorded: list[warnings.WarningMessage],
) -> None:
    """Off and on again, the check starts afresh at a decorated function too: its first move
    after is compared with nothing before."""
    weight = torch.ones(2)

    @device_agnostic(device=META)
    def step(w: torch.Tensor) -> torch.Tensor:
        return w

    step(weight)
    set_repeated_move_warning(False)
    set_repeated_move_warning(True)
    step(weight)
    assert [] == _repeats(recorded)
    step(weight)
    assert 1 == len(_repeats(recorded))


def test_inference_tensors_are_moved_without_a_check(
    recorded: list[warnings.WarningMessage],
) -> None:
    """Inference tensors keep no version counter: they are moved, counted, never reported."""
    with torch.inference_mode():
        tensor = torch.ones(2)
    with track_transfers() as log:
        for _ in range(3):
            to_device(tensor, META)
    assert (3, 24) == (log.total_tensors, log.total_bytes)
    assert [] == _repeats(recorded)


def test_the_testing_kit_moves_the_same_inputs_without_a_warning(
    recorded: list[warnings.WarningMessage],
) -> None:
    """``assert_device_agnostic`` moves one input to each device on purpose, every call."""
    x = torch.ones(3)
    for _ in range(3):
        assert_device_agnostic(torch.sin, x, devices=["cpu", "meta"])
    assert [] == _repeats(recorded)


# The repeated-move warning's fix names what the caller holds.

_CONSTANT_TABLE = torch.ones(4)  # a module's constant, read by a function below


def _fix_line(caught: list[warnings.WarningMessage]) -> str:
    """The fix of the one repeated-move warning caught, without its advice on buffers."""
    (warning,) = _repeats(caught)
    fix = str(warning.message).splitlines()[1]
    return fix.split("; for a model's constant", 1)[0]


def _run_fix(fix: str, namespace: dict[str, Any]) -> None:
    """Run the statement the fix prints (``fix: pass it on meta already: <it> once, ...``)
    in ``namespace``, as the user would before the loop."""
    statement = fix.split(" already: ", 1)[1].split(" once, ", 1)[0]
    exec(statement, namespace)


@device_agnostic(device="meta")
def _step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x


def test_the_fix_names_the_callers_variable_and_works(
    recorded: list[warnings.WarningMessage],
) -> None:
    """The fix moves the caller's variable (W), not the parameter it was passed as (w);
    run, it stops the copies: the loop then moves only each call's new batch."""
    W = torch.ones(3)
    for _ in range(3):
        _step(torch.ones(3), W)
    fix = _fix_line(recorded)
    assert fix == "fix: pass it on meta already: W = W.to('meta') once, before the loop"
    namespace = {"W": W}
    _run_fix(fix, namespace)
    recorded.clear()
    with track_transfers() as log:
        for _ in range(3):
            _step(torch.ones(3), namespace["W"])
    assert (3, []) == (log.total_tensors, _repeats(recorded))


class _Holder:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.weights = tensor


@pytest.mark.parametrize("held", ["attribute", "dict entry", "list item"])
def test_the_fix_names_what_holds_it_one_step_down(
    recorded: list[warnings.WarningMessage], held: str
) -> None:
    """A tensor the caller reaches through an object, a dict or a list is named there
    (holder.weights, consts['w'], tables[1]), and the fix, run, stops the copies."""
    holder = _Holder(torch.ones(3))
    consts = {"w": torch.ones(3)}
    tables = [torch.zeros(1), torch.ones(3)]
    get: Callable[[], torch.Tensor] = {
        "attribute": lambda: holder.weights,
        "dict entry": lambda: consts["w"],
        "list item": lambda: tables[1],
    }[held]
    for _ in range(3):
        _step(torch.ones(3), get())
    expected = {
        "attribute": "holder.weights",
        "dict entry": "consts['w']",
        "list item": "tables[1]",
    }
    name = expected[held]
    fix = _fix_line(recorded)
    assert fix == f"fix: pass it on meta already: {name} = {name}.to('meta') once, before the loop"
    _run_fix(fix, {"holder": holder, "consts": consts, "tables": tables})
    recorded.clear()
    with track_transfers() as log:
        for _ in range(3):
            _step(torch.ones(3), get())
    assert (3, []) == (log.total_tensors, _repeats(recorded))


def test_the_fix_prefers_the_name_written_in_the_calling_line(
    recorded: list[warnings.WarningMessage],
) -> None:
    """Of two names for the tensor, the one the call is written with is moved: rebinding
    the other would not change what the loop passes."""
    alias = torch.ones(3)
    weights = alias
    for _ in range(3):
        _step(torch.ones(3), weights)
    assert alias is weights
    fix = _fix_line(recorded)
    assert fix == "fix: pass it on meta already: weights = weights.to('meta') once, before the loop"


def test_the_fix_moves_a_global_where_the_module_defines_it(
    recorded: list[warnings.WarningMessage], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module's global read in a function is moved at the top level of its file (rebound
    in the function, the name would be a local, unbound when read); run in the module, the
    fix stops the copies."""

    def train() -> None:
        for _ in range(3):
            _step(torch.ones(4), _CONSTANT_TABLE)

    train()
    fix = _fix_line(recorded)
    assert fix == (
        "fix: pass it on meta already: _CONSTANT_TABLE = _CONSTANT_TABLE.to('meta') once, "
        "at the top level of its file, where _CONSTANT_TABLE is defined"
    )
    module = train.__globals__
    monkeypatch.setitem(module, "_CONSTANT_TABLE", _CONSTANT_TABLE)  # put back after
    _run_fix(fix, module)
    recorded.clear()
    with track_transfers() as log:
        train()
    assert (3, []) == (log.total_tensors, _repeats(recorded))


def test_the_fix_of_an_argument_of_the_caller_is_where_it_is_called_from(
    recorded: list[warnings.WarningMessage],
) -> None:
    """A tensor the caller got as its own argument comes from further out: moved in the
    caller, it would be moved at every call again."""

    def train_step(batch: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return _step(batch, table)

    table = torch.ones(3)
    for _ in range(3):
        train_step(torch.ones(3), table)
    assert _fix_line(recorded) == (
        "fix: pass it on meta already: it is table, an argument of train_step(): move it to "
        "meta once where train_step() is called from, before the loop"
    )
    table = table.to("meta")  # the fix, where train_step() is called from
    recorded.clear()
    with track_transfers() as log:
        for _ in range(3):
            train_step(torch.ones(3), table)
    assert (3, []) == (log.total_tensors, _repeats(recorded))


def _cached(size: int) -> Callable[[], torch.Tensor]:
    """A function that returns the same tensor at every call, kept where its caller
    cannot name it."""
    kept = torch.ones(size)
    return lambda: kept


def test_the_fix_of_a_tensor_the_caller_holds_nowhere_names_what_it_was_passed_as(
    recorded: list[warnings.WarningMessage],
) -> None:
    """Held nowhere the caller can name (returned by a function, which keeps it), the
    tensor is named by the parameter it was passed as, as such."""
    cached = _cached(3)
    for _ in range(3):
        _step(torch.ones(3), cached())
    assert _fix_line(recorded) == (
        "fix: pass it on meta already: move the tensor passed as w to meta once, before the "
        "loop, and pass the moved one"
    )


def test_several_constants_are_each_named_as_the_caller_holds_them(
    recorded: list[warnings.WarningMessage],
) -> None:
    """One warning for three constants: each step of its fix names the caller's own."""

    @device_agnostic(device="meta")
    def loss(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
        return None

    W = torch.ones(2)
    holder = _Holder(torch.ones(3))
    cached = _cached(4)
    for _ in range(3):
        loss(torch.zeros(2), W, holder.weights, cached())
    assert _fix_line(recorded) == (
        "fix: pass them on meta already, each moved once before the loop: W = W.to('meta'), "
        "holder.weights = holder.weights.to('meta'), the tensor passed as c"
    )


def test_the_fix_for_a_prefetcher_is_in_the_loader(
    recorded: list[warnings.WarningMessage],
) -> None:
    """A prefetcher's batches holding the same tensor: the fix is where the loader gets it
    (the prefetcher's own name for a batch is no name of the caller's), and works."""
    batch = {"x": torch.ones(2)}
    for _ in devicectx.prefetch([batch] * 4, "meta"):
        pass
    assert _fix_line(recorded) == (
        "fix: the loader yields it in every batch: move it to meta once, before the loop, "
        "where the loader gets it, so that each batch holds it there"
    )
    batch["x"] = batch["x"].to("meta")
    with track_transfers() as log:
        for _ in devicectx.prefetch([batch] * 4, "meta"):
            pass
    assert 0 == log.total_tensors


@pytest.mark.requires_device("accelerator")
def test_the_fix_for_a_result_moved_back_is_in_the_function() -> None:
    """A decorated function returning the same device tensor at every call, moved back by
    output='input': the fix keeps a copy where the function holds it (the caller holds
    only past results)."""
    kind = torch.accelerator.current_accelerator()
    assert kind is not None
    kept = torch.ones(3, device=kind.type)

    @device_agnostic(device=kind.type, output="input")
    def predict(x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": kept}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            result = predict(torch.ones(3))
    assert CPU == result["out"].device
    name = "test_the_fix_for_a_result_moved_back_is_in_the_function.<locals>.predict()"
    assert _fix_line(caught) == (
        f"fix: {name} returns it unchanged at every call: keep a copy on cpu where {name} "
        "holds it (made once), and return that"
    )


@dataclasses.dataclass(frozen=True)
class _Frozen:
    w: torch.Tensor


@pytest.mark.parametrize("holder", ["frozen dataclass", "tuple"])
def test_the_fix_names_no_holder_that_cannot_be_assigned_to(
    recorded: list[warnings.WarningMessage], holder: str
) -> None:
    """A tensor in a frozen dataclass or a tuple is named by what it was passed as: the
    assignment a fix would print there (config.w = ...) raises."""
    config = _Frozen(torch.ones(3))
    pair = (torch.zeros(1), torch.ones(3))
    for _ in range(3):
        _step(torch.ones(3), config.w if holder == "frozen dataclass" else pair[1])
    assert _fix_line(recorded) == (
        "fix: pass it on meta already: move the tensor passed as w to meta once, before the "
        "loop, and pass the moved one"
    )


def test_several_constants_read_as_a_global_and_an_argument(
    recorded: list[warnings.WarningMessage],
) -> None:
    """In the fix for several, a global read in a function is moved where the module
    defines it, and the caller's argument where the caller is called from."""

    @device_agnostic(device="meta")
    def loss(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        return None

    def train_step(x: torch.Tensor, table: torch.Tensor) -> None:
        loss(x, _CONSTANT_TABLE, table)

    weights = torch.ones(3)
    for _ in range(3):
        train_step(torch.zeros(2), weights)
    assert _fix_line(recorded) == (
        "fix: pass them on meta already, each moved once before the loop: _CONSTANT_TABLE = "
        "_CONSTANT_TABLE.to('meta') at the top level of its file, table (an argument of "
        "train_step()) where it is called from"
    )


def test_the_repeated_move_warning_describes_a_strided_nested_tensor() -> None:
    """A strided nested tensor's shape is ragged (``.shape`` raises): the warning's line
    for it gives its number of components instead of failing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # strided nested tensors: a prototype
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    assert "nested, 2 components" == repeats_module._shape_text(nested)
    assert "shape (2, 3)" == repeats_module._shape_text(torch.ones(2, 3))
