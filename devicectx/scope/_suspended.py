"""A scope set aside for the length of one call, in one thread: what a scope's
``torch_slot_at_entry`` holds meanwhile.

torch's own optimizers make some of their state with constructors that name no device (the
non-capturable ``step`` counters of RMSprop, NAdam, RAdam, Adamax, Adadelta), and mean the
CPU: in a scope those would land on the target, where reading one costs a host sync. So
while such a step runs (:mod:`devicectx.scope._optimizer_step`), the innermost scope is set
aside: its record of torch's default slot at entry is replaced by a :class:`Suspended`, which
:func:`~devicectx.scope._stack.scope_device` reads as "not mine" (as it reads a
``set_default_device`` call made inside the block), so constructors get torch's own default.

Why in the scope object and not in a flag of the thread. Nothing is added to the path of a
constructor called in a scope that is not set aside: the slot is compared already, and only
where it differs is the marker looked at. And the marker is only trusted where it applies:

- in the thread that set it aside (a copy of the context in another thread sees the same
  block, and keeps its device);
- while the call that set it aside is still running: its frame is on the stack. A step that
  raised never gives the scope back itself (torch runs no post-hook then); the first
  constructor after it sees the frame gone, and the scope applies again.
"""

from __future__ import annotations

import sys
from types import FrameType

__all__ = ["Suspended", "inside"]


class Suspended:
    """A scope set aside by the call running ``frame``, in the thread whose list of call
    scopes is ``thread``; ``slot``: the scope's ``torch_slot_at_entry``, given back after."""

    __slots__ = ("frame", "slot", "thread")

    def __init__(self, slot: object, frame: FrameType, thread: object) -> None:
        self.slot = slot
        self.frame = frame
        self.thread = thread


def inside(marker: Suspended) -> bool:
    """Whether the call that set the scope aside is running below this point (its frame is
    on this thread's stack). Asked only for constructors called while a scope is set aside
    or just after: a walk up the stack, some tens of frames."""
    frame: FrameType | None = sys._getframe(1)
    wanted = marker.frame
    while frame is not None:
        if frame is wanted:
            return True
        frame = frame.f_back
    return False
