"""``prefetch``: batches moved ahead of the step, in order, with a loader's habits kept.

Three layers. On the CPU and ``meta`` (no streams) the iterator moves each batch when it is
asked for; those tests run everywhere. The lookahead (reading ``depth`` batches ahead,
errors kept for their turn, freeing on ``close`` and ``break``) is checked on the CPU too,
through a stand-in for :class:`devicectx.move._prefetch.Streams` that records what it is asked.
The stream path itself (copy stream, events, ``record_stream``) runs on an accelerator:
the emulated one of the testing kit, or a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import inspect
import re
import reprlib
import threading
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import staged_counts, step_ahead
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from devicectx import (
    DeviceWarning,
    MoveError,
    RepeatedMoveWarning,
    device_agnostic,
    on_device,
    prefetch,
    register_container,
    staging_memory,
    to_device,
    track_transfers,
    unregister_container,
)
from devicectx.move import _prefetch, _repeats, _staging, _streams
from devicectx.move._staging._state import StagingState, swapped
from devicectx.move._walk import iter_tensors
from devicectx.testing import emulated
from devicectx.testing.strategies import nested, tensors

CPU = torch.device("cpu")
META = torch.device("meta")


def summary(obj: Any) -> list[tuple[str, tuple[int, ...], str, str, str]]:
    """Each tensor of ``obj``, sorted: its path (set members unnumbered: their order
    follows hashes), shape, dtype, device and type; what a move to ``meta`` can be compared
    on (it keeps no values)."""
    return sorted(
        (re.sub(r"\)\[\d+\]", ")[_]", path), tuple(t.shape), str(t.dtype), str(t.device),
         type(t).__name__)
        for path, t in iter_tensors(obj, "batch")
    )  # fmt: skip


def numbered(count: int) -> list[dict[str, Any]]:
    """``count`` small batches, each a dict with its index and two tensors."""
    return [
        {"i": i, "x": torch.full((2, 3), float(i)), "y": torch.arange(i + 1)} for i in range(count)
    ]


class Reads:
    """A loader that logs each read into a shared log, and raises for the batches asked to."""

    def __init__(
        self, batches: list[Any], log: list[str], raise_at: frozenset[int] = frozenset()
    ) -> None:
        self.batches = batches
        self.log = log
        self.raise_at = raise_at
        self.position = 0

    def __iter__(self) -> Reads:
        return self

    def __next__(self) -> Any:
        index = self.position
        if index >= len(self.batches):
            raise StopIteration
        self.position += 1
        self.log.append(f"read {index}")
        if index in self.raise_at:
            raise KeyError(f"sample {index} is missing")
        return self.batches[index]


class Recording:
    """A stand-in for ``Streams`` on the CPU: moves at once, and logs sends, hand-overs
    and waits by batch index (its events are the indices)."""

    def __init__(self, device: torch.device, log: list[str]) -> None:
        self.device = device
        self.log = log

    def send(self, move: Callable[[Any, int], Any], batch: Any, index: int) -> tuple[Any, int]:
        moved = move(batch, index)
        self.log.append(f"send {index}")
        return moved, index

    def hand_over(self, token: tuple[Any, int]) -> Any:
        self.log.append(f"hand over {token[1]}")
        return token[0]

    def landed(self, token: tuple[Any, int]) -> None:
        self.log.append(f"landed {token[1]}")

    def sources_read(self, token: tuple[Any, int]) -> None:
        pass  # moved at once, in send

    def close(self) -> None:
        pass


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A log, and every prefetcher made in the test given a recording stand-in for streams."""
    entries: list[str] = []
    monkeypatch.setattr(_prefetch, "streams_for", lambda device, **_: Recording(device, entries))
    return entries


# Where there are no streams: in order, one when asked.


def test_moves_each_batch_as_to_device_does() -> None:
    """Each batch comes back moved to meta, as to_device moves it, in the loader's order."""
    batches = numbered(4)

    moved = list(prefetch(batches, "meta"))

    assert [summary(to_device(b, "meta")) for b in batches] == [summary(b) for b in moved]
    assert [0, 1, 2, 3] == [b["i"] for b in moved]


def test_batches_already_on_the_device_come_back_as_they_are() -> None:
    """On the CPU, to the CPU, nothing is copied: the loader's own batches come back."""
    batches = numbered(3)

    assert [id(b) for b in batches] == [id(b) for b in prefetch(batches, "cpu")]


def test_no_streams_on_the_cpu_or_meta() -> None:
    """The CPU and meta have no streams: batches move in order, and that is said."""
    assert (False, False) == (prefetch([], "cpu").streams, prefetch([], "meta").streams)


def test_device_defaults_to_the_enclosing_block_then_auto() -> None:
    """device=None takes the enclosing on_device block's device, else what "auto" picks."""
    with on_device("meta"):
        inside: Any = prefetch([], None)
    outside: Any = prefetch([], None)

    assert META == inside.device
    assert torch.device("cpu") == outside.device or torch.accelerator.is_available()


def test_in_order_reads_one_batch_when_asked() -> None:
    """Without streams, nothing is read ahead: each read comes when its batch is asked for."""
    log: list[str] = []
    batches = prefetch(Reads(numbered(3), log), "meta", depth=4)

    for batch in batches:
        log.append(f"step {batch['i']}")

    assert ["read 0", "step 0", "read 1", "step 1", "read 2", "step 2"] == log


def test_no_thread_is_started_without_streams() -> None:
    """Where the device has no streams, prefetching starts no thread: each batch is moved
    in the caller's, when asked for."""
    before = threading.active_count()

    for _ in prefetch(numbered(3), "meta"):
        assert before == threading.active_count()


@pytest.mark.parametrize(("batches", "kind"), [(3, "an int"), (None, "a NoneType")])
def test_batches_that_cannot_be_iterated_are_refused_at_the_call(batches: Any, kind: str) -> None:
    """``prefetch(3)`` is a TypeError of ours where it is called, not Python's at the first
    ``next()``."""
    with pytest.raises(TypeError) as raised:
        prefetch(batches, "meta")

    assert [
        f"prefetch({batches!r}, ...): batches is what the training loop iterates over, and "
        f"{kind} is not iterable",
        "fix: prefetch(loader, ...) with the DataLoader (or list, or generator) of batches; to "
        "move one batch, to_device(batch, ...)",
    ] == str(raised.value).splitlines()


@pytest.mark.parametrize("batch", [{"x": torch.ones(2)}, collections.UserDict(x=torch.ones(2))])
def test_one_batch_given_as_the_batches_is_refused_at_the_call(batch: Any) -> None:
    """``prefetch(batch)`` with a dict (or a UserDict, as transformers' BatchEncoding is)
    would hand over its keys: refused with the fix, to_device for one batch."""
    with pytest.raises(TypeError) as raised:
        prefetch(batch, "meta")

    kind = type(batch).__name__
    assert [
        f"prefetch({reprlib.repr(batch)}, ...): a {kind} is one batch: iterating it gives its "
        "keys, not batches",
        "fix: prefetch(loader, ...) with the DataLoader (or list, or generator) of batches; to "
        "move one batch, to_device(batch, ...)",
    ] == str(raised.value).splitlines()


