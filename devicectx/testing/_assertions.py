"""``assert_device_agnostic``: run a function on every device and compare what comes back."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable

import torch

from devicectx.devices._resolve import DeviceLike, available_devices, resolve_device
from devicectx.move._dtypes import DtypesLike, check_dtypes
from devicectx.move._unseen import Unseen, fix_for, is_device_mismatch, unseen_tensors
from devicectx.testing._compare import Run, compare, memory_of
from devicectx.testing._inputs import holds_for, inputs_for, name_of, named_arguments

_META = torch.device("meta")


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
    within ``rtol``/``atol``.

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
        rtol: relative tolerance for floating point values; with ``atol``, as in
            ``torch.testing.assert_close``. Default: by dtype, ``torch.testing``'s defaults
            (``1.3e-6`` for float32). Integer and bool values are compared exactly.
        atol: absolute tolerance. Give both or neither.
        dtypes: what to do with inputs of a dtype a device cannot hold (float64 on MPS),
            as in :func:`devicectx.to_device`: ``None`` refuses them, before ``fn`` runs;
            ``"device"`` casts them, for that device only, to the nearest dtype it holds
            (float64 to float32), and then accepts there the dtype it holds where the
            reference has the other (float32 for float64), with the values compared
            within the wider tolerance of the two dtypes (float32's), as
            ``torch.testing.assert_close`` does for two dtypes; a mapping
            (``{torch.float64: torch.float32}``) casts on every device, the reference
            included. Module arguments' copies are cast too.
        **kwargs: its keyword arguments.

    Raises:
        AssertionError: an output differs. The message names each device that differed,
            each output path (``out['logits'][1]``) and what differs: missing or extra
            tensors, a container's type, the device, dtype, shape, layout,
            ``requires_grad``, which tensors are one or share memory, or how many values
            differ and by how much (max abs and rel diff), or a number in the output that
            differs (``out['loss']: 4.5, expected 4.0``). Also raised when ``fn`` raises on
            a device other than the first, chained to that exception, and on any device
            where torch's device mismatch comes from tensors the move could not see (in
            attributes of a plain object, or a module's attribute that is no buffer): the
            message names them.
        TypeError, ValueError: ``devices``, ``rtol``, ``atol`` or ``dtypes`` are not usable
            (a tolerance that is no number, negative or NaN), before ``fn`` runs.
        devicectx.DtypeUnsupportedError: a device cannot hold an input's dtype, and
            ``dtypes`` casts it to none it holds; raised before ``fn`` runs.
        devicectx.InvalidDeviceError, devicectx.DeviceUnavailableError: a listed device
            is malformed or not on this machine.

    Caveats:
        - ``fn`` runs without a device scope, as a caller would call it: a tensor it creates
          without ``device=`` lands on torch's default device and is reported as on the
          wrong device (``@devicectx.device_agnostic`` scopes it for you).
        - Every device's inputs are made before the first call, so an in-place write by
          ``fn`` cannot leak into another device's run; tensors already on a device are
          passed as they are (by identity), as ``to_device`` does.
        - Every ``nn.Module`` in the call (``fn`` itself, an argument, or one inside a
          container argument: a dict, a list, a dataclass) is deep-copied for each device,
          one copy per module, so the caller's model is never moved or changed. One inside
          an object with its own ``.to`` is left to that ``.to``.
        - Tensors, numbers (an ``int`` exactly, a ``float`` from ``loss.item()`` within
          the tolerances, by default float32's) and the types of containers and numbers
          are compared (found with the move engine's walk, so every container it
          supports); other values in the output (a ``str``, which may name the device)
          are not, nor numbers inside a set. ``fn`` must be deterministic: a random op
          draws different numbers on each device.
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
    name = name_of(fn)
    # Every run's inputs are built from the caller's untouched objects before any run.
    calls = [(device, inputs_for(device, fn, args, kwargs, dtypes, targets)) for device in targets]
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
    runs = [Run(device, holds_for(dtypes, device), memory_of(call)) for device, call in calls]
    message = compare(name, outputs, tolerances, runs)
    if message is not None:
        raise AssertionError(message)


def _resolve_devices(devices: Iterable[DeviceLike] | None) -> list[torch.device]:
    if devices is None:
        return available_devices()
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
    return resolved


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
    unseen = [u for u in unseen_tensors(named_arguments(fn, args, kwargs)) if u.device != device]
    return unseen or None


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
