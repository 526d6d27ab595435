"""Mixed precision on any device: one training step that runs unchanged on a CPU and a GPU.

    python examples/mixed_precision.py              # precision "auto"
    python examples/mixed_precision.py bf16-mixed   # or "16-mixed", "32"

Scripts that hard-code ``torch.autocast("cuda", dtype=torch.float16)`` fail or do nothing
elsewhere. Here ``precision_scope(device, precision)`` runs the forward pass and the loss
under the autocast of whatever device ``"auto"`` found. ``"auto"`` picks bfloat16 on a GPU
that computes in it (CUDA from Ampere on, ROCm, MPS, XPU), float16 on an older CUDA GPU
(with a ``GradScaler``, which float16 needs), and float32 on the CPU, where autocast is
mostly slower. On a machine without a GPU it prints::

    device: cpu
    precision: 32: 'auto' on the CPU, where autocast is mostly slower (to use it: 'bf16-mixed')
    logits: torch.float32, weights: torch.float32
    grad scaler: off
    loss: 1.1092 -> 1.0661 after one step

The weights stay float32 in every precision: autocast computes in the lower precision
and keeps the master copy. The logits come out in the autocast dtype.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from devicectx import Precision, PrecisionName, choose_precision, resolve_device, to_device


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    precision: Precision,
    batch: tuple[torch.Tensor, torch.Tensor],
) -> tuple[float, torch.Tensor]:
    """One optimizer step; the loss before the step, and the logits it came from."""
    features, labels = batch
    optimizer.zero_grad(set_to_none=True)
    # Forward pass and loss under autocast; the backward pass outside it, as torch advises.
    with precision.autocast():
        logits = model(features)
        loss = nn.functional.cross_entropy(logits, labels)
    # A disabled scaler (every precision but float16) passes the loss and the step through.
    scaler.scale(loss).backward()  # type: ignore[no-untyped-call]  # torch leaves it untyped
    scaler.step(optimizer)
    scaler.update()
    return loss.item(), logits


def main(precision_name: PrecisionName = "auto") -> None:
    torch.manual_seed(0)
    device = resolve_device("auto")
    precision = choose_precision(device, precision_name)

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler(precision.device_type, enabled=precision.needs_grad_scaler)
    # As a CPU data loader gives it: to_device moves the whole batch in one call.
    batch = to_device((torch.randn(64, 16), torch.randint(0, 3, (64,))), device)

    before, logits = train_step(model, optimizer, scaler, precision, batch)
    with torch.no_grad(), precision.autocast():
        after = nn.functional.cross_entropy(model(batch[0]), batch[1]).item()

    print(f"device: {device}")
    print(f"precision: {precision}")
    print(f"logits: {logits.dtype}, weights: {next(model.parameters()).dtype}")
    print(f"grad scaler: {'on' if scaler.is_enabled() else 'off'}")
    print(f"loss: {before:.4f} -> {after:.4f} after one step")


if __name__ == "__main__":
    main(*sys.argv[1:2])  # type: ignore[arg-type]  # checked by choose_precision