def test_a_dataset_iterated_by_its_indices_is_taken_and_not_started_at_the_call() -> None:
    """What Python iterates is taken: a class with ``__getitem__`` alone (the old sequence
    protocol); nothing is read from it until the loop asks."""
    read: list[int] = []

    class Indexed:
        def __getitem__(self, index: int) -> torch.Tensor:
            if index == 2:
                raise IndexError(index)
            read.append(index)
            return torch.ones(1)

    batches = prefetch(Indexed(), "meta")
    assert [] == read
    assert ["meta", "meta"] == [batch.device.type for batch in batches]


@pytest.mark.parametrize("depth", [0, -1, 1.5, True, "2"])
def test_depth_must_be_a_positive_int(depth: Any) -> None:
    """A depth that is no int of at least 1 is refused when the prefetcher is made."""
    with pytest.raises(ValueError, match="depth") as raised:
        prefetch([], "meta", depth=depth)

    assert [
        f"prefetch(depth={depth!r}): depth is how many batches move ahead of the one handed "
        "over, an int of at least 1",
        "fix: prefetch(batches, depth=2), or depth=1 to hold the fewest batches on the device",
    ] == str(raised.value).splitlines()


# A loader's habits.


def test_len_and_loader_attributes_are_read_through() -> None:
    """len(), sampler, batch_size and dataset are the DataLoader's own."""
    dataset = TensorDataset(torch.arange(10.0))
    loader = DataLoader(dataset, batch_size=4)

    batches = prefetch(loader, "meta")

    assert (3, loader.sampler, 4, dataset) == (
        len(batches),
        batches.sampler,
        batches.batch_size,
        batches.dataset,
    )


def test_len_of_an_iterable_without_one_is_a_type_error() -> None:
    """A generator has no len(): neither has its prefetcher, and list() still works."""
    batches = prefetch((b for b in numbered(2)), "meta")

    with pytest.raises(TypeError):
        len(batches)
    assert 2 == len(list(batches))


def test_missing_attribute_names_the_attribute() -> None:
    """An attribute neither the prefetcher nor the loader has is an AttributeError that
    names both (not only the loader, whose type the user may not know was asked)."""
    with pytest.raises(AttributeError) as error:
        prefetch([], "meta").no_such_thing  # type: ignore[attr-defined]  # noqa: B018
    assert "prefetch() object has no attribute 'no_such_thing', nor has the list it reads" == str(
        error.value
    )


def test_set_epoch_reaches_a_distributed_sampler() -> None:
    """set_epoch() tells the loader's DistributedSampler, which then shuffles anew."""
    dataset = TensorDataset(torch.arange(16))
    sampler: DistributedSampler[int] = DistributedSampler(dataset, num_replicas=2, rank=0, seed=0)
    batches = prefetch(DataLoader(dataset, batch_size=4, sampler=sampler), "cpu")

    first = [b[0].tolist() for b in batches]
    batches.set_epoch(3)
    again = [b[0].tolist() for b in batches]

    assert 3 == sampler.epoch
    assert first != again


def test_set_epoch_prefers_the_loaders_own() -> None:
    """A loader with its own set_epoch (accelerate's) is told directly."""

    class Loader(list[Any]):
        epoch = -1

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

    loader = Loader(numbered(2))

    prefetch(loader, "meta").set_epoch(5)

    assert 5 == loader.epoch


def test_set_epoch_without_one_says_so() -> None:
    """A loader with no set_epoch anywhere: the error names it and what to do."""
    with pytest.raises(AttributeError) as raised:
        prefetch(numbered(1), "meta").set_epoch(1)

    assert [
        "prefetch(...).set_epoch(1): the wrapped list has no set_epoch, nor has its sampler",
        "fix: leave set_epoch out for this loader, or give it a sampler that takes one "
        "(DistributedSampler)",
    ] == str(raised.value).splitlines()


def test_reiterable_when_the_loader_is() -> None:
    """A list or a DataLoader gives a new pass at each iter(), as a loop per epoch needs."""
    loader = DataLoader(TensorDataset(torch.arange(6.0)), batch_size=2)
    batches = prefetch(loader, "meta")

    epochs = [[tuple(b[0].shape) for b in batches] for _ in range(2)]

    assert [[(2,), (2,), (2,)]] * 2 == epochs


def test_an_iterator_is_one_pass_resumed_after_break() -> None:
    """Over a generator, a break and a new loop go on where the first stopped: nothing read
    ahead is lost, as with the generator itself."""
    batches = prefetch((b for b in numbered(5)), "meta")

    first = []
    for batch in batches:
        first.append(batch["i"])
        if batch["i"] == 1:
            break
    rest = [batch["i"] for batch in batches]

    assert ([0, 1], [2, 3, 4]) == (first, rest)


@pytest.mark.filterwarnings("ignore::devicectx.RepeatedMoveWarning")  # the list, twice
def test_close_ends_the_passes() -> None:
    """close() ends every pass under way; a list can be iterated again after it."""
    batches = prefetch(numbered(3), "meta")
    running = iter(batches)
    next(running)

    batches.close()

    assert [] == list(running)
    assert [0, 1, 2] == [b["i"] for b in batches]


def test_repr_shows_the_call() -> None:
    """The repr reads as the call that made it, its loader by type and length, never its
    batches (a notebook shows it as a cell's last line); an iterator by its own repr."""
    assert "prefetch([], 'meta', depth=3)" == repr(prefetch([], "meta", depth=3))
    data = [{"x": torch.zeros(100)}] * 200
    assert "prefetch(<list of 200 batches>, 'meta', depth=2)" == repr(prefetch(data, "meta"))
    loader = torch.utils.data.DataLoader(torch.zeros(10, 3), batch_size=4)
    assert "prefetch(<DataLoader of 3 batches>, 'meta', depth=2)" == repr(prefetch(loader, "meta"))
    stream = torch.utils.data.DataLoader(_Stream(), batch_size=None)
    assert "prefetch(<DataLoader>, 'meta', depth=2)" == repr(prefetch(stream, "meta"))
    batches = iter(data)
    assert f"prefetch({batches!r}, 'meta', depth=2)" == repr(prefetch(batches, "meta"))


