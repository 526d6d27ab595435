"""torch.distributed: DDP, FSDP2 and DTensor with devicectx, on the CPU with gloo.

Two kinds of test. The job tests launch ``torchrun --standalone --nproc_per_node 2``
once for the module (tests/torchrun_worker.py runs every scenario on both ranks, a few
seconds in all, bounded by a timeout) and each checks one scenario's verdict on both
ranks. The in-process tests use a one-process gloo group, set up and torn down around
each test, for what one rank can show: layouts, messages, the FSDP2 target.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import once_per_session
from torch import nn

from devicectx import (
    DeviceMismatchError,
    Layout,
    MoveError,
    device_agnostic,
    find_devices,
    find_layouts,
    on_device,
    to_device,
)
from devicectx.decorator._target import module_device
from devicectx.move._containers import kind_for
from devicectx.move._distributed import fsdp_compute_device, wrapper_name
from devicectx.move._kinds import DTENSOR_KIND

pytestmark = [
    pytest.mark.torch_internals,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built"),
]

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("torchrun_worker.py")
JOB_TIMEOUT = 240  # seconds: the job takes about 7 s alone, longer on a loaded 2-core machine


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    """Each rank's verdicts, from one torchrun job of two processes (one in a session)."""
    result: list[dict[str, str]] = once_per_session(
        tmp_path_factory, "torchrun-verdicts", lambda: _run_job(tmp_path_factory)
    )
    return result


