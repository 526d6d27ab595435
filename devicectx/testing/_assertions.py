"""``assert_device_agnostic``: run a function on every device and compare what comes back."""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from devicectx.devices._resolve import DeviceLike, available_devices, resolve_device
from devicectx.move._move import iter_tensors, move_call
from devicectx.move._unseen import Unseen, fix_for, is_device_mismatch, unseen_tensors
from devicectx.testing._sets import paired

_META = torch.device("meta")

# torch.testing.assert_close's default tolerances by dtype (private there, as
# torch.testing._comparison._DTYPE_PRECISIONS; checked on torch 2.13). Any other
# dtype (integers, bool) must match exactly.
_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex32: (1e-3, 1e-5),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}

# A failure lists at most this many problems per device: the first few say what is wrong.
_MAX_PROBLEMS = 10


def assert_device_agnostic(
    fn: Callable[..., object],
    /,
    *args: object,
    devices: Iterable[DeviceLike] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    **kwargs: object,
) -> None:
    """Assert that ``fn`` gives the same result on every device, each time on that device.

    ``fn(*args, **kwargs)`` is called once per device, with every tensor in ``args`` and
    ``kwargs`` moved there by :func:`devicectx.to_device`; each output is compared with the
    first device's: the same tensors at the same paths, each on the device it ran on, with
    the same dtype and shape, and values within ``rtol``/``atol``.

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
            :func:`devicectx.available_devices` (the CPU and every accelerator index).
            ``"meta"`` may be listed: there only structure, dtype and shape are compared.
        rtol: relative tolerance; with ``atol``, as in ``torch.testing.assert_close``.
            Default: by dtype, ``torch.testing``'s defaults (``1.3e-6`` for float32).
        atol: absolute tolerance. Give both or neither.
        **kwargs: its keyword arguments.

    Raises:
        AssertionError: an output differs. The message names each device that differed,
            each output path (``out['logits'][1]``) and what differs: missing or extra
            tensors, the device, dtype, shape, or how many values differ and by how much
            (max abs and rel diff). Also raised when ``fn`` raises on a device other than
            the first, chained to that exception, and on any device where torch's device
            mismatch comes from tensors the move could not see (in attributes of a plain
            object, or a module's attribute that is no buffer): the message names them.
        TypeError, ValueError: ``devices``, ``rtol`` or ``atol`` are not usable.
        devicectx.InvalidDeviceError, devicectx.DeviceUnavailableError: a listed device
            is malformed or not on this machine.

    Caveats:
        - ``fn`` runs without a device scope, as a caller would call it: a tensor it creates
          without ``device=`` lands on torch's default device and is reported as on the
          wrong device (``@devicectx.device_agnostic`` scopes it for you).
        - Every device's inputs are made before the first call, so an in-place write by
          ``fn`` cannot leak into another device's run; tensors already on a device are
          passed as they are (by identity), as ``to_device`` does.
        - ``nn.Module`` objects passed as ``fn``, as an argument or as a keyword argument are
          deep-copied for each device, so the caller's model is never moved. A module nested
          inside a container argument is moved in place by ``to_device``: pass it directly.
        - Only tensors are compared (found with the move engine's walk, so every container
          it supports); other values in the output are not. ``fn`` must be deterministic:
          a random op draws different numbers on each device.
        - A set (or frozenset) has no order: its iteration order follows hashes, ids for
          tensors, so it differs between runs. Each member is compared with the member of
          the reference's set it equals, whatever the order; a member that equals none is
          reported at ``list(out)[i]``, ``i`` the place of a reference member left over.
        - ``devices``, ``rtol`` and ``atol`` are this function's own; to pass arguments with
          those names to ``fn``, wrap it: ``assert_device_agnostic(lambda x: fn(x, atol=1), x)``.
    """
    __tracebackhide__ = True
    targets = _resolve_devices(devices)
    tolerances = _check_tolerances(rtol, atol)
    name = _name(fn)
    # Every run's inputs are built from the caller's untouched objects before any run.
    calls = [(device, _inputs_for(device, fn, args, kwargs)) for device in targets]
    outputs: list[tuple[torch.device, object]] = []
    for device, (call_fn, call_args, call_kwargs) in calls:
        try:
            outputs.append((device, call_fn(*call_args, **call_kwargs)))
        except Exception as error:
            unseen = _unseen(call_fn, call_args, call_kwargs, device, error)
            if not outputs and unseen is None:
                raise
            reference = outputs[0][0] if outputs else None
            raised = _raised_message(name, device, reference, error, unseen)
            raise AssertionError(raised) from error
    message = _compare(name, outputs, tolerances)
    if message is not None:
        raise AssertionError(message)


