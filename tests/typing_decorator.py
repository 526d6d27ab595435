"""Static checks only: mypy proves ``@device_agnostic`` keeps each signature. Never run.

``mypy --strict tests/typing_decorator.py`` passes when every decorated function keeps its
parameters and return type (``assert_type``), and when every misuse below is an error:
strict mode warns on an unneeded ``# type: ignore[...]``, so a decorator that erased the
signature (``Callable[..., Any]``) would fail this file. pytest does not collect it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import torch
from torch import nn
from typing_extensions import assert_type

from devicectx import device_agnostic, prefetch


@device_agnostic
def bare(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return x * scale


@device_agnostic(device="cuda", move=False, output="input", exclude=("extra",))
def configured(x: torch.Tensor, *, extra: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [x, *extra.values()]


@device_agnostic(device="meta")
def generate(n: int) -> Iterator[torch.Tensor]:
    yield torch.zeros(n)


@device_agnostic
async def infer(x: torch.Tensor) -> torch.Tensor:
    return x


@device_agnostic
async def stream(x: torch.Tensor) -> AsyncIterator[torch.Tensor]:
    yield x


class Net(nn.Module):
    @device_agnostic
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @classmethod
    @device_agnostic(device="meta")
    def build(cls, width: int) -> Net:
        return cls()

    @staticmethod
    @device_agnostic
    def helper(x: torch.Tensor) -> float:
        return float(x.sum())


t = torch.ones(1)

# The parameters and the return type survive, bare and configured.
assert_type(bare(t), torch.Tensor)
assert_type(bare(t, 2.0), torch.Tensor)
assert_type(configured(t, extra={}), list[torch.Tensor])
assert_type(generate(2), Iterator[torch.Tensor])
pending = infer(t)
assert_type(pending, Coroutine[Any, Any, torch.Tensor]).close()
assert_type(stream(t), AsyncIterator[torch.Tensor])
assert_type(Net().forward(t), torch.Tensor)
assert_type(Net.build(3), Net)
assert_type(Net.helper(t), float)
keeps_bare: Callable[[torch.Tensor, float], torch.Tensor] = bare
keeps_configured: Callable[..., list[torch.Tensor]] = configured

# Each misuse is an error mypy reports (else its ignore would be unused, itself an error).
bare("not a tensor")  # type: ignore[arg-type]
bare(t, scale="2")  # type: ignore[arg-type]
configured(t)  # type: ignore[call-arg]
configured(t, {})  # type: ignore[call-arg]
wrong: Callable[[torch.Tensor], str] = bare  # type: ignore[assignment]
Net().forward("x")  # type: ignore[arg-type]
Net.build("3")  # type: ignore[arg-type]
device_agnostic(device="cpu", move="yes")  # type: ignore[call-overload]
# prefetch()'s pass-through to the loader is for run time only: a misspelt name is an error.
prefetch([t], "cpu").set_epcoh(1)  # type: ignore[attr-defined]