def _run_job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    out = tmp_path_factory.mktemp("torchrun")
    # The checkout first, before what the path held (an installed devicectx's metadata, say).
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "2", str(WORKER), str(out)]
    result = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=out, timeout=JOB_TIMEOUT, check=False
    )
    found = sorted(out.glob("rank*.json"))
    if len(found) != 2:
        pytest.fail(
            f"torchrun gave {len(found)} verdicts (exit {result.returncode}):\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return [json.loads(path.read_text()) for path in found]


def check(verdicts: list[dict[str, str]], scenario: str) -> None:
    """The scenario passed on both ranks; else the first failure, with its traceback.
    A scenario torch itself cannot run here is skipped, with torch's reason."""
    skipped = [v[scenario] for v in verdicts if v[scenario].startswith("skip: ")]
    if skipped:
        pytest.skip(skipped[0].removeprefix("skip: "))
    failures = [
        f"rank {rank}: {v[scenario]}" for rank, v in enumerate(verdicts) if v[scenario] != "ok"
    ]
    assert [] == failures, "\n".join(failures)


def test_the_job_imports_the_checkout_under_test(verdicts: list[dict[str, str]]) -> None:
    """The launched ranks import devicectx from this checkout, not an installed copy."""
    expected = str(ROOT / "devicectx")
    assert [expected, expected] == [v["devicectx"] for v in verdicts]


def test_ddp_step_given_the_model(verdicts: list[dict[str, str]]) -> None:
    """A decorated training step given a DDP model: the undecorated loss and gradients."""
    check(verdicts, "ddp_module_as_argument")


def test_ddp_model_with_decorated_forward(verdicts: list[dict[str, str]]) -> None:
    """A DDP model whose forward is decorated (the module as self): bit-identical."""
    check(verdicts, "ddp_module_as_self")


def test_ddp_fix_moves_before_wrapping(verdicts: list[dict[str, str]]) -> None:
    """A DDP model off the target: the fix moves the model, then wraps it."""
    check(verdicts, "ddp_fix_says_move_before_wrapping")


def test_fsdp2_meta_init_and_decorated_step(verdicts: list[dict[str, str]]) -> None:
    """on_device("meta"), fully_shard, to_empty, then a decorated step: bit-identical."""
    check(verdicts, "fsdp_meta_init_and_decorated_step")


def test_fsdp2_target_explains_itself(verdicts: list[dict[str, str]]) -> None:
    """A mismatch against an FSDP2 model names its compute device and mesh as the reason."""
    check(verdicts, "fsdp_target_explains_itself")


def test_dtensor_moves_keep_placements(verdicts: list[dict[str, str]]) -> None:
    """Sharded and replicated DTensors, and DTensor parameters, move with their layout."""
    check(verdicts, "dtensor_moves_keep_placements")


def test_dtensor_mixed_with_plain_refused(verdicts: list[dict[str, str]]) -> None:
    """A DTensor and a plain tensor in one decorated call: refused before the body."""
    check(verdicts, "dtensor_mixed_refused_before_the_body")


def test_device_report_in_a_job(verdicts: list[dict[str, str]]) -> None:
    """The report in a job: rank-prefixed lines, the ranks, sizes and the backend."""
    check(verdicts, "device_report_names_rank_and_backend")


def test_device_report_json_in_a_job(verdicts: list[dict[str, str]]) -> None:
    """``--json`` in a job carries the ranks, sizes, backend and the text's prefix."""
    check(verdicts, "device_report_json_carries_the_job")


# One rank, in this process.


@pytest.fixture
def mesh() -> Iterator[object]:
    """A one-process gloo group and its CPU mesh, for the length of one test.

    The tests on it make their DTensors with ``DTensor.from_local`` (on one rank, what
    ``distribute_tensor`` makes) and read them with ``to_local``: no collective runs. On
    torch 2.6, destroying a gloo group just after an asynchronous collective can deadlock
    (a gloo thread frees the collective's tensors, which takes the GIL, while the group's
    destructor, holding the GIL, waits for that thread's lock); seen in a CI run.
    """
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_find_layouts_tells_sharded_replicated_and_plain_apart(mesh: object) -> None:
    """find_devices lists three tensors on one device; find_layouts gives each its kind,
    placements and mesh, in the same order and with the same paths."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    batch = {
        "w": DTensor.from_local(torch.ones(4, 4), mesh, [Shard(0)]),  # type: ignore[arg-type]
        "b": DTensor.from_local(torch.ones(4), mesh, [Replicate()]),  # type: ignore[arg-type]
        "x": torch.ones(2),
    }
    cpu = torch.device("cpu")

    expected = {
        Layout(cpu, "sharded", ("Shard(dim=0)",), mesh): ["batch['w']"],
        Layout(cpu, "replicated", ("Replicate()",), mesh): ["batch['b']"],
        Layout(cpu, "plain"): ["batch['x']"],
    }
    assert {cpu: ["batch['w']", "batch['b']", "batch['x']"]} == find_devices(batch, name="batch")
    assert expected == find_layouts(batch, name="batch")
    assert [
        "sharded [Shard(dim=0)] on mesh cpu [0], local data on cpu",
        "replicated [Replicate()] on mesh cpu [0], local data on cpu",
        "plain on cpu",
    ] == [str(layout) for layout in find_layouts(batch)]


def test_a_partial_dtensor_is_partial(mesh: object) -> None:
    """A DTensor awaiting its reduction (Partial) is neither sharded nor replicated."""
    from torch.distributed.tensor import DTensor, Partial

    partial = DTensor.from_local(torch.ones(2), mesh, [Partial()])  # type: ignore[arg-type]

    assert ["partial"] == [layout.kind for layout in find_layouts(partial)]


def test_mixed_message_every_line(mesh: object) -> None:
    """The mixed-DTensor error: the call, each path with its layout, the rule, the fix."""
    from torch.distributed.tensor import DTensor, Shard

    @device_agnostic(move=False)
    def loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the body ran")

    pred = DTensor.from_local(torch.ones(4, 2), mesh, [Shard(0)])  # type: ignore[arg-type]
    with pytest.raises(DeviceMismatchError) as caught:
        loss(pred, torch.ones(4, 2))

    expected = [
        f"{loss.__qualname__}() got DTensors and plain tensors together:",
        "    pred   : sharded [Shard(dim=0)] on mesh cpu [0], local data on cpu",
        "    target : plain tensor on cpu",
        "a DTensor op takes only DTensors (and tensors of one element)",
        "fix: make target a DTensor: DTensor.from_local(target, pred.device_mesh, "
        "[Replicate()]) if every rank holds the same target (or its own shard: "
        "[Shard(dim)]), distribute_tensor(target, pred.device_mesh, pred.placements) to "
        "split a full tensor from rank 0; or pass pred.to_local() or pred.full_tensor() "
        "to compute on plain tensors",
    ]
    assert expected == str(caught.value).splitlines()


def test_dtensors_alone_pass_the_check(mesh: object) -> None:
    """DTensors with one-element plain tensors (which DTensor ops take) run the body."""
    from torch.distributed.tensor import DTensor, Shard

    @device_agnostic(move=False)
    def scale(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        return x * factor

    x = DTensor.from_local(torch.ones(4, 2), mesh, [Shard(0)])  # type: ignore[arg-type]

    assert 8.0 * 2 == scale(x, torch.tensor(2.0)).to_local().sum().item()


def test_dtensor_kind_is_told_apart(mesh: object) -> None:
    """The engine keeps a kind of its own for DTensor, by which the check finds one."""
    from torch.distributed.tensor import DTensor

    assert DTENSOR_KIND is kind_for(DTensor)


def test_fsdp2_module_computes_on_its_mesh_device(mesh: object) -> None:
    """An FSDP2 module's target is its mesh's device; a plain module has none of its own.

    On a CPU both are the CPU. A CPU-offloaded FSDP2 module (parameters on the CPU, compute
    on the accelerator) needs an accelerator: fully_shard refuses CPUOffloadPolicy here.
    """
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(nn.Linear(2, 2), mesh=mesh)  # type: ignore[arg-type]

    assert torch.device("cpu") == fsdp_compute_device(model)  # type: ignore[arg-type]
    assert torch.device("cpu") == module_device(model)  # type: ignore[arg-type]
    assert fsdp_compute_device(nn.Linear(2, 2)) is None
    assert "fully_shard" == wrapper_name(model)  # type: ignore[arg-type]


def test_cpu_offloaded_fsdp2_module_with_buffers_targets_its_compute_device(
    mesh: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under CPU offload, fully_shard keeps the parameters on the CPU and puts the buffers
    on the compute device: the module is on two devices, and its target is still the
    compute device; a buffer anywhere else is a module spread for real.

    fully_shard refuses CPUOffloadPolicy on a machine without an accelerator, so the
    placement is made by hand on a CPU mesh, with ``meta`` standing for the compute device
    (the mesh's device, which devicectx reads from torch on a real job).
    """
    from torch.distributed.fsdp import fully_shard

    from devicectx.decorator import _target
    from devicectx.move import _distributed

    model = fully_shard(nn.BatchNorm1d(2), mesh=mesh)  # type: ignore[arg-type]
    for where in (_target, _distributed):
        monkeypatch.setattr(where, "fsdp_compute_device", lambda module: torch.device("meta"))
    for name, buffer in model.named_buffers():
        model._buffers[name] = buffer.to("meta")  # parameters stay on the CPU

    assert torch.device("meta") == module_device(model)
    assert _target.module_label(model, "model") == (
        "the compute device of model (FSDPBatchNorm1d), sharded by fully_shard over mesh "
        "cpu [0]; its parameters are kept on cpu (CPU offload)"
    )

    stray = fully_shard(nn.BatchNorm1d(2), mesh=mesh)  # type: ignore[arg-type]
    stray._buffers["running_mean"] = stray.running_mean.to("meta")
    stray._buffers["running_var"] = stray.running_var.to(torch.float64)  # on the CPU
    assert _target.Spread.SPREAD == module_device(stray)


def test_fsdp2_fix_moves_before_fully_shard(mesh: object) -> None:
    """An FSDP2 model off the decorator's device: the fix moves it before fully_shard."""
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(nn.Linear(2, 2), mesh=mesh)  # type: ignore[arg-type]

    @device_agnostic(device="meta")
    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the body ran")

    with pytest.raises(DeviceMismatchError) as caught:
        step(model, torch.ones(2))

    expected = (
        'fix: move the model before wrapping it: model.to("meta"), then fully_shard(model); '
        "a wrapped model is not moved afterwards (and never implicitly)"
    )
    assert expected == str(caught.value).splitlines()[-1]


def test_an_fsdp2_model_sharded_on_meta_is_not_materialised(mesh: object) -> None:
    """Built under on_device("meta") and sharded: its device is meta (not its mesh's), and
    a decorated call stops before the body with to_empty as the fix; once materialised,
    its device is its mesh's."""
    from torch.distributed.fsdp import fully_shard

    with on_device("meta"):
        layer = nn.Linear(2, 2)
    sharded = fully_shard(layer, mesh=mesh)  # type: ignore[arg-type]

    @device_agnostic
    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)  # type: ignore[no-any-return]

    assert torch.device("meta") == module_device(sharded)  # type: ignore[arg-type]
    with pytest.raises(DeviceMismatchError) as error:
        step(sharded, torch.ones(2))  # type: ignore[arg-type]
    name = "test_an_fsdp2_model_sharded_on_meta_is_not_materialised.<locals>.step"
    assert [
        f"{name}() got model (FSDPLinear) not materialised, its shards on meta:",
        "    meta <- model",
        "target cpu (from the compute device of model (FSDPLinear), sharded by fully_shard "
        "over mesh cpu [0])",
        'fix: model.to_empty(device="cpu"), then initialise it (model.reset_parameters(), '
        f"or load a state dict), before calling {name}()",
    ] == str(error.value).splitlines()
    sharded.to_empty(device="cpu")  # type: ignore[operator]
    sharded.reset_parameters()  # type: ignore[operator]
    assert torch.device("cpu") == module_device(sharded)  # type: ignore[arg-type]
    # (no forward here: torch 2.6's FSDP2 cannot run one on the CPU, its streams lack
    # record_event; the two-rank job runs FSDP2 forwards)


