"""Hypothesis strategies for device-agnostic code: devices, tensors, and nested batches.

Example:
    >>> from hypothesis import given
    >>> from devicectx import to_device
    >>> from devicectx.testing.strategies import nested, tensors
    >>> @given(nested(tensors(devices=["cpu"])))
    ... def test_moves_everything(batch):
    ...     moved = to_device(batch, "meta")
    ...     assert to_device(moved, "meta") is moved
    >>> test_moves_everything()

- :func:`devices`: the devices of this machine, plus ``meta`` where allowed;
- :func:`tensors`: tensors of any dtype and shape (small), on those devices;
- :func:`nested`: structures of every container kind :func:`~devicectx.to_device`
  supports, holding tensors, views of them, the same tensor at several places, and plain
  values (``None``, numbers, strings, ``torch.Size``, ``range``, iterators, ...).

Needs hypothesis (``pip install -e '.[testing]'``); ``import devicectx`` does not
import this module.
"""

from __future__ import annotations

import collections
import dataclasses
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from hypothesis import strategies as st
from torch.nn.utils.rnn import PackedSequence

from devicectx._errors import DeviceUnavailableError, InvalidDeviceError, with_article
from devicectx.devices._capabilities import nearest_dtype, supports_dtype
from devicectx.devices._resolve import DeviceLike, available_devices, resolve_device
from devicectx.move._dtypes import dtype_named

__all__ = [
    "KINDS",
    "devices",
    "kind_of",
    "nested",
    "tensors",
]

_META = torch.device("meta")
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.bool)
_QUANTIZED = (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4)


def devices(*, allow_meta: bool = False) -> st.SearchStrategy[torch.device]:
    """The devices of this machine (:func:`~devicectx.available_devices`), and ``meta``.

    Args:
        allow_meta: also draw ``meta``, the second device of a machine without an
            accelerator: tensors on it have shapes and dtypes but no values.

    Raises:
        TypeError: ``allow_meta`` is not True or False.
    """
    _check_flag("devices", "allow_meta", allow_meta)
    found = available_devices()
    return st.sampled_from([*found, _META] if allow_meta else found)


_machine_devices = devices  # tensors() takes a parameter of that name


