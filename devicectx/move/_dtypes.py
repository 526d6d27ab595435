"""The dtype policy of a move: what happens to tensors of a dtype the target cannot hold.

``dtypes=`` of :func:`~devicectx.to_device`, ``@device_agnostic`` and
:func:`~devicectx.prefetch`:

- ``None`` (the default) changes nothing: a move to a device that cannot hold some of the
  tensors' dtypes (float64 on MPS) raises :class:`~devicectx.DtypeUnsupportedError`
  before anything is copied, naming every such path, with the fix;
- ``"device"``: each tensor of a dtype the target cannot hold is cast to the nearest one
  it holds (float64 -> float32, complex128 -> complex64; see
  :func:`devicectx.devices._capabilities.nearest_dtype`); on a device that holds
  everything nothing changes;
- a mapping (``{torch.float64: torch.float32}``): every tensor of a key's dtype is cast to
  its value, wherever it is and wherever it goes, so the same code gives the same dtypes on
  every device.

The cast is made before the move, where each tensor is (on the host for a batch from a
loader, so the copy sends the smaller dtype, and the staged path packs it like any other
tensor). It keeps what a move keeps (:mod:`devicectx.move._alias` does it, with the
target's dtype instead of its device): each tensor cast once, views of a cast tensor
still views of its cast, autograd history (``.to(dtype)``); the input is never changed.
Modules are not cast (``module.to`` moves them in place, as they are), but they are
checked: a parameter or buffer of a dtype the target cannot hold is refused with the rest,
before anything moves, so a module is never left half-moved. The fix casts with a module's
``.float()`` where that changes no other tensor's dtype, else tensor by tensor (float16
weights beside a float64 buffer stay float16). An object with its own ``.to`` is cast
where the engine can rebuild it (a registered or known protocol: ``TensorDict``,
``BatchEncoding``), and is otherwise left to its ``.to`` (torch_geometric's ``Data``),
which cannot cast.

The default's refusal offers two ``dtypes=``: the mapping, which gives the same dtypes on
every device, and ``"device"``, which casts only where the device lacks the dtype (on a
CUDA GPU, nothing: code fixed so on a Mac then fails there on float64).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain
from typing import Any, Literal, NamedTuple, TypeAlias, TypeVar

import torch
from torch import nn

from devicectx._errors import DtypeUnsupportedError
from devicectx.devices._capabilities import (
    CAPABILITIES,
    holds_every_dtype,
    missing_dtypes,
    nearest_dtype,
)
from devicectx.move._alias import TensorMover
from devicectx.move._containers import KIND_CACHE
from devicectx.move._kinds import LEAF_KIND, MODULE_KIND
from devicectx.move._paths import within
from devicectx.move._rebuild import Fix, Rebuild
from devicectx.move._skip import Skip
from devicectx.move._walk import iter_tensors, module_paths

__all__ = [
    "DtypesLike",
    "Policy",
    "arguments_code",
    "call_suggest",
    "cast_batch",
    "check_dtypes",
    "code_of",
    "holds_any",
    "policy_for",
]

T = TypeVar("T")
_Tensor = torch.Tensor
_Module = nn.Module
_NO_DTYPES: frozenset[torch.dtype] = frozenset()

DtypesLike: TypeAlias = Literal["device"] | Mapping[torch.dtype, torch.dtype] | None
"""What ``dtypes=`` takes: ``None``, ``"device"``, or ``{from dtype: to dtype}``."""

Suggest = Callable[[str], str]
"""Given the ``dtypes=`` argument to write (``'"device"'``), the fix line, as code."""


class Policy:
    """A ``dtypes=`` for one target: what to cast, and what the target still cannot hold.

    Attributes:
        spec: the ``dtypes=`` it came from (``None``, ``"device"`` or the mapping).
        cast: ``{dtype: dtype}``: every tensor of a key's dtype becomes its value.
        missing: the dtypes the target cannot hold that ``cast`` does not change: tensors
            of these that would move are refused.
        unheld: every dtype the target cannot hold: a module's parameters and buffers of
            these are refused, as ``module.to`` moves them uncast.
        device: the target.
    """

    __slots__ = ("cast", "device", "missing", "spec", "unheld", "wanted")

    def __init__(
        self,
        spec: DtypesLike,
        cast: dict[torch.dtype, torch.dtype],
        unheld: frozenset[torch.dtype],
        device: torch.device,
    ) -> None:
        self.spec = spec
        self.cast = cast
        self.missing = unheld - cast.keys()
        self.unheld = unheld
        self.device = device
        # The dtypes that make a walk worth it; a superset of `unheld`.
        self.wanted = frozenset(cast) | unheld

    def apply(
        self,
        obj: T,
        skip: Skip | None,
        name: str,
        who: str,
        fix: Fix,
        suggest: Suggest,
        values: Iterable[Any] | None = None,
        parameters: bool = True,
    ) -> T:
        """``obj`` with the casts made, or ``obj`` itself where none applies.

        Raises:
            DtypeUnsupportedError: a tensor that would move is of a dtype the target
                cannot hold (after the casts), or a module that would move holds one
                (modules are not cast); every such path is named.

        ``values``: what ``obj`` holds, for the quick look (default: ``obj`` itself).
        ``parameters``: as :func:`devicectx.move._move.move_call`'s (False: a cast
        ``nn.Parameter`` is a differentiable copy, whose gradient reaches the parameter).
        """
        # Our frames, hidden from pytest's report: it shows the caller's line and our message.
        __tracebackhide__ = True
        skip_types = () if skip is None else skip.types
        # A quick look first (a batch with nothing to cast is the common case): the walk
        # that rebuilds costs several times more than one that only reads.
        look = (obj,) if values is None else values
        if not holds_any(look, self.wanted, self.unheld, skip_types):
            return obj
        caster = _Caster(self, parameters)
        walk = Rebuild.moving(None, caster, skip, name, fix, who)
        # Rebuild's hot loops copy a plain tensor with .to(device) themselves, which is a
        # move's work: here every tensor goes to the caster, which picks the ones to cast.
        walk.moved = None
        met: list[nn.Module] = []
        walk.modules = met
        result = walk.run(obj)
        replace = caster.finish()
        if replace:  # views met before the tensor they belong to: made views of its cast
            result = Rebuild.replacing(replace, name, fix, who).run(result)
        # module.to would stop at the first tensor the target refuses, with the module's
        # earlier tensors already moved in place: refused here, before anything moves.
        in_modules = self._unheld_in(met)
        if caster.refused or in_modules:
            refused = _Refused(caster.refused, in_modules, met)
            raise _refused(self, obj, name, who, refused, suggest)
        return result  # type: ignore[no-any-return]

    def _unheld_in(self, modules: list[nn.Module]) -> dict[int, torch.dtype]:
        """``{id(tensor): dtype}`` of the parameters and buffers of ``modules`` that
        ``module.to`` would send to the target, which cannot hold their dtype."""
        unheld, device = self.unheld, self.device
        refused: dict[int, torch.dtype] = {}
        for module in modules:
            for tensor in chain(module.parameters(), module.buffers()):
                if tensor.dtype in unheld and tensor.device != device:
                    refused[id(tensor)] = tensor.dtype
        return refused


class _Caster(TensorMover):
    """A :class:`TensorMover` that casts where each tensor is, and only what the policy
    casts; it notes the tensors the target cannot hold."""

    __slots__ = ("missing", "refused", "target")

    def __init__(self, policy: Policy, parameters: bool = True) -> None:
        super().__init__(None, False, policy.cast, parameters=parameters)
        self.target = policy.device
        self.missing = policy.missing
        # {id(tensor): (its dtype, the dtype the policy makes it)}: a mapping's value may be
        # the dtype the target cannot hold, not the tensor's own.
        self.refused: dict[int, tuple[torch.dtype, torch.dtype]] = {}

    def move(self, tensor: torch.Tensor) -> torch.Tensor:
        dtype = tensor.dtype
        assert self.dtypes is not None
        to = self.dtypes.get(dtype, dtype)
        if to in self.missing and tensor.device != self.target:
            self.refused[id(tensor)] = (dtype, to)
            return tensor
        return tensor if to is dtype else super().move(tensor)


def holds_any(
    values: Iterable[Any],
    wanted: frozenset[torch.dtype],
    modules: frozenset[torch.dtype] = _NO_DTYPES,
    skip_types: tuple[type, ...] = (),
) -> bool:
    """Whether a tensor of a ``wanted`` dtype is in ``values``, or one of a ``modules``
    dtype among the parameters and buffers of a module there that is none of
    ``skip_types``: plain dicts, lists and tuples read recursively, without paths;
    anything else read by the full walk, which reads a module's tensors against ``wanted``
    (with ``modules`` a part of it, as in a policy, the answer errs only towards yes)."""
    try:
        return _plain_holds(values, wanted, modules, skip_types, _PLAIN_DEPTH)
    except _NotPlain:
        into = bool(modules) and not (skip_types and issubclass(_Module, skip_types))
        return any(
            tensor.dtype in wanted
            for v in values
            for _, tensor in iter_tensors(v, "", modules=into)
        )


class _NotPlain(Exception):
    pass


_PLAIN_DEPTH = 8


def _plain_holds(
    items: Iterable[Any],
    wanted: frozenset[torch.dtype],
    modules: frozenset[torch.dtype],
    skip_types: tuple[type, ...],
    depth: int,
) -> bool:
    for item in items:
        tp = type(item)
        if tp is _Tensor:
            if item.dtype in wanted:
                return True
        elif tp is dict or tp is list or tp is tuple:
            if not depth:
                raise _NotPlain
            inner = item.values() if tp is dict else item
            if _plain_holds(inner, wanted, modules, skip_types, depth - 1):
                return True
        else:
            kind = KIND_CACHE.get(tp)
            if kind is MODULE_KIND:
                if (
                    modules
                    and not (skip_types and isinstance(item, skip_types))
                    and any(t.dtype in modules for t in chain(item.parameters(), item.buffers()))
                ):
                    return True
            elif kind is not LEAF_KIND:
                raise _NotPlain
    return False


def policy_for(dtypes: DtypesLike, device: torch.device) -> Policy | None:
    """The policy of ``dtypes=`` for ``device``; None where it changes and checks nothing
    (the default, or ``"device"``, on a device that holds every dtype).

    Raises:
        ValueError, TypeError: ``dtypes`` is no policy (said with the fix).
    """
    __tracebackhide__ = True
    if dtypes is None or (isinstance(dtypes, str) and dtypes == "device"):
        if holds_every_dtype(device):  # most devices: nothing kept, nothing for dynamo to trace
            return None
        key = (_KEY, dtypes, device)
        derived = CAPABILITIES.derived
        policy = derived.get(key, _KEY)
        if policy is _KEY:
            policy = derived[key] = _named(dtypes, device)
        return policy  # type: ignore[return-value]
    cast = check_dtypes(dtypes)
    missing = missing_dtypes(device)
    if not cast and not missing:
        return None
    return Policy(dtypes, cast, missing, device)


# The policies of None and "device" on a device that lacks some dtype are worked out once
# per device and kept with the answers they come from (CAPABILITIES.derived); a device that
# holds everything has none, answered before this cache is read.
_KEY = object()


def _named(spec: str | None, device: torch.device) -> Policy:
    """The policy of ``None`` or ``"device"`` on a device that lacks some dtype."""
    missing = missing_dtypes(device)
    cast: dict[torch.dtype, torch.dtype] = {}
    if spec == "device":
        for dtype in missing:
            nearest = nearest_dtype(device, dtype)
            if nearest is not None:
                cast[dtype] = nearest
    return Policy(spec, cast, missing, device)  # type: ignore[arg-type]


def cast_batch(
    batch: T,
    device: torch.device,
    dtypes: DtypesLike,
    skip: Skip | None,
    index: int,
    suggest: Suggest | None = None,
) -> T:
    """:func:`~devicectx.prefetch`'s batch ``index`` with the policy's casts made.

    ``suggest``: the refusal's fix line, with the caller's other arguments (None: the
    call with ``dtypes=`` alone)."""
    __tracebackhide__ = True
    policy = policy_for(dtypes, device)
    if policy is None:
        return batch

    def fix(path: str) -> str:
        return f"leave it where it is: prefetch(batches, {str(device)!r}, skip=[{path!r}])"

    if suggest is None:
        suggest = call_suggest("prefetch", ("batches", repr(str(device))), ())
    return policy.apply(batch, skip, "batch", f"prefetch() at batch {index}", fix, suggest)


def call_suggest(
    function: str, positional: Sequence[str], keywords: Iterable[tuple[str, object, object]]
) -> Suggest:
    """The fix line of a refusal: the caller's call (``positional`` as code, then
    ``keywords`` as :func:`arguments_code` writes them) with ``dtypes=`` added.

    Each argument the caller set is written back, as a fix that dropped one would change
    the call (``skip=["rng"]`` dropped moves the RNG state, which torch then refuses).
    One that cannot be written as code (a lambda) is marked, so that the pasted line
    fails rather than run without it.

    Example:
        >>> call = call_suggest("to_device", ["obj", "'mps:0'"], [("skip", ["rng"], None)])
        >>> print(call('"device"'))
        to_device(obj, 'mps:0', skip=['rng'], dtypes="device")
    """
    written = [*positional, *arguments_code(keywords)]

    def suggest(dtypes: str) -> str:
        return f"{function}({', '.join([*written, f'dtypes={dtypes}'])})"

    return suggest


def arguments_code(keywords: Iterable[tuple[str, object, object]]) -> list[str]:
    """``name=value``, as code, of each ``(name, value, default)`` whose value the caller
    set off its default: the arguments a fix line writes back."""
    written = []
    for name, value, default in keywords:
        if value is default or value == default:
            continue
        code = code_of(value)
        written.append(f"{name}={code if code is not None else f'<your {name}= as it was>'}")
    return written


_WRITTEN = (type(None), bool, int, float, str, bytes)


def code_of(value: object) -> str | None:
    """``value`` as code, or None where it has none: a value, a container of them, a type
    or a function by its name (torch's under ``torch.``)."""
    if type(value) in _WRITTEN:
        return repr(value)
    if isinstance(value, torch.device):
        return repr(str(value))
    if isinstance(value, torch.dtype):
        return _code(value)
    if type(value) in (list, tuple, set, frozenset):
        items = [code_of(item) for item in value]  # type: ignore[attr-defined]
        if any(item is None for item in items):
            return None
        inner = ", ".join(items)  # type: ignore[arg-type]
        if isinstance(value, list):
            return f"[{inner}]"
        if isinstance(value, tuple):
            return f"({inner},)" if len(items) == 1 else f"({inner})"
        braced = f"{{{inner}}}" if items else ""
        return braced if type(value) is set and items else f"{type(value).__name__}({braced})"
    if type(value) is dict:  # a dtypes= mapping
        pairs = [(code_of(key), code_of(item)) for key, item in value.items()]
        if any(key is None or item is None for key, item in pairs):
            return None
        return "{" + ", ".join(f"{key}: {item}" for key, item in pairs) + "}"
    if isinstance(value, type) or inspect.isfunction(value) or inspect.isbuiltin(value):
        return _name_of(value)
    return None


# Where torch's types are written from: `torch.nn.Module`, not `torch.nn.modules.module.Module`.
_PUBLIC = {"torch": torch, "torch.nn": torch.nn, "torch.optim": torch.optim}


def _name_of(value: Any) -> str | None:
    """How code names a type or a function: ``torch.nn.Module``, ``dict``, ``MyState``;
    None for one no code can name (a lambda, one defined in a function)."""
    qualname = getattr(value, "__qualname__", "")
    if not qualname or "<" in qualname:
        return None
    module = getattr(value, "__module__", "") or ""
    if module.partition(".")[0] != "torch":
        return str(qualname)
    for public, namespace in _PUBLIC.items():
        if getattr(namespace, qualname, None) is value:
            return f"{public}.{qualname}"
    return f"{module}.{qualname}"


def check_dtypes(dtypes: object) -> dict[torch.dtype, torch.dtype]:
    """The cast a ``dtypes=`` mapping asks for; ``{}`` for None and ``"device"``.

    Raises:
        ValueError: a string other than ``"device"``.
        TypeError: anything else that is no mapping of ``torch.dtype`` to ``torch.dtype``.
    """
    __tracebackhide__ = True
    if dtypes is None:
        return {}
    if isinstance(dtypes, str):
        if dtypes == "device":
            return {}
        msg = (
            f'dtypes={dtypes!r} is no dtype policy: it takes None, "device" or a mapping\n'
            f'fix: dtypes="device" (what the target cannot hold becomes the nearest dtype it '
            f"holds), or dtypes={{torch.float64: torch.float32}}"
        )
        raise ValueError(msg)
    if isinstance(dtypes, Mapping):
        wrong = [
            (k, v)
            for k, v in dtypes.items()
            if not isinstance(k, torch.dtype) or not isinstance(v, torch.dtype)
        ]
        if not wrong:
            return {k: v for k, v in dtypes.items() if k != v}
        shown = ", ".join(f"{k!r}: {v!r}" for k, v in wrong)
        named = [(dtype_named(k), dtype_named(v)) for k, v in dtypes.items()]
        fixed = [(k, v) for k, v in named if k is not None and v is not None]
        if len(fixed) == len(named):  # names: spelt as dtypes
            written = ", ".join(f"{_code(k)}: {_code(v)}" for k, v in fixed)
            raise TypeError(
                f'dtypes= takes None, "device" or a mapping of torch.dtype to torch.dtype, '
                f"got {shown}\nfix: dtypes={{{written}}}"
            )
    else:
        shown = repr(dtypes)
    msg = (
        f'dtypes= takes None, "device" or a mapping of torch.dtype to torch.dtype, '
        f"got {shown}\n"
        f"fix: dtypes={{torch.float64: torch.float32}}"
    )
    raise TypeError(msg)


def dtype_named(value: object) -> torch.dtype | None:
    """``value`` as a dtype: itself, or the dtype a name spells (``"float64"``,
    ``"torch.float64"``); None where it is neither.

    Example:
        >>> dtype_named("float64"), dtype_named("torch.int8"), dtype_named("f64")
        (torch.float64, torch.int8, None)
    """
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        found = getattr(torch, value.removeprefix("torch."), None)
        return found if isinstance(found, torch.dtype) else None
    return None


class _Refused(NamedTuple):
    """What a policy's walk refused: the tensors it would have moved, by id, each with its
    dtype and the dtype the policy makes it (the same, or a mapping's value the target
    cannot hold); the modules' tensors of a dtype the target cannot hold, by id; the
    modules met."""

    tensors: dict[int, tuple[torch.dtype, torch.dtype]]
    in_modules: dict[int, torch.dtype]
    modules: list[nn.Module]


def _refused(
    policy: Policy, obj: Any, name: str, who: str, refused: _Refused, suggest: Suggest
) -> DtypeUnsupportedError:
    """The error naming every path of a tensor the target cannot hold, by dtype: those the
    policy would have moved, then those of modules. A tensor a mapping would make a dtype
    the target cannot hold is listed as ``torch.float32 -> torch.float64``, and under that
    dtype in the error's ``paths``."""
    rows = _rows(obj, name, refused)
    moved = set(refused.tensors.values())
    plain = [pair for pair in rows if pair in moved]
    paths: dict[torch.dtype, list[str]] = {}
    for (_, to), listed in rows.items():
        paths.setdefault(to, []).extend(listed)
    device = policy.device
    count = len(refused.tensors.keys() | refused.in_modules.keys())
    held_not = " or ".join(str(d) for d in paths)
    mapped = [f"{own} to {to}" for own, to in plain if own != to]
    why = f" (dtypes= maps {', '.join(mapped)})" if mapped else ""
    labels = {
        pair: str(pair[0]) if pair[0] == pair[1] else f"{pair[0]} -> {pair[1]}" for pair in rows
    }
    width = max(len(label) for label in labels.values())
    lines = [f"    {labels[pair]:<{width}} <- {', '.join(p)}" for pair, p in rows.items()]
    what = "a tensor" if count == 1 else f"{count} tensors"
    casts = _casts_of_modules(device, obj, name, refused)
    calls = _fix_calls(policy, plain, suggest) if plain else ""
    if casts:
        fix = f"{'; '.join(casts)} before the move (dtypes= casts no module's tensors)"
        if calls:
            fix = f"{fix}, and {calls}"
    else:
        fix = calls
    msg = "\n".join(
        [
            f"{who} cannot move {what} to {device}, which holds no {held_not}{why}:",
            *lines,
            f"fix: {fix}",
        ]
    )
    return DtypeUnsupportedError(msg, device=device, paths=paths)


def _rows(
    obj: Any, name: str, refused: _Refused
) -> dict[tuple[torch.dtype, torch.dtype], list[str]]:
    """The paths of the refused tensors, by ``(dtype, the dtype the policy makes it)``:
    those the policy would have moved, then those of modules, in the order of ``obj``."""
    rows: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}
    seen: set[str] = set()
    for path, tensor in iter_tensors(obj, name):
        seen.add(path)
        pair = refused.tensors.get(id(tensor))
        if pair is not None:
            rows.setdefault(pair, []).append(path)
    if refused.in_modules:
        for path, tensor in iter_tensors(obj, name, modules=True):
            dtype = refused.in_modules.get(id(tensor))
            if dtype is not None and path not in seen:
                rows.setdefault((dtype, dtype), []).append(path)
    return rows


