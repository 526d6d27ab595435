"""Audit mode of ``on_device``: tensors made inside a block that did not land on its device.

``on_device(d, audit=True)`` warns (:class:`~devicectx.StrayTensorWarning`), and
``audit="raise"`` raises (:class:`~devicectx.StrayTensorError`), where code in the block
makes a tensor somewhere else: ``torch.from_numpy``, ``torch.zeros_like`` of a CPU tensor,
``x.new_zeros``, an explicit ``device="cpu"`` (``torch.nested.nested_tensor``'s too), a
CPU ``torch.Generator``, a module's buffer or parameter registered on another device.
These are the tensors that later fail far from where they were made, in a mixed-device
error.

How it works. While a thread has an audited block open, one ``TorchFunctionMode`` sits on
its mode stack. For every torch call it does one set lookup; only for a call that makes
tensors (torch's constructors, the ``*_like`` family, ``Tensor.new_*``) or takes a
``generator=``, it asks the running task's audit state (a context variable, so an asyncio
task or thread without an audited block is never reported), runs the call and looks at
the device of what came back. ``torch.from_numpy``, ``torch.frombuffer`` and torch.nested's
constructors never reach a mode with their device: while any block of the process audits
they are replaced in torch's modules, with the
:class:`~devicectx.scope._constructors.TorchPatch` that replaces the constructors. Buffers
and parameters are seen through torch's global module registration hooks, installed only
meanwhile.

What is reported: a call made by the user's code (a tensor torch's own code makes as it
works, on purpose on the CPU, is torch's business), and every buffer or parameter
registered, at the user's line that led to it. Results of ops on existing tensors follow
their inputs and are not reported: ``@device_agnostic`` reports mixed inputs where they
meet. Each report names the op, the devices, the user's ``file:line`` and the fix, once
per line and op for the process (raising, every time).

torch's list of constructors comes from :mod:`devicectx._torch.constructors`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable, Sequence
from types import BuiltinFunctionType, FrameType, FunctionType
from typing import Any, Literal, TypeAlias

import torch
import wrapt
from torch.nn.modules import module as _module
from torch.overrides import TorchFunctionMode, resolve_name

from devicectx._errors import StrayTensorError, StrayTensorWarning, warn_at
from devicectx._torch import modes as _torch_modes
from devicectx._torch.constructors import device_constructors
from devicectx.devices._capabilities import CAPABILITIES, nearest_dtype
from devicectx.scope._constructors import TorchPatch, inline_only, probing

__all__ = ["AuditLevel", "AuditOption", "Auditor", "check_audit", "reset_reports"]

AuditOption: TypeAlias = bool | Literal["raise"]
"""What ``on_device(audit=...)`` takes."""

AuditLevel: TypeAlias = Literal["warn", "raise"]
"""An audit that is on: warn once per line, or raise every time."""

AuditState = Callable[[], "tuple[AuditLevel, torch.device] | None"]
"""The running task's audit: its level and the device of its innermost block, or None."""

_is_dynamo_compiling = torch.compiler.is_dynamo_compiling

# The functions that make tensors, as torch passes them to a mode. Read once, as
# frozensets: the check on every torch call is one hash lookup.
_LIKE = frozenset(
    getattr(torch, f"{name}_like")
    for name in ("empty", "full", "ones", "rand", "randint", "randn", "zeros")
)
_NEW = frozenset(
    getattr(torch.Tensor, f"new_{name}")
    for name in ("empty", "empty_strided", "full", "ones", "tensor", "zeros")
)
_MADE = frozenset(device_constructors()) | _LIKE | _NEW
# Replaced in the torch module while any block audits: no mode sees them (torch.nested's
# are Python functions that hand the device to private ops, which a mode sees without it).
_UNSEEN = ("from_numpy", "frombuffer")
_UNSEEN_NESTED = ("nested_tensor", "as_nested_tensor")


def _directory(path: str | None) -> str:
    return os.path.dirname(path or "") + os.sep


# Where a frame's code is not the user's. A frame whose function is a mode's
# ``__torch_function__`` is a mode on the way (torch's DeviceContext, ours).
_OURS = _directory(os.path.dirname(__file__))  # the package: this file is in scope/
_TORCH = (_directory(torch.__file__), "<eval_with_key")  # torch, and graphs fx generated
_NOT_USER = (_OURS, *_TORCH, contextlib.__file__, functools.__file__, _directory(wrapt.__file__))

