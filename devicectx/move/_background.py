"""A thread of its own that runs jobs in order, each result taken once: where
:func:`devicectx.prefetch` moves its batches, off the training thread.

:meth:`Worker.submit` queues a job and returns a :class:`Ticket`, which the caller redeems
with :meth:`Ticket.take`: the job's result, or its exception raised.
Unlike ``concurrent.futures``, whose worker frames still hold a result for a moment after
handing it over, the thread lets go of a job, its arguments and its result before it says
the job is done: a result that holds memory (a batch on a device) is freed the moment its
taker drops it, which the callers' tests of freed memory rely on.

The thread is started at the first job, is a daemon (as a ``DataLoader``'s pin-memory
thread is: an idle one never holds up the interpreter's exit), and ends after the jobs
queued before :meth:`Worker.stop`, or once its :class:`Worker` is garbage.

Example:
    >>> worker = Worker("example")
    >>> ticket = worker.submit(sum, [1, 2, 3])
    >>> ticket.take()
    6
    >>> worker.stop()
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["Ticket", "Worker"]

_STOP = None  # the sentinel that ends a thread's loop


class Ticket:
    """A job's result or exception, once the job has run; redeemed once."""

    __slots__ = ("_done", "_error", "_value")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def wait(self) -> None:
        """Wait for the job to have run, leaving its result (or exception) to :meth:`take`."""
        self._done.wait()

    def peek(self) -> Any:
        """The job's result, left for :meth:`take`; None where it raised or was taken."""
        self._done.wait()
        return self._value

    def take(self) -> Any:
        """Wait for the job; its result, or its exception raised. The ticket lets go of
        either: a second take returns None."""
        self._done.wait()
        error, self._error = self._error, None
        if error is not None:
            try:
                raise error
            finally:
                del error  # the traceback would hold this frame, and this frame the error
        value, self._value = self._value, None
        return value


class Worker:
    """One thread, started at the first job, that runs the jobs submitted in order."""

    __slots__ = ("__weakref__", "_jobs", "_thread", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[Any] | None = None
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[..., Any], *args: Any) -> Ticket:
        """Queue ``job(*args)``, to run after the jobs queued before it."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(
                target=_run, args=(self._jobs,), name=self.name, daemon=True
            )
            self._thread.start()
            # Garbage without a stop: the thread still ends, after the jobs queued.
            weakref.finalize(self, self._jobs.put, _STOP)
        ticket = Ticket()
        self._jobs.put((ticket, job, args))
        return ticket

    def stop(self) -> None:
        """End the thread after the jobs queued so far; a later job starts a new one."""
        if self._jobs is not None:
            self._jobs.put(_STOP)
        self._jobs = self._thread = None

    def here(self) -> bool:
        """Whether the caller runs on this worker's thread (where waiting for one of its
        own jobs would never end)."""
        return self._thread is not None and threading.current_thread() is self._thread


def _run(jobs: queue.SimpleQueue[Any]) -> None:
    """The thread's loop. It holds no reference to a job once the job's ticket says done."""
    while True:
        item = jobs.get()
        if item is _STOP:
            return
        ticket, job, args = item
        item = None
        try:
            ticket._value = job(*args)
        except BaseException as error:  # handed to the ticket's taker, raised there
            ticket._error = error
        job = args = None
        ticket._done.set()
        ticket = None
