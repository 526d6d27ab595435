"""torch's tensor constructors, filled in with a scope's device.

Why not torch's own mechanism. ``with torch.device(d)`` and ``set_default_device`` put a
``DeviceContext`` (a ``TorchFunctionMode``) on the thread's mode stack, and every torch call
in the thread then makes a trip through Python to reach it, although the mode changes only
the few dozen constructors: a small op's launch (an ``mm``) takes several times as long.
Here the constructors themselves are replaced by wrappers that fill in ``device=`` and call
the original: every other call costs what it costs outside a scope, and a constructor costs
a Python call instead of a mode dispatch.

When. The wrappers are put in place when the first scope of the process opens that changes
the device, and stay: entering a later block is a push on a context variable, not 80
``setattr``s. A process that never opens such a block runs torch's own functions.
Outside every block a wrapper asks one context variable and the thread's list of decorated
calls, and calls torch's function. While they are in place, they ask
:mod:`devicectx.scope._stack` which device the running thread or asyncio task wants (``None``:
leave torch to decide), and ``torch.get_default_device`` answers for the scopes too.

Where. In every loaded module, torch's or not, a module-level name bound to one of torch's
constructors (``from torch import zeros``, ``ones = torch.ones``) is replaced, at the first
block and, for modules loaded since, at the next block entered; a name bound afterwards
through torch's modules gets the wrapper anyway. What stays torch's own: a reference held
inside an object, a closure or a default argument before the first block (an attribute
``self.fn = torch.ones``, a ``functools.partial``, a ``def f(fn=torch.ones)``).
``on_device(..., exact=True)`` adds torch's mode for such code, and ``audit=True`` names
each such call.

torch's list of constructors, and TorchScript's table of them, come from
:mod:`devicectx._torch.constructors`: the wrappers are added to that list, so that torch's
mode, traced or not, treats a wrapper as the constructor it is, and each is mapped as its
original in TorchScript's table, so that ``torch.jit.script`` compiles code that calls one.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from types import CodeType, ModuleType
from typing import Any

import torch

from devicectx._errors import DtypeUnsupportedError
from devicectx._torch.constructors import device_constructors, keep_builtin_ops
from devicectx._torch.dynamo import (
    called_by_dynamo,
    constant,
    disable,
    keep_trace_rules,
    loaded,
    never_top_level,
)
from devicectx.devices._capabilities import CAPABILITIES, nearest_dtype

__all__ = ["TorchPatch", "constructor_patch", "inline_only", "probing"]

DeviceQuery = Callable[[], "torch.device | None"]
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_Site = tuple[ModuleType, str, object, object]  # (module, name, torch's function, replacement)


class TorchPatch:
    """Functions of torch replaced in every loaded module that holds them by name.

    Args:
        make: ``{torch's function: its replacement}``, called once, at the first install.
    """

    def __init__(self, make: Callable[[], dict[object, Callable[..., Any]]]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._wrappers: dict[int, Callable[..., Any]] | None = None  # by id of the original
        self._scanned: dict[str, ModuleType] = {}  # the modules looked through, by name
        self._sites: list[_Site] = []
        self.installed = False
        self.seen = -1
        """``len(sys.modules)`` when the modules were last looked through: a caller compares
        it with the length now (one comparison) to know whether :meth:`install` has work."""

    def install(self) -> None:
        """Put the replacements in place, in every loaded module that holds torch's own by
        name (modules looked through before are not looked through again)."""
        with self._lock:
            if self._wrappers is None:
                self._wrappers = {id(original): fn for original, fn in self._make().items()}
                _REPLACEMENTS.update(fn.__code__ for fn in self._wrappers.values())
            new, seen = self._find_sites()
            # Tables dynamo built since the last look (its first compile loads modules, so
            # a look follows it) list the replacements: torch's own are put back in them.
            pairs = [(fn.__wrapped__, fn) for fn in self._wrappers.values()]  # type: ignore[attr-defined]
            keep_trace_rules(pairs)
            keep_builtin_ops(pairs)
            if loaded():
                inline_only()
            for module, name, original, wrapper in new if self.installed else self._sites + new:
                if module.__dict__.get(name) is original:
                    setattr(module, name, wrapper)
            self._sites.extend(new)
            self.installed = True
            # Last: a block opening in another thread meanwhile compares its count with
            # this one, and waits on the lock, until the replacements are in place.
            self.seen = seen

    def uninstall(self) -> None:
        """Give torch its functions back wherever they were replaced."""
        with self._lock:
            for module, name, original, wrapper in self._sites:
                # Someone else may have replaced it since (a test's monkeypatch): theirs stays.
                if module.__dict__.get(name) is wrapper:
                    setattr(module, name, original)
            # dynamo, loaded and first tracing while they were in place, listed them.
            keep_trace_rules((original, wrapper) for _, _, original, wrapper in self._sites)
            self.installed = False

    def _find_sites(self) -> tuple[list[_Site], int]:
        """The names bound to a replaced function in the modules loaded since the last
        look, and how many modules were loaded then."""
        assert self._wrappers is not None
        wrappers = self._wrappers
        sites: list[_Site] = []
        modules = list(sys.modules.items())
        for module_name, module in modules:
            if self._scanned.get(module_name) is module or not isinstance(module, ModuleType):
                continue
            self._scanned[module_name] = module
            for name, value in list(vars(module).items()):
                wrapper = wrappers.get(id(value))
                if wrapper is not None and not name.startswith("__"):
                    sites.append((module, name, value, wrapper))
        return sites, len(modules)


def constructor_patch(
    active: Callable[[], tuple[object, ...]],
    calls: Any,
    scope_device: DeviceQuery,
    traced_scope_device: DeviceQuery,
    default_device: Callable[[], torch.device],
    torch_own: object,
) -> TorchPatch:
    """The replacement of torch's constructors (and ``torch.get_default_device``).

    Args:
        active: the running task's blocks (empty outside every block): asked first, on
            every constructor call, so it must be cheap.
        calls: a ``threading.local`` whose ``scopes`` lists the scopes of the decorated
            calls running in this thread (empty outside them): asked next; its
            ``seeding`` is set while a ``torch.utils.data`` seed is drawn on the host.
        scope_device: the device a constructor called without ``device=`` gets here, or
            None to leave torch's own default (and modes) in charge; asked inside blocks.
        traced_scope_device: the same, for code dynamo traces: a trace-time constant.
        default_device: what ``torch.get_default_device()`` answers while the patch is
            in place.
        torch_own: the ``previous`` of a block on the device torch gives anyway (the CPU,
            nothing else open): alone in the task, outside decorated calls, constructors in
            it are torch's at once, as outside every block.
    """

    def make() -> dict[object, Callable[..., Any]]:
        originals = device_constructors()
        wrappers: dict[object, Callable[..., Any]] = {
            original: _fill_device(
                original, active, calls, scope_device, traced_scope_device, torch_own
            )
            for original in originals
        }
        # torch's DeviceContext, traced or not, treats a replacement handed to it (by dynamo,
        # which puts one in its graph) as the constructor it replaces.
        originals.update(wrappers.values())
        getter = torch.get_default_device
        wrappers[getter] = _answer_default(getter, default_device)
        return wrappers

    return TorchPatch(make)


def _fill_device(
    original: Callable[..., Any],
    active: Callable[[], tuple[Any, ...]],
    calls: Any,
    scope_device: DeviceQuery,
    traced_scope_device: DeviceQuery,
    torch_own: object,
) -> Callable[..., Any]:
    """``original``, with ``device=`` filled in from the scope where the caller gave none."""

    # As in torch's DeviceContext: only a device given by keyword counts (a positional one
    # is not in any constructor's signature), and device=None means "the default".
    # is_dynamo_compiling() is False when the function runs, True where dynamo traces it:
    # then the scope's device is read at trace time, where dynamo keeps its own mode stack.
    # Outside every scope (the task's tuple of blocks and the thread's list of decorated
    # calls empty), or in a block on the device torch gives anyway (such a block is entered
    # only with nothing else open, so it is the task's only one): torch's function at once.
    seeds = getattr(original, "__name__", None) == "empty"  # torch.utils.data's seeds' maker
    # torch.nested.nested_tensor, a Python function torch's DeviceContext never sees (it
    # sees the calls inside): left to those calls, as in torch.device. Of tensors, it
    # stays where the leftmost is, its documented default.
    nested = getattr(original, "__name__", None) == "nested_tensor"

    @functools.wraps(original)
    def constructor(*args: Any, **kwargs: Any) -> Any:
        if _is_dynamo_compiling():
            inline_only()
            if kwargs.get("device") is None:
                device = traced_scope_device()
                if device is not None:
                    kwargs["device"] = device
            return original(*args, **kwargs)
        blocks = active()
        scoped = calls.scopes or (blocks and blocks[-1].previous is not torch_own)
        if scoped and kwargs.get("device") is None:
            if seeds and args == _SEED_SHAPE and _draws_a_seed(kwargs):
                calls.seeding = True
                try:
                    return original(*args, **kwargs)
                finally:
                    calls.seeding = False
            if nested:
                return original(*args, **kwargs)
            generator = kwargs.get("generator")
            # A generator draws only on its own device (a CPU one refuses any other): the
            # numbers are made there, as DataLoader's shuffling sampler needs them.
            device = scope_device() if generator is None else generator.device
            if device is not None and not _from_dynamo():
                kwargs["device"] = device
                try:
                    return original(*args, **kwargs)
                except Exception as error:
                    refused = _refusal()(original, args, kwargs, error)
                    if refused is None:
                        raise
                    raise refused from error
        return original(*args, **kwargs)

    return constructor


_SEED_SHAPE = ((),)


def _draws_a_seed(kwargs: dict[str, Any]) -> bool:
    """Whether a ``torch.empty((), dtype=torch.int64)`` is ``torch.utils.data`` drawing a
    seed (its shuffling sampler's, its workers' base seed: ``.random_().item()``): made
    on the host, as outside a block, so that a block draws the seeds a CPU run draws, and
    a ``meta`` block (which has no values to read) lets a ``DataLoader`` run."""
    if kwargs.get("dtype") is not torch.int64:
        return False
    caller = sys._getframe(2).f_globals.get("__name__", "")  # 1: the constructor
    return isinstance(caller, str) and caller.startswith("torch.utils.data")


_Refusal = Callable[
    [Callable[..., Any], tuple[Any, ...], dict[str, Any], Exception], "DtypeUnsupportedError | None"
]
_DISABLED: list[_Refusal] = []


def _refusal() -> _Refusal:
    """:func:`_dtype_refused`, kept from dynamo once it is loaded: called in code a compiled
    function runs eagerly (behind a graph break), dynamo would compile its frame, make the
    failed tensor again, and come back here, until Python's recursion limit."""
    if not loaded():
        return _dtype_refused
    if not _DISABLED:
        _DISABLED.append(disable(_dtype_refused))
    return _DISABLED[0]


_PROBE = threading.local()  # on while _dtype_refused remakes a failed tensor on meta


def probing() -> bool:
    """Whether this thread is remaking a refused constructor's tensor on ``meta`` to learn
    its dtype: that tensor is devicectx's own, which ``on_device(audit=...)`` must not
    report (nor raise at, which would hide the refusal)."""
    return getattr(_PROBE, "on", False)


def _dtype_refused(
    original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], error: Exception
) -> DtypeUnsupportedError | None:
    """Our error for a constructor the scope sent to a device that cannot hold the dtype it
    makes (``torch.tensor(numpy_float64)`` on MPS), or None for any other failure.

    Worked out only once the constructor failed: the dtype it makes is found by making it
    on ``meta`` (no data, and every dtype held).
    """
    device = kwargs["device"]
    try:
        target = torch.device(device)
        if not CAPABILITIES.missing(target):
            return None
        _PROBE.on = True
        try:
            dtype = original(*args, **{**kwargs, "device": "meta"}).dtype
        finally:
            _PROBE.on = False
    except Exception:
        return None
    if CAPABILITIES.holds(target, dtype):
        return None
    name = f"{_torch_name(original)}()"
    nearest = nearest_dtype(target, dtype)
    to = "a dtype it holds" if nearest is None else str(nearest)
    raised = f"{type(error).__name__} from torch"
    if _from_default_dtype(dtype, args, kwargs):
        # The call may be inside a library (nn.Linear's torch.empty), where no dtype= can
        # be given: the default dtype is what the user set, and can set back.
        default = torch.get_default_dtype()
        held = nearest_dtype(target, default)
        msg = (
            f"{name} inside a block on {target}, called without dtype=, would make a tensor "
            f"of torch's default dtype, {default}, which {target} cannot hold ({raised})\n"
            f"fix: torch.set_default_dtype({held or 'a dtype it holds'}) before the block, "
            f"or where {name} is called in your code, {name[:-1]}..., dtype={to})"
        )
    else:
        msg = (
            f"{name} inside a block on {target} would make a {dtype} tensor, which {target} "
            f"cannot hold ({raised})\n"
            f"fix: {name[:-1]}..., dtype={to}), or make it on the CPU and move it with "
            f'to_device(..., {str(target)!r}, dtypes="device")'
        )
    return DtypeUnsupportedError(msg, device=target, paths={dtype: [name]})


