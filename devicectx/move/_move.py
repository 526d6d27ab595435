"""The move engine: :func:`to_device` and :func:`find_devices`, and what the decorator uses.

Public: :func:`to_device`; also :func:`find_devices` (written in :mod:`devicectx.move._walk`,
with the other reading walks) and :func:`register_container` (in
:mod:`devicectx.move._containers`), re-exported here.

Internal, for ``@device_agnostic`` (each takes an already-resolved device, so a call pays
no resolution):

- :func:`move_to`: :func:`to_device` for a resolved device;
- :func:`move_call`: a call's ``(args, kwargs)`` moved as one structure, errors naming
  parameters;
- :func:`all_on`: is every tensor already on the device? The hot path: no paths built;
  :func:`shared_device`, the same walk, also finds the one device when none is given;
- :func:`iter_tensors`: every tensor with its path, for messages. It does not look into
  ``nn.Module`` objects unless asked (``modules=True``): the decorator reports modules
  on their own.

How the work is split: :mod:`devicectx.move._containers` knows each type (its kind: what
its children are, how to rebuild it; the families' rules in the modules it names),
:mod:`devicectx.move._walk` walks structures, :mod:`devicectx.move._alias` moves the
tensors so that shared memory stays shared, :mod:`devicectx.move._skip` compiles
``skip=``, and :mod:`devicectx.move._paths` writes paths. Under ``torch.compile``,
:mod:`devicectx.move._traced` walks instead of :mod:`devicectx.move._rebuild` (dynamo cannot
trace the memo's ``id()`` on every release, and recompiles for each batch where it can).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

from devicectx._errors import DeviceWarning, check_switches, with_article
from devicectx._torch.module_tree import makes_new_parameters
from devicectx.devices._capabilities import holds_every_dtype
from devicectx.devices._resolve import DeviceLike, resolve_device
from devicectx.move import _repeats, _staging, _transfers
from devicectx.move._alias import TensorMover
from devicectx.move._containers import register_builtin_kind
from devicectx.move._containers import register_container as register_container
from devicectx.move._dtypes import (
    DtypesLike,
    Suggest,
    arguments_code,
    call_suggest,
    code_of,
    policy_for,
)
from devicectx.move._host_arrays import arrays_only, arrays_unmoved
from devicectx.move._kinds import CONTAINER, Kind
from devicectx.move._paths import NAME
from devicectx.move._rebuild import Call, Fix, Rebuild
from devicectx.move._skip import (
    Skip,
    SkipLike,
    check_names,
    compile_skip,
    inside_own_to_message,
    unmatched_message,
)
from devicectx.move._staging._state import STATE
from devicectx.move._traced import TracedMove
from devicectx.move._walk import all_on as all_on
from devicectx.move._walk import find_devices as find_devices
from devicectx.move._walk import iter_tensors as iter_tensors
from devicectx.move._walk import shared_device as shared_device

T = TypeVar("T")
_is_compiling = torch.compiler.is_compiling

__all__ = [
    "all_on",
    "find_devices",
    "iter_tensors",
    "move_call",
    "move_to",
    "register_container",
    "shared_device",
    "to_device",
]


def to_device(
    obj: T,
    device: DeviceLike,
    *,
    non_blocking: bool = False,
    skip: SkipLike = None,
    coalesce: bool = True,
    dtypes: DtypesLike = None,
) -> T:
    """Return ``obj`` with every tensor in it on ``device``, losing nothing.

    Example:
        >>> import torch
        >>> from devicectx import to_device
        >>> x = torch.arange(6.0)
        >>> batch = {"x": x, "first": x[:3], "also_x": x, "name": "b0"}
        >>> moved = to_device(batch, "meta")
        >>> moved["x"].device, moved["also_x"] is moved["x"], moved["first"]._base is moved["x"]
        (device(type='meta'), True, True)
        >>> to_device(moved, "meta") is moved  # nothing to move: the same object
        True

    Args:
        obj: a tensor, or any structure of them: list, tuple, namedtuple,
            ``torch.return_types``, dict, ``OrderedDict``, ``defaultdict``, deque, set,
            frozenset, dataclass (mutable, frozen, ``slots=True``, ``init=False`` fields,
            the attributes an instance holds beside its fields; one that is also a
            mapping, such as transformers' ``ModelOutput``, comes back with its fields and
            its entries agreeing), ``UserDict``/``UserList`` (entries and attributes),
            ``SimpleNamespace``, ``PackedSequence``, ``ChainMap`` (every map), other
            ``Mapping``/``Sequence``/``Set`` types, types taught with
            :func:`register_container`, objects with their own ``.to(device)``
            (tensordict, its lazy stacks, ``BatchEncoding``, torch_geometric's ``Data``),
            and ``nn.Module``.
        device: anything :func:`resolve_device` takes: ``"cuda:1"``, ``"auto"``, ...
        non_blocking: ask for asynchronous copies (see the rule below).
        skip: what stays where it is, with everything inside it: a type, a path as
            :func:`find_devices` writes it (``"obj['meta']"``), a key or attribute name
            (``"labels"``: matched at any depth), a predicate ``(path, value) -> bool``,
            or a list of these. A key or path that names nothing in ``obj`` is warned of
            (:class:`~devicectx.DeviceWarning`), with the entry it most likely meant.
        coalesce: stage moves between the host and an accelerator (see below); False
            moves every tensor with its own copy.
        dtypes: what happens to a tensor of a dtype ``device`` cannot hold (float64 and
            complex128 on MPS; see :func:`~devicectx.supports_dtype`). ``None`` (the
            default) changes no dtype: such tensors raise ``DtypeUnsupportedError``
            before anything is copied, naming every path. ``"device"`` casts each to the
            nearest dtype the device holds (float64 -> float32, complex128 -> complex64,
            bfloat16 -> float32, float8 -> float16) and leaves every other tensor alone:
            on a device that holds every dtype, nothing changes. A mapping
            (``{torch.float64: torch.float32}``) casts every tensor of a key's dtype,
            wherever it is (already on ``device`` too), so a program gets the same
            dtypes on every device. Casts are made before the move, where each tensor
            is (a batch on the host is cast there and sends fewer bytes); skipped
            tensors, modules (and their parameters and buffers, wherever ``obj`` holds
            them) and objects with their own ``.to`` are not cast (a module that holds a
            dtype ``device`` cannot hold is refused, whatever ``dtypes``).

    Returns:
        A structure like ``obj``: the same types (a namedtuple stays that namedtuple, a
        ``defaultdict`` keeps its factory), the same keys and order, every tensor on
        ``device``. Containers with nothing to move come back as the same objects, and so
        do tensors already on ``device`` and every non-tensor (``str``, numbers, numpy
        arrays, ``range``, ``torch.Size``, iterators and generators, which are never
        iterated: one given whole is warned of, :class:`~devicectx.DeviceWarning`).

    Raises:
        InvalidDeviceError, DeviceUnavailableError: ``device`` is no device here; raised
            before any tensor is touched.
        DtypeUnsupportedError: with ``dtypes=None``, tensors of a dtype ``device``
            cannot hold; with any ``dtypes``, a module holding a parameter or buffer of
            such a dtype (modules are not cast: the fix is the module's ``.float()``).
            Its ``paths`` lists every one, by dtype. Nothing was copied, and no module
            moved.
        ValueError, TypeError: ``dtypes`` is no dtype policy.
        MoveError: a tensor or object could not be moved, or a container could not be
            rebuilt with every view of it showing the moved tensors (a ``Mapping`` whose
            type takes neither item assignment nor a dict, say); the message names its
            path and the fix, and the original error is chained. Also when a ``skip``
            predicate raises: the message names the predicate and the signature it
            must have. And when a module to move holds tensors on ``meta`` (not
            materialised: ``module.to`` has nothing to copy), to another device: refused
            before any module moves, naming each such module and its tensors, with
            ``to_empty`` as the fix.
        TypeError: ``skip`` holds something that is no type, path, key or predicate;
            ``non_blocking`` or ``coalesce`` is not a bool (``"no"`` would read as True).

    What is kept:
        - The input is never changed (but see modules below). Each tensor is copied once
          however many places hold it, and a view of a tensor that is also in ``obj``
          (or inside a larger tensor of ``obj``) arrives as a view of that tensor's copy,
          whichever order they come in: writing into one shows in the other. A view whose
          base is not in ``obj`` is copied alone, as ``.to`` copies it (a staged small one
          into a region it shares with other small tensors, see below).
        - A module's parameter or buffer that ``obj`` also holds outside the module
          (``{"model": m, "w": m.weight}``, a list of its parameters) comes back as the
          module's moved one (``moved["w"] is m.weight``), and a view of it as a view of
          that, whichever comes first. A parameter two modules share (tied weights) is
          one parameter after the move, also where torch's ``module.to`` unties them
          (``meta``, devices registered out of tree).
        - dtype (unless ``dtypes=`` casts it), shape, ``requires_grad``, and autograd
          history: the move is ``.to`` (or ``as_strided`` for views), so gradients flow
          back to the originals; a cast keeps all of it too, views of a cast tensor
          included, as ``.to(dtype)`` does. An ``nn.Parameter`` comes back as a new
          ``nn.Parameter`` on ``device`` (a leaf, its ``.grad`` moved with it, as
          ``module.to`` makes them: gradients reach it, not the original; the decorator
          passes a parameter as a copy through autograd instead).
        - A cycle does not loop: the inner reference to an enclosing container is kept
          as the original object. Depth is not limited by Python's recursion limit.

    The ``non_blocking`` rule: asynchronous copies are used only from CPU memory to an
    accelerator other than MPS, where torch orders every later use of the copy after it
    lands. Copies to the CPU are always blocking: torch returns from a non-blocking copy
    to the host before the data has landed, and nothing makes the host wait before it
    reads the result, which can then hold stale values. Copies to MPS are always
    blocking too: there, torch's non-blocking copies from the host have been seen to
    land wrong values. Lightning's batch transfer makes the same two exceptions. So
    ``non_blocking=True`` is always safe here; it only helps from pinned memory.

    Staged moves (``coalesce=True``, the default): from the host to an accelerator (CUDA,
    XPU, ...: the one ``torch.accelerator`` reports; never to ``meta`` or MPS), a move of
    at least 4 small tensors, or of 1 MiB or more in pageable memory, copies them into a
    reused pinned buffer and sends it in a few large copies, instead of one copy per
    tensor (see :mod:`devicectx.move._staging` for the rules and thresholds):

    - Tensors of at most 64 KiB are copied into one device region of at most 1 MiB and
      each comes back with a storage of its own over its bytes of it (not a view: its
      ``_base`` is None); one kept alive keeps that region allocated. Larger
      tensors get device memory of their own, as with ``.to``. ``record_stream`` on a
      small one does not reach its region (the caching allocator knows the region
      alone): to use it on another stream, keep it alive until that stream is done
      with it, or move with ``coalesce=False``.
    - The sources staged have been copied when ``to_device`` returns, so they may be
      changed at once, even with ``non_blocking=True``: safer than
      ``.to(non_blocking=True)`` from pinned memory, whose source must stay unchanged
      until the copy lands. Tensors that are pinned already are sent directly, and
      follow that rule, where they are larger, and (whatever their size) while the
      target's current stream has work queued: a pinned tensor may still be the target
      of an earlier copy from the device, which its move must come after.
    - With ``non_blocking=True``, while the current stream has work queued (steps not
      yet run), the staged copies run on a copy stream of the target (one per device),
      beside that work instead of after it; the current stream waits for them (the
      device waits, not the host) and their memory is recorded as used there: use the
      results on the current stream, as ``.to``'s (on another stream, make it wait for
      the current one first).
    - Everything above is kept (strides and memory format included); tensors the
      staged path cannot copy faithfully (that require grad, subclasses and parameters,
      expanded or strided views, ...) move one by one in the same call.
    - Back to the host (a ``"cpu"`` target), 4 or more small accelerator tensors are
      packed on the device and come back in one blocking copy, into host memory of
      their own (shared by at most 1 MiB of them).
    - The pinned memory is bounded (64 MiB) and kept for the next move:
      :func:`~devicectx.staging_memory` says how much, :func:`~devicectx.release_staging`
      lets it go. Where memory cannot be pinned, moves go tensor by tensor. A ``skip``
      with keys, paths or predicates also moves tensor by tensor.

    Caveats:
        - ``nn.Module`` objects are moved with ``module.to``, which moves them in place;
          pass ``skip=torch.nn.Module`` to leave them alone. A module is never left
          half-moved by a dtype the device cannot hold, nor by tensors on ``meta``:
          those are refused before any module moves. A move that fails after a module
          moved (out of memory midway, a leaf that cannot move) puts the module back
          as it was, the same tensor objects, before it raises.
        - Objects with their own ``.to`` are moved with it (on a shallow copy, so that a
          ``.to`` that works in place leaves the input alone): they keep their own
          rules, so a tensor they share with the rest of ``obj`` is copied twice. What
          their ``.to`` leaves behind (a ``BatchEncoding`` moves only the tensors it
          holds directly) is moved as their children, where the type takes item
          assignment; else ``MoveError``, never a half-moved object.
        - Dataclasses are rebuilt field by field; other attributes are copied as they
          are. A dataclass that is also a mapping (or a sequence) is copied, and each
          view that showed a moved child (field, entry, or any attribute holding it)
          is made to show the moved one; the copy is then read again to check it.
        - A ``Mapping``/``Sequence``/``Set`` type is rebuilt with a copy and item
          assignment (an attribute dict, its own ``__dict__``, stays one), else with its
          constructor; one that takes neither raises
          ``MoveError`` (it is never turned into another type, nor left half-moved):
          teach it with :func:`register_container`, or ``skip`` it.
    """
    # Our frames, hidden from pytest's report: it shows the caller's line and our message.
    __tracebackhide__ = True
    if type(non_blocking) is not bool or type(coalesce) is not bool:
        check_switches(
            "to_device", lead="obj, device, ", non_blocking=non_blocking, coalesce=coalesce
        )
    cacheable = isinstance(device, (str, torch.device))
    target = _RESOLVED.get(device) if cacheable else None  # type: ignore[arg-type]
    if target is None:
        target = resolve_device(device)
        if cacheable and _stable(device) and len(_RESOLVED) < 64:
            _RESOLVED[device] = target  # type: ignore[index]
    if isinstance(obj, _Optimizer):
        warnings.warn(_optimizer_unmoved(obj, target), DeviceWarning, stacklevel=2)
    elif hasattr(type(obj), "__next__"):
        warnings.warn(_iterator_unmoved(obj, target), DeviceWarning, stacklevel=2)
    if type(obj) is not _Tensor and target.type != "cpu":
        arrays = arrays_only(obj)
        if arrays is not None:
            message = arrays_unmoved("to_device()", "obj", arrays, target, _arrays_fix(target))
            warnings.warn(message, DeviceWarning, stacklevel=2)
    left: list[object] = []
    if skip is None and dtypes is None and holds_every_dtype(target):
        if _nothing_to_move(obj, target, ()):
            return obj
        fix = _FIXES.get(target)
        if fix is None:
            fix = _to_device_fix(target, "obj")
            if len(_FIXES) < 64:
                _FIXES[target] = fix
        result = _move(
            obj, target, non_blocking, None, "obj", fix, "to_device()", coalesce, left=left
        )
        if left:
            warnings.warn(_optimizer_unmoved(left[0], target, beside=True), DeviceWarning, 2)
        return result
    fix = _to_device_fix(target, "obj", non_blocking, skip, coalesce, dtypes)
    compiled = compile_skip(skip)
    suggest = None  # a dtype refusal's fix, with the caller's arguments (its skip= as given)
    if dtypes is not None or not holds_every_dtype(target):
        suggest = _to_device_suggest(target, "obj", non_blocking, skip, coalesce)
    moved = move_to(
        obj,
        target,
        non_blocking=non_blocking,
        skip=compiled,
        coalesce=coalesce,
        dtypes=dtypes,
        suggest=suggest,
        fix=fix,
        left=left,
    )
    if left:
        warnings.warn(_optimizer_unmoved(left[0], target, beside=True), DeviceWarning, 2)
    if compiled is not None and (compiled.keys or compiled.paths):
        missing, inside = check_names(compiled, obj, "obj")
        if missing:
            message = unmatched_message(skip, missing, "obj", "to_device()")
            warnings.warn(message, DeviceWarning, stacklevel=2)
        if inside:
            message = inside_own_to_message(inside, target, "to_device()")
            warnings.warn(message, DeviceWarning, stacklevel=2)
    return moved


_Optimizer = torch.optim.Optimizer


def _optimizer_unmoved(optimizer: object, target: torch.device, beside: bool = False) -> str:
    """The warning for ``to_device(optimizer, ...)``, which moves nothing: an optimizer is
    no container (its state is moved by torch as it is loaded, beside each parameter);
    ``beside``: one in a structure whose module moved (a training state).

    Where a module's move to ``target`` makes new parameters (to ``meta``, to a device out
    of torch's tree), the optimizer steps the old ones whatever state it reloads: the fix is
    then a new optimizer."""
    kind = with_article(type(optimizer).__qualname__)
    params = [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"]]
    renewed = sorted({str(p.device) for p in params if makes_new_parameters(p.device, target)})
    if beside:
        told = f"to_device() moved a module in obj, and no optimizer ({kind}, in obj too): "
        told += (
            f"it steps the module's old parameters, left on {', '.join(renewed)}"
            if renewed
            else "its state stays where it was, off the parameters it steps"
        )
    else:
        told = (
            f"to_device() moves no optimizer ({kind}): it came back as it was, its state "
            f"where it was"
        )
    if renewed:
        return (
            f"{told}\na move from {' or '.join(renewed)} to {target} makes new parameters, "
            f"and reloading the optimizer's state does not change which parameters it steps: "
            f"as it is, it would train nothing\n"
            f"fix: build the optimizer after moving the model, from the moved model's "
            f"parameters; to keep its state, take state = optimizer.state_dict() before the "
            f"move and load it into the new optimizer"
        )
    reload = "optimizer.load_state_dict(optimizer.state_dict())"
    fix = f"{reload} after the move" if beside else f"move the model, then {reload}"
    return (
        f"{told}\nfix: {fix}, which puts the state beside each parameter (on {target}); or "
        f"build the optimizer after moving the model"
    )


def _arrays_fix(target: torch.device) -> str:
    """The fix of ``to_device`` given numpy arrays alone: tensors of them, then moved."""
    return (
        f"torch.as_tensor(obj, device={str(target)!r}) for one array; for a batch, make its "
        f"arrays tensors where it is made (torch.as_tensor(array), as a DataLoader's default "
        f"collate_fn does), then to_device(batch, {str(target)!r})"
    )


def _iterator_unmoved(iterator: object, target: torch.device) -> str:
    """The warning for ``to_device(iterator, ...)``: reading it would use up its items, so
    it comes back as it was, whatever it yields left where it is made."""
    kind = with_article(type(iterator).__qualname__)
    return (
        f"to_device() got obj, {kind}, an iterator: it is not read (its items would be used "
        f"up), and comes back as it was, what it yields not moved to {target}\n"
        f"fix: to_device(list(obj), {str(target)!r}) to move its items now, or "
        f"prefetch(obj, {str(target)!r}) to move each as it is read"
    )


_Tensor = torch.Tensor
# The fix of a failed to_device(obj, target) with no other argument, written once per target.
_FIXES: dict[torch.device, Fix] = {}
# Explicit specs whose resolution cannot change: resolving costs more than a small move.
_RESOLVED: dict[str | torch.device, torch.device] = {}


def _stable(spec: DeviceLike) -> bool:
    """Whether ``spec`` always resolves to the same device: not ``"auto"``, and not an
    accelerator without an index (``"cuda"`` follows ``torch.cuda.set_device``)."""
    if isinstance(spec, torch.device):
        return spec.index is not None or spec.type in ("cpu", "meta")
    return isinstance(spec, str) and (":" in spec or spec.strip() in ("cpu", "meta"))


def move_to(
    obj: T,
    device: torch.device,
    *,
    non_blocking: bool = False,
    skip: SkipLike = None,
    name: str = "obj",
    coalesce: bool = True,
    where: _repeats.Place | None = None,
    dtypes: DtypesLike = None,
    suggest: Suggest | None = None,
    fix: Fix | None = None,
    left: list[object] | None = None,
    who: str = "to_device()",
    parameters: bool = True,
) -> T:
    """:func:`to_device` for a device already resolved: no resolution cost per call.

    The decorator's entry point. Everything is as in :func:`to_device`; moreover:

    Args:
        device: a resolved ``torch.device``, with its index where tensors have one
            (``cuda:0``, not ``cuda``), or tensors already there would be copied again.
        skip: as in :func:`to_device`, or a compiled :class:`~devicectx.move._skip.Skip`. A
            type or tuple of types (``skip=nn.Module``, to never move modules) is
            compiled once and kept, and costs nothing on the way to the fast check.
        name: the root of the paths in errors (and of paths given in ``skip``).
        where: the place that moves, for :mod:`devicectx.move._repeats` (the decorated
            function); None for the line that called.
        suggest: the fix line of a :class:`~devicectx.DtypeUnsupportedError`, given the
            ``dtypes=`` to write; None: ``to_device(name, device, dtypes=...)``.
        fix: the fix of a failed move, given the path that failed; None:
            ``to_device(name, device, skip=[path])``.
        left: gets an optimizer the move left where it was, beside a module it moved.
        who: what an error says failed (a decorated function moving its result back).
        parameters: False copies an ``nn.Parameter`` as ``.to`` does, through autograd
            (a result's, whose gradient then reaches the parameter), not as a new one.

    Moving ``(args, kwargs)`` in one call keeps aliasing across arguments: a tensor
    passed twice becomes one moved tensor.
    """
    __tracebackhide__ = True
    if fix is None:
        fix = _to_device_fix(device, name)
    if skip is None and dtypes is None and holds_every_dtype(device):
        if _nothing_to_move(obj, device, ()):
            return obj
        return _move(
            obj, device, non_blocking, None, name, fix, who, coalesce, where, left=left,
            parameters=parameters,
        )  # fmt: skip
    compiled = compile_skip(skip, name)
    policy = policy_for(dtypes, device)
    if policy is not None:  # the dtype policy: casts made (or refused) before the move
        if suggest is None:
            suggest = _to_device_suggest(device, name, non_blocking, skip, coalesce)
        obj = policy.apply(obj, compiled, name, who, fix, suggest)
    if (compiled is None or not compiled.slow) and _nothing_to_move(obj, device, _types(compiled)):
        return obj
    return _move(
        obj, device, non_blocking, compiled, name, fix, who, coalesce, where, left=left,
        parameters=parameters,
    )  # fmt: skip


def move_call(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device,
    *,
    names: Sequence[str] = (),
    rest: str = "args",
    non_blocking: bool = False,
    skip: SkipLike = None,
    who: str = "@device_agnostic",
    coalesce: bool = True,
    where: _repeats.Place | None = None,
    check_repeats: bool = True,
    dtypes: DtypesLike = None,
    parameters: bool = True,
    written: str = "",
    fix: Fix | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A call's arguments moved as one structure, with errors that name the parameters.

    As ``move_to((args, kwargs), device)``, but a path starts at the parameter: the
    positional argument ``i`` is ``names[i]`` (``args[j]`` past the names, with ``rest``
    for ``args``), a keyword argument is its keyword. ``(args, kwargs)`` come back as the
    same objects when nothing moved. ``who`` starts the error message (the decorated
    function, say: ``"train.loss()"``); ``where`` names the place that moves, as in
    :func:`move_to`. ``dtypes`` is the dtype policy; its error's fix is written for
    ``@device_agnostic``, with its other arguments ``written`` as code
    (``"device='mps', exclude='rng'"``). ``parameters`` False copies an ``nn.Parameter``
    as ``.to`` does, through autograd (the decorator's choice: a loose parameter's
    gradient reaches the caller's), not as a new parameter. ``fix``: the fix of an
    argument that fails to move (:func:`exclude_fix`); None: ``exclude=`` that argument.
    """
    __tracebackhide__ = True
    if fix is None:
        fix = _call_fix
    compiled = compile_skip(skip, "")
    policy = policy_for(dtypes, device)
    if policy is not None:  # the dtype policy: casts made (or refused) before the move
        values = (*args, *kwargs.values())
        call = Call(args, kwargs, names, rest)
        cast = policy.apply(
            call, compiled, "", who, fix, _decorator_suggest(written), values, parameters
        )
        args, kwargs = cast.args, cast.kwargs
    if compiled is None:
        if _nothing_to_move((args, kwargs), device, ()):
            return args, kwargs
    elif not compiled.slow and _nothing_to_move((args, kwargs), device, compiled.types):
        return args, kwargs
    call = Call(args, kwargs, names, rest)
    moved = _move(
        call,
        device,
        non_blocking,
        compiled,
        "",
        fix,
        who,
        coalesce,
        where,
        check_repeats,
        parameters=parameters,
    )
    if moved is call:
        return args, kwargs
    return moved.args, moved.kwargs


def _nothing_to_move(obj: object, device: torch.device, skip_types: tuple[type, ...]) -> bool:
    """The fast check before a move. A container whose own code fails here is left to the
    move, which names it in its error."""
    try:
        return all_on(obj, device, skip_types)
    except Exception:
        return False


def _move(
    obj: T,
    device: torch.device,
    non_blocking: bool,
    skip: Skip | None,
    name: str,
    fix: Fix,
    who: str = "to_device()",
    coalesce: bool = True,
    where: _repeats.Place | None = None,
    check_repeats: bool = True,
    handed: _staging.HandedTo | None = None,
    parameters: bool = True,
    left: list[object] | None = None,
) -> T:
    __tracebackhide__ = True
    # The one test of torch.compile on the eager path (the accounting below made it).
    compiling = _is_compiling()
    if compiling and (skip is None or not skip.slow):
        return TracedMove(device, non_blocking, skip, name, fix).run(obj)  # type: ignore[no-any-return]
    mover = TensorMover(device, non_blocking, parameters=parameters)
    # Traced code keeps no state (and dynamo cannot trace ContextVar.get): nothing recorded.
    paths = None if compiling else _transfers.paths_if_tracked(obj, name)
    staged = None
    if (
        coalesce
        and device not in STATE.never
        and (skip is None or not skip.slow)
        and not _staging.declines(_root(obj), device, _types(skip))
    ):
        # The staged tensors' results go into mover.moved, where the walk finds them;
        # `staged` holds what their ids belong to until the walk is done.
        staged = _staging.stage(obj, device, non_blocking, _types(skip), handed)
        if staged is not None:
            mover.moved.update(staged.results)
            mover.sent.extend(staged.sources)
    walk = Rebuild.moving(device, mover, skip, name, fix, who)
    try:
        result = walk.run(obj)
        replace = mover.finish()
        if replace:  # views met before the tensor they belong to: made views of it now
            result = Rebuild.replacing(replace, name, fix, who).run(result)
    except BaseException:
        walk.put_modules_back()  # modules move in place: none is left moved, or half
        raise
    if handed is not None and not handed.reads_later:
        handed.reads_later = _copied_pinned(mover.sent, staged)
    if left is not None and mover.optimizer is not None and mover.adopted is not None:
        left.append(mover.optimizer)  # a module it steps moved, and its state did not
    if not compiling:
        _transfers.account(mover.sent, device, obj, name, where, check_repeats, paths)
    del staged
    return result  # type: ignore[no-any-return]


def _copied_pinned(sent: list[torch.Tensor], staged: _staging.Staged | None) -> bool:
    """Whether a pinned host tensor of ``sent`` was copied by the move engine itself (not
    staged): its copy reads its memory after the move returns."""
    packed = {} if staged is None else staged.results
    if len(sent) == len(packed):  # every tensor sent was staged (most of a large batch)
        return False
    return any(id(t) not in packed and t.is_cpu and t.is_pinned() for t in sent)


def _root(obj: object) -> object:
    """What staging looks at: a call's arguments as plain containers."""
    return (obj.args, obj.kwargs) if type(obj) is Call else obj


def _types(skip: Skip | None) -> tuple[type, ...]:
    return () if skip is None else skip.types


def _to_device_fix(
    device: torch.device,
    name: str,
    non_blocking: bool = False,
    skip: SkipLike = None,
    coalesce: bool = True,
    dtypes: DtypesLike = None,
) -> Fix:
    """The fix of a failed move, given the path that failed: the call again with that path
    added to its ``skip=``, the caller's own entries and other arguments kept (a fix that
    dropped one would move what the caller keeps where it is). Written when a move fails:
    making it costs a successful move nothing."""

    def fix(path: str) -> str:
        others = arguments_code(
            [
                ("non_blocking", non_blocking, False),
                ("coalesce", coalesce, True),
                ("dtypes", dtypes, None),
            ]
        )
        start = ", ".join([name, repr(str(device)), *others])
        given = list(skip) if isinstance(skip, (list, tuple, set, frozenset)) else [skip]
        if skip is None or isinstance(skip, Skip):  # nothing given, or nothing to write
            given = []
        entries = code_of([*given, path])
        if entries is None:  # an entry no code can write (a lambda): marked, not dropped
            entries = f"[<your skip= entries>, {path!r}]"
        return f"leave it where it is: to_device({start}, skip={entries})"

    return fix


def _to_device_suggest(
    device: torch.device,
    name: str,
    non_blocking: bool = False,
    skip: SkipLike = None,
    coalesce: bool = True,
) -> Suggest:
    """The fix line of a dtype refusal: the call, with the arguments the caller set."""
    keywords = [
        ("non_blocking", non_blocking, False),
        ("skip", skip, None),
        ("coalesce", coalesce, True),
    ]
    return call_suggest("to_device", (name, repr(str(device))), keywords)


def _decorator_suggest(written: str) -> Suggest:
    """The fix line of the decorator's dtype refusal: the decorator as the caller wrote it
    (``written``: its other arguments, as code), with ``dtypes=`` added."""
    before = f"{written}, " if written else ""

    def suggest(dtypes: str) -> str:
        return f"@device_agnostic({before}dtypes={dtypes})"

    return suggest


def _call_fix(path: str) -> str:
    return exclude_fix([], ())(path)


def exclude_fix(kept: Sequence[str], excluded: Sequence[str]) -> Fix:
    """The fix of a decorated call's argument that fails to move: ``@device_agnostic``
    with its other arguments ``kept`` (as code) and the argument added to those
    ``excluded`` already."""

    def fix(path: str) -> str:
        match = re.match(r"[A-Za-z_]\w*", path)
        parameter = match.group(0) if match else path
        names = (*excluded, parameter) if parameter not in excluded else tuple(excluded)
        arguments = ", ".join([*kept, f"exclude={names!r}"])
        return (
            f"move it yourself, or leave the argument out of the move: "
            f"@device_agnostic({arguments})"
        )

    return fix


def _split_call(call: Call) -> tuple[list[str], list[Any]]:
    return call.keys(), [*call.args, *call.kwargs.values()]


def _rebuild_call(call: Call, keys: object, old: object, new: list[Any]) -> Call:
    count = len(call.args)
    return call.with_values(tuple(new[:count]), dict(zip(call.kwargs, new[count:], strict=True)))


register_builtin_kind(Call, Kind(CONTAINER, NAME, _split_call, _rebuild_call))
