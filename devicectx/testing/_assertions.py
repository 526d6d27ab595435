"""``assert_device_agnostic``: run a function on every device and compare what comes back."""

from __future__ import annotations

import functools
import inspect
import linecache
import math
import numbers
import re
import sys
import warnings
from collections.abc import Callable, Iterable
from types import FrameType, TracebackType
from typing import NamedTuple

import torch
from torch import nn

from devicectx._errors import DeviceMismatchError, DeviceWarning, with_article
from devicectx.decorator._autograd import function_of
from devicectx.decorator._wrappers import DeviceAgnosticWrapper, _BoundWrapper
from devicectx.devices._capabilities import CAPABILITIES, nearest_dtype
from devicectx.devices._resolve import DeviceLike, available_devices, resolve_device
from devicectx.move._dtypes import DtypesLike, check_dtypes
from devicectx.move._repeats import NOT_CALLERS
from devicectx.move._unseen import (
    Unseen,
    fix_for,
    is_device_mismatch,
    stored_device_fix,
    stored_devices,
    stray_device,
    unseen_tensors,
)
from devicectx.testing._compare import Hints, Run, compare, memory_of, moves_to
from devicectx.testing._inputs import Inputs, holds_for, leave_out, named_arguments, walk_arguments
from devicectx.testing._left import LEFT_FIXES, left_in

_META = torch.device("meta")
# What torch says where code asks for CUDA by name on a machine (or a build) without it.
_NO_CUDA = (
    "Torch not compiled with CUDA enabled",
    "Found no NVIDIA driver",
    "No CUDA GPUs are available",
)
# torch's words for an op without a kernel for the device: the dispatcher's (a backend's
# missing kernel; the emulated accelerator's fallback names the CPU), then MPS's.
_NO_KERNEL = re.compile(r"Could not run '(?P<op>[^']+)' with arguments from the '[^']+' backend\.")
_MPS_NO_KERNEL = re.compile(
    r"The operator '(?P<op>[^']+)' is not currently implemented for the MPS device\."
)
# meta's: an op without a Meta kernel, and nonzero's (boolean indexing's too), which has
# one that refuses: its output's shape depends on the values, which meta has none of.
_META_NO_KERNEL = re.compile(
    r"(?P<op>\w+::[\w.]+): attempted to run this operator with Meta tensors, but there was "
    r"no fake impl or Meta kernel registered\."
)
_META_NONZERO = re.compile(
    r"The register_meta function for torch\.(?P<op>nonzero)\(\) raises unimplemented by default"
)
# Ops whose output's shape depends on the input's values: meta cannot run them.
_VALUE_SHAPED = frozenset(
    {
        "aten::nonzero",
        "aten::masked_select",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
        "aten::bincount",
        "aten::histc",
        "aten::repeat_interleave",
    }
)
_NUMPY_OFF_CPU = "device type tensor to numpy"
# MPS's words (and the emulated accelerator's, playing it) for a dtype it cannot hold.
_NO_DTYPE = re.compile(r"Cannot convert a \w+ Tensor to (?P<dtype>\w+) dtype")
# What torch says where meta is asked for values: .item() (float(t), bool(t)), .tolist(),
# .cpu().
_NO_VALUES_ON_META = ("cannot be called on meta tensors", "Cannot copy out of meta tensor")
_EMULATED_INSTEAD = (
    "check it on the emulated accelerator instead of meta (pytest "
    "--devicectx-accelerator=emulated, devices=['cpu', 'emu:0'])"
)
_DROPOUTS = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