def tensors(
    devices: st.SearchStrategy[torch.device] | DeviceLike | Sequence[DeviceLike] = None,
    dtypes: st.SearchStrategy[torch.dtype] | torch.dtype | Sequence[torch.dtype] | None = None,
    shapes: st.SearchStrategy[tuple[int, ...]] | None = None,
    *,
    requires_grad: bool = False,
) -> st.SearchStrategy[torch.Tensor]:
    """Fresh tensors (no views) with seeded random values, in dtypes their device holds.

    Example:
        >>> import torch
        >>> from hypothesis import given
        >>> @given(tensors(devices="cpu", dtypes=torch.float32))
        ... def test_float32_on_the_cpu(tensor):
        ...     assert (tensor.device.type, tensor.dtype) == ("cpu", torch.float32)
        >>> test_float32_on_the_cpu()

    Args:
        devices: a strategy of devices (or of device specs), one device spec
            (``"cpu"``, ``torch.device``), or a list of them; default :func:`devices`
            (this machine's devices, no ``meta``).
        dtypes: a strategy of dtypes, one dtype, or a list; default float32/64/16,
            int64/32, bool. Each tensor gets one its device holds
            (:func:`~devicectx.supports_dtype`): on an MPS-like device (MPS, or the
            emulated accelerator's ``"mps"`` profile), no float64 or complex128. From a
            list, the dtypes it cannot hold are left out; from a strategy, one it cannot
            hold is replaced by the nearest it holds (float32 for float64).
        shapes: a strategy of shapes; default 0 to 3 dimensions of 0 to 4 each.
        requires_grad: make floating-point tensors leaves that require grad.

    Raises:
        TypeError: ``devices`` or ``dtypes`` is neither a strategy, one value, nor a list;
            a dtype is a str (``"float32"``: torch's dtypes are objects) or one
            ``tensors`` cannot fill with values (a quantized dtype); ``shapes`` is no
            strategy; ``requires_grad`` is not True or False. When drawn: a strategy
            drew a value of the wrong kind.
        ValueError: ``devices`` or ``dtypes`` is an empty list; or, when drawn, a device
            holds none of the listed dtypes, or neither a drawn dtype nor one near it.
        devicectx.InvalidDeviceError: a device spec is malformed (``"gpu"``), where
            the strategy is built or, from a strategy, when drawn.
        devicectx.DeviceUnavailableError: a device is not on this machine.
    """
    _check_flag("tensors", "requires_grad", requires_grad)
    if devices is None:
        device_strategy = _machine_devices()
    elif isinstance(devices, st.SearchStrategy):
        device_strategy = devices
    else:
        listed = _listed("devices", devices, (str, torch.device, int), example="['cpu']")
        call = f"tensors(devices={devices!r})"
        device_strategy = st.sampled_from([_resolved(spec, call) for spec in listed])
    if dtypes is None:
        dtype_choice: st.SearchStrategy[torch.dtype] | list[torch.dtype] = list(_DTYPES)
    elif isinstance(dtypes, st.SearchStrategy):
        dtype_choice = dtypes
    else:
        dtype_choice = _listed_dtypes(dtypes)
    if shapes is None:
        shape_strategy = _SHAPES
    elif isinstance(shapes, st.SearchStrategy):
        shape_strategy = shapes.map(_checked_shape)
    else:
        given_shape = _as_shape(shapes)
        example = (5,) if given_shape is None else given_shape
        msg = (
            f"tensors(shapes={shapes!r}): takes a hypothesis strategy of shapes, not "
            f"{with_article(type(shapes).__name__)}\nfix: tensors(shapes=st.just({example!r}))"
        )
        raise TypeError(msg)
    return _tensors(shape_strategy, _placed_dtypes(device_strategy, dtype_choice), requires_grad)


@st.composite
def _tensors(
    draw: st.DrawFn,
    shapes: st.SearchStrategy[tuple[int, ...]],
    placed: st.SearchStrategy[tuple[torch.device, torch.dtype]],
    requires_grad: bool,
) -> torch.Tensor:
    # Drawn here, not built with st.builds: a failing example then prints the tensor as
    # torch does, not a call of this module's private helper.
    seed = st.integers(0, 2**31 - 1)
    return _make_tensor(draw(shapes), draw(placed), draw(seed), requires_grad)


def nested(
    leaves: st.SearchStrategy[torch.Tensor] | None = None,
    *,
    max_depth: int = 3,
    plain_values: bool = True,
    views: bool = True,
) -> st.SearchStrategy[Any]:
    """Structures of every container kind :func:`~devicectx.to_device` supports.

    Each example draws a few tensors from ``leaves`` and views of them (slices,
    transposes, ``expand``, views of views; sparse and nested leaves, which refuse most of
    these, come as they are), then builds a container whose tensor leaves are picked from
    those: so the same tensor shows up at several places, and views show up with or
    without their base, before or after it. The container kinds are listed in
    :data:`KINDS`; :func:`kind_of` names the kind of a container. Empty lists, tuples and
    dicts show up too.

    Args:
        leaves: the tensors to start from; default :func:`tensors` on the CPU.
        max_depth: how deep containers nest; 0 gives bare leaves.
        plain_values: also put non-tensor values among the leaves.
        views: also draw views; False keeps only the tensors drawn from ``leaves``, each
            with memory of its own (still at several places), for properties that count
            copies or bytes.

    Raises:
        TypeError: ``leaves`` is no strategy, or (when drawn) drew something other than
            a tensor; ``max_depth`` is no int; ``plain_values`` or ``views`` is not True
            or False.
        ValueError: ``max_depth`` is negative.

    An example holds up to 125 tensor leaves at the default depth, so hypothesis may warn
    of an overly large repr (``HypothesisWarning``) where it prints one; ``max_depth=2``
    draws smaller structures. A failing example prints each structure as its repr.
    """
    _check_flag("nested", "plain_values", plain_values)
    _check_flag("nested", "views", views)
    if not isinstance(max_depth, int) or isinstance(max_depth, bool):
        msg = (
            f"nested(max_depth={max_depth!r}): takes an int, not "
            f"{with_article(type(max_depth).__name__)}\nfix: nested(max_depth=3)"
        )
        raise TypeError(msg)
    if max_depth < 0:
        msg = f"nested(max_depth={max_depth}): the depth cannot be negative\nfix: max_depth=3"
        raise ValueError(msg)
    if leaves is not None and not isinstance(leaves, st.SearchStrategy):
        msg = (
            f"nested(leaves={leaves!r}): takes a hypothesis strategy of tensors, not "
            f"{with_article(type(leaves).__name__)}\n"
            f"fix: nested(strategies.tensors(devices=['cpu']))"
        )
        raise TypeError(msg)
    source = leaves if leaves is not None else tensors(devices=["cpu"])
    return _nested(source, max_depth, plain_values, views)


