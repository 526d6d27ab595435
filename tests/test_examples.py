"""Every script in examples/ runs on the CPU and prints what its docstring promises."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import runpy
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import python_command
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from devicectx import DeviceMismatchError, PrecisionUnsupportedError, choose_precision

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# Tested by its owner's own test file, not run from here.
TESTED_ELSEWHERE = {"property_test_forward.py"}
TESTED_HERE = {
    "batches.py",
    "mixed_device_error.py",
    "mixed_precision.py",
    "oom_backoff.py",
    "prefetch.py",
    "quickstart.py",
    "torchrun_inference.py",
    "where_the_bytes_go.py",
}


def run(*command: str) -> subprocess.CompletedProcess[str]:
    """Run ``command`` from the project root on one thread; fail with its stderr if it fails.

    No time limit: on a loaded machine the emulated accelerator's build alone can take
    minutes, and a limit would fail the machine, not the example. A hang is CI's job
    timeout's to catch (torchrun stops the other process when one fails).
    """
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=ROOT,
        # One thread each: the two torchrun processes and the test share a small machine.
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        check=False,
    )
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr}"
    return result


def run_example(name: str, *arguments: str) -> list[str]:
    """The lines an example prints, run as ``python examples/NAME ARGUMENTS...``."""
    return run(*python_command(str(EXAMPLES / name), *arguments)).stdout.splitlines()


def free_port() -> int:
    """A TCP port nobody listens on right now, for torchrun's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def auto_device(local_rank: int | None = None) -> str:
    """Where "auto" goes on this machine, by the documented rules (no DEVICECTX_DEVICE)."""
    if not torch.accelerator.is_available():
        return "cpu"
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None
    if local_rank is None:
        return f"{accelerator.type}:{torch.accelerator.current_device_index()}"
    return f"{accelerator.type}:{local_rank % torch.accelerator.device_count()}"


def test_every_example_is_tested() -> None:
    """Each script in examples/ is run by a test here or by its owner's tests."""
    scripts = {path.name for path in EXAMPLES.glob("*.py")}
    assert TESTED_HERE == scripts - TESTED_ELSEWHERE


