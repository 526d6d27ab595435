"""What staged moves remember between moves, in one object: :data:`STATE`.

Which targets never stage, which accelerator there is, the pinned host of each
accelerator type and the back-off of a failed probe, whether non-blocking moves use the
copy stream, the thresholds, and what :func:`~devicectx.move._staging.forced` set. Every
module reads and changes these through :data:`STATE`, in place: the name is never bound
to another object, so a module may import it once. Tests (and ``forced``) swap all of it
at once with :func:`swapped`, instead of patching several modules' globals.

Example:
    >>> from devicectx.move._staging._state import STATE, StagingState, swapped
    >>> with swapped(STATE.replace(copy_stream=False)):
    ...     STATE.copy_stream
    False
    >>> STATE.copy_stream
    True
    >>> with swapped(StagingState()) as fresh:  # as in a new process
    ...     fresh.hosts
    {}
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from devicectx.move._pinned import Backoff, Host
    from devicectx.move._staging._layout import Thresholds
    from devicectx.move._staging._seam import _Forced

__all__ = ["STATE", "StagingState", "swapped"]

_META = torch.device("meta")


class StagingState:
    """Everything staged moves keep between moves (see the module's docstring).

    Attributes:
        never: target devices a move never stages to, read by the move engine before it
            calls :func:`~devicectx.move._staging.stage`, which adds each device it finds
            it cannot stage to: each is tested once per process. Devices, not types:
            hashing a device costs a third of reading its ``.type``, and this is read on
            every move, to meta and the CPU too.
        accelerator: torch's current accelerator type (None: none), once
            ``accelerator_known``.
        accelerator_known: whether ``accelerator`` has been asked of the resolver.
        hosts: the pinned :class:`~devicectx.move._pinned.Host` of each accelerator type,
            None for a type settled as having none (and the hosts tests register).
        backoff: the back-off of each accelerator type whose pinned-memory probe failed.
        copy_stream: whether a non-blocking staged move made while the caller's stream
            has work queued queues its copies on the device's copy stream
            (:mod:`devicectx.move._streams`), where they start at once and the staging
            chunks are free again when they land, instead of on the caller's stream,
            behind that work; the caller's stream then waits for them (the device waits,
            not the host). The benchmark turns it off to time both.
        thresholds: when and how a move is staged
            (:class:`~devicectx.move._staging.Thresholds`; None: the default).
        forced: what :func:`~devicectx.move._staging.forced` set (None: outside it).
    """

    __slots__ = (
        "accelerator",
        "accelerator_known",
        "backoff",
        "copy_stream",
        "forced",
        "hosts",
        "never",
        "thresholds",
    )

    def __init__(self) -> None:
        self.never: set[torch.device] = {_META}
        self.accelerator: str | None = None
        self.accelerator_known = False
        self.hosts: dict[str, Host | None] = {}
        self.backoff: dict[str, Backoff] = {}
        self.copy_stream = True
        self.thresholds: Thresholds | None = None
        self.forced: _Forced | None = None

    def replace(self, **changes: Any) -> StagingState:
        """A copy of this state with ``changes`` (attribute names to values); the sets and
        dicts are shared with this one unless replaced."""
        copy = StagingState.__new__(StagingState)
        for name in StagingState.__slots__:
            setattr(copy, name, changes.pop(name) if name in changes else getattr(self, name))
        if changes:
            msg = f"no such staging state: {sorted(changes)}"
            raise TypeError(msg)
        return copy

    def assign(self, other: StagingState) -> None:
        """Take every attribute of ``other``, in place."""
        for name in StagingState.__slots__:
            setattr(self, name, getattr(other, name))


STATE = StagingState()
"""The state every staged move reads: changed in place, never rebound."""


@contextlib.contextmanager
def swapped(state: StagingState) -> Iterator[StagingState]:
    """:data:`STATE` holds ``state``'s attributes for the block, its own again after it.

    Not thread-safe: for tests, benchmarks and :func:`~devicectx.move._staging.forced`.
    Yields :data:`STATE`.
    """
    saved = STATE.replace()
    STATE.assign(state)
    try:
        yield STATE
    finally:
        STATE.assign(saved)
