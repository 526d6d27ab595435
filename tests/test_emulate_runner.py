"""``python -m devicectx.testing.emulate``: a script or module run on the emulated accelerator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from devicectx.testing import emulate, emulated

RUNNER = [sys.executable, "-m", "devicectx.testing.emulate"]


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The runner with ``args``, in a fresh process; skips where the build is unavailable."""
    done = subprocess.run(
        [*RUNNER, *args], capture_output=True, text=True, timeout=600, check=False, cwd=cwd
    )
    if done.returncode == 2 and "EmulatedUnavailable" in done.stderr:
        pytest.skip(f"the emulated accelerator: {done.stderr.splitlines()[0]}")
    return done


def usage_error(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The exit status, output and error output of the runner given ``args``, run in this
    process: a usage error stops it before it enables the device, so a fresh process would
    add only torch's import."""
    enabled_before = emulated.enabled()
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        emulate.main(list(args))
    out, err = capsys.readouterr()
    assert enabled_before == emulated.enabled(), "the runner enabled the device first"
    assert isinstance(stopped.value.code, int)
    return stopped.value.code, out, err


def test_a_script_runs_as_main_with_its_own_arguments(tmp_path: Path) -> None:
    """The script runs as ``__main__``, sees its own arguments (options included) and its
    folder on ``sys.path``, and ``"auto"`` is the emulated accelerator, with the runner's
    device count and profile."""
    (tmp_path / "sibling.py").write_text("VALUE = 'sibling'\n")
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch, devicectx, sibling\n"
        "print(__name__, sys.argv[1:], sibling.VALUE)\n"
        "from devicectx.testing import emulated\n"
        "print(devicectx.resolve_device('auto'), torch.accelerator.device_count(),\n"
        "      emulated.settings()['float64'])\n"
    )
    done = run("--devices", "1", "--profile", "mps", str(script), "--epochs", "1")
    assert 0 == done.returncode, done.stderr
    assert ["__main__ ['--epochs', '1'] sibling", "emu:0 1 False"] == done.stdout.splitlines()


def test_a_module_runs_as_python_m_runs_it() -> None:
    """``-m devicectx --json`` runs the device report with its option, on ``emu``."""
    done = run("-m", "devicectx", "--json")
    assert 0 == done.returncode, done.stderr
    assert "emu:0" == json.loads(done.stdout)["auto"]["device"]


def test_without_a_script_it_says_what_to_give() -> None:
    """No script and no module: a usage error (exit 2) saying what to give, from the
    command line."""
    done = subprocess.run([*RUNNER, "--devices", "1"], capture_output=True, text=True, check=False)
    assert 2 == done.returncode
    assert done.stderr.splitlines()[-1].endswith("error: give a script to run, or -m MODULE")


