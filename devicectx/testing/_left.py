"""What a run of ``fn`` left in the modules it was given, for ``assert_device_agnostic``.

A training step returns its loss, computed before the step: a device whose backward gives
other gradients returns the same loss. So after each run, each module copy's state is
compared as an output is, by path: a parameter by its gradient where it has one
(``model.lin.weight.grad``), by its value where it has none (a frozen weight, a step that
zeroes its gradients at its end), and each buffer by its value. A weight an optimizer
stepped is not compared where its gradient is: an adaptive optimizer's first steps move a
weight by about ``lr * sign(grad)``, so the rounding noise of a gradient that is zero in
exact arithmetic (a bias before a BatchNorm) moves it by that much, another way on each
device, where the gradients agree within any tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.nn.parameter import is_lazy

from devicectx.move._rebuild import Call

# The fixes of what differs in the modules' state, where the comparison's own speak of
# what fn returns.
LEFT_FIXES = {
    "structure": (
        "fix: make {name} leave the same gradients, parameters and buffers in its modules on "
        "every device: a gradient on one device only is a backward that reached that "
        "parameter there alone"
    ),
    "exact": (
        "fix: integer and bool buffers are compared exactly, whatever rtol and atol: make "
        "{name} update {path} alike on every device"
    ),
}


def left_in(modules: Sequence[tuple[str, nn.Module, nn.Module]]) -> Call:
    """The state of each module copy (``(path, original, copy)``), in one call's arguments
    named by path: each parameter's gradient (``path.name.grad``), or the parameter where
    it has none, then each buffer. The entries follow the originals, the same on every
    device (a move to meta, or to a backend out of tree, unties a weight two modules
    share): a tensor two modules share, once, at its first path; a lazy module's
    parameters, not made yet, left out.

    Example:
        >>> import torch
        >>> lin = nn.Linear(2, 1)
        >>> list(left_in([("model", lin, lin)]).kwargs)
        ['model.weight', 'model.bias']
        >>> lin(torch.ones(2)).sum().backward()
        >>> list(left_in([("model", lin, lin)]).kwargs)
        ['model.weight.grad', 'model.bias.grad']
    """
    entries: dict[str, object] = {}
    met: set[int] = set()
    for path, original, copied in modules:
        for name, parameter in original.named_parameters(remove_duplicate=False):
            if id(parameter) in met or is_lazy(parameter):
                continue
            met.add(id(parameter))
            left = copied.get_parameter(name)
            if left.grad is None:
                entries[f"{path}.{name}"] = left
            else:
                entries[f"{path}.{name}.grad"] = left.grad
        for name, buffer in original.named_buffers(remove_duplicate=False):
            if id(buffer) in met or is_lazy(buffer):
                continue
            met.add(id(buffer))
            entries[f"{path}.{name}"] = copied.get_buffer(name)
    return Call((), entries, (), "args")
