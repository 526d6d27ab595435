"""Staged moves (``coalesce=True``): the same results as tensor-by-tensor moves, in fewer copies.

Packing and unpacking are the same on every device, so most tests take the staged path
through the seam :func:`devicectx.move._staging.forced`, which stages every move through
ordinary host memory: the whole engine to ``meta`` (structure, aliasing, views, strides,
autograd), and the staging functions to the CPU (values). The pool of pinned buffers is
tested with events that stand for an accelerator's. Tests marked
``requires_device("accelerator")`` take the real path (on the emulated accelerator in CI;
tests/test_staging_accelerator.py has the properties there).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from itertools import pairwise
from typing import Any

import pytest
import torch
from helpers import described, placed, python_output, tensors_of
from hypothesis import example, given
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import devicectx
from devicectx import to_device
from devicectx.move import _pinned, _staging
from devicectx.move._move import move_call, move_to
from devicectx.move._staging import _seam, _sending
from devicectx.move._staging._state import STATE, StagingState, swapped
from devicectx.move._walk import collect
from devicectx.testing import emulated
from devicectx.testing.strategies import nested, tensors

CPU = torch.device("cpu")
META = torch.device("meta")
SMALL = _staging.FORCED_THRESHOLDS
"""The seam's default thresholds: every move staged, through small buffers, so that a
few tensors fill several regions and chunks."""

batches = nested(tensors(devices=["cpu"]))
mixed_batches = nested(tensors(devices=["cpu", "meta"]))
grad_batches = nested(tensors(devices=["cpu"], dtypes=[torch.float32], requires_grad=True))


def relations(results: list[torch.Tensor]) -> list[tuple[bool, bool]]:
    """For each pair of results: the same object? the first a view of the second?"""
    return [(a is b, a._base is b) for a in results for b in results]


def extent(tensor: torch.Tensor) -> tuple[int, int]:
    """The addresses from a CPU tensor's first byte to past its last one."""
    if tensor.numel() == 0:
        return tensor.data_ptr(), tensor.data_ptr()
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return tensor.data_ptr(), tensor.data_ptr() + (last + 1) * tensor.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two CPU tensors share a byte of memory."""
    (a_lo, a_hi), (b_lo, b_hi) = extent(a), extent(b)
    return a_lo < b_hi and b_lo < a_hi


def staged_into(
    obj: Any, device: torch.device, host: _pinned.Host, thresholds: Thresholds = SMALL
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """``(tensors found in obj, {id: staged copy})``: the host-to-device path to ``device``."""
    found, inside, _ = collect(obj)
    return found, _staging.to_accelerator(found, inside, device, False, thresholds, host)


Thresholds = _staging.Thresholds


@pytest.fixture
def fresh_state() -> Iterator[StagingState]:
    """Staging's state as in a new process (nothing probed yet), for the test."""
    with swapped(StagingState()) as state:
        yield state


needs_emulated = pytest.mark.skipif(
    not emulated.enabled(),
    reason="needs the emulated accelerator's controls: pytest --devicectx-accelerator=emulated",
)


# The whole engine, staged and not: the same results.


_ABSENT = torch.tensor([1.5, 2.0])  # a base no batch holds


@given(st.one_of(batches, mixed_batches, grad_batches))
@example([_ABSENT[0:1], _ABSENT[1:1]])  # an empty view where another view ends
def test_staged_move_keeps_what_the_per_tensor_move_keeps(batch: Any) -> None:
    """Staged to meta, every structure comes back as the per-tensor move gives it: types,
    dtypes, shapes, strides, autograd, which places hold one tensor, which are views."""
    expected = to_device(batch, META, coalesce=False)
    with _staging.forced():
        actual = to_device(batch, META)
    assert [described(t) for t in tensors_of(expected)] == [
        described(t) for t in tensors_of(actual)
    ]
    assert relations(tensors_of(expected)) == relations(tensors_of(actual))


@given(batches)
def test_staged_move_leaves_the_input_alone_and_moves_once(batch: Any) -> None:
    """The input is unchanged, and moving the result again returns it as it is."""
    before = [(path, t, t.device) for path, t in placed(batch)]
    with _staging.forced():
        moved = to_device(batch, META)
        assert to_device(moved, META) is moved
    assert before == [(path, t, t.device) for path, t in placed(batch)]


# The staging functions, with values: into CPU memory, and back.


@given(batches)
def test_staged_copies_are_the_sources_in_memory_of_their_own(batch: Any) -> None:
    """Every plain, dense, non-empty tensor that needs no autograd is staged, and comes
    back with its values, dtype, shape and strides, in memory that no source shares and
    that only small tensors share with each other."""
    with _staging.forced() as host:
        found, results = staged_into(batch, CPU, host)
    expected = {key for key, t in found.items() if t._base is None and t.numel() > 0}
    assert expected <= set(results)
    sources = list(found.values())
    for key, result in results.items():
        source = found[key]
        assert described(source) == described(result)
        assert torch.equal(source, result)
        assert not any(overlaps(result, other) for other in sources)
        for other_key, other in results.items():
            if other_key != key and overlaps(result, other):
                assert source.nbytes <= SMALL.share_max_bytes
                assert result.untyped_storage().nbytes() <= SMALL.shared_bytes


@given(batches)
def test_staged_back_to_host_copies_are_the_sources(batch: Any) -> None:
    """Back to the host, small tensors come back with their values, dtype, shape and
    strides, in regions of at most the shared size, none shared with a source."""
    with _staging.forced() as host:
        found, inside, _ = collect(batch)
        results = _staging.to_host(found, inside, _staging._with_data, SMALL, host)
    for key, result in results.items():
        source = found[key]
        assert source.nbytes <= SMALL.share_max_bytes
        assert described(source) == described(result)
        assert torch.equal(source, result)
        assert not any(overlaps(result, other) for other in found.values())
        assert result.untyped_storage().nbytes() <= SMALL.shared_bytes


