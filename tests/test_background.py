"""The thread prefetch moves batches on: jobs in order, results taken once, nothing kept."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
from hypothesis import given
from hypothesis import strategies as st

from devicectx.move._background import Worker


class Payload:
    """A result that can be watched for being freed."""


@given(st.lists(st.integers(), max_size=20))
def test_jobs_run_in_order_on_one_thread_not_the_callers(values: list[int]) -> None:
    """Each job runs after those submitted before it, all on the worker's one thread."""
    worker = Worker("test-order")
    seen: list[tuple[int, threading.Thread]] = []
    try:
        tickets = [
            worker.submit(lambda v: seen.append((v, threading.current_thread())) or v, value)
            for value in values
        ]
        assert values == [ticket.take() for ticket in tickets]
    finally:
        worker.stop()
    assert values == [value for value, _ in seen]
    assert len({thread for _, thread in seen}) <= 1
    assert threading.current_thread() not in {thread for _, thread in seen}


def test_an_error_is_raised_at_take_and_the_thread_goes_on() -> None:
    """A job's exception is raised by its ticket's take, once; later jobs still run."""
    worker = Worker("test-error")

    def fail() -> None:
        raise KeyError("missing")

    failed = worker.submit(fail)
    after = worker.submit(int, "7")
    with pytest.raises(KeyError, match="missing"):
        failed.take()
    assert failed.take() is None
    assert 7 == after.take()
    worker.stop()


def test_a_result_is_freed_once_its_taker_lets_go() -> None:
    """Once a ticket is taken and the value dropped, nothing else holds the result: not
    the ticket, not the thread (freed by counts, without the collector)."""
    worker = Worker("test-free")
    gc.disable()
    try:
        value = worker.submit(Payload).take()
        watched = weakref.ref(value)
        del value
        assert watched() is None
    finally:
        gc.enable()
        worker.stop()


def test_stop_ends_the_thread_and_a_later_job_starts_another() -> None:
    """stop() ends the thread after the jobs queued; the next job starts a new one."""
    worker = Worker("test-stop")
    first = worker.submit(threading.current_thread).take()
    worker.stop()
    first.join(timeout=60)
    second = worker.submit(threading.current_thread).take()
    worker.stop()
    assert not first.is_alive()
    assert first is not second


def test_a_dropped_worker_ends_its_thread() -> None:
    """A worker that is garbage ends its thread, with no stop."""
    worker = Worker("test-dropped")
    thread = worker.submit(threading.current_thread).take()
    del worker
    thread.join(timeout=60)
    assert not thread.is_alive()


def test_here_says_whether_the_caller_is_on_the_thread() -> None:
    """here() is True on the worker's thread only."""
    worker = Worker("test-here")
    assert not worker.here()
    assert worker.submit(worker.here).take()
    assert not worker.here()
    worker.stop()
