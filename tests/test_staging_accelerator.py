"""Staged moves on a real accelerator's semantics: the emulated one in CI, a GPU elsewhere.

Copies to or from pinned memory finish late there (``devicectx.testing.emulated``: about
2 ms after their stream reaches them), so what the staged path reads, and when, shows: a
source read too early, a chunk reused too early, a result handed back before it landed.
Each property compares the staged move with the per-tensor one (``coalesce=False``),
whose every copy is ``.to``: ordered on the stream, as torch orders it.

The real path, with thresholds lowered: the batches here are a few small tensors, which
the real thresholds (4 small tensors at least) would seldom stage; every example here
stages, through the device's own pinned pool, and says how many tensors it staged.
Copies into pending sources are queued in the test and held (``emulated.paused``) until
the staged move has read its sources: the race staging must avoid is there every time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import accelerator, described, staged_counts, step_ahead, tensors_of
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch import nn

from devicectx import MoveError, device_agnostic, to_device
from devicectx.move import _pinned, _staging, _streams
from devicectx.move._staging._state import STATE, swapped
from devicectx.move._walk import collect
from devicectx.testing import emulated
from devicectx.testing.strategies import nested, tensors

pytestmark = pytest.mark.requires_device("accelerator")
needs_emulated = pytest.mark.skipif(
    not emulated.enabled(),
    reason="needs the emulated accelerator's controls: pytest --devicectx-accelerator=emulated",
)

SMALL = dataclasses.replace(
    _staging.THRESHOLDS, min_tensors=2, stage_min_bytes=256, share_max_bytes=64, shared_bytes=256
)
"""Thresholds the drawn batches stage under: 2 small tensors (64 bytes at most) are
enough; larger ones stream through the chunks; regions of 256 bytes, several a batch.
The chunk and pool sizes are the real ones: the pool is the device's own, kept for the
process."""


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.pin_memory()


def pending(tensor: torch.Tensor) -> torch.Tensor:
    """Pinned memory that a copy of ``tensor`` from the device is to land in (queued by
    :func:`land`, as ``.to("cpu", non_blocking=True)`` queues one): other values till then."""
    stale = (tensor.logical_not() if tensor.dtype == torch.bool else tensor + 1).pin_memory()
    stale.landing = tensor.to(accelerator())  # type: ignore[attr-defined]
    return stale


def channels_last(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(memory_format=torch.channels_last) if tensor.dim() == 4 else tensor


def requiring_grad(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype.is_floating_point:
        return tensor.detach().requires_grad_(True)
    return tensor


SOURCES: list[Callable[[torch.Tensor], torch.Tensor]] = [
    lambda tensor: tensor,  # pageable
    pinned,
    pending,
    channels_last,
    requiring_grad,
]

shapes = st.one_of(
    st.lists(st.integers(0, 4), max_size=3).map(tuple),
    st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
)
sources = st.tuples(tensors(devices=["cpu"], shapes=shapes), st.sampled_from(SOURCES)).map(
    lambda pair: pair[1](pair[0])
)
small_shapes = st.sampled_from([(1,), (3,), (2, 2)])
runs = st.tuples(
    st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bool]), small_shapes
).flatmap(
    lambda kind: st.lists(
        tensors(devices=["cpu"], dtypes=[kind[0]], shapes=st.just(kind[1])),
        min_size=SMALL.min_tensors,
        max_size=4,
    )
)
"""Small pageable tensors of one dtype and shape, as many as staging needs at least: a
batch's per-sample fields. They make every example stage, and come back from one run."""
batches = st.tuples(
    nested(sources), runs, st.lists(tensors(devices=["cpu"], shapes=small_shapes).map(pending))
)
"""A nested batch of every kind of source, a run, and small pending sources (in most
examples: they are what staging must not read too early)."""


def land(batch: Any) -> int:
    """Queue the copy from the device into each pending source of ``batch`` (or base of
    one of its views) that is not empty, on the current stream: into pinned memory, so it
    lands when the stream gets to it. Returns how many were queued."""
    found, inside, _ = collect(batch)
    targets: dict[int, torch.Tensor] = {}
    for tensor in [*found.values(), *inside.values()]:
        for candidate in (tensor, tensor._base):
            if candidate is not None and candidate.numel() and hasattr(candidate, "landing"):
                targets[id(candidate)] = candidate
    for target in targets.values():
        target.copy_(target.landing, non_blocking=True)  # type: ignore[attr-defined]
    return len(targets)


