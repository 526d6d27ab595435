"""Objects the move engine's tests share: a named tuple, a dataclass batch, a frozen
dataclass, a registered container (registered at import), an object with a counting
``.to``, and a check that everything landed on meta."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from devicectx import register_container
from devicectx.move._move import iter_tensors

META = torch.device("meta")


class Pair(NamedTuple):
    first: Any
    second: Any


def on_meta(obj: Any) -> bool:
    """Whether every tensor of ``obj`` (by the engine's own listing) is on meta."""
    return all(t.device == META for _, t in iter_tensors(obj))


@dataclasses.dataclass
class Batch:
    inputs: torch.Tensor
    name: str = "b"
    cache: Any = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        self.extra = "not a field"


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor


class Holder:
    def __init__(self, left: Any, right: Any, note: str = "") -> None:
        self.left, self.right, self.note = left, right, note


class SubHolder(Holder):
    pass


register_container(
    Holder,
    children=lambda h: [("left", h.left), ("right", h.right)],
    rebuild=lambda h, new: type(h)(*new, note=h.note),
)


class CountingTo:
    """An object with a .to that counts its calls."""

    calls = 0

    def to(self, device: Any) -> CountingTo:
        CountingTo.calls += 1
        return self