def _casts_of_modules(device: torch.device, obj: Any, name: str, refused: _Refused) -> list[str]:
    """The lines that cast the modules' tensors ``device`` cannot hold, module by module,
    each module's tensors read from where ``obj`` holds it."""
    if not refused.in_modules:
        return []
    holding = [
        module
        for module in refused.modules
        if any(id(t) in refused.in_modules for t in chain(module.parameters(), module.buffers()))
    ]
    found = module_paths(obj, {id(module) for module in holding}, name)
    casts: dict[str, None] = {}
    for module in holding:
        root = found.get(id(module))
        if root is not None:
            tensors = ((path, t.dtype) for path, t in iter_tensors(module, root, modules=True))
            casts.update(dict.fromkeys(module_casts(device, tensors, root)))
    return list(casts)


# More lines than this casting one tensor (or one module) each are one line per dtype that
# casts every tensor of it under the module: a fix is read, then pasted.
_MAX_CASTS = 4


def module_casts(
    device: torch.device, tensors: Iterable[tuple[str, torch.dtype]], root: str
) -> list[str]:
    """The lines that cast the tensors of the module at ``root`` (all of them, ``(path,
    dtype)`` as a message names them) of dtypes ``device`` cannot hold, each once: what
    must come before ``module.to(device)``, which would stop at the first with the tensors
    before it moved. Empty where it holds them all.

    A floating point one is cast by a module's ``.float()`` where that changes no other
    tensor's dtype: the outermost module whose floating point tensors are all of dtypes
    ``device`` cannot hold (``model.float()`` for a ``model.double()``), else the tensor's
    own module where its others are float32; else (float16 or bfloat16 weights beside it,
    which ``.float()`` would upcast) the tensor alone, as a complex one always is.
    """
    missing = missing_dtypes(device)
    if not missing:
        return []
    listed = list(tensors)
    verdicts = _module_verdicts(listed, root, missing)
    lines: dict[str, None] = {}
    refused: dict[torch.dtype, None] = {}
    for path, dtype in listed:
        if dtype not in missing:
            continue
        refused[dtype] = None
        above = _modules_above(path, root) if dtype.is_floating_point else []
        outer = next((module for module in above if verdicts[module][0]), None)
        if outer is None and above and verdicts[above[-1]][1]:
            outer = above[-1]
        line = _tensor_cast(device, path, dtype) if outer is None else f"{outer}{_FLOAT}"
        lines[line] = None
    kept = outermost(lines)
    if len(kept) <= _MAX_CASTS:
        return kept
    return [_every_tensor_cast(device, root, dtype) for dtype in refused]