_SEEN: set[tuple[str, int, str]] = set()  # (file, line, op) warned about, for the process
_SEEN_LOCK = threading.Lock()


def check_audit(audit: object) -> AuditLevel | None:
    """The level ``on_device(audit=...)`` asks for, or None for off.

    Example:
        >>> check_audit(True), check_audit(False), check_audit("raise")
        ('warn', None, 'raise')

    Raises:
        ValueError: anything but ``False``, ``True`` or ``"raise"``.
    """
    if audit is False:
        return None
    if audit is True:
        return "warn"
    if audit == "raise" and isinstance(audit, str):
        return "raise"
    msg = (
        f"on_device(audit={audit!r}): audit takes False, True (warn once per line) or "
        f'"raise" (raise at the first stray tensor)\nfix: on_device(device, audit=True)'
    )
    raise ValueError(msg)


def reset_reports() -> None:
    """Forget which lines were warned about, so each warns again (for tests)."""
    with _SEEN_LOCK:
        _SEEN.clear()


class Auditor:
    """Audit mode's machinery, put in place while any block audits, counted like a lock.

    Args:
        state: the running task's audit level and block device, or None where it has no
            audited block; asked only for calls that make tensors.
    """

    def __init__(self, state: AuditState) -> None:
        self._state = state
        self._mode = _AuditMode(self)
        self._holders = 0
        self._lock = threading.Lock()
        self._threads = threading.local()  # how many audited blocks this thread has open
        self._patch = TorchPatch(self._watchers)
        self._hooks: list[Any] = []

    def acquire(self) -> None:
        """An audited block opens in this thread: the mode on its stack, the rest in place."""
        with self._lock:
            if not self._holders:
                self._install()
            self._holders += 1
        count = self._threads.__dict__.get("count", 0)
        if not count:
            _torch_modes.push_mode(self._mode)
        self._threads.count = count + 1

    def release(self) -> None:
        """Undo :meth:`acquire`; the last holder gives torch everything back."""
        self._threads.count -= 1
        if not self._threads.count:
            _torch_modes.remove_mode(self._mode)
        with self._lock:
            self._holders -= 1
            if not self._holders:
                self._uninstall()

    def _watchers(self) -> dict[object, Callable[..., Any]]:
        originals = [(f"torch.{name}", getattr(torch, name)) for name in _UNSEEN]
        originals += [
            (f"torch.nested.{name}", getattr(torch.nested, name)) for name in _UNSEEN_NESTED
        ]
        return {fn: _watched(fn, op, self) for op, fn in originals}

    def _install(self) -> None:
        self._patch.install()
        self._hooks = [
            _module.register_module_buffer_registration_hook(self._buffer_hook),
            _module.register_module_parameter_registration_hook(self._parameter_hook),
        ]

    def _uninstall(self) -> None:
        self._patch.uninstall()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def run(
        self,
        func: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        maker: Callable[..., Any] | None,
    ) -> Any:
        """Run a call that makes tensors (``maker``: torch's function) or takes a generator,
        and report what strays."""
        state = self._state()
        if state is None or probing():
            return func(*args, **kwargs)
        level, block = state
        generator = kwargs.get("generator")
        # None first: isinstance of torch.Generator runs a Python __instancecheck__.
        elsewhere = generator is not None and _is_generator(generator) and generator.device != block
        if elsewhere:
            self._report_generator(level, block, maker or func, generator)
        result = func(*args, **kwargs)
        # A maker given a generator elsewhere makes its tensor there: reported as above.
        if maker is not None and not elsewhere:
            landed = _stray(result, block)
            if landed is not None:
                given = kwargs.get("device") is not None
                op = _op_name(maker)
                fix = _fix(maker, op, block, given)
                _report(level, op, f"made a tensor on {landed}", block, fix, user_calls=True)
        return result

    def check_unseen(self, op: str, result: object) -> None:
        """After ``torch.from_numpy``, ``torch.frombuffer`` or torch.nested's constructors:
        report a stray result."""
        state = self._state()
        if state is None:
            return
        level, block = state
        landed = _stray(result, block)
        if landed is not None:
            # A fix that makes no CPU tensor inside the block, or the audit reports it again.
            if op == "torch.from_numpy":
                fix = f'torch.as_tensor(array, device="{block}")'
                dtype = getattr(result, "dtype", None)
                nearest = None
                if isinstance(dtype, torch.dtype) and not CAPABILITIES.holds(block, dtype):
                    nearest = nearest_dtype(block, dtype)  # float64 on MPS: the cast in the fix
                if nearest is not None:
                    fix = f'torch.as_tensor(array, dtype={nearest}, device="{block}")'
            elif op == "torch.frombuffer":  # it takes no device=
                fix = f'{op}(buffer, dtype=...) before the block, then .to("{block}") inside it'
            elif block.type == "meta":  # torch keeps strided nested tensors off meta
                fix = f'{op}(tensors, layout=torch.jagged, device="meta")'
            else:
                fix = f'{op}(tensors, device="{block}")'
            _report(level, op, f"made a tensor on {landed}", block, fix, user_calls=True)

    def _report_generator(
        self, level: AuditLevel, block: torch.device, func: Callable[..., Any], generator: Any
    ) -> None:
        name = _name_in_caller(generator)
        used = f"used the generator {name}" if name else "used a torch.Generator"
        name = name or "generator"
        fix = f'{name} = torch.Generator(device="{block}")'
        if block.type == "meta":  # no generator lives on meta, where nothing random runs
            fix = "leave generator= out on meta; on an accelerator, " + fix.replace(
                '"meta"', "<the block's device>"
            )
        elif not _has_generators(block):  # a backend without generators of its own
            fix = (
                f"leave generator= out ({block} has no torch.Generator of its own; seed its "
                "default one with torch.manual_seed)"
            )
        op = _op_name(func)
        _report(level, op, f"{used} (on {generator.device})", block, fix, user_calls=True)

    def _buffer_hook(self, module: torch.nn.Module, name: str, buffer: object) -> None:
        self._registered(module, "register_buffer", name, buffer)

    def _parameter_hook(self, module: torch.nn.Module, name: str, parameter: object) -> None:
        self._registered(module, "register_parameter", name, parameter)

    def _registered(self, module: torch.nn.Module, how: str, name: str, tensor: object) -> None:
        if tensor is None or _is_dynamo_compiling():
            return
        state = self._state()
        if state is None:
            return
        level, block = state
        landed = _stray(tensor, block)
        if landed is None:
            return
        op = f"{how}({name!r}) on {type(module).__name__}"
        if how == "register_buffer":
            fix = f'self.register_buffer({name!r}, tensor.to("{block}")), or make the tensor'
        else:
            fix = f'nn.Parameter(tensor.to("{block}")), or build the module'
        fix += f" without device= (the block then picks {block})"
        _report(level, op, f"got a tensor on {landed}", block, fix, user_calls=False)