def test_the_not_materialised_fix_offers_reset_parameters_only_where_the_model_has_it(
    mesh: object,
) -> None:
    """A model without reset_parameters() (an nn.Sequential), sharded on meta: the fix is
    to_empty then a state dict, not a call the model lacks."""
    from torch.distributed.fsdp import fully_shard

    with on_device("meta"):
        model = nn.Sequential(nn.Linear(2, 2))
    sharded = fully_shard(model, mesh=mesh)  # type: ignore[arg-type]

    @device_agnostic
    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)  # type: ignore[no-any-return]

    assert not hasattr(sharded, "reset_parameters")
    with pytest.raises(DeviceMismatchError) as error:
        step(sharded, torch.ones(2))  # type: ignore[arg-type]
    fix = str(error.value).splitlines()[-1]
    assert fix.startswith('fix: model.to_empty(device="cpu"), then initialise it (load a state')


def test_fsdp2_module_computes_where_fully_shard_ran(
    mesh: object, two: tuple[torch.device, torch.device]
) -> None:
    """Sharded inside on_device on the second device, an FSDP2 module's target outside the
    block is still that device (fully_shard fixed where it computes when it ran), not the
    device current at the call; its parameters there are not called offloaded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from devicectx.decorator._target import module_label

    second = two[1]
    with on_device(second):
        model = fully_shard(nn.Linear(2, 2), mesh=init_device_mesh(second.type, (1,)))
        x = torch.ones(2)

    @device_agnostic(move=False)
    def step(model: nn.Module, x: torch.Tensor) -> torch.device:
        return x.device

    assert second == fsdp_compute_device(model)  # type: ignore[arg-type]
    assert second == module_device(model)  # type: ignore[arg-type]
    assert second == step(model, x)  # type: ignore[arg-type]
    assert module_label(model, "model") == (  # type: ignore[arg-type]
        f"the compute device of model (FSDPLinear), sharded by fully_shard over mesh "
        f"{second.type} [0]"
    )


# A wrapped model moved by to_device: refused before anything moves.


def test_to_device_refuses_a_ddp_model_whose_parameters_would_move(mesh: object) -> None:
    """DDP keeps syncing the parameters it was given: to_device of a DDP model to another
    device (alone, or inside a structure) moves nothing and says to move before wrapping."""
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    before = list(ddp.parameters())

    with pytest.raises(MoveError) as error:
        to_device(ddp, "meta")
    assert [
        "to_device() cannot move obj (a DistributedDataParallel) to meta, and moved nothing: "
        "DistributedDataParallel keeps syncing the parameters it was given, so a moved "
        "model's gradients would no longer be averaged across processes:",
        "    obj (DistributedDataParallel): parameters on cpu",
        "fix: leave it where it is: do not move obj; or move the model before wrapping it: "
        'model.to("meta"), then DistributedDataParallel(model, ...); a wrapped model is not '
        "moved afterwards (and never implicitly)",
    ] == str(error.value).splitlines()
    with pytest.raises(MoveError) as nested:
        to_device({"x": torch.ones(2), "model": ddp}, "meta")
    lines = str(nested.value).splitlines()
    assert lines[0].startswith("to_device() cannot move obj['model'] (a DistributedDataParallel)")
    assert "    obj['model'] (DistributedDataParallel): parameters on cpu" == lines[1]
    assert before == list(ddp.parameters())
    assert {torch.device("cpu")} == {p.device for p in ddp.parameters()}


def test_to_device_leaves_a_wrapped_model_already_on_the_target(
    mesh: object, two: tuple[torch.device, torch.device]
) -> None:
    """A DDP or fully_shard model already on the target moves nothing and is not refused,
    also where a structure holding it has a module that moves (the modules are checked
    then)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    assert ddp is to_device(ddp, "cpu")
    second = two[1]
    with on_device(second):
        sharded = fully_shard(nn.Linear(2, 2), mesh=init_device_mesh(second.type, (1,)))
    head = nn.Linear(2, 2)

    moved = to_device({"head": head, "model": sharded}, second)

    assert (head, sharded) == (moved["head"], moved["model"])
    assert {second} == {p.device for p in [*head.parameters(), *sharded.parameters()]}


