"""Slices of a storage made at C++ speed: what a staged move's small results stand on.

``UntypedStorage.__getitem__`` is a Python override that checks the device (``meta`` has no
memory) before calling ``torch._C.StorageBase.__getitem__``, which makes the slice: a
storage over those bytes that keeps the whole storage's memory alive and cannot be resized.
The check costs more than the slice; the staged move calls it once per small tensor, never
on ``meta``, so it calls the C++ method itself. Checked on torch 2.6.0 to 2.15.0; where a
release lacks it, the public indexing is used.

Example:
    >>> import torch
    >>> storage = torch.arange(4, dtype=torch.uint8).untyped_storage()
    >>> part = storage_slice(storage, 1, 3)
    >>> part.tolist(), part.resizable()
    ([1, 2], False)
"""

import operator
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["base_of", "below_autograd", "is_cpu_scalar", "storage_slice", "version_of"]

#: ``tensor._base``: the tensor a view was made from, or ``None``. Bound as an attrgetter so
#: the per-call move path pays no Python call frame for it.
base_of: Callable[[torch.Tensor], torch.Tensor | None] = operator.attrgetter("_base")

#: ``tensor._version``: the counter of in-place changes to a tensor's memory.
version_of: Callable[[torch.Tensor], int] = operator.attrgetter("_version")

_GETITEM: Callable[[Any, slice], Any] = getattr(
    getattr(torch._C, "StorageBase", None), "__getitem__", operator.getitem
)


#: A block whose ops skip the dispatcher's autograd and in-place/view layers: for tensors
#: made from scratch that need neither (a staged move's results: plain, no grad, nobody's
#: view, at version 0 as ``.to`` makes them), where those layers were about a third of the
#: cost of each ``set_``. ``torch._C._AutoDispatchBelowADInplaceOrView`` is what torch's
#: own kernels use for that; it marks no tensor (unlike inference mode). Checked on torch
#: 2.6.0 to 2.15.0.
below_autograd: Callable[[], Any] = torch._C._AutoDispatchBelowADInplaceOrView


def storage_slice(storage: Any, start: int, stop: int) -> Any:
    """Bytes ``start`` to ``stop`` of an ``UntypedStorage`` not on ``meta``, as a storage of
    their own that keeps ``storage``'s memory alive and cannot be resized."""
    return _GETITEM(storage, slice(start, stop))


_functorch = torch._C._functorch
_is_wrapped: Callable[[torch.Tensor], bool] = _functorch.is_functorch_wrapped_tensor
_is_batched: Callable[[torch.Tensor], bool] = _functorch.is_batchedtensor
_unwrapped: Callable[[torch.Tensor], torch.Tensor] = _functorch.get_unwrapped


def is_cpu_scalar(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a 0-dim CPU tensor, which torch's ops mix with any device.

    Under ``torch.func.vmap``, a tensor that is 0-dim per sample is not one: its data holds
    the batch dimension, and torch refuses to mix it (``is_batchedtensor``, looked for
    through the wrappers of ``grad`` and nested transforms). Checked on torch 2.6.0 to
    2.15.0.

    Example:
        >>> import torch
        >>> from torch.func import vmap
        >>> is_cpu_scalar(torch.tensor(1.0)), is_cpu_scalar(torch.ones(2))
        (True, False)
        >>> vmap(lambda s: torch.tensor(is_cpu_scalar(s)))(torch.ones(3)).tolist()
        [False, False, False]
    """
    if tensor.dim() != 0 or tensor.device.type != "cpu":
        return False
    while _is_wrapped(tensor):
        if _is_batched(tensor):
            return False
        tensor = _unwrapped(tensor)
    return True
