"""The errors traced code raises on torch 2.6, in place of the real ones.

Where torch's graph break takes no message (2.6), a refusal found while tracing
(:func:`devicectx.decorator._compiled._refuse`) is a ``raise`` in traced code, and dynamo
builds the error with the message alone: it cannot trace the keyword-only ``__init__`` of
:class:`~devicectx.DeviceMismatchError` or :class:`~devicectx.DtypeUnsupportedError`. The
stand-ins here are subclasses of those that take the message alone, and answer their
attributes from the error the message was made from (:data:`MADE`), which only the latest
few are kept of.

Only torch 2.6 raises them: delete this module whole when the torch floor leaves 2.6 (and
with it the ``raise`` in ``_refuse``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from devicectx import _errors

_Kept = _errors.DeviceMismatchError | _errors.DtypeUnsupportedError


class Made:
    """The errors the traced messages were made from, by message; the latest ``limit``.

    A function has a few kinds of mismatch, so a few are enough; the cap keeps a process
    that compiles many functions from holding every error (and the tensors' names) for good.
    """

    __slots__ = ("_errors", "limit")

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._errors: dict[str, _Kept] = {}

    def keep(self, error: _Kept) -> str:
        """Remember ``error`` by its message, which is returned."""
        message = str(error)
        made = self._errors
        made.pop(message, None)
        made[message] = error
        while len(made) > self.limit:
            # Two threads may trace at once: another may drop the oldest first, or change
            # the dict between ``iter`` and ``next``. Either way the loop looks again.
            try:
                made.pop(next(iter(made)), None)
            except (RuntimeError, StopIteration):
                continue
        return message

    def get(self, message: str) -> _Kept | None:
        """The error ``message`` was made from, or None where it is no longer kept."""
        return self._errors.get(message)


MADE = Made()


class TracedMismatchError(_errors.DeviceMismatchError):
    """:class:`~devicectx.DeviceMismatchError` as traced code raises it (torch 2.6 only).

    Dynamo builds it with the message alone. Where it reaches the user (2.6 raises it from
    compiled code) it answers ``devices``, ``target`` and ``reason`` as the error its
    message was made from; where that is no longer kept: ``{}``, None and ``""``.
    """

    __init__ = RuntimeError.__init__  # dynamo cannot trace the keyword-only __init__

    def __reduce__(self) -> tuple[Callable[[bool, str], _Kept], tuple[bool, str]]:
        return rebuilt, (False, str(self))

    @property
    def devices(self) -> dict[torch.device, list[str]]:  # type: ignore[override]
        made = MADE.get(str(self))
        return made.devices if isinstance(made, _errors.DeviceMismatchError) else {}

    @property
    def target(self) -> torch.device | None:  # type: ignore[override]
        made = MADE.get(str(self))
        return made.target if isinstance(made, _errors.DeviceMismatchError) else None

    @property
    def reason(self) -> str:  # type: ignore[override]
        made = MADE.get(str(self))
        return made.reason if isinstance(made, _errors.DeviceMismatchError) else ""


class TracedDtypeError(_errors.DtypeUnsupportedError):
    """:class:`~devicectx.DtypeUnsupportedError` as traced code raises it (torch 2.6 only),
    answering ``device`` and ``paths`` as the error its message was made from; where that
    is no longer kept: None (the message still names the device) and ``{}``."""

    __init__ = TypeError.__init__  # dynamo cannot trace the keyword-only __init__

    def __reduce__(self) -> tuple[Callable[[bool, str], _Kept], tuple[bool, str]]:
        return rebuilt, (True, str(self))

    @property
    def device(self) -> torch.device | None:  # type: ignore[override]
        made = MADE.get(str(self))
        return made.device if isinstance(made, _errors.DtypeUnsupportedError) else None

    @property
    def paths(self) -> dict[torch.dtype, list[str]]:  # type: ignore[override]
        made = MADE.get(str(self))
        return made.paths if isinstance(made, _errors.DtypeUnsupportedError) else {}


def rebuilt(dtype: bool, message: str) -> TracedMismatchError | TracedDtypeError:
    """A stand-in unpickled: pickle cannot find its class by the public name it prints as."""
    # Typed here: mypy reads a call of a class whose ``__init__`` is a builtin's as Any.
    error: TracedMismatchError | TracedDtypeError
    error = TracedDtypeError(message) if dtype else TracedMismatchError(message)
    return error


# Printed as the public error (torch's report quotes the class, a traceback names it): the
# name users import, and catch, it by.
for _stand_in, _public in (
    (TracedMismatchError, _errors.DeviceMismatchError),
    (TracedDtypeError, _errors.DtypeUnsupportedError),
):
    _stand_in.__name__ = _stand_in.__qualname__ = _public.__name__
    _stand_in.__module__ = _public.__module__
del _stand_in, _public
