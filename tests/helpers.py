"""Helpers shared by the test files."""

from __future__ import annotations

import subprocess
import sys


def python_output(source: str) -> str:
    """What ``source`` prints, run in a fresh interpreter; its error output if it fails.

    For what must start from a fresh process: dynamo's tables built at its first compile,
    torch's import-time state.
    """
    done = subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, check=False
    )
    assert 0 == done.returncode, done.stderr[-3000:]
    return done.stdout.strip()