class _Stream(torch.utils.data.IterableDataset[torch.Tensor]):
    """A dataset with no length."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield torch.zeros(2)


# Errors, in order.


def raise_in_loader(log: list[str]) -> Iterator[dict[str, Any]]:
    """A generator loader that yields two batches, then fails."""
    yield from numbered(2)
    log.append("about to fail")
    raise KeyError("sample 2 is missing")


def test_loader_error_surfaces_in_its_turn_with_its_traceback() -> None:
    """The loader's exception comes when its batch is asked for, after the batches before
    it, as the same exception, with the loader's frame in its traceback."""
    log: list[str] = []
    seen: list[int] = []

    with pytest.raises(KeyError) as raised:
        seen.extend(batch["i"] for batch in prefetch(raise_in_loader(log), "meta"))

    assert [0, 1] == seen
    frames = [frame.name for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert "raise_in_loader" == frames[-1]


class Unmovable:
    """An object with a tensor and its own ``.to``, which always fails."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def to(self, *args: Any, **kwargs: Any) -> Unmovable:
        raise RuntimeError("this object stays where it is")


def test_move_error_names_the_batch_index_and_path() -> None:
    """A batch that cannot be moved raises MoveError naming its index, the path inside it,
    and the skip= that leaves it alone; the batches before it come first."""
    batches = [*numbered(2), {"i": 2, "odd": Unmovable(torch.zeros(1))}]
    seen: list[int] = []

    with pytest.raises(MoveError) as raised:
        seen.extend(batch["i"] for batch in prefetch(batches, "meta"))

    assert [0, 1] == seen
    assert [
        "prefetch() at batch 2 could not move batch['odd'] (an Unmovable) to meta:",
        "    RuntimeError: this object stays where it is",
        "fix: leave it where it is: prefetch(batches, 'meta', skip=[\"batch['odd']\"])",
    ] == str(raised.value).splitlines()


def test_skip_paths_are_rooted_at_batch() -> None:
    """skip= takes paths from ``batch``, as the error's fix writes them."""
    batches: list[dict[str, Any]] = [{"i": 0, "odd": Unmovable(torch.zeros(1)), "x": torch.ones(1)}]

    (moved,) = prefetch(batches, "meta", skip=["batch['odd']"])

    assert (META, CPU) == (moved["x"].device, moved["odd"].value.device)


# The rest of devicectx sees it.


def test_track_transfers_names_the_prefetch_line() -> None:
    """The copies are recorded under the line that called prefetch, by path in the batch."""
    line = inspect.currentframe().f_lineno + 3  # type: ignore[union-attr]
    place = f"{_repeats._short(__file__)}:{line}"
    with track_transfers() as transfers:
        batches = prefetch(numbered(3), "meta")
        for _ in batches:
            pass

    assert {
        (place, "batch['x']", 3, 3 * 24),
        (place, "batch['y']", 3, (1 + 2 + 3) * 8),
    } == {(row.where, row.path, row.tensors, row.bytes) for row in transfers.rows}


def test_decorated_step_finds_its_inputs_on_the_device() -> None:
    """@device_agnostic on the step moves nothing: every copy is prefetch's."""

    @device_agnostic(device="meta")
    def step(batch: dict[str, Any]) -> torch.Tensor:
        total: torch.Tensor = batch["x"].sum()
        return total

    with track_transfers() as transfers:
        batches = prefetch(numbered(3), "meta")
        results = [step(batch) for batch in batches]

    assert [META] * 3 == [r.device for r in results]
    assert {_repeats._short(__file__)} == {row.where.split(":")[0] for row in transfers.rows}


# The lookahead, through a recording stand-in for the streams.


def test_reads_depth_batches_ahead(log: list[str]) -> None:
    """With streams, the first batch asked for reads depth more; each later one reads one
    more, sent before the batch is handed over."""
    batches = prefetch(Reads(numbered(4), log), "meta", depth=2)

    for batch in batches:
        log.append(f"step {batch['i']}")

    assert [
        "read 0", "send 0", "read 1", "send 1", "read 2", "send 2", "hand over 0", "step 0",
        "read 3", "send 3", "hand over 1", "step 1",
        "hand over 2", "step 2",
        "hand over 3", "step 3",
    ] == log  # fmt: skip


def test_loader_error_ahead_waits_for_its_turn(log: list[str]) -> None:
    """An error read ahead stops the reading; it is raised when its batch is asked for,
    and a loader that can go on is read again after it."""
    batches = prefetch(Reads(numbered(4), log, raise_at=frozenset({1})), "meta", depth=2)
    running = iter(batches)

    first = next(running)
    log.append(f"step {first['i']}")
    with pytest.raises(KeyError, match="sample 1 is missing"):
        next(running)
    log.append("error seen")
    rest = [batch["i"] for batch in running]

    assert [
        "read 0", "send 0", "read 1", "hand over 0", "step 0", "error seen",
        "read 2", "send 2", "read 3", "send 3", "hand over 2", "hand over 3",
    ] == log  # fmt: skip
    assert [2, 3] == rest


def test_move_error_ahead_waits_for_its_turn(log: list[str]) -> None:
    """A batch read ahead that cannot be moved raises MoveError in its turn, not before."""
    batches = [*numbered(1), {"i": 1, "odd": Unmovable(torch.zeros(1))}, *numbered(1)]
    running = iter(prefetch(batches, "meta", depth=3))

    assert 0 == next(running)["i"]
    with pytest.raises(MoveError, match=r"prefetch\(\) at batch 1 could not move"):
        next(running)
    assert 0 == next(running)["i"]  # the list's third batch


def test_close_waits_for_the_copies_in_flight_and_frees_them(log: list[str]) -> None:
    """close() waits for each batch in flight to land, then drops it; the pass is over."""
    batches = prefetch(numbered(5), "meta", depth=2)
    running = iter(batches)
    next(running)

    batches.close()

    assert ["send 0", "send 1", "send 2", "hand over 0", "landed 1", "landed 2"] == log
    assert [] == list(running)


def test_break_frees_the_batches_in_flight(log: list[str]) -> None:
    """A break out of the loop drops the pass, which frees its batches in flight as
    close() does: nothing is held for them after the loop."""
    batches = prefetch(numbered(5), "meta", depth=2)

    for _ in batches:
        break
    gc.collect()

    assert ["send 0", "send 1", "send 2", "hand over 0", "landed 1", "landed 2"] == log


@st.composite
def schedules(draw: st.DrawFn) -> dict[str, Any]:
    """A loader of 0 to 6 generated batches, a depth of 1 to 4, maybe a batch the loader
    fails at, and what the consumer does with each batch: read it, write it, or break."""
    count = draw(st.integers(0, 6))
    structures = draw(st.lists(nested(tensors(devices=["cpu"])), min_size=count, max_size=count))
    return {
        "batches": [{"i": i, "b": b} for i, b in enumerate(structures)],
        "depth": draw(st.integers(1, 4)),
        "raise_at": draw(st.none() | st.integers(0, max(count - 1, 0))),
        "actions": draw(
            st.lists(st.sampled_from(["read", "write", "break"]), min_size=count, max_size=count)
        ),
    }


@given(schedules())
def test_property_lookahead_keeps_order_bound_and_errors(case: dict[str, Any]) -> None:
    """Over generated batches and consumer schedules: each batch handed over is its source
    moved as to_device moves it, in order; no more than depth + 1 batches are ever sent and
    not yet handed over; the loader's error comes exactly in its turn; a break ends it."""
    log: list[str] = []
    raise_at = frozenset() if case["raise_at"] is None else frozenset({case["raise_at"]})
    loader = Reads(case["batches"], log, raise_at)
    original = _prefetch.streams_for
    _prefetch.streams_for = lambda device, **_: Recording(device, log)  # type: ignore[assignment, return-value]
    try:
        batches = prefetch(loader, "meta", depth=case["depth"])
    finally:
        _prefetch.streams_for = original
    handed: list[int] = []
    failed_at = None
    try:
        for batch, action in zip(batches, case["actions"], strict=False):
            expected = case["batches"][batch["i"]]
            assert summary(to_device(expected, "meta")) == summary(batch)
            handed.append(batch["i"])
            if action == "write":
                for _, tensor in iter_tensors(batch):
                    if tensor._base is None:  # a view may overlap itself (an expand)
                        tensor.zero_()
            elif action == "break":
                break
    except KeyError:
        failed_at = len(handed)

    assert list(range(len(handed))) == handed
    if case["raise_at"] is not None and failed_at is not None:
        assert case["raise_at"] == failed_at
    sent = handed_over = 0
    for entry in log:
        sent += entry.startswith("send")
        handed_over += entry.startswith("hand over")
        assert sent - handed_over <= case["depth"] + 1, log


# The stream path, on an accelerator: the emulated one (pytest
# --devicectx-accelerator=emulated) finishes copies late and poisons freed memory, so that
# a batch read before its copies land, or memory reused while a stream still reads it,
# shows as wrong values.

needs_accelerator = pytest.mark.requires_device("accelerator")
needs_emulated = pytest.mark.skipif(
    not emulated.enabled(),
    reason="needs the emulated accelerator's controls: pytest --devicectx-accelerator=emulated",
)


def accelerator(index: int = 0) -> torch.device:
    """Device ``index`` of the accelerator."""
    kind = torch.accelerator.current_accelerator()
    assert kind is not None
    return torch.device(kind.type, index)


def detection_like(i: int, large: bool = False) -> dict[str, Any]:
    """A batch like a detection loader's: images, ids, boxes and labels of varying lengths
    (staged together), with values that tell batch ``i`` apart; a 2 MiB tensor too if
    ``large`` (streamed through the staging chunks)."""
    generator = torch.Generator().manual_seed(i)
    batch: dict[str, Any] = {
        "images": torch.randn(2, 3, 8, 8, generator=generator),
        "ids": torch.tensor([2 * i, 2 * i + 1]),
        "boxes": [torch.rand(k, 4, generator=generator) for k in (1, 3, 2)],
        "labels": [torch.randint(0, 80, (k,), generator=generator) for k in (1, 3, 2)],
    }
    if large:
        batch["features"] = torch.randn(512, 1024, generator=generator)
    return batch


def values(obj: Any) -> list[tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor]]:
    """Each tensor of ``obj`` by path (set members unnumbered), with its shape, strides and
    values on the CPU, sorted by path."""
    return sorted(
        ((re.sub(r"\)\[\d+\]", ")[_]", path), tuple(t.shape), t.stride(), t.detach().cpu())
         for path, t in iter_tensors(obj, "batch")),
        key=lambda item: (*item[:3], content(item[3])),
    )  # fmt: skip


