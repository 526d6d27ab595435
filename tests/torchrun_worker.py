"""One rank of the torch.distributed checks: launched twice by tests/test_distributed.py,
``torchrun --standalone --nproc_per_node 2 tests/torchrun_worker.py OUT``, on the CPU with gloo.

Each scenario runs in turn on both ranks and leaves its verdict, ``"ok"`` or the failure
in words, in ``OUT/rank<R>.json``, which the tests read: one launch (a few seconds) serves
them all. The verdict is written before the process group is torn down, and the process
leaves through ``os._exit``: torch can abort a gloo rank at interpreter exit (a
``terminate called`` from a background thread), which must not turn a verdict into a
failure.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

import devicectx
from devicectx import (
    DeviceMismatchError,
    device_agnostic,
    find_layouts,
    on_device,
    to_device,
)
from devicectx.devices._cli import main as report_main

SCENARIOS: dict[str, Callable[[], None]] = {}


class Skip(Exception):
    """A scenario this torch cannot run, for a reason of its own: the test skips."""


def scenario(function: Callable[[], None]) -> Callable[[], None]:
    SCENARIOS[function.__name__] = function
    return function


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x).relu())


class DecoratedNet(Net):
    @device_agnostic
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x).relu())


def batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    return {
        "x": torch.randn(6, 8, generator=generator),
        "y": torch.randn(6, 4, generator=generator),
    }


def plain_step(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(data["x"]), data["y"])
    loss.backward()
    return loss.detach()


decorated_step = device_agnostic(plain_step)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@scenario
def ddp_module_as_argument() -> None:
    """A decorated step given a DDP model: the same loss and gradients as undecorated."""
    torch.manual_seed(0)
    plain = DistributedDataParallel(Net())
    torch.manual_seed(0)
    decorated = DistributedDataParallel(Net())
    data = batch()
    expected = plain_step(plain, data)
    actual = decorated_step(decorated, data)
    assert torch.equal(expected, actual), (expected, actual)
    assert same(grads(plain), grads(decorated)), "gradients differ"


@scenario
def ddp_module_as_self() -> None:
    """A DDP model whose forward is decorated (the module is `self`): bit-identical."""
    torch.manual_seed(0)
    plain = DistributedDataParallel(Net())
    torch.manual_seed(0)
    decorated = DistributedDataParallel(DecoratedNet())
    data = batch()
    assert torch.equal(plain_step(plain, data), plain_step(decorated, data))
    assert same(grads(plain), grads(decorated)), "gradients differ"


@scenario
def ddp_fix_says_move_before_wrapping() -> None:
    """A DDP model off the decorator's device: the fix moves the model before wrapping."""
    model = DistributedDataParallel(Net())

    @device_agnostic(device="meta")
    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the body ran")

    try:
        step(model, batch()["x"])
    except DeviceMismatchError as error:
        last = str(error).splitlines()[-1]
        expected = (
            'fix: move the model before wrapping it: model.to("meta"), then '
            "DistributedDataParallel(model, ...); a wrapped model is not moved afterwards "
            "(and never implicitly)"
        )
        assert expected == last, last
    else:
        raise AssertionError("no DeviceMismatchError")