def assert_device_agnostic(
    fn: Callable[..., object],
    /,
    *args: object,
    devices: Iterable[DeviceLike] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    dtypes: DtypesLike = None,
    **kwargs: object,
) -> None:
    """Assert that ``fn`` gives the same result on every device, each time on that device.

    ``fn(*args, **kwargs)`` is called once per device, with every tensor in ``args`` and
    ``kwargs`` moved there by :func:`devicectx.to_device`; each output is compared with the
    first device's: the same containers and tensors at the same paths, each tensor on the
    device it ran on, with the same dtype, shape, layout and ``requires_grad``, the same
    tensors shared between paths (the same object, or views of one tensor), and values
    within ``rtol``/``atol``. Where the outputs agree, what ``fn`` left in the modules it
    was given is compared so too, after the call: each parameter by its gradient where it
    has one (``model.weight.grad``), by its value where it has none, and each buffer; so a
    training step that returns its loss alone is checked by the gradients it computed.

    Example:
        >>> import torch
        >>> def scale(x, factor=2.0):
        ...     return {"y": x * factor, "n": x.new_tensor(x.numel())}
        >>> assert_device_agnostic(scale, torch.ones(3), devices=["cpu", "meta"])

    Args:
        fn: the function to check. An ``nn.Module``, or a bound method of one
            (``model.forward``), is copied to each device like a module argument.
        *args: its positional arguments.
        devices: the devices to run on, in order; the first is the reference. Default:
            :func:`devicectx.available_devices` (the CPU and every accelerator index), with
            ``meta`` added where that is the CPU alone: a check needs a second device.
            ``"meta"`` may be listed: there only structure, dtype and shape are compared.
            Devices that are all one (``["cpu", "cpu"]``) compare nothing across devices:
            a :class:`devicectx.DeviceWarning` says so.
        rtol: relative tolerance for floating point values; with ``atol``, as in
            ``torch.testing.assert_close``. Default: by dtype, ``torch.testing``'s defaults
            (``1.3e-6`` for float32). Integer and bool values are compared exactly.
        atol: absolute tolerance. Give both or neither.
        dtypes: what to do with inputs of a dtype a device cannot hold (float64 on MPS),
            as in :func:`devicectx.to_device`: ``None`` refuses them, before ``fn`` runs;
            ``"device"`` casts them, on each device that cannot hold them and nowhere
            else, to the nearest dtype it holds (float64 to float32), and then accepts
            there the dtype it holds where the reference has the other (float32 for
            float64), with the values compared within the wider tolerance of the two
            dtypes (float32's), as ``torch.testing.assert_close`` does for two dtypes; a
            mapping (``{torch.float64: torch.float32}``) casts on every device, the
            reference included. Module arguments' copies are cast too.
        **kwargs: its keyword arguments.

    Raises:
        AssertionError: an output differs. The message names each device that differed,
            each output path (``out['logits'][1]``) and what differs: missing or extra
            tensors, a container's type, the device, dtype, shape, layout,
            ``requires_grad``, which tensors are one or share memory, or how many values
            differ and by how much (max abs and rel diff), or a number in the output that
            differs (``out['loss']: 4.5, expected 4.0``); or, the outputs alike, a
            gradient, parameter or buffer of a module in the call that differs after it
            (``model.weight.grad: 4 of 4 values differ``). Also raised, chained to what
            ``fn`` raised: when ``fn`` raises on a device other than the first; on any
            device, for torch's device mismatch (the message names the tensors the move
            could not see, in attributes of a plain object or a module's attribute that is
            no buffer, and those ``fn`` made during the call and kept; else it points at a
            tensor made without ``device=``), and for CUDA asked for by name (``.cuda()``)
            where there is none. A later device's error names an op that device has no
            kernel for as its gap, and a host round trip (``.numpy()``; on meta
            ``.item()`` too) as such, each with its fix; a dtype ``fn`` makes that the
            device cannot hold (``.double()`` on MPS) is named as its gap on any
            device. Another error on the first device is ``fn``'s own, raised as it is.
        TypeError, ValueError: ``devices``, ``rtol``, ``atol`` or ``dtypes`` are not usable
            (a tolerance that is no number, negative or NaN; a hypothesis strategy for
            ``devices``, which the test draws from), before ``fn`` runs. TypeError also
            for an optimizer whose parameters are no module's in the call (before ``fn``
            runs), and for an iterator in the output (a generator: comparing it would run
            it).
        devicectx.DtypeUnsupportedError: a device cannot hold an input's dtype, and
            ``dtypes`` casts it to none it holds; raised before ``fn`` runs.
        devicectx.InvalidDeviceError, devicectx.DeviceUnavailableError: a listed device
            is malformed or not on this machine.

    Caveats:
        - ``fn`` runs without a device scope, as a caller would call it: a tensor it creates
          without ``device=`` lands on torch's default device and is reported as on the
          wrong device (``@devicectx.device_agnostic`` scopes it for you).
        - Every device's inputs are made before the first call, from the caller's, so an
          in-place write by ``fn`` reaches neither another run (the same device listed
          twice too) nor the caller: a tensor already on a run's device is copied for it,
          views kept views of the input tensor that covers them, as the move to another
          device copies them. Tensors held by a plain object or by an object with its own
          ``.to`` are passed as they are, to every run.
        - Every ``nn.Module`` in the call (``fn`` itself, an argument, or one inside a
          container argument: a dict, a list, a dataclass) is deep-copied for each device,
          one copy per module, so the caller's model is never moved or changed (a model
          accelerate placed with its hooks is refused: a copy would not follow them); a module's
          parameter passed beside it is the copy's, and a weight two modules share stays
          one in their copies. One inside an object with its own ``.to``, or in a plain
          object (a trainer's ``self.model``), is left as it is, and what ``fn`` leaves in
          it is not compared. A weight an optimizer stepped is compared by its gradient,
          not by its value: an adaptive optimizer's first steps move a weight by about
          ``lr * sign(grad)``, so rounding noise around a zero gradient moves it another
          way on each device.
        - An optimizer (``torch.optim.Optimizer``) or LR scheduler in the arguments is
          copied with the modules, for each device: the copy steps the copied model's
          parameters, from the caller's state (momentum, moments), moved as
          ``load_state_dict`` moves it, so the caller's optimizer is not changed either.
          Pass the model too. Hooks registered on the optimizer are not copied; other
          objects that hold a model or its parameters (an EMA helper) are not copied:
          build those inside ``fn``, from the model it is given.
        - A ``torch.Generator`` in the arguments is copied for each run, in the caller's
          generator's state: every device draws the numbers it would draw next, and the
          caller's is not advanced.
        - Tensors, numbers (an ``int`` and a numpy bool exactly, a ``float`` from
          ``loss.item()`` within the tolerances, by default float32's), numpy arrays (as
          tensors: dtype, shape, and values where they are numbers), ``torch.Size`` and
          ``torch.dtype`` values (a TensorDict's ``batch_size`` and ``names`` too), and
          the types of containers and of those values are compared (found with the move
          engine's walk, so every container it supports; tensors held by plain objects
          are not, and a check that passes warns of them, with the fix).
          Other values in the output are not: a ``str`` or a ``torch.device`` names the
          device it ran on by nature; nor numbers inside a set. An iterator (a generator)
          is refused: return a list. ``fn`` must be deterministic: a random op (dropout in
          training mode: call ``model.eval()`` first) draws other numbers on each device,
          whatever the seed.
        - Strides are not compared: they may differ between backends. So may what
          ``reshape()`` and ``contiguous()`` return (their input, a view of it, or a copy,
          as the strides allow), and that shows as tensors shared on one device only:
          return ``x.clone()`` where a copy is meant. Which outputs are views of the
          inputs' memory is not compared (the move to a device copies some views apart:
          empty ones, slices that overlap without their base); which are the same tensor is.
        - A set (or frozenset) has no order: its iteration order follows hashes, ids for
          tensors, so it differs between runs. Each member is compared with the member of
          the reference's set it equals, whatever the order; a member that equals none is
          reported at ``list(out)[i]``, ``i`` the place of a reference member left over.
        - ``devices``, ``rtol``, ``atol`` and ``dtypes`` are this function's own; to pass
          arguments with those names to ``fn``, wrap it:
          ``assert_device_agnostic(lambda x: fn(x, atol=1), x)``.
    """
    __tracebackhide__ = True
    targets = _resolve_devices(devices)
    tolerances = _check_tolerances(rtol, atol)
    _check_dtypes(dtypes)
    inputs = Inputs(fn, args, kwargs, dtypes, targets)
    # Every run's inputs are built from the caller's untouched objects before any run.
    calls = [(device, inputs.on(device)) for device in targets]
    outputs: list[tuple[torch.device, object]] = []
    for device, (call_fn, call_args, call_kwargs, _) in calls:
        try:
            outputs.append((device, call_fn(*call_args, **call_kwargs)))
        except Exception as error:
            reference = outputs[0][0] if outputs else None
            raised = _raised(inputs, device, reference, error, (call_fn, call_args, call_kwargs))
            if raised is None:
                raise
            raise AssertionError(raised) from error
    runs = [Run(device, holds_for(dtypes, device), memory_of(call[:3])) for device, call in calls]
    call = "model" if isinstance(fn, nn.Module) else "fn"
    if inspect.isfunction(fn) and inputs.name.isidentifier():
        call = inputs.name
    hidden = functools.partial(_hidden, inputs)
    hints = Hints(_decorated(fn, inputs.name), functools.partial(_training, inputs), call, hidden)
    message = compare(inputs.name, outputs, tolerances, runs, hints)
    if message is None:  # the outputs agree; what the call left in its modules must too
        left: list[tuple[torch.device, object]] = [
            (device, left_in(run.modules)) for device, run in calls
        ]
        message = compare(inputs.name, left, tolerances, runs, hints, LEFT_FIXES)
        if message is not None:
            title, _, rest = message.partition("\n")
            message = f"{title}\n{_LEFT_IN_MODULES}\n{rest}"
    if message is not None:
        raise AssertionError(message)
    _warn_uncompared(inputs.name, outputs[0][1])


