"""The strategies of ``devicectx.testing.strategies`` generate what they promise.

Measured over the default number of examples (100), derandomized so the measure is the
same on every run: every container kind of ``strategies.KINDS``, the same tensor at two
places, views with and without their base, views met before their base, and plain values.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.utils.rnn import PackedSequence

from devicectx import available_devices
from devicectx.testing.strategies import KINDS, devices, kind_of, nested, tensors

DEFAULT_EXAMPLES = settings.get_profile("default").max_examples
META = torch.device("meta")


def preorder(obj: Any) -> Iterator[Any]:
    """Every object in a generated structure, containers before their children."""
    yield obj
    if kind_of(obj) is None:
        return
    if isinstance(obj, PackedSequence):
        children: Any = [obj.data]
    elif dataclasses.is_dataclass(obj):
        children = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif isinstance(obj, Mapping):
        children = list(obj.values())
    else:
        children = list(obj)
    for child in children:
        yield from preorder(child)


def cases(obj: Any) -> set[str]:
    """The container kinds and the aliasing and view cases present in one structure."""
    found = {kind for kind in map(kind_of, preorder(obj)) if kind is not None}
    tensors_met = [o for o in preorder(obj) if isinstance(o, torch.Tensor)]
    ids = [id(t) for t in tensors_met]
    if len(ids) != len(set(ids)):
        found.add("same tensor twice")
    for index, tensor in enumerate(tensors_met):
        if tensor._base is None:
            continue
        where = [i for i, t in enumerate(tensors_met) if t is tensor._base]
        if not where:
            found.add("view without its base")
        elif min(where) > index:
            found.add("view before its base")
        else:
            found.add("view after its base")
    plain = [o for o in preorder(obj) if kind_of(o) is None and not isinstance(o, torch.Tensor)]
    if plain:
        found.add("plain value")
    if any(type(o).__name__ in ("list_iterator", "generator") for o in plain):
        found.add("iterator")
    return found


EXPECTED = {
    *KINDS,
    "same tensor twice",
    "view without its base",
    "view before its base",
    "view after its base",
    "plain value",
    "iterator",
}


def test_every_kind_and_case_within_the_default_examples() -> None:
    """100 examples of nested() hold every container kind and every alias and view case."""
    seen: set[str] = set()

    @settings(max_examples=DEFAULT_EXAMPLES, derandomize=True, database=None)
    @given(nested())
    def collect(batch: Any) -> None:
        seen.update(cases(batch))

    collect()
    assert set() == EXPECTED - seen


@given(tensors(devices=["cpu", "meta"], dtypes=[torch.int32], shapes=st.just((2, 3))))
def test_tensors_follow_their_arguments(tensor: torch.Tensor) -> None:
    """tensors() makes fresh tensors of the given devices, dtypes and shapes."""
    assert tensor.device in (torch.device("cpu"), META)
    assert (tensor.dtype, tuple(tensor.shape), tensor._base) == (torch.int32, (2, 3), None)


@given(tensors(dtypes=[torch.float32, torch.int64], requires_grad=True))
def test_requires_grad_only_for_floating_point(tensor: torch.Tensor) -> None:
    """requires_grad=True makes floating-point tensors leaves that require grad."""
    assert tensor.requires_grad == tensor.dtype.is_floating_point
    assert tensor.is_leaf


def test_devices() -> None:
    """devices() draws this machine's devices, and meta only when allowed."""
    seen: set[torch.device] = set()
    seen_with_meta: set[torch.device] = set()

    @settings(max_examples=30, derandomize=True, database=None)
    @given(devices(), devices(allow_meta=True))
    def collect(device: torch.device, maybe_meta: torch.device) -> None:
        seen.add(device)
        seen_with_meta.add(maybe_meta)

    collect()
    assert seen == set(available_devices())
    assert seen_with_meta == {*available_devices(), META}


def test_nested_refuses_a_negative_depth() -> None:
    """A negative max_depth is refused, with the fix."""
    with pytest.raises(ValueError, match="negative") as raised:
        nested(max_depth=-1)
    assert [
        "nested(max_depth=-1): the depth cannot be negative",
        "fix: max_depth=3",
    ] == str(raised.value).splitlines()


def test_import_devicectx_imports_no_hypothesis() -> None:
    """import devicectx leaves hypothesis (and the strategies module) unimported."""
    code = (
        "import sys, devicectx\n"
        "print(sorted(m for m in sys.modules if m.startswith(('hypothesis', "
        "'devicectx.testing.strategies'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
