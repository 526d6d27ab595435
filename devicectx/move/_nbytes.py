"""The bytes a tensor's copy sends to another device: what it holds, not what it stands for.

``tensor.nbytes`` is elements times element size, which is what a plain strided tensor
holds, but not what a sparse or nested tensor does: a 100,000 x 100,000 sparse matrix with
1,000 nonzeros holds a few kilobytes and would count as 37 GiB (a sparse COO tensor
refuses ``nbytes`` outright). :func:`bytes_of` counts the tensors a copy carries instead.
:mod:`devicectx.move._transfers` and :mod:`devicectx.move._repeats` read a tensor's bytes
here only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.masked import MaskedTensor

__all__ = ["bytes_of"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
_COO = torch.sparse_coo
_ROWS = (torch.sparse_csr, torch.sparse_bsr)  # compressed rows: crow_indices, col_indices
_COLUMNS = (torch.sparse_csc, torch.sparse_bsc)  # compressed columns: ccol_indices, row_indices


def bytes_of(tensor: torch.Tensor) -> int:
    """The bytes a copy of ``tensor`` to another device carries.

    Example:
        >>> import torch
        >>> identity = torch.eye(1000)
        >>> bytes_of(identity), bytes_of(identity.to_sparse())  # 2 x 1000 indices, 1000 values
        (4000000, 20000)

    A plain strided tensor: its elements times their size (``tensor.nbytes``). Sparse COO:
    its indices and values; CSR, CSC, BSR, BSC: its compressed and plain indices and
    values; a jagged nested tensor: its values and offsets (and lengths, where it has
    them); a strided nested tensor: its buffer and its sizes; a ``MaskedTensor``: its data
    and mask; a traceable wrapper subclass (one with ``__tensor_flatten__``): its inner
    tensors, each counted as here.
    """
    # The hot path (every tensor of a tracked move): a plain tensor, three attribute reads.
    if type(tensor) in _PLAIN and tensor.layout is _STRIDED and not tensor.is_nested:
        return tensor.nbytes
    try:
        parts = _parts(tensor)
        return tensor.nbytes if parts is None else sum(bytes_of(part) for part in parts)
    except Exception:  # a layout or subclass this module does not know: its dense size
        return tensor.numel() * tensor.element_size()


def _parts(tensor: torch.Tensor) -> list[torch.Tensor] | None:
    """The tensors a copy of ``tensor`` carries, for a tensor that is not a plain one;
    None for a strided one of a subclass that holds nothing else (its own elements)."""
    layout = tensor.layout
    if tensor.is_nested:
        if layout is torch.jagged:
            jagged: Any = tensor  # a NestedTensor, whose class torch keeps in a private module
            lengths = jagged.lengths()
            parts = [jagged.values(), jagged.offsets()]
            return parts if lengths is None else [*parts, lengths]
        # Strided (the default layout of torch.nested.nested_tensor): values() is its
        # buffer, and its sizes come from a private method (checked on torch 2.13; where
        # either is missing, the except below counts the buffer's elements alone).
        return [tensor.values(), tensor._nested_tensor_size()]
    if layout is _COO:  # _indices(): an uncoalesced tensor's too, which indices() refuses
        return [tensor._indices(), tensor._values()]
    if layout in _ROWS:
        return [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    if layout in _COLUMNS:
        return [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    if isinstance(tensor, MaskedTensor):
        return [tensor.get_data(), tensor.get_mask()]  # type: ignore[no-untyped-call]
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is not None:
        names, _ = flatten(tensor)
        return [getattr(tensor, name) for name in names]
    return None