def test_to_device_refuses_a_fully_shard_model_whose_parameters_would_move(
    mesh: object,
) -> None:
    """fully_shard fixed where the model computes when it ran: to_device of it to another
    device moves nothing and names the outermost sharded module, with fully_shard's fix."""
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    fully_shard(model[0], mesh=mesh)  # type: ignore[arg-type]
    fully_shard(model, mesh=mesh)  # type: ignore[arg-type]

    with pytest.raises(MoveError) as error:
        to_device({"model": model}, "meta")
    assert [
        "to_device() cannot move obj['model'] (an FSDPSequential) to meta, and moved "
        "nothing: fully_shard fixed the device it computes on (cpu) when it ran, so a moved "
        "model would fail at its next forward:",
        "    obj['model'] (FSDPSequential): parameters on cpu",
        "fix: leave it where it is: to_device(obj, 'meta', skip=[\"obj['model']\"]); or move "
        'the model before wrapping it: model.to("meta"), then fully_shard(model); a wrapped '
        "model is not moved afterwards (and never implicitly)",
    ] == str(error.value).splitlines()
    assert {torch.device("cpu")} == {p.device for p in model.parameters()}


def test_a_decorated_call_refuses_an_fsdp2_model_moved_after_fully_shard(
    mesh: object, two: tuple[torch.device, torch.device]
) -> None:
    """An FSDP2 model wholly on a device that is neither where it computes nor the CPU
    (moved after fully_shard, by torch's .to) is refused before the body, with the target
    it computes on and the fix that moves the model before fully_shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    first, second = two
    with on_device(second):
        model = fully_shard(nn.Linear(2, 2), mesh=init_device_mesh(second.type, (1,)))
    model.to(first)

    @device_agnostic
    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the body ran")

    with pytest.raises(DeviceMismatchError) as error:
        step(model, torch.ones(2))  # type: ignore[arg-type]
    name = f"{step.__qualname__}"
    assert [
        f"{name}() got model (FSDPLinear) on {first}, not on its target:",
        f"    {first} <- model",
        f"target {second} (from the compute device of model (FSDPLinear), sharded by "
        f"fully_shard over mesh {second.type} [0])",
        f'fix: move the model before wrapping it: model.to("{second}"), then '
        "fully_shard(model); a wrapped model is not moved afterwards (and never implicitly)",
    ] == str(error.value).splitlines()