def _module_verdicts(
    tensors: Iterable[tuple[str, torch.dtype]], root: str, missing: frozenset[torch.dtype]
) -> dict[str, tuple[bool, bool]]:
    """For each module above a floating point tensor: whether all its floating point
    tensors are of ``missing`` dtypes, and whether all are of those or float32 (where its
    ``.float()`` changes no other tensor's dtype)."""
    verdicts: dict[str, tuple[bool, bool]] = {}
    for path, dtype in tensors:
        if not dtype.is_floating_point:
            continue
        unheld = dtype in missing
        kept = unheld or dtype == torch.float32
        for module in _modules_above(path, root):
            all_unheld, all_kept = verdicts.get(module, (True, True))
            verdicts[module] = (all_unheld and unheld, all_kept and kept)
    return verdicts


def _modules_above(path: str, root: str) -> list[str]:
    """The paths of the modules that hold the tensor at ``path`` (under the module at
    ``root``), outermost first: ``root``, then one per part of the path after it but the
    last (the tensor's name). ``[]`` for a path not under ``root``.

    Example:
        >>> _modules_above("model.layers[0]['a.b'].weight", "model")
        ['model', 'model.layers', 'model.layers[0]', "model.layers[0]['a.b']"]
    """
    if not within(path, root) or path == root:
        return []
    ends = [len(root)]
    at, quote = len(root), ""
    while at < len(path):
        char = path[at]
        if quote:  # inside a key's repr: only its closing quote matters
            if char == "\\":
                at += 1
            elif char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in ".[" and at > len(root):
            ends.append(at)
        at += 1
    return [path[:end] for end in ends]