_LEFT_IN_MODULES = (
    "  its outputs agree; what it left in the modules it was given (each parameter's "
    "gradient, or the parameter where it has none, and the buffers):"
)


def _warn_uncompared(name: str, output: object) -> None:
    """Warn of the output's tensors that the comparison could not look at (held by plain
    objects: a transformers cache's layers), where the check passed: it says nothing of
    them."""
    unseen = [u for u in unseen_tensors([("out", output)]) if u.module is None]
    if not unseen:
        return
    shown = [f"    {u.path} (in {u.holder.__qualname__})" for u in unseen[:_LISTED]]
    if len(unseen) > _LISTED:
        shown.append(f"    and {len(unseen) - _LISTED} more")
    message = "\n".join(
        [
            f"assert_device_agnostic({name}): passed, but these tensors of the output were not "
            f"compared (held by objects the comparison does not look into):",
            *shown,
            f"fix: teach devicectx those types, and the check compares them: "
            f"{fix_for(unseen, argument=False, own_to=False)}",
        ]
    )
    warnings.warn(message, DeviceWarning, stacklevel=3)


_LISTED = 4  # the uncompared tensors a warning names; the rest are counted


def _resolve_devices(devices: Iterable[DeviceLike] | None) -> list[torch.device]:
    if devices is None:
        found = available_devices()
        # The CPU alone would be compared with itself, and every check would pass.
        return found if len(found) > 1 else [*found, _META]
    hypothesis = sys.modules.get("hypothesis.strategies")
    if hypothesis is not None and isinstance(devices, hypothesis.SearchStrategy):
        given = repr(devices)
        given = given if len(given) <= 60 else "<a hypothesis strategy>"
        msg = (
            f"assert_device_agnostic(devices={given}): devices takes a list of devices, "
            f"not a hypothesis strategy: the test draws from it, the assertion does not\n"
            f"fix: draw one in the test, @given(device=strategy) and devices=['cpu', "
            f"device] (or data.draw(strategy) with @given(data=st.data())), or take the "
            f"plugin's device fixture: def test_x(device): ... devices=['cpu', device]"
        )
        raise TypeError(msg)
    if isinstance(devices, (str, torch.device, int)):
        pair = ", ".join(repr(str(device)) for device in _pair_for(devices))
        msg = (
            f"assert_device_agnostic(devices={devices!r}): devices takes a list of devices\n"
            f"fix: devices=[{pair}]"
        )
        raise TypeError(msg)
    resolved = [resolve_device(device) for device in devices]
    if not resolved:
        msg = (
            "assert_device_agnostic(devices=[]): no device to run on\nfix: devices=['cpu', 'meta']"
        )
        raise ValueError(msg)
    if len(set(resolved)) == 1:
        _warn_one_device(resolved[0])
    return resolved