def test_sources_may_change_as_soon_as_the_move_returns() -> None:
    """The staged copies are made before the move returns: writing into the sources right
    after, even with non_blocking=True, changes nothing in the results."""
    sources = [torch.full((3,), float(i)) for i in range(6)] + [torch.arange(300.0)]
    expected = [t.clone() for t in sources]
    with _staging.forced() as host:
        found, inside, _ = collect(sources)
        results = _staging.to_accelerator(found, inside, CPU, True, SMALL, host)
    for source in sources:
        source.fill_(-1.0)
    assert all(torch.equal(e, results[id(s)]) for e, s in zip(expected, sources, strict=True))


def test_channels_last_stays_channels_last() -> None:
    """A channels_last image, small, alone in one chunk or streamed through several,
    keeps its strides and values."""
    images = [
        torch.randn(1, 3, 2, 2).to(memory_format=torch.channels_last),  # 48 bytes: shared
        torch.randn(1, 3, 4, 4).to(memory_format=torch.channels_last),  # 192: alone
        torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last),  # 1,536: 2 chunks
    ]
    with _staging.forced() as host:
        _, results = staged_into(images, CPU, host)
        moved = to_device(images, META)
    for source in images:
        result = results[id(source)]
        assert source.stride() == result.stride()
        assert result.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(source, result)
    assert [t.stride() for t in images] == [t.stride() for t in moved]


def test_a_tensor_larger_than_a_chunk_streams_through_several() -> None:
    """A tensor of several chunks' bytes arrives whole, in memory of its own, while the
    pool holds no more than its bound."""
    source = torch.randn(3_000, dtype=torch.float64)  # 24,000 bytes: 24 chunks of 1,024
    with _staging.forced() as host:
        _, results = staged_into([source], CPU, host)
        held = host.pool.held_bytes
    result = results[id(source)]
    assert torch.equal(source, result)
    assert result._base is None
    assert source.nbytes == result.untyped_storage().nbytes()
    assert SMALL.pool_bytes >= held


def test_small_tensors_share_regions_of_bounded_size() -> None:
    """Small tensors come back each with a storage of its own (its own bytes, not
    resizable), over regions of memory shared by several, each at most the shared size."""
    sources = [torch.full((4,), float(i)) for i in range(40)]  # 16 bytes each, 640 in all
    with _staging.forced() as host:
        _, results = staged_into(sources, CPU, host)
    storages = [results[id(t)].untyped_storage() for t in sources]
    assert [16] * 40 == [storage.nbytes() for storage in storages]
    assert not any(storage.resizable() for storage in storages)
    addresses = sorted(storage.data_ptr() for storage in storages)
    # Side by side within a region; two allocations never touch (the allocator's headers).
    regions = 1 + sum(b - a != 16 for a, b in pairwise(addresses))
    assert 3 == regions  # 256, 256 and 128 bytes
    assert all(torch.equal(t, results[id(t)]) for t in sources)
    # As .to makes them: nobody's view, at version 0, with their shape and strides.
    for source in sources:
        result = results[id(source)]
        assert (None, 0, (4,), (1,)) == (
            result._base,
            result._version,
            result.shape,
            result.stride(),
        )


def test_runs_of_mixed_dtypes_and_shapes_are_aligned() -> None:
    """Tensors of every dtype and several shapes, packed side by side, each start at an
    address their dtype can be read from, and keep their values."""
    sources = [
        torch.tensor([True, False, True]),
        torch.tensor([1, 2, 3], dtype=torch.int8),
        torch.tensor([1.5, 2.5], dtype=torch.float16),
        torch.tensor([1.5], dtype=torch.bfloat16),
        torch.tensor([7], dtype=torch.int16),
        torch.tensor(3.0, dtype=torch.float64),
        torch.tensor([1 + 2j], dtype=torch.complex128),
        torch.tensor([1 + 2j, 3j], dtype=torch.complex64),
        torch.arange(6, dtype=torch.int32).reshape(2, 3).t(),
    ]
    with _staging.forced() as host:
        _, results = staged_into(sources, CPU, host)
    for source in sources:
        result = results[id(source)]
        assert described(source) == described(result)
        assert torch.equal(source, result)
        assert 0 == result.data_ptr() % result.element_size()


# Which tensors take the staged path, and which move one by one.


def staged_ids(obj: Any, **kwargs: Any) -> set[int]:
    """The ids of the tensors of ``obj`` a staged move to meta copies."""
    with _staging.forced(**kwargs):
        staged = _staging.stage(obj, META, False, ())
    return set() if staged is None else set(staged.results)


def test_what_the_staged_path_leaves_to_the_per_tensor_move() -> None:
    """Tensors that need autograd, parameters and subclasses, empty, expanded, strided and
    conjugate views, sparse tensors and other dtypes (float8) move one by one."""
    plain = torch.zeros(2)
    others = [
        torch.zeros(2, requires_grad=True),
        nn.Parameter(torch.zeros(2)),
        torch.zeros(0),
        torch.zeros(2, 1).expand(2, 3),
        torch.zeros(6)[::2],
        torch.zeros(2, dtype=torch.complex64).conj(),
        torch.zeros(2).to_sparse(),
        torch.zeros(2).to(torch.float8_e4m3fn),
    ]
    assert {id(plain)} == staged_ids([plain, *others])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_few_tensors_are_weighed_without_reading_what_has_no_bytes() -> None:
    """A move of fewer tensors than staging takes is staged for its bytes alone: sparse and
    nested tensors, which have no ``nbytes`` (torch raises), count for nothing, and move
    one by one (every default move of a graph's sparse adjacency raised there)."""
    few = dataclasses.replace(_staging.FORCED_THRESHOLDS, min_tensors=8, stage_min_bytes=8)
    sparse = torch.eye(3).to_sparse()
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    dense = torch.zeros(32)  # larger than a shared region: staged for its bytes
    assert {id(dense)} == staged_ids([sparse, nested, dense], thresholds=few)
    assert set() == staged_ids([sparse, nested], thresholds=few)
    with _staging.forced(few):
        moved = to_device({"adj": sparse, "x": dense}, META)
    assert moved["adj"].layout is torch.sparse_coo
    assert (moved["adj"].device, moved["x"].device) == (META, META)