# Container types the strategy builds, beyond the built-in ones.


class Pair(NamedTuple):
    """A namedtuple."""

    first: Any
    second: Any


@dataclasses.dataclass
class Box:
    """A mutable dataclass, with a field the constructor does not take."""

    value: Any
    label: str = "box"
    late: Any = dataclasses.field(init=False, default=None)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """Print as the repr does, ``late`` included: hypothesis's printer, which calls
        this, shows only the fields the constructor takes, so a failing example would
        hide what ``late`` holds."""
        printer.text("Box(value=")
        printer.pretty(self.value)
        printer.text(f", label={self.label!r}, late=")
        printer.pretty(self.late)
        printer.text(")")


@dataclasses.dataclass(frozen=True)
class FrozenBox:
    """A frozen dataclass."""

    value: Any
    other: Any = None


@dataclasses.dataclass(frozen=True, slots=True)
class SlottedBox:
    """A frozen dataclass with ``__slots__``."""

    value: Any


class TaggedList(list[Any]):
    """A list subclass with an attribute of its own."""

    tag = "tagged"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """Print with the type's name: hypothesis's printer would show a plain list."""
        _pretty_call(printer, "TaggedList", list(self))


class TupleOf(tuple[Any, ...]):
    """A tuple subclass that is no namedtuple."""

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """Print with the type's name: hypothesis's printer would show a plain tuple."""
        _pretty_call(printer, "TupleOf", tuple(self))


def _pretty_call(printer: Any, name: str, argument: Any) -> None:
    printer.text(f"{name}(")
    printer.pretty(argument)
    printer.text(")")