def _resolve_devices(devices: Iterable[DeviceLike] | None) -> list[torch.device]:
    if devices is None:
        return available_devices()
    if isinstance(devices, (str, torch.device, int)):
        msg = (
            f"assert_device_agnostic(devices={devices!r}): devices takes a list of devices\n"
            f"fix: devices=['cpu', {str(devices)!r}]"
        )
        raise TypeError(msg)
    resolved = [resolve_device(device) for device in devices]
    if not resolved:
        msg = (
            "assert_device_agnostic(devices=[]): no device to run on\nfix: devices=['cpu', 'meta']"
        )
        raise ValueError(msg)
    return resolved


def _check_tolerances(rtol: float | None, atol: float | None) -> tuple[float, float] | None:
    if (rtol is None) != (atol is None):
        given = f"rtol={rtol!r}" if atol is None else f"atol={atol!r}"
        msg = (
            f"assert_device_agnostic({given}): give both rtol and atol, or neither "
            f"(then they depend on the dtype, as in torch.testing.assert_close)\n"
            f"fix: assert_device_agnostic(fn, ..., rtol=1e-5, atol=1e-8)"
        )
        raise ValueError(msg)
    return None if rtol is None or atol is None else (rtol, atol)


def _name(fn: object) -> str:
    qualname = getattr(fn, "__qualname__", None)
    if not isinstance(qualname, str):
        qualname = type(fn).__qualname__
    # A function defined in a test reads better as `scale` than `test_x.<locals>.scale`.
    return qualname.rpartition("<locals>.")[2]


def _inputs_for(
    device: torch.device,
    fn: Callable[..., object],
    args: tuple[object, ...],
    kwargs: dict[str, object],
) -> tuple[Callable[..., object], tuple[object, ...], dict[str, object]]:
    """``fn``, ``args`` and ``kwargs`` for one run on ``device``, leaving the caller's alone."""
    call_fn = _copy_callable(fn, device)
    call_args = tuple(_copy_module(arg, device) for arg in args)
    call_kwargs = {key: _copy_module(value, device) for key, value in kwargs.items()}
    # Moved as one structure, so a tensor passed twice stays one tensor.
    # The same inputs go to each device on purpose: no repeated-move warning.
    moved_args, moved_kwargs = move_call(call_args, call_kwargs, device, check_repeats=False)
    return call_fn, moved_args, moved_kwargs


def _copy_module(value: object, device: torch.device) -> object:
    # to_device moves a module in place; a copy keeps the caller's model where it is, and
    # intact (moving to meta drops the weights).
    if not isinstance(value, nn.Module):
        return value
    try:
        return copy.deepcopy(value).to(device)
    except Exception as error:
        kind = type(value).__qualname__
        msg = (
            f"assert_device_agnostic copies each nn.Module argument to each device; copying "
            f"the {kind} to {device} failed: {type(error).__name__}: {error}\n"
            f"fix: make the module deep-copyable, or create it inside fn"
        )
        raise TypeError(msg) from error


def _copy_callable(fn: Callable[..., object], device: torch.device) -> Callable[..., object]:
    if isinstance(fn, nn.Module):
        module: Callable[..., object] = _copy_module(fn, device)  # type: ignore[assignment]
        return module
    owner = getattr(fn, "__self__", None)
    method_name = getattr(fn, "__name__", None)
    if isinstance(owner, nn.Module) and isinstance(method_name, str):
        # Looked up again on the copy, so a decorated method keeps its decorator.
        bound: Callable[..., object] = getattr(_copy_module(owner, device), method_name)
        return bound
    return fn


