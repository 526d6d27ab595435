"""Run a script or module on the emulated accelerator: ``python -m devicectx.testing.emulate``.

The command-line face of :func:`devicectx.testing.emulated.enable`, for code that runs in
a process of its own (a training script, a CLI, each rank of a ``torchrun`` job): the
emulated accelerator is enabled first, so that ``torch.accelerator``, ``"auto"`` and
everything else see ``emu:0`` and ``emu:1``, then the script runs as ``__main__``, with
its own arguments in ``sys.argv``.

Usage::

    python -m devicectx.testing.emulate train.py --epochs 1
    python -m devicectx.testing.emulate -m devicectx           # the device report
    torchrun --nproc_per_node 2 -m devicectx.testing.emulate train.py

Options before the script: ``--devices N`` (default 2), ``--delay-ms MS`` (default 2) and
``--profile NAME`` (``mps``: a device without float64; see
:data:`~devicectx.testing.emulated.PROFILES`), as :func:`~devicectx.testing.emulated.enable`
takes them. Where the emulated accelerator
cannot be built, it exits with status 2 and says why on stderr; so it does, in python's
words, for a script that does not exist.

The process ends as Python ends one (the script's exit status, or 1 and the traceback for
an exception; non-daemon threads joined; ``atexit`` handlers run; output flushed), short of
the interpreter's finalization: the emulated device's worker threads and torch's autograd
thread for the device may still be running then, and C++'s static destructors, run
under them, can abort a process that has already printed its results ("terminate called
without an active exception", as a CUDA process can abort in the same case).
"""

from __future__ import annotations

import argparse
import atexit
import errno
import importlib.util
import os
import runpy
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn, TypeVar

from devicectx.testing import emulated

_TAKE_A_VALUE = ("--devices", "--delay-ms", "--profile")
_N = TypeVar("_N", int, float)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    # Our options come first; everything from the script (or -m MODULE) on is the
    # target's own, options included, as python itself splits its command line.
    split = 0
    while split < len(args) and args[split] != "-m" and args[split].startswith("-"):
        split += 2 if args[split] in _TAKE_A_VALUE else 1
    ours, target = args[:split], args[split:]
    parser = argparse.ArgumentParser(
        prog="python -m devicectx.testing.emulate",
        usage=(
            "%(prog)s [--devices N] [--delay-ms MS] [--profile NAME] (SCRIPT | -m MODULE) "
            "[ARGS ...]"
        ),
        description="Run a script or module with devicectx's emulated accelerator enabled.",
    )
    parser.add_argument(
        "--devices", type=_device_count, default=2, help="emulated devices, 1 to 16 (default 2)"
    )
    parser.add_argument(
        "--delay-ms", type=_delay, default=2.0, help="delay of a non_blocking pinned copy"
    )
    parser.add_argument(
        "--profile", choices=sorted(emulated.PROFILES), help="the device to play (default cuda)"
    )
    options = parser.parse_args(ours)
    if not target or target == ["-m"]:
        parser.error("give a script to run, or -m MODULE")
    if target[0] != "-m" and not os.path.exists(target[0]):
        # Before the build, in python's own words and status (`python nonexist.py`).
        path = os.path.abspath(target[0])
        print(
            f"{parser.prog}: can't open file {path!r}: [Errno {errno.ENOENT}] "
            f"{os.strerror(errno.ENOENT)}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    try:
        emulated.enable(options.devices, delay_ms=options.delay_ms, profile=options.profile)
    except emulated.EmulatedUnavailable as error:
        print(f"devicectx.testing.emulate: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    if target[0] == "-m":
        module, *arguments = target[1:]
        if not _findable(module):  # in python's own words and status (`python -m nonexist`)
            print(f"{parser.prog}: No module named {module}", file=sys.stderr)
            raise SystemExit(1)
        sys.argv = [module, *arguments]
        _run_then_exit(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))
    script, *arguments = target
    sys.argv = [script, *arguments]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
    _run_then_exit(lambda: runpy.run_path(script, run_name="__main__"))


def _findable(module: str) -> bool:
    """Whether ``module`` can be found; looked for after ``enable()``, since finding a
    dotted name imports its parent packages, which then see the device."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that is missing, or not a package
        return False


# Checked here, as enable() checks them, so that a bad value is a usage error (exit 2)
# before the build, not enable()'s ValueError and its traceback after it.


def _device_count(text: str) -> int:
    count = _number(text, int, "a whole number", "--devices 2")
    if not 1 <= count <= 16:
        msg = f"{count} is not between 1 and 16 (fix: --devices 2)"
        raise argparse.ArgumentTypeError(msg)
    return count


def _delay(text: str) -> float:
    delay = _number(text, float, "a number", "--delay-ms 2")
    if not delay >= 0:  # NaN too
        msg = f"{delay} is not 0 or more (fix: --delay-ms 2)"
        raise argparse.ArgumentTypeError(msg)
    return delay


def _number(text: str, kind: Callable[[str], _N], what: str, example: str) -> _N:
    try:
        return kind(text)
    except ValueError:
        msg = f"{text!r} is not {what} (fix: {example})"
        raise argparse.ArgumentTypeError(msg) from None


def _run_then_exit(run: Callable[[], object]) -> NoReturn:
    """Run the target, then end the process as Python would, without its finalization
    (see the module docstring)."""
    try:
        run()
        status = 0
    except SystemExit as exit_:
        status = _status(exit_.code)
    except BaseException:  # what Python does with an uncaught exception: print it, exit 1
        traceback.print_exc()
        status = 1
    # As Python ends: the callbacks threads registered for shutdown first (an idle
    # ThreadPoolExecutor's workers are told to stop there, or joining them never ends),
    # then every thread that is no daemon joined. Private, as in Python 3.10 to 3.14.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)


def _status(code: object) -> int:
    """The exit status Python gives ``SystemExit(code)``: 0 for None, the int, else 1 with
    the code printed on stderr."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    main()
