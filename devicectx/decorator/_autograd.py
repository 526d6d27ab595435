"""Which ``torch.autograd.Function`` a ``forward`` or ``backward`` belongs to.

torch runs a Function's ``forward`` with grad off and gives its outputs the Function's own
backward node, so a move inside ``forward`` has no backward: the gradient ``backward``
returns for a moved input is on the wrong device. The decorator refuses such a move, and
the testing kit names the Function in its fixes; both ask this module whose it is.
"""

from __future__ import annotations

from types import CodeType

import torch
from torch.autograd.function import FunctionCtx


def function_of(code: CodeType, first: object) -> str | None:
    """The name of the ``autograd.Function`` whose ``forward`` or ``backward`` runs
    ``code`` with ``first`` as its first argument; None where it is neither.

    A ``first`` that is a ctx answers at once: it is the Function's backward node, of a
    class torch names ``<Function>Backward``. A ``forward`` of the ``setup_context`` form
    takes no ctx, and some torch releases call it from C (no frame of ``Function.apply``
    above it), so it is found by its code among the Function classes alive now (a few
    hundred: callers ask once, or on an error's path).

    Example:
        >>> class Double(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(x):
        ...         return x * 2
        ...
        ...     @staticmethod
        ...     def setup_context(ctx, inputs, output):
        ...         pass
        ...
        ...     @staticmethod
        ...     def backward(ctx, grad):
        ...         return grad * 2
        >>> function_of(Double.forward.__code__, None)
        'Double'
        >>> function_of(function_of.__code__, None) is None
        True
    """
    if isinstance(first, FunctionCtx):
        return type(first).__name__.removesuffix("Backward")
    if code.co_name != "forward":
        return None
    pending: list[type] = [torch.autograd.Function]
    while pending:
        function = pending.pop()
        forward = vars(function).get("forward")
        made = getattr(forward, "__func__", forward)  # a staticmethod's function
        if getattr(made, "__code__", None) is code:
            return function.__name__
        pending += function.__subclasses__()
    return None
