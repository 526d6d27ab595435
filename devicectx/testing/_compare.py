"""What ``assert_device_agnostic`` compares between the outputs of its runs: where the
tensors are, the structure (container types, dtypes, shapes, layouts, autograd, which
outputs share memory) and the values, within tolerances; one failure message for all."""

from __future__ import annotations

import cmath
import math
import sys
from collections.abc import Callable, Mapping
from numbers import Complex, Integral
from typing import Any, NamedTuple

import torch
from torch.masked import MaskedTensor as _MaskedTensor

from devicectx._errors import with_article
from devicectx._torch.tensors import base_of
from devicectx.devices._capabilities import CAPABILITIES, nearest_dtype
from devicectx.move._move import iter_tensors
from devicectx.testing._sets import (
    Holds,
    Shape,
    Walked,
    compared_leaf,
    is_container,
    paired,
    same_dtype,
    same_shape,
    shape_of,
    walked,
)

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

# The tolerances a values fix may suggest, the smallest that covers every difference:
# float sums in another order, fused kernels and TF32 stay within the last; a difference
# beyond it is no rounding (random numbers drawn, or another computation).
_LOOSER = ((1e-4, 1e-5), (1e-3, 1e-4), (1e-2, 1e-3))


class Run(NamedTuple):
    """What the comparison knows of one device's run besides its output."""

    device: torch.device
    holds: Holds
    inputs: frozenset[int]
    """The ids of the memory of its input tensors (each one's base, or itself)."""


def memory_of(call: tuple[object, ...]) -> frozenset[int]:
    return frozenset(id(_root(t)) for _, t in iter_tensors(call, modules=True))


class Problem(NamedTuple):
    """One difference: its kind (a key of ``_FIXES``), its output path, its message line;
    for values that differ, the smallest of ``_LOOSER`` (with the tolerances in use) that
    covers them, None where none does."""

    kind: str
    path: str
    line: str
    covered_by: tuple[float, float] | None = None


class Hints(NamedTuple):
    """What the fixes name besides ``fn``, read only when the check fails."""

    decorate: str | None
    """What to decorate with ``@device_agnostic``: ``fn``'s name, ``Model.forward``; None
    where it is decorated already."""
    training: Callable[[], str | None]
    """The fix for a module in training mode that holds dropout, if there is one."""
    call: str = "fn"
    """How a fix's code calls ``fn``: its name where that is a function's, else a
    placeholder (a lambda or a module has no name to call it by)."""
    hidden: Callable[[], str | None] = lambda: None
    """The fix where the arguments' tensors are all where the move cannot see them (an
    attrs class's), which is why no tensor argument reached a device; None: none is."""


