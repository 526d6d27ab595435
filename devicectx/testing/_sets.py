"""Outputs holding sets of tensors, paired for :func:`assert_device_agnostic`'s comparison.

A set iterates in the order of its members' hashes, ids for tensors: another order on
each device. Its members are numbered here as the members of the reference output's set
that they equal, so that the comparison's paths (``list(out['stats'])[2]``) name the same
member on every device. The same walk, without sets to pair, gives every other output's
tensors by path, the types of its other values, its numbers, its numpy arrays and the
values compared by equality (``torch.Size``, ``torch.dtype``) (:func:`walked`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from numbers import Complex
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from devicectx.move._containers import kind_for
from devicectx.move._kinds import OWN, TENSOR, Split
from devicectx.move._paths import MEMBER, join

_META = torch.device("meta")

Differs = Callable[[str, torch.Tensor, torch.Tensor], bool]
"""Whether the values of two tensors at a path differ (within the comparison's tolerance)."""

Holds = Mapping[torch.dtype, torch.dtype]
"""What a device holds of each dtype it cannot hold, where the inputs were cast to it
(``dtypes="device"``: float32 for float64 on MPS); empty elsewhere."""
_HOLDS_ALL: Holds = MappingProxyType({})


class Walked(NamedTuple):
    """One output, walked: its tensors by path, the type of every other value met, and
    among them by path: the numbers (an ``int``, a ``float`` from ``loss.item()``, numpy's
    scalars, a numpy bool), the numpy arrays, the values compared by equality (a
    ``torch.Size``, a ``torch.dtype``), and the iterators (a generator), which no walk can
    look into without running them."""

    tensors: dict[str, torch.Tensor]
    types: dict[str, type]
    numbers: dict[str, Complex]
    arrays: dict[str, Any]
    equal: dict[str, object]
    iterators: dict[str, type]

    @classmethod
    def empty(cls) -> Walked:
        return cls({}, {}, {}, {}, {}, {})


def walked(output: object) -> Walked:
    """``output``'s tensors by path, as :func:`iter_tensors` gives them, with the types."""
    return Pairing(_never, False).leaves(output, None, "out")


def paired(
    outputs: list[tuple[torch.device, object]],
    against: int,
    differs: Differs,
    holds: Sequence[Holds],
) -> list[Walked]:
    """Each output walked, as :func:`walked` does, except that in the outputs after
    ``outputs[against]`` each set member is numbered as the member of ``outputs[against]``'s
    set that it equals. ``holds`` is each output's device's, for :func:`same_dtype`."""
    reference_device, reference = outputs[against]
    paired: list[Walked] = []
    for index, (device, output) in enumerate(outputs):
        values = _META not in (device, reference_device)
        pairing = Pairing(differs, values, holds[index], holds[against])
        # The reference, and the outputs not compared with it, keep iteration order.
        paired.append(pairing.leaves(output, reference if index > against else None, "out"))
    return paired


def same_dtype(
    actual: torch.dtype, expected: torch.dtype, actual_holds: Holds, expected_holds: Holds
) -> bool:
    """Whether ``actual`` is ``expected``, or each is what the other's device holds of the
    other (float32 on a device that holds no float64, for float64 on the CPU)."""
    return actual == expected or (
        actual_holds.get(expected, expected) == expected_holds.get(actual, actual)
    )


class Shape(NamedTuple):
    """A tensor's shape as the comparison compares it. A nested tensor's ragged dimension is
    None in ``dims``, not its symbol (``j1``: a new one for each tensor made, so on each
    run), and its components' shapes are compared instead, where they can be read: not on
    meta, which holds no lengths, nor on a device that cannot copy them to the CPU."""

    dims: tuple[int | None, ...]
    nested: bool = False
    components: tuple[tuple[int, ...], ...] | None = None

    def __str__(self) -> str:
        """``(2, 3)``, as a tuple prints; ``(2, j, 3)``, j for a ragged dimension."""
        shown = ["j" if dim is None else str(dim) for dim in self.dims]
        return f"({shown[0]},)" if len(shown) == 1 else f"({', '.join(shown)})"

    def versus(self, expected: Shape) -> str:
        """``shape (3,), expected (2,)``; ``nested shape (2, j), expected shape (2, 2)``."""
        shape = f"{'nested ' * self.nested}shape {self}"
        if self.nested == expected.nested:
            return f"{shape}, expected {expected}"
        return f"{shape}, expected {'nested ' * expected.nested}shape {expected}"


def shape_of(tensor: torch.Tensor) -> Shape:
    """``tensor``'s :class:`Shape`: a nested tensor's ragged dimensions left out, and its
    components' shapes, from the lengths of a jagged one, by ``unbind()`` of one of the
    strided layout (which has no shape of its own)."""
    if not tensor.is_nested:
        return Shape(tuple(tensor.shape))
    if tensor.layout == torch.jagged:
        dims = tuple(dim if isinstance(dim, int) else None for dim in tensor.shape)
        return Shape(dims, True, _jagged_components(tensor, dims))
    regular = tuple(_regular_size(tensor, dim) for dim in range(tensor.dim()))
    try:
        components = tuple(tuple(part.shape) for part in tensor.unbind())
    except RuntimeError:  # a device without nested kernels (the emulated one)
        components = None
    return Shape(regular, True, components)


def _jagged_components(
    tensor: torch.Tensor, dims: tuple[int | None, ...]
) -> tuple[tuple[int, ...], ...] | None:
    """The shapes of a jagged tensor's components, from their lengths on the CPU; None on
    meta, which holds none, or where the device cannot copy them."""
    if tensor.is_meta:
        return None
    jagged: Any = tensor  # offsets() and lengths() are missing from torch's type stubs
    lengths = jagged.lengths()  # where the components leave gaps in values(); else None
    lengths = jagged.offsets().diff() if lengths is None else lengths
    try:
        counts = lengths.to("cpu").tolist()
    except RuntimeError:
        return None
    return tuple(tuple(count if dim is None else dim for dim in dims[1:]) for count in counts)


def _regular_size(tensor: torch.Tensor, dim: int) -> int | None:
    """The size of a strided-layout nested tensor's dimension ``dim``, None where its
    components differ in it."""
    try:
        return tensor.size(dim)
    except RuntimeError:  # "Given dimension 1 is irregular and does not have a size."
        return None


def same_shape(actual: Shape, expected: Shape) -> bool:
    """Whether two shapes agree: their dimensions, and their components' where both are
    known."""
    return (actual.nested, actual.dims) == (expected.nested, expected.dims) and (
        actual.components is None
        or expected.components is None
        or actual.components == expected.components
    )


def is_container(tp: type) -> bool:
    """Whether the comparison looks into values of type ``tp`` (and compares their type)."""
    kind = kind_for(tp)
    return kind.role != TENSOR and kind.split is not None


def _never(path: str, actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return False


class Pairing:
    """A walk of an output beside the reference output that numbers each member of a set
    as the member of the reference's set, at the same path, that it equals: the same
    containers, tensors, dtypes and shapes, and values within tolerance where both devices
    hold values.

    Members are paired by a largest matching, not each with the first it equals: within
    a tolerance, "equals" is no equivalence (a member may equal two of the reference's,
    one of which equals nothing else). A member that equals none takes a number left over,
    so that its differences are reported at that path. Without a reference (the
    reference itself), members keep their iteration order, as in :func:`iter_tensors`.
    """

    def __init__(
        self,
        differs: Differs,
        values: bool,
        holds: Holds = _HOLDS_ALL,
        reference_holds: Holds = _HOLDS_ALL,
    ) -> None:
        self.differs = differs
        self.values = values
        self.holds = holds
        self.reference_holds = reference_holds

    def leaves(self, obj: object, reference: object, path: str) -> Walked:
        """The tensors of ``obj`` by path, and the types of its other values; a container
        met again is not looked into again."""
        walked = Walked.empty()
        self._walk(obj, reference, path, walked, set())
        return walked

    def _walk(
        self,
        obj: Any,
        reference: Any,
        path: str,
        found: Walked,
        seen: set[int],
    ) -> None:
        kind = kind_for(type(obj))
        if kind.role == TENSOR:
            found.tensors[path] = obj
            return
        found.types[path] = type(obj)
        if kind.split is None:  # a module or a leaf
            if isinstance(obj, Complex):
                found.numbers[path] = obj
            elif obj is not None:
                _leaf(obj, path, found)
            return
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if kind.role == OWN:
            _batch_facts(obj, path, found)
        keys, children = kind.split(obj)
        # The reference's container at the same path: where it is of another type, that
        # is reported as missing and unexpected tensors; sets below it keep their order.
        if reference is not None and type(reference) is not type(obj):
            reference = None
        if kind.style == MEMBER and reference is not None:
            references = list(kind.split(reference)[1])
            numbers = self._numbers(children, references, path, seen)
            for number, child in sorted(zip(numbers, children, strict=True), key=_number):
                partner = references[number] if number < len(references) else None
                self._walk(child, partner, join(path, MEMBER, number), found, seen)
            return
        partners = _partners(keys, len(children), reference, kind.split)
        for position, child in enumerate(children):
            key = position if keys is None else keys[position]
            self._walk(child, partners[position], join(path, kind.style, key), found, seen)

    def _numbers(
        self, members: Sequence[Any], references: list[Any], path: str, seen: set[int]
    ) -> list[int]:
        """Each member's number: that of the reference's member it is paired with."""
        # A trial walk sees a copy of `seen`: what it meets is met for real afterwards.
        expected = [
            self._trial(reference, None, join(path, MEMBER, number), set())
            for number, reference in enumerate(references)
        ]
        tried: dict[tuple[int, int], bool] = {}

        def equal(member: int, number: int) -> bool:
            if (member, number) not in tried:
                at = join(path, MEMBER, number)
                actual = self._trial(members[member], references[number], at, seen)
                tried[member, number] = self._same(actual, expected[number])
            return tried[member, number]

        paired = _largest_pairing(len(members), len(references), equal)
        taken = set(paired.values())
        left = (n for n in range(len(references) + len(members)) if n not in taken)
        return [paired[m] if m in paired else next(left) for m in range(len(members))]

    def _trial(self, obj: object, reference: object, path: str, seen: set[int]) -> Walked:
        found = Walked.empty()
        self._walk(obj, reference, path, found, set(seen))
        return found

    def _same(self, walked: Walked, expected_walked: Walked) -> bool:
        actual, expected = walked.tensors, expected_walked.tensors
        if actual.keys() != expected.keys() or _containers(walked) != _containers(expected_walked):
            return False
        for path, want in expected.items():
            got = actual[path]
            if not same_shape(shape_of(got), shape_of(want)):
                return False
            if not same_dtype(got.dtype, want.dtype, self.holds, self.reference_holds):
                return False
            if not self.values or got.is_meta or want.is_meta:
                continue
            if self.differs(path, got, want):
                return False
        return True


# What a batch of tensors with its own .to says of its dimensions beside its entries (a
# TensorDict's, a tensorclass's): a batch that lost its batch dimension on one device has
# the same entries, and another len() and indexing.
_BATCH_FACTS = ("batch_size", "names")


def _batch_facts(obj: object, path: str, found: Walked) -> None:
    """File ``obj``'s ``batch_size`` (a ``torch.Size``) and ``names`` (a list) where the
    comparison compares values by equality."""
    for name in _BATCH_FACTS:
        try:
            value = getattr(obj, name, None)
        except Exception:  # a property that cannot answer here: nothing to compare
            continue
        if isinstance(value, torch.Size) or (name == "names" and isinstance(value, list)):
            found.equal[f"{path}.{name}"] = value


def _leaf(obj: object, path: str, found: Walked) -> None:
    """File a leaf that is no Python number where the comparison looks for it."""
    if isinstance(obj, (torch.Size, torch.dtype)):
        found.equal[path] = obj
        return
    numpy = sys.modules.get("numpy")  # an output holds no numpy object unless it is loaded
    if numpy is not None:
        if isinstance(obj, numpy.ndarray):
            found.arrays[path] = obj
            return
        if isinstance(obj, numpy.bool_):  # numpy registers its other scalars as numbers
            found.numbers[path] = obj
            return
    if isinstance(obj, Iterator):
        found.iterators[path] = type(obj)


def compared_leaf(tp: type) -> bool:
    """Whether the comparison compares values of type ``tp`` that are no containers: the
    numbers, numpy arrays, ``torch.Size`` and ``torch.dtype`` (so a value of another type
    in their place is a difference)."""
    if issubclass(tp, (Complex, torch.Size, torch.dtype)):
        return True
    numpy = sys.modules.get("numpy")
    return numpy is not None and issubclass(tp, (numpy.ndarray, numpy.bool_))


def _containers(walked: Walked) -> dict[str, type]:
    return {path: tp for path, tp in walked.types.items() if is_container(tp)}


def _partners(keys: Any, count: int, reference: Any, split: Split) -> list[Any]:
    """For each of a container's ``count`` children, the child of ``reference`` (of the
    same type) at the same key, or position; None where there is none."""
    if reference is None:
        return [None] * count
    try:
        reference_keys, children = split(reference)
        if keys is None or reference_keys is None:
            return [children[i] if i < len(children) else None for i in range(count)]
        by_key = dict(zip(reference_keys, children, strict=True))
        return [by_key.get(key) for key in keys]
    except Exception:  # an unhashable key, or one that compares elementwise (a tensor)
        return [None] * count


def _largest_pairing(
    count: int, partners: int, equal: Callable[[int, int], bool]
) -> dict[int, int]:
    """A largest pairing of ``count`` members with ``partners`` others, each member with
    one it ``equal``s, as ``{member: partner}``: each takes the first free one it equals,
    else one taken from a member that can move to another (Kuhn's augmenting paths)."""
    owner: dict[int, int] = {}

    def claim(member: int, tried: set[int]) -> bool:
        for partner in range(partners):
            if partner not in tried and equal(member, partner):
                tried.add(partner)
                if partner not in owner or claim(owner[partner], tried):
                    owner[partner] = member
                    return True
        return False

    for member in range(count):
        free = (p for p in range(partners) if p not in owner and equal(member, p))
        partner = next(free, None)
        if partner is None:
            claim(member, set())
        else:
            owner[partner] = member
    return {member: partner for partner, member in owner.items()}


def _number(item: tuple[int, object]) -> int:
    return item[0]