@pytest.mark.parametrize(
    ("option", "problem"),
    [
        (["--devices", "0"], "argument --devices: 0 is not between 1 and 16 (fix: --devices 2)"),
        (
            ["--devices", "two"],
            "argument --devices: 'two' is not a whole number (fix: --devices 2)",
        ),
        (["--delay-ms", "-1"], "argument --delay-ms: -1.0 is not 0 or more (fix: --delay-ms 2)"),
    ],
    ids=["no-devices", "not-a-number", "negative-delay"],
)
def test_a_bad_option_value_is_a_usage_error(
    option: list[str], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A device count or delay enable() would refuse is a usage error (exit 2) that says
    what to write, before the build, not a traceback."""
    status, out, err = usage_error(capsys, *option, "-m", "devicectx")
    assert (2, "") == (status, out)
    assert f"python -m devicectx.testing.emulate: error: {problem}" == err.splitlines()[-1]


@pytest.mark.parametrize(
    ("body", "status", "stderr_end"),
    [
        ("pass", 0, None),
        ("raise SystemExit(3)", 3, None),
        ("raise SystemExit('stopped: no data')", 1, "stopped: no data"),
        ("raise ValueError('bad batch')", 1, "ValueError: bad batch"),
    ],
)
def test_the_process_ends_as_python_ends_it(
    tmp_path: Path, body: str, status: int, stderr_end: str | None
) -> None:
    """The exit status is the script's (its SystemExit, or 1 and the traceback for an
    exception); a non-daemon thread is joined and atexit handlers run, in that order;
    the output is flushed."""
    script = tmp_path / "job.py"
    script.write_text(
        "import atexit, sys, threading\n"
        "atexit.register(lambda: print('atexit', flush=False))\n"
        "sys.stdout.write('unflushed ')\n"
        # still computing when the script's last line has run: joined, or its line is lost
        "threading.Thread(target=lambda: (sum(range(10**7)), print('thread'))).start()\n"
        f"{body}\n"
    )
    done = run("--devices", "1", str(script))
    assert status == done.returncode, done.stderr
    assert ["unflushed thread", "atexit"] == done.stdout.splitlines()
    if stderr_end is not None:
        assert done.stderr.rstrip().endswith(stderr_end)


def test_a_thread_pool_alive_at_the_end_lets_the_process_end(tmp_path: Path) -> None:
    """A ThreadPoolExecutor still referenced when the script ends (by a library's object,
    here a logger's attribute): its idle workers are told to stop as Python tells them,
    and the process ends with the script's status instead of waiting on them for good."""
    script = tmp_path / "serve.py"
    script.write_text(
        "import concurrent.futures, logging\n"
        "pool = concurrent.futures.ThreadPoolExecutor(2)\n"
        "logging.getLogger('serving').pool = pool\n"
        "print(pool.submit(lambda: 41 + 1).result())\n"
    )
    try:
        done = subprocess.run(
            [*RUNNER, "--devices", "1", str(script)],
            capture_output=True,
            text=True,
            timeout=600,  # a safety net: the script ends in seconds, or never
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not end: it waits on the pool's idle workers")
    if done.returncode == 2 and "EmulatedUnavailable" in done.stderr:
        pytest.skip(f"the emulated accelerator: {done.stderr.splitlines()[0]}")
    assert (0, ["42"]) == (done.returncode, done.stdout.splitlines()), done.stderr


def test_a_missing_script_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A script that does not exist: exit 2 and one line saying so, in python's words
    (`python missing.py`), before the build, not runpy's traceback."""
    missing = tmp_path / "missing.py"
    status, out, err = usage_error(capsys, "--devices", "1", str(missing), "--epochs", "1")
    python = subprocess.run(
        [sys.executable, str(missing)], capture_output=True, text=True, check=False
    )
    assert (2, "") == (status, out)
    assert [
        f"python -m devicectx.testing.emulate: can't open file '{missing}': [Errno 2] No such "
        "file or directory"
    ] == err.splitlines()
    assert python.stderr.partition(": ")[2] == err.partition(": ")[2]
    assert python.returncode == status


@pytest.mark.parametrize("module", ["no_such_module_here", "json.no_such_module"])
def test_a_missing_module_is_one_line(module: str) -> None:
    """``-m`` a module that does not exist (or whose parent does not): exit 1 and one line
    in python's words (``python -m missing``), not runpy's traceback."""
    done = subprocess.run(
        [*RUNNER, "--devices", "1", "-m", module, "--epochs", "1"],
        capture_output=True,
        text=True,
        check=False,
    )
    python = subprocess.run(
        [sys.executable, "-m", module], capture_output=True, text=True, check=False
    )
    if done.returncode == 2 and "emulated accelerator" in done.stderr:
        pytest.skip(done.stderr.splitlines()[0])
    assert (1, "") == (done.returncode, done.stdout)
    assert [f"python -m devicectx.testing.emulate: No module named {module}"] == (
        done.stderr.splitlines()
    )
    assert python.stderr.partition(": ")[2] == done.stderr.partition(": ")[2]
    assert python.returncode == done.returncode
