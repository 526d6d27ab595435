"""Multi-process inference under torchrun: each process finds its own device.

    torchrun --nproc_per_node=2 examples/torchrun_inference.py

``resolve_device("auto")`` reads ``LOCAL_RANK``, which torchrun sets: on a machine with
GPUs, process 0 gets ``cuda:0`` and process 1 ``cuda:1`` (index ``LOCAL_RANK % count``);
on a machine without one, both get the CPU. The processes share one model (same seed),
each classifies its own shard of the data, and an ``all_reduce`` over the gloo backend
adds their counts together.

Run without torchrun (``python examples/torchrun_inference.py``), it is one process of
one: it says so, with the command that starts two.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from devicectx import device_agnostic, explain_device, on_device, resolve_device

SAMPLES = 64


@device_agnostic(output="cpu")
def predict(model: nn.Module, features: torch.Tensor) -> torch.Tensor:
    """The predicted class of each sample, computed on the model's device, returned on the CPU."""
    logits: torch.Tensor = model(features)
    return logits.argmax(dim=-1)


def start() -> None:
    """Join the processes torchrun started; or, launched without it, be the only one."""
    if "RANK" in os.environ:  # torchrun provides the rank, world size and address
        dist.init_process_group("gloo")
        return
    launch = f"torchrun --nproc_per_node=2 {sys.argv[0]}"
    print(f"not started by torchrun: one process (for two: {launch})")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def main() -> None:
    start()
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        device = resolve_device("auto")
        torch.manual_seed(0)  # the same model and data in every process
        features = torch.randn(SAMPLES, 8)
        with on_device(device), torch.inference_mode():
            model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).eval()
            shard = features[rank::world]  # this process's share of the samples
            classes = predict(model, shard)

        # gloo reduces CPU tensors; the predictions are on the CPU already (output="cpu").
        counts = torch.bincount(classes, minlength=3)
        total = counts.clone()
        dist.all_reduce(total)
        why = explain_device("auto").partition(": ")[2]
        line = (
            f"rank {rank}/{world}: device {device} ({why}); {len(shard)} samples, "
            f"classes {counts.tolist()}, all ranks {total.tolist()}\n"
        )
        # One write per line: the processes share the terminal, and a single short write
        # to a pipe is not interleaved with the other process's output (print makes two).
        sys.stdout.write(line)
        sys.stdout.flush()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