class FrozenMap(Mapping[Any, Any]):
    """An immutable Mapping, rebuilt through its constructor."""

    def __init__(self, items: Mapping[Any, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: Any) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"FrozenMap({self._items!r})"


KINDS: tuple[str, ...] = (
    "list",
    "tuple",
    "namedtuple",
    "return_types",
    "dict",
    "OrderedDict",
    "defaultdict",
    "ChainMap",
    "mappingproxy",
    "deque",
    "set",
    "frozenset",
    "dataclass",
    "frozen dataclass",
    "slots dataclass",
    "PackedSequence",
    "UserDict",
    "Mapping",
    "UserList",
    "list subclass",
    "tuple subclass",
)
"""Every container kind :func:`nested` builds, as :func:`kind_of` names them."""

_KIND_OF_TYPE: dict[type, str] = {
    list: "list",
    tuple: "tuple",
    Pair: "namedtuple",
    torch.return_types.max: "return_types",
    dict: "dict",
    collections.OrderedDict: "OrderedDict",
    collections.defaultdict: "defaultdict",
    collections.ChainMap: "ChainMap",
    types.MappingProxyType: "mappingproxy",
    collections.deque: "deque",
    set: "set",
    frozenset: "frozenset",
    Box: "dataclass",
    FrozenBox: "frozen dataclass",
    SlottedBox: "slots dataclass",
    PackedSequence: "PackedSequence",
    collections.UserDict: "UserDict",
    FrozenMap: "Mapping",
    collections.UserList: "UserList",
    TaggedList: "list subclass",
    TupleOf: "tuple subclass",
}


def kind_of(obj: object) -> str | None:
    """The name (in :data:`KINDS`) of the container kind of ``obj``, or None for a leaf."""
    return _KIND_OF_TYPE.get(type(obj))


_SHAPES = st.lists(st.integers(0, 4), max_size=3).map(tuple)


def _listed_dtypes(given: Any) -> list[torch.dtype]:
    """``dtypes=`` as a list of dtypes ``tensors`` can make, each checked now, not when
    drawn: a str (``"float32"``) would be iterated letter by letter."""
    if isinstance(given, str):
        given = [given]
    listed = _listed("dtypes", given, (torch.dtype,), example="[torch.float32]")
    return [_checked_dtype(dtype, drawn=False) for dtype in listed]


def _checked_dtype(dtype: Any, *, drawn: bool) -> torch.dtype:
    """``dtype``, where it is a torch dtype ``tensors`` can make values in (a quantized
    dtype is none); else a TypeError that says so, with the fix."""
    how = "drew" if drawn else "got"
    if isinstance(dtype, str):
        named = dtype_named(dtype)
        spelled = str(named) if named is not None else "torch.float32"
        msg = (
            f"tensors(dtypes=...): {how} {dtype!r}, a str: dtypes are torch's objects\n"
            f"fix: tensors(dtypes=[{spelled}])"
        )
        raise TypeError(msg)
    if not isinstance(dtype, torch.dtype):
        msg = (
            f"tensors(dtypes=...): {how} {dtype!r} ({with_article(type(dtype).__name__)}), not a "
            f"torch.dtype\nfix: tensors(dtypes=[torch.float32])"
        )
        raise TypeError(msg)
    try:
        with warnings.catch_warnings():  # complex32's "experimental" warning is the draws'
            warnings.simplefilter("ignore")
            torch.zeros(1).to(dtype)
    except (RuntimeError, TypeError):
        raise TypeError(_unfillable(dtype, how)) from None
    return dtype


def _unfillable(dtype: torch.dtype, how: str) -> str:
    """The message for a dtype torch makes no tensor of from numbers: quantized ones are
    made from float tensors (the fix says how); bits, sub-byte and packed ones not at all."""
    if dtype in _QUANTIZED:
        return (
            f"tensors(dtypes=...): {how} {dtype}, which tensors() cannot fill with values "
            f"(torch makes it only from other tensors: quantized dtypes)\n"
            f"fix: tensors(dtypes=[torch.float32]), and torch.quantize_per_tensor in the test"
        )
    return (
        f"tensors(dtypes=...): {how} {dtype}, which tensors() cannot fill with values "
        f"(torch makes no values of it from numbers)\nfix: tensors(dtypes=[torch.float32])"
    )


def _checked_shape(shape: Any) -> tuple[int, ...]:
    """A drawn shape, where it is a sequence of sizes of 0 or more; else our TypeError
    (torch's would name ``randint``'s overloads)."""
    sizes = _as_shape(shape)
    if sizes is None:
        msg = (
            f"tensors(shapes=...): drew {shape!r}, not a shape (a tuple of sizes, 0 or "
            f"more)\nfix: tensors(shapes=st.just((5,))), or "
            f"hypothesis.extra.numpy.array_shapes()"
        )
        raise TypeError(msg)
    return sizes


def _as_shape(shape: Any) -> tuple[int, ...] | None:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list, torch.Size)):
        return None
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        return None
    return tuple(shape)


def _listed(name: str, given: Any, one: tuple[type, ...], *, example: str) -> list[Any]:
    """``given`` as a list: one value of the types ``one`` (a str is one device, not its
    characters), or the items of a sequence."""
    if isinstance(given, one):
        return [given]
    if isinstance(given, (bytes, Mapping)) or not isinstance(given, Iterable):
        msg = (
            f"tensors({name}={given!r}): takes a hypothesis strategy, one value or a list, "
            f"not {with_article(type(given).__name__)}\nfix: tensors({name}={example})"
        )
        raise TypeError(msg)
    values = list(given)
    if not values:
        msg = f"tensors({name}={given!r}): nothing to draw from\nfix: tensors({name}={example})"
        raise ValueError(msg)
    return values