def _warn_one_device(device: torch.device) -> None:
    """Warn of a check that compares ``device`` with itself: it finds no device bug (a
    tensor put on the CPU by name is on the right device there), yet it passes."""
    pair = ", ".join(repr(str(d)) for d in _pair_for(device))
    msg = (
        f"assert_device_agnostic(devices=[{str(device)!r}, ...]): every device listed is "
        f"{device}, so nothing is compared across devices: the check passes code that "
        f"runs on {device} alone\n"
        f"fix: devices=[{pair}] (or, with the plugin's device fixture on a machine "
        f"without an accelerator, pytest --devicectx-accelerator=emulated)"
    )
    warnings.warn(msg, DeviceWarning, stacklevel=4)


def _pair_for(device: DeviceLike) -> list[torch.device]:
    """The CPU and a device to compare it with, for one device given where a list is due:
    that device, else (the CPU itself, or no device here) an accelerator, else ``meta``."""
    try:
        target = resolve_device(device)
    except Exception:  # malformed or absent: the fix must name a device that is here
        target = torch.device("cpu")
    if target.type == "cpu":
        others = [d for d in available_devices() if d.type != "cpu"]
        target = others[0] if others else _META
    return [torch.device("cpu"), target]


def _check_tolerances(rtol: float | None, atol: float | None) -> tuple[float, float] | None:
    if (rtol is None) != (atol is None):
        given = f"rtol={rtol!r}" if atol is None else f"atol={atol!r}"
        msg = (
            f"assert_device_agnostic({given}): give both rtol and atol, or neither "
            f"(then they depend on the dtype, as in torch.testing.assert_close)\n"
            f"fix: assert_device_agnostic(fn, ..., rtol=1e-5, atol=1e-8)"
        )
        raise ValueError(msg)
    if rtol is None or atol is None:
        return None
    # Checked before fn runs: torch would refuse them only in the comparison, after every
    # device's run, and never for integer outputs, which ignore tolerances.
    for label, value in (("rtol", rtol), ("atol", atol)):
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            msg = (
                f"assert_device_agnostic({label}={value!r}): {label} takes a float, "
                f"got a {type(value).__qualname__}\n"
                f"fix: assert_device_agnostic(fn, ..., rtol=1e-5, atol=1e-8)"
            )
            raise TypeError(msg)
        if math.isnan(value) or value < 0:
            msg = (
                f"assert_device_agnostic({label}={value!r}): {label} must be 0 or more, "
                f"as in torch.testing.assert_close\n"
                f"fix: assert_device_agnostic(fn, ..., rtol=1e-5, atol=1e-8)"
            )
            raise ValueError(msg)
    return float(rtol), float(atol)


def _check_dtypes(dtypes: DtypesLike) -> None:
    try:
        check_dtypes(dtypes)
    except (TypeError, ValueError) as error:
        msg = f"assert_device_agnostic: {error}"
        raise type(error)(msg) from None


