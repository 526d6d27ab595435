"""Out-of-memory back-off: retry a function with half the batch size until it fits.

How an out-of-memory error is recognised, from any backend:

- ``torch.OutOfMemoryError``, raised by the CUDA, ROCm and XPU caching allocators
  (``"CUDA out of memory. Tried to allocate 2.00 GiB ..."``);
- a ``RuntimeError`` (``torch.AcceleratorError`` included) whose message says
  ``"out of memory"``: MPS (``"MPS backend out of memory"``), ``"CUDA error: out of
  memory"`` from outside the caching allocator, and older torch releases that raised
  plain ``RuntimeError`` for all of these;
- the allocation failures that say so in other words: the CPU allocator
  (``"DefaultCPUAllocator: can't allocate memory"``; ``"DefaultCPUAllocator: not enough
  memory"`` on Windows) and cuBLAS (``"CUBLAS_STATUS_ALLOC_FAILED"``).

The same list as accelerate's ``should_reduce_batch_size``, less the cuDNN
``CUDNN_STATUS_NOT_SUPPORTED`` error, which is not about memory.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import logging
import operator
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, ParamSpec, SupportsIndex, TypeVar, cast, overload

import torch

from devicectx._errors import SMALLER_BATCHES, BatchTooLargeError, MoveError, check_switches
from devicectx.devices._resolve import accelerator_type
from devicectx.move._prefetch import Prefetcher

_P = ParamSpec("_P")
_R = TypeVar("_R")

# A public name, documented in docs/diagnostics.md: logging configurations name it.
_logger = logging.getLogger("devicectx.oom")

# torch's CPU allocator (c10/core/impl/alloc_cpu.cpp) says "can't allocate memory" where
# posix_memalign fails, "not enough memory" where Windows' _aligned_malloc does.
_OOM_MESSAGES = (
    "out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
)
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_NOT_UNDONE = "what the failed attempt changed, such as gradients it accumulated, is not undone"


@overload
def shrink_batch_on_oom(
    wrapped: Callable[_P, _R], /, *, param: str = ..., minimum: int = ..., remember: bool = ...
) -> Callable[_P, _R]: ...


@overload
def shrink_batch_on_oom(
    wrapped: None = None, /, *, param: str = ..., minimum: int = ..., remember: bool = ...
) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]: ...


def shrink_batch_on_oom(
    wrapped: Callable[_P, _R] | None = None,
    /,
    *,
    param: str = "batch_size",
    minimum: int = 1,
    remember: bool = True,
) -> Callable[_P, _R] | Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Retry a function with half the batch size whenever it runs out of memory.

    The function is called with the batch size it was given. When it raises an
    out-of-memory error (from any backend: see the module docstring), the garbage
    collector runs, the accelerator's allocator cache is emptied, and the function is
    called again with the batch size halved (but never below ``minimum``), until it
    returns. Any other exception passes through untouched, on the first raise.

    The other usual remedy, before or with a smaller batch, is mixed precision: 16-bit
    activations need half the memory. examples/mixed_precision.py shows a training step
    under :func:`devicectx.precision_scope` that runs unchanged on any device.

    Example:
        >>> @shrink_batch_on_oom(minimum=8)
        ... def evaluate(data, batch_size=256):
        ...     if batch_size > 64:  # stands in for a real out-of-memory error
        ...         raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4 GiB")
        ...     return batch_size
        >>> evaluate([1, 2, 3])  # tries 256, 128, then 64
        64
        >>> evaluate([1, 2, 3], batch_size=512)  # starts at the 64 that worked
        64

    Args:
        wrapped: the function; given when used bare, as ``@shrink_batch_on_oom``.
        param: the name of the batch-size parameter. It is looked up in the signature
            once, here, so the batch size can be passed positionally or by keyword, or
            left to the parameter's default.
        minimum: the smallest batch size to try (at least 1). A halving that would go
            below it tries ``minimum`` itself once.
        remember: after a call had to shrink, later calls start at the size that
            worked (see the caveats). ``False`` starts every call at the size it is given.

    Returns:
        The decorated function, with the signature, name and docstring of the original.
        Async functions are retried the same way, around each ``await``.

    Raises:
        BatchTooLargeError: (at call time) out of memory at ``minimum`` too, or at the
            batch size given when it already is ``minimum`` or less. It subclasses
            ``torch.OutOfMemoryError``; ``.tried`` lists the sizes tried, and the last
            out-of-memory error is its ``__cause__``.
        TypeError: (at decoration time) ``param`` is not a parameter of the function,
            or is ``*args``/``**kwargs``; the function is a generator, a class, or a
            ``staticmethod``/``classmethod`` object; (at call time) the batch size is
            not an integer, or an argument is an iterator read once (a generator,
            ``iter(loader)``, a :func:`~devicectx.prefetch` over one), which a retry would
            find part-read: pass a list or a DataLoader.
        ValueError: ``minimum`` below 1; (at call time) a batch size below 1.

    Caveats:
        - Memory, with ``remember=True``: the size that worked after a shrink becomes a
          ceiling for every later call of this decorated function (shared by all
          instances when it is a method, and by all threads). A later call asking for
          more starts at the ceiling; a call asking for less gets what it asked for; an
          out-of-memory error at a smaller size lowers the ceiling further. The ceiling
          never rises again. To start over, decorate the function anew, or pass
          ``remember=False`` where the memory a batch needs varies between calls.
        - The function must use the batch size it is given: it is the only thing
          that changes between attempts. Work done before the error is repeated, and
          what it changed is not undone: gradients accumulated by ``.backward()``
          before the error are still in ``.grad`` when the retry adds its own, and an
          optimizer step already taken stays taken. Start the function from clean
          state (``optimizer.zero_grad()`` first thing inside it). Items already
          yielded cannot be taken back: generator functions, and iterators given as
          arguments, are refused for this.
        - Memory held by the failed attempt is freed only if nothing outside the
          function keeps a reference to it; the traceback of the error is dropped
          before the retry so that its frames release their tensors.
        - The shrink is logged (``logging`` WARNING on the logger ``"devicectx.oom"``):
          a smaller batch changes the statistics of training (batch norm, learning rate
          scaling). So is a call held below the size it asks for by the ceiling, once
          per ceiling. The first shrink's line also says that the failed attempt's
          changes are not undone.
    """

    def decorate(function: Callable[_P, _R]) -> Callable[_P, _R]:
        return _decorate(function, param=param, minimum=minimum, remember=remember)

    _check_minimum(minimum)
    check_switches("@shrink_batch_on_oom", remember=remember)
    if wrapped is None:
        return decorate
    return decorate(wrapped)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an out-of-memory error from any backend (module docstring).

    Example:
        >>> is_out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
        True
        >>> is_out_of_memory(ValueError("out of memory"))
        False
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if not isinstance(error, RuntimeError):
        return False
    message = str(error)
    return any(text in message for text in _OOM_MESSAGES)


