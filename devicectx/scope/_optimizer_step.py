"""torch's optimizers step as they would outside every scope.

A scope makes its target the default device for everything in it, as ``with torch.device``
does, and an optimizer stepped in a decorated training step is in it. But torch's optimizers
make some of their lazy state with constructors that name no device because they mean the
CPU: the non-capturable ``step`` counters of RMSprop, NAdam, RAdam, Adamax, Adadelta (and
Adam's before torch 2.13, which names the CPU since). In a scope those land on the target,
where every read of one is a host sync (20-48% longer optimizer steps measured on an H100),
and on ``meta`` the step fails reading one. So for the length of a step of one of torch's
optimizers, the innermost scope is set aside (:mod:`devicectx.scope._suspended`): its
constructors get torch's own default, as without devicectx. A ``closure`` the step calls
(LBFGS's; any ``step(closure)``) is the caller's code, and runs in the scope.

Through torch's global step hooks (``register_optimizer_step_pre_hook`` and its post
hook), put in place with the constructors' wrappers at the first scope that changes the
device. A step of an optimizer whose ``step`` is not torch's own (a class of the caller's,
or a library's) is left in the scope, as under ``with torch.device``: its author may mean
the default device. Code dynamo compiles is left alone too.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from devicectx.scope._stack import Scope, give_back, set_aside, take_again
from devicectx.scope._suspended import Suspended, inside

__all__ = ["watch_optimizer_steps"]

_Aside = tuple[Scope, Suspended]


class _Steps(threading.local):
    """The scopes set aside by the steps running in this thread, innermost last."""

    def __init__(self) -> None:
        self.aside: list[_Aside] = []


_STEPS = _Steps()
_TORCH_STEP: dict[type, bool] = {}
_watching = False
_is_compiling = torch.compiler.is_compiling


def watch_optimizer_steps() -> None:
    """Put the step hooks in place, once per process."""
    global _watching
    if not _watching:
        _watching = True
        register_optimizer_step_pre_hook(_before_step)
        register_optimizer_step_post_hook(_after_step)


def _before_step(
    optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if _is_compiling():
        return None
    aside = _STEPS.aside
    while aside and not inside(aside[-1][1]):  # steps that raised: their scopes back
        give_back(*aside.pop())
    if not _torch_step(type(optimizer)):
        return None
    entered = set_aside(sys._getframe(1))  # the frame of torch's step wrapper
    if entered is None:
        return None
    aside.append(entered)
    return _scoped_closure(entered, args, kwargs)


def _after_step(optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    # Its own scope only: a step that set nothing aside (not torch's) may run inside one
    # that did. Those of steps that raised are given back at the next step, or by the
    # scope itself at its next constructor (:mod:`devicectx.scope._suspended`).
    if _is_compiling():
        return
    aside = _STEPS.aside
    if aside and aside[-1][1].frame is sys._getframe(1):
        give_back(*aside.pop())


def _torch_step(tp: type) -> bool:
    """Whether the step of optimizers of ``tp`` is torch's own code (the hooked ``step``
    keeps its ``__module__`` through torch's wrappers)."""
    known = _TORCH_STEP.get(tp)
    if known is None:
        module = getattr(getattr(tp, "step", None), "__module__", None) or ""
        known = _TORCH_STEP[tp] = module.startswith("torch.optim.")
    return known


def _scoped_closure(
    entered: _Aside, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The step's arguments with its closure, if any, run in the scope set aside."""
    if kwargs.get("closure") is not None:
        return args, {**kwargs, "closure": _in_scope(kwargs["closure"], entered)}
    if len(args) > 1 and args[1] is not None:
        return (args[0], _in_scope(args[1], entered), *args[2:]), kwargs
    return None


def _in_scope(closure: Callable[[], Any], entered: _Aside) -> Callable[[], Any]:
    scope, marker = entered

    def in_scope() -> Any:
        give_back(scope, marker)
        try:
            return closure()
        finally:
            take_again(scope, marker)

    return in_scope
