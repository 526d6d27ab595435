"""The seam for tests: :func:`forced` stages every move, through ordinary host memory."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from devicectx.move import _pinned
from devicectx.move._staging._layout import Thresholds
from devicectx.move._staging._state import STATE, swapped

__all__ = ["FORCED_THRESHOLDS", "forced"]


class _Forced:
    """What :func:`forced` set: the host to stage through, and the thresholds."""

    __slots__ = ("host", "thresholds")

    def __init__(self, host: _pinned.Host, thresholds: Thresholds) -> None:
        self.host = host
        self.thresholds = thresholds


_FORCED_NAME = "forced (tests)"


FORCED_THRESHOLDS = Thresholds(
    min_tensors=1,
    stage_min_bytes=0,
    share_max_bytes=64,
    shared_bytes=256,
    chunk_bytes=1024,
    pool_bytes=4096,
)
""":func:`forced`'s default: every move of one or more tensors staged, through buffers so
small that a test's batch fills several regions and chunks."""


@contextlib.contextmanager
def forced(
    thresholds: Thresholds | None = None,
    *,
    pinned: Callable[[torch.Tensor], bool] | None = None,
) -> Iterator[_pinned.Host]:
    """Stage every move that can be, to any target, through ordinary host memory.

    The test seam: packing and unpacking are the same on every device, so tests take this
    path to the CPU or ``meta`` and compare it with the per-tensor move. ``cpu`` targets
    stage back to the host from any device (a CPU tensor stands for an accelerator's).
    Failures are raised instead of falling back. Not thread-safe: for tests.

    Args:
        thresholds: default :data:`FORCED_THRESHOLDS`.
        pinned: which sources count as pinned (default: none).

    Yields:
        The host staged through: its pool can be inspected.
    """
    limits = thresholds or FORCED_THRESHOLDS
    pool = _pinned.Pool(_host_buffer, _landed, limits.chunk_bytes, limits.pool_bytes)
    host = _pinned.Host(pool, _no_stream, pinned or _never_pinned)
    # The hosts are shared with the state outside: staging_memory() sees this one too.
    with swapped(STATE.replace(forced=_Forced(host, limits), never=set())):
        _pinned.register(_FORCED_NAME, host)
        try:
            yield host
        finally:
            _pinned.unregister(_FORCED_NAME)


def _host_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


class _Landed:
    """The event of copies that are all blocking (host memory): always complete."""

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _landed(device: torch.device) -> _Landed:
    return _Landed()


def _no_stream(device: torch.device) -> None:
    return None


def _never_pinned(tensor: torch.Tensor) -> bool:
    return False
