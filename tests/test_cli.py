"""The device report: ``python -m devicectx`` and the ``devicectx`` script, text and JSON."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import python_command

import devicectx
from devicectx import (
    DeviceUnavailableError,
    InvalidDeviceError,
    available_devices,
    explain_device,
    resolve_device,
)
from devicectx.devices._cli import EXIT_BROKEN, EXIT_OK, EXIT_USAGE, format_report, main
from devicectx.devices._report import ENV_VARS, DeviceInfo, gather_report
from devicectx.devices._resolve import accelerator_type

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(sys.executable).with_name("devicectx")
AUTO_ON_CPU = "no accelerator found, so the CPU (set DEVICECTX_DEVICE to choose)"
# The command line itself (`python -m devicectx`, the console script, argparse's exit
# status), a process each: CI's main run has these; the torch range leaves them out, the
# report's content being tested in process there.
tooling = pytest.mark.tooling
no_accelerator = pytest.mark.skipif(
    torch.accelerator.is_available(),
    reason="checks what 'auto' says on a machine without an accelerator",
)
Ran = Callable[..., subprocess.CompletedProcess[str]]  # a run of the command, by its arguments


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m devicectx ARGS`` in a fresh process, with ``env`` added."""
    return subprocess.run(
        python_command("-m", "devicectx", *args),
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=ROOT,
        timeout=120,
        check=False,
    )


@pytest.fixture
def report_here(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Ran:
    """``main(ARGS)`` in this process with ``env`` set, as a finished run of the command.

    The report reads the environment and torch at call time, so a fresh process adds
    nothing to what it says but an interpreter's start (torch's import: seconds); the
    command line itself (``python -m``, the script, its exit status) has tests of its own.
    """

    def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        status = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["devicectx", *args], status, out, err)

    return run