def test_parameters_and_autograd_are_kept_through_a_staged_move() -> None:
    """In a staged move, a parameter comes back a parameter and a tensor that requires
    grad keeps its history back to the source."""
    weight = nn.Parameter(torch.randn(3))
    x = torch.randn(3, requires_grad=True)
    batch: dict[str, Any] = {"w": weight, "x": x, "rest": [torch.zeros(2)] * 3}
    with _staging.forced():
        moved = to_device(batch, META)
    assert isinstance(moved["w"], nn.Parameter)
    assert moved["w"].is_leaf
    assert moved["x"].grad_fn is not None


def test_a_base_and_its_views_stay_linked() -> None:
    """A base with views in the structure gets memory of its own; its views are views of
    its copy, whichever comes first."""
    base = torch.arange(8.0)
    batch = [base[2:], base, base[:3], torch.zeros(1), torch.zeros(1)]
    with _staging.forced():
        moved = to_device(batch, META)
    assert moved[1]._base is None
    assert moved[0]._base is moved[1]
    assert moved[2]._base is moved[1]
    assert id(base) in staged_ids(batch)


def test_views_of_an_absent_base_are_staged_where_they_do_not_overlap() -> None:
    """Views of a base that is not in the structure are staged when they share no byte,
    and move one by one when they do."""
    base = torch.arange(8.0)
    apart = [base[:4], base[4:]]
    overlapping = [base[:5], base[3:]]
    assert {id(t) for t in apart} == staged_ids(apart)
    assert set() == staged_ids(overlapping)


def test_tensors_inside_objects_with_their_own_to_are_not_staged() -> None:
    """An object moved by its own ``.to`` moves its tensors itself; a view elsewhere of a
    tensor inside it is left to the per-tensor move too."""

    class Encoding(collections.UserDict[str, Any]):
        def to(self, device: torch.device) -> Encoding:
            return Encoding({k: v.to(device) for k, v in self.data.items()})

    ids = torch.arange(6)
    encoding = Encoding({"ids": ids})
    staged = staged_ids({"enc": encoding, "head": ids[:2], "other": torch.ones(1)})
    assert staged.isdisjoint({id(ids)})
    assert 1 == len(staged)


def test_skipped_types_are_not_staged() -> None:
    """Tensors inside an object of a skipped type are not copied."""

    @dataclasses.dataclass
    class Kept:
        tensor: torch.Tensor

    kept = Kept(torch.zeros(2))
    with _staging.forced():
        staged = _staging.stage([kept, torch.ones(2)], META, False, (Kept,))
    assert staged is not None
    assert id(kept.tensor) not in staged.results
    assert 1 == len(staged.results)


def test_no_staging_with_coalesce_false_or_a_skip_by_key() -> None:
    """``coalesce=False``, and a skip by key, path or predicate, move tensor by tensor."""
    batch = {"a": torch.zeros(2), "labels": torch.ones(2)}
    with _staging.forced() as host:
        to_device(batch, META, coalesce=False)
        to_device(batch, META, skip=["labels"])
        move_to(batch, META, coalesce=False)
        move_call((batch,), {}, META, coalesce=False)
        assert 0 == host.pool.held_bytes
        to_device(batch, META)
        assert 0 < host.pool.held_bytes


# The same inputs moved again, on purpose.
@pytest.mark.filterwarnings("ignore::devicectx.RepeatedMoveWarning")
def test_the_decorator_stages_its_inputs_unless_told_not_to() -> None:
    """``@device_agnostic`` stages a call's many input tensors, and with ``coalesce=False``
    moves them one by one, to the same results."""

    def body(batch: dict[str, list[torch.Tensor]]) -> list[torch.Tensor]:
        return batch["x"]

    staged = devicectx.device_agnostic(device="meta")(body)
    alone = devicectx.device_agnostic(device="meta", coalesce=False)(body)
    batch = {"x": [torch.full((2,), float(i)) for i in range(8)]}
    with _staging.forced() as host:
        expected = alone(batch)
        assert 0 == host.pool.held_bytes
        actual = staged(batch)
        assert 0 < host.pool.held_bytes
    assert [described(t) for t in expected] == [described(t) for t in actual]


def test_the_decorator_stages_its_result_placement_unless_told_not_to() -> None:
    """``output=`` moves a result of many tensors staged, and with ``coalesce=False`` one
    tensor at a time."""

    def body(x: torch.Tensor) -> list[torch.Tensor]:
        return [x + i for i in range(8)]

    staged = devicectx.device_agnostic(device="cpu", output="meta")(body)
    alone = devicectx.device_agnostic(device="cpu", output="meta", coalesce=False)(body)
    with _staging.forced() as host:
        expected = alone(torch.zeros(2))
        assert 0 == host.pool.held_bytes
        actual = staged(torch.zeros(2))
        assert 0 < host.pool.held_bytes
    assert [described(t) for t in expected] == [described(t) for t in actual]
    assert all(META == t.device for t in actual)