def content(tensor: torch.Tensor) -> tuple[str, str]:
    """A sort key from a tensor's dtype and values: it orders set members, whose paths,
    shapes and strides may tie and whose iteration order follows their hashes."""
    return str(tensor.dtype), repr(tensor.detach().cpu().tolist())


def assert_same(expected: Any, actual: Any) -> None:
    """Same paths, devices, dtypes, shapes, strides and values (NaN equal to NaN)."""
    left, right = values(expected), values(actual)
    assert [item[:3] for item in left] == [item[:3] for item in right]
    for (path, *_, a), (_, *_, b) in zip(left, right, strict=True):
        assert a.dtype == b.dtype, path
        assert torch.equal(a, b) or (a.is_floating_point() and torch.allclose(
            a, b, rtol=0, atol=0, equal_nan=True)), path  # fmt: skip
    assert summary(expected) == summary(actual)


@needs_accelerator
@pytest.mark.parametrize("large", [False, True])
def test_stream_path_moves_each_batch_as_to_device_does(large: bool) -> None:
    """On an accelerator every batch arrives with the values, dtypes, shapes and strides
    to_device gives it, through a copy stream; the caller's stream and device are as
    they were."""
    device = accelerator()
    sources = [detection_like(i, large) for i in range(5)]
    before = (torch.accelerator.current_stream(device), torch.accelerator.current_device_index())

    batches = prefetch(sources, device, depth=2)
    moved = list(batches)

    assert batches.streams
    for source, batch in zip(sources, moved, strict=True):
        assert_same(to_device(source, device), batch)
    assert before == (
        torch.accelerator.current_stream(device),
        torch.accelerator.current_device_index(),
    )


@needs_accelerator
def test_another_device_keeps_the_current_index() -> None:
    """Prefetching to device 1 leaves device 0 current, and lands on device 1."""
    if torch.accelerator.device_count() < 2:
        pytest.skip("needs two devices")
    index = torch.accelerator.current_device_index()

    moved = list(prefetch([detection_like(i) for i in range(3)], accelerator(1)))

    assert index == torch.accelerator.current_device_index()
    assert {accelerator(1)} == {t.device for b in moved for _, t in iter_tensors(b)}


@needs_emulated
def test_hand_over_does_not_wait_on_the_host() -> None:
    """Batches are handed over while their copies are still held back: the host never
    waits for them (a wait on a paused stream would raise); the caller's stream does,
    so the batch is right when read."""
    device = accelerator()
    sources = [detection_like(i) for i in range(4)]
    batches = prefetch(sources, device, depth=2)
    running = iter(batches)

    with emulated.paused(device, stream=batches._streams.copy):
        first = next(running)
        second = next(running)

    assert_same(to_device(sources[0], device), first)
    assert_same(to_device(sources[1], device), second)


def nonempty(batch: Any) -> list[torch.Tensor]:
    """The tensors of ``batch`` with at least one element, in the structure's order."""
    return [t for _, t in iter_tensors(batch) if t.numel()]


def late_read(held: list[Any], device: torch.device) -> list[torch.Tensor]:
    """Queue a copy of each tensor of the batch in ``held`` (its only reference) to the
    host on the caller's stream, drop the batch while those copies are held back, then let
    them run: the values they read, which are poison if its memory was freed under them.
    Empty tensors are left out: they have no memory (and the emulator copies them at once,
    which waits for the held-back stream)."""
    stream = torch.accelerator.current_stream(device)
    with emulated.paused(device, stream=stream):
        copies = [t.to("cpu", non_blocking=True) for t in nonempty(held[0])]
        alive = [weakref.ref(t) for _, t in iter_tensors(held[0])]
        held.clear()
        if any(ref() is not None for ref in alive):  # held in a cycle: a collection frees it
            gc.collect()
    torch.accelerator.synchronize()
    return copies


