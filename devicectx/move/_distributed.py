"""What devicectx knows of torch.distributed: DTensors, FSDP2 modules, wrappers, the job.

Nothing here imports ``torch.distributed``'s submodules: a DTensor or an FSDP2 module
can only exist once torch has imported the module that defines its class, so each
question first looks in ``sys.modules`` and answers "no" at once where it is not there.
A program that never touches torch.distributed pays one dictionary lookup, and
``import devicectx`` stays as quick as it was.

The public APIs used (``DTensor.placements``, ``.device_mesh``, ``DeviceMesh.device_type``,
``FSDPModule``, ``torch.distributed.is_initialized``/``get_backend``) are the same on every
torch from 2.6 to 2.15. The one private fact relied on: a parameter of a tensor subclass
(``nn.Parameter(dtensor)``) is an instance of the subclass flagged ``_is_param``, not of
``nn.Parameter`` (:mod:`devicectx.move._alias` rebuilds it so), checked on 2.6, 2.13, 2.15.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from devicectx._torch.fsdp import fsdp_module_type, fsdp_state_device

_Tensor = torch.Tensor


def dtensor_type() -> type | None:
    """``DTensor``, where torch has imported it; else None (and no DTensor exists)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor_type(tp: type) -> bool:
    """Whether ``tp`` is ``DTensor`` or a subclass of it."""
    dtensor = dtensor_type()
    return dtensor is not None and issubclass(tp, dtensor)


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor (a parameter of one too)."""
    return type(tensor) is not _Tensor and is_dtensor_type(type(tensor))


class Layout(NamedTuple):
    """How a tensor is laid out: :func:`find_layouts` groups tensors by it.

    Attributes:
        device: the device of the tensor's (local) data: ``tensor.device``.
        kind: ``"plain"`` (a tensor of this process), ``"replicated"`` (a DTensor whose
            placements are all ``Replicate``), ``"sharded"`` (one or more ``Shard``) or
            ``"partial"`` (a ``Partial`` sum awaiting its reduction, no ``Shard``).
        placements: the DTensor's placements as torch writes them (``("Shard(dim=0)",)``);
            ``()`` for a plain tensor.
        mesh: the DTensor's ``DeviceMesh``; None for a plain tensor.
    """

    device: torch.device
    kind: str
    placements: tuple[str, ...] = ()
    mesh: Any = None

    def __str__(self) -> str:
        if self.mesh is None:
            return f"plain on {self.device}"
        return (
            f"{self.kind} [{', '.join(self.placements)}] on {_mesh(self.mesh)}, "
            f"local data on {self.device}"
        )


def layout_of(tensor: torch.Tensor) -> Layout:
    """The :class:`Layout` of one tensor."""
    if not is_dtensor(tensor):
        return Layout(tensor.device, "plain")
    placements = tuple(tensor.placements)  # type: ignore[attr-defined]
    names = tuple(repr(placement) for placement in placements)
    if any(placement.is_shard() for placement in placements):
        kind = "sharded"
    elif all(placement.is_replicate() for placement in placements):
        kind = "replicated"
    else:
        kind = "partial"
    return Layout(tensor.device, kind, names, tensor.device_mesh)  # type: ignore[attr-defined]


def _mesh(mesh: Any) -> str:
    """``mesh cpu [0, 1]``: the device type and the ranks, shorter than its repr."""
    try:
        ranks = mesh.mesh.tolist()
    except Exception:
        return repr(mesh)
    names = getattr(mesh, "mesh_dim_names", None)
    dims = f" ({', '.join(names)})" if names else ""
    return f"mesh {mesh.device_type} {ranks}{dims}"


# The decorator's check: DTensors and plain tensors in one call.


def mixed_message(
    function: str, dtensors: Mapping[str, Layout], plain: Mapping[str, torch.Tensor]
) -> str:
    """The error for a call given DTensors and plain tensors together.

    DTensor ops refuse a plain tensor of more than one element (``aten.add.Tensor got
    mixed torch.Tensor and DTensor``); torch says so only once the body reaches the op.
    """
    lines = [f"{function}() got DTensors and plain tensors together:"]
    rows = [(path, str(layout)) for path, layout in dtensors.items()]
    rows += [(path, f"plain tensor on {tensor.device}") for path, tensor in plain.items()]
    width = max(len(path) for path, _ in rows)
    lines += [f"    {path:<{width}} : {what}" for path, what in rows]
    first_path, first = next(iter(dtensors.items()))
    stray = next(iter(plain))
    mesh = "mesh" if first.mesh is None else f"{first_path}.device_mesh"
    lines.append("a DTensor op takes only DTensors (and tensors of one element)")
    lines.append(
        f"fix: make {stray} a DTensor: DTensor.from_local({stray}, {mesh}, [Replicate()]) "
        f"if every rank holds the same {stray} (or its own shard: [Shard(dim)]), "
        f"distribute_tensor({stray}, {mesh}, {first_path}.placements) to split a full "
        f"tensor from rank 0; or pass {first_path}.to_local() or "
        f"{first_path}.full_tensor() to compute on plain tensors"
    )
    return "\n".join(lines)


def split_mixed(
    named: Iterable[tuple[str, torch.Tensor]],
) -> tuple[dict[str, Layout], dict[str, torch.Tensor]]:
    """The DTensors and the plain tensors a DTensor op refuses (more than one element)."""
    dtensors: dict[str, Layout] = {}
    plain: dict[str, torch.Tensor] = {}
    for path, tensor in named:
        if type(tensor) is not _Tensor and is_dtensor(tensor):
            dtensors.setdefault(path, layout_of(tensor))
        elif tensor.numel() > 1:
            plain.setdefault(path, tensor)
    return dtensors, plain


# Modules: FSDP2 and the wrappers that must be given a model already on its device.


def fsdp_compute_device(module: nn.Module) -> torch.device | None:
    """Where an FSDP2 (``fully_shard``) module computes; None for any other module.

    FSDP2 computes on the device ``fully_shard`` fixed when it ran (its mesh's device type
    at the index current then: sharded inside ``on_device("cuda:1")``, it computes on
    ``cuda:1`` after the block too), whatever device its sharded parameters sit on
    between steps: with CPU offload (``offload_policy=CPUOffloadPolicy()``) they stay on
    the CPU while it computes on the accelerator, where the inputs must go. Where torch
    does not say which device it fixed, its mesh's device type at the current index.
    """
    fsdp = fsdp_module_type()
    if fsdp is None or not isinstance(module, fsdp):
        return None
    fixed = fsdp_state_device(module)
    if fixed is not None:
        return fixed
    for param in module.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None:
            from devicectx.devices._resolve import resolve_device

            kind = str(mesh.device_type)
            return torch.device("cpu") if kind == "cpu" else resolve_device(kind)
    return None


def fsdp_label(module: nn.Module, name: str) -> str | None:
    """Why an FSDP2 module's target is what it is, in words; None for any other module."""
    compute = fsdp_compute_device(module)
    if compute is None:
        return None
    param = next((p for p in module.parameters() if is_dtensor(p)), None)
    mesh = _mesh(param.device_mesh) if param is not None else "its mesh"  # type: ignore[attr-defined]
    kept = param.device if param is not None else compute
    # Only the CPU is an offload: meta is not made yet, another device a misplaced model.
    offloaded = kept.type == "cpu" and compute.type != "cpu"
    offload = f"; its parameters are kept on {kept} (CPU offload)" if offloaded else ""
    return (
        f"the compute device of {name} ({type(module).__name__}), sharded by fully_shard "
        f"over {mesh}{offload}"
    )


