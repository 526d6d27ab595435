"""Quickstart: inference on the best device here, with the results back on the CPU.

    python examples/quickstart.py

With a GPU (CUDA, ROCm, MPS, XPU) the model runs there; without one, on the CPU.
``DEVICECTX_DEVICE=cpu`` (or ``cuda:1``, ``mps``, ...) chooses for you.
"""

from __future__ import annotations

import torch
from torch import nn

from devicectx import device_agnostic, on_device


@device_agnostic(output="input")
def classify(model: nn.Module, features: torch.Tensor) -> dict[str, torch.Tensor]:
    """Class probabilities and the top class, computed where the model is.

    ``features`` is moved to the model's device; the result goes back to the device the
    features came from (``output="input"``), so a caller with CPU data gets CPU tensors.
    """
    probabilities = model(features).softmax(dim=-1)
    # Created without device=: it lands on the model's device, next to the probabilities.
    ranks = torch.arange(probabilities.shape[-1])
    return {"probabilities": probabilities, "top": ranks[probabilities.argmax(dim=-1)]}


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    features = torch.randn(4, 8)  # as a CPU data loader gives them

    with on_device("auto") as device, torch.inference_mode():
        # Built inside the block, the model's parameters are allocated on `device` directly.
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).eval()
        outputs = classify(model, features)

    print(f"device: {device}")
    print(f"model on: {next(model.parameters()).device}")
    print(f"outputs on: {outputs['probabilities'].device}")
    print(f"top classes: {outputs['top'].tolist()}")
    sums = outputs["probabilities"].sum(dim=-1)
    print(f"probabilities sum to: {[round(total, 4) for total in sums.tolist()]}")
    return outputs


if __name__ == "__main__":
    main()
