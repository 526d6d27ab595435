"""Whether the installed torch traces ``@device_agnostic`` calls as devicectx leads it to.

devicectx steers dynamo with private hooks (:mod:`devicectx._torch.dynamo`) that a torch
release may drop or read differently. Rather than trust a table of versions, the first time
dynamo looks at a decorated function, this compiles a few tiny decorated calls, one for each
way dynamo reaches a wrapper (a function value, a module's ``forward`` and another method, a
classmethod, a staticmethod, ``torch.compile`` of the decorated function itself), with
``fullgraph=True``, and checks that each result is where the eager call puts it. Any
difference or error, and decorated calls run eagerly under ``torch.compile`` for the rest
of the process (:mod:`devicectx.decorator._wrappers`).

It takes about a second, once per process, and only in processes that compile code
reaching a decorated function. It may run while dynamo traces the user's code: a nested
compile, which dynamo supports (:func:`devicectx._torch.dynamo.nested_compile`), made in an
ordinary context whatever the user's compile is inside (a strict ``torch.export``, where
``torch.compile`` compiles nothing; ``torch.func.vmap``, where ``nn.Linear`` cannot draw
its random weights; a ``with torch.device(...)`` block, whose modes dynamo keeps aside):
what the probe finds is the installed torch's answer, not the context's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from devicectx._torch import dynamo as _dynamo_hooks

Decorate = Callable[..., Any]
"""``decorate(function, **options)``: ``@device_agnostic(**options)`` applied to ``function``."""

_META = torch.device("meta")


def run(decorate: Decorate) -> str | None:
    """Compile the probe's calls with ``decorate``: None where all went as in eager code,
    else what went wrong, in a few words."""
    try:
        with _dynamo_hooks.nested_compile():
            wrong = _wrong_results(decorate)
    except Exception as error:  # whatever fails, the traced path is not to be trusted here
        lines = str(error).strip().splitlines()
        return f"{type(error).__name__}: {lines[0][:200] if lines else ''}".strip()
    if wrong:
        return f"results not on the device eager code gives: {', '.join(wrong)}"
    return None


def _wrong_results(decorate: Decorate) -> list[str]:
    """Which of the probe's calls, compiled, do not give a meta tensor (eager ones do)."""

    on_meta = functools.partial(decorate, device="meta")

    @on_meta
    def moved(x: torch.Tensor) -> torch.Tensor:
        return x + torch.zeros(1)  # meta only if moved and scoped

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(1, 1, device="meta")

        @decorate
        def forward(self, x: torch.Tensor) -> Any:
            return self.lin(x) + torch.zeros(1)

        @decorate
        def other(self, x: torch.Tensor) -> Any:
            return self.lin(x) + torch.zeros(1)

    class Maker:
        @on_meta
        @classmethod
        def make(cls, x: torch.Tensor) -> torch.Tensor:
            return x + torch.zeros(1)

        @on_meta
        @staticmethod
        def double(x: torch.Tensor) -> torch.Tensor:
            return x * 2 + torch.zeros(1)

    def caller(net: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return moved(x), net(x), net.other(x), Maker.make(x), Maker().double(x)

    x = torch.ones(1, device="cpu")
    results = _compile(caller)(Net(), x)
    results = (*results, _compile(moved)(x))
    names = ("function", "forward", "method", "classmethod", "staticmethod", "compiled")
    return [name for name, result in zip(names, results, strict=True) if result.device != _META]


def _compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    compiled: Callable[..., Any] = torch.compile(fn, backend="eager", fullgraph=True)
    return compiled