def _raised(
    inputs: Inputs,
    device: torch.device,
    reference: torch.device | None,
    error: Exception,
    call: tuple[Callable[..., object], tuple[object, ...], dict[str, object]],
) -> str | None:
    """The failure message for ``fn`` raising ``error`` on ``device``; None where it is
    ``fn``'s own error to raise as it is: on the first device (``reference`` None), and
    nothing about devices in it (an op the device has no kernel for is the device's gap,
    named wherever it comes)."""
    name = inputs.name
    missing = _missing_op(error)
    detail = _trimmed(error, missing).replace("\n", "\n    ")
    where = f"on {device}" if reference is None else f"on {device}, not on {reference}"
    lines = [f"{name} is not device-agnostic: it raised {where}:", f"    {detail}"]
    if isinstance(error, DeviceMismatchError):  # @device_agnostic's: its fix is there
        return "\n".join(lines)
    if is_device_mismatch(error):
        unseen, made = _unseen(inputs, device, call)
        if unseen:
            lines.append(f"  tensors the move to {device} could not see, left where they were:")
            lines += [f"    {u.device} <- {u.path} (in {u.holder.__qualname__})" for u in unseen]
            lines.append(f"fix: {fix_for(unseen)}")
            return "\n".join(lines)
        if made:
            lines.append(f"  tensors {name} made during the call, kept off {device}:")
            lines += [f"    {u.device} <- {u.path} (in {u.holder.__qualname__})" for u in made]
        stray = stray_device(error, device)
        stored = [] if stray is None else stored_devices(named_arguments(*call), stray)
        if stored:
            lines.append("  devices stored in the call's objects, which may have put it there:")
            lines += [f"    {stray} <- {path}" for path in stored]
            lines.append(f"fix: {stored_device_fix(stored[0])}")
            return "\n".join(lines)
        if stray is not None and stray.type == device.type:
            lines.append(
                f"fix: {name} makes a tensor on {stray}, and runs on {device}: a device named "
                f'by its type alone (device=x.device.type, "{device.type}") is the current '
                f"one, not the inputs': use the inputs' device itself, "
                f"torch.zeros(n, device=x.device)"
            )
            return "\n".join(lines)
        inner = _failed_in(error)
        if _over_numpy(error):
            lines.append(
                f"fix: {inner or name} makes a tensor over a numpy array's memory "
                f"(torch.from_numpy), which stays on the CPU, decorated or not: "
                f"torch.as_tensor(array, device={_inputs_device(call)}) makes it on its "
                f"inputs' device"
            )
        elif inner is not None and inner != _decorated(inputs.fn, name):
            # The op that met the stray tensor is in code fn calls (a submodule of a
            # wrapper, say): the tensor was made there, or passed there. An
            # autograd.Function's forward and backward take no decorator (backward runs
            # outside any block, and a decorated forward's moves break its gradients).
            decorate = None if _in_autograd_function(error) else inner
            lines.append(_made_without_device(inner, decorate, device))
        else:
            lines.append(_made_without_device(name, _decorated(inputs.fn, name), device))
        return "\n".join(lines)
    if device.type != "cuda" and any(words in str(error) for words in _NO_CUDA):
        lines.append(
            f'fix: {name} asks for CUDA by name (.cuda(), device="cuda"), and runs on '
            f"{device} here: use its inputs' device instead, t.to(x.device), "
            f"torch.zeros(n, device=x.device)"
        )
        return "\n".join(lines)
    if missing is not None:  # torch's own words, on the first device too
        ran = "" if reference is None else f": it ran on {reference}"
        if device.type == "meta" and missing.op in _VALUE_SHAPED:
            lines.append(
                f"  meta has no values, and {missing.op} makes a tensor whose shape depends "
                f"on them (torch's gap, not {name}'s{ran})"
            )
        else:
            lines.append(
                f"  {device} has no kernel for {missing.op}: an op the device's backend lacks "
                f"(torch's gap, not {name}'s{ran})"
            )
        lines.append(f"fix: {_missing_op_fix(inputs, device, missing.mps)}")
        return "\n".join(lines)
    lacked = _lacked_dtype(error, device)
    if lacked is not None:  # the device's gap, on the first device too
        lines.append(f"  {device} holds no {lacked}, which {name} makes there")
        lines.append(f"fix: {_lacked_dtype_fix(name, device, lacked, inputs.devices)}")
        return "\n".join(lines)
    lacked = _lacked_default_dtype(error, device)
    if lacked is not None:  # torch turns the refusal into NotImplemented: a TypeError
        lines.append(
            f"  {device} holds no {lacked}, torch's default dtype here, which an op of a "
            f"tensor and a Python float makes (ids * 0.5)"
        )
        nearest = nearest_dtype(device, lacked)
        leave = leave_out(device, inputs.devices, [lacked])
        lines.append(
            f"fix: keep torch's default dtype one {device} holds where {name} runs there "
            f"(torch.set_default_dtype({nearest})), or {leave}"
            if nearest is not None
            else f"fix: {leave}"
        )
        return "\n".join(lines)
    inference = _inference_inputs(inputs, device) if "nference tensor" in str(error) else []
    if inference:
        shown = ", ".join(inference[:3])
        lines.append(
            f"  {shown}: made under torch.inference_mode() and on {device} already, so "
            f"{name} gets {'it' if len(inference) == 1 else 'them'} as made, which torch "
            f"refuses here; a move to another device makes a normal tensor, so a run "
            f"there passes"
        )
        lines.append(
            f"fix: make {shown} under torch.no_grad() instead of torch.inference_mode(), "
            f"or pass {inference[0]}.clone() (outside inference mode, a normal tensor)"
        )
        return "\n".join(lines)
    if reference is None:
        return None
    lines.append(f"fix: {_host_fix(name, error, device, inputs.devices)}")
    return "\n".join(lines)


