"""Decorated functions, methods and a module, pickled by devicectx 0.1.0 into
``tests/data/pickles-0.1.0.pkl`` (see tests/test_layout.py): pickles name them by this
module, so it keeps its name and these definitions."""

import torch
from torch import nn

from devicectx import device_agnostic, on_device


@device_agnostic
def loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A decorated function."""
    return (a - b).sum()


@device_agnostic(device="meta")
def step(x: torch.Tensor) -> torch.Tensor:
    """A decorated function with a target."""
    return x * 2


class Model(nn.Module):
    """A module whose forward, classmethod and staticmethod are decorated."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)

    @device_agnostic
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    @device_agnostic
    @classmethod
    def make(cls) -> "Model":
        return cls()

    @device_agnostic
    @staticmethod
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2


@on_device("meta")
def built() -> torch.Tensor:
    """A function decorated with on_device."""
    return torch.zeros(1)