def fsdp_model() -> nn.Module:
    """Net built on meta through on_device, sharded by fully_shard, then materialised."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with on_device("meta"):
        model = Net()
    assert {torch.device("meta")} == {p.device for p in model.parameters()}
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for layer in (model.fc1, model.fc2):
        layer.reset_parameters()
    return model


@scenario
def fsdp_meta_init_and_decorated_step() -> None:
    """fully_shard of a model made inside on_device("meta"), then to_empty: a decorated
    step gives the loss and gradients of the plain one."""
    plain, decorated = fsdp_model(), fsdp_model()
    assert all(isinstance(p, DTensor) for p in decorated.parameters())
    data = batch()
    try:
        expected = plain_step(plain, data)
    except Exception as error:  # torch's own FSDP2 on the CPU (2.6: no Stream.record_event)
        raise Skip(
            f"FSDP2 fails on the CPU in torch {torch.__version__} itself: {error!r}"
        ) from None
    assert torch.equal(expected, decorated_step(decorated, data))
    assert same(grads(plain), grads(decorated)), "gradients differ"


@scenario
def fsdp_target_explains_itself() -> None:
    """A mismatch against an FSDP2 module says the target is its compute device, with
    its mesh; the fix for a module off target says to move before fully_shard."""

    @device_agnostic(move=False)
    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the body ran")

    model = fsdp_model()
    try:
        step(model, torch.ones(2, 8, device="meta"))
    except DeviceMismatchError as error:
        line = str(error).splitlines()[2]
        expected = (
            "target cpu (from the compute device of model (FSDPNet), sharded by fully_shard "
            "over mesh cpu [0, 1])"
        )
        assert expected == line, line
    else:
        raise AssertionError("no DeviceMismatchError")


@scenario
def dtensor_moves_keep_placements() -> None:
    """to_device keeps a DTensor's placements and mesh; a DTensor Parameter stays one;
    the parameters of an FSDP2 model (a checkpoint's dict) move too."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])
    param = nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Replicate()]))
    moved = to_device({"s": sharded, "p": param}, "meta")
    assert isinstance(moved["s"], DTensor)
    assert moved["s"].device == torch.device("meta")
    assert (Shard(0),) == moved["s"].placements
    assert moved["s"].device_mesh is mesh
    assert isinstance(moved["p"], nn.Parameter)
    assert isinstance(moved["p"], DTensor)
    assert (Replicate(),) == moved["p"].placements
    assert moved["p"].requires_grad
    params = to_device(dict(fsdp_model().named_parameters()), "meta")
    assert all(isinstance(p, nn.Parameter) and isinstance(p, DTensor) for p in params.values())
    assert {torch.device("meta")} == {p.device for p in params.values()}
    layouts = find_layouts({"s": sharded, "p": param, "x": torch.ones(2)}, name="b")
    assert ["sharded", "replicated", "plain"] == [layout.kind for layout in layouts]
    assert [mesh, mesh, None] == [layout.mesh for layout in layouts]


@scenario
def dtensor_mixed_refused_before_the_body() -> None:
    """A DTensor and a plain tensor in one decorated call are refused before the body
    runs, with or without moves, naming both paths and their placements."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    weight = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    ran: list[str] = []
    for move in (False, True):

        @device_agnostic(move=move)
        def add(weight: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            ran.append("body")
            return weight + batch["x"]

        try:
            add(weight, {"x": torch.ones(4, 4)})
        except DeviceMismatchError as error:
            lines = str(error).splitlines()
            expected = [
                f"{add.__qualname__}() got DTensors and plain tensors together:",
                "    weight     : sharded [Shard(dim=0)] on mesh cpu [0, 1], local data on cpu",
                "    batch['x'] : plain tensor on cpu",
                "a DTensor op takes only DTensors (and tensors of one element)",
            ]
            assert expected == lines[:4], lines
            assert "DTensor.from_local(batch['x'], weight.device_mesh" in lines[4], lines[4]
        else:
            raise AssertionError("no DeviceMismatchError")
    assert [] == ran
    # DTensors alone, or with a one-element tensor (which DTensor ops take), are fine.
    add(weight, {"x": distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])})
    add(weight, {"x": torch.tensor(2.0)})


@scenario
def device_report_names_rank_and_backend() -> None:
    """The device report inside a job: every line prefixed with the rank, and a job line
    with the ranks, sizes and the process group's backend."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = report_main([])
    rank = dist.get_rank()
    lines = out.getvalue().splitlines()
    assert 0 == status
    assert all(line.startswith(f"[rank {rank}] ") for line in lines), lines
    expected = (
        f"[rank {rank}] job          rank {rank} of 2, local rank {rank} of 2, process group gloo"
    )
    assert expected == lines[-1], lines[-1]


@scenario
def device_report_json_carries_the_job() -> None:
    """``--json`` inside a job: the same facts as the text's job line, and its prefix."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = report_main(["--json"])
    rank = dist.get_rank()
    expected = {
        "rank": rank,
        "world_size": 2,
        "local_rank": rank,
        "local_world_size": 2,
        "backend": "gloo",
        "prefix": f"[rank {rank}] ",
        "malformed": {},
    }
    assert 0 == status
    job = json.loads(out.getvalue())["job"]
    assert expected == job, job


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    verdicts: dict[str, str] = {"devicectx": str(Path(devicectx.__file__).resolve().parent)}
    for name, function in SCENARIOS.items():
        try:
            function()
            verdicts[name] = "ok"
        except Skip as skip:
            verdicts[name] = f"skip: {skip}"
        except BaseException:  # a verdict for every scenario, whatever happens
            verdicts[name] = traceback.format_exc()
        dist.barrier()
    path = out / f"rank{dist.get_rank()}.json"
    path.write_text(json.dumps(verdicts, indent=1))
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