@needs_emulated
def test_memory_of_a_dropped_batch_waits_for_the_callers_stream() -> None:
    """A batch dropped while the caller's stream still reads it keeps its memory until
    that stream has run past: the late reads see the batch, not the poison freed memory
    is filled with."""
    device = accelerator()
    sources = [detection_like(i) for i in range(3)]
    running = iter(prefetch(sources, device))

    copies = late_read([next(running)], device)

    expected = nonempty(sources[0])
    assert len(expected) == len(copies)
    assert all(torch.equal(a, b) for a, b in zip(expected, copies, strict=True))


@needs_emulated
@pytest.mark.parametrize("left_out", ["record_stream", "wait_event"])
def test_the_emulator_catches_a_hand_over_that_leaves_a_step_out(
    monkeypatch: pytest.MonkeyPatch, left_out: str
) -> None:
    """The checks above can fail: without record_stream (of the results, and of the
    staged regions their storages are slices of) the late reads see poison; without the
    wait, the batch is read before its copies land."""

    def hand_over(self: _prefetch.Streams, token: Any) -> Any:
        moved, sent = token.take()
        if left_out == "record_stream":
            torch.accelerator.current_stream(self.device).wait_event(sent.event)
        return moved

    def record(self: _prefetch.Streams, batch: Any, regions: Any, stream: Any) -> None:
        pass

    monkeypatch.setattr(_prefetch.Streams, "hand_over", hand_over)
    monkeypatch.setattr(_prefetch.Streams, "_record", record)
    device = accelerator()
    sources = [detection_like(i) for i in range(3)]
    # Copies that land 300 ms late: a loaded machine takes more than the default 2 ms
    # between the copy's queueing and the read, which then finds it landed.
    with emulated.configure(delay_ms=300):
        running = iter(prefetch(sources, device))
        held = [next(running)]
        read_now = held[0]["ids"].cpu()
        copies = late_read(held, device)

    assert any(torch.isnan(copy).any() or (copy == -1).any() for copy in copies)
    if left_out == "wait_event":
        assert not torch.equal(sources[0]["ids"], read_now)


def moved_ahead(batches: _prefetch.Prefetcher[Any]) -> None:
    """Wait until the prefetcher's thread has run every move sent so far."""
    assert batches._streams is not None
    batches._streams.worker.submit(int).take()


@needs_emulated
@pytest.mark.parametrize("how", ["close", "break"])
def test_close_and_break_free_the_batches_in_flight(how: str) -> None:
    """close(), or a break out of the loop, frees the device memory of the batches in
    flight; the batch handed over stays the caller's until dropped."""
    device = accelerator()
    torch.accelerator.synchronize()
    gc.collect()
    base = emulated.memory_allocated(device)
    one = to_device(detection_like(0), device)
    per_batch = emulated.memory_allocated(device) - base
    del one
    batches = prefetch([detection_like(i) for i in range(6)], device, depth=3)

    if how == "close":
        running = iter(batches)
        kept = next(running)
        moved_ahead(batches)
        in_flight = emulated.memory_allocated(device) - base
        batches.close()
    else:
        for batch in batches:
            kept = batch
            moved_ahead(batches)
            in_flight = emulated.memory_allocated(device) - base
            break
        del batch
    gc.collect()
    after = emulated.memory_allocated(device) - base
    del kept
    gc.collect()

    assert (4 * per_batch, per_batch, 0) == (
        in_flight,
        after,
        emulated.memory_allocated(device) - base,
    )


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """The cyclic garbage collector off for the block: what is freed is freed by counts."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@needs_emulated
@pytest.mark.parametrize("how", ["dropped", "closed"])
def test_a_prefetcher_over_a_generator_frees_its_batches_without_the_collector(how: str) -> None:
    """Over a generator (whose one pass the prefetcher holds), dropping the prefetcher
    and its pass frees the batches in flight at once, without the cyclic collector."""
    device = accelerator()
    sources = [detection_like(i, large=True) for i in range(5)]
    torch.accelerator.synchronize()
    with collector_off():
        base = emulated.memory_allocated(device)
        batches = prefetch((batch for batch in sources), device, depth=3)
        running = iter(batches)
        kept = next(running)
        in_flight = emulated.memory_allocated(device) - base
        if how == "closed":
            batches.close()
        del batches, running, kept
        torch.accelerator.synchronize()
        after = emulated.memory_allocated(device) - base

    assert in_flight > 0
    assert 0 == after


@needs_emulated
def test_close_frees_the_batches_ahead_of_a_loader_error_without_the_collector() -> None:
    """With a loader error read ahead (its traceback holds the frames that read it, and
    so the pass), close() frees the batches in flight at once, without the collector."""
    device = accelerator()
    sources = [detection_like(i, large=True) for i in range(5)]
    torch.accelerator.synchronize()
    with collector_off():
        base = emulated.memory_allocated(device)
        batches = prefetch(Reads(sources, [], frozenset({3})), device, depth=3)
        next(iter(batches))
        moved_ahead(batches)
        in_flight = emulated.memory_allocated(device) - base
        batches.close()
        torch.accelerator.synchronize()
        after = emulated.memory_allocated(device) - base

    assert in_flight > 0
    assert 0 == after


@needs_emulated
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a CUDA GPU is present: the emulated memory limit is refused here",
)
def test_a_batch_past_the_device_memory_is_torchs_out_of_memory_error_in_its_turn() -> None:
    """A batch that does not fit on the device raises, in its turn, an error that is both
    torch.OutOfMemoryError and MoveError, naming the batch and the path inside it."""
    device = accelerator()
    batches = [*numbered(2), {"i": 2, "x": torch.ones(2**21)}]  # 8 MiB
    seen: list[int] = []
    torch.accelerator.synchronize()
    gc.collect()
    room = emulated.memory_allocated(device) + 4 * 2**20

    with emulated.configure(memory_limit=room), pytest.raises(torch.OutOfMemoryError) as raised:
        seen.extend(batch["i"] for batch in prefetch(batches, device))

    assert [0, 1] == seen
    assert isinstance(raised.value, MoveError)
    assert str(raised.value).startswith(
        "prefetch() at batch 2 could not move batch['x'] (a Tensor of shape (2097152,), "
    )


@needs_emulated
def test_the_callers_stream_waits_for_a_batch_whose_copies_are_held() -> None:
    """A batch is handed over while its copies are held back on the copy stream: the
    host does not wait for them, the caller's stream does (waiting for it then waits for
    the held copies, which the emulator refuses, as it would hang)."""
    device = accelerator()
    sources = [detection_like(i) for i in range(3)]
    batches = prefetch(sources, device, depth=2)
    caller = torch.accelerator.current_stream(device)
    caller.synchronize()
    with emulated.paused(device, stream=_streams.copy_stream(device)):
        first = next(iter(batches))
        with pytest.raises(RuntimeError, match="paused"):
            caller.synchronize()
    torch.accelerator.synchronize()
    assert_same(to_device(sources[0], device), first)


@needs_emulated
def test_a_batch_handed_to_another_stream_is_safe_there() -> None:
    """A batch sent while one stream was current and handed over while another is: its
    memory, the staged regions of its small tensors included, is recorded as used on the
    stream it is handed to, so reads queued there and the batch dropped still read it."""
    device = accelerator()
    sources = [detection_like(i) for i in range(3)]
    running = iter(prefetch(sources, device, depth=1))
    next(running)  # batches 0 and 1 sent while the default stream was current
    other = torch.Stream(device=device)
    default = torch.accelerator.current_stream(device)
    torch.accelerator.set_stream(other)
    try:
        copies = late_read([next(running)], device)
    finally:
        torch.accelerator.set_stream(default)

    expected = nonempty(sources[1])
    assert len(expected) == len(copies)
    assert all(torch.equal(a, b) for a, b in zip(expected, copies, strict=True))


@needs_emulated
def test_pinned_small_tensors_are_staged_while_the_callers_stream_is_idle() -> None:
    """Small pinned tensors are packed by the staged move whenever the caller's stream is
    idle (nothing queued there can still be writing them), however busy the copy stream
    is: here held back with the copies of the batches sent before."""
    device = accelerator()
    sources = [{"labels": [torch.full((5,), i).pin_memory() for _ in range(16)]} for i in range(4)]
    torch.accelerator.synchronize()
    batches = prefetch(sources, device, depth=3)
    with staged_counts() as staged, emulated.paused(device, stream=_streams.copy_stream(device)):
        first = next(iter(batches))  # sends all four, then hands the first over
    torch.accelerator.synchronize()

    assert [16] * 4 == staged
    assert_same(to_device(sources[0], device), first)


@needs_emulated
def test_copies_of_pageable_batches_run_beside_the_callers_queued_work() -> None:
    """With the caller's stream held back behind queued work, the batches of pageable
    tensors are moved ahead all the same: their copies on the copy stream do not wait
    for the caller's stream (waiting for the copy stream does not wait for it)."""
    device = accelerator()
    sources = [detection_like(i, large=True) for i in range(3)]
    caller = torch.accelerator.current_stream(device)
    batches = prefetch(sources, device, depth=2)
    with step_ahead(caller):
        first = next(iter(batches))
        _streams.copy_stream(device).synchronize()  # all three batches' copies landed
    torch.accelerator.synchronize()
    assert_same(to_device(sources[0], device), first)


