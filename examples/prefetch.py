"""A training loop whose batches are on the device before the step asks for them: prefetch.

    python examples/prefetch.py            # "auto": the accelerator if there is one, else the CPU
    python examples/prefetch.py emulated   # the testing kit's emulated accelerator (no GPU needed)

The loader is an ordinary ``DataLoader`` (no ``pin_memory``); ``prefetch`` moves the next
two batches on a copy stream while the step computes (on the CPU, each batch is moved when
asked for). It keeps the loader's habits (``len``, ``set_epoch`` for the
``DistributedSampler``), the ``@device_agnostic`` step finds its batch on the device and
moves nothing, and ``track_transfers`` counts every copy at the line that called
``prefetch``.
"""

from __future__ import annotations

import sys

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from devicectx import device_agnostic, prefetch, resolve_device, track_transfers


def main(spec: str) -> None:
    if spec == "emulated":
        from devicectx.testing import emulated

        device = emulated.enable()
    else:
        device = resolve_device(spec)
    torch.manual_seed(0)
    features = torch.randn(256, 8)
    targets = features @ torch.linspace(-1, 1, 8) + 0.1 * torch.randn(256)
    dataset = TensorDataset(features, targets)
    sampler: DistributedSampler[int] = DistributedSampler(dataset, num_replicas=1, rank=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)  # pageable batches

    model = torch.nn.Linear(8, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    @device_agnostic  # the target is the model's device; the batch is already there
    def step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    batches = prefetch(loader, device)  # the next 2 batches on their way while one computes
    print(f"device: {device}")
    print(f"batches per epoch: {len(batches)} (the loader's {len(loader)})")
    print(f"copy stream: {'yes' if batches.streams else 'no (batches move in order)'}")
    with track_transfers() as log:
        for epoch in range(3):
            batches.set_epoch(epoch)  # the DistributedSampler reshuffles
            losses = [step(model, x, y) for x, y in batches]
            print(f"epoch {epoch}: loss {losses[0].item():.3f} -> {losses[-1].item():.3f}")
    print(log.table())  # every copy at the prefetch line; none by the step


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "auto")