def _every_tensor_cast(device: torch.device, root: str, dtype: torch.dtype) -> str:
    """One line that casts every parameter and buffer of ``dtype`` under ``root`` to the
    nearest dtype ``device`` holds, in place (``.data``: each object kept, so ties too)."""
    to = nearest_dtype(device, dtype) or _fallback(device, dtype)
    return (
        f'[setattr(t, "data", t.data.to({_code(to)})) for t in '
        f"[*{root}.parameters(), *{root}.buffers()] if t.dtype == {_code(dtype)}]"
    )


_FLOAT = ".float()"


def outermost(casts: Iterable[str]) -> list[str]:
    """``casts`` (:func:`module_cast`'s lines) without a module's ``.float()`` where an
    ancestor's is among them: ``Module.float()`` casts every submodule too.

    Example:
        >>> outermost(["obj.embed.float()", "obj.w.data = obj.w.data.to(torch.complex64)",
        ...            "obj.float()"])
        ['obj.w.data = obj.w.data.to(torch.complex64)', 'obj.float()']
    """
    lines = list(casts)
    cast = [line.removesuffix(_FLOAT) for line in lines if line.endswith(_FLOAT)]

    def covered(line: str) -> bool:
        module = line.removesuffix(_FLOAT)
        return line != module and any(o != module and within(module, o) for o in cast)

    return [line for line in lines if not covered(line)]