def free_memory() -> None:
    """Collect garbage, then return the accelerator allocator's cached blocks to the device.

    The collection comes first: tensors kept alive only by reference cycles (a failed
    attempt's frames often are one) go back to the cache, which is then emptied.
    """
    gc.collect()
    accelerator = accelerator_type()
    if accelerator is None:
        return
    # torch.accelerator.empty_cache arrived in torch 2.9; the floor is 2.6, where each
    # backend module (torch.cuda, torch.xpu, torch.mps) has its own.
    empty_cache = getattr(torch.accelerator, "empty_cache", None)
    if empty_cache is None:
        empty_cache = getattr(getattr(torch, accelerator, None), "empty_cache", None)
    if callable(empty_cache):
        empty_cache()


def _check_minimum(minimum: object) -> None:
    if isinstance(minimum, bool) or not isinstance(minimum, int):
        msg = f"shrink_batch_on_oom(minimum={minimum!r}): minimum must be an int >= 1"
        raise TypeError(msg)
    if minimum < 1:
        msg = (
            f"shrink_batch_on_oom(minimum={minimum!r}): minimum must be >= 1\n"
            "fix: @shrink_batch_on_oom(minimum=1)"
        )
        raise ValueError(msg)


def _decorate(
    function: Callable[_P, _R], *, param: str, minimum: int, remember: bool
) -> Callable[_P, _R]:
    _refuse_unsupported(function)
    name = getattr(function, "__qualname__", repr(function))
    batch = _BatchArgument.find(function, name, param)
    names = _ArgumentNames.find(function)
    state = _Shared(remember=remember)

    def attempts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Attempts:
        _refuse_one_shot(name, names, args, kwargs)
        return _Attempts(name, batch, minimum, state, args, kwargs)

    if inspect.iscoroutinefunction(function):
        call_async = cast(Callable[..., Any], function)

        @functools.wraps(function)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            run = attempts(args, kwargs)
            while True:
                call_args, call_kwargs = run.next_call()
                try:
                    result = await call_async(*call_args, **call_kwargs)
                except Exception as error:
                    if not run.shrink_after(error):
                        raise
                else:
                    run.succeeded()
                    return result
                free_memory()  # outside the except block: the traceback is gone by now

        return cast(Callable[_P, _R], async_wrapper)

    @functools.wraps(function)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        __tracebackhide__ = True
        run = attempts(args, kwargs)
        while True:
            call_args, call_kwargs = run.next_call()
            try:
                result = function(*call_args, **call_kwargs)
            except Exception as error:
                if not run.shrink_after(error):
                    raise
            else:
                run.succeeded()
                return result
            free_memory()  # outside the except block: the traceback is gone by now

    return wrapper