def _check_flag(strategy: str, name: str, value: object) -> None:
    """Refuse a switch that is not True or False: ``"no"`` would be true."""
    if isinstance(value, bool):
        return
    if isinstance(value, int):  # 0 or 1: the switch it stands for
        fix = f"{strategy}({name}={bool(value)})"
    else:
        fix = f"{strategy}({name}=True), or {name}=False"
    msg = (
        f"{strategy}({name}={value!r}): takes True or False, not "
        f"{with_article(type(value).__name__)}\nfix: {fix}"
    )
    raise TypeError(msg)


def _resolved(spec: DeviceLike, call: str) -> torch.device:
    """``spec`` resolved; its error, which has the fix, begins with the strategy's call."""
    try:
        return resolve_device(spec)
    except (InvalidDeviceError, DeviceUnavailableError) as error:
        raise type(error)(f"{call}: {error}") from None


def _drawn_device(value: object) -> torch.device:
    """A device a ``devices=`` strategy drew: a spec (``"cpu"``) as the list form takes."""
    if isinstance(value, torch.device):
        return value
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return _resolved(value, f"tensors(devices=...): drew {value!r}")
    msg = (
        f"tensors(devices=...): drew {value!r} ({with_article(type(value).__name__)}), not "
        f"a device\nfix: tensors(devices=st.sampled_from(['cpu', 'meta']))"
    )
    raise TypeError(msg)


@st.composite
def _placed_dtypes(
    draw: st.DrawFn,
    devices: st.SearchStrategy[torch.device],
    dtypes: st.SearchStrategy[torch.dtype] | list[torch.dtype],
) -> tuple[torch.device, torch.dtype]:
    """A device, and a dtype it holds: asked at each draw, since what a device holds can
    change in a run (the emulated accelerator's profiles)."""
    device = _drawn_device(draw(devices))
    if isinstance(dtypes, st.SearchStrategy):
        # Replaced, not filtered out: a strategy of dtypes the device cannot hold would end
        # in hypothesis's "filtering too much", which says nothing of dtypes.
        dtype = _checked_dtype(draw(dtypes), drawn=True)
        if supports_dtype(device, dtype):
            return device, dtype
        replaced = nearest_dtype(resolve_device(device), dtype)
        if replaced is None:
            msg = (
                f"tensors(): {device} holds neither {dtype}, which dtypes= drew, nor any "
                f"dtype near it\nfix: draw only dtypes it holds: "
                f"dtypes.filter(lambda d: devicectx.supports_dtype({str(device)!r}, d))"
            )
            raise ValueError(msg)
        return device, replaced
    held = [dtype for dtype in dtypes if supports_dtype(device, dtype)]
    if not held:
        target = resolve_device(device)
        nearest = [nearest_dtype(target, dtype) for dtype in dtypes]
        added = [dtype for dtype in nearest if dtype is not None and dtype not in dtypes]
        names = ", ".join(map(str, dtypes))
        suggested = ", ".join(map(str, [*dtypes, *dict.fromkeys(added or [torch.float32])]))
        msg = (
            f"tensors(): {device} holds none of the dtypes listed: {names}\n"
            f"fix: list one it holds too, tensors(dtypes=[{suggested}])"
        )
        raise ValueError(msg)
    return device, draw(st.sampled_from(held))


def _make_tensor(
    shape: tuple[int, ...],
    placed: tuple[torch.device, torch.dtype],
    seed: int,
    requires_grad: bool,
) -> torch.Tensor:
    device, dtype = placed
    if device.type == "meta":
        tensor = torch.empty(shape, dtype=dtype, device=device)
    else:
        generator = torch.Generator().manual_seed(seed)
        if dtype.is_floating_point:
            values = torch.randn(shape, generator=generator, dtype=torch.float64)
        else:
            values = torch.randint(-3, 4, shape, generator=generator)
        tensor = values.to(dtype=dtype, device=device)
    if requires_grad and dtype.is_floating_point:
        tensor.requires_grad_(True)
    return tensor