def error_text(variable_value: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The text of the error resolve_device("auto") raises with DEVICECTX_DEVICE set so."""
    monkeypatch.setenv("DEVICECTX_DEVICE", variable_value)
    with pytest.raises((InvalidDeviceError, DeviceUnavailableError)) as caught:
        resolve_device("auto")
    return f"devicectx: {type(caught.value).__name__}: {caught.value}"


@tooling
def test_python_m_devicectx_prints_the_report() -> None:
    """`python -m devicectx` exits 0 and prints every line of the report, on any build.

    A CPU-only build, a CUDA build on a machine without a GPU (cuDNN is still reported),
    and a machine with accelerators (one line per device) all print their own facts.
    """
    result = run_cli()

    report = gather_report()
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    built_for = report.build.summary + ("" if cudnn is None else f", cuDNN {cudnn}")
    devices = [str(device) for device in available_devices()]
    width = max(len(device) for device in devices) + 2
    cpu = f"{platform.machine()}, capability {torch.backends.cpu.get_cpu_capability()}"
    # torch_xla installed (CI's XLA job runs this without PJRT_DEVICE): its row, no device.
    unused = "not used: PJRT_DEVICE is unset (set it to use XLA)"
    xla = [f"xla          torch_xla {report.build.xla}, {unused}"] if report.build.xla else []
    accelerators = format_report(report).splitlines()[5 + len(xla) : 4 + len(xla) + len(devices)]
    set_here = [f"{name}={os.environ[name]}" for name in ENV_VARS if name in os.environ]
    unset = [name for name in ENV_VARS if name not in os.environ]
    environment = "; ".join([*set_here, *([f"unset: {', '.join(unset)}"] if unset else [])])
    expected = [
        f"devicectx    {devicectx.__version__}",
        f"python       {platform.python_version()}, {platform.platform()}",
        f"torch        {torch.__version__}, built for {built_for}",
        *xla,
        f"accelerator  {accelerator_type() or 'none'}",
        f"devices      {'cpu':<{width}}{cpu}",
        *accelerators,
        f"auto         {explain_device()}",
        "default      cpu (torch.get_default_device())",
        f"environment  {environment}",
    ]
    assert (EXIT_OK, "") == (result.returncode, result.stderr)
    assert expected == result.stdout.splitlines()
    assert devices[1:] == [line.split()[0] for line in accelerators]


@pytest.mark.skipif(not SCRIPT.exists(), reason=f"the console script is not installed at {SCRIPT}")
@tooling
def test_the_console_script_prints_the_same_json_as_python_m() -> None:
    """The installed `devicectx` script and `python -m devicectx` give one report."""
    from devicectx.testing import emulated

    # The script itself, or run as a script through the emulated accelerator's runner.
    command = python_command(str(SCRIPT)) if emulated.enabled() else [str(SCRIPT)]
    script = subprocess.run(
        [*command, "--json"], capture_output=True, text=True, timeout=120, check=False
    )
    module = run_cli("--json")

    assert (EXIT_OK, EXIT_OK) == (script.returncode, module.returncode)
    assert json.loads(module.stdout) == json.loads(script.stdout)


@no_accelerator
def test_json_holds_every_fact_of_the_report(report_here: Ran) -> None:
    """--json prints one JSON object with the build, the devices, "auto" and the default."""
    result = report_here("--json", LOCAL_RANK="1")

    report = json.loads(result.stdout)
    assert EXIT_OK == result.returncode
    assert {
        "devicectx",
        "python",
        "platform",
        "build",
        "devices",
        "auto",
        "default_device",
        "environment",
        "problem",
        "job",
        "warnings",
    } == set(report)
    assert torch.__version__ == report["build"]["torch_version"]
    assert (torch.version.cuda, torch.version.hip) == (
        report["build"]["cuda"],
        report["build"]["hip"],
    )
    assert torch.backends.mps.is_built() == report["build"]["mps"]
    assert ["cpu"] == [device["device"] for device in report["devices"]]
    expected_auto = {
        "device": "cpu",
        "reason": "LOCAL_RANK=1 (torchrun) but no accelerator found, so the CPU",
    }
    assert expected_auto == report["auto"]
    assert "cpu" == report["default_device"]
    assert "1" == report["environment"]["LOCAL_RANK"]
    assert report["problem"] is None
    expected_job = {
        "rank": None,
        "world_size": None,
        "local_rank": 1,
        "local_world_size": None,
        "backend": None,
        "prefix": "",
        "malformed": {},
    }
    assert expected_job == report["job"]


def test_devicectx_device_picks_the_device(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """DEVICECTX_DEVICE=meta is where "auto" goes, and the report says why."""
    monkeypatch.setenv("DEVICECTX_DEVICE", "meta")

    status = main(["--json"])

    expected = {"device": "meta", "reason": "environment variable DEVICECTX_DEVICE='meta'"}
    assert (EXIT_OK, expected) == (status, json.loads(capsys.readouterr().out)["auto"])


@pytest.mark.parametrize("value", ["cuda:7", "gpu"])
def test_a_broken_setup_says_what_is_wrong_and_exits_1(
    value: str, monkeypatch: pytest.MonkeyPatch, report_here: Ran
) -> None:
    """A DEVICECTX_DEVICE that is unusable here prints our error on stderr and exits 1."""
    if value == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    expected_error = error_text(value, monkeypatch)

    result = report_here(DEVICECTX_DEVICE=value)

    assert EXIT_BROKEN == result.returncode
    assert expected_error == result.stderr.rstrip("\n")
    assert expected_error.splitlines()[-1] == (
        "fix: set DEVICECTX_DEVICE to one of the devices above (cpu always works), or unset it"
    )
    error_name = expected_error.split(":")[1].strip()
    assert f"auto         cannot be resolved: {error_name} (see below)" in result.stdout


def test_a_broken_setup_in_json_has_the_problem_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With --json, a broken set-up still prints the report, with the problem in it."""
    expected_error = error_text("gpu", monkeypatch)

    status = main(["--json"])

    captured = capsys.readouterr()
    report = json.loads(captured.out)
    problem = report["problem"]
    assert EXIT_BROKEN == status
    assert report["auto"] is None
    assert expected_error == f"devicectx: {problem['error']}: {problem['message']}"
    assert expected_error == captured.err.rstrip("\n")


def test_a_malformed_local_rank_is_a_broken_setup(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """LOCAL_RANK=abc makes "auto" unresolvable: main returns 1 and prints the error."""
    monkeypatch.setenv("LOCAL_RANK", "abc")

    status = main([])

    captured = capsys.readouterr()
    assert EXIT_BROKEN == status
    assert captured.err.startswith("devicectx: InvalidDeviceError: environment variable LOCAL_RANK")


def test_an_unknown_option_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown option returns 2 with argparse's usage line, without raising SystemExit."""
    status = main(["--bogus"])

    captured = capsys.readouterr()
    expected = [
        "usage: devicectx [-h] [--json] [--version]",
        "devicectx: error: unrecognized arguments: --bogus",
    ]
    assert (EXIT_USAGE, "", expected) == (status, captured.out, captured.err.splitlines())


@tooling
def test_an_unknown_option_exits_2_from_the_command_line() -> None:
    """`python -m devicectx --bogus` exits with status 2."""
    assert EXIT_USAGE == run_cli("--bogus").returncode


def test_version_and_help_return_0(capsys: pytest.CaptureFixture[str]) -> None:
    """--version prints the version and --help the usage, both returning 0."""
    assert EXIT_OK == main(["--version"])
    assert f"devicectx {devicectx.__version__}\n" == capsys.readouterr().out
    assert EXIT_OK == main(["--help"])
    assert capsys.readouterr().out.startswith("usage: devicectx [-h] [--json] [--version]")


def test_the_default_device_is_read_at_call_time() -> None:
    """Inside a torch device scope, the report's default device is that device."""
    with torch.device("meta"):
        report = gather_report()
    assert "meta" == report.default_device
    assert "default      meta (torch.get_default_device())" in format_report(report)


def test_the_cpu_is_listed_first_with_its_capability() -> None:
    """The first device is the CPU, with the vector extension torch dispatches to."""
    cpu = gather_report().devices[0]
    assert ("cpu", torch.backends.cpu.get_cpu_capability()) == (cpu.device, cpu.capability)
    assert cpu.memory is None


@pytest.mark.requires_device("cuda")
def test_each_gpu_is_listed_with_its_name_memory_and_capability() -> None:
    """On a GPU machine every device has the name, memory and capability torch reports."""
    devices = gather_report().devices[1:]
    expected = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        capability = (
            properties.gcnArchName
            if torch.version.hip
            else f"{properties.major}.{properties.minor}"
        )
        expected.append((f"cuda:{index}", properties.name, properties.total_memory, capability))
    assert expected == [(d.device, d.name, d.memory, d.capability) for d in devices]


TORCHRUN_RANK_1 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


def test_report_under_torchrun_names_the_rank_on_every_line(report_here: Ran) -> None:
    """Under torchrun (world of 2) each line starts with the rank, and a job line gives
    the ranks and sizes, so that two ranks' interleaved reports can be told apart."""
    result = report_here(**TORCHRUN_RANK_1)

    lines = result.stdout.splitlines()
    assert EXIT_OK == result.returncode
    assert [] == [line for line in lines if not line.startswith("[rank 1] ")]
    expected = "[rank 1] job          rank 1 of 2, local rank 1 of 2, no process group initialised"
    assert expected == lines[-1]


def test_report_json_under_torchrun_carries_the_job(report_here: Ran) -> None:
    """--json carries the same job facts as the text, and the prefix the text uses."""
    result = report_here("--json", **TORCHRUN_RANK_1)

    expected = {
        "rank": 1,
        "world_size": 2,
        "local_rank": 1,
        "local_world_size": 2,
        "backend": None,
        "prefix": "[rank 1] ",
        "malformed": {},
    }
    assert expected == json.loads(result.stdout)["job"]


def test_report_of_a_one_process_world_has_no_prefix(report_here: Ran) -> None:
    """A world of one needs no rank on its lines; the job line is still there."""
    result = report_here(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")

    lines = result.stdout.splitlines()
    assert lines[0].startswith("devicectx ")
    assert "job          rank 0 of 1, local rank 0 of 1, no process group initialised" == lines[-1]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"WORLD_SIZE": "abc"},
            "job          rank ?, local rank ?, no process group initialised; "
            "WORLD_SIZE='abc' is not a world size: torchrun sets it to 1, 2, ...",
        ),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "-1"},
            "[rank 1] job          rank 1 of 2, local rank 0, no process group initialised; "
            "LOCAL_WORLD_SIZE='-1' is not a world size: torchrun sets it to 1, 2, ...",
        ),
        (
            {"RANK": "x"},
            "job          rank ?, local rank ?, no process group initialised; "
            "RANK='x' is not a rank: torchrun sets it to 0, 1, 2, ...",
        ),
    ],
    ids=["world-size", "local-world-size", "rank"],
)
def test_a_malformed_job_variable_is_shown_on_the_job_line(
    env: dict[str, str], expected: str, report_here: Ran
) -> None:
    """A torchrun variable that is not a whole number still gives the job line, which says
    so in the words of a malformed LOCAL_RANK's error; "auto" is not affected (exit 0)."""
    result = report_here(**env)

    assert EXIT_OK == result.returncode
    assert expected == result.stdout.splitlines()[-1]


