"""Helpers shared by the test files."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock
from torch import nn
from warm_python import run_python


def accelerator(index: int = 0) -> torch.device:
    """Device ``index`` of the machine's accelerator (tests marked
    ``requires_device("accelerator")``: CUDA, the emulated ``emu``, ...)."""
    kind = torch.accelerator.current_accelerator()
    assert kind is not None, "no accelerator: mark the test requires_device('accelerator')"
    return torch.device(kind.type, index)


@contextlib.contextmanager
def mps_like() -> Iterator[torch.device]:
    """The emulated accelerator playing MPS in the block: no float64, no complex128; the
    test skips on any other accelerator (a real one keeps its dtypes)."""
    import pytest

    device = accelerator()
    if device.type != "emu":
        pytest.skip("the device without float64 is the emulated one (--devicectx-accelerator)")
    from devicectx.testing import emulated

    with emulated.profile("mps"):
        yield device


@contextlib.contextmanager
def step_ahead(stream: torch.Stream) -> Iterator[torch.Stream]:
    """``stream`` (a device's) with work queued in the block, as a step queued ahead of a
    move: a wait for a blocker stream, held back (``emulated.paused``) till the end. The
    wait is for an event recorded on the paused blocker, so it is queued whatever the
    timing (a wait for an event already complete queues nothing)."""
    from devicectx.testing import emulated

    blocker = torch.Stream(device=stream.device)
    with emulated.paused(stream=blocker):
        stream.wait_event(blocker.record_event())
        yield blocker


def python_command(*argv: str) -> list[str]:
    """``python ARGV...`` for a child process that should see the devices this test sees:
    under ``--devicectx-accelerator=emulated``, it runs through
    ``python -m devicectx.testing.emulate``, which enables the emulated accelerator first."""
    from devicectx.testing import emulated

    prefix = ["-m", "devicectx.testing.emulate"] if emulated.enabled() else []
    return [sys.executable, *prefix, *argv]


def python_output(source: str) -> str:
    """What ``source`` prints, run in a fresh interpreter (one that starts with torch
    imported: :func:`warm_python.run_python`); its error output if it fails.

    For what must start from a fresh process: dynamo's tables built at its first compile,
    torch's import-time state.
    """
    done = run_python(source)
    assert 0 == done.returncode, done.stderr[-3000:]
    return done.stdout.strip()


def once_per_session(factory: pytest.TempPathFactory, name: str, compute: Callable[[], Any]) -> Any:
    """``compute()``'s result (JSON), computed once in a test session however many xdist
    workers ask for it: the first computes it, under a lock, and the others read it.

    For a module's fixture that runs a costly child (a torchrun job, a sweep in a fresh
    interpreter): xdist hands a module's tests to both workers, and each ran the child
    again. A failing ``compute`` leaves nothing behind: the next worker to ask runs it.
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return compute()
    shared = factory.getbasetemp().parent  # the session's folder, above each worker's
    path = shared / f"{name}.json"
    with FileLock(f"{path}.lock"):
        if path.is_file():
            return json.loads(path.read_text())
        value = compute()
        path.write_text(json.dumps(value))
        return value


def placed(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every tensor of a structure the strategies build, with its position, preorder;
    set members are left out (their order follows their hashes)."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    if isinstance(obj, (set, frozenset, str, bytes, torch.Size)):
        return
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        pairs: Any = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    elif isinstance(obj, nn.utils.rnn.PackedSequence):
        pairs = [("data", obj.data), ("sorted", obj.sorted_indices)]
    elif isinstance(obj, (dict, collections.abc.Mapping)):
        pairs = list(obj.items())
    elif isinstance(obj, (list, tuple, collections.deque, collections.UserList)):
        pairs = list(enumerate(obj))
    else:
        return
    for key, child in pairs:
        yield from placed(child, (*path, key))


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """The tensors of ``obj`` that have a position, in preorder."""
    return [tensor for _, tensor in placed(obj)]


def described(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What a move must keep of one tensor (values aside)."""
    return (
        type(tensor),
        tensor.device,
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride() if tensor.numel() else None,
        tensor.requires_grad,
        tensor.grad_fn is None,
        tensor.is_leaf,
    )


@contextlib.contextmanager
def staged_counts() -> Iterator[list[int]]:
    """A list, filled in the block with how many tensors each staged move to the
    accelerator staged (the results of ``_staging.to_accelerator``), in order."""
    import pytest

    from devicectx.move import _staging

    counts: list[int] = []
    to_accelerator = _staging.to_accelerator

    def counted(*args: Any) -> dict[int, torch.Tensor]:
        results = to_accelerator(*args)
        counts.append(len(results))
        return results

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_staging, "to_accelerator", counted)
        yield counts


ROOT = Path(__file__).resolve().parent.parent


def passing_run(*arguments: str) -> subprocess.CompletedProcess[str]:
    """pytest run with ``arguments`` (test files or ids, and options) in a fresh process
    (:func:`warm_python.run_python`), which must pass; the test skips where the emulated
    accelerator cannot be built."""
    options = [*arguments, "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    done = run_python(f"import sys, pytest\nsys.exit(pytest.main({options!r}))", cwd=ROOT)
    if "the emulated accelerator is unavailable" in done.stdout:
        pytest.skip(done.stdout[-2000:])
    assert 0 == done.returncode, done.stdout[-4000:] + done.stderr[-2000:]
    return done


def skip_unless_emulated(request: pytest.FixtureRequest) -> None:
    """Skip a test of the emulated device (an ``emu`` fixture) in a session without it:
    :func:`emulated_tests_in_a_child` runs such a file's tests in a fresh process that
    enables it."""
    from devicectx.testing import emulated

    if emulated.enabled():
        return
    if request.config.getoption("devicectx_accelerator") is not None:
        pytest.skip("the emulated accelerator is unavailable (see the report header)")
    pytest.skip(
        "needs --devicectx-accelerator=emulated; tests/test_emulated.py::"
        "test_the_device_s_own_tests_on_the_emulated_accelerator runs it so, in a fresh process"
    )


# The files of the emulated device's own tests: without the option, their tests that need
# the device run in one child process (test_emulated.py's test_the_device_s_own_tests...).
EMULATED_FILES = ("test_emulated.py", "test_emulated_generators.py", "test_emulated_ops.py")


def emulated_tests_in_a_child(request: pytest.FixtureRequest) -> list[str]:
    """In a session without the emulated accelerator, the tests of :data:`EMULATED_FILES`
    that need it (their ``emu`` fixture), run in one fresh pytest that enables it (one:
    each child is a torch import, a pytest start and the device's load); they must pass,
    none skipped for want of the device. The child's output lines (``-rsp``: each passed
    test and each skip with its reason)."""
    from devicectx.testing import emulated

    if emulated.enabled():
        pytest.skip("the emulated accelerator is enabled here: the tests ran in this process")
    needing = [
        item.nodeid
        for item in request.session.items
        if item.path.name in EMULATED_FILES and "emu" in getattr(item, "fixturenames", ())
    ]
    if not needing:  # deselected (-k): a child given no ids would run the whole suite
        pytest.skip("none of the tests that need the device was collected")
    lines = passing_run(*needing, "--devicectx-accelerator=emulated", "-rsp").stdout.splitlines()
    # What matters: the tests that need the device ran there (other skips are the child's
    # business: a torch release may lack what one test checks).
    skipped = [line for line in lines if line.startswith("SKIPPED")]
    assert not [line for line in skipped if "needs --devicectx" in line]
    return lines
