"""Shared set-up: hypothesis profiles, and a clean device state around every test."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from torch.overrides import _get_current_function_mode_stack

from devicectx._torch.modes import clear_default_device
from devicectx.move import _repeats

# Tensor work is slow next to plain Python, so no per-example deadline; "ci" runs the
# default number of examples, "dev" fewer for a quick loop, "thorough" many more, and
# "range" a quarter of the default: CI's runs on the other torch releases, where the 2.13
# run has drawn the full number (a release that breaks a property breaks it on most
# inputs, not on the hundredth).
settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile("dev", parent=settings.get_profile("ci"), max_examples=20)
settings.register_profile("thorough", parent=settings.get_profile("ci"), max_examples=1000)
settings.register_profile("range", parent=settings.get_profile("ci"), max_examples=25)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="session")
def _import_heap_frozen() -> None:
    """Move what is alive once the tests are collected (torch, transformers, hypothesis:
    hundreds of thousands of objects) out of the cyclic collector's reach, for good: a full
    collection, which tests run to free what they dropped and Python runs as the heap grows,
    then scans what the tests made, not all of torch."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _clean_device_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run each test with the CPU default, no torch modes, and no device variables set.

    A test that leaves a default device or a mode behind fails here, by name,
    instead of breaking whichever test happens to run next.
    """
    monkeypatch.delenv("DEVICECTX_DEVICE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert _get_current_function_mode_stack() == [], "a torch mode leaked into this test"
    _repeats._reset_for_tests()  # no repeated-move memory from an earlier test
    yield
    leaked = _get_current_function_mode_stack()
    # Also after tests that called set_default_device(None): on torch 2.6 to 2.9 that leaves
    # a None that get_default_device fails on, in every later test of this thread.
    clear_default_device()
    if leaked:
        while torch._C._len_torch_function_stack():
            torch._C._pop_torch_function_stack()
        pytest.fail(f"the test left torch modes on the stack: {leaked}")


@pytest.fixture
def accelerate() -> Any:
    """accelerate, where installed (the tests of models it dispatches)."""
    return pytest.importorskip("accelerate")


@pytest.fixture
def two() -> tuple[torch.device, torch.device]:
    """The first two devices of the accelerator, for a model spread over them."""
    try:
        count = torch.accelerator.device_count()
    except RuntimeError as error:  # a CUDA build without a driver (torch 2.7) raises here
        pytest.skip(f"two devices of the accelerator: none usable here ({error})")
    if count < 2:
        pytest.skip("two devices of the accelerator, for a model spread over them (one here)")
    kind = torch.accelerator.current_accelerator()
    assert kind is not None
    return torch.device(kind.type, 0), torch.device(kind.type, 1)