def _compare(
    name: str,
    outputs: list[tuple[torch.device, object]],
    tolerances: tuple[float, float] | None,
) -> str | None:
    """The failure message for ``outputs`` (one per device, the first the reference), or None."""
    reference = outputs[0][1]
    leaves = [dict(iter_tensors(output, name="out")) for _, output in outputs]
    # Values are compared with the first device that has any: meta has none.
    value_index = next((i for i, (d, _) in enumerate(outputs) if d != _META), None)
    value_leaves = leaves
    if any(path.startswith("list(") for found in leaves for path in found):
        # A path through a set member starts list(...)[i], i the member's place in
        # iteration order, which follows hashes (ids, for tensors): another order in each
        # output. Members are numbered instead as the reference's members they equal.
        def differs(path: str, actual: torch.Tensor, expected: torch.Tensor) -> bool:
            return _value_problem(path, actual, expected, tolerances) is not None

        leaves = paired(outputs, 0, differs)
        if value_index is not None and value_index > 0:
            value_leaves = paired(outputs, value_index, differs)
        else:
            value_leaves = leaves
    sections: list[str] = []
    kinds: set[str] = set()
    for index, (device, output) in enumerate(outputs):
        problems = _placement_problems(leaves[index], device)
        if problems:
            kinds.add("device")
        if index > 0:
            structure = _structure_problems(reference, output, leaves[0], leaves[index])
            if structure:
                kinds.add("structure")
            problems += structure
        if value_index is not None and index > value_index and device != _META:
            values = _value_problems(value_leaves[value_index], value_leaves[index], tolerances)
            if values:
                kinds.add("values")
            problems += values
        if problems:
            shown = problems[:_MAX_PROBLEMS]
            if len(problems) > len(shown):
                shown.append(f"... and {len(problems) - len(shown)} more")
            compared = [str(outputs[i][0]) for i in sorted({0, value_index or 0}) if i < index]
            against = f", compared with {' and '.join(compared)}" if compared else ""
            body = "\n".join(f"    {problem}" for problem in shown)
            sections.append(f"  on {device}{against}:\n{body}")
    if not sections:
        return None
    ran = ", ".join(str(device) for device, _ in outputs)
    lines = [f"{name} is not device-agnostic (ran on {ran}):", *sections]
    lines += [_FIXES[kind].format(name=name) for kind in _FIXES if kind in kinds]
    return "\n".join(lines)


_FIXES = {
    "device": (
        "fix: create new tensors on the input's device, torch.zeros(n, device=x.device), "
        "or decorate {name} with @devicectx.device_agnostic so they land there"
    ),
    "structure": "fix: make {name} return the same tensors, dtypes and shapes on every device",
    "values": (
        "fix: if the difference is expected (float sums in another order, TF32), "
        "allow it: assert_device_agnostic({name}, ..., rtol=1e-4, atol=1e-5)"
    ),
}


def _placement_problems(leaves: dict[str, torch.Tensor], device: torch.device) -> list[str]:
    return [
        f"{path}: on {t.device}, expected {device}"
        for path, t in leaves.items()
        if t.device != device
    ]


def _structure_problems(
    reference: object,
    output: object,
    reference_leaves: dict[str, torch.Tensor],
    leaves: dict[str, torch.Tensor],
) -> list[str]:
    problems: list[str] = []
    if type(output) is not type(reference):
        problems.append(f"out: a {_type(output)}, expected a {_type(reference)}")
    problems += [f"{path}: missing" for path in reference_leaves if path not in leaves]
    problems += [f"{path}: unexpected tensor" for path in leaves if path not in reference_leaves]
    for path, expected in reference_leaves.items():
        actual = leaves.get(path)
        if actual is None:
            continue
        if actual.dtype != expected.dtype:
            problems.append(f"{path}: dtype {actual.dtype}, expected {expected.dtype}")
        if actual.shape != expected.shape:
            problems.append(
                f"{path}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
            )
    return problems


def _type(value: object) -> str:
    return type(value).__qualname__