def _refuse_unsupported(function: object) -> None:
    shown = getattr(function, "__qualname__", repr(function))
    if isinstance(function, (staticmethod, classmethod)):
        kind = type(function).__name__
        msg = (
            f"shrink_batch_on_oom cannot wrap a {kind} object ({shown})\n"
            f"fix: put @shrink_batch_on_oom below @{kind}, next to the def"
        )
        raise TypeError(msg)
    if inspect.isclass(function):
        msg = (
            f"shrink_batch_on_oom cannot decorate a class ({shown})\n"
            f"fix: decorate the method that takes the batch size"
        )
        raise TypeError(msg)
    if inspect.isgeneratorfunction(function) or inspect.isasyncgenfunction(function):
        msg = (
            f"shrink_batch_on_oom cannot retry the generator function {shown}(): an "
            "out-of-memory error arrives while its items are consumed, after some were "
            "already yielded, and a retry would yield them again\n"
            "fix: decorate the function that takes the batch size and reads the items, and "
            "pass it a list or a DataLoader (read again from the start at each attempt), not "
            "a generator"
        )
        raise TypeError(msg)
    if not callable(function):
        msg = f"shrink_batch_on_oom decorates functions, not {type(function).__name__} objects"
        raise TypeError(msg)


class _ArgumentNames:
    """The names a call's arguments are known by, for messages: found in the signature once."""

    def __init__(self, positional: tuple[str, ...], star: str | None) -> None:
        self.positional = positional
        self.star = star  # the *args parameter, which takes the positional arguments beyond

    @classmethod
    def find(cls, function: Callable[..., Any]) -> _ArgumentNames:
        parameters = inspect.signature(function).parameters.values()
        positional = tuple(p.name for p in parameters if p.kind in _POSITIONAL)
        star = next((p.name for p in parameters if p.kind is p.VAR_POSITIONAL), None)
        return cls(positional, star)

    def of(self, index: int) -> str:
        """The name of the positional argument at ``index``."""
        if index < len(self.positional):
            return self.positional[index]
        return f"{self.star or 'args'}[{index - len(self.positional)}]"


