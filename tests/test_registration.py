"""``register_container`` and ``unregister_container``: a registration taken back, a
``children=`` of the wrong shape refused with its fix, a rebuild that names every error it
met, a registration made while another thread works out the type's kind, and the
package's own built-in kinds."""

from __future__ import annotations

import collections
import threading
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


@pytest.mark.parametrize(
    ("rebuild", "what"),
    [
        (lambda p, new: Pair(new[0], None), "a Pair holding 1 of the 2 new children"),
        (lambda p, new: list(new), "a list"),
    ],
    ids=["drops a child", "another type"],
)
def test_a_rebuild_that_loses_a_child_or_the_type_is_refused(rebuild: Any, what: str) -> None:
    """A ``rebuild=`` whose result drops a child, or is of another type, is refused as
    the built-in rebuilds are, naming the registration and its fix, never returned."""
    register_container(
        Pair,
        children=lambda p: [
            (k, v) for k, v in (("left", p.left), ("right", p.right)) if v is not None
        ],
        rebuild=rebuild,
    )
    try:
        with pytest.raises(MoveError) as raised:
            to_device(Pair(torch.zeros(1), torch.ones(1)), "meta")
        assert [
            "to_device() could not move obj (a Pair) to meta:",
            f"    register_container(Pair, rebuild=...) returned {what}",
            "fix: rebuild=lambda obj, new: Pair(*new), a new Pair holding each new child, in "
            "the order children= gives them",
        ] == str(raised.value).splitlines()
    finally:
        unregister_container(Pair)


def test_children_keyed_by_numbers_have_paths_python_reads() -> None:
    """A registered container whose keys are its indices: ``b['s'][0]``, not ``b['s'].0``."""
    register_container(
        Pair, children=lambda p: [(0, p.left), (1, p.right)], rebuild=lambda p, new: Pair(*new)
    )
    try:
        pair = Pair(torch.zeros(1), torch.ones(1))
        assert {CPU: ["b['s'][0]", "b['s'][1]"]} == find_devices({"s": pair}, name="b")
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


#: How long a thread of the race test waits for the other before the test fails: only
#: reached when the code under test deadlocks.
PATIENCE = 30.0


def test_a_registration_while_another_thread_works_out_the_kind_is_kept() -> None:
    """A thread that met the type first and worked out its kind from the rules as they were
    before a registration made in the meantime neither caches that kind nor returns it:
    the registered type is looked into and moved afterwards."""
    reading = threading.Event()
    registered = threading.Event()

    class Pausing(type):
        """Holds the kind's working out, after it read the registry, until the main
        thread has registered the type."""

        @property
        def to(cls) -> None:
            if not registered.is_set():
                reading.set()
                assert registered.wait(PATIENCE)
            return None

    class Late(metaclass=Pausing):
        def __init__(self, inner: Any) -> None:
            self.inner = inner

    found: list[_containers.Kind] = []
    worker = threading.Thread(target=lambda: found.append(_containers.kind_for(Late)))
    worker.start()
    try:
        assert reading.wait(PATIENCE)
        register_container(
            Late, children=lambda late: [("inner", late.inner)], rebuild=lambda _, new: Late(*new)
        )
    finally:
        registered.set()
        worker.join(PATIENCE)
    try:
        assert not worker.is_alive()
        late = Late(torch.zeros(1))
        assert {CPU: ["late.inner"]} == find_devices(late, name="late")
        assert META == to_device(late, "meta").inner.device
        assert [_containers.CONTAINER] == [kind.role for kind in found]
    finally:
        unregister_container(Late)


def test_a_type_that_registers_as_it_is_read_is_worked_out_twice_and_not_cached() -> None:
    """Where working out a type's kind changes the rules each time (the type's own code
    registers), ``kind_for`` tries twice, then answers without caching rather than loop:
    each look works the kind out again."""
    reads: list[type] = []

    class Registering(type):
        """Registers ``Pair`` each time the kind's working out reads ``to``."""

        @property
        def to(cls) -> None:
            reads.append(cls)
            if len(reads) > 10:
                msg = "kind_for keeps working the kind out"
                raise AssertionError(msg)
            register_container(Pair, children=lambda p: [], rebuild=lambda p, new: p)
            return None

    class Restless(metaclass=Registering): ...

    try:
        assert _containers.LEAF == _containers.kind_for(Restless).role
        assert _containers.LEAF == _containers.kind_for(Restless).role
        assert [Restless] * 4 == reads
    finally:
        unregister_container(Pair)


class Box:
    """A type that the built-in rules take for a leaf, given a built-in kind below."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner


def test_a_built_in_kind_replaces_the_one_already_worked_out() -> None:
    """``register_builtin_kind`` applies to a type met before it: the leaf kind already
    cached is forgotten, and the type is looked into and moved."""
    box = Box(torch.zeros(1))
    assert {} == find_devices(box, name="box")
    kind = _containers.Kind(
        _containers.CONTAINER,
        split=lambda b: (["inner"], [b.inner]),
        rebuild=lambda b, keys, old, new: Box(*new),
    )
    _containers.register_builtin_kind(Box, kind)
    try:
        assert {CPU: ["box['inner']"]} == find_devices(box, name="box")
        assert META == to_device(box, "meta").inner.device
    finally:
        with _containers._LOCK:
            del _containers._BUILTIN[Box]
            _containers._reset_cache()


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