def _from_default_dtype(dtype: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a constructor made ``dtype`` because it is torch's default dtype (or the
    complex dtype that goes with it): no ``dtype=`` given, and no data of a dtype of its
    own (a numpy array, a tensor, numpy's scalars), which the constructor would follow."""
    if kwargs.get("dtype") is not None:
        return False
    default = torch.get_default_dtype()
    defaults = (default, torch.complex128 if default == torch.float64 else torch.complex64)
    if dtype not in defaults:
        return False
    return not any(_carries_dtype(value) for value in (*args, *kwargs.values()))


def _carries_dtype(value: object) -> bool:
    """Whether ``value`` (a constructor's data, or in it) has a dtype of its own."""
    if isinstance(value, (list, tuple)):
        return any(_carries_dtype(item) for item in value)
    return hasattr(value, "dtype")


def _torch_name(function: Callable[..., Any]) -> str:
    """``torch.tensor``: how the user wrote the constructor (torch's own are in ``torch``;
    ``torch.fft.fftfreq`` is ``fft_fftfreq`` to torch)."""
    name = getattr(function, "__name__", "constructor")
    if hasattr(torch, name):
        return f"torch.{name}"
    if name.startswith("fft_") and hasattr(torch.fft, name[4:]):
        return f"torch.fft.{name[4:]}"
    return name


_REPLACEMENTS: set[CodeType] = set()  # the code of every replacement a patch made
_INLINED: set[CodeType] = set()  # those dynamo was told to inline only


@constant
def inline_only() -> bool:
    """Tell dynamo never to compile a replacement as a frame of its own (see
    ``never_top_level``): when a patch is put in place with dynamo loaded, else where
    dynamo traces a replacement (too late for one compiled on its own before). A constant
    where dynamo traces it: it runs once, at trace time."""
    for code in _REPLACEMENTS - _INLINED:
        _INLINED.add(code)
        never_top_level(code)
    return True


def _from_dynamo() -> bool:
    """Whether the constructor's caller is dynamo's own code (not code it traces).

    dynamo makes probe tensors when it is imported, which a meta op can trigger inside a
    block (torch 2.6, 2.7: ops with Python meta kernels import it): on the block's device,
    meta, they fail and leave dynamo half imported.
    """
    # 1: the constructor (never in code dynamo traces, which cannot read frames), 2: its
    # caller.
    return called_by_dynamo(2)


def _answer_default(
    original: Callable[[], torch.device], default_device: Callable[[], torch.device]
) -> Callable[[], torch.device]:
    """``torch.get_default_device``, answering for the scopes."""

    @functools.wraps(original)
    def get_default_device() -> torch.device:
        return default_device()

    return get_default_device