def wrapper_name(module: nn.Module) -> str | None:
    """``"DistributedDataParallel"``, ``"fully_shard"``, ...: a wrapper that must be given
    a model already on its device; None for any other module."""
    parallel = getattr(nn.parallel, "DistributedDataParallel", None)
    if isinstance(module, nn.DataParallel) or (
        parallel is not None and isinstance(module, parallel)
    ):
        return type(module).__name__
    fsdp1 = getattr(sys.modules.get("torch.distributed.fsdp"), "FullyShardedDataParallel", None)
    if isinstance(fsdp1, type) and isinstance(module, fsdp1):
        return "FullyShardedDataParallel"
    fsdp = fsdp_module_type()
    if fsdp is not None and isinstance(module, fsdp):
        return "fully_shard"
    return None


# The job, for the device report.


class Job(NamedTuple):
    """This process's place in a torchrun job, from its environment and torch.distributed."""

    rank: int | None
    world_size: int | None
    local_rank: int | None
    local_world_size: int | None
    backend: str | None  # the initialised process group's, else None

    @property
    def prefix(self) -> str:
        """``[rank 1] ``, where the world is larger than one; else nothing."""
        if self.rank is not None and self.world_size is not None and self.world_size > 1:
            return f"[rank {self.rank}] "
        return ""


def job() -> Job:
    """This process's ranks and sizes (torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``; an initialised process group's own where there is one) and the
    process group's backend."""
    rank, world = _int("RANK"), _int("WORLD_SIZE")
    backend = None
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        backend = str(dist.get_backend())
    return Job(rank, world, _int("LOCAL_RANK"), _int("LOCAL_WORLD_SIZE"), backend)


def _int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() else None