def test_report_json_lists_malformed_job_variables(report_here: Ran) -> None:
    """--json carries the malformed variables by name, with their values as set."""
    result = report_here("--json", WORLD_SIZE="abc")

    expected = {
        "rank": None,
        "world_size": None,
        "local_rank": None,
        "local_world_size": None,
        "backend": None,
        "prefix": "",
        "malformed": {"WORLD_SIZE": "abc"},
    }
    assert expected == json.loads(result.stdout)["job"]


def test_report_outside_a_job_has_no_job_line(report_here: Ran) -> None:
    """Without torchrun's variables and with no process group the report is as before."""
    env = {name: "" for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    result = report_here(**env)

    assert [] == [line for line in result.stdout.splitlines() if line.startswith("job")]


def test_report_names_an_initialised_process_group() -> None:
    """With a process group initialised in the process, the job line gives its backend
    and the group's own rank and size."""
    code = (
        "import torch.distributed as dist\n"
        "from devicectx.devices._cli import main\n"
        "dist.init_process_group('gloo', rank=0, world_size=1, store=dist.HashStore())\n"
        "main([])\n"
        "dist.destroy_process_group()\n"
    )
    env = {**os.environ, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "RANK": "", "WORLD_SIZE": ""}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=True,
    )

    expected = "job          rank 0 of 1, local rank 0 of 1, process group gloo"
    assert expected == result.stdout.splitlines()[-1]