def imported_modules(path: Path) -> set[str]:
    """The top-level names of every module ``path`` imports (relative imports aside)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.partition(".")[0])
    return names - {"__future__"}


def installed_by(extra: str | None) -> set[str]:
    """The modules ``pip install -e .`` (``extra`` None) or ``pip install -e '.[extra]'``
    installs: devicectx and the distributions it requires, by their import names."""
    requirements = [Requirement(text) for text in importlib.metadata.requires("devicectx") or []]
    wanted = {
        canonicalize_name(req.name)
        for req in requirements
        if req.marker is None or req.marker.evaluate({"extra": extra or ""})
    }
    modules = {"devicectx"}
    # From each distribution's files (Python 3.10's packages_distributions() reads only
    # top_level.txt, which many wheels, hypothesis's among them, do not ship).
    for dist in importlib.metadata.distributions():
        if canonicalize_name(dist.metadata["Name"]) not in wanted:
            continue
        for file in dist.files or []:
            top = file.parts[0]
            if len(file.parts) > 1 and top != ".." and not top.endswith((".dist-info", ".data")):
                modules.add(top)
            elif len(file.parts) == 1 and file.suffix == ".py":
                modules.add(file.stem)
    return modules


@pytest.mark.parametrize("script", sorted(path.name for path in EXAMPLES.glob("*.py")))
def test_examples_need_only_what_their_install_line_installs(script: str) -> None:
    """Every example imports only the standard library and what the README's first set-up
    command installs (``pip install -e .``), or what the install line in its docstring does
    (``pip install -e '.[testing]'``)."""
    path = EXAMPLES / script
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    extra = re.search(r"pip install -e '\.\[(\w+)\]'", docstring)
    allowed = installed_by(extra.group(1) if extra else None) | set(sys.stdlib_module_names)
    assert set() == imported_modules(path) - allowed


def test_quickstart_runs_on_the_auto_device_and_returns_cpu_outputs() -> None:
    """quickstart.py picks the "auto" device, builds the model there, and returns CPU tensors."""
    lines = run_example("quickstart.py")

    device = auto_device()
    assert [f"device: {device}", f"model on: {device}", "outputs on: cpu"] == lines[:3]
    top = re.fullmatch(r"top classes: \[(\d), (\d), (\d), (\d)\]", lines[3])
    assert top is not None, lines[3]
    assert all(int(label) in range(3) for label in top.groups())
    sums = re.fullmatch(r"probabilities sum to: \[(.*)\]", lines[4])
    assert sums is not None, lines[4]
    assert [pytest.approx(1.0)] * 4 == [float(value) for value in sums.group(1).split(", ")]
    assert 5 == len(lines)


def test_mixed_device_error_shows_our_message_instead_of_pytorchs() -> None:
    """mixed_device_error.py prints PyTorch's error, then DeviceMismatchError's, then the fix."""
    lines = run_example("mixed_device_error.py")

    example = runpy.run_path(str(EXAMPLES / "mixed_device_error.py"))
    model = torch.nn.Linear(4, 2, device="meta")
    with pytest.raises(DeviceMismatchError) as caught:
        example["checked_loss"](model, torch.randn(8, 4), torch.randn(8, 2, device="meta"))
    ours = f"  DeviceMismatchError: {caught.value}".splitlines()
    ours = [ours[0], *(f"  {line}" for line in ours[1:])]

    assert "PyTorch alone:" == lines[0]
    assert lines[1].startswith("  RuntimeError: ")
    start = lines.index("with @device_agnostic(move=False):") + 1
    assert ours == lines[start : start + len(ours)]
    assert [
        "",
        "with @device_agnostic (move=True, the default):",
        "  loss on meta, shape ()",
        "  the caller's inputs are still on cpu",
    ] == lines[start + len(ours) :]


def test_batches_of_every_kind_train_on_the_models_device() -> None:
    """batches.py trains on a dict, a dataclass and a namedtuple; each loss goes down. A
    new batch each step, as a DataLoader gives: nothing is copied again and again (on an
    accelerator, no RepeatedMoveWarning)."""
    result = run(*python_command(str(EXAMPLES / "batches.py")))
    assert "Warning" not in result.stderr, result.stderr
    lines = result.stdout.splitlines()

    assert f"model on: {auto_device()}" == lines[0]
    pattern = r"(\w+) +loss (\d+\.\d+) -> (\d+\.\d+), caller's batch still on cpu"
    matches = [re.fullmatch(pattern, line) for line in lines[1:]]
    assert all(matches), lines
    kinds = [match.group(1) for match in matches if match]
    assert ["dict", "dataclass", "namedtuple"] == kinds
    for match in matches:
        assert match is not None
        assert float(match.group(3)) < float(match.group(2)), match.group(0)


def test_torchrun_inference_runs_two_cooperating_processes() -> None:
    """Under torchrun with 2 processes, each rank picks its device and all_reduce adds counts."""
    # Each rank on the devices this test sees (the emulated accelerator's, where enabled).
    emulate = python_command()[1:]
    result = run(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        *emulate,
        str(EXAMPLES / "torchrun_inference.py"),
    )

    pattern = (
        r"rank (\d)/2: device (\S+) \((.*)\); (\d+) samples, "
        r"classes \[(\d+), (\d+), (\d+)\], all ranks \[(\d+), (\d+), (\d+)\]"
    )
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    matches = [re.fullmatch(pattern, line) for line in lines]
    assert 2 == len(matches), result.stdout
    assert all(matches), lines
    found = [match for match in matches if match]
    assert [0, 1] == [int(match.group(1)) for match in found]
    assert [auto_device(0), auto_device(1)] == [match.group(2) for match in found]
    assert all(f"LOCAL_RANK={rank}" in match.group(3) for rank, match in enumerate(found))
    assert [32, 32] == [int(match.group(4)) for match in found]
    per_rank = [[int(n) for n in match.groups()[4:7]] for match in found]
    totals = [[int(n) for n in match.groups()[7:10]] for match in found]
    assert totals[0] == totals[1], "the ranks disagree on the all_reduce result"
    assert [a + b for a, b in zip(*per_rank, strict=True)] == totals[0]


def test_torchrun_inference_without_torchrun_is_one_process() -> None:
    """Launched with plain python, the torchrun example runs as a world of one and says how
    to start two, instead of torch's error about RANK."""
    lines = run_example("torchrun_inference.py")
    assert lines[0].startswith("not started by torchrun: one process (for two: torchrun ")
    assert lines[0].endswith("torchrun_inference.py)")
    match = re.fullmatch(
        r"rank 0/1: device (\S+) \(.*\); 64 samples, classes \[(\d+), (\d+), (\d+)\], "
        r"all ranks \[(\d+), (\d+), (\d+)\]",
        lines[1],
    )
    assert match is not None, lines
    assert match.groups()[1:4] == match.groups()[4:7]