def test_the_accelerator_is_asked_of_the_resolver(monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging learns which accelerator there is from the resolver, never from
    ``torch.accelerator`` itself, whose API differs across releases (2.6's
    ``current_accelerator`` raises where there is none)."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch.accelerator asked directly")

    monkeypatch.setattr(torch.accelerator, "is_available", refuse)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", refuse)
    monkeypatch.setattr(_pinned, "accelerator_type", lambda: None)
    monkeypatch.setattr(_staging, "accelerator_type", lambda: None)
    with swapped(StagingState()) as state:
        assert _pinned.host_for("cuda", 1024, 4096) is None
        assert _staging.stage([torch.zeros(1)] * 4, CPU, False, ()) is None
        assert {META, CPU} == state.never


@pytest.mark.parametrize(
    ("count", "nbytes", "staged"),
    [(3, 16, False), (4, 16, True), (1, 2**20 - 4, False), (1, 2**20, True)],
)
def test_when_a_move_is_staged(count: int, nbytes: int, staged: bool) -> None:
    """With the default thresholds: from 4 small tensors, or from 1 MiB of larger ones
    in pageable memory."""
    batch = [torch.zeros(nbytes // 4) for _ in range(count)]
    assert staged == bool(staged_ids(batch, thresholds=_staging.THRESHOLDS))


class CopiesFromHost(TorchDispatchMode):
    """The host tensors copied to another device, in the order their copies are made."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: list[torch.Tensor] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        source = args[0] if func is torch.ops.aten._to_copy.default else None
        if source is not None and source.is_cpu and kwargs.get("device", CPU) != CPU:
            self.sources.append(source)
        return func(*args, **kwargs)


def test_larger_pinned_tensors_are_sent_directly_and_first() -> None:
    """A larger tensor that is pinned already goes in on its own copy, made before the
    small ones are packed (the link carries it meanwhile); small pinned ones are still
    packed, into one region."""
    small = [torch.full((4,), float(i)) for i in range(4)]
    large = torch.zeros(1_000)
    with CopiesFromHost() as copies:
        ids = staged_ids([*small, large], pinned=lambda tensor: True)

    assert {id(large), *map(id, small)} == ids
    assert 2 == len(copies.sources)
    assert copies.sources[0] is large
    assert 4 * small[0].nbytes <= copies.sources[1].nbytes  # the region


def test_pinned_sources_are_packed_only_while_the_stream_is_idle() -> None:
    """A pinned source may be the target of a copy from the device still queued on the
    stream (``.to("cpu", non_blocking=True)`` returns pinned memory at once): while the
    stream has work queued, pinned sources are left to ``.to``, which is ordered after
    it; pageable ones are packed as before. With the stream idle, all are packed."""
    pinned = [torch.full((2,), float(i)) for i in range(4)]
    pageable = [torch.full((2,), float(i)) for i in range(4, 8)]
    ids = {id(t) for t in pinned}

    def staged_with(idle: bool) -> set[int]:
        pool = _pinned.Pool(_seam._host_buffer, _seam._landed, 1024, 4096)
        host = _pinned.Host(pool, _seam._no_stream, lambda t: id(t) in ids, lambda device: idle)
        found, inside, _ = collect([*pinned, *pageable])
        return set(_staging.to_accelerator(found, inside, CPU, False, SMALL, host))

    assert {id(t) for t in pageable} == staged_with(idle=False)
    assert {id(t) for t in [*pinned, *pageable]} == staged_with(idle=True)


def test_a_declined_move_pays_no_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch staging would not pay for (3 small tensors, the larger ones pinned) is
    declined before the sort, asking ``is_pinned`` once per larger tensor and never of
    the small ones."""
    small = [torch.zeros(2) for _ in range(3)]
    large = [torch.zeros(100) for _ in range(3)]
    asked: list[int] = []

    def pinned(tensor: torch.Tensor) -> bool:
        asked.append(id(tensor))
        return True

    def refuse(*args: Any) -> Any:
        raise AssertionError("sorted")

    monkeypatch.setattr(_sending, "_sort", refuse)
    pool = _pinned.Pool(_seam._host_buffer, _seam._landed, 1024, 4096)
    host = _pinned.Host(pool, _seam._no_stream, pinned)
    found, inside, _ = collect({"small": small, "large": large})
    thresholds = dataclasses.replace(SMALL, min_tensors=4, stage_min_bytes=1_000)
    assert {} == _staging.to_accelerator(found, inside, CPU, False, thresholds, host)
    assert sorted(map(id, large)) == sorted(asked)


def test_the_event_of_a_move_is_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A move waits on the event recorded after its own copies, read before its chunk goes
    back to the pool: another thread may take the chunk and record it again at once."""
    log: list[str] = []
    pool = pool_of(log)
    host = _pinned.Host(pool, _seam._no_stream, _seam._never_pinned)
    release = pool.release

    def release_then_reused(chunk: _pinned.Chunk, device: Any, stream: Any) -> Any:
        event = release(chunk, device, stream)
        chunk.event = Pending(["another thread's"])  # taken and recorded again
        return event

    monkeypatch.setattr(pool, "release", release_then_reused)
    sender = _sending._Sender(host, META, None)
    sender.space(8, whole=True)
    event = sender.done()
    assert isinstance(event, Pending)
    assert ["record"] == event.log


def test_staged_small_tensors_are_no_views() -> None:
    """Small tensors of one shape, staged, are independent tensors as ``.to`` makes them:
    no ``_base``, in-place ops with grad operands work under grad mode, and ``resize_``
    cannot reach a neighbour's bytes."""
    sources = [torch.full((4,), float(i)) for i in range(6)]
    with _staging.forced() as host:
        _, results = staged_into(sources, CPU, host)
    moved = [results[id(t)] for t in sources]
    assert [None] * 6 == [t._base for t in moved]
    weight = nn.Parameter(torch.full((4,), 2.0))
    with torch.enable_grad():
        moved[1].mul_(weight)  # 1.0 * weight
        moved[2].copy_(weight)
        moved[0][0] = weight.sum()
    moved[1].sum().backward()
    assert [1.0] * 4 == weight.grad.tolist()  # type: ignore[union-attr]
    assert [8.0, 0.0, 0.0, 0.0] == moved[0].tolist()
    with pytest.raises(RuntimeError, match="not resizable"):
        moved[3].resize_(8)
    assert torch.equal(sources[4], moved[4])


def test_a_failure_falls_back_to_the_per_tensor_move(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside the seam, a staged move that fails leaves nothing staged: every tensor
    then moves by itself."""
    host = _pinned.Host(_pinned.Pool(_seam._host_buffer, _seam._landed, 1024, 4096),
                        _seam._no_stream, _seam._never_pinned)  # fmt: skip
    monkeypatch.setattr(_pinned, "host_for", lambda *args: host)
    monkeypatch.setattr(_staging, "_capturing", lambda kind: False)

    def fail(*args: Any) -> Any:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(_staging, "to_accelerator", fail)
    batch = [torch.zeros(2) for _ in range(8)]
    assert _staging.stage(batch, META, False, ()) is None


def test_devices_that_cannot_stage_are_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A target whose type is not torch's accelerator (pinned memory is pinned for that one
    alone) is tested once, then never again; meta and MPS are never staged to."""
    assert META in STATE.never
    monkeypatch.setattr(_pinned, "accelerator_type", lambda: "xpu")
    batch = [torch.zeros(1)] * 4
    cuda, mps = torch.device("cuda", 0), torch.device("mps", 0)
    with swapped(StagingState()) as state:
        assert _staging.stage(batch, cuda, False, ()) is None
        assert _staging.stage(batch, mps, False, ()) is None
        assert {META, cuda, mps} == state.never


def failing_allocator(failing: int, calls: list[int]) -> Callable[[int], torch.Tensor]:
    """An allocator of host buffers whose ``failing``-th call raises as pinned memory
    running out does; each call's size is appended to ``calls``."""

    def allocate(nbytes: int) -> torch.Tensor:
        calls.append(nbytes)
        if len(calls) == failing:
            raise RuntimeError("out of pinned memory")
        return torch.empty(nbytes, dtype=torch.uint8)

    return allocate


def test_a_failed_probe_is_tried_again_after_a_back_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the probe of pinned memory fails (pinned memory exhausted, a graph being
    captured), the device is not given up: the probe is skipped for the next 64 moves,
    then tried again, and a host is made once it succeeds."""
    probes: list[int] = []
    probe = failing_allocator(1, probes)
    monkeypatch.setattr(_pinned, "accelerator_type", lambda: "cuda")
    monkeypatch.setattr(_pinned, "_pinned_buffer", probe)
    monkeypatch.setattr(_pinned, "current", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(_pinned, "_new_event", _seam._landed)  # events work
    monkeypatch.setattr(_pinned, "_current_stream", _seam._no_stream)
    cuda = torch.device("cuda", 0)
    with swapped(StagingState()) as state:
        for _ in range(1 + _pinned.Backoff.FIRST):
            assert _pinned.host_for("cuda", 1024, 4096, cuda) is None
        assert 1 == len(probes)
        assert cuda not in state.never
        assert _pinned.host_for("cuda", 1024, 4096, cuda) is not None
        assert 2 == len(probes)


def test_a_failed_chunk_allocation_backs_off_then_tries_again() -> None:
    """A pool that cannot allocate its first chunk raises (the move goes tensor by tensor),
    then the next 64 staged moves decline at once, before any packing; the 65th tries
    again. A pool that holds chunks already waits for one of them instead of failing."""
    allocations: list[int] = []
    allocate = failing_allocator(1, allocations)
    pool = _pinned.Pool(allocate, _seam._landed, 1024, 4096)
    host = _pinned.Host(pool, _seam._no_stream, _seam._never_pinned)
    batch = [torch.full((2,), float(i)) for i in range(4)]
    found, inside, _ = collect(batch)
    with pytest.raises(RuntimeError, match="out of pinned memory"):
        _staging.to_accelerator(found, inside, CPU, False, SMALL, host)
    declined = 0
    while not pool.backoff.ready():
        declined += 1
    assert _pinned.Backoff.FIRST == declined
    assert 1 == len(allocations)
    results = _staging.to_accelerator(found, inside, CPU, False, SMALL, host)
    assert all(torch.equal(t, results[id(t)]) for t in batch)
    assert 2 == len(allocations)
    pool.backoff.failed()  # as if the next allocation failed: the chunk held is reused
    results = _staging.to_accelerator(found, inside, CPU, False, SMALL, host)
    assert all(torch.equal(t, results[id(t)]) for t in batch)
    assert 2 == len(allocations)


def test_a_move_declines_at_once_while_its_pool_backs_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """stage() asks the pool's back-off before collecting anything: a pool with no chunk
    after a failed allocation costs a move nothing."""
    pool = _pinned.Pool(_seam._host_buffer, _seam._landed, 1024, 4096)
    pool.backoff.failed()
    host = _pinned.Host(pool, _seam._no_stream, _seam._never_pinned)

    def refuse(*args: Any) -> Any:
        raise AssertionError("collected while backing off")

    monkeypatch.setattr(_pinned, "host_for", lambda *args: host)
    monkeypatch.setattr(_staging, "collect", refuse)
    assert _staging.stage([torch.zeros(2)] * 8, torch.device("cuda", 0), False, ()) is None
    assert _pinned.Backoff.FIRST - 1 == pool.backoff.skip


@pytest.mark.skipif(torch.accelerator.is_available(), reason="this machine has an accelerator")
def test_without_an_accelerator_nothing_is_pinned() -> None:
    """With no accelerator, there is no pinned memory for any type: no host."""
    assert _pinned.host_for("cuda", 1024, 4096) is None


def test_nothing_is_staged_while_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile's tracing, moves go tensor by tensor."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert set() == staged_ids([torch.zeros(2)] * 4)


def test_inference_mode_in_and_out() -> None:
    """A move in inference mode gives inference tensors, as .to does, and leaves the
    staging buffers usable by moves outside it."""
    with _staging.forced() as host:
        with torch.inference_mode():
            inside = to_device([torch.zeros(2)] * 4, META)
        _, results = staged_into([torch.ones(2) for _ in range(4)], CPU, host)
    assert all(t.is_inference() for t in inside)
    assert all(torch.equal(torch.ones(2), t) and not t.is_inference() for t in results.values())


def test_thresholds_are_checked() -> None:
    """Thresholds that cannot work together are refused, saying what they need."""
    with pytest.raises(ValueError, match="share_max_bytes <= shared_bytes <= chunk_bytes"):
        Thresholds(share_max_bytes=2048, shared_bytes=1024)
    with pytest.raises(ValueError, match="multiple of 16"):
        Thresholds(chunk_bytes=4 * 2**20 + 1)


# The pool of staging buffers.


class Pending:
    """An event whose copies finish only when waited for (or when ``done`` is set)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.done = False

    def record(self, stream: object = None) -> None:
        self.done = False
        self.log.append("record")

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append("synchronize")
        self.done = True


def pool_of(log: list[str], chunks: int = 2) -> _pinned.Pool:
    """A pool of 64-byte host buffers, at most ``chunks`` of them, with pending events."""
    return _pinned.Pool(_seam._host_buffer, lambda device: Pending(log), 64, 64 * chunks)


def test_a_chunk_is_reused_only_once_its_copies_are_done() -> None:
    """A chunk given back with copies in flight is not handed out again while the pool
    may grow; once they are done, it is."""
    log: list[str] = []
    pool = pool_of(log)
    first = pool.acquire()
    pool.release(first, META, None)
    second = pool.acquire()
    assert second is not first
    pool.release(second, META, None)
    first.event.done = True
    assert pool.acquire() is first
    assert ["record", "record"] == log


def test_a_full_pool_waits_for_the_oldest_chunk_alone() -> None:
    """At its bound, the pool waits on the event of the chunk given back first, and
    hands that one out."""
    log: list[str] = []
    pool = pool_of(log)
    first, second = pool.acquire(), pool.acquire()
    pool.release(first, META, None)
    pool.release(second, META, None)
    assert pool.acquire() is first
    assert ["record", "record", "synchronize"] == log
    assert 128 == pool.held_bytes


class Interrupted(Pending):
    """An event whose first wait is interrupted (Ctrl-C while a move waits for a chunk),
    after ``meanwhile`` ran (another thread's ``release_staging``, say)."""

    def __init__(self, log: list[str], meanwhile: Callable[[], object]) -> None:
        super().__init__(log)
        self.meanwhile = meanwhile

    def synchronize(self) -> None:
        if "interrupted" not in self.log:
            self.log.append("interrupted")
            self.meanwhile()
            raise KeyboardInterrupt
        super().synchronize()


@pytest.mark.parametrize("cleared", [False, True])
def test_a_wait_for_the_oldest_chunk_interrupted_gives_the_chunk_back(cleared: bool) -> None:
    """Interrupted while it waits for the oldest chunk's copies, a full pool keeps that
    chunk (first in line, its copies still to be waited for), or lets it go where the pool
    was cleared meanwhile (``release_staging``): the next move gets a chunk, where a lost
    one stayed counted as held and moves waited for ever once the pool was full."""
    log: list[str] = []
    pool: _pinned.Pool

    def meanwhile() -> object:
        return pool.clear() if cleared else None

    pool = _pinned.Pool(_seam._host_buffer, lambda device: Interrupted(log, meanwhile), 64, 128)
    first, second = pool.acquire(), pool.acquire()
    pool.release(first, META, None)
    pool.release(second, META, None)
    with pytest.raises(KeyboardInterrupt):
        pool.acquire()
    if cleared:
        assert (0, []) == (pool.held_bytes, pool.free)
        assert pool.acquire() not in (first, second)
    else:
        assert (128, [first, second]) == (pool.held_bytes, pool.free)
        assert pool.acquire() is first
        assert ["record", "record", "interrupted", "synchronize"] == log


def test_a_pool_backing_off_reuses_its_chunks_instead_of_allocating() -> None:
    """After a failed allocation, a pool that holds a chunk whose copies are in flight
    waits for that chunk where it would otherwise grow, allocating nothing, until the
    back-off is over; then it grows again."""
    log: list[str] = []
    allocations: list[int] = []
    allocate = failing_allocator(2, allocations)
    pool = _pinned.Pool(allocate, lambda device: Pending(log), 64, 64 * 4)
    first = pool.acquire()
    pool.release(first, META, None)
    assert pool.acquire() is first  # the second allocation failed: waited for first
    assert (2, ["record", "synchronize"]) == (len(allocations), log)
    pool.release(first, META, None)
    assert pool.acquire() is first  # backing off: no allocation tried
    assert (2, ["record", "synchronize"] * 2) == (len(allocations), log)
    while not pool.backoff.ready():  # each False counts as a try skipped: 64 of them
        pass
    pool.release(first, META, None)
    assert pool.acquire() is not first
    assert 3 == len(allocations)


def test_a_pool_with_no_chunk_backing_off_raises_without_allocating() -> None:
    """A pool whose first allocation failed holds no chunk to wait for: while it backs
    off, acquire() raises at once, saying why, and allocates nothing."""
    allocations: list[int] = []
    allocate = failing_allocator(1, allocations)
    pool = _pinned.Pool(allocate, _seam._landed, 64, 64 * 4)
    with pytest.raises(RuntimeError, match="out of pinned memory"):
        pool.acquire()
    with pytest.raises(RuntimeError, match="an allocation failed recently"):
        pool.acquire()
    assert 1 == len(allocations)


def test_threads_never_share_a_chunk() -> None:
    """A thread asking a full pool whose chunks are all held waits until one is given
    back, then gets it: no two holders at once."""
    pool = pool_of([], chunks=1)
    held = pool.acquire()
    waiting = threading.Event()
    got: list[_pinned.Chunk] = []
    wait = pool.changed.wait

    def signalled_wait(timeout: float | None = None) -> bool:
        waiting.set()
        return wait(timeout)

    pool.changed.wait = signalled_wait  # type: ignore[method-assign]
    thread = threading.Thread(target=lambda: got.append(pool.acquire()))
    thread.start()
    assert waiting.wait(timeout=30)
    assert [] == got
    pool.release(held, None, None)
    thread.join(timeout=30)
    assert [held] == got


def test_threads_moving_at_once_each_get_their_own_values() -> None:
    """Threads staging at the same time through one small pool each get back exactly
    their own tensors."""
    errors: list[str] = []

    def work(host: _pinned.Host, seed: int) -> None:
        for step in range(20):
            value = float(seed * 100 + step)
            batch = [torch.full((n,), value) for n in (3, 5, 3, 200)]
            _, results = staged_into(batch, CPU, host)
            if not all(torch.equal(t, results[id(t)]) for t in batch):
                errors.append(f"thread {seed}, step {step}")

    with _staging.forced() as host:
        threads = [threading.Thread(target=work, args=(host, seed)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert [] == errors
    assert SMALL.pool_bytes >= host.pool.held_bytes


def test_events_follow_the_device_of_the_copies() -> None:
    """A chunk used for another device gets an event of that device."""
    made: list[torch.device] = []

    def new_event(device: torch.device) -> Pending:
        made.append(device)
        return Pending([])

    pool = _pinned.Pool(_seam._host_buffer, new_event, 64, 64)
    other = torch.device("cuda", 1)
    for device in (META, META, other):
        chunk = pool.acquire()
        pool.release(chunk, device, None)
        chunk.event.done = True
    assert [META, other] == made


def test_staging_memory_is_reported_and_released() -> None:
    """staging_memory() counts the buffers kept; release_staging() lets go of them, and
    of one in use as soon as it is given back."""
    devicectx.release_staging()  # an earlier test may have staged to an accelerator
    assert 0 == devicectx.staging_memory()
    with _staging.forced() as host:
        to_device([torch.zeros(2)] * 3, META)
        assert SMALL.chunk_bytes == devicectx.staging_memory()
        kept, in_use = host.pool.acquire(), host.pool.acquire()
        assert 2 * SMALL.chunk_bytes == devicectx.staging_memory()
        host.pool.release(kept, None, None)
        assert SMALL.chunk_bytes == devicectx.release_staging()
        assert SMALL.chunk_bytes == devicectx.staging_memory()
        host.pool.release(in_use, None, None)
        assert 0 == devicectx.staging_memory()
        assert [] == host.pool.free
    assert 0 == devicectx.staging_memory()


def test_non_blocking_false_waits_for_the_copies() -> None:
    """A blocking staged move waits on the event after its copies; a non-blocking one
    does not."""
    log: list[str] = []
    pool = _pinned.Pool(_seam._host_buffer, lambda device: Pending(log), 1024, 4096)
    host = _pinned.Host(pool, _seam._no_stream, _seam._never_pinned)
    batch = [torch.zeros(2) for _ in range(4)]
    found, inside, _ = collect(batch)
    _staging.to_accelerator(found, inside, CPU, True, SMALL, host)
    assert ["record"] == log
    pool.free[0].event.done = True
    _staging.to_accelerator(found, inside, CPU, False, SMALL, host)
    assert ["record", "record", "synchronize"] == log


# The real path.


@pytest.mark.requires_device("accelerator")
def test_staged_move_to_the_accelerator_and_back() -> None:
    """To the accelerator and back, staged: values, dtypes, strides and memory formats
    kept, pageable sources free to change at once, the pinned memory reported."""
    device = torch.accelerator.current_accelerator()
    pageable = {
        "small": [torch.randint(0, 9, (int(n),)) for n in torch.randint(1, 50, (64,))],
        "image": torch.randn(8, 3, 64, 64).to(memory_format=torch.channels_last),
        "big": torch.randn(3_000_000),
        "flags": torch.rand(100) > 0.5,
    }
    pinned = {"big": torch.randn(1_000_000).pin_memory(), "ids": torch.arange(5).pin_memory()}
    batch = {"pageable": pageable, "pinned": pinned}
    expected = [t.clone() for t in tensors_of(batch)]
    moved = to_device(batch, device, non_blocking=True)
    for source in tensors_of(pageable):  # staged: copied when the move returns
        source.zero_()
    # Not the pinned ones: those may have moved with .to(non_blocking=True), whose source
    # must not change until the copy lands.
    torch.accelerator.synchronize()
    actual = tensors_of(moved)
    assert [described(t.to(device)) for t in expected] == [described(t) for t in actual]
    assert all(torch.equal(e.to(device), a) for e, a in zip(expected, actual, strict=True))
    assert devicectx.staging_memory() > 0
    back = to_device(moved, "cpu")
    assert all(torch.equal(e, b) for e, b in zip(expected, tensors_of(back), strict=True))
    assert [described(t) for t in expected] == [described(t) for t in tensors_of(back)]
    devicectx.release_staging()
    assert 0 == devicectx.staging_memory()


@pytest.mark.requires_device("accelerator")
@needs_emulated
def test_a_pinned_source_with_a_copy_in_flight_is_read_after_the_copy() -> None:
    """A pinned tensor whose copy from the device is still queued (as ``y = x.to("cpu",
    non_blocking=True)`` hands one back) is not packed with the small tensors moved with
    it: it moves with ``.to``, ordered after that copy, and comes back with ``x``'s values.
    The copy is held back (``emulated.paused``) while the move runs, which waits for
    nothing (a wait would raise there); the other small tensors are still staged."""
    device = torch.device(emulated.DEVICE_TYPE, 0)
    x = torch.arange(8.0, device=device)
    y = torch.full((8,), -1.0).pin_memory()
    small = [torch.full((1,), float(i)) for i in range(4)]
    with emulated.paused(device):
        y.copy_(x, non_blocking=True)  # as .to("cpu", non_blocking=True), into known bytes
        moved = to_device([y, *small], device, non_blocking=True)
        assert [-1.0] * 8 == y.tolist()  # the move ran before the copy landed
    torch.accelerator.synchronize()
    assert [float(i) for i in range(8)] == moved[0].tolist()
    assert [[float(i)] for i in range(4)] == [t.tolist() for t in moved[1:]]
    # Staged: packed side by side in one region, where .to would allocate each alone.
    assert [4, 4, 4] == [b.data_ptr() - a.data_ptr() for a, b in pairwise(moved[1:])]


@pytest.mark.requires_device("accelerator")
@needs_emulated
def test_a_device_with_pinned_memory_but_no_events_is_not_staged_to(
    monkeypatch: pytest.MonkeyPatch, fresh_state: StagingState
) -> None:
    """Pinned memory alone does not make a device one to stage to: without events a
    chunk could never be known free again, so the probe records one as well. A device
    with pinned memory but no events (the emulated one with events off, probed afresh)
    gets its moves tensor by tensor with nothing packed; with events back, staging
    resumes once the probe's back-off is over."""
    device = torch.device(emulated.DEVICE_TYPE, 0)
    packed: list[int] = []
    to_accelerator = _staging.to_accelerator

    def counted(found: dict[int, torch.Tensor], *args: Any) -> dict[int, torch.Tensor]:
        packed.append(len(found))
        return to_accelerator(found, *args)

    monkeypatch.setattr(_staging, "to_accelerator", counted)

    def batch() -> list[torch.Tensor]:
        return [torch.full((3,), float(i)) for i in range(8)]

    expected = [[float(i)] * 3 for i in range(8)]
    with emulated.configure(events=False):
        assert torch.ones(1).pin_memory().is_pinned()
        assert expected == [t.tolist() for t in to_device(batch(), device)]
    assert [] == packed
    for _ in range(_pinned.Backoff.FIRST):
        to_device(batch(), device)
    assert [] == packed
    assert expected == [t.tolist() for t in to_device(batch(), device)]
    assert [8] == packed


def test_a_first_staged_move_to_another_device_creates_no_context_on_the_current() -> None:
    """A first staged move to device 1 allocates its pinned memory with device 1 current,
    as torch creates a context for the current device: device 0, current but never used,
    gets none (on a GPU, 0.5 GB in every torchrun rank). In a fresh process, on the
    emulated accelerator, which creates contexts as CUDA does."""
    out = python_output(
        "import torch\n"
        "from devicectx.testing import emulated\n"
        "try:\n"
        "    emulated.enable()\n"
        "except emulated.EmulatedUnavailable as error:\n"
        "    raise SystemExit(print('unavailable:', str(error).splitlines()[0]))\n"
        "from devicectx import to_device, staging_memory\n"
        "moved = to_device([torch.full((1,), float(i)) for i in range(4)], 'emu:1')\n"
        "print(staging_memory() > 0, [d.index for d in emulated.initialized_devices()])\n"
    )
    if out.startswith("unavailable:"):
        pytest.skip(f"the emulated accelerator: {out}")
    assert "True [1]" == out


@pytest.mark.parametrize("missing", ["pinned", "events"])
def test_a_device_without_pinned_memory_or_events_moves_tensor_by_tensor(missing: str) -> None:
    """On an accelerator without pinned memory, or without events (the emulated one with
    either turned off, in a fresh process), moves are correct, tensor by tensor, and
    silent: no warning, no pinned memory held; turned on again, staging comes back after
    its back-off."""
    if missing == "pinned" and torch.cuda.is_available():
        pytest.skip(
            "where CUDA is present, torch pins host memory with CUDA's allocator whichever "
            "the accelerator is: the emulated device cannot play one without pinned memory"
        )
    out = python_output(
        "import warnings, torch\n"
        "from devicectx.testing import emulated\n"
        "try:\n"
        "    emulated.enable()\n"
        "except emulated.EmulatedUnavailable as error:\n"
        "    raise SystemExit(print('unavailable:', str(error).splitlines()[0]))\n"
        "from devicectx import to_device, staging_memory\n"
        "batch = [torch.full((3,), float(i)) for i in range(8)]\n"
        "warnings.simplefilter('error')\n"
        f"with emulated.configure({missing}=False):\n"
        "    moved = to_device(batch, 'emu:0', non_blocking=True)\n"
        "    torch.accelerator.synchronize()\n"
        "    print([t.tolist()[0] for t in moved], staging_memory())\n"
        "for _ in range(70):\n"
        "    moved = to_device([t + 0 for t in batch], 'emu:0')\n"
        "values = [t.tolist()[0] for t in moved]\n"
        "print(staging_memory() > 0, values == list(map(float, range(8))))\n"
    )
    if out.startswith("unavailable:"):
        pytest.skip(f"the emulated accelerator: {out}")
    assert ["[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0] 0", "True True"] == out.splitlines()
