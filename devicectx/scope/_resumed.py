"""Generators and coroutines whose body must run inside a device scope: it runs later.

Their body does not run at the call but at each ``next``, ``send`` or ``await``, so the
scope is entered at every resume and left at every yield: a suspended generator must not
leak its device to its caller. ``on_device`` and ``@device_agnostic`` both drive theirs
here; each passes how to enter and leave its scope, and the decorator how to place items
(``output=``) and how to explain torch's device mismatch in the body (``explain``: the
error to raise in its place, or None to let torch's through).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator
from typing import Any, cast

import torch
import wrapt

Enter = Callable[[], Any]
"""Enters the scope; what it returns is handed to the matching ``Leave``."""
Leave = Callable[[Any], None]
Explain = Callable[[RuntimeError], BaseException | None]
"""Given torch's error from the body, the error to raise from it instead (None: torch's)."""


def resumed(
    inner: Generator[Any, Any, Any],
    enter: Enter,
    leave: Leave,
    place: Callable[[Any], Any] | None = None,
    explain: Explain | None = None,
) -> Generator[Any, Any, Any]:
    """Drive ``inner``: in the scope at every resume (and at close), out of it at yields."""
    step: Callable[[], Any] = functools.partial(inner.send, None)
    try:
        while True:
            try:
                item = _resume(step, enter, leave)
            except RuntimeError as error:
                told = None if explain is None else explain(error)
                if told is None:
                    raise
                raise told from error
            try:
                sent = yield (item if place is None else place(item))
            except GeneratorExit:
                _resume(inner.close, enter, leave)
                raise
            except BaseException as error:
                step = functools.partial(inner.throw, error)
            else:
                step = functools.partial(inner.send, sent)
    except StopIteration as stop:
        return stop.value


def _resume_scoped(step: Callable[[], Any], enter: Enter, leave: Leave) -> Any:
    """One resume of a generator, in its scope."""
    scope = enter()
    try:
        return step()
    finally:
        leave(scope)


_resume: Callable[[Callable[[], Any], Enter, Leave], Any] = _resume_scoped


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
    inner: Coroutine[Any, Any, Any],
    enter: Enter,
    leave: Leave,
    place: Callable[[Any], Any] | None = None,
    explain: Explain | None = None,
) -> Any:
    """Await ``inner`` in the scope: the context keeps each task's scopes apart, so one
    entry around the whole await suffices."""
    scope = enter()
    try:
        result = await inner
    except RuntimeError as error:
        told = None if explain is None else explain(error)
        if told is None:
            raise
        raise told from error
    finally:
        leave(scope)
    return result if place is None else place(result)


async def async_resumed(
    inner: AsyncGenerator[Any, Any],
    enter: Enter,
    leave: Leave,
    place: Callable[[Any], Any] | None = None,
    explain: Explain | None = None,
) -> AsyncGenerator[Any, Any]:
    """:func:`resumed` for an async generator (the twin of its loop: change them together)."""
    step: Callable[[], Any] = functools.partial(inner.asend, None)
    while True:
        scope = enter()
        try:
            item = await step()
        except StopAsyncIteration:
            return
        except RuntimeError as error:
            told = None if explain is None else explain(error)
            if told is None:
                raise
            raise told from error
        finally:
            leave(scope)
        try:
            sent = yield (item if place is None else place(item))
        except GeneratorExit:
            scope = enter()
            try:
                await inner.aclose()
            finally:
                leave(scope)
            raise
        except BaseException as error:
            step = functools.partial(inner.athrow, error)
        else:
            step = functools.partial(inner.asend, sent)


def resumed_async_generator_function(
    func: Callable[..., AsyncGenerator[Any, Any]], scope: Callable[[], tuple[Enter, Leave]]
) -> Callable[..., AsyncGenerator[Any, Any]]:
    """``func``, each async generator of which runs driven by :func:`async_resumed`, in a
    scope made by ``scope()`` when the generator is created.

    A wrapt wrapper, not a function: it passes ``func``'s code on, so that
    ``inspect.isasyncgenfunction``, which frameworks test, still says True (a plain function
    returning the driver would not, and an ``async def`` forwarding to it repeats its loop),
    and it binds as ``func`` does when it is a method.

    Example:
        >>> import asyncio, inspect
        >>> async def count():
        ...     yield 1
        >>> no_scope = (lambda: None, lambda entered: None)
        >>> wrapped = resumed_async_generator_function(count, lambda: no_scope)
        >>> inspect.isasyncgenfunction(wrapped)
        True
        >>> async def first():
        ...     return [item async for item in wrapped()]
        >>> asyncio.run(first())
        [1]
    """

    def start(
        wrapped: Callable[..., AsyncGenerator[Any, Any]],
        instance: object,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> AsyncGenerator[Any, Any]:
        enter, leave = scope()
        return async_resumed(wrapped(*args, **kwargs), enter, leave)

    return cast(Callable[..., AsyncGenerator[Any, Any]], wrapt.FunctionWrapper(func, start))
