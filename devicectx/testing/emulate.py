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

Options before the script: ``--devices N`` (default 2) and ``--delay-ms MS`` (default 2),
as :func:`~devicectx.testing.emulated.enable` takes them. Where the emulated accelerator
cannot be built, it exits with status 2 and says why on stderr.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from devicectx.testing import emulated

_TAKE_A_VALUE = ("--devices", "--delay-ms")


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
        usage="%(prog)s [--devices N] [--delay-ms MS] (SCRIPT | -m MODULE) [ARGS ...]",
        description="Run a script or module with devicectx's emulated accelerator enabled.",
    )
    parser.add_argument("--devices", type=int, default=2, help="emulated devices (default 2)")
    parser.add_argument(
        "--delay-ms", type=float, default=2.0, help="delay of a non_blocking pinned copy"
    )
    options = parser.parse_args(ours)
    if not target or target == ["-m"]:
        parser.error("give a script to run, or -m MODULE")
    try:
        emulated.enable(options.devices, delay_ms=options.delay_ms)
    except emulated.EmulatedUnavailable as error:
        print(f"devicectx.testing.emulate: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    if target[0] == "-m":
        module, *arguments = target[1:]
        sys.argv = [module, *arguments]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, *arguments = target
        sys.argv = [script, *arguments]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
