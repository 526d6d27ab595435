"""A decorated call's inputs: the one look every call takes, and the excluded arguments.

:func:`scan` is the hot path of ``@device_agnostic``: it answers "is every tensor
already on one device, and which?", with the recursive walk for plain batches where it can,
else looking at top-level tensors directly and handing containers to the move engine.
:class:`Held` keeps ``exclude=`` arguments out of it. The optimizer arguments it notes
beside a module are :mod:`devicectx.decorator._optimizers`' business.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from devicectx._errors import DeviceMismatchError
from devicectx._torch.tensors import is_cpu_scalar
from devicectx.decorator._params import Exclusion
from devicectx.move import _move
from devicectx.move._containers import KIND_CACHE, kind_for
from devicectx.move._distributed import is_dtensor, mixed_message, split_mixed
from devicectx.move._kinds import OWN
from devicectx.move._walk import MIXED, Mixed, NotPlain, plain_device

_Tensor = torch.Tensor
_Module = nn.Module
_Optimizer = torch.optim.Optimizer
# Values that hold no tensor and need no walk: the scan steps over them.
_LEAVES = frozenset({int, float, bool, str, bytes, type(None), torch.device, torch.dtype})


def host_only(values: Iterable[Any], depth: int = 0) -> bool:
    """Whether ``values`` hold only what lives on the host and names no device: numbers,
    strings, numpy arrays and scalars, modules (the model), and lists, tuples and dicts of
    them: where ``output="input"`` finds no tensor input, the caller's data is then the
    host's. False for anything else (a plain object, which may hold tensors the look did
    not see), and past a few levels of nesting.

    Example:
        >>> import numpy as np
        >>> host_only([np.zeros(3), {"gamma": 0.99}, nn.Linear(2, 2)])
        True
        >>> host_only([object()])
        False
    """
    if depth > _HOST_DEPTH:
        return False
    for value in values:
        kind = type(value)
        if kind in _LEAVES or isinstance(value, _Module) or kind.__module__ == "numpy":
            continue
        if kind in (list, tuple) or (isinstance(value, tuple) and hasattr(kind, "_fields")):
            if not host_only(value, depth + 1):
                return False
        elif kind is dict:
            if not host_only(value.values(), depth + 1):
                return False
        else:
            return False
    return True


_HOST_DEPTH = 4  # a batch's nesting: deeper, the look gives up (and the result stays)


def scan(
    values: tuple[Any, ...], expected: torch.device | None
) -> tuple[torch.device | None, bool, nn.Module | None, tuple[Any, ...] | None]:
    """One look at a call's arguments: the hot path of every call.

    Args:
        values: the arguments, positional then keyword.
        expected: the device the inputs should be on, when already known: containers are
            then checked against it, without looking for their first tensor.

    Returns:
        A device of the inputs (the first tensor's, or ``expected``), whether every
        tensor is on it, the first module argument, and the optimizer arguments beside
        it (None: none; :func:`left_behind` looks at them). A batch of plain containers
        takes :func:`~devicectx.move._walk.plain_device`; anything else, this loop: top-level
        tensors and scalars are looked at directly, containers are checked by the move
        engine (modules are not looked into: they are the module rule's business).
    """
    try:
        return plain_device(values), True, None, None
    except NotPlain:
        pass  # a module, another type, or two devices: the loop below tells which
    first: torch.device | None = None
    uniform = True
    module: nn.Module | None = None
    optimizers: tuple[Any, ...] | None = None
    for value in values:
        if isinstance(value, _Tensor):
            device = value.device
            if first is None:
                first = device
            elif device != first:
                uniform = False
            if type(value) is not _Tensor and is_dtensor(value):
                uniform = False  # the slow path looks closer: found_devices refuses a mix
        elif type(value) in _LEAVES:
            continue
        elif isinstance(value, _Module):
            if module is None:
                module = value
        elif isinstance(value, _Optimizer):  # holds no tensor the walk would see
            optimizers = (value,) if optimizers is None else (*optimizers, value)
        elif uniform:
            # One walk: checks a container against the device known so far, or finds it.
            # Modules nested in containers are checked by their parameters here; one off
            # the device only sends the call down the slow path, which leaves it alone.
            shared = _move.shared_device(
                value, first if first is not None else expected, dtensor_mixes=True
            )
            if shared is MIXED:
                uniform = False
            elif shared is not None:
                first = shared
    # Beside a module argument only: a call of plain values takes plain_device() above,
    # which steps over an optimizer (a leaf), so a call without a module never gets here
    # for sure, and a decorated method's instance is no argument.
    return first, uniform, module, optimizers if module is not None else None


def optimizer_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.optim.Optimizer, ...] | None:
    """The optimizers among a call's top-level arguments, for a method of a module (whose
    instance :func:`scan` does not see); None where there is none."""
    found: tuple[torch.optim.Optimizer, ...] | None = None
    for value in (*args, *kwargs.values()) if kwargs else args:  # a loop: a forward's cost
        if isinstance(value, _Optimizer):
            found = (value,) if found is None else (*found, value)
    return found


def sees_into(instance: object) -> bool:
    """Whether the walk sees tensors in ``instance``, a decorated method's instance that is
    no module: a dataclass, a NamedTuple, a registered container, an object with a ``.to``
    of its own (whose attributes a check reads). Not a plain object, whose attributes are
    read only where torch fails, as an argument's are; nor a class (a classmethod's).

    Per type: the answer is the type's kind, cached (and forgotten at a registration).
    """
    tp = type(instance)
    kind = KIND_CACHE.get(tp) or kind_for(tp)
    return kind.split is not None or kind.role == OWN


def instance_device(instance: object, expected: torch.device | None) -> torch.device | Mixed | None:
    """The one device of the tensors ``instance`` holds (one :func:`sees_into` accepts):
    ``expected`` where given and they are all on it (or there are none), :data:`MIXED`
    where one is elsewhere or they are on several devices, None where there is none and
    nothing was expected.

    Modules inside it are stepped over: they are not the call's to check, and a large model
    held by a dataclass is not walked at every call. 0-dim CPU tensors answer
    :data:`MIXED` off the CPU: :func:`found_devices` then leaves them out.
    """
    kind = KIND_CACHE.get(type(instance)) or kind_for(type(instance))
    if kind.split is not None:
        return _move.shared_device(instance, expected, skip_types=(_Module,), dtensor_mixes=True)
    device = expected  # an object with its own .to: its attributes, as a check reads them
    for _, tensor in _move.iter_tensors(instance, attributes=True):
        found = tensor.device
        if found != device:
            if device is not None or (type(tensor) is not _Tensor and is_dtensor(tensor)):
                return MIXED
            device = found
    return device


def found_devices(
    function: str, named: Iterable[tuple[str, Any, object]], *, attributes: bool = False
) -> dict[torch.device, list[str]]:
    """Each device the inputs are on, with the paths of their tensors on it: the slow
    path's look, taken when the inputs do not all agree (or hold a DTensor).

    0-dim CPU tensors are left out: PyTorch lets them mix with any device. With
    ``attributes``, the tensors in the attributes of objects with their own ``.to`` are
    listed too (a call that moves nothing must check them; a move leaves them to that
    ``.to``).

    Raises:
        DeviceMismatchError: DTensors together with plain tensors of more than one
            element, which every DTensor op refuses; the message names both and the fix.
    """
    named = list(named)
    found: dict[torch.device, list[str]] = {}
    dtensor = False
    for name, value, _ in named:
        for path, tensor in _move.iter_tensors(value, name, attributes=attributes):
            device = tensor.device
            if type(tensor) is not _Tensor and not dtensor:
                dtensor = is_dtensor(tensor)
            if device.type == "cpu" and is_cpu_scalar(tensor):
                continue
            found.setdefault(device, []).append(path)
    if dtensor:  # rare: a second walk, to tell DTensors and plain tensors apart
        tensors = (pair for name, value, _ in named for pair in _move.iter_tensors(value, name))
        dtensors, plain = split_mixed(tensors)
        if dtensors and plain:
            message = mixed_message(function, dtensors, plain)
            reason = "DTensor ops take only DTensors"
            raise DeviceMismatchError(message, devices=found, target=None, reason=reason)
    return found


class Held:
    """A call's arguments with the excluded ones held out of the move and the checks."""

    __slots__ = ("args", "keywords", "kwargs", "order", "positions")

    def __init__(
        self, exclusion: Exclusion, args: tuple[Any, ...], kwargs: dict[str, Any], offset: int
    ) -> None:
        self.positions = {i: v for i, v in enumerate(args) if exclusion.holds_position(i + offset)}
        self.keywords = {k: v for k, v in kwargs.items() if exclusion.holds_keyword(k)}
        # Held positions become None, so the others keep their places (and names).
        self.args = tuple(None if i in self.positions else v for i, v in enumerate(args))
        self.kwargs = {k: v for k, v in kwargs.items() if k not in self.keywords}
        self.order = tuple(kwargs)

    def merge(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Put the held values back among the moved ones, in the caller's keyword order."""
        positions, keywords = self.positions, self.keywords
        merged = tuple(positions.get(i, v) for i, v in enumerate(args))
        return merged, {k: keywords[k] if k in keywords else kwargs[k] for k in self.order}
