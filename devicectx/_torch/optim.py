"""torch's optimizers as their LR schedulers see them: the ``step`` wrapper a scheduler puts on.

A scheduler learns that its optimizer stepped through a wrapper on the optimizer's ``step``
(``patch_track_step_called`` in ``torch/optim/lr_scheduler.py``, private to torch, checked
the same in torch 2.6 and 2.13), which a copy of the optimizer does not keep. The testing
kit copies an optimizer and its scheduler for each device (:mod:`devicectx.testing._inputs`).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

from torch.optim import Optimizer

__all__ = ["keep_step_tracking"]


def keep_step_tracking(original: Optimizer, copied: Optimizer) -> None:
    """Give ``copied`` the ``step`` wrapper an LR scheduler gave ``original``.

    A scheduler wraps its optimizer's ``step`` (an instance attribute, which a copy leaves
    out: ``Optimizer.__getstate__`` keeps only defaults, state and groups) to learn that it
    ran; without it, the copied scheduler's first ``step()`` warns that ``optimizer.step()``
    was overridden. This is torch's wrapper (``patch_track_step_called`` in
    ``torch/optim/lr_scheduler.py``, the same in torch 2.6 to 2.13), marked as torch marks it.
    """
    step = vars(original).get("step")
    if not getattr(step, "_wrapped_by_lr_sched", False) or "step" in vars(copied):
        return
    method = type(copied).step
    reference = weakref.ref(copied)  # as torch's: the optimizer does not keep itself alive

    @functools.wraps(method)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        optimizer: Any = reference()
        optimizer._opt_called = True
        return method(optimizer, *args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    copied.step = tracked  # type: ignore[method-assign]
    if getattr(original, "_opt_called", False):
        copied._opt_called = True  # type: ignore[attr-defined]
