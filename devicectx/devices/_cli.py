"""``devicectx`` / ``python -m devicectx``: print the device report, as text or JSON.

Exit status: 0 when the set-up works, 1 when it is broken (``"auto"`` cannot resolve,
say ``DEVICECTX_DEVICE=cuda:7`` on a machine with one GPU), 2 for a usage error. A
warning (local ranks that share a device) is printed, and the status stays 0: such a
set-up runs under gloo, and some share a device on purpose.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from importlib.metadata import version as _version
from typing import NoReturn

from devicectx.devices._report import DeviceInfo, DeviceReport, JobInfo, gather_report

EXIT_OK = 0
EXIT_BROKEN = 1
EXIT_USAGE = 2

_DESCRIPTION = """\
Print what torch was built with, every device this process can use (name, memory,
capability), the device "auto" resolves to here and why, and torch's current default
device. Exit status: 0 when the set-up works (warnings, such as local ranks that share
a device, included), 1 when it is broken (the problem is printed on stderr), 2 for a
usage error."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the device report command line.

    Example:
        >>> main(["--json"])  # doctest: +SKIP
        0

    Args:
        argv: the arguments without the program name; ``None`` reads ``sys.argv[1:]``.

    Returns:
        The exit status: 0 (``EXIT_OK``) when ``"auto"`` resolves, 1 (``EXIT_BROKEN``)
        when the set-up is broken, 2 (``EXIT_USAGE``) for bad arguments. ``--help``
        and ``--version`` return 0.
    """
    parser = _parser()
    try:
        options = parser.parse_args(argv)
    except _ParserExit as done:
        return done.status

    report = gather_report()
    if options.json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
    else:
        print(format_report(report))
    if report.problem is not None:
        prefix = report.job.prefix if report.job is not None else ""
        problem = f"devicectx: {report.problem.error}: {report.problem.message}"
        print(prefix + problem.replace("\n", "\n" + prefix), file=sys.stderr)
        return EXIT_BROKEN
    return EXIT_OK


def format_report(report: DeviceReport) -> str:
    """The report as aligned text, one fact per line (the CLI's default output)."""
    build = report.build
    built_for = build.summary
    if build.cudnn is not None:
        built_for += f", cuDNN {build.cudnn}"
    if report.auto is not None:
        auto = f"{report.auto.device}: {report.auto.reason}"
    else:
        error = "a broken set-up" if report.problem is None else report.problem.error
        auto = f"cannot be resolved: {error} (see below)"
    rows = [
        ("devicectx", report.devicectx),
        ("python", f"{report.python}, {report.platform}"),
        ("torch", f"{build.torch_version}, built for {built_for}"),
        *([("xla", _xla_line(report))] if build.xla is not None else []),
        ("accelerator", build.accelerator or "none"),
        *(("devices" if i == 0 else "", line) for i, line in enumerate(_device_lines(report))),
        ("auto", auto),
        ("default", f"{report.default_device} (torch.get_default_device())"),
        ("environment", _environment_line(report.environment)),
    ]
    if report.job is not None:
        rows.append(("job", _job_line(report.job)))
    rows += [("warning", warning) for warning in report.warnings]
    width = max(len(key) for key, _ in rows) + 2
    prefix = report.job.prefix if report.job is not None else ""
    return "\n".join(f"{prefix}{key:<{width}}{value}".rstrip() for key, value in rows)


def _xla_line(report: DeviceReport) -> str:
    """``torch_xla 2.9.0, PJRT_DEVICE=TPU``, or why its devices are not listed."""
    pjrt = report.environment.get("PJRT_DEVICE")
    used = f"PJRT_DEVICE={pjrt}" if pjrt else "not used: PJRT_DEVICE is unset (set it to use XLA)"
    return f"torch_xla {report.build.xla}, {used}"


def _job_line(job: JobInfo) -> str:
    """``rank 1 of 2, local rank 1 of 2, process group gloo``."""

    def of(what: str, rank: int | None, size: int | None) -> str:
        shown = "?" if rank is None else str(rank)
        return f"{what} {shown}" + ("" if size is None else f" of {size}")

    backend = f"process group {job.backend}" if job.backend else "no process group initialised"
    line = ", ".join(
        [
            of("rank", job.rank, job.world_size),
            of("local rank", job.local_rank, job.local_world_size),
            backend,
        ]
    )
    return "; ".join([line, *(_malformed(name, value) for name, value in job.malformed.items())])


def _malformed(name: str, value: str) -> str:
    """``WORLD_SIZE='abc' is not a world size: torchrun sets it to 1, 2, ...``, worded as
    resolve_device's error for a malformed LOCAL_RANK."""
    if name.endswith("RANK"):
        return f"{name}={value!r} is not a rank: torchrun sets it to 0, 1, 2, ..."
    return f"{name}={value!r} is not a world size: torchrun sets it to 1, 2, ..."


def _device_lines(report: DeviceReport) -> list[str]:
    width = max(len(info.device) for info in report.devices) + 2
    return [f"{info.device:<{width}}{_describe(info)}".rstrip() for info in report.devices]


def _describe(info: DeviceInfo) -> str:
    facts = [
        *([info.name] if info.name else []),
        *([_memory_text(info.memory)] if info.memory is not None else []),
        *([f"capability {info.capability}"] if info.capability else []),
        *([f"no {'/'.join(info.missing_dtypes)}"] if info.missing_dtypes else []),
    ]
    return ", ".join(facts)


def _memory_text(nbytes: int) -> str:
    # GiB for a GPU; a memory limit set for a test (the emulated device's) may be far less.
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


def _environment_line(environment: dict[str, str | None]) -> str:
    set_ = [f"{name}={value}" for name, value in environment.items() if value is not None]
    unset = [name for name, value in environment.items() if value is None]
    parts = [*set_, *([f"unset: {', '.join(unset)}"] if unset else [])]
    return "; ".join(parts)


class _ParserExit(Exception):
    """argparse wants to exit; ``main`` turns this into its return value instead."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class _Parser(argparse.ArgumentParser):
    # argparse calls sys.exit on --help, --version and usage errors; main() returns
    # its status instead, so it can be called (and tested) like any function.
    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise _ParserExit(status)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="devicectx", description=_DESCRIPTION)
    parser.add_argument(
        "--json", action="store_true", help="print the report as JSON (for programs)"
    )
    parser.add_argument("--version", action="version", version=f"devicectx {_version('devicectx')}")
    return parser
