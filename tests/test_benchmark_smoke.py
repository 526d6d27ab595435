"""The benchmark script's quick mode runs and writes every section, so it cannot rot.

No timing is asserted: the figures of a quick run on a shared machine mean nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import once_per_session, python_command

ROOT = Path(__file__).resolve().parent.parent
SECTIONS_WITH_CASES = ("decorator", "move", "find_devices", "scope", "diagnostics")
STATUSES = {"ok", "not available", "error"}
AUDIT_SUBJECTS = ["no block", "on_device(cpu)", "on_device(cpu, audit=True)", "torch.device(cpu)"]
PEERS = ("send_to_device", "apply_to_collection", "optree.tree_map", "TensorDict.to")

pytestmark = pytest.mark.tooling  # the scripts' own health: CI's main run, not the range's


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One quick run of the script in a fresh interpreter: its output, JSON and markdown
    (one in a session)."""
    result: dict[str, Any] = once_per_session(
        tmp_path_factory, "benchmark-quick-run", lambda: _quick_run(tmp_path_factory)
    )
    return result


def run_script(
    name: str, *argv: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """benchmarks/``name`` run in a fresh interpreter that sees this test's devices, from the
    repository's root; its output captured (the timeout a safety net: seconds, not minutes)."""
    return subprocess.run(
        [*python_command(str(ROOT / "benchmarks" / name)), *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
        check=False,
    )


def _quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    env = {k: v for k, v in os.environ.items() if k not in ("DEVICECTX_DEVICE", "LOCAL_RANK")}
    done = run_script(
        "bench.py",
        "--quick",
        "--json",
        str(out / "figures.json"),
        "--markdown",
        str(out / "report.md"),
        env=env,
    )
    assert 0 == done.returncode, done.stderr
    return {
        "stdout": done.stdout,
        "json": json.loads((out / "figures.json").read_text()),
        "markdown": (out / "report.md").read_text(),
    }


def _subjects(report: dict[str, Any], section: str) -> dict[str, dict[str, Any]]:
    return {
        f"{case}/{name}": figures
        for case, body in report[section]["cases"].items()
        for name, figures in body["subjects"].items()
    }


def test_json_has_every_section(run: dict[str, Any]) -> None:
    """The JSON holds the environment, the rows and the five sections the report promises,
    and more."""
    expected = {
        "environment",
        "rows",
        "decorator",
        "move",
        "find_devices",
        "scope",
        "import",
        "transfer",
        "diagnostics",
        "prefetch",
    }
    assert expected == set(run["json"])


@pytest.mark.parametrize("section", SECTIONS_WITH_CASES)
def test_every_subject_ran_or_says_why_not(run: dict[str, Any], section: str) -> None:
    """Each subject has a known status, and a median exactly when it ran; none crashed."""
    subjects = _subjects(run["json"], section)
    assert subjects
    for name, figures in subjects.items():
        assert figures["status"] in STATUSES, name
        assert (figures["status"] == "ok") == (figures["median_ns"] is not None), name
        assert "error" != figures["status"], (name, figures["detail"])


def _off_default() -> list[str]:
    """The devices the benchmark times as a target that is not the default: meta, and the
    accelerator where there is one."""
    found = ["meta"]
    if torch.accelerator.is_available():
        kind = torch.accelerator.current_accelerator()
        assert kind is not None
        found.append(str(torch.device(kind.type, torch.accelerator.current_device_index())))
    return found


def test_sections_cover_their_cases(run: dict[str, Any]) -> None:
    """Decorator, move and find sections cover the flat, nested and two many-leaf trees
    (the move section also a BatchEncoding and a batch holding a long list of ints);
    the decorator section also each tree under a dtype policy, a decorated module forward
    and three tensors on each device that is not the default, there already and moved
    there at each call; the scope section each op,
    the BERT forwards and a block's entry on each such device (with an accelerator, also a
    BERT forward on it)."""
    report = run["json"]
    decorator = list(report["decorator"]["cases"])
    trees = decorator[:4]
    assert ["flat3", "nested"] == trees[:2]
    off = [f"flat3 {where} {device}" for device in _off_default() for where in ("on", "to")]
    policies = [f"{tree} dtypes=" for tree in trees]  # each tree with a dtype policy
    assert [*trees, *policies, "forward", *off] == decorator
    assert [*trees, "aliased_10", "batch_encoding", "token_ids"] == list(report["move"]["cases"])
    assert trees == list(report["find_devices"]["cases"])
    scope = ["a + b (8x8)", "torch.zeros(8, 8)", "nn.Linear(16, 16) forward", "BERT forward"]
    scope += [f"block entry ({device})" for device in _off_default()]
    if torch.accelerator.is_available():
        scope.append("BERT forward on the accelerator")
    assert scope == list(report["scope"]["cases"])


def test_off_default_targets_are_timed_with_a_target(run: dict[str, Any]) -> None:
    """The rows off the default device: each decorated call on a device that is not the
    default, and each block entered per call, has a row with its target, and every
    subject ran."""
    rows = {row["what"]: row for row in run["json"]["rows"]}
    for device in _off_default():
        added = f"3 flat tensors on {device}, not the default: time @device_agnostic"
        assert "<= 0.5x" == rows[f"{added}(device={device!r}) adds"]["target"]
        entered = f"entering and leaving on_device({device!r}), no block around it"
        assert "<= 2.0x" == rows[entered]["target"]
        for section, case in (
            ("decorator", f"flat3 on {device}"),
            ("scope", f"block entry ({device})"),
        ):
            subjects = run["json"][section]["cases"][case]["subjects"]
            assert all("ok" == s["status"] for s in subjects.values()), (case, subjects)
    bert = "BERT forward (transformers, 4 layers, hidden 32, batch 2x8)"
    assert "<= 1.05x" == rows[f"{bert}, on_device(meta) entered per call"]["target"]


def test_peers_all_ran(run: dict[str, Any]) -> None:
    """The installed peers are measured on every tree of the decorator and move sections."""
    for section in ("decorator", "move"):
        for key, case in run["json"][section]["cases"].items():
            # the model; the calls on a device not the default, beside send_to_device
            # and .to alone; the dtype policy, against the same decorated call without it
            if key == "forward" or key.startswith("flat3 ") or key.endswith(" dtypes="):
                continue
            # a BatchEncoding, which only send_to_device takes as users pass it; a list of
            # ints, which optree (it maps every int) and TensorDict do not take
            peers = (
                ("to_device", "send_to_device")
                if key == "batch_encoding"
                else ("to_device", "send_to_device", "apply_to_collection")
                if key == "token_ids"
                else PEERS
            )
            for peer in peers:
                assert "ok" == case["subjects"][peer]["status"], (section, peer)


def test_moves_at_each_call_measured_beside_the_copies_alone(run: dict[str, Any]) -> None:
    """Three small tensors moved to each device that is not the default are timed with
    to_device, the decorated call, send_to_device and .to on each (the floor)."""
    for device in _off_default():
        case = run["json"]["decorator"]["cases"][f"flat3 to {device}"]
        names = [".to each", "to_device", f"@device_agnostic(device={str(device)!r})"]
        assert [*names, "send_to_device"] == list(case["subjects"])
        assert all("ok" == subject["status"] for subject in case["subjects"].values())


def test_decorated_forward_measured(run: dict[str, Any]) -> None:
    """The model is timed with and without a decorated forward, and the difference kept."""
    forward = run["json"]["decorator"]["cases"]["forward"]
    assert ["model(x)", "decorated model(x)"] == list(forward["subjects"])
    assert ["decorated model(x)"] == list(forward["added_ns"])


def test_scope_section_has_every_context(run: dict[str, Any]) -> None:
    """Each torch call is timed with no scope (twice: the run's noise), in torch's scopes
    and in on_device's."""
    contexts = ["no scope", "no scope, again", "torch.device(meta)", "on_device(meta)"]
    contexts += ["torch.device(cpu)", "on_device(cpu)"]
    cases = dict(run["json"]["scope"]["cases"])
    bert = cases.pop("BERT forward")
    for key in list(cases):  # the entries, and the accelerator's forward: checked elsewhere
        if key.startswith("block entry") or key == "BERT forward on the accelerator":
            del cases[key]
    assert 3 == len(cases)
    for case in cases.values():
        assert contexts == list(case["subjects"])
    forwards = ["no scope", "no scope, again", "torch.device(meta)", "on_device(meta)"]
    forwards += ["decorated, in on_device(meta)", "decorated(scope=False)"]
    forwards += ["torch.device(meta) per call", "on_device(meta) per call"]
    assert forwards == list(bert["subjects"])
    assert all("ok" == subject["status"] for subject in bert["subjects"].values())


def test_peers_copy_an_aliased_tensor_once_per_reference(run: dict[str, Any]) -> None:
    """Copies are counted: each peer turns one tensor reachable 10 times into 10."""
    copies = run["json"]["move"]["cases"]["aliased_10"]["copies"]
    assert {peer: 10 for peer in PEERS} == {peer: copies[peer] for peer in PEERS}


def test_import_cost_measured_in_a_fresh_process(run: dict[str, Any]) -> None:
    """The import section measured ``import devicectx`` after ``import torch``."""
    ours = run["json"]["import"]["devicectx"]
    assert "ok" == ours["status"]
    assert ours["median_ms"] > 0


def test_transfer_skipped_without_accelerator(run: dict[str, Any]) -> None:
    """Without an accelerator the transfer section says so instead of measuring."""
    transfer = run["json"]["transfer"]
    if torch.accelerator.is_available():
        assert "cases" in transfer
    else:
        assert {"skipped": "no accelerator"} == transfer


def test_diagnostics_measure_the_check_the_log_and_the_audit(run: dict[str, Any]) -> None:
    """The repeated-move check on and off and the transfer log ran, for a new batch each
    call and for the same one; audit mode was timed on an op and on a constructor, plain,
    in on_device(cpu) with and without audit, and in torch.device(cpu)."""
    cases = run["json"]["diagnostics"]["cases"]
    for key in ("new_batch", "same_batch"):
        assert {"check on", "check off", "tracked"} == set(cases[key]["subjects"])
    for op in ("x + 1 (4 elements)", "torch.zeros(4)"):
        case = cases[f"audit: {op}"]
        assert AUDIT_SUBJECTS == list(case["subjects"])
        assert ["on_device(cpu, audit=True)"] == list(case["added_ns"])
    for case in cases.values():
        assert all("ok" == s["status"] for s in case["subjects"].values()), case
    rows = [row for row in run["json"]["rows"] if row["section"] == "6 diagnostics"]
    assert 6 == len(rows)
    assert all(row["ours"].startswith("+") for row in rows if "audit" in row["what"])


def test_every_row_is_complete(run: dict[str, Any]) -> None:
    """Every row has what, devicectx, peers, ratio, target and met; met only with a target."""
    fields = {"section", "what", "ours", "peers", "ratio", "target", "met"}
    rows = run["json"]["rows"]
    assert rows
    for row in rows:
        assert fields <= set(row), row
        assert row["met"] in {"yes", "no", "not available", "n/a", ""}, row
        assert (row["met"] == "") == (row["target"] == ""), row


def test_markdown_printed_and_written(run: dict[str, Any]) -> None:
    """The same markdown report is printed and written, starting with the summary table."""
    header = "| section | what | devicectx | peers | ratio | target | met |"
    assert run["markdown"].startswith("# devicectx benchmark\n")
    assert header in run["markdown"]
    assert run["markdown"] in run["stdout"]
    assert len(run["json"]["rows"]) == run["markdown"].split("\n## ")[0].count("\n| ") - 2


def test_prefetch_loop_ran_on_the_host_and_the_accelerator_there_is(run: dict[str, Any]) -> None:
    """The prefetch section timed every loop on cpu and meta, and on the accelerator (real,
    or the emulated one where it builds, else saying why not) from pageable then pinned
    memory; only torchtnt's prefetcher may be missing, off CUDA or uninstalled."""
    section = run["json"]["prefetch"]
    kinds = [(case["kind"], case["source"]) for case in section["cases"].values()]
    assert [("cpu", "pageable"), ("meta", "pageable")] == kinds[:2]

    def accelerator(kind: str) -> list[tuple[str, str]]:
        return [(kind, "pageable"), (kind, "pinned")]

    assert kinds[2:] in (accelerator("accelerator"), accelerator("emulated")) or (
        "emulated" in section["skipped"] and not kinds[2:]
    )
    for key, case in section["cases"].items():
        for name, figures in case["subjects"].items():
            if name == "CudaDataPrefetcher":
                assert figures["status"] in ("ok", "not available"), (key, figures["detail"])
            else:
                assert "ok" == figures["status"], (key, name, figures["detail"])
                assert figures["per_step_ns"] > 0
        assert case["bound_ns"] > 0
        assert set(case["added_ns"]) == {
            "@device_agnostic(device=d)",
            "@device_agnostic(device=d, scope=False)",
        }
    # With the pinned batch on an accelerator, prefetch also ran as a pin-memory thread's
    # batches are moved, with a row of its own.
    pinned = [case for case in section["cases"].values() if case["source"] == "pinned"]
    for case in pinned:
        assert "ok" == case["subjects"]["prefetch, batches as a pin-memory thread's"]["status"]
    rows = [row for row in run["json"]["rows"] if row["section"] == "7 prefetch"]
    assert 3 * len(kinds) + len(pinned) == len(rows)


@pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator")
def test_long_lists_times_each_walk() -> None:
    """benchmarks/long_lists.py prints one time for each walk of its batch."""
    done = run_script("long_lists.py", "--items", "100")
    assert 0 == done.returncode, done.stderr
    labels = [line.partition(": ")[0] for line in done.stdout.splitlines()]
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None
    index = torch.accelerator.current_device_index()
    assert [
        "to_device to meta",
        f"decorated call to {accelerator.type}:{index}",
        "find_devices",
        "prefetch, first batch",
    ] == labels


@pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator")
def test_staged_breakdown_times_every_subject() -> None:
    """benchmarks/staged_breakdown.py --quick prints a time for every subject, with every
    core and with a quarter of them (one table where that is the same count)."""
    done = run_script("staged_breakdown.py", "--quick")
    assert 0 == done.returncode, done.stderr
    rows = [
        line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line
    ]
    subjects = [row.split(" | ")[0].removeprefix("| ") for row in rows if "subject" not in row]
    assert not [row for row in rows if "error" in row or "not available" in row], rows
    chunked = [
        f"staged, {kind}, {size} MiB chunks"
        for size in (4, 16, 64)
        for kind in ("blocking", "host's share")
    ]
    alone = [
        "packing alone",
        "packed and sent by hand, 4 MiB pieces",
        "packed and sent by hand, 16 MiB pieces",
        "per tensor, pinned",
        "staged, blocking, pinned",
        "staged, host's share, pinned",
        "one host copy",
        "link, a copy per tensor",
        "link, one copy",
    ]
    tables = done.stdout.count(" torch threads, ")
    assert tables in (1, 2)
    assert sorted([*alone, "per tensor", *chunked] * tables) == sorted(subjects)