def module_cast(device: torch.device, path: str, dtype: torch.dtype) -> str:
    """The line that casts a module's tensor at ``path`` to a dtype ``device`` holds: its
    module's ``.float()`` for a floating point one (which leaves complex ones alone), else
    the tensor's own ``.data`` (``module.to(torch.complex64)`` would make the module's
    real tensors complex too)."""
    # A parameter's or buffer's name is the last part of its path (`.weight`, or `['a-b']`
    # for a name that is no identifier): what comes before is its module's path.
    cut = path.rfind("[") if path.endswith("]") else path.rfind(".")
    if dtype.is_floating_point and cut > 0:
        return f"{path[:cut]}.float()"
    return _tensor_cast(device, path, dtype)


def _tensor_cast(device: torch.device, path: str, dtype: torch.dtype) -> str:
    """The line that casts the module's tensor at ``path`` alone, in place (``.data``: the
    object kept, so a tie too), to the nearest dtype ``device`` holds."""
    to = nearest_dtype(device, dtype) or _fallback(device, dtype)
    return f"{path}.data = {path}.data.to({_code(to)})"


# How the fix of a refusal under dtypes=None tells its two calls apart.
_PORTABLE = "to get the same dtypes on every device"
_LACKING = "to cast only where the device lacks them"
_DEVICE = '"device"'