class Staging:
    """Moves made under :meth:`watch` stage with :data:`SMALL`, through the device's own
    pinned pool; ``staged`` counts the tensors the staged path moved, ``busy`` says
    whether the stream still had work queued when staging looked. :meth:`hold` pauses
    the (emulated) device till the staged move has packed its sources."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.staged = 0
        self.busy: bool | None = None
        self.held = False
        self._hold = contextlib.ExitStack()

    @classmethod
    @contextlib.contextmanager
    def watch(cls, device: torch.device) -> Iterator[Staging]:
        """A block whose moves stage as the class says, watched; the device resumed at its end."""
        watch = cls(device)
        stage, release = _staging.stage, _pinned.Pool.release

        def watched_stage(
            obj: Any,
            target: torch.device,
            non_blocking: bool,
            skip_types: tuple[type, ...],
            handed: _staging.HandedTo | None = None,
        ) -> Any:
            watch.busy = not torch.accelerator.current_stream(target).query()
            staged = None
            try:
                staged = stage(obj, target, non_blocking, skip_types, handed)
                return staged
            finally:
                watch.staged += 0 if staged is None else len(staged.results)
                watch._hold.close()  # declined, or done: the per-tensor move waits

        def packed(pool: _pinned.Pool, *args: Any) -> Any:
            watch._hold.close()  # the sources are packed: the stream may run
            return release(pool, *args)

        with watch._hold, pytest.MonkeyPatch.context() as patch:
            patch.setattr(_staging, "THRESHOLDS", SMALL)
            patch.setattr(_staging, "stage", watched_stage)
            patch.setattr(_pinned.Pool, "release", packed)
            yield watch

    def hold(self) -> None:
        """Hold back the work queued on the device from now (the emulated device only)
        until the staged move has read its sources: copies queued into pending sources
        are still pending while staging looks at them and packs."""
        if emulated.enabled() and self.device.type == emulated.DEVICE_TYPE:
            self._hold.enter_context(emulated.paused(self.device))
            self.held = True


def relations(results: list[torch.Tensor]) -> list[tuple[bool, bool, bool]]:
    """For each pair: the same object? the first a view of the second? sharing memory?"""
    return [
        (a is b, a._base is b, a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
        for a in results
        for b in results
        if a.numel() and b.numel()
    ]


def in_place_with_grad(results: list[torch.Tensor]) -> list[str]:
    """Each floating result, in turn, multiplied in place by a parameter under grad mode:
    what happened (``ok`` or the error's type)."""
    outcomes = []
    for tensor in results:
        if not tensor.dtype.is_floating_point or tensor.dtype == torch.float16:
            continue
        weight = nn.Parameter(torch.ones((), dtype=tensor.dtype, device=tensor.device))
        try:
            with torch.enable_grad():
                tensor.mul_(weight)
            outcomes.append("ok")
        except RuntimeError as error:
            outcomes.append(type(error).__name__)
    return outcomes


@settings(max_examples=40)
@given(batch=batches, non_blocking=st.booleans())
def test_staged_and_per_tensor_moves_agree(batch: Any, non_blocking: bool) -> None:
    """For batches of pageable, pinned and pending-copy sources, views, channels_last and
    tensors that require grad: the staged move gives what ``.to`` gives, tensor by tensor:
    values, dtypes, shapes, strides, aliasing, views, autograd, in-place ops with grad
    operands, with non_blocking either way. The staged move goes first, with the copies
    into pending sources queued and, on the emulated device, not landed while it reads."""
    device = accelerator()
    with Staging.watch(device) as staging:
        staging.hold()
        landing = land(batch)
        staged = to_device(batch, device, non_blocking=non_blocking)
    alone = to_device(batch, device, non_blocking=non_blocking, coalesce=False)
    torch.accelerator.synchronize()
    event("pending copies: " + ("0", "1", "2 or more")[min(landing, 2)])
    assert staging.staged >= SMALL.min_tensors
    if staging.held:
        assert (landing > 0) == staging.busy
    expected, actual = tensors_of(alone), tensors_of(staged)
    assert [described(t) for t in expected] == [described(t) for t in actual]
    assert [e.cpu().tolist() for e in expected] == [a.cpu().tolist() for a in actual]
    assert relations(expected) == relations(actual)
    assert in_place_with_grad(expected) == in_place_with_grad(actual)


@settings(max_examples=25)
@given(batch=st.tuples(nested(tensors(devices=["cpu"], shapes=shapes), views=False), runs))
def test_pageable_sources_may_change_once_the_move_returns(batch: Any) -> None:
    """With ``non_blocking=True``, pageable sources may be overwritten as soon as
    ``to_device`` returns (staged ones are in the staging buffer; the rest were copied
    by ``.to``, which copies pageable memory before it returns): the results hold the
    values from before."""
    device = accelerator()
    before = [t.clone() for t in tensors_of(batch)]
    with Staging.watch(device) as staging:
        moved = to_device(batch, device, non_blocking=True)
    for source in tensors_of(batch):
        if source.numel():
            source.fill_(7)
    torch.accelerator.synchronize()
    assert staging.staged >= SMALL.min_tensors
    assert [e.tolist() for e in before] == [a.cpu().tolist() for a in tensors_of(moved)]


def test_pinned_sources_may_change_after_the_first_staged_move_on_an_idle_stream() -> None:
    """The first staged move of a process, on an idle stream, packs pinned sources too, so
    that they may change once it returns: the look at whether pinned memory and events work
    (made on that first move) leaves the stream idle, not busy with a probe of its own."""
    device = accelerator()
    sources = [torch.ones(64).pin_memory() for _ in range(4)]
    with swapped(STATE.replace(hosts={})):  # no host yet: this move makes it
        torch.accelerator.synchronize()
        moved = to_device(sources, device, non_blocking=True)
        for source in sources:
            source.fill_(2.0)
        torch.accelerator.synchronize()
    assert [[1.0] * 64] * 4 == [tensor.cpu().tolist() for tensor in moved]


# Non-blocking moves on the copy stream. The caller's stream is held back (work queued ahead
# of the move, as a training step's kernels are), and the pool holds two chunks of 1 KiB:
# a sequence of batches reuses every chunk several times. Each move must return without the
# host waiting for the caller's stream (a wait on a held stream raises on the emulated
# device), the batch must be read on that stream only after its copies land, and its memory
# must not be reused while reads queued there are pending.

TINY_POOL = dataclasses.replace(SMALL, chunk_bytes=1024, pool_bytes=2048)

stageable = st.lists(
    st.one_of(
        runs,  # small tensors, packed into shared regions
        tensors(devices=["cpu"], shapes=st.sampled_from([(260,), (16, 40)])).map(
            lambda tensor: [tensor]
        ),  # larger ones (256 bytes or more: staged alone), streamed through the chunks
    ),
    min_size=1,
    max_size=3,
).map(lambda parts: [tensor for part in parts for tensor in part])
"""A batch every tensor of which the staged path moves: pageable, not empty, dense, no
grad, and enough of them (a tensor it declined would be moved by ``.to``, which waits for
the held stream)."""


class TinyPool:
    """The device's staged moves, in :meth:`block`, through a pool of two 1 KiB chunks;
    ``staged`` counts the tensors they staged."""

    def __init__(self, device: torch.device) -> None:
        self.pool = _pinned.Pool(_pinned._pinned_buffer, _pinned._new_event, 1024, 2048)
        self.counts: list[int] = []
        real = _pinned.host_for(device.type, 1024, 2048, device)
        assert real is not None
        self.host = _pinned.Host(self.pool, real.stream, real.pinned, real.idle, real.side)

    @property
    def staged(self) -> int:
        return sum(self.counts)

    @contextlib.contextmanager
    def block(self) -> Iterator[TinyPool]:
        hosts = {**STATE.hosts, accelerator().type: self.host}
        with (
            staged_counts() as self.counts,
            swapped(STATE.replace(thresholds=TINY_POOL, hosts=hosts)),
        ):
            yield self


def tiny_pool(device: torch.device) -> contextlib.AbstractContextManager[TinyPool]:
    """A block whose staged moves to ``device`` go through a :class:`TinyPool`."""
    return TinyPool(device).block()


def held_reads(batches: list[list[torch.Tensor]], device: torch.device) -> list[torch.Tensor]:
    """Move each batch with ``non_blocking=True`` while the caller's stream is held back
    with work queued, queue a copy of each result to the host on that stream, then drop
    the results; the copies' values once the stream runs."""
    stream = torch.accelerator.current_stream(device)
    # Held back by a step queued ahead that waits for a paused stream (a wait for an event
    # already complete queues nothing, and left the stream idle now and then).
    with step_ahead(stream):
        reads = []
        alive = []
        for batch in batches:
            moved = to_device(batch, device, non_blocking=True)
            reads.extend(t.to("cpu", non_blocking=True) for t in moved)
            alive.extend(weakref.ref(t) for t in moved)
            del moved
        if any(ref() is not None for ref in alive):  # held in a cycle: a collection frees it
            gc.collect()
    torch.accelerator.synchronize()
    return reads


@needs_emulated
@settings(max_examples=30)
@given(batches=st.lists(stageable, min_size=1, max_size=4))
def test_non_blocking_moves_do_not_wait_for_the_callers_stream(
    batches: list[list[torch.Tensor]],
) -> None:
    """With the caller's stream held back behind a step, non-blocking staged moves return
    at once (their copies, and the chunks' reuse, wait for the copy stream alone),
    however often the chunks are reused; read on the caller's stream, every result has
    its source's values, even once dropped before those reads ran."""
    device = accelerator()
    with tiny_pool(device) as tiny:
        reads = held_reads(batches, device)
    sources = [tensor for batch in batches for tensor in batch]
    event(f"chunks reused: {sum(t.nbytes for t in sources) > tiny.pool.limit_bytes}")
    assert len(sources) == len(reads) == tiny.staged
    for source, read in zip(sources, reads, strict=True):
        assert torch.equal(source, read)


@needs_emulated
def test_the_copy_stream_test_fails_on_the_callers_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """The property above can fail: with the copies on the caller's stream, a held stream
    holds the chunks, and the move cannot go on."""
    device = accelerator()
    batch = [torch.randn(16, 40) for _ in range(3)]  # 7.5 KiB: the two chunks, reused
    off = swapped(STATE.replace(copy_stream=False))
    with off, tiny_pool(device), pytest.raises(MoveError):
        held_reads([batch], device)
    torch.accelerator.synchronize()


BATCH = [torch.randn(3) for _ in range(4)] + [torch.randn(200)]
"""Four small tensors and one larger: 1 KiB staged, no chunk reused in the tiny pool."""


@needs_emulated
def test_behind_queued_work_the_callers_stream_waits_for_the_copy_stream() -> None:
    """Behind a step queued on the caller's stream, a non-blocking staged move returns
    with its copies held back on the copy stream (the host does not wait for them), and
    the caller's stream waits for them: once the step has run, waiting for the caller's
    stream waits for the held copies (which the emulator refuses, as it would hang)."""
    device = accelerator()
    side, caller = _streams.copy_stream(device), torch.accelerator.current_stream(device)
    with tiny_pool(device) as tiny, emulated.paused(device, stream=side):
        with step_ahead(caller) as blocker:
            moved = to_device(BATCH, device, non_blocking=True)
        blocker.synchronize()
        with pytest.raises(RuntimeError, match="paused"):
            caller.synchronize()
    torch.accelerator.synchronize()
    assert len(BATCH) == tiny.staged
    assert all(torch.equal(a, b.cpu()) for a, b in zip(BATCH, moved, strict=True))


@needs_emulated
def test_on_an_idle_callers_stream_the_copies_stay_there() -> None:
    """On a caller's stream with nothing queued, a non-blocking staged move queues its
    copies there, where they start at once: the copy stream, held back, is not waited for."""
    device = accelerator()
    side, caller = _streams.copy_stream(device), torch.accelerator.current_stream(device)
    caller.synchronize()
    with tiny_pool(device) as tiny, emulated.paused(device, stream=side):
        moved = to_device(BATCH, device, non_blocking=True)
        caller.synchronize()
        reads = [t.cpu() for t in moved]
    assert len(BATCH) == tiny.staged
    assert all(torch.equal(a, b) for a, b in zip(BATCH, reads, strict=True))


@needs_emulated
def test_a_move_to_another_device_leaves_the_current_device_and_streams() -> None:
    """Behind work queued on device 1, a non-blocking staged move there goes through device
    1's copy stream and leaves device 0 current, and each device's current stream as it was."""
    if torch.accelerator.device_count() < 2:
        pytest.skip("needs two devices")
    first, second = accelerator(0), accelerator(1)
    before = [torch.accelerator.current_stream(d) for d in (first, second)]
    index = torch.accelerator.current_device_index()
    with tiny_pool(second) as tiny, step_ahead(before[1]):
        moved = to_device(BATCH, second, non_blocking=True)
    torch.accelerator.synchronize(second)
    assert len(BATCH) == tiny.staged
    assert index == torch.accelerator.current_device_index()
    assert before == [torch.accelerator.current_stream(d) for d in (first, second)]
    assert all(torch.equal(a, b.cpu()) for a, b in zip(BATCH, moved, strict=True))


@needs_emulated
def test_the_copy_stream_block_restores_device_and_stream_on_an_error() -> None:
    """An error inside a block on device 1's copy stream leaves device 0 current and
    device 1's current stream as they were."""
    if torch.accelerator.device_count() < 2:
        pytest.skip("needs two devices")
    second = accelerator(1)
    index = torch.accelerator.current_device_index()
    before = torch.accelerator.current_stream(second)
    with pytest.raises(ZeroDivisionError), _streams.queued_on(_streams.copy_stream(second), second):
        1 / 0  # noqa: B018
    assert index == torch.accelerator.current_device_index()
    assert before == torch.accelerator.current_stream(second)


# A batch too small to stage, told before staging looks: the real thresholds (4 small
# tensors, or 1 MiB), around their edges.
_SIZES = st.sampled_from([1, 16, 16_384, 131_072, 262_144])  # floats: up to 1 MiB a tensor
_leaves = st.one_of(
    st.builds(lambda n: torch.zeros(n), _SIZES),
    st.builds(lambda n: torch.zeros(n, device=accelerator()), _SIZES),
    st.sampled_from(["name", 3, None]),
)
_plain_batches = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.lists(inner, max_size=5).map(tuple),
        st.dictionaries(st.sampled_from("abcde"), inner, max_size=5),
    ),
    max_leaves=7,
)