def _refuse_one_shot(
    shown: str, names: _ArgumentNames, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Refuse an argument a retry would find part-read: an iterator, read once."""
    named = [(names.of(i), value) for i, value in enumerate(args)]
    for argument, value in [*named, *kwargs.items()]:
        kind = _one_shot(value)
        if kind is None:
            continue
        listed = (
            f"[item async for item in {argument}]"
            if isinstance(value, AsyncIterator)
            else f"list({argument}) or a DataLoader"
        )
        msg = (
            f"shrink_batch_on_oom cannot retry {shown}() with {argument}={kind}, an iterator "
            "read once: an attempt that runs out of memory reads part of it, and the retry "
            "would see only the rest\n"
            f"fix: pass {listed}, which each attempt reads from the start, not an iterator; "
            f"or make the iterator inside {shown}()"
        )
        raise TypeError(msg)


def _one_shot(value: object) -> str | None:
    """What ``value`` is (``"a generator"``) where it is an iterator that can be read once
    (``iter(value) is value``, or a prefetch over one), else None."""
    if isinstance(value, Prefetcher):
        # Not itself an iterator: each iter() of it resumes the one pass over its batches.
        inner = _one_shot(value.batches)
        return None if inner is None else f"a Prefetcher over {inner}"
    try:
        if isinstance(value, Iterator) and iter(value) is value:
            return f"a {type(value).__name__}"
        if isinstance(value, AsyncIterator) and aiter(value) is value:
            return f"a {type(value).__name__}"
    except Exception:  # an __iter__ that fails is the function's to report, when it reads
        return None
    return None


class _BatchArgument:
    """Where the batch size sits in a call: found in the signature once, at decoration."""

    def __init__(
        self,
        name: str,
        index: int | None,
        default: object,
        *,
        positional_only: bool,
        fill: tuple[object, ...],
    ) -> None:
        self.name = name
        self.index = index  # its position when it can be passed by position, else None
        self.default = default  # inspect.Parameter.empty when there is none
        self.positional_only = positional_only
        # The defaults of the parameters before a positional-only batch size, to pass it
        # by position when the caller left it to its default.
        self.fill = fill

    @classmethod
    def find(cls, function: Callable[..., Any], shown: str, param: str) -> _BatchArgument:
        parameters = list(inspect.signature(function).parameters.values())
        found = next((p for p in parameters if p.name == param), None)
        if found is None or found.kind in (found.VAR_POSITIONAL, found.VAR_KEYWORD):
            names = ", ".join(p.name for p in parameters) or "none"
            problem = "has no parameter" if found is None else "takes *args/**kwargs as"
            msg = (
                f"{shown}() {problem} {param!r}, which shrink_batch_on_oom would shrink; "
                f"its parameters: {names}\n"
                "fix: @shrink_batch_on_oom(param='<the batch size parameter>')"
            )
            raise TypeError(msg)
        index = parameters.index(found) if found.kind in _POSITIONAL else None
        positional_only = found.kind is found.POSITIONAL_ONLY
        fill = tuple(p.default for p in parameters[:index]) if positional_only else ()
        return cls(param, index, found.default, positional_only=positional_only, fill=fill)

    def get(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
        """The batch size this call passes, or ``inspect.Parameter.empty`` when it passes none."""
        if self.index is not None and len(args) > self.index:
            return args[self.index]
        if self.positional_only:
            if inspect.Parameter.empty in self.fill[len(args) :]:
                return inspect.Parameter.empty  # an argument before it is missing
            return self.default
        return kwargs.get(self.name, self.default)

    def set(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], size: int
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments of the call with the batch size replaced by ``size``."""
        if self.index is not None and len(args) > self.index:
            return (*args[: self.index], size, *args[self.index + 1 :]), kwargs
        if self.positional_only:
            return (*args, *self.fill[len(args) :], size), kwargs
        return args, {**kwargs, self.name: size}


class _Shared:
    """What the calls of one decorated function share: the batch size that worked after a
    shrink, a ceiling for later calls (``remember=True``), and which notes were logged."""

    def __init__(self, *, remember: bool) -> None:
        self.remember = remember
        self.ceiling: int | None = None
        self._held_logged: int | None = None  # the ceiling whose first held call was logged
        self._undone_logged = False
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # cloudpickle (Ray, loky, a notebook's function sent to workers) pickles a function of
        # __main__ by value, with this state: the copy keeps what was learned, not the lock.
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def cap(self, size: int) -> int:
        ceiling = self.ceiling
        return size if ceiling is None else min(size, ceiling)

    def lower(self, size: int) -> None:
        if not self.remember:
            return
        with self._lock:  # two threads that both shrank keep the smaller size
            if self.ceiling is None or size < self.ceiling:
                self.ceiling = size

    def first_held_at(self, ceiling: int) -> bool:
        """Whether a call held at ``ceiling`` is the first one there (to be logged)."""
        with self._lock:
            first = self._held_logged != ceiling
            self._held_logged = ceiling
        return first

    def first_shrink(self) -> bool:
        """Whether this is the function's first shrink (to say what it does not undo)."""
        with self._lock:
            first = not self._undone_logged
            self._undone_logged = True
        return first


class _Attempts:
    """One call of a decorated function: the sizes tried so far and the next one."""

    def __init__(
        self,
        name: str,
        batch: _BatchArgument,
        minimum: int,
        shared: _Shared,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.name = name
        self.batch = batch
        self.minimum = minimum
        self.shared = shared
        self.args = args
        self.kwargs = kwargs
        self.tried: list[int] = []
        self.moved: str | None = None  # what the last out-of-memory move failed to move
        requested = batch.get(args, kwargs)
        # Nothing to shrink: let the function raise its own TypeError for the missing argument.
        self.size: int | None = None
        self.asked: int | None = None  # the size the call gave, where a ceiling lowered it
        if requested is not inspect.Parameter.empty:
            asked = self._check(requested)
            self.size = shared.cap(asked)
            if self.size != asked:
                self.asked = asked
                self._log_held(asked, self.size)

    def next_call(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.size is None:
            return self.args, self.kwargs
        self.tried.append(self.size)
        return self.batch.set(self.args, self.kwargs, self.size)

    def succeeded(self) -> None:
        if self.size is not None and len(self.tried) > 1:
            self.shared.lower(self.size)

    def _log_held(self, asked: int, size: int) -> None:
        # A shared log may hold the shrink that set the ceiling thousands of lines earlier.
        if not self.shared.first_held_at(size):
            return
        _logger.warning(
            "%s(): asked for %s=%d, starting at %s=%d, the size an earlier call shrank to "
            "(remember=True); later calls held there are not logged",
            self.name,
            self.batch.name,
            asked,
            self.batch.name,
            size,
        )

    def shrink_after(self, error: Exception) -> bool:
        """Move to the next size after ``error``; False when ``error`` is not ours to handle.

        Raises:
            BatchTooLargeError: out of memory, and no smaller size is left to try.
        """
        __tracebackhide__ = True
        if self.size is None or not is_out_of_memory(error):
            return False
        # A move (devicectx's MoveError: @device_agnostic's of the arguments, or a to_device)
        # that fails on the same tensor at two sizes does not depend on the batch size:
        # halving it again cannot help.
        moved = _lines(error)[0] if isinstance(error, MoveError) else None
        if moved is not None and moved == self.moved:
            raise self._same_move(error) from error
        self.moved = moved
        smaller = max(self.size // 2, self.minimum)
        if smaller >= self.size:
            raise self._too_large(error) from error
        _logger.warning(
            "%s(): out of memory at %s=%d; retrying with %s=%d%s",
            self.name,
            self.batch.name,
            self.size,
            self.batch.name,
            smaller,
            f" ({_NOT_UNDONE})" if self.shared.first_shrink() else "",
        )
        self.size = smaller
        return True

    def _check(self, requested: object) -> int:
        shown = f"{self.name}() got {self.batch.name}={requested!r}"
        if isinstance(requested, bool):
            msg = f"{shown}: a batch size must be an int >= 1, not a bool"
            raise TypeError(msg)
        size: int | None = None
        if isinstance(requested, SupportsIndex):  # int, numpy and 0-dim torch integers
            with contextlib.suppress(TypeError):  # a float tensor has __index__, and raises
                size = operator.index(requested)
        if size is None:
            kind = type(requested).__name__
            msg = f"{shown}: a batch size must be an int >= 1, not a {kind}"
            raise TypeError(msg)
        if size < 1:
            msg = f"{shown}: a batch size must be an int >= 1"
            raise ValueError(msg)
        return size

    def _same_move(self, error: Exception) -> BatchTooLargeError:
        """The refusal where the same move ran out of memory at the last two sizes: the
        move's own fix, which the batch size cannot give."""
        name, (before, now) = self.batch.name, self.tried[-2:]
        lines = _lines(error)
        fix = next((line for line in lines if line.startswith("fix: ")), None)
        if fix is not None:  # the back-off is what just failed: its mention goes
            fix = fix.replace(f", or {SMALLER_BATCHES}", "").replace(f"; or {SMALLER_BATCHES}", "")
        msg = (
            f"{self.name}() ran out of memory moving the same tensor at {name}={before} and "
            f"{name}={now}: the {name} does not change that move\n"
            f"last error: {_first(error)}\n"
            f"{fix or 'fix: free memory on the device, or move less at once'}"
        )
        return BatchTooLargeError(msg, tried=self.tried)

    def _too_large(self, error: Exception) -> BatchTooLargeError:
        sizes = ", ".join(str(size) for size in self.tried)
        last = _first(error)
        # Below the last size tried: a call that asked for less than the minimum tried that.
        smaller = min(self.minimum, self.tried[-1]) // 2
        decorator = f"@shrink_batch_on_oom(minimum={smaller})"
        if self.batch.name != "batch_size":
            decorator = f"@shrink_batch_on_oom(param={self.batch.name!r}, minimum={smaller})"
        lower = f"{decorator} to try smaller batches, or " if smaller >= 1 else ""
        start = ""
        if self.asked is not None:
            start = (
                f"; asked for {self.asked}, it started at {self.tried[0]}, the "
                f"{self.batch.name} an earlier call shrank to (remember=True)"
            )
        elif len(self.tried) == 1:
            start = (
                f"; the call asked for {self.tried[0]}, not above the minimum, so no smaller "
                "size was tried"
            )
        msg = (
            f"{self.name}() ran out of memory at every {self.batch.name} tried: {sizes} "
            f"(minimum={self.minimum}){start}\n"
            f"last error: {last}\n"
            f"fix: {lower}make one sample need less memory (shorter sequences, "
            "torch.autocast), or free memory held outside the call"
        )
        return BatchTooLargeError(msg, tried=self.tried)


def _lines(error: BaseException) -> list[str]:
    """``error``'s message, line by line (its type's name where it has none)."""
    return str(error).strip().splitlines() or [type(error).__name__]


def _first(error: BaseException) -> str:
    """``error`` in a line: its first, and the next one where the first ends with a colon
    (devicectx's move errors: what failed, then torch's words on the next line)."""
    lines = _lines(error)
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1].strip()}"
    return lines[0]
