"""Every exception and warning devicectx raises.

Each exception subclasses what PyTorch users already catch (``ValueError`` for bad
input, ``RuntimeError`` for a state of the machine) and :class:`DeviceError`,
so ``except devicectx.DeviceError`` catches all of ours. Each warning is a
:class:`DeviceWarning`, a ``UserWarning``, so one filter silences them all.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

import torch


class DeviceError(Exception):
    """Base class of every devicectx exception."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Made again from its message and attributes, not by __init__, whose keyword-only
        # arguments pickle's default (the class called with the message) would miss: an
        # error raised in a worker process reaches its parent whole.
        return (_unpickled, (type(self), self.args, self.__dict__))


def _unpickled(cls: type[DeviceError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class InvalidDeviceError(DeviceError, ValueError):
    """A device spec that is malformed: ``"gpu"``, ``"cuda:-1"``, ``3.5``."""


class DeviceUnavailableError(DeviceError, RuntimeError):
    """A well-formed device that this machine does not have: ``"cuda:3"`` with 2 GPUs."""


class InvalidPrecisionError(DeviceError, ValueError):
    """A precision name devicectx does not know: ``"fp16"``, ``"bf16-true"``."""


class PrecisionUnsupportedError(DeviceError, RuntimeError):
    """A known precision that the device cannot run: ``"bf16-mixed"`` on a GPU before Ampere.

    A ``RuntimeError``, like torch's own error for bfloat16 autocast on such a GPU, so code
    that catches that keeps working.
    """


class MoveError(DeviceError, RuntimeError):
    """An object inside a structure could not be moved; the message names its path."""


class MoveOutOfMemoryError(MoveError, torch.OutOfMemoryError):
    """A :class:`MoveError` whose cause is that the target device ran out of memory.

    It exists so that ``except torch.OutOfMemoryError`` around a move catches it, as it
    catches torch's own ``.to``, while ``except devicectx.MoveError`` still does too and
    the message still names the path and the fix. Raised only where torch raised a
    ``torch.OutOfMemoryError`` (CUDA, ROCm, XPU, the emulated device): MPS, which raises
    a ``RuntimeError``, gets a plain :class:`MoveError`, as torch's own ``.to`` would.
    """


#: The part of an out-of-memory move's fix that points at the back-off, which a back-off
#: that found the move does not shrink leaves out.
SMALLER_BATCHES = "move less at once (devicectx.shrink_batch_on_oom retries with smaller batches)"


class DtypeUnsupportedError(DeviceError, TypeError):
    """Tensors of a dtype the target device cannot hold (float64 on MPS); the message
    names every path, by dtype.

    A ``TypeError``, like torch's own error for float64 on MPS, so code that catches that
    keeps working.

    Attributes:
        device: the device that cannot hold them.
        paths: each dtype it cannot hold, with the paths of the tensors of that dtype.

    Every argument but the message has a default, so that the class can be made from the
    message alone, as torch's DataLoader does to raise a worker's error again in the
    parent (``device`` None and ``paths`` empty there; the message still says all).
    """

    def __init__(
        self,
        message: str,
        *,
        device: torch.device | None = None,
        paths: Mapping[torch.dtype, Sequence[str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.device = device
        self.paths: dict[torch.dtype, list[str]] = {d: list(p) for d, p in (paths or {}).items()}


class DeviceMismatchError(DeviceError, RuntimeError):
    """Tensors (or a module) on other devices than a call needs.

    Attributes:
        devices: each device found, with the argument paths of the tensors on it.
        target: the device the call needed, or ``None`` when none could be chosen.
        reason: why that target was chosen, in words.

    Made from the message alone (as torch's DataLoader raises a worker's error again in the
    parent), ``devices`` is empty, ``target`` None and ``reason`` empty.
    """

    def __init__(
        self,
        message: str,
        *,
        devices: Mapping[torch.device, Sequence[str]] | None = None,
        target: torch.device | None = None,
        reason: str = "",
    ) -> None:
        super().__init__(message)
        self.devices: dict[torch.device, list[str]] = {
            d: list(p) for d, p in (devices or {}).items()
        }
        self.target = target
        self.reason = reason


class BatchTooLargeError(DeviceError, torch.OutOfMemoryError):
    """Out of memory even at the smallest batch size allowed.

    It is a ``torch.OutOfMemoryError``, so code that already catches that keeps working.

    Attributes:
        tried: every batch size that was tried, in order (empty where the error was made
            from its message alone, as torch's DataLoader raises a worker's error again).
    """

    def __init__(self, message: str, *, tried: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.tried: list[int] = list(tried)


class StrayTensorError(DeviceError, RuntimeError):
    """A tensor made inside ``on_device(..., audit="raise")`` that is not on the block's device.

    The message is the :class:`StrayTensorWarning` text the block would otherwise warn with.
    """


class ScopeExitError(DeviceError, RuntimeError):
    """An ``on_device`` object left more times than it was entered.

    A ``RuntimeError``, like torch's own error for one exit too many of ``torch.device``
    ("trying to pop from empty mode stack"), so code that catches that keeps working.
    """


class RegistrationError(DeviceError, TypeError):
    """A :func:`~devicectx.register_container` registration that cannot work: its
    ``children=`` gives something other than ``(key, child)`` pairs."""


class DeviceWarning(UserWarning):
    """Base class of every devicectx warning: filter it to silence them all."""


class RepeatedMoveWarning(DeviceWarning):
    """The same unchanged tensor was moved again by the same place (a copy every step)."""


class StrayTensorWarning(DeviceWarning):
    """A tensor made inside an audited ``on_device`` block landed on another device."""


# Printed and pickled as devicectx.X, the name users import them by (as torch's public
# names are): a traceback then shows what to catch. Pickles naming devicectx._errors.X
# still load, as the classes stay here. Every class of ours above, so that a new one
# cannot be left out (devicectx/__init__.py must export it: tests/test_layout.py checks).
for _public in [
    value
    for value in globals().values()
    if isinstance(value, type)
    and issubclass(value, (DeviceError, DeviceWarning))
    and value.__module__ == __name__
]:
    _public.__module__ = "devicectx"
del _public


def without_fix(error: BaseException) -> str:
    """``error``'s message less its ``fix:`` lines, for a caller that says its own fix.

    Example:
        >>> without_fix(ValueError("invalid device 'gpu'\\nfix: pass 'cuda'"))
        "invalid device 'gpu'"
    """
    return "\n".join(line for line in str(error).splitlines() if not line.startswith("fix:"))


def with_article(name: str) -> str:
    """A type's name as messages write it, with the article it is read with.

    Example:
        >>> [with_article(name) for name in ["Tensor", "Embedding", "UserDict", "Upsample"]]
        ['a Tensor', 'an Embedding', 'a UserDict', 'an Upsample']
        >>> [with_article(name) for name in ["LSTM", "RNNCell", "GRU", "OneCycleLR"]]
        ['an LSTM', 'an RNNCell', 'a GRU', 'a OneCycleLR']
    """
    if name[:2].isupper():  # an acronym, read letter by letter: an LSTM, a GRU
        vowel_sound = name[0] in _VOWEL_SOUNDING_LETTERS
    else:
        vowel_sound = name[:1] in "AEIOUaeiou" and not name.lower().startswith(_READ_WITH_A)
    return f"{'an' if vowel_sound else 'a'} {name}"


_VOWEL_SOUNDING_LETTERS = "AEFHILMNORSX"
"""The capitals whose names start with a vowel sound: an F, an L, an M, an S."""

_READ_WITH_A = ("one", "uni", "usa", "use", "usu", "uti", "eu")
"""Beginnings read with a consonant sound: a OneCycleLR, a UserDict, a Unique..."""


def check_switches(call: str, *, lead: str = "", **switches: object) -> None:
    """Refuse an on/off option given anything but ``True`` or ``False``, as torch's own
    ``.to(non_blocking=...)`` does.

    ``"no"`` (or ``"False"``, or a numpy bool) is truthy: taken for a switch, it would do
    what its truth says, not what it reads. ``call`` names the call in the message
    (``"to_device"``, ``"@device_agnostic"``); ``lead``, the arguments its fix writes
    before the option (``"obj, device, "``).

    Example:
        >>> check_switches("to_device", lead="obj, device, ", non_blocking=True)
        >>> check_switches("to_device", lead="obj, device, ", non_blocking="no")
        Traceback (most recent call last):
        TypeError: to_device(non_blocking='no'): non_blocking takes True or False, not a str
        fix: to_device(obj, device, non_blocking=True) or to_device(obj, device, non_blocking=False)

    Raises:
        TypeError: the first such option, with the fix.
    """
    for name, value in switches.items():
        if type(value) is not bool:
            msg = (
                f"{call}({name}={value!r}): {name} takes True or False, not "
                f"{with_article(type(value).__qualname__)}\n"
                f"fix: {call}({lead}{name}=True) or {call}({lead}{name}=False)"
            )
            raise TypeError(msg)


def warn_at(frame: FrameType, message: str, category: type[DeviceWarning]) -> None:
    """Warn as from ``frame`` (the user's line), through its module's warning registry,
    so that warnings filters and Python's own once-per-line rule apply there."""
    warn_explicit_at(frame.f_code.co_filename, frame.f_lineno, frame.f_globals, message, category)


def warn_explicit_at(
    filename: str,
    line: int,
    scope: dict[str, Any],
    message: str,
    category: type[DeviceWarning],
) -> None:
    """Warn as from ``line`` of ``filename``, a module whose globals are ``scope``: as
    :func:`warn_at`, for a line whose frame has returned (a warning given on another
    thread, about that line)."""
    warnings.warn_explicit(
        message,
        category,
        filename,
        line,
        module=scope.get("__name__", "<string>"),
        registry=scope.setdefault("__warningregistry__", {}),
    )
