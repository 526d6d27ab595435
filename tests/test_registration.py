"""``register_container`` and ``unregister_container``: a registration taken back, a
``children=`` of the wrong shape refused with its fix, and a rebuild that names every
error it met."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

from devicectx import (
    MoveError,
    RegistrationError,
    find_devices,
    register_container,
    to_device,
    unregister_container,
)
from devicectx.move import _containers

CPU = torch.device("cpu")
META = torch.device("meta")


class Pair:
    """Two tensors and a note, for registrations."""

    def __init__(self, left: Any, right: Any, note: str = "") -> None:
        self.left, self.right, self.note = left, right, note


def test_unregister_container_restores_the_built_in_rules() -> None:
    """After unregistering, a Pair is a leaf again: not looked into, not moved."""
    register_container(
        Pair,
        children=lambda p: [("left", p.left), ("right", p.right)],
        rebuild=lambda p, new: Pair(*new, note=p.note),
    )
    pair = Pair(torch.zeros(1), torch.ones(1))
    assert {CPU: ["pair.left", "pair.right"]} == find_devices(pair, name="pair")
    unregister_container(Pair)
    assert {} == find_devices(pair, name="pair")
    assert to_device(pair, "meta") is pair


def test_unregister_container_refuses_a_type_never_registered() -> None:
    """Unregistering what was not registered says so, and what is."""
    with pytest.raises(ValueError, match="is not registered") as raised:
        unregister_container(Pair)
    lines = str(raised.value).splitlines()
    assert lines[0].startswith("unregister_container('Pair'): it is not registered (registered: ")
    assert "fix: unregister only a class given to register_container()" == lines[1]


@pytest.mark.parametrize(
    "children",
    [
        lambda p: [p.left, p.right],  # tensors of three elements: "not enough values"
        lambda p: [("left", p.left, "extra")],
        lambda p: [7],
    ],
    ids=["tensors", "triples", "ints"],
)
def test_children_of_the_wrong_shape_name_the_type_and_the_fix(children: Any) -> None:
    """A ``children=`` that gives no (key, child) pairs fails with RegistrationError (a
    TypeError) naming the type, in find_devices and, inside a move, as its MoveError."""
    register_container(Pair, children=children, rebuild=lambda p, new: Pair(*new))
    try:
        pair = Pair(torch.zeros(3), torch.ones(3))
        with pytest.raises(RegistrationError) as raised:
            find_devices(pair)
        assert isinstance(raised.value, TypeError)
        lines = str(raised.value).splitlines()
        assert lines[0].startswith("register_container(Pair, children=...) gave a ")
        assert lines[0].endswith(" for a Pair, not a (key, child) pair")
        fix = (
            'fix: children=lambda obj: [("left", obj.left), ("right", obj.right)], '
            "each child with its key"
        )
        assert fix == lines[1]
        with pytest.raises(MoveError) as moved:
            to_device({"p": pair}, "meta")
        assert [
            "to_device() could not move obj['p'] (a Pair) to meta:",
            f"    {lines[0]}",
            fix,
        ] == str(moved.value).splitlines()
    finally:
        unregister_container(Pair)


def test_a_two_element_tensor_is_no_pair() -> None:
    """A child tensor of two elements, which would unpack as a key and a value, is refused."""
    register_container(Pair, children=lambda p: [p.left], rebuild=lambda p, new: p)
    try:
        with pytest.raises(RegistrationError, match="gave a Tensor for a Pair"):
            find_devices(Pair(torch.zeros(2), None))
    finally:
        unregister_container(Pair)


class Unmovable(collections.UserList[Any]):
    """A list type whose copy cannot be updated and whose constructor refuses contents."""

    def __init__(self, items: Any = None, *, ok: bool = False) -> None:
        if not ok:
            msg = "construct me with ok=True"
            raise TypeError(msg)
        super().__init__(items or [])

    def __setitem__(self, index: Any, value: Any) -> None:
        msg = "read-only"
        raise RuntimeError(msg)


def test_a_rebuild_that_fails_twice_names_both_errors() -> None:
    """Where updating a copy fails and then the constructor does too, the message names
    both errors, and the traceback chains both."""
    value = Unmovable([torch.zeros(1)], ok=True)
    with pytest.raises(MoveError) as raised:
        to_device(value, "meta")
    text = str(raised.value)
    assert "updating a copy of it raised RuntimeError: read-only, and" in text
    assert "Unmovable(new_items) raised TypeError: construct me with ok=True" in text
    cannot = raised.value.__cause__
    assert isinstance(cannot, _containers.CannotRebuild)
    constructor = cannot.__cause__
    assert isinstance(constructor, TypeError)
    assert isinstance(constructor.__context__, RuntimeError)
    assert "read-only" == str(constructor.__context__)