def _inference_inputs(inputs: Inputs, device: torch.device) -> list[str]:
    """The paths of the call's inference tensors on ``device``: the ones that reach ``fn``
    as made, where a move elsewhere would have made normal tensors of them."""
    named = named_arguments(inputs.fn, inputs.args, inputs.kwargs)
    return [
        path
        for path, value in walk_arguments(named)
        if isinstance(value, torch.Tensor) and value.is_inference() and value.device == device
    ]


class _MissingOp(NamedTuple):
    """An op torch says the device has no kernel for, and the words it says it in."""

    op: str
    mps: bool  # MPS's words (with its fallback as a fix)
    found: re.Match[str]  # where torch's first sentence ends: the rest is left out


def _missing_op(error: Exception) -> _MissingOp | None:
    """The op named by torch's error for an op without a kernel for the device (the
    dispatcher's words, MPS's, meta's); None for any other error."""
    if not isinstance(error, NotImplementedError):
        return None
    text = str(error)
    for pattern in (_NO_KERNEL, _MPS_NO_KERNEL, _META_NO_KERNEL, _META_NONZERO):
        found = pattern.search(text)
        if found is not None:
            op = found["op"] if "::" in found["op"] else f"aten::{found['op']}"
            return _MissingOp(op, pattern is _MPS_NO_KERNEL, found)
    return None


def _lacked_dtype(error: Exception, device: torch.device) -> torch.dtype | None:
    """The dtype torch's error says ``device`` cannot hold, where it cannot; else None."""
    found = _NO_DTYPE.search(str(error)) if isinstance(error, TypeError) else None
    dtype = None if found is None else getattr(torch, found["dtype"], None)
    if not isinstance(dtype, torch.dtype) or CAPABILITIES.holds(device, dtype):
        return None
    return dtype


def _lacked_default_dtype(error: Exception, device: torch.device) -> torch.dtype | None:
    """torch's default dtype, where ``device`` cannot hold it and the error is an operator's
    refusal (``x * 0.5`` makes the default dtype; torch reports the device's refusal as
    Python's "unsupported operand type(s)"); else None."""
    if not (isinstance(error, TypeError) and "unsupported operand type(s)" in str(error)):
        return None
    dtype = torch.get_default_dtype()
    return None if CAPABILITIES.holds(device, dtype) else dtype


def _lacked_dtype_fix(
    name: str, device: torch.device, dtype: torch.dtype, devices: list[torch.device]
) -> str:
    """The fix for ``fn`` making a dtype ``device`` cannot hold: compute in the nearest
    dtype it holds. ``dtypes=`` is none: it casts the inputs, not what ``fn`` makes."""
    leave = leave_out(device, devices, [dtype])
    nearest = nearest_dtype(device, dtype)
    if nearest is None:
        return f"make {name} compute in a dtype {device} holds, or {leave}"
    methods = "x.float(), not x.double(); " if dtype == torch.float64 else ""
    return (
        f"make {name} compute in a dtype {device} holds, {nearest} for {dtype} ({methods}"
        f"dtype={nearest} in the constructors, torch.as_tensor(array, dtype={nearest}, "
        f"device=x.device) for a numpy array), or {leave}"
    )


def _trimmed(error: Exception, missing: _MissingOp | None) -> str:
    """``error`` as the message quotes it: for an op without a kernel, torch's first
    sentence, without the dispatch keys (fifty lines), MPS's advice or meta's."""
    text = str(error)
    if missing is not None:
        end = missing.found.end()
        if text[end:].strip():
            dispatcher = missing.found.re is _NO_KERNEL
            left = "torch's list of dispatch keys" if dispatcher else "the rest of torch's text"
            text = f"{text[:end]} ({left} left out)"
    return f"{type(error).__name__}: {text}"


def _missing_op_fix(inputs: Inputs, device: torch.device, mps: bool) -> str:
    leave = _leave_out_lacking(inputs, device)
    if not mps:
        return leave
    return (
        "run with MPS's CPU fallback for the ops it lacks, set before Python starts "
        f"(PYTORCH_ENABLE_MPS_FALLBACK=1 pytest ...), or {leave}"
    )


