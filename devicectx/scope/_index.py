"""The accelerator's current index under the scopes: per thread, as torch keeps it.

``.cuda()``, ``"cuda"``, streams and ``synchronize()`` follow the current index, which torch
(CUDA's runtime) keeps per thread; torch's own ``with torch.device("cuda:1")`` leaves it as it
is. A block on a device of an accelerator with several (``cuda:1``) keeps the index in step
with its device:

- Which devices those are (an indexed device of torch's accelerator, where it has more
  than one) is asked of torch once per device, at the first scope on it
  (:func:`learn_index_reader`), and kept in :data:`INDEX_READERS`.
- In the thread that enters it, it makes its index current at entry where it is not, and
  gives the old one back at exit (:mod:`devicectx.scope._stack`). The blocks of asyncio
  tasks sharing a thread close in any order: each thread lists its open blocks that changed
  the index, in the order entered, and one that closes before a block entered after it
  hands what it would give back on to that one (:func:`left_out_of_order`), so that the
  last to close gives back the index the thread had before the first.
- In another thread that runs code in a copy of its context (``asyncio.to_thread``,
  ``contextvars.copy_context().run`` in a thread or a ``concurrent.futures`` pool), no
  code of devicectx runs when the job starts. The index follows at the first call there
  that reads the scope (a constructor without ``device=``, ``torch.get_default_device()``,
  ``current_device()``, a decorated call, a block entered): :func:`follow`. The thread
  has its own index back when the job ends (a ``concurrent.futures`` job:
  ``asyncio.to_thread``'s, ``pool.submit``'s), before its next job; elsewhere (a thread
  of one's own that runs jobs in turn) the index stays until the thread follows another
  block, or ends. A job that reads the index before any such call (``.cuda()`` first)
  finds the thread's own.
- ``loop.run_in_executor(None, fn)`` copies no context: ``fn`` sees no block and keeps its
  thread's index, as a thread started inside a block does.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from devicectx.devices._resolve import accelerator_type

if TYPE_CHECKING:
    from devicectx.scope._stack import Block

__all__ = [
    "INDEX_READERS",
    "ThreadIndex",
    "follow",
    "index_reader_of",
    "learn_index_reader",
    "left_out_of_order",
]

INDEX_READERS: dict[torch.device, object] = {}
"""For each device met, how to read the current index of its type where a scope may have to
change it, else None (:func:`index_reader_of`). Keyed by the device, not its type:
``device.type`` builds a new string each time, a large part of a decorated call's scope,
and a device's hash is cheap. Asked once per device: the answer changes only when a
PrivateUse1 backend registers (the emulated accelerator's ``enable()`` clears it)."""


def learn_index_reader(device: torch.device) -> bool:
    """Whether a scope on ``device``, met for the first time, keeps its index current;
    remembered in :data:`INDEX_READERS` (asking torch at each scope would ask the driver,
    on CUDA)."""
    index_of = INDEX_READERS[device] = index_reader_of(device)
    return index_of is not None


def index_reader_of(device: torch.device) -> Callable[[], int] | None:
    """How to read the current index of ``device``'s type where a scope may have to change
    it; None where it never does: ``device`` has no index, its type is not torch's
    accelerator, or the accelerator has one device, whose index is always the current one
    (a single-GPU machine: the read, a driver call on CUDA, is then saved at every
    scope). The count is fixed for the process (``CUDA_VISIBLE_DEVICES`` is read
    once)."""
    if (
        device.index is None
        or device.type != accelerator_type()
        or torch.accelerator.device_count() < 2
    ):
        return None
    return torch.accelerator.current_device_index


class ThreadIndex:
    """One thread's index state: the blocks entered here that changed the index (open, in
    the order entered), and the block of another thread whose index it follows, with the
    index it had before (:func:`follow`)."""

    __slots__ = ("changed", "lent", "own")

    def __init__(self) -> None:
        self.changed: list[Block] = []
        self.lent: Block | None = None
        self.own = 0


def left_out_of_order(scope: Block, changed: list[Block]) -> None:
    """Give back the index at the exit of ``scope``, a block that changed it, where it is
    not the last such block open in this thread (``changed``): a block entered after it,
    by another task (or a generator left open), is open still, and its index current. It
    gives back this one's at its exit, and the index stays (the last one entered's)."""
    previous = scope.previous_index
    assert previous is not None
    for position in range(len(changed) - 1, -1, -1):
        if changed[position] is scope:
            del changed[position]
            changed[position].previous_index = previous
            return
    # Not listed here: left in another thread than the one that entered it.
    torch.accelerator.set_device_index(previous)


def follow(scope: Block, state: ThreadIndex) -> None:
    """Make ``scope``'s index current in this thread (whose index ``state`` is), which runs
    code in a copy of the context of the thread that entered it; until the job ends (a
    ``concurrent.futures`` job), or this thread follows another block."""
    if state.lent is scope:
        return
    index = scope.target.index
    assert index is not None
    if state.lent is None:
        state.own = torch.accelerator.current_device_index()
        future = _running_future()
        if future is not None:
            future.add_done_callback(lambda _future: _give_back(state))
    state.lent = scope
    torch.accelerator.set_device_index(index)


def _give_back(state: ThreadIndex) -> None:
    """The end of a job that followed a block: the thread's own index back. Run by the
    job's future in the thread that ran the job, before the thread takes its next one."""
    if state.lent is not None:
        state.lent = None
        torch.accelerator.set_device_index(state.own)


def _running_future() -> Any:
    """The future of the ``concurrent.futures`` job this thread runs, or None.

    ``concurrent.futures`` runs a job in ``_WorkItem.run``, a frame below this one whose
    ``self`` holds the job's future; the future's callbacks run in this thread when the
    job returns or raises, before the thread takes its next job (Python 3.10 to 3.13; 3.14
    passes ``run`` a context, and keeps ``self.future``). Looked for once per job that
    follows a block.
    """
    module = sys.modules.get("concurrent.futures.thread")
    work_item = getattr(module, "_WorkItem", None)
    run = getattr(work_item, "run", None)
    code = getattr(run, "__code__", None)
    if code is None:  # no pool was ever made here
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            future = getattr(frame.f_locals.get("self"), "future", None)
            return future if hasattr(future, "add_done_callback") else None
        frame = frame.f_back  # type: ignore[assignment]
    return None
