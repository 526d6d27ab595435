"""Batches as dicts, dataclasses and namedtuples through one decorated training step.

    python examples/batches.py

``@device_agnostic`` moves every tensor inside the batch, at any depth and in any of these
containers, to the model's device, and leaves everything else (ids, strings) alone. The
caller's batch is never modified: on a GPU it stays on the CPU, ready for the next epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from devicectx import device_agnostic, resolve_device


@dataclass
class Batch:
    features: torch.Tensor
    labels: torch.Tensor
    ids: list[str]


class Pair(NamedTuple):
    features: torch.Tensor
    labels: torch.Tensor


AnyBatch = dict[str, torch.Tensor] | Batch | Pair


def unpack(batch: AnyBatch) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, dict):
        return batch["features"], batch["labels"]
    return batch.features, batch.labels


@device_agnostic
def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: AnyBatch) -> float:
    """One optimisation step; the batch arrives on the model's device, whatever its type."""
    features, labels = unpack(batch)
    assert features.device == labels.device == next(model.parameters()).device
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(features), labels)
    loss.backward()  # type: ignore[no-untyped-call]  # torch's stubs leave it untyped
    optimizer.step()
    return loss.item()


def main() -> dict[str, list[float]]:
    torch.manual_seed(0)
    device = resolve_device("auto")
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    rule = torch.randn(6, 3)  # labels a linear model can learn
    features = torch.randn(5, 32, 6)  # five batches of 32, on the CPU
    labels = (features @ rule).argmax(-1)

    def batch_of(kind: str, step: int) -> AnyBatch:
        # A new batch each step, as a DataLoader gives: the same one every step would be
        # copied to the device again and again (devicectx warns of that).
        x, y = features[step], labels[step]
        if kind == "dict":
            return {"features": x, "labels": y}
        if kind == "dataclass":
            return Batch(x, y, ids=[f"sample-{step}-{i}" for i in range(32)])
        return Pair(x, y)

    print(f"model on: {device}")
    losses: dict[str, list[float]] = {}
    for kind in ("dict", "dataclass", "namedtuple"):
        steps = [batch_of(kind, step) for step in range(5)]
        losses[kind] = [train_step(model, optimizer, batch) for batch in steps]
        caller_device = unpack(steps[-1])[0].device
        print(
            f"{kind:<10} loss {losses[kind][0]:.3f} -> {losses[kind][-1]:.3f}, "
            f"caller's batch still on {caller_device}"
        )
    return losses


if __name__ == "__main__":
    main()
