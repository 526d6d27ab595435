"""The model the spread-model tests place over devices: three stages, as a device map
splits one, and the same seeded copy with an input and its output for each test."""

from __future__ import annotations

import torch
from torch import nn


class Net(nn.Module):
    """Three stages, as a device map splits a model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)).relu())


def made() -> tuple[Net, torch.Tensor, torch.Tensor]:
    """A seeded net, an input on the CPU and the net's output for it, before any dispatch."""
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(3, 4)
    with torch.no_grad():
        return net, x, net(x)
