"""A decorated function's parameters, read once at decoration for what calls need.

A call must never pay for ``inspect.signature(...).bind``: errors need each argument's
name, and ``exclude=`` needs to know which positions and keywords it covers, so both are
worked out here from the signature, once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MethodType
from typing import Any

import wrapt

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_PARTIAL = wrapt.PartialCallableObjectProxy


def self_offset(wrapped: object, instance: object) -> int:
    """How many of the function's first parameters a call's ``args`` leave out: 1 where
    wrapt hands the wrapper the method with ``self`` (or ``cls``) bound, else 0.

    Bound means a bound method (``model.step(x)``, a classmethod), or, for a method called
    through its class with the instance first (``Model.step(model, x)``), the function
    with the instance bound in wrapt's ``PartialCallableObjectProxy`` (``args`` then
    starts at ``x``).
    """
    if instance is None:
        return 0
    kind = type(wrapped)
    return 1 if kind is MethodType or kind is _PARTIAL else 0


class Params:
    """The names a function gives its arguments.

    Attributes:
        positional: names of the parameters that can be passed by position, in order.
        varargs: the name of ``*args``, or ``None``.
        keywords: every name that can be passed by keyword.
        varkw: the name of ``**kwargs``, or ``None``.
        defaults: ``(position, name, default)`` for each parameter with a default that can
            be passed by keyword: its place among the positional parameters (None for a
            keyword-only one), so that a call can tell whether it passed it.
    """

    __slots__ = ("defaults", "function", "keywords", "positional", "varargs", "varkw")

    def __init__(
        self,
        function: str,
        positional: tuple[str, ...],
        varargs: str | None,
        keywords: frozenset[str],
        varkw: str | None,
        defaults: tuple[tuple[int | None, str, Any], ...] = (),
    ) -> None:
        self.function = function
        self.positional = positional
        self.varargs = varargs
        self.keywords = keywords
        self.varkw = varkw
        self.defaults = defaults

    @classmethod
    def of(cls, function: Callable[..., Any], name: str) -> Params:
        """Read ``function``'s signature; a callable without one takes anything."""
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):  # some builtins and C callables have none
            return cls(name, (), "args", frozenset(), "kwargs")
        params = list(signature.parameters.values())
        kind = inspect.Parameter
        positional = tuple(p.name for p in params if p.kind in _POSITIONAL)
        defaults = tuple(
            (positional.index(p.name) if p.kind in _POSITIONAL else None, p.name, p.default)
            for p in params
            if p.kind in (kind.POSITIONAL_OR_KEYWORD, kind.KEYWORD_ONLY)
            and p.default is not p.empty
        )
        return cls(
            name,
            positional,
            next((p.name for p in params if p.kind == kind.VAR_POSITIONAL), None),
            frozenset(
                p.name for p in params if p.kind in (kind.POSITIONAL_OR_KEYWORD, kind.KEYWORD_ONLY)
            ),
            next((p.name for p in params if p.kind == kind.VAR_KEYWORD), None),
            defaults,
        )

    def argument_name(self, where: int | str | None, offset: int) -> str:
        """How a message names an argument: by position in ``args``, by key, or the instance.

        Args:
            where: a position in the call's ``args``; a keyword; ``None`` for ``self``.
            offset: how many leading parameters the binding consumed (1 for a method
                called on its instance: ``self`` is not in ``args``).
        """
        if where is None:
            return "self"
        if isinstance(where, str):
            return where
        index = where + offset
        if index < len(self.positional):
            return self.positional[index]
        return f"{self.varargs or 'args'}[{index - len(self.positional)}]"

    def named(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], offset: int
    ) -> Iterator[tuple[str, Any, int | str]]:
        """Each argument of a call as ``(name, value, where)``, positional ones first."""
        for position, value in enumerate(args):
            yield self.argument_name(position, offset), value, position
        for key, value in kwargs.items():
            yield key, value, key

    def excluded(
        self,
        exclusion: Exclusion,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        offset: int,
    ) -> list[tuple[str, Any]]:
        """``(name, value)`` of each argument of a call that ``exclusion`` holds out (not
        moved, not checked), for an error's message. On the error path only."""
        held = []
        for name, value, where in self.named(args, kwargs, offset):
            if isinstance(where, int):
                out = exclusion.holds_position(where + offset)
            else:
                out = exclusion.holds_keyword(where)
            if out:
                held.append((name, value))
        return held

    def defaults_taken(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], offset: int
    ) -> Iterator[tuple[str, Any]]:
        """``(name, default)`` for each parameter with a default that the call did not pass:
        the body reads the default (a config object, a table of constants) as an argument."""
        for position, name, default in self.defaults:
            passed = name in kwargs or (position is not None and position < len(args) + offset)
            if not passed:
                yield name, default

    def exclusion(self, names: Iterable[str]) -> Exclusion:
        """What ``exclude=names`` covers.

        Raises:
            ValueError: a name the function does not take (and it has no ``**kwargs``).
        """
        wanted = tuple(names)
        known = {*self.positional, *self.keywords, self.varargs, self.varkw} - {None}
        unknown = [name for name in wanted if name not in known]
        if unknown and self.varkw is None:
            takes = ", ".join(repr(name) for name in sorted(known, key=self._order)) or "nothing"
            msg = (
                f"@device_agnostic(exclude=...) names {', '.join(map(repr, unknown))}, which "
                f"{self.function}() does not take (it takes {takes})\n"
                f"fix: exclude only parameters of {self.function}(), by name"
            )
            raise ValueError(msg)
        positions = frozenset(i for i, name in enumerate(self.positional) if name in wanted)
        rest_from = len(self.positional) if self.varargs in wanted else None
        named = frozenset({*self.positional, *self.keywords})
        return Exclusion(
            positions, rest_from, frozenset(wanted), named if self.varkw in wanted else None
        )

    def _order(self, name: str | None) -> int:
        order = [*self.positional, self.varargs, *sorted(self.keywords), self.varkw]
        return order.index(name) if name in order else len(order)


class Exclusion:
    """The positions and keywords ``exclude=`` covers, for a call to look up in O(1)."""

    __slots__ = ("keywords", "named", "positions", "rest_from")

    def __init__(
        self,
        positions: frozenset[int],
        rest_from: int | None,
        keywords: frozenset[str],
        named: frozenset[str] | None,
    ) -> None:
        self.positions = positions
        self.rest_from = rest_from
        self.keywords = keywords
        # With **kwargs excluded: the names that are not extra keywords (these stay in).
        self.named = named

    def holds_position(self, index: int) -> bool:
        """Whether the parameter at ``index`` of the full signature is excluded."""
        rest_from = self.rest_from
        return index in self.positions or (rest_from is not None and index >= rest_from)

    def holds_keyword(self, key: str) -> bool:
        """Whether an argument passed as ``key=...`` is excluded."""
        named = self.named
        return key in self.keywords or (named is not None and key not in named)