def _leave_out_lacking(inputs: Inputs, device: torch.device) -> str:
    """The fix that leaves ``device`` out where it lacks an op: to meta, as for any device,
    only where ``fn`` runs there (meta lacks many ops an accelerator lacks: sparse ones),
    else to an accelerator of this machine, or an op on the CPU in ``fn``."""
    name = inputs.name
    # A backend lacks the op on each of its devices.
    devices = [d for d in inputs.devices if d == device or d.type != device.type]
    others = [d for d in devices if d != device]
    if device.type == "meta" or not (_META in others or len(others) < 2):
        return leave_out(device, devices)
    # Made as every run is, from the caller's objects; a run on meta before this one
    # succeeded, which settles it.
    ran = inputs.devices[: inputs.devices.index(device)]
    why = None if _META in ran else _fails_on_meta(inputs)
    if why is None:
        return leave_out(device, devices)
    kept = list(dict.fromkeys(str(d) for d in others if d != _META))
    accelerators = [
        str(d)
        for d in available_devices()
        if d.type not in ("cpu", device.type) and d not in others
    ]
    if len(kept) >= 2:
        return f"leave {device} and meta out: devices={kept!r} (meta {why})"
    if accelerators:
        pair = [*(kept or ["cpu"]), accelerators[0]]
        return f"leave {device} out: devices={pair!r} (meta, the usual second device, {why})"
    return (
        f"run that op on the CPU in {name} where {device} lacks it (x.cpu(), then "
        f".to(x.device) on its result), or check {name} where another accelerator is "
        f"(devices=['cpu', 'cuda']): leaving {device} out here leaves the CPU alone, as "
        f"meta {why}"
    )


def _fails_on_meta(inputs: Inputs) -> str | None:
    """Why ``fn`` cannot run on meta, as the fix says it ("lacks an op fn needs too
    (aten::_to_sparse)"), or None where it runs there."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            call_fn, args, kwargs, _ = inputs.on(_META)
            call_fn(*args, **kwargs)
    except Exception as error:  # whatever stops fn there makes meta no second device
        missing = _missing_op(error)
        if missing is not None:
            return f"lacks an op {inputs.name} needs too ({missing.op})"
        first = str(error).strip().split("\n")[0].split(". ")[0]
        return f"fails {inputs.name} too ({type(error).__name__}: {first})"
    return None


def _host_fix(
    name: str, error: Exception, device: torch.device, devices: list[torch.device]
) -> str:
    """The fix for ``fn`` raising on a later device: a round trip through the host
    (numpy, or values read on meta) where torch's words tell one, else to make it work."""
    on_meta = device.type == "meta"
    if _NUMPY_OFF_CPU in str(error):
        what = (
            f"{name} converts a tensor to numpy (.numpy()), which fails on every device but the CPU"
        )
        fix = (
            "keep the work in torch, or copy there and back: "
            "torch.as_tensor(f(x.detach().cpu().numpy()), device=x.device)"
        )
        if on_meta:
            no_values = f"meta has no values to convert: {_EMULATED_INSTEAD}"
            return f"{what}, and {no_values}, where the fix is to {fix}"
        return f"{what}: {fix}"
    if on_meta and any(words in str(error) for words in _NO_VALUES_ON_META):
        return (
            f"{name} copies a tensor's values to the host (.item(), .tolist(), .cpu()), "
            f"which meta has none of: {leave_out(device, devices)}"
        )
    return f"make {name} work on {device}, or leave {device} out of devices="


def _unseen(
    inputs: Inputs,
    device: torch.device,
    call: tuple[Callable[..., object], tuple[object, ...], dict[str, object]],
) -> tuple[list[Unseen], list[Unseen]]:
    """For torch's device mismatch: the tensors off ``device`` that the move to it could
    not see (in attributes of plain objects, plain attributes of modules), and those among
    them that were not there before the call (``fn`` made them, and kept them there)."""
    after = [u for u in unseen_tensors(named_arguments(*call)) if u.device != device]
    if not after:
        return [], []
    # The caller's objects, as every run's were before its call: the module copies were
    # made of them, and no run touched them.
    caller = named_arguments(inputs.fn, inputs.args, inputs.kwargs)
    before = {u.path for u in unseen_tensors(caller)}
    return [u for u in after if u.path in before], [u for u in after if u.path not in before]


def _raising_entry(error: Exception) -> TracebackType | None:
    """The entry of ``error``'s traceback whose line raised it: the innermost outside torch
    and devicectx (``torch_geometric``'s is not torch's); None where there is none."""
    found = None
    entry = error.__traceback__
    while entry is not None:
        if not entry.tb_frame.f_code.co_filename.startswith(NOT_CALLERS):
            found = entry
        entry = entry.tb_next
    return found


def _failed_in(error: Exception) -> str | None:
    """The function (``Scale.forward``) whose line raised ``error``
    (:func:`_raising_entry`'s); None where there is none."""
    entry = _raising_entry(error)
    if entry is None or entry.tb_frame.f_code.co_name.startswith("<"):  # a lambda, a genexpr
        return None
    found = entry.tb_frame
    code = found.f_code
    function = _autograd_function(found)
    if function is not None:
        return f"{function}.{code.co_name}"
    # A method's first parameter, whatever its name: an instance whose class has it.
    owner = found.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
    if owner is None or getattr(type(owner), code.co_name, None) is None:
        return code.co_name
    return f"{type(owner).__qualname__}.{code.co_name}"


def _in_autograd_function(error: Exception) -> bool:
    """Whether the line that raised ``error`` (:func:`_raising_entry`'s) is in an
    ``autograd.Function``'s ``forward`` or ``backward``."""
    entry = _raising_entry(error)
    return entry is not None and _autograd_function(entry.tb_frame) is not None