def _view_ops(tensor: torch.Tensor) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """View-making functions that apply to ``tensor``'s layout and shape: none for a
    sparse or nested tensor, whose layouts refuse unsqueeze, expand, view or diagonal."""
    if tensor.layout != torch.strided or tensor.is_nested:
        return []
    ops: list[Callable[[torch.Tensor], torch.Tensor]] = [
        lambda t: t.unsqueeze(0),
        lambda t: t.view(t.shape),
        lambda t: t.expand(2, *t.shape),
    ]
    if tensor.dim() >= 1 and tensor.shape[0] >= 1:
        ops += [lambda t: t[1:], lambda t: t[:1], lambda t: t.select(0, t.shape[0] - 1)]
    if tensor.dim() >= 1:
        ops.append(lambda t: t[..., ::2])
    if tensor.dim() >= 2:
        ops += [lambda t: t.transpose(0, 1), lambda t: t.diagonal()]
    return ops


def _views(draw: st.DrawFn, bases: Sequence[torch.Tensor], max_size: int) -> list[torch.Tensor]:
    """Up to ``max_size`` views of tensors of ``bases``, of those that have views."""
    viewable = [base for base in bases if _view_ops(base)]
    if not viewable:
        return []
    count = draw(st.integers(0, max_size))
    views: list[torch.Tensor] = []
    for _ in range(count):
        base = draw(st.sampled_from(viewable))
        views.append(draw(st.sampled_from(_view_ops(base)))(base))
    return views


@st.composite
def _pool(
    draw: st.DrawFn, leaves: st.SearchStrategy[torch.Tensor], with_views: bool
) -> list[torch.Tensor]:
    leaves = _built(_checked_leaf, leaves)
    if not with_views:
        return draw(st.lists(leaves, min_size=1, max_size=4))
    bases = draw(st.lists(leaves, min_size=1, max_size=2))
    views = _views(draw, bases, 2)
    if views:  # a view of a view: torch gives it the root base as its _base
        views += _views(draw, views, 1)
    # Views of a tensor that is not in the pool, so never in the structure.
    hidden = _views(draw, [draw(leaves)], 1) if draw(st.booleans()) else []
    return bases + views + hidden


def _checked_leaf(leaf: Any) -> torch.Tensor:
    if not isinstance(leaf, torch.Tensor):
        msg = (
            f"nested(leaves=...): drew {leaf!r} ({with_article(type(leaf).__name__)}), not a "
            f"tensor: the leaves are the tensors the structure shares and views\nfix: "
            f"nested(strategies.tensors(devices=['cpu'])); plain values come among them "
            f"with plain_values=True (the default)"
        )
        raise TypeError(msg)
    return leaf


# On a line of its own: hypothesis reads a lambda's source to print what it made, and some
# releases cannot read one written inside a list.
_GENERATORS = st.integers(0, 3).map(lambda n: (i for i in range(n)))


def _plain_values() -> st.SearchStrategy[Any]:
    values: list[st.SearchStrategy[Any]] = [
        st.none(),
        st.booleans(),
        st.integers(-5, 5),
        st.floats(allow_nan=False, width=32),
        st.text(max_size=3),
        st.binary(max_size=3),
        st.sampled_from([torch.float32, torch.int64]),
        st.just(torch.device("cpu")),
        _built(torch.Size, st.lists(st.integers(0, 3), max_size=3)),
        st.integers(0, 5).map(range),
        st.lists(st.integers(), max_size=3).map(iter),
        _GENERATORS,
    ]
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        pass
    else:
        values.append(st.lists(st.integers(-3, 3), max_size=3).map(np.array))
    return st.one_of(values)


def _hashable_plain() -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=3))