def test_no_example_run_has_a_time_limit() -> None:
    """No subprocess this file starts has a timeout: a slow machine must not fail here."""
    tree = ast.parse(Path(__file__).read_text())
    limited = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and any(k.arg == "timeout" for k in node.keywords)
    ]
    assert [] == limited


def test_oom_backoff_halves_then_remembers_then_gives_up() -> None:
    """oom_backoff.py halves 256 down to 32, starts the next call at 32, then gives up below 8."""
    lines = run_example("oom_backoff.py")

    first_mean = re.fullmatch(r"  mean output (-?\d+\.\d+) with batch_size=32", lines[4])
    assert first_mean is not None, lines[4]
    mean = first_mean.group(1)
    expected = [
        "first call, batch_size=256:",
        "  log: evaluate(): out of memory at batch_size=256; retrying with batch_size=128 (what "
        "the failed attempt changed, such as gradients it accumulated, is not undone)",
        "  log: evaluate(): out of memory at batch_size=128; retrying with batch_size=64",
        "  log: evaluate(): out of memory at batch_size=64; retrying with batch_size=32",
        f"  mean output {mean} with batch_size=32",
        "second call, batch_size=512: starts at the size that worked",
        "  log: evaluate(): asked for batch_size=512, starting at batch_size=32, the size an "
        "earlier call shrank to (remember=True); later calls held there are not logged",
        f"  mean output {mean} with batch_size=32",
        "a device too small for the minimum batch of 8:",
        "  log: evaluate(): out of memory at batch_size=16; retrying with batch_size=8",
        "  BatchTooLargeError: evaluate() ran out of memory at every batch_size tried: 16, 8 "
        "(minimum=8)",
        "  last error: CUDA out of memory. Tried to allocate 24.00 MiB. GPU 0 has a total "
        "capacity of 10.00 MiB",
        "  fix: @shrink_batch_on_oom(minimum=4) to try smaller batches, or make one sample need "
        "less memory (shorter sequences, torch.autocast), or free memory held outside the call",
        "  sizes tried: [16, 8]",
    ]
    assert expected == lines


@pytest.mark.parametrize("precision_name", ["auto", "bf16-mixed", "16-mixed"])
def test_mixed_precision_trains_one_step_in_the_chosen_precision(precision_name: str) -> None:
    """mixed_precision.py says which precision it chose here, and why, computes its logits in
    that dtype with float32 weights, scales the loss only for float16, and the loss goes down."""
    device = auto_device()
    try:
        precision = choose_precision(device, precision_name)  # type: ignore[arg-type]
    except PrecisionUnsupportedError as error:
        pytest.skip(f"{precision_name} does not run on this machine's {device}: {error}")
    lines = run_example("mixed_precision.py", precision_name)

    assert [
        f"device: {device}",
        f"precision: {precision}",
        f"logits: {precision.dtype or torch.float32}, weights: torch.float32",
        f"grad scaler: {'on' if precision.needs_grad_scaler else 'off'}",
    ] == lines[:4]
    loss = re.fullmatch(r"loss: (\d+\.\d+) -> (\d+\.\d+) after one step", lines[4])
    assert loss is not None, lines[4]
    assert float(loss.group(2)) < float(loss.group(1))
    assert 5 == len(lines)