@settings(max_examples=60)
@given(batch=_plain_batches)
def test_a_batch_staging_is_said_to_decline_stages_nothing(batch: Any) -> None:
    """Where ``_staging.declines`` says a move of plain dicts, lists and tuples is too
    small to stage (told from the batch alone, before any pinned host), the staging look
    itself stages nothing of it: the move engine skips that look for such batches."""
    device = accelerator()
    declined = _staging.declines(batch, device)
    event(f"declines: {declined}")
    if declined:
        assert _staging.stage(batch, device, False, ()) is None


def test_the_decline_is_told_at_the_thresholds_edges() -> None:
    """Three small tensors off the device decline, four do not, nor 1 MiB in two; tensors
    already on the device do not count; a container of another kind is left to the look."""
    device = accelerator()
    small = [torch.zeros(4) for _ in range(4)]
    there = torch.zeros(4, device=device)
    assert _staging.declines({"x": small[0], "y": small[1:3], "n": "b0"}, device)
    assert not _staging.declines((small[0], [small[1], {"z": small[2]}], small[3]), device)
    assert _staging.declines((*small[:3], there, there), device)
    assert not _staging.declines([torch.zeros(131_072), torch.zeros(131_072)], device)
    assert not _staging.declines(Pair(small[0], small[1]), device)


def test_a_move_of_a_few_small_tensors_skips_the_staging_look(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``to_device`` and a decorated call of a training step's batch (three small tensors,
    a model beside them) never reach the staging look; a batch of four small tensors does,
    and is staged."""
    device = accelerator()
    looked: list[object] = []
    stage = _staging.stage

    def watched(obj: Any, *args: Any) -> Any:
        looked.append(obj)
        return stage(obj, *args)

    monkeypatch.setattr(_staging, "stage", watched)
    model = nn.Linear(2, 2).to(device)

    @device_agnostic(device=device)
    def step(model: nn.Module, x: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
        pass

    x, y, mask = torch.zeros(2, 2), torch.zeros(2), torch.ones(2)
    moved = to_device({"x": x, "y": y, "mask": mask}, device)
    step(model, x, {"y": y, "mask": mask})
    assert [] == looked
    assert all(t.device == device for t in moved.values())
    with staged_counts() as counts:
        to_device([x, y, mask, torch.zeros(3)], device)
    assert len(looked) == 1
    assert [4] == counts


@dataclasses.dataclass
class Pair:
    first: torch.Tensor
    second: torch.Tensor
