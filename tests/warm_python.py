"""``python -c SOURCE`` in a process that has already imported torch.

Some tests need a process of their own: dynamo's tables built at its first compile, what
importing devicectx changes in torch, the first block of a process. Such a process spent
most of its life importing torch (3.5 s here for the CPU build, 5 s for a CUDA one: more
than most of these tests' own work). Here a server imports torch once per test process,
and each run is a child it forks: a fresh process in every way these tests look at (no
compile yet, no devicectx imported, its own ``__main__``, the caller's environment and
working directory, its threads joined and ``atexit`` run at the end, as Python's exit
does), but for what happened at torch's import (a variable read then was read with the
environment the server started with).

``DEVICECTX_TESTS_COLD_PYTHON=1`` runs a real ``python -c`` instead, to check that a test
passes either way.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

# The server: reads one request (JSON) a line, forks a child for it, and answers with the
# child's exit status. Its stdout is the answers' pipe: the child points its own 1 and 2 at
# the request's files before anything runs.
_SERVER = r"""
import json, os, sys
import torch  # the one import every child shares

answers = os.fdopen(os.dup(1), "w")
devnull = os.open(os.devnull, os.O_RDWR)


def child(request):
    os.dup2(devnull, 0)
    for fd, key in ((1, "stdout"), (2, "stderr")):
        opened = os.open(request[key], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["-c"]
    import atexit, builtins, threading, traceback, types, warnings
    if request["ignore_warnings"]:
        sys.warnoptions.append("ignore")
        warnings.simplefilter("ignore")
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    status = 0
    try:
        exec(compile(request["source"], "<string>", "exec"), main.__dict__)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            status = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            status = 1
    except BaseException as error:  # printed as Python prints it: no frame of this server
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        status = 1
    # What Python's own exit does, in its order: non-daemon threads joined, atexit run,
    # the streams flushed.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)


for line in iter(sys.stdin.readline, ""):
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            child(request)
        finally:
            os._exit(70)
    _, wait_status = os.waitpid(pid, 0)
    answers.write(f"{os.waitstatus_to_exitcode(wait_status)}\n")
    answers.flush()
"""

_COLD = os.environ.get("DEVICECTX_TESTS_COLD_PYTHON") == "1"
# The environment the server imports torch with: this process's as the tests were
# collected, not whatever a test has set when the first run starts the server.
_STARTING_ENV = dict(os.environ)
_lock = threading.Lock()
_server: subprocess.Popen[str] | None = None


def run_python(
    source: str,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    ignore_warnings: bool = False,
) -> subprocess.CompletedProcess[str]:
    """What ``python -c source`` gives (``python -W ignore -c`` with ``ignore_warnings``):
    its exit status and output, run in a process forked from one that imported torch.

    ``env`` is the child's whole environment (None: this process's, as now); ``cwd`` its
    working directory (None: this process's).
    """
    environment = dict(os.environ if env is None else env)
    folder = os.getcwd() if cwd is None else str(cwd)
    if _COLD:
        options = ["-W", "ignore"] if ignore_warnings else []
        return subprocess.run(
            [sys.executable, *options, "-c", source],
            env=environment,
            cwd=folder,
            capture_output=True,
            text=True,
            check=False,
        )
    with _lock, tempfile.TemporaryDirectory(prefix="warm-python-") as outputs:
        stdout, stderr = Path(outputs, "stdout"), Path(outputs, "stderr")
        request = {
            "source": source,
            "env": environment,
            "cwd": folder,
            "ignore_warnings": ignore_warnings,
            "stdout": str(stdout),
            "stderr": str(stderr),
        }
        server = _started()
        assert server.stdin is not None
        assert server.stdout is not None
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        answer = server.stdout.readline()
        if not answer:
            raise RuntimeError(f"the warm Python server ended (exit status {server.wait()})")
        return subprocess.CompletedProcess(
            [sys.executable, "-c", source],
            int(answer),
            stdout.read_text(errors="replace"),
            stderr.read_text(errors="replace"),
        )


def _started() -> subprocess.Popen[str]:
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_STARTING_ENV,
            text=True,
        )
        atexit.register(_stop, _server)
    return _server


def _stop(server: subprocess.Popen[str]) -> None:
    """End of input: the server's loop ends and it exits."""
    if server.stdin is not None:
        server.stdin.close()
    server.wait()