def _autograd_function(frame: FrameType) -> str | None:
    """The name of the ``autograd.Function`` whose ``forward`` or ``backward`` ``frame``
    runs (:func:`~devicectx.decorator._autograd.function_of`); None where it is neither."""
    code = frame.f_code
    first = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
    return function_of(code, first)


def _inputs_device(
    call: tuple[Callable[..., object], tuple[object, ...], dict[str, object]],
) -> str:
    """Where the call's inputs are, as code for a fix: its first tensor argument's
    ``device`` (``x.device``), else its first module argument's (``next(net.parameters())
    .device``: an RL policy's ``act(net, obs)`` given a numpy ``obs``); ``x.device`` where
    it has neither, a placeholder."""
    named = list(named_arguments(*call))
    for argument, value in named:
        if isinstance(value, torch.Tensor) and argument.isidentifier():
            return f"{argument}.device"
    for argument, value in named:
        if isinstance(value, nn.Module) and argument.isidentifier():
            return f"next({argument}.parameters()).device"
    return "x.device"


def _over_numpy(error: Exception) -> bool:
    """Whether the line that raised ``error`` (:func:`_raising_entry`'s) calls
    ``torch.from_numpy``: the tensor it makes shares the array's memory on the CPU, where
    no scope and no decorator puts it elsewhere."""
    entry = _raising_entry(error)
    if entry is None or "from_numpy" not in entry.tb_frame.f_code.co_names:
        return False
    line = linecache.getline(entry.tb_frame.f_code.co_filename, entry.tb_lineno)
    return not line or "from_numpy" in line  # no source to read: the code's names decide


def _made_without_device(name: str, decorate: str | None, device: torch.device) -> str:
    default = torch.get_default_device()
    if default != device:
        # torch's error cannot tell a tensor made without device= from one moved to the
        # default device by name: the fix covers both.
        fix = (
            f"fix: make the tensors {name} creates on its inputs' device, torch.zeros(n, "
            f"device=x.device), and move none to {default} (a tensor made without device= "
            f"is on {default}, as is one moved there: {moves_to(default)})"
        )
        if decorate is None:  # decorated already: the decorator is no fix
            return fix
        return (
            f"{fix}, or decorate {decorate} with @devicectx.device_agnostic so that those "
            "made without device= land there"
        )
    return (
        f"fix: pass {name} each tensor it uses as an argument (one in a global or a closure "
        f"is not moved), or create it on its inputs' device, torch.zeros(n, device=x.device)"
    )


def _decorated(fn: Callable[..., object], name: str) -> str | None:
    """What a fix says to decorate with ``@device_agnostic``: a module's ``forward``, or
    ``fn``; None where that is decorated already (the decorator is then no fix)."""
    if isinstance(fn, nn.Module):
        forward = inspect.getattr_static(type(fn), "forward", None)
        return None if is_decorated(forward) else f"{type(fn).__qualname__}.forward"
    return None if is_decorated(fn) else name


def is_decorated(obj: object) -> bool:
    """Whether ``obj`` (or the function a ``functools.partial`` calls) is a function or
    method decorated with ``@device_agnostic``."""
    while isinstance(obj, functools.partial):
        obj = obj.func
    return isinstance(obj, (DeviceAgnosticWrapper, _BoundWrapper))


def _hidden(inputs: Inputs) -> str | None:
    """The fix where ``fn`` got tensors only where the move cannot see them (an attrs
    class's, a plain object's), so that no run's arguments reached its device."""
    unseen = [
        u
        for u in unseen_tensors(named_arguments(inputs.fn, inputs.args, inputs.kwargs))
        if u.module is None
    ]
    if not unseen:
        return None
    shown = ", ".join(f"{u.path} (in {u.holder.__qualname__})" for u in unseen[:3])
    return (
        f"fix: {inputs.name} got its tensors only where the move to each device cannot see "
        f"them, {shown}, so that none reached the device: {fix_for(unseen)}"
    )


def _training(inputs: Inputs) -> str | None:
    """A fix for values that differ where a module in the call is in training mode and
    holds dropout, which zeroes other values on each device."""
    for path, value in walk_arguments(named_arguments(inputs.fn, inputs.args, inputs.kwargs)):
        if not isinstance(value, nn.Module):
            continue
        dropout = next(
            (
                (sub, type(module).__qualname__)
                for sub, module in value.named_modules()
                if isinstance(module, _DROPOUTS) and module.training and module.p > 0
            ),
            None,
        )
        if dropout is not None:
            sub, kind = dropout
            # Quoted as a name: an nn.Sequential's children are named "0", "1", ...
            what = f"its submodule {sub!r}" if sub else "it"
            what = f"{what} ({with_article(kind)})"
            if path == "self":  # fn is the module, or one of its methods
                owner, call = type(value).__qualname__, "assert_device_agnostic(model.eval(), ...)"
            else:
                owner, call = path, f"pass {path}.eval()"
            return (
                f"fix: {owner} is in training mode, where {what} zeroes other values on "
                f"each device: call .eval() on it before the check ({call}), and draw no "
                f"other random numbers in {inputs.name}"
            )
    return None