def compare(
    name: str,
    outputs: list[tuple[torch.device, object]],
    tolerances: tuple[float, float] | None,
    runs: list[Run],
    hints: Hints | None = None,
    fixes: Mapping[str, str] | None = None,
) -> str | None:
    """The failure message for ``outputs`` (one per device, the first the reference), or None.

    ``fixes`` replaces the fix lines of some kinds of problem (keys of ``_FIXES``): those
    of the outputs speak of what ``fn`` returns.

    Raises:
        TypeError: an output holds an iterator (a generator), which cannot be compared
            without running it.
    """
    walks = [walked(output) for _, output in outputs]
    for walk in walks:
        if walk.iterators:
            call = "fn" if hints is None else hints.call
            raise TypeError(_iterator_message(name, walk.iterators, call))
    holds = [run.holds for run in runs]
    # Values are compared with the first device that has any: meta has none.
    value_index = next((i for i, (d, _) in enumerate(outputs) if d != _META), None)
    value_walks = walks
    if any(path.startswith("list(") for walk in walks for path in (*walk.tensors, *walk.types)):
        # A path through a set member starts list(...)[i], i the member's place in
        # iteration order, which follows hashes (ids, for tensors): another order in each
        # output. Members are numbered instead as the reference's members they equal.
        def differs(path: str, actual: torch.Tensor, expected: torch.Tensor) -> bool:
            # Values that cannot be read tell no members apart: reported once paired.
            found = _tensor_value_problems(path, actual, expected, tolerances)
            return any(problem.kind != "unreadable" for problem in found)

        walks = paired(outputs, 0, differs, holds)
        if value_index is not None and value_index > 0:
            value_walks = paired(outputs, value_index, differs, holds)
        else:
            value_walks = walks
    sections: list[str] = []
    found: dict[str, str] = {}  # each kind of problem met, with its first line's path
    away: torch.device | None = None  # where the first tensor off its device is
    over_numpy: torch.dtype | None = None  # the dtype of the first over numpy's memory
    covers: list[tuple[float, float] | None] = []  # each values problem's
    for index, (device, _) in enumerate(outputs):
        problems = _placement_problems(walks[index].tensors, device)
        if index > 0:
            problems += _structure_problems(walks[0], walks[index], runs[0], runs[index])
        if value_index is not None and index > value_index and device != _META:
            problems += _value_problems(
                value_walks[value_index].tensors,
                value_walks[index].tensors,
                tolerances,
                holds[index],
                holds[value_index],
            )
            problems += _number_problems(
                value_walks[value_index].numbers, value_walks[index].numbers, tolerances
            )
            problems += _array_value_problems(
                value_walks[value_index].arrays, value_walks[index].arrays, tolerances
            )
        if problems:
            for problem in problems:
                found.setdefault(problem.kind, problem.path)
                if problem.kind == "device" and away is None:
                    away = walks[index].tensors[problem.path].device
                if problem.kind == "numpy" and over_numpy is None:
                    over_numpy = walks[index].tensors[problem.path].dtype
                if problem.kind == "values":
                    covers.append(problem.covered_by)
            shown = [problem.line for problem in problems[:_MAX_PROBLEMS]]
            if len(problems) > len(shown):
                shown.append(f"... and {len(problems) - len(shown)} more")
            compared = [str(outputs[i][0]) for i in sorted({0, value_index or 0}) if i < index]
            against = f", compared with {' and '.join(compared)}" if compared else ""
            body = "\n".join(f"    {problem}" for problem in shown)
            sections.append(f"  on {device}{against}:\n{body}")
    if not sections:
        return None
    ran = ", ".join(str(device) for device, _ in outputs)
    verdict = "could not be checked" if found.keys() == {"unreadable"} else "is not device-agnostic"
    lines = [f"{name} {verdict} (ran on {ran}):", *sections]
    hints = hints or Hints(name, _no_training)
    for kind, fix in {**_FIXES, **(fixes or {})}.items():
        if kind not in found:
            continue
        if kind == "values":
            lines.append(_values_fix(name, covers, hints))
            continue
        inputs = any(run.inputs for run in runs)
        if kind == "device":
            fix = _device_fix(inputs, hints.decorate, away or torch.get_default_device())
            hidden = None if inputs else hints.hidden()
            if hidden is not None:
                fix = hidden.replace("{", "{{").replace("}", "}}")
        elif kind == "numpy":
            fix = _numpy_fix(inputs, over_numpy, [device for device, _ in outputs])
        lines.append(fix.format(name=name, path=found[kind]))
    return "\n".join(lines)


def _no_training() -> None:
    return None


def _iterator_message(name: str, iterators: dict[str, type], call: str) -> str:
    path, tp = next(iter(iterators.items()))
    # Only an iterator that is the whole output can be listed around the call: list() of a
    # dict that holds one would compare the dict's keys, and pass.
    compare_one = (
        f", or compare one: assert_device_agnostic(lambda *a: list({call}(*a)), ...)"
        if path == "out"
        else f" (list(...) where {name} builds {path})"
    )
    return (
        f"assert_device_agnostic({name}): {path} is {_a(tp)}, which cannot be compared "
        f"without running it (it may never end, or be meant to run once)\n"
        f"fix: return a list in its place{compare_one}"
    )