class _AuditMode(TorchFunctionMode):
    """On a thread's mode stack while it has an audited block open: sees every torch call."""

    def __init__(self, auditor: Auditor) -> None:
        super().__init__()
        self.auditor = auditor

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        # Where dynamo traces this, first: it cannot hash a torch function it does not know
        # (its tables, built inside a block, list the constructors' replacements).
        if _is_dynamo_compiling():
            return func(*args, **kwargs)
        if func in _MADE:
            return self.auditor.run(func, args, kwargs, func)
        maker = None
        if type(func) is FunctionType:
            # torch passes the function its module holds: for torch.fft, torch.linalg, ...
            # (torch._C._fft, ...), the constructor's replacement while a block is open.
            wrapped = getattr(func, "__wrapped__", None)
            if isinstance(wrapped, BuiltinFunctionType) and wrapped in _MADE:
                maker = wrapped
        if maker is not None or "generator" in kwargs:
            return self.auditor.run(func, args, kwargs, maker)
        return func(*args, **kwargs)


def _watched(original: Any, op: str, auditor: Auditor) -> Callable[..., Any]:
    """``torch.from_numpy`` (or another function no mode sees), reporting a stray result."""

    @functools.wraps(original)
    def made(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if _is_dynamo_compiling():  # where dynamo traces this: not audited
            inline_only()
        else:
            auditor.check_unseen(op, result)
        return result

    return made


def _is_generator(value: object) -> bool:
    return isinstance(value, torch.Generator)


def _stray(result: object, block: torch.device) -> torch.device | None:
    """The device of the first tensor in ``result`` that is not on ``block``, or None."""
    if isinstance(result, torch.Tensor):
        return None if result.device == block else result.device
    if isinstance(result, (tuple, list)):
        for item in result:
            if isinstance(item, torch.Tensor) and item.device != block:
                return item.device
    return None


def _op_name(func: Callable[..., Any]) -> str:
    """``torch.zeros_like``, ``torch.fft.fftfreq``, ``Tensor.new_zeros``, ``Tensor.normal_``."""
    if func in _NEW:
        return f"Tensor.{func.__name__}"
    name = _names().get(func) if func in _MADE else None
    if name is None:
        try:
            name = resolve_name(func)
        except Exception:  # a torch without the name table: the short name will do
            name = None
    name = name or f"torch.{func.__name__}"
    return name.replace("torch.Tensor.", "Tensor.")


@functools.cache
def _names() -> dict[object, str]:
    """The public name of each function that makes tensors. Built at the first report:
    torch.overrides' own table, built inside a block, lists the constructors' replacements."""
    names: dict[object, str] = {}
    for namespace in (torch, torch.fft, torch.linalg, torch.special, torch.nested, torch.sparse):
        for name, value in vars(namespace).items():
            original = getattr(value, "__wrapped__", value)
            public = not name.startswith("_") and isinstance(original, BuiltinFunctionType)
            if public and original in _MADE:
                names.setdefault(original, f"{namespace.__name__}.{name}")
    return names


def _fix(func: Callable[..., Any], op: str, block: torch.device, given: bool) -> str:
    device = f'device="{block}"'
    if func in _LIKE:
        return f"{op}(x, {device}), or move x to {block} first"
    if func in _NEW:
        return f"x.{func.__name__}(..., {device}), or move x to {block} first"
    if given:
        return f"{op}(..., {device}), or leave device= out (the block then picks {block})"
    return (
        f"{op}(..., {device}); without device= it got torch's own default: {op} held in "
        f"an object, a closure or a default argument is not filled in (call {op} by its name, "
        f"or use on_device(..., exact=True))"
    )


def _report(
    level: AuditLevel, op: str, finding: str, block: torch.device, fix: str, *, user_calls: bool
) -> None:
    """Warn once per line and op, or raise; at the user's line that led here.

    With ``user_calls``, only where the user's code made the call itself: the caller of the
    op, past devicectx and the modes on the way, is not torch.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_OURS) or frame.f_code.co_name == "__torch_function__"
    ):
        frame = frame.f_back
    if frame is None or (user_calls and frame.f_code.co_filename.startswith(_TORCH)):
        return
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_USER):
        frame = frame.f_back
    if frame is None:
        return
    filename, line = frame.f_code.co_filename, frame.f_lineno
    text = (
        f"{op} at {filename}:{line} {finding} inside an audited on_device block on {block}\n"
        f"fix: {fix}"
    )
    if level == "raise":
        raise StrayTensorError(text) from None
    key = (filename, line, f"{op} {finding.split(' ')[0]}")
    with _SEEN_LOCK:
        if key in _SEEN:
            return
        _SEEN.add(key)
    warn_at(frame, text, StrayTensorWarning)


def _name_in_caller(value: object) -> str | None:
    """The name the user's code holds ``value`` by (a local, else a global), if any."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_USER):
        frame = frame.f_back
    if frame is None:
        return None
    for names in (frame.f_locals, frame.f_globals):
        for name, held in names.items():
            if held is value:
                return name
    return None


def _has_generators(device: torch.device) -> bool:
    """Whether ``torch.Generator(device=...)`` can be made for ``device``: not for every
    backend registered out of tree (the emulated accelerator plays one with
    ``configure(generators=False)``)."""
    try:
        torch.Generator(device=device)
    except (RuntimeError, NotImplementedError):
        return False
    return True
