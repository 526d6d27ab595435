"""``python -c SOURCE`` in a process that has already imported torch.

Some tests need a process of their own: dynamo's tables built at its first compile, what
importing devicectx changes in torch, the first block of a process. Such a process spent
most of its life importing torch (3.5 s here for the CPU build, 5 s for a CUDA one: more
than most of these tests' own work). Here a server imports torch once per test process,
and each run is a child it forks: a fresh process in every way these tests look at (no
compile yet, no devicectx imported, its own ``__main__``, the caller's environment and
working directory, Python's own traceback and exit status, its threads joined and
``atexit`` run at the end, as Python's exit does).

What differs from a real ``python -c``: what happened at torch's import (a variable read
then, ``PYTHONPATH`` and the other ``PYTHON*`` start-up variables, were read with the
environment the server started with: this process's as the tests were collected); the hash
seed, shared by every child; no interpreter shutdown (``__del__`` of what is left alive at
exit does not run); an uncaught ``KeyboardInterrupt`` exits with status 1, not by SIGINT.
Tests whose subject is the process's own start (the examples, the emulate runner's exits, a
spawned process, torchrun) keep real processes.

``DEVICECTX_TESTS_COLD_PYTHON=1`` runs a real ``python -c`` instead, to check that a test
passes either way.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

# The server: reads one request (JSON) a line, forks a child for it, answers with the
# child's pid, then with its exit status. Its stdout is the answers' pipe: the child points
# its own 0, 1 and 2 elsewhere before anything runs.
_SERVER = r"""
import json, os, sys
import torch  # the one import every child shares

answers = os.fdopen(os.dup(1), "w")
devnull = os.open(os.devnull, os.O_RDWR)
os.dup2(devnull, 1)


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
    import atexit, builtins, linecache, threading, types, warnings
    if "multiprocessing.process" in sys.modules:  # where a spawned process starts from
        sys.modules["multiprocessing.process"].ORIGINAL_DIR = os.getcwd()
    if request["ignore_warnings"]:
        sys.warnoptions.append("ignore")
        warnings.simplefilter("ignore")
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    source = request["source"]
    if sys.version_info >= (3, 13):  # python -c shows the source's lines in tracebacks
        linecache.cache["<string>"] = (len(source), None, source.splitlines(True), "<string>")
    status = 0
    try:
        exec(compile(source, "<string>", "exec"), main.__dict__)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            status = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            status = 1
    except BaseException as error:  # printed as Python prints it: no frame of this server
        error = error.with_traceback(error.__traceback__.tb_next)
        sys.excepthook(type(error), error, error.__traceback__)
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
        except BaseException:  # the child's own set-up failed: said where the test reads
            import traceback
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(70)
    answers.write(f"{pid}\n")
    answers.flush()
    _, wait_status = os.waitpid(pid, 0)
    answers.write(f"{os.waitstatus_to_exitcode(wait_status)}\n")
    answers.flush()
"""

_COLD = os.environ.get("DEVICECTX_TESTS_COLD_PYTHON") == "1"
# The environment the server imports torch with: this process's as the tests were
# collected, not whatever a test has set when the first run starts the server.
_STARTING_ENV = dict(os.environ)


class _Server:
    """The server of this process (a forked test process starts its own), its answers
    read unbuffered so that a wait for one can time out."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.log = tempfile.NamedTemporaryFile(prefix="warm-python-server-", suffix=".log")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=_STARTING_ENV,
            bufsize=0,
        )
        atexit.register(self.stop)

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.process.poll() is None

    def ask(self, request: dict[str, object], timeout: float | None) -> int:
        """Send ``request``; the child's exit status. A child still running after
        ``timeout`` seconds is killed, and TimeoutExpired raised."""
        assert self.process.stdin is not None
        unsent = memoryview(json.dumps(request).encode() + b"\n")
        while unsent:  # a raw pipe may take part of a large request (an environment)
            unsent = unsent[os.write(self.process.stdin.fileno(), unsent) :]
        pid = int(self._answer(None))
        try:
            return int(self._answer(timeout))
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            self._answer(None)
            raise

    def _answer(self, timeout: float | None) -> str:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        read = b""
        while not read.endswith(b"\n"):
            if not select.select([fd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired("warm python", timeout or 0)
            byte = os.read(fd, 1)
            if not byte:
                self.process.wait()
                self.log.seek(0)
                said = self.log.read().decode(errors="replace")[-3000:]
                msg = f"the warm Python server ended (status {self.process.returncode}):\n{said}"
                raise RuntimeError(msg)
            read += byte
        return read.decode()

    def stop(self) -> None:
        """End of input: the server's loop ends and it exits."""
        if self.owner == os.getpid() and self.process.stdin is not None:
            self.process.stdin.close()
            self.process.wait()


_lock = threading.Lock()
_server: _Server | None = None


def run_python(
    source: str,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    ignore_warnings: bool = False,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """What ``python -c source`` gives (``python -W ignore -c`` with ``ignore_warnings``):
    its exit status and output, run in a process forked from one that imported torch.

    ``env`` is the child's whole environment (None: this process's, as now); ``cwd`` its
    working directory (None: this process's). A child still running after ``timeout``
    seconds is killed, and ``subprocess.TimeoutExpired`` raised, as ``subprocess.run``
    does.
    """
    global _server
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
            timeout=timeout,
        )
    with _lock, tempfile.TemporaryDirectory(prefix="warm-python-") as outputs:
        stdout, stderr = Path(outputs, "stdout"), Path(outputs, "stderr")
        request: dict[str, object] = {
            "source": source,
            "env": environment,
            "cwd": folder,
            "ignore_warnings": ignore_warnings,
            "stdout": str(stdout),
            "stderr": str(stderr),
        }
        if _server is None or not _server.alive():
            _server = _Server()
        command = [sys.executable, "-c", source]
        try:
            status = _server.ask(request, timeout)
        except subprocess.TimeoutExpired:
            out, err = stdout.read_text(errors="replace"), stderr.read_text(errors="replace")
            raise subprocess.TimeoutExpired(command, timeout or 0, out, err) from None
        return subprocess.CompletedProcess(
            command, status, stdout.read_text(errors="replace"), stderr.read_text(errors="replace")
        )