def _values_fix(name: str, covers: list[tuple[float, float] | None], hints: Hints) -> str:
    """A fix for values that differ: the tolerances that allow them where they are float
    rounding, never those in use; else where else such a difference comes from."""
    if all(cover is not None for cover in covers):
        rtol = max(cover[0] for cover in covers if cover is not None)
        atol = max(cover[1] for cover in covers if cover is not None)
        return (
            "fix: if the difference is expected (float sums in another order, TF32), allow "
            f"it: assert_device_agnostic({name}, ..., rtol={_short(rtol)}, atol={_short(atol)})"
        )
    training = hints.training()
    if training is not None:
        return training
    rtol, atol = _LOOSER[-1]
    return (
        f"fix: no float rounding is this large (beyond rtol={_short(rtol)}, "
        f"atol={_short(atol)}): {name} must be deterministic (dropout in training mode: "
        "model.eval(); torch.rand and the like draw other numbers on each device, whatever "
        "the seed), else it computes something else there: a bug"
    )


def _short(value: float) -> str:
    """``1e-4`` for 0.0001, as a fix is written (``f"{0.0001}"`` is ``0.0001``)."""
    if value == 0:
        return "0"
    mantissa, _, exponent = f"{value:.1e}".partition("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


_NO_INPUT_FIX = (
    "fix: {name} got no tensor argument, so nothing it is given is on each run's device: "
    "give it one whose device it takes, assert_device_agnostic(lambda like, *a: "
    "{name}(*a, device=like.device), torch.empty(0), ...) with a device= parameter in "
    "{name}; or run it in a block on that device: def run(like, *a): with "
    "devicectx.on_device(like.device): return {name}(*a)"
)

_NUMPY_MEMORY = (
    "fix: {{path}} is made over a numpy array's memory (torch.from_numpy, torch.as_tensor of "
    "an array), which neither on_device nor @device_agnostic reaches"
)
_NUMPY_FIX = _NUMPY_MEMORY + ": make it on the input's device{held}, {as_tensor}"
_NUMPY_NO_INPUT_FIX = _NUMPY_MEMORY + (
    ", and {{name}} got no tensor argument: give it a device= parameter and make it "
    "there{held}, {as_tensor}, then assert_device_agnostic(lambda like, *a: "
    "{{name}}(*a, device=like.device), torch.empty(0), ...)"
)


def _numpy_fix(inputs: bool, dtype: torch.dtype | None, devices: list[torch.device]) -> str:
    """The fix for an output over numpy's memory, a format of ``name`` and ``path``:
    ``torch.as_tensor(array, device=...)``, with a ``dtype=`` every device holds where one
    of them cannot hold the array's (``as_tensor`` of a float64 array fails on MPS)."""
    device = "x.device" if inputs else "device"
    as_tensor, held = f"torch.as_tensor(array, device={device})", ""
    lacking = [] if dtype is None else [d for d in devices if not CAPABILITIES.holds(d, dtype)]
    nearest = nearest_dtype(lacking[0], dtype) if lacking and dtype is not None else None
    if nearest is not None and all(CAPABILITIES.holds(d, nearest) for d in devices):
        names = ", ".join(str(d) for d in lacking)
        holds = "holds" if len(lacking) == 1 else "hold"
        held = f", in a dtype every device holds ({names} {holds} no {dtype})"
        as_tensor = f"torch.as_tensor(array, dtype={nearest}, device={device})"
    template = _NUMPY_FIX if inputs else _NUMPY_NO_INPUT_FIX
    return template.format(held=held, as_tensor=as_tensor)


def _device_fix(inputs: bool, decorate: str | None, away: torch.device) -> str:
    """The fix for outputs off the device (the first on ``away``), a format of ``name``:
    made on it (from an input's device, or one given), or, where ``fn`` is not decorated
    yet, the decorator."""
    if not inputs:
        return _NO_INPUT_FIX
    fix = (
        "fix: create new tensors on the input's device, torch.zeros(n, device=x.device), and "
        f"move none to {away} by name ({moves_to(away)})"
    )
    if decorate is None:
        return fix
    escaped = decorate.replace("{", "{{").replace("}", "}}")
    return (
        f"{fix}, or decorate {escaped} with @devicectx.device_agnostic so that those made "
        "without device= land there"
    )


_FIXES = {
    "numpy": "",  # written by _NUMPY_FIX or _NUMPY_NO_INPUT_FIX
    "device": "",  # written by _device_fix
    "structure": (
        "fix: make {name} return the same containers and tensors, dtypes, shapes and layouts "
        "on every device"
    ),
    "grad": (
        "fix: make {name} record autograd alike on every device: the same ops, no .detach() "
        "or torch.no_grad() on one device only"
    ),
    "aliasing": (
        "fix: where {name} means a copy, make one on every device: x.clone() (reshape() and "
        "contiguous() return their input, or a view of it, where the strides allow)"
    ),
    "values": "",  # written by _values_fix, after the differences
    "exact": (
        "fix: integer and bool values are compared exactly, whatever rtol and atol; where "
        "{path} may differ, make {name} return it as a float and allow the difference: "
        "assert_device_agnostic({name}, ..., rtol=0, atol=1)"
    ),
    "unreadable": (
        "fix: compare {path} on a device that can copy it to the CPU (the emulated "
        "accelerator has no kernels for sparse compressed or strided nested tensors), or "
        "make {name} return it in a layout that device copies: dense, or a nested tensor "
        "of layout=torch.jagged"
    ),
}


def moves_to(device: torch.device) -> str:
    """How code moves a tensor to ``device`` by name."""
    by_name = f".to({str(device)!r})"
    return f".cpu(), {by_name}" if device.type == "cpu" else by_name


def _placement_problems(leaves: dict[str, torch.Tensor], device: torch.device) -> list[Problem]:
    return [
        Problem(_misplaced(t), path, f"{path}: on {t.device}, expected {device}")
        for path, t in leaves.items()
        if t.device != device
    ]


def _misplaced(tensor: torch.Tensor) -> str:
    """A misplaced tensor's kind of problem: ``"numpy"`` for one over memory torch did
    not allocate (torch.from_numpy, torch.frombuffer: its storage cannot grow), which no
    default device reaches; else ``"device"``."""
    if tensor.layout != torch.strided or not tensor.is_cpu:
        return "device"
    try:
        resizable = tensor.untyped_storage().resizable()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return "device"
    return "device" if resizable else "numpy"


def _structure_problems(
    reference: Walked, output: Walked, reference_run: Run, run: Run
) -> list[Problem]:
    problems: list[Problem] = []
    for path, expected_type in reference.types.items():
        actual_type = output.types.get(path)
        # Other values' types are compared where a container, a number or another value
        # compared stands (a str may name the device it ran on; so may a torch.device).
        if actual_type is None or actual_type is expected_type:
            continue
        if any(is_container(tp) or compared_leaf(tp) for tp in (actual_type, expected_type)):
            line = f"{path}: {_a(actual_type)}, expected {_a(expected_type)}"
            problems.append(Problem("structure", path, line))
    problems += _equal_problems(reference.equal, output.equal, run.holds, reference_run.holds)
    problems += _array_problems(reference.arrays, output.arrays, run.holds, reference_run.holds)
    reference_leaves, leaves = reference.tensors, output.tensors
    problems += [
        Problem("structure", path, f"{path}: missing")
        for path in reference_leaves
        if path not in leaves
    ]
    problems += [
        Problem("structure", path, f"{path}: unexpected tensor")
        for path in leaves
        if path not in reference_leaves
    ]
    for path, expected in reference_leaves.items():
        actual = leaves.get(path)
        if actual is None:
            continue
        # A subclass lost (a mask, a scale, a tag); a nested tensor's is told by its shape.
        if type(actual) is not type(expected) and not (actual.is_nested or expected.is_nested):
            line = f"{path}: {_a(type(actual))}, expected {_a(type(expected))}"
            problems.append(Problem("structure", path, line))
        if not same_dtype(actual.dtype, expected.dtype, run.holds, reference_run.holds):
            problems.append(
                Problem(
                    "structure", path, f"{path}: dtype {actual.dtype}, expected {expected.dtype}"
                )
            )
        problems += _shape_problems(path, shape_of(actual), shape_of(expected))
        if actual.layout != expected.layout:
            problems.append(
                Problem(
                    "structure", path, f"{path}: layout {actual.layout}, expected {expected.layout}"
                )
            )
        if actual.requires_grad != expected.requires_grad:
            grad = f"requires_grad={actual.requires_grad}, expected {expected.requires_grad}"
            problems.append(Problem("grad", path, f"{path}: {grad}"))
    return problems + _aliasing_problems(reference_leaves, leaves, reference_run, run)


def _shape_problems(path: str, shape: Shape, expected: Shape) -> list[Problem]:
    """Shapes that differ; a nested tensor's components that differ, each by its path."""
    if (shape.nested, shape.dims) != (expected.nested, expected.dims):
        line = f"{path}: {shape.versus(expected)}"
        return [Problem("structure", path, line)]
    if same_shape(shape, expected) or shape.components is None or expected.components is None:
        return []
    problems: list[Problem] = []
    # As many components: their count is the first dimension.
    pairs = zip(shape.components, expected.components, strict=True)
    for index, (got, want) in enumerate(pairs):
        if got != want:
            at = _component(path, index)
            line = f"{at}: {Shape(got).versus(Shape(want))}"
            problems.append(Problem("structure", at, line))
    return problems


def _component(path: str, index: int) -> str:
    """The path of component ``index`` of the nested tensor at ``path``."""
    return f"{path}.unbind()[{index}]"


def _equal_problems(
    expected_values: dict[str, object],
    values: dict[str, object],
    holds: Holds,
    expected_holds: Holds,
) -> list[Problem]:
    """``torch.Size`` and ``torch.dtype`` values that differ (a dtype as the devices hold
    it, as a tensor's). Set members are left out: their paths follow their order."""
    problems: list[Problem] = []
    for path, expected in expected_values.items():
        actual = values.get(path)
        if actual is None or type(actual) is not type(expected) or "list(" in path:
            continue  # another type there: reported as a structure problem
        if isinstance(actual, torch.dtype) and isinstance(expected, torch.dtype):
            if same_dtype(actual, expected, holds, expected_holds):
                continue
        elif actual == expected:
            continue
        problems.append(Problem("structure", path, f"{path}: {actual}, expected {expected}"))
    return problems


def _array_problems(
    expected_arrays: dict[str, Any], arrays: dict[str, Any], holds: Holds, expected_holds: Holds
) -> list[Problem]:
    """Numpy arrays of another dtype or shape than the reference's (their dtypes as the
    devices hold them, as tensors'). Their values are compared with the tensors'."""
    problems: list[Problem] = []
    for path, expected in expected_arrays.items():
        actual = arrays.get(path)
        if actual is None:
            continue  # another type there: reported as a structure problem
        if actual.dtype != expected.dtype:
            dtype, expected_dtype = _torch_dtype(actual), _torch_dtype(expected)
            if (
                dtype is None
                or expected_dtype is None
                or not same_dtype(dtype, expected_dtype, holds, expected_holds)
            ):
                line = f"{path}: dtype {actual.dtype}, expected {expected.dtype}"
                problems.append(Problem("structure", path, line))
        if actual.shape != expected.shape:
            line = f"{path}: shape {actual.shape}, expected {expected.shape}"
            problems.append(Problem("structure", path, line))
    return problems


def _torch_dtype(array: Any) -> torch.dtype | None:
    """The dtype of the tensor ``torch.from_numpy`` makes of ``array``'s dtype, if any."""
    numpy = sys.modules["numpy"]
    try:
        return torch.from_numpy(numpy.empty(0, dtype=array.dtype)).dtype
    except (TypeError, ValueError):  # object, str, datetime: no tensor of them
        return None


def _as_tensor(array: Any) -> torch.Tensor | None:
    """``array`` as a tensor on the CPU, for its values; None where torch holds none of
    its dtype (object, str)."""
    numpy = sys.modules["numpy"]
    try:  # from_numpy refuses negative strides: a contiguous copy has none
        return torch.from_numpy(numpy.ascontiguousarray(array))
    except (TypeError, ValueError):
        return None


def _array_value_problems(
    expected_arrays: dict[str, Any],
    arrays: dict[str, Any],
    tolerances: tuple[float, float] | None,
) -> list[Problem]:
    """Numpy arrays' values, compared as tensors' are: floating point within tolerances,
    integers and bools exactly; not those of dtypes torch has no tensor of (str, object),
    which may name the device, as a str may."""
    problems: list[Problem] = []
    for path, expected in expected_arrays.items():
        actual = arrays.get(path)
        if actual is None or actual.shape != expected.shape:
            continue  # reported as a structure problem
        a, e = _as_tensor(actual), _as_tensor(expected)
        if a is None or e is None:  # str, object: like a str, may name the device
            continue
        if a.dtype.is_complex != e.dtype.is_complex:
            continue  # reported as a structure problem
        problems += _values_differ(path, a, e, tolerances)
    return problems


def _a(tp: type) -> str:
    if tp is type(None):
        return "None"
    return with_article(tp.__qualname__)


def _aliasing_problems(
    reference: dict[str, torch.Tensor],
    leaves: dict[str, torch.Tensor],
    reference_run: Run,
    run: Run,
) -> list[Problem]:
    """Where the output's tensors are one, or share memory, unlike the reference's: a
    caller's in-place write to one then changes the other on some devices only."""
    # Left out: a tensor on the wrong device (reported as such: its .to() made the
    # difference), and set members, which may pair with any equal member (on meta, any
    # of the same dtype and shape).
    paths = [
        path
        for path, expected in reference.items()
        if path in leaves
        and expected.device == reference_run.device
        and leaves[path].device == run.device
        and "list(" not in path
    ]
    expected = _aliases(reference, paths, reference_run.inputs)
    actual = _aliases(leaves, paths, run.inputs)
    return [
        Problem("aliasing", path, f"{path}: {_said(got)}, expected {_said(want)}")
        for path, want, got in zip(paths, expected, actual, strict=True)
        if want != got
    ]


def _aliases(
    leaves: dict[str, torch.Tensor], paths: list[str], inputs: frozenset[int]
) -> list[tuple[str, str] | None]:
    """For each path, the first path before it that holds the same tensor, else the first
    that shares its memory (a view of one tensor), else None. The memory of the inputs is
    left out: the move to a device copies some of their views apart (an empty one, slices
    that overlap without their base), so fn is not answerable for what they share."""
    same: dict[int, str] = {}
    shared: dict[int, str] = {}
    found: list[tuple[str, str] | None] = []
    for path in paths:
        tensor = leaves[path]
        root = _root(tensor)
        if id(tensor) in same:
            found.append(("same", same[id(tensor)]))
        elif id(root) in shared:
            found.append(("view", shared[id(root)]))
        else:
            found.append(None)
        same.setdefault(id(tensor), path)
        if id(root) not in inputs:
            shared.setdefault(id(root), path)
    return found


def _root(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory ``tensor`` is a view of (torch keeps the first base), or
    ``tensor`` itself; tensors sharing memory otherwise (``x.detach()``) are not told."""
    try:
        base = base_of(tensor)
    except Exception:  # a tensor subclass without _base
        return tensor
    return tensor if base is None else base


def _said(alias: tuple[str, str] | None) -> str:
    if alias is None:
        return "a tensor with its own memory"
    kind, path = alias
    return f"the same tensor as {path}" if kind == "same" else f"a view sharing memory with {path}"


def _value_problems(
    expected_leaves: dict[str, torch.Tensor],
    leaves: dict[str, torch.Tensor],
    tolerances: tuple[float, float] | None,
    holds: Holds,
    expected_holds: Holds,
) -> list[Problem]:
    problems: list[Problem] = []
    for path, actual in leaves.items():
        expected = expected_leaves.get(path)
        if (
            expected is None
            or expected.is_nested != actual.is_nested
            or not same_shape(shape_of(actual), shape_of(expected))
            or not same_dtype(actual.dtype, expected.dtype, holds, expected_holds)
        ):
            continue  # reported as a structure problem
        problems += _tensor_value_problems(path, actual, expected, tolerances)
    return problems


def _tensor_value_problems(
    path: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    tolerances: tuple[float, float] | None,
) -> list[Problem]:
    """The problems of two tensors' values (of one shape); a nested tensor's component by
    component, each named by its path; a quantized tensor's values as they read
    (dequantized); a ``MaskedTensor``'s mask, then its values under the mask."""
    if actual.is_quantized or expected.is_quantized:
        return _values_differ(path, _dequantized(actual), _dequantized(expected), tolerances)
    if isinstance(actual, _MaskedTensor) and isinstance(expected, _MaskedTensor):
        return _masked_problems(path, actual, expected, tolerances)
    if not actual.is_nested:
        return _values_differ(path, actual, expected, tolerances)
    try:
        pairs = zip(_components(actual), _components(expected), strict=True)
    except Unreadable as unreadable:
        return [unreadable.problem(path)]
    problems: list[Problem] = []
    for index, (part, expected_part) in enumerate(pairs):  # as many: the shapes agree
        problems += _values_differ(_component(path, index), part, expected_part, tolerances)
    return problems


def _masked_problems(
    path: str,
    actual: _MaskedTensor,
    expected: _MaskedTensor,
    tolerances: tuple[float, float] | None,
) -> list[Problem]:
    """A ``MaskedTensor``'s mask, compared exactly, then its values where the mask is set
    (what lies under no mask is no output)."""
    mask: torch.Tensor = actual.get_mask()  # type: ignore[no-untyped-call]
    expected_mask: torch.Tensor = expected.get_mask()  # type: ignore[no-untyped-call]
    differ = _values_differ(f"{path}.get_mask()", mask, expected_mask, tolerances)
    if differ:
        return differ
    shown: torch.Tensor = actual.get_data()  # type: ignore[no-untyped-call]
    expected_shown: torch.Tensor = expected.get_data()  # type: ignore[no-untyped-call]
    zero = torch.zeros((), dtype=shown.dtype)
    shown = torch.where(mask, shown, zero.to(shown.device))
    expected_shown = torch.where(expected_mask, expected_shown, zero.to(expected_shown.device))
    return _values_differ(f"{path}.get_data()", shown, expected_shown, tolerances)


def _dequantized(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.dequantize() if tensor.is_quantized else tensor


def _values_differ(
    path: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    tolerances: tuple[float, float] | None,
) -> list[Problem]:
    """The problem of two tensors' values, if any: ``"values"`` (with the tolerances that
    would cover it) for floating point, ``"exact"`` for integers and bools, ``"unreadable"``
    where a device cannot give them back."""
    try:
        problem = _value_problem(path, actual, expected, tolerances)
    except Unreadable as unreadable:
        return [unreadable.problem(path)]
    if problem is None:
        return []
    if _inexact(actual, expected):
        return [Problem("values", path, problem, _covered_by(actual, expected, tolerances))]
    return [Problem("exact", path, problem)]


def _number_problems(
    expected_numbers: dict[str, Complex],
    numbers: dict[str, Complex],
    tolerances: tuple[float, float] | None,
) -> list[Problem]:
    """Numbers in the output (``loss.item()``, a count): integers and bools exactly, others
    within the tolerances, by default float32's (a Python float mostly comes from a float32
    tensor's ``.item()``). Set members are left out: their paths follow their order."""
    problems: list[Problem] = []
    for path, expected in expected_numbers.items():
        actual = numbers.get(path)
        if actual is None or "list(" in path:
            continue  # another type there: reported as a structure problem
        if _exact(actual) and _exact(expected):
            if actual != expected:
                what = "integers" if isinstance(expected, Integral) else "bools"
                line = f"{path}: {actual!r}, expected {expected!r}, {what} compared exactly"
                problems.append(Problem("exact", path, line))
            continue
        rtol, atol = tolerances or _TOLERANCES[torch.float32]
        a, e = complex(actual), complex(expected)
        if not _close(a, e, rtol, atol):
            line = f"{path}: {actual!r}, expected {expected!r}, rtol={rtol:g}, atol={atol:g}"
            cover = next(
                (looser for looser in _looser(rtol, atol) if _close(a, e, *looser)),
                None,
            )
            problems.append(Problem("values", path, line, cover))
    return problems


def _exact(number: object) -> bool:
    """Whether a number in an output is compared exactly: an int, a bool, numpy's too."""
    if isinstance(number, Integral):
        return True
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(number, numpy.bool_)


def _close(actual: complex, expected: complex, rtol: float, atol: float) -> bool:
    both_nan = cmath.isnan(actual) and cmath.isnan(expected)
    return both_nan or actual == expected or abs(actual - expected) <= atol + rtol * abs(expected)


def _looser(rtol: float, atol: float) -> list[tuple[float, float]]:
    """The tolerances a fix may suggest beyond ``rtol`` and ``atol``, smallest first."""
    looser = [(max(rtol, r), max(atol, a)) for r, a in _LOOSER]
    return [pair for pair in looser if pair != (rtol, atol)]


def _covered_by(
    actual: torch.Tensor, expected: torch.Tensor, tolerances: tuple[float, float] | None
) -> tuple[float, float] | None:
    """The smallest of the tolerances a fix may suggest within which ``actual`` and
    ``expected`` (floating point or complex) agree; None where none is enough."""
    wide = torch.complex128 if actual.is_complex() or expected.is_complex() else torch.float64
    a, e = _dense(actual).to(wide), _dense(expected).to(wide)
    used = tolerances or _default_tolerances(actual.dtype, expected.dtype)
    for rtol, atol in _looser(*used):
        if bool(torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True).all()):
            return rtol, atol
    return None


def _inexact(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether the values are compared within tolerances: floating point or complex."""
    return any(t.is_floating_point() or t.is_complex() for t in (actual, expected))


def _value_problem(
    path: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    tolerances: tuple[float, float] | None,
) -> str | None:
    wide = torch.complex128 if actual.is_complex() or expected.is_complex() else torch.float64
    a, e = _dense(actual), _dense(expected)
    if _inexact(actual, expected):
        # Two dtypes (dtypes="device": float32 for float64) get the wider tolerance of the
        # two, as torch.testing.assert_close gives them.
        rtol, atol = tolerances or _default_tolerances(actual.dtype, expected.dtype)
        compared = f"rtol={rtol:g}, atol={atol:g}"
        a, e = a.to(wide), e.to(wide)
        close = torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    else:  # integers and bools: exact, whatever rtol and atol (a count, an index, a mask)
        compared = f"{actual.dtype} compared exactly"
        close = a == e
        a, e = a.to(wide), e.to(wide)
    if bool(close.all()):
        return None
    wrong = ~close
    count, total = int(wrong.sum()), close.numel()
    abs_diff = (a - e).abs()
    rel_diff = abs_diff / e.abs()
    lines = [
        f"{path}: {count} of {total} values differ ({100 * count / total:.1f}%), {compared}",
        _largest("max abs diff", abs_diff, wrong),
        _largest("max rel diff", rel_diff, wrong),
    ]
    return "\n      ".join(lines)


class Unreadable(Exception):
    """A tensor's values, which its device cannot copy to the CPU for the comparison."""

    def __init__(self, tensor: torch.Tensor, error: Exception) -> None:
        super().__init__(str(error))
        self.device = tensor.device
        layout = str(tensor.layout).removeprefix("torch.")
        self.what = f"{layout} nested tensor" if tensor.is_nested else f"{layout} tensor"
        self.error = error

    def problem(self, path: str) -> Problem:
        """The line that says which values were not compared, and why."""
        reason = str(self.error).strip().partition("\n")[0]
        if len(reason) > _REASON:
            reason = reason[: _REASON - 3] + "..."
        line = (
            f"{path}: not compared: {self.device} cannot copy this {self.what} to the CPU "
            f"({type(self.error).__name__}: {reason})"
        )
        return Problem("unreadable", path, line)


# How much of torch's error a line quotes: its first sentence says why; the rest lists
# backends.
_REASON = 160


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU, strided, with no pending conjugation or negation: sparse
    tensors are compared as the dense tensors they stand for.

    Raises:
        Unreadable: its device cannot copy it to the CPU.
    """
    try:
        cpu = tensor.detach().to("cpu")
    except RuntimeError as error:
        raise Unreadable(tensor, error) from None
    if cpu.layout != torch.strided:
        cpu = cpu.to_dense()
    return cpu.resolve_conj().resolve_neg()


def _components(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A nested tensor's components, on the CPU.

    Raises:
        Unreadable: its device cannot copy it to the CPU.
    """
    try:
        return tensor.detach().to("cpu").unbind()
    except RuntimeError as error:
        raise Unreadable(tensor, error) from None


def _default_tolerances(*dtypes: torch.dtype) -> tuple[float, float]:
    found = [_TOLERANCES.get(dtype, (0.0, 0.0)) for dtype in dtypes]
    return max(rtol for rtol, _ in found), max(atol for _, atol in found)


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
