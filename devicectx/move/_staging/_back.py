"""Accelerator tensors back to the host, staged: packed on the device, one copy out."""

from __future__ import annotations

from collections.abc import Callable

import torch

from devicectx.move import _pinned
from devicectx.move._staging._layout import (
    Thresholds,
    _aligned,
    _Key,
    _pack,
    _regions,
    _sort,
    _Typed,
    _unpack,
)

__all__ = ["to_host"]


def to_host(
    found: dict[int, torch.Tensor],
    inside: dict[int, torch.Tensor],
    source: Callable[[torch.Tensor], bool],
    thresholds: Thresholds,
    host: _pinned.Host,
) -> dict[int, torch.Tensor]:
    """Small accelerator tensors of ``found`` (those ``source`` accepts) on the host, staged:
    ``{id(source): result}``; empty where staging would not pay. Blocking."""
    groups, _ = _sort(found, inside, source, thresholds.share_max_bytes)
    by_device: dict[torch.device, dict[_Key, list[torch.Tensor]]] = {}
    for key, members in groups.items():
        for tensor in members:
            by_device.setdefault(tensor.device, {}).setdefault(key, []).append(tensor)
    results: dict[int, torch.Tensor] = {}
    for device, on_device in by_device.items():
        if sum(map(len, on_device.values())) < thresholds.min_tensors:
            continue
        regions = _regions(on_device, thresholds.shared_bytes)
        while regions:
            batch, used = [], 0  # the regions that fit in one chunk, and where each starts
            while regions and used + _aligned(regions[0][0]) <= thresholds.chunk_bytes:
                size, runs = regions.pop(0)
                batch.append((used, _aligned(size), runs))
                used += _aligned(size)
            packed = _Typed(torch.empty(used, dtype=torch.uint8, device=device))
            for start, _, runs in batch:
                for run in runs:
                    _pack(packed(run.dtype), start, run)
            chunk = host.pool.acquire()
            try:
                staging = chunk.buffer[:used]
                staging.copy_(packed.buffer)  # blocking: the host reads it next
                for start, padded, runs in batch:
                    region = staging[start : start + padded].clone()  # its own memory
                    for run in runs:
                        _unpack(region, run, results)
            finally:
                host.pool.release(chunk, None, None)
    return results