def test_where_the_bytes_go_finds_the_constant_and_the_stray() -> None:
    """where_the_bytes_go.py: the class weights copied every step warn once and show in the
    table; moved once, they are gone from it; the audited block raises at frombuffer."""
    lines = run_example("where_the_bytes_go.py")
    device = auto_device() if auto_device() != "cpu" else "meta"

    first = lines[: lines.index("2. moved once, before the loop")]
    second = lines[len(first) : lines.index(f"3. an audited block on {device}")]
    warned = [line for line in first if line.startswith("warning: ")]
    assert [
        f"warning: loss_step() copied the same unchanged tensor class_weights (shape (3,), "
        f"torch.float32, 12 B) from cpu to {device} again: 12 B crosses on every call"
    ] == warned
    rows = {line.split()[1]: line.split()[-3:] for line in first if line.startswith("loss_step()")}
    assert {"logits", "labels", "class_weights"} == set(rows)
    assert ["5", "60", "B"] == rows["class_weights"]
    assert "repeated-move warnings: 0" in second
    assert not any("class_weights" in line for line in second)
    assert lines[-2].startswith("StrayTensorError: torch.frombuffer at ")
    assert lines[-2].endswith(f"made a tensor on cpu inside an audited on_device block on {device}")
    assert (
        f'fix: torch.frombuffer(buffer, dtype=...) before the block, then .to("{device}") inside it'
    ) in lines[-1]


def _prefetch_lines(lines: list[str], device: str, streams: bool) -> None:
    """What examples/prefetch.py prints on ``device``: the loader's length, whether a copy
    stream is used, a loss that goes down, and the transfer table."""
    assert [
        f"device: {device}",
        "batches per epoch: 8 (the loader's 8)",
        f"copy stream: {'yes' if streams else 'no (batches move in order)'}",
    ] == lines[:3]
    losses = [
        re.fullmatch(r"epoch (\d): loss (\d+\.\d+) -> (\d+\.\d+)", line) for line in lines[3:6]
    ]
    assert all(losses), lines[3:6]
    assert ["0", "1", "2"] == [match.group(1) for match in losses if match]
    first, last = (float(match.group(2)) for match in losses[::2] if match)
    assert last < first


def test_prefetch_trains_on_batches_moved_ahead() -> None:
    """prefetch.py keeps the loader's length, trains (the loss goes down), and on an
    accelerator counts every copy at its prefetch line, none by the decorated step."""
    lines = run_example("prefetch.py")
    device = lines[0].removeprefix("device: ")  # the example's process enables no emulator
    assert device in (auto_device(), "cpu")

    _prefetch_lines(lines, device, device != "cpu")
    if device == "cpu":
        assert ["no transfers"] == lines[6:]
    else:
        assert all(line.startswith("examples/prefetch.py:") for line in lines[7:-1]), lines


@pytest.mark.skipif(
    not (
        torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == "emu"
    ),
    reason="needs the emulated accelerator built: pytest --devicectx-accelerator=emulated",
)
def test_prefetch_on_the_emulated_accelerator() -> None:
    """prefetch.py emulated: the same training on emu:0, through a copy stream; the table
    shows both tensors of each of the 24 batches copied at the prefetch line."""
    lines = run_example("prefetch.py", "emulated")

    _prefetch_lines(lines, "emu:0", True)
    rows = [line.split() for line in lines[7:]]
    assert ["batch[0]", "batch[1]", "cpu"] == [row[1] for row in rows]
    assert ["24", "24", "48"] == [row[-3] for row in rows]