@needs_emulated
def test_a_device_without_events_moves_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device whose events fail gets no copy stream: batches move in order, as asked.
    (Its copy stream, and its staging, which events fail too, are worked out afresh.)"""
    device = accelerator()
    monkeypatch.setattr(_streams, "_STREAMS", {})
    with swapped(StagingState()), emulated.configure(events=False):
        batches = prefetch([detection_like(i) for i in range(3)], device)
        moved = list(batches)
    assert not batches.streams
    assert_same(to_device(detection_like(2), device), moved[2])


@needs_accelerator
def test_staging_memory_stays_bounded_and_reported() -> None:
    """Large batches ahead, more than the staging pool holds, use at most the pool's
    bound of pinned memory, and staging_memory() reports what is held."""
    device = accelerator()
    sources = [{"x": torch.randn(4096, 1024), "i": i} for i in range(8)]  # 16 MiB each

    for batch in prefetch(sources, device, depth=4):
        held = staging_memory()
        assert 0 < held <= _staging.THRESHOLDS.pool_bytes
        assert batch["x"].device == device


@needs_accelerator
def test_stream_path_records_transfers_at_the_prefetch_line() -> None:
    """On the stream path too, track_transfers names the line that called prefetch."""
    device = accelerator()
    line = inspect.currentframe().f_lineno + 3  # type: ignore[union-attr]
    place = f"{_repeats._short(__file__)}:{line}"
    with track_transfers() as transfers:
        batches = prefetch([detection_like(i) for i in range(3)], device)
        for _ in batches:
            pass

    assert {place} == {row.where for row in transfers.rows}
    assert {(CPU, device)} == set(transfers.directions())
    assert 3 * 8 == transfers.total_tensors


@needs_accelerator
def test_stream_path_raises_in_turn() -> None:
    """On the stream path, a loader error and a batch that cannot be moved are raised
    when their batch is asked for, after the batches before them."""
    device = accelerator()
    log: list[str] = []
    sources = [detection_like(0), {"odd": Unmovable(torch.zeros(1))}, *map(detection_like, (2, 3))]
    running = iter(prefetch(Reads(sources, log, frozenset({3})), device, depth=3))

    first = next(running)
    with pytest.raises(MoveError, match=r"prefetch\(\) at batch 1 could not move"):
        next(running)
    third = next(running)
    with pytest.raises(KeyError, match="sample 3") as raised:
        next(running)

    last = raised.traceback[-1]  # the loader's own frame, where it raised
    assert ("__next__", __file__) == (last.name, str(last.path))
    assert_same(to_device(sources[0], device), first)
    assert_same(to_device(sources[2], device), third)


@st.composite
def consumer_cases(draw: st.DrawFn) -> dict[str, Any]:
    """Batches from the strategies, a depth of 1 to 4, maybe a batch the loader fails at,
    and per batch what the caller does: read it, write it, read it late (a copy queued on
    its stream, then the batch dropped), or break."""
    count = draw(st.integers(0, 5))
    leaves = tensors(devices=["cpu"])
    structures = draw(st.lists(nested(leaves), min_size=count, max_size=count))
    return {
        "sources": [{"i": i, "b": b, "pad": detection_like(i)} for i, b in enumerate(structures)],
        "depth": draw(st.integers(1, 4)),
        "raise_at": draw(st.none() | st.integers(0, max(count - 1, 0))),
        "actions": draw(
            st.lists(
                st.sampled_from(["read", "write", "late", "break"]), min_size=count, max_size=count
            )
        ),
    }


def same_shaped_set_members() -> dict[str, Any]:
    """A case CI found: set members alike in path, shape and stride, unlike in value."""
    members = [frozenset(torch.full((2,), float(i + k)) for i in range(6)) for k in (0, 10)]
    return {
        "sources": [{"i": i, "b": b, "pad": detection_like(i)} for i, b in enumerate(members)],
        "depth": 1,
        "raise_at": None,
        "actions": ["read", "late"],
    }


@needs_emulated
@given(consumer_cases())
@example(same_shaped_set_members())
def test_property_every_batch_is_its_source_moved_and_no_memory_is_reused_early(
    case: dict[str, Any],
) -> None:
    """Over generated batches, depths and consumer schedules on the emulated accelerator:
    every batch the caller sees equals its source moved with to_device (values, dtypes,
    shapes, strides, paths), whatever the caller did to the batches before it; memory of
    a dropped batch is not reused while the caller's stream still reads it; the loader's
    error comes in its turn."""
    device = accelerator()
    raise_at = frozenset() if case["raise_at"] is None else frozenset({case["raise_at"]})
    loader = Reads(case["sources"], [], raise_at)
    handed: list[int] = []
    running = iter(prefetch(loader, device, depth=case["depth"]))
    try:
        for action in case["actions"]:
            held = [next(running, None)]  # the batch's only reference, for "late"
            if held[0] is None:
                break
            source = case["sources"][held[0]["i"]]
            handed.append(held[0]["i"])
            if action == "late":
                # Sorted by value: set members come in the order of their hashes.
                expected = sorted(nonempty(source), key=content)
                copies = sorted(late_read(held, device), key=content)
                for want, got in zip(expected, copies, strict=True):
                    assert torch.equal(want, got) or torch.allclose(
                        want, got, rtol=0, atol=0, equal_nan=True
                    )
                continue
            assert_same(to_device(source, device), held[0])
            if action == "write":
                for _, tensor in iter_tensors(held[0]):
                    if tensor._base is None:
                        tensor.zero_()
            elif action == "break":
                break
    except KeyError:
        assert case["raise_at"] == len(handed)
    assert list(range(len(handed))) == handed


@needs_accelerator
def test_a_repeated_move_warning_points_at_the_prefetch_line() -> None:
    """The batches' moves run on the prefetcher's thread; their repeated-move warning is
    given at the line that called prefetch, so filters on the user's module apply."""
    batch = {"x": torch.ones(8, 4)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        for _ in prefetch([batch] * 4, accelerator()):
            pass
    (warning,) = [w for w in caught if issubclass(w.category, RepeatedMoveWarning)]
    assert (__file__, line) == (warning.filename, warning.lineno)
    assert str(warning.message).startswith(f"{_repeats._short(__file__)}:{line} copied")


def refilled(layout: str, steps: int, pinned: bool = False) -> Iterator[dict[str, Any]]:
    """A loader that refills one set of host buffers for each batch it yields (a ring
    buffer, a replay reader)."""
    sizes = {"one small": [1_000], "many small": [16] * 8, "large": [1 << 20, 4]}[layout]
    buffers = [torch.zeros(size, pin_memory=pinned) for size in sizes]
    for step in range(steps):
        for buffer in buffers:
            buffer.fill_(step)
        yield {"step": step, "x": buffers}


@needs_accelerator
@settings(max_examples=20, deadline=None)
@given(
    st.sampled_from(["one small", "many small", "large"]),
    st.integers(min_value=1, max_value=3),
    st.integers(min_value=2, max_value=6),
    st.booleans(),
)
def test_property_a_loader_may_refill_its_buffers_at_once(
    layout: str, depth: int, steps: int, pinned: bool
) -> None:
    """A loader that reuses one host buffer per batch (refilled when read again), pageable
    or pinned, hands over batches that each hold their own step's values, at any depth:
    the loader is read again only once the last batch's sources have been read, by its
    move (pageable ones, staged) or by its copies (pinned ones, which may be copied
    directly: on the emulated device, whose copies land late, batch k carried batch
    k + depth's values)."""
    device = accelerator()
    for batch in prefetch(refilled(layout, steps, pinned), device, depth=depth):
        values = {float(tensor.min()) for tensor in batch["x"]}
        values |= {float(tensor.max()) for tensor in batch["x"]}
        assert {float(batch["step"])} == values


@needs_accelerator
def test_a_source_the_callers_stream_still_writes_is_read_after_it() -> None:
    """A pinned source filled by a copy still queued on the caller's stream
    (``x.to("cpu", non_blocking=True)``) arrives as that copy leaves it: the copy stream
    waits for the caller's stream where a batch has such a source."""
    device = accelerator()
    x = torch.arange(8.0, device=device)
    for _ in range(3):  # work queued ahead of the copy
        x = (x * 1.0).contiguous()
    pending = x.to("cpu", non_blocking=True)
    batch = {"y": pending, "small": [torch.full((1,), float(i)) for i in range(4)]}
    (moved,) = list(prefetch([batch], device))
    torch.accelerator.synchronize()
    assert list(range(8)) == moved["y"].cpu().tolist()


def test_pageable_batches_need_no_wait_for_the_callers_stream() -> None:
    """Only a batch with a source on a device, or pinned, makes the copies wait for the
    caller's stream: pageable host tensors are read by the host alone."""
    assert not _prefetch._written_by_streams({"x": torch.ones(2), "ids": [torch.zeros(3)]})
    assert _prefetch._written_by_streams({"x": torch.ones(2), "m": torch.ones(2, device="meta")})


class Pinnable(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Batches of host tensors, larger than a staged move packs (copied with ``.to``)."""

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((64, 1024), float(index)), "i": torch.tensor(index)}


@needs_emulated
@pytest.mark.parametrize("source", ["DataLoader(pin_memory=True, num_workers=1)", "pinned"])
def test_pinned_batches_a_dataloader_pins_do_not_wait_for_the_callers_stream(
    source: str,
) -> None:
    """A DataLoader with workers pins each batch on the host, in its pin-memory thread:
    their copies start at once, beside the work queued on the caller's stream (its copy
    stream can finish while that work is held back). Batches pinned elsewhere may still
    be filled by a copy queued there: theirs wait for it."""
    device = accelerator()
    if source == "pinned":
        loader: Any = [{k: v.pin_memory() for k, v in Pinnable()[i].items()} for i in range(3)]
    else:
        loader = DataLoader(Pinnable(), batch_size=None, num_workers=1, pin_memory=True)
    copies = _streams.copy_stream(device)
    assert copies is not None
    batches = iter(prefetch(loader, device, depth=1))
    if source == "pinned":
        # Before the loader is read again, the host waits for the copies of a pinned batch
        # (the loader may refill its memory), which wait for the caller's stream: held back
        # here, the emulated device says the host would wait for ever.
        busy = step_ahead(torch.accelerator.current_stream(device))
        with busy, pytest.raises(RuntimeError, match="is paused"):
            next(batches)
        batches.close()  # type: ignore[attr-defined]
        return
    with step_ahead(torch.accelerator.current_stream(device)):  # the caller's stream busy
        first = next(batches)
        assert first["x"].device == device
        copies.synchronize()  # landed while the caller's stream is held back
    torch.accelerator.synchronize()
    assert [0.0, 1.0, 2.0] == [first["x"][0, 0].item()] + [b["x"][0, 0].item() for b in batches]


def test_which_loaders_pin_on_the_host() -> None:
    """Only a DataLoader with pin_memory=True and workers is known to pin its batches on
    the host; without workers, a dataset's own pinned tensor is handed out as it is."""
    data = Pinnable()
    assert _prefetch._pins_on_the_host(DataLoader(data, num_workers=2, pin_memory=True))
    assert not _prefetch._pins_on_the_host(DataLoader(data, num_workers=0, pin_memory=True))
    assert not _prefetch._pins_on_the_host(DataLoader(data, num_workers=2))
    assert not _prefetch._pins_on_the_host([data[0]])
    meta = {"x": torch.ones(2), "m": torch.ones(2, device="meta")}
    assert _prefetch._written_by_streams(meta, pinned_when_read=True)


@needs_emulated
def test_a_source_another_current_stream_still_writes_is_read_after_it() -> None:
    """Where the caller computes on a stream of its own, the copies of a batch with a
    source that stream still fills wait for it (the stream current at next(), not the
    default one of the thread that moves the batches)."""
    device = accelerator()
    x = torch.arange(8.0, device=device)
    mine = torch.Stream(device=device)
    with _streams.queued_on(mine, device):
        with emulated.paused(device, stream=mine):
            pending = (x * 1.0).to("cpu", non_blocking=True)  # lands once mine runs
            batch = {"y": pending, "small": [torch.full((1,), float(i)) for i in range(4)]}
            batches = iter(prefetch([batch], device))
            # Before reading the loader again, the host waits for the batch's copy of its
            # pinned source, which waits for mine: held back, the emulated device says so.
            with pytest.raises(RuntimeError, match="is paused"):
                next(batches)
        (moved,) = list(batches)
        torch.accelerator.synchronize()
        assert list(range(8)) == moved["y"].cpu().tolist()


@pytest.fixture
def mover_threads(monkeypatch: pytest.MonkeyPatch) -> list[threading.Thread]:
    """The thread of each batch a prefetcher moves, in order, for the test to look at."""
    threads: list[threading.Thread] = []
    move = _prefetch._move_batch

    def spied(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread())
        return move(*args, **kwargs)

    monkeypatch.setattr(_prefetch, "_move_batch", spied)
    return threads


@needs_emulated
def test_a_pass_whose_loader_raised_is_freed_without_the_collector(
    mover_threads: list[threading.Thread],
) -> None:
    """A loader's error raised in its turn and handled: once the caller lets go, the pass
    and its thread go too, without the cyclic collector (the error's traceback holds the
    frame that read it, which held the error: a cycle)."""
    device = accelerator()
    threads = mover_threads

    def requests() -> Iterator[dict[str, torch.Tensor]]:
        yield {"x": torch.ones(1)}
        raise ValueError("a bad request")

    with collector_off():
        with pytest.raises(ValueError, match="a bad request"):
            for _ in prefetch(requests(), device):
                pass
        (thread,) = set(threads)
        thread.join(timeout=60)
    assert not thread.is_alive()


@needs_emulated
@pytest.mark.parametrize("end", ["close", "drop"])
def test_batches_are_moved_on_a_thread_of_their_own_which_ends_with_the_prefetcher(
    mover_threads: list[threading.Thread], end: str
) -> None:
    """With streams, every batch is moved on one thread of the prefetcher's own, not the
    caller's, with the caller's context; close(), or dropping the prefetcher, ends it."""
    device = accelerator()
    threads = mover_threads
    with track_transfers() as transfers:
        batches = prefetch([detection_like(i) for i in range(4)], device, depth=2)
        for _ in batches:
            pass

    assert 1 == len(set(threads))
    (thread,) = set(threads)
    assert thread is not threading.current_thread()
    assert 4 == len(threads)
    assert 4 * 8 == transfers.total_tensors  # counted in the caller's log
    with collector_off():  # dropped: freed by counts, no cycle holds the thread
        if end == "close":
            batches.close()
        else:
            del batches
        thread.join(timeout=60)
    assert not thread.is_alive()


class _OwnBatch:
    """A collate_fn's batch type the move cannot look into: no .to, not registered."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


def _first_batch_warnings(
    batches: Any, device: Any, **options: Any
) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in prefetch(batches, device, **options):  # _PREFETCH_LINE
            pass
    return [w for w in caught if w.category is DeviceWarning]


_PREFETCH_LINE = next(
    number
    for number, line in enumerate(Path(__file__).read_text().split("\n"), start=1)
    if line.endswith("# _PREFETCH_LINE") and "prefetch(" in line
)


@pytest.mark.parametrize(
    ("skip", "meant"),
    [(["obj['meta']"], "batch['meta']"), (["batch['mta']"], "batch['meta']"), (["mta"], "meta")],
)
def test_a_skip_entry_naming_nothing_in_the_first_batch_is_warned_of(
    skip: list[str], meant: str
) -> None:
    """prefetch warns of skip= entries that name nothing in the first batch, as to_device
    does, once, at the line that called prefetch, with the entry it likely meant; the fix
    applied leaves the entry where it is."""
    batches = [{"x": torch.ones(2), "meta": torch.zeros(())} for _ in range(3)]
    (warning,) = _first_batch_warnings(batches, "meta", skip=skip)
    assert (__file__, _PREFETCH_LINE) == (warning.filename, warning.lineno)
    text = str(warning.message)
    assert text.startswith("prefetch(): skip= entries name nothing in batch")
    assert text.endswith(f"fix: skip=[{meant!r}]")
    assert [] == _first_batch_warnings(batches, "meta", skip=[meant])
    assert all(b["meta"].is_cpu for b in prefetch(batches, "meta", skip=[meant]))


def test_batches_of_numpy_arrays_alone_are_warned_of_at_the_first() -> None:
    """Batches of numpy arrays (a replay buffer sampled with numpy) come back as they were:
    prefetch says at the first batch that nothing moved, at the line that called it; the
    fix, applied, moves them."""
    import numpy as np

    batches = [{"obs": np.zeros((2, 4), np.float32), "reward": np.ones(2)} for _ in range(3)]
    (warning,) = _first_batch_warnings(batches, "meta")
    assert (__file__, _PREFETCH_LINE) == (warning.filename, warning.lineno)
    assert (
        "prefetch() at its first batch got numpy arrays and no tensor (batch['obs'], "
        "batch['reward']): a move takes tensors and leaves every other object as it is, so "
        "nothing went to meta\n"
        "fix: make them tensors where the batches are made: torch.as_tensor(array) in the "
        "loader's collate_fn (a DataLoader's default collate_fn does it), or around the "
        "sampler's arrays"
    ) == str(warning.message)
    made = [{k: torch.as_tensor(v) for k, v in b.items()} for b in batches]
    assert [] == _first_batch_warnings(made, "meta")
    assert all(b["obs"].is_meta for b in prefetch(made, "meta"))


def test_tensors_the_move_cannot_see_in_the_first_batch_are_warned_of() -> None:
    """A batch of a type the move cannot look into keeps its tensors where the loader made
    them: prefetch says so once, naming them and the type, with a fix that, applied,
    moves them."""
    batches = [_OwnBatch(torch.ones(2)) for _ in range(3)]
    (warning,) = _first_batch_warnings(batches, "meta")
    text = str(warning.message)
    assert text.startswith("prefetch() left batch.x (on cpu) where the loader made it, in every")
    assert "the move does not look inside a _OwnBatch" in text
    fix = text.split("\nfix: ", 1)[1]
    code = fix.split(", or give ", 1)[0]
    assert "as an argument" not in fix
    try:
        exec(code, {"register_container": register_container, "_OwnBatch": _OwnBatch})
        assert [] == _first_batch_warnings(batches, "meta")
        assert all(b.x.is_meta for b in prefetch(batches, "meta"))
    finally:
        unregister_container(_OwnBatch)
