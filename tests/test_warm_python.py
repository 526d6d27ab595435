"""The warm interpreter (``tests/warm_python.py``) gives what ``python -c`` gives.

The tests that need a process of their own run in children forked from a server that
imported torch; each child must be what those tests take it for: a fresh process, with
the caller's environment and folder, Python's exit, and Python's own output and status.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from warm_python import run_python

SOURCES = {
    "fresh": (
        "import sys\n"
        "print(__name__, sys.argv, sorted(m for m in sys.modules if m.startswith("
        "('torch._dynamo', 'torch._inductor', 'devicectx', 'pytest', 'hypothesis'))))"
    ),
    "error": "def f():\n    raise ValueError('bad')\nf()",
    "exit text": "import sys\nsys.exit('stopped')",
    "exit status": "import sys\nprint('before', flush=True)\nsys.exit(3)",
    "exit": (
        "import atexit, threading\n"
        "atexit.register(print, 'atexit')\n"
        "print('main')\n"
        "threading.Thread(target=lambda: print('thread')).start()"
    ),
    "warning": "import warnings\nwarnings.warn('careful')",
}


def cold(source: str, *options: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *options, "-c", source],
        capture_output=True,
        text=True,
        check=False,
        **kwargs,  # type: ignore[call-overload]
    )


def outcome(done: subprocess.CompletedProcess[str]) -> tuple[int, str, str]:
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize("name", SOURCES)
def test_a_child_prints_and_exits_as_python_c(name: str) -> None:
    """Output, errors (a traceback without the server's frames), ``sys.exit``, threads
    joined before ``atexit``: as ``python -c`` gives them, byte for byte."""
    source = SOURCES[name]
    assert outcome(cold(source)) == outcome(run_python(source))


def test_warnings_ignored_as_with_w_ignore() -> None:
    source = SOURCES["warning"]
    assert outcome(cold(source, "-W", "ignore")) == outcome(
        run_python(source, ignore_warnings=True)
    )
    assert "UserWarning: careful" in run_python(source).stderr


def test_a_child_has_the_callers_environment_and_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The environment as it is at the call (a variable set by the test), or the one
    given; the folder given, or the caller's."""
    source = "import os\nprint(os.environ.get('WARM_PYTHON_SEEN'), os.getcwd())"
    monkeypatch.setenv("WARM_PYTHON_SEEN", "set")
    monkeypatch.chdir(tmp_path)
    assert f"set {tmp_path}\n" == run_python(source).stdout
    given = {**os.environ, "WARM_PYTHON_SEEN": "given"}
    other = tmp_path / "other"
    other.mkdir()
    assert f"given {other}\n" == run_python(source, env=given, cwd=other).stdout


def test_a_child_past_its_timeout_is_killed_and_the_next_runs() -> None:
    """As subprocess.run: a child still running after ``timeout`` is killed and
    TimeoutExpired raised, with what it printed; the server goes on."""
    waits = "import threading\nprint('waiting', flush=True)\nthreading.Event().wait()"
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        run_python(waits, timeout=2)
    # What it printed comes with the error; on a loaded machine the kill may come first.
    assert "waiting\n".startswith(raised.value.output)
    assert "next\n" == run_python("print('next')").stdout


def test_children_share_nothing() -> None:
    """What one child does (an import, a compile) is not in the next."""
    run_python("import torch, devicectx\ntorch.compile(lambda x: x + 1, backend='eager')")
    assert outcome(cold(SOURCES["fresh"])) == outcome(run_python(SOURCES["fresh"]))