def _fix_calls(
    policy: Policy, refused: Sequence[tuple[torch.dtype, torch.dtype]], suggest: Suggest
) -> str:
    """The call (or calls) with the ``dtypes=`` that moves the ``refused`` tensors (each
    ``(its dtype, the dtype the policy makes it)``).

    Under the default, two: a mapping to the nearest dtype the target holds, which casts
    on every device (code fixed on an MPS laptop keeps float32 on a CUDA GPU too), and
    ``"device"``, which casts only where the device lacks the dtype. Otherwise one: the
    policy's casts, completed, each to a dtype the target holds (a mapping's value it
    cannot hold replaced by the nearest one it holds; a key left mapped to itself out).
    """
    device = policy.device
    nearest = {own: nearest_dtype(device, own) for own, _ in refused}
    if policy.spec is None and all(nearest.values()):
        mapping = _mapping_code({own: to for own, to in nearest.items() if to is not None})
        return f"{suggest(mapping)} {_PORTABLE}, or {suggest(_DEVICE)} {_LACKING}"
    cast = dict(policy.cast)
    for own, to in refused:
        cast[own] = nearest_dtype(device, to) or _fallback(device, to)
    kept = {k: v for k, v in cast.items() if k != v}
    return suggest(_mapping_code(kept) if kept else "None")


def _mapping_code(cast: Mapping[torch.dtype, torch.dtype]) -> str:
    """``{torch.float64: torch.float32}``: a ``dtypes=`` mapping as code."""
    return "{" + ", ".join(f"{_code(k)}: {_code(v)}" for k, v in cast.items()) + "}"


def _fallback(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """A dtype the target holds for one without a nearest: float32, complex64, int64."""
    if dtype.is_complex:
        return torch.complex64
    return torch.float32 if dtype.is_floating_point else torch.int64


def _code(dtype: torch.dtype) -> str:
    return str(dtype)  # "torch.float64": the dtype as code
