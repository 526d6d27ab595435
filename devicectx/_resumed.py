"""Generators and async functions under ``@device_agnostic``: the body runs later.

Their body does not run at the call, but at each ``next``, ``send`` or ``await``, so the
device scope is entered at every resume and left at every yield (a suspended generator
must not leak its device to its caller), and ``output=`` applies to each item.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator
from typing import Any, Protocol

import torch

from devicectx._context import pop_nested, push_nested


class _Places(Protocol):
    """What the drivers need of the decorator's plan: how to place an item by ``output=``."""

    def place(self, result: Any, back: torch.device) -> Any: ...


def resumed(
    plan: _Places,
    inner: Generator[Any, Any, Any],
    target: torch.device | None,
    back: torch.device | None,
) -> Generator[Any, Any, Any]:
    """Drive ``inner``, entering the target at every resume and leaving it at every yield."""
    step: Callable[[], Any] = functools.partial(inner.send, None)
    try:
        while True:
            item = _resume(step, target)
            try:
                sent = yield (item if back is None else plan.place(item, back))
            except GeneratorExit:
                inner.close()
                raise
            except BaseException as error:
                step = functools.partial(inner.throw, error)
            else:
                step = functools.partial(inner.send, sent)
    except StopIteration as stop:
        return stop.value


def _resume_scoped(step: Callable[[], Any], target: torch.device | None) -> Any:
    """One resume of a generator, in the target's scope."""
    scope = push_nested(target) if target is not None else None
    try:
        return step()
    finally:
        if scope is not None:
            pop_nested(scope)


_resume: Callable[[Callable[[], Any], torch.device | None], Any] = _resume_scoped


def disable_resume_under_compile() -> None:
    """Make each resume run eagerly when compiled code advances a decorated generator.

    dynamo would otherwise trace into the scope (context variables, torch's mode stack);
    disabled, a resume is a graph break with the same meaning as without
    ``torch.compile``. Called when a generator function is decorated, not at import:
    ``torch.compiler.disable`` imports dynamo, a second on top of ``import torch``.
    """
    global _resume
    if _resume is _resume_scoped:
        _resume = torch.compiler.disable(_resume_scoped)  # type: ignore[no-untyped-call]


async def awaited(
    plan: _Places,
    inner: Coroutine[Any, Any, Any],
    target: torch.device | None,
    back: torch.device | None,
) -> Any:
    # The context keeps each task's scopes apart, so one push around the await suffices.
    scope = push_nested(target) if target is not None else None
    try:
        result = await inner
    finally:
        if scope is not None:
            pop_nested(scope)
    return result if back is None else plan.place(result, back)


async def async_resumed(
    plan: _Places,
    inner: AsyncGenerator[Any, Any],
    target: torch.device | None,
    back: torch.device | None,
) -> AsyncGenerator[Any, Any]:
    """Drive an async generator, scoped at every resume, each item placed by ``output=``."""
    step: Callable[[], Any] = functools.partial(inner.asend, None)
    while True:
        scope = push_nested(target) if target is not None else None
        try:
            item = await step()
        except StopAsyncIteration:
            return
        finally:
            if scope is not None:
                pop_nested(scope)
        try:
            sent = yield (item if back is None else plan.place(item, back))
        except GeneratorExit:
            await inner.aclose()
            raise
        except BaseException as error:
            step = functools.partial(inner.athrow, error)
        else:
            step = functools.partial(inner.asend, sent)