def _value_problems(
    expected_leaves: dict[str, torch.Tensor],
    leaves: dict[str, torch.Tensor],
    tolerances: tuple[float, float] | None,
) -> list[str]:
    problems: list[str] = []
    for path, actual in leaves.items():
        expected = expected_leaves.get(path)
        if expected is None or expected.dtype != actual.dtype or expected.shape != actual.shape:
            continue  # reported as a structure problem
        problem = _value_problem(path, actual, expected, tolerances)
        if problem is not None:
            problems.append(problem)
    return problems


def _value_problem(
    path: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    tolerances: tuple[float, float] | None,
) -> str | None:
    rtol, atol = tolerances if tolerances is not None else _TOLERANCES.get(actual.dtype, (0.0, 0.0))
    wide = torch.complex128 if actual.is_complex() else torch.float64
    a = actual.detach().to("cpu").resolve_conj().resolve_neg().to(wide)
    e = expected.detach().to("cpu").resolve_conj().resolve_neg().to(wide)
    if actual.is_floating_point() or actual.is_complex():
        close = torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    else:
        close = actual.detach().to("cpu") == expected.detach().to("cpu")
    if bool(close.all()):
        return None
    wrong = ~close
    count, total = int(wrong.sum()), close.numel()
    abs_diff = (a - e).abs()
    rel_diff = abs_diff / e.abs()
    lines = [
        f"{path}: {count} of {total} values differ ({100 * count / total:.1f}%), "
        f"rtol={rtol:g}, atol={atol:g}",
        _largest("max abs diff", abs_diff, wrong),
        _largest("max rel diff", rel_diff, wrong),
    ]
    return "\n      ".join(lines)


def _largest(label: str, diff: torch.Tensor, wrong: torch.Tensor) -> str:
    """The largest ``diff`` among the ``wrong`` elements, and where (NaN counts as largest)."""
    score = torch.where(wrong, diff, torch.full_like(diff, -1.0))
    score = torch.where(score.isnan(), torch.full_like(score, math.inf), score)
    flat = int(score.flatten().argmax())
    value = float(diff.flatten()[flat])
    if diff.dim() == 0:
        return f"{label} {value:.6g}"
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    return f"{label} {value:.6g} at index {index}"


def _unseen(
    fn: Callable[..., object],
    args: tuple[object, ...],
    kwargs: dict[str, object],
    device: torch.device,
    error: Exception,
) -> list[Unseen] | None:
    """For torch's device mismatch: the tensors off ``device`` that the move to it could
    not see (in attributes of plain objects); None where there are none."""
    if not is_device_mismatch(error):
        return None
    unseen = [u for u in unseen_tensors(_named(fn, args, kwargs)) if u.device != device]
    return unseen or None


def _named(
    fn: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]
) -> list[tuple[str, object]]:
    """Each argument by the name ``fn`` gives it (``args[0]`` where it cannot be told)."""
    named: list[tuple[str, object]] = []
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module) or isinstance(fn, nn.Module):
        named.append(("self", fn if isinstance(fn, nn.Module) else owner))
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        named += [(f"args[{i}]", value) for i, value in enumerate(args)]
        return named + list(kwargs.items())
    for parameter, value in bound.arguments.items():
        kind = bound.signature.parameters[parameter].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            named += [(f"{parameter}[{i}]", item) for i, item in enumerate(value)]
        elif kind is inspect.Parameter.VAR_KEYWORD:
            named += list(value.items())
        else:
            named.append((parameter, value))
    return named


def _raised_message(
    name: str,
    device: torch.device,
    reference_device: torch.device | None,
    error: Exception,
    unseen: list[Unseen] | None = None,
) -> str:
    detail = f"{type(error).__name__}: {error}".replace("\n", "\n    ")
    where = (
        f"on {device}" if reference_device is None else f"on {device}, not on {reference_device}"
    )
    lines = [f"{name} is not device-agnostic: it raised {where}:", f"    {detail}"]
    if unseen is None:
        lines.append(f"fix: make {name} work on {device}, or leave {device} out of devices=")
        return "\n".join(lines)
    lines.append(f"  tensors the move to {device} could not see, left where they were:")
    lines += [f"    {u.device} <- {u.path} (in {u.holder.__qualname__})" for u in unseen]
    lines.append(f"fix: {fix_for(unseen)}")
    return "\n".join(lines)
