"""The inputs the benchmark moves, the peers that move them, and how copies are counted.

Every tree is made of dicts (the flat case is a tuple of three tensors), so that every
peer, TensorDict included, can take every tree and each row compares the same work.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from devicectx import to_device


@dataclass(frozen=True)
class Tree:
    """One input: a key for the JSON, a label for the table, the tree and its leaf count."""

    key: str
    label: str
    tree: Any
    leaves: int


def flat3(shape: tuple[int, ...] = (16, 16)) -> Tree:
    """Three separate tensors, as a function's three positional arguments."""
    args = tuple(torch.randn(shape) for _ in range(3))
    return Tree("flat3", "3 flat tensors", args, 3)


def nested(scale: int = 1) -> Tree:
    """A dict batch of 6 tensors nested 3 deep (``batch['targets']['weights']['pos']``).

    ``scale`` multiplies the batch dimension, for the host-to-device bandwidth section.
    """
    n = 8 * scale
    batch = {
        "inputs": {
            "ids": torch.randint(0, 30_000, (n, 128)),
            "mask": torch.ones(n, 128, dtype=torch.bool),
        },
        "targets": {
            "labels": torch.randint(0, 10, (n,)),
            "weights": {"pos": torch.rand(n), "neg": torch.rand(n)},
        },
        "extras": {"pixels": torch.randn(n, 3, 32, 32)},
    }
    label = "nested batch (6 tensors, 3 deep)" if scale == 1 else f"nested batch x{scale}"
    return Tree("nested" if scale == 1 else f"nested_x{scale}", label, batch, 6)


def many_leaves(n: int) -> Tree:
    """``n`` distinct small tensors in groups of ten: ``tree['g0042']['t7']``."""
    tree = {
        f"g{group:05d}": {f"t{i}": torch.zeros(4) for i in range(10)} for group in range(n // 10)
    }
    return Tree(f"leaves_{n}", f"{n:,} leaves", tree, n)


def tiles(n: int, side: int = 64) -> Tree:
    """``n`` distinct tensors of ``side`` x ``side`` floats: ``tree['t0042']``."""
    tree = {f"t{i:04d}": torch.randn(side, side) for i in range(n)}
    return Tree(f"tiles_{n}", f"{n:,} tensors of {side}x{side} floats", tree, n)


def detection(images: int = 16, side: int = 512, seed: int = 0) -> Tree:
    """A detection batch: ``images`` images 3 x side x side (one tensor) and their ids, and
    per image a box tensor (k, 4) and a label tensor (k,) of a random length k (1 to 50).

    At the defaults: 50 MB in 34 tensors, the batch a detection model's loader makes.
    Boxes and labels are dicts keyed
    by image (``tree['boxes']['3']``), so that TensorDict takes the tree too.
    """
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 51, (images,), generator=generator).tolist()
    tree = {
        "images": torch.randn(images, 3, side, side, generator=generator),
        "image_ids": torch.arange(images),
        "boxes": {str(i): torch.rand(k, 4, generator=generator) for i, k in enumerate(lengths)},
        "labels": {
            str(i): torch.randint(0, 80, (k,), generator=generator) for i, k in enumerate(lengths)
        },
    }
    label = f"detection batch ({images} images 3x{side}x{side}, boxes, labels)"
    return Tree(f"detection_{images}x{side}", label, tree, 2 + 2 * images)


def aliased(refs: int = 10) -> Tree:
    """One tensor reachable ``refs`` times, from two sub-dicts."""
    shared = torch.randn(16, 16)
    half = refs // 2
    tree = {
        "a": {f"k{i}": shared for i in range(half)},
        "b": {f"k{i}": shared for i in range(refs - half)},
    }
    return Tree(f"aliased_{refs}", f"1 tensor reachable {refs} times", tree, refs)


def load(module: str, attr: str) -> Any:
    """``module.attr`` of an installed package; a missing one raises ``ImportError``.

    Loaded by name so that the benchmark still runs, with "not available" rows, where a
    peer is not installed, and so that the untyped peers stay out of ``mypy --strict``.
    """
    return getattr(importlib.import_module(module), attr)


def as_tensordict(tree: Any) -> Any:
    """The tree as a ``TensorDict`` (the flat tuple under keys ``a``, ``b``, ``c``)."""
    tensordict = load("tensordict", "TensorDict")
    if isinstance(tree, tuple):
        tree = dict(zip("abc", tree, strict=True))
    return tensordict(tree, batch_size=[])


Mover = Callable[[], Callable[[], Any]]
"""Builds a zero-argument call that moves one tree to one device (see ``_timing.Maker``)."""


def movers(tree: Any, device: torch.device, *, non_blocking: bool = False) -> dict[str, Mover]:
    """``to_device`` and each peer, ready to move ``tree`` to ``device``.

    The peers as their users write them: ``send_to_device(tree, d)``,
    ``apply_to_collection(tree, Tensor, lambda t: t.to(d))``,
    ``optree.tree_map(lambda t: t.to(d), tree)`` and ``TensorDict.to(d)`` (the TensorDict
    is built once, outside the timing).
    """

    def ours() -> Callable[[], Any]:
        return lambda: to_device(tree, device, non_blocking=non_blocking)

    def accelerate() -> Callable[[], Any]:
        send_to_device = load("accelerate.utils", "send_to_device")
        return lambda: send_to_device(tree, device, non_blocking=non_blocking)

    def lightning() -> Callable[[], Any]:
        apply_to_collection = load("lightning_utilities.core.apply_func", "apply_to_collection")

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return lambda: apply_to_collection(tree, torch.Tensor, move)

    def optree() -> Callable[[], Any]:
        tree_map = load("optree", "tree_map")
        return lambda: tree_map(lambda t: t.to(device, non_blocking=non_blocking), tree)

    def tensordict() -> Callable[[], Any]:
        td = as_tensordict(tree)
        return lambda: td.to(device, non_blocking=non_blocking)

    return {
        "to_device": ours,
        "send_to_device": accelerate,
        "apply_to_collection": lightning,
        "optree.tree_map": optree,
        "TensorDict.to": tensordict,
    }


PEERS = tuple(name for name in movers((), torch.device("cpu")) if name != "to_device")
"""The peers' names, in the order the tables show them."""


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable in a tree of dicts, lists, tuples or a TensorDict, with repeats."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif hasattr(item, "batch_size") and hasattr(item, "values"):  # a TensorDict
            stack.extend(item.values(include_nested=True, leaves_only=True))


def count_copies(before: Any, after: Any) -> int:
    """How many new tensors ``after`` holds that ``before`` did not.

    ``meta`` tensors have no data to compare, so new tensor objects are counted; on a real
    device, distinct storages (two views of one copy count once).
    """
    seen = {id(t) for t in tensors_in(before)}
    new = [t for t in tensors_in(after) if id(t) not in seen]
    if all(t.device.type == "meta" for t in new):
        return len({id(t) for t in new})
    return len({(t.device, t.untyped_storage().data_ptr()) for t in new})