def test_problem_on_stderr_carries_the_rank() -> None:
    """A broken set-up under torchrun says which rank is broken, on stderr too."""
    result = run_cli(DEVICECTX_DEVICE="cuda:7", **TORCHRUN_RANK_1)

    assert EXIT_BROKEN == result.returncode
    assert result.stderr.startswith("[rank 1] devicectx: ")


def test_each_device_lists_the_dtypes_it_cannot_hold() -> None:
    """The report gives each device the ordinary dtypes it cannot hold, by name: none for the
    CPU; float64 and complex128 for a device playing MPS (the emulated accelerator's "mps"
    profile), whose name and memory are listed too."""
    assert () == gather_report().devices[0].missing_dtypes
    runner = [sys.executable, "-m", "devicectx.testing.emulate", "--profile", "mps"]
    done = subprocess.run(
        [*runner, "-m", "devicectx", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode == 2 and "emulated accelerator" in done.stderr:
        pytest.skip(done.stderr.splitlines()[0])
    assert EXIT_OK == done.returncode, done.stderr
    # Only the CPU and the emulated devices: a GPU machine may list its own too.
    devices = [
        device
        for device in json.loads(done.stdout)["devices"]
        if device["device"] == "cpu" or device["device"].startswith("emu")
    ]
    assert [
        ("cpu", []),
        ("emu:0", ["float64", "complex128"]),
        ("emu:1", ["float64", "complex128"]),
    ] == [(device["device"], device["missing_dtypes"]) for device in devices]
    assert {"devicectx emulated accelerator"} == {device["name"] for device in devices[1:]}
    assert all(isinstance(device["memory"], int) for device in devices[1:])


def test_the_text_report_lists_missing_dtypes_and_a_small_memory_in_mib() -> None:
    """A device line says which dtypes the device cannot hold, and a memory below 1 GiB (a
    limit set for a test) in MiB, not as ``0.0 GiB``."""
    report = gather_report()
    mps_like = DeviceInfo("emu:0", "an MPS-like device", 64 * 2**20, None, ("float64",))
    gpu = DeviceInfo("emu:1", "a GPU", 80 * 2**30, "9.0")
    report = dataclasses.replace(report, devices=[report.devices[0], mps_like, gpu])
    lines = format_report(report).splitlines()
    assert any(line.endswith("emu:0  an MPS-like device, 64.0 MiB, no float64") for line in lines)
    assert any(line.endswith("emu:1  a GPU, 80.0 GiB, capability 9.0") for line in lines)


def _share_env(monkeypatch: pytest.MonkeyPatch, local_rank: int, local_world: str) -> None:
    for name in ("DEVICECTX_DEVICE", "PJRT_DEVICE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)


@pytest.mark.requires_device("accelerator")
def test_local_ranks_sharing_a_device_are_warned_of_and_exit_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """More local ranks than devices: "auto" folds LOCAL_RANK onto the devices, so two ranks
    share one, which NCCL refuses. The report says so on a warning line and under
    "warnings" in JSON; the set-up can run (gloo, or on purpose), so it still exits 0."""
    count = torch.accelerator.device_count()
    kind = accelerator_type()
    _share_env(monkeypatch, count + 1, str(2 * count))
    device = f"{kind}:{1 % count}"
    expected = (
        f"{2 * count} local ranks on {count} {kind} device(s), placed by LOCAL_RANK % {count}: "
        f"local rank {count + 1} shares {device} with local rank 1; NCCL refuses two ranks on "
        f'one GPU ("Duplicate GPU detected"); fix: start {count} processes per machine '
        f"(torchrun --nproc_per_node {count}), or make {2 * count} devices visible"
    )

    status = main([])
    lines = capsys.readouterr().out.splitlines()
    assert EXIT_OK == status
    assert f"warning      {expected}" == lines[-1]
    assert EXIT_OK == main(["--json"])
    assert [expected] == json.loads(capsys.readouterr().out)["warnings"]


@pytest.mark.requires_device("accelerator")
def test_a_local_rank_past_the_devices_is_warned_of_without_a_local_world_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LOCAL_RANK at or past the device count, LOCAL_WORLD_SIZE unset: the ranks below it
    are there too, and one of them has this device."""
    count = torch.accelerator.device_count()
    _share_env(monkeypatch, count, "")
    (warning,) = gather_report().warnings
    assert warning.startswith(f"at least {count + 1} local ranks on {count} ")
    assert f"local rank {count} shares {accelerator_type()}:0 with local rank 0;" in warning


@pytest.mark.requires_device("accelerator")
def test_a_rank_with_a_device_to_itself_still_hears_of_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With one rank more than devices, a rank whose device is its own is told which ranks
    share one: the set-up is the same for every rank, and any rank's report shows it."""
    count = torch.accelerator.device_count()
    if count < 2:
        pytest.skip("needs two devices: with one, every rank shares it")
    _share_env(monkeypatch, 1, str(count + 1))
    (warning,) = gather_report().warnings
    assert f"local rank 1 has {accelerator_type()}:1 to itself; local ranks 0 and {count} " in (
        warning
    )


@pytest.mark.requires_device("accelerator")
def test_a_device_type_without_an_index_under_torchrun_is_warned_of(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DEVICECTX_DEVICE set to the accelerator's type alone, with several local ranks: every
    rank takes the current index (the same device), which NCCL refuses. The report warns,
    with the fix: leave the variable unset (LOCAL_RANK then gives each rank its device)."""
    kind = accelerator_type()
    _share_env(monkeypatch, 1, "2")
    monkeypatch.setenv("DEVICECTX_DEVICE", kind)
    current = torch.accelerator.current_device_index()
    assert [
        f"DEVICECTX_DEVICE={kind} (a device type without an index) puts every one of the 2 "
        f"local ranks on the current {kind} device, {kind}:{current} here; NCCL refuses two "
        f'ranks on one GPU ("Duplicate GPU detected"); fix: unset DEVICECTX_DEVICE, so that '
        f"each rank takes {kind}:LOCAL_RANK, or set it to {kind}:LOCAL_RANK in each rank"
    ] == gather_report().warnings
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank: nothing to share
    assert [] == gather_report().warnings


@pytest.mark.parametrize(
    ("local_rank", "local_world", "variable"),
    [(0, "2", "DEVICECTX_DEVICE"), (1, "1", None), (0, "99", "LOCAL_RANK_ONLY_CPU")],
    ids=["device-named", "one-rank", "no-accelerator"],
)
def test_no_sharing_warning_where_local_rank_does_not_place_the_rank(
    monkeypatch: pytest.MonkeyPatch, local_rank: int, local_world: str, variable: str | None
) -> None:
    """No warning where DEVICECTX_DEVICE names the device (LOCAL_RANK does not place the
    rank), where the ranks fit the devices, or on the CPU, which every rank shares."""
    if variable == "LOCAL_RANK_ONLY_CPU" and torch.accelerator.is_available():
        pytest.skip("checks a machine without an accelerator")
    _share_env(monkeypatch, local_rank, local_world)
    if variable == "DEVICECTX_DEVICE":
        monkeypatch.setenv("DEVICECTX_DEVICE", "cpu")
    assert [] == gather_report().warnings


def test_the_report_gives_python_and_the_platform(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bug report needs the Python version and the operating system: a python line before
    torch's, and both in JSON."""
    assert EXIT_OK == main([])
    lines = capsys.readouterr().out.splitlines()
    expected = f"python       {platform.python_version()}, {platform.platform()}"
    assert expected == lines[1]
    assert EXIT_OK == main(["--json"])
    report = json.loads(capsys.readouterr().out)
    assert (platform.python_version(), platform.platform()) == (
        report["python"],
        report["platform"],
    )