def _packed(data: torch.Tensor) -> PackedSequence:
    # One sequence as long as the first dimension: the simplest valid batch_sizes.
    if data.layout != torch.strided or data.is_nested:  # no sequence of such steps
        data = torch.zeros(1, dtype=data.dtype, device=data.device)
    elif data.dim() == 0:  # copied, not viewed: with views=False, no tensor shares memory
        data = data.reshape(1).clone()
    if data.shape[0] == 0:
        data = torch.zeros(1, dtype=data.dtype, device=data.device)
    batch_sizes = torch.ones(data.shape[0], dtype=torch.int64)
    return PackedSequence(data, batch_sizes)


def _containers(
    child: st.SearchStrategy[Any],
    hashable: st.SearchStrategy[Any],
    tensor: st.SearchStrategy[torch.Tensor],
) -> st.SearchStrategy[Any]:
    keys = st.sampled_from(["a", "b", "mask", "ids", 0, 1])
    small = st.lists(child, min_size=2, max_size=5)
    mapping = st.dictionaries(keys, child, min_size=2, max_size=5)
    hashables = st.lists(hashable, max_size=3)
    return _weighted(
        [
            small,
            _built(tuple, small),
            _built(Pair, child, child),
            _built(lambda a, b: torch.return_types.max((a, b)), child, child),
            mapping,
            _built(collections.OrderedDict, mapping),
            _built(lambda m: collections.defaultdict(list, m), mapping),
            _built(_chained, mapping, st.integers(0, 5)),
            _built(types.MappingProxyType, mapping),
            _built(collections.deque, small, st.sampled_from([None, 5])),
            _built(set, hashables),
            _built(frozenset, hashables),
            _built(_box, child, child),
            _built(FrozenBox, child, child),
            _built(SlottedBox, child),
            _built(_packed, tensor),
            _built(collections.UserDict, mapping),
            _built(FrozenMap, mapping),
            _built(collections.UserList, small),
            _built(TaggedList, small),
            _built(TupleOf, small),
            _built(lambda empty: empty(), st.sampled_from([list, tuple, dict])),
        ]
    )


@st.composite
def _built(draw: st.DrawFn, make: Callable[..., Any], *parts: st.SearchStrategy[Any]) -> Any:
    """``make`` called on a value drawn from each of ``parts``. Drawn here, not with
    ``st.builds`` or ``.map``: for what those make, a failing example prints the call
    (``_packed(tensor(...))``, this module's private helpers); for what is made here, it
    prints the value's repr, which shrinks the same."""
    return make(*[draw(part) for part in parts])


def _weighted(choices: list[st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of ``choices``, each as often as it is listed."""
    return st.sampled_from(choices).flatmap(lambda chosen: chosen)


def _chained(mapping: dict[Any, Any], cut: int) -> collections.ChainMap[Any, Any]:
    """``mapping``'s entries in two maps of a ChainMap, split at ``cut``. No key is in
    both: a walk through the ChainMap's items, as a test's own walk is, then sees every
    entry (an entry behind another of its key is seen only through ``.maps``)."""
    items = list(mapping.items())
    return collections.ChainMap(dict(items[:cut]), dict(items[cut:]))


def _box(value: Any, late: Any) -> Box:
    box = Box(value)
    box.late = late
    return box


@st.composite
def _nested(
    draw: st.DrawFn,
    leaves: st.SearchStrategy[torch.Tensor],
    max_depth: int,
    plain_values: bool,
    views: bool,
) -> Any:
    pool = draw(_pool(leaves, views))
    tensor = st.sampled_from(pool)
    # Choices are weighted with sampled_from(...).flatmap: one_of would flatten the many
    # plain-value and container strategies into one uniform choice among them all.
    leaf = _weighted([tensor, tensor, _plain_values()]) if plain_values else tensor
    hashable = _weighted([tensor, _hashable_plain()]) if plain_values else tensor
    # The top is a container; below, a container twice as often as a leaf.
    node: st.SearchStrategy[Any] = leaf
    for level in range(max_depth):
        containers = _containers(node, hashable, tensor)
        node = (
            containers
            if level == max_depth - 1
            else _weighted([containers, containers, containers, leaf])
        )
    return draw(node)
