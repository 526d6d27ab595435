"""A child forked inside scopes (a DataLoader's workers, a fork-started pool's) starts outside
every scope of its parent, as a spawned child does; the parent's scopes are untouched."""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from devicectx import current_device, device_agnostic, on_device

pytestmark = pytest.mark.skipif(
    sys.platform == "win32" or "fork" not in multiprocessing.get_all_start_methods(),
    reason="needs the fork start method",
)

META = torch.device("meta")


def made_here() -> str:
    """Where a tensor made without ``device=`` lands, in the process that runs this."""
    return str(torch.zeros(1).device)


def in_forked_worker(job: Callable[[], Any]) -> Any:
    """``job()`` in a worker of a fork-started pool, forked here and now."""
    with multiprocessing.get_context("fork").Pool(1) as pool:
        return pool.apply(job)


@pytest.mark.parametrize(
    "options",
    [{}, {"exact": True}, {"audit": "raise"}],
    ids=["plain", "exact", "audit"],
)
def test_a_pool_forked_inside_a_block_makes_its_tensors_where_torch_does(
    options: dict[str, Any],
) -> None:
    """Its workers live on after the block: they run outside it (exact's mode off their
    stack, the audit that would raise released); the block goes on in the parent."""
    with on_device("meta", **options):
        assert "cpu" == in_forked_worker(made_here)
        assert "meta" == made_here()
    assert "cpu" == made_here()


class Made(Dataset[str]):
    """A dataset whose samples say where the worker made a tensor."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> str:
        return made_here()


@device_agnostic(device="meta")
def evaluate(loader: DataLoader[str]) -> list[str]:
    """A helper that iterates a loader in its body: its workers fork in the call's scope."""
    return [place for batch in loader for place in batch]


def test_a_loader_iterated_in_a_decorated_call_forks_workers_outside_its_scope() -> None:
    """On CUDA a worker in the call's scope would fail ("Cannot re-initialize CUDA in forked
    subprocess"); on meta its samples were made there, silently."""
    loader = DataLoader(Made(), num_workers=1, multiprocessing_context="fork")
    assert ["cpu", "cpu"] == evaluate(loader)


def fork_in_body(report: int) -> str:
    """A bare fork in a decorated call inside a block: the child goes on in the body, leaves
    both scopes, writes one byte to ``report`` (0: all as expected) and exits; the parent
    returns where it made a tensor in the body."""
    child = False
    try:

        @device_agnostic(device="meta")
        def body() -> str:
            nonlocal child
            with on_device("meta", exact=True):
                child = os.fork() == 0
                return made_here()

        place = body()
        if child:
            expected = ("cpu", "cpu", torch.device("cpu"))
            os.write(report, bytes([(place, made_here(), current_device()) != expected]))
        return place
    except BaseException:
        if child:
            os.write(report, b"\x02")
        raise
    finally:
        if child:  # never back into pytest
            os._exit(0)


def test_a_child_that_goes_on_in_the_body_leaves_its_scopes_without_error() -> None:
    """A bare ``os.fork()``: the child's copy of the body runs outside the scopes and
    leaves them as the parent does; the parent is as if nothing forked."""
    read, write = os.pipe()
    try:
        assert "meta" == fork_in_body(write)
        assert b"\x00" == os.read(read, 1)
    finally:
        os.close(read)
        os.close(write)
    os.wait()
    assert "cpu" == made_here()
