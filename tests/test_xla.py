"""XLA (torch_xla) as a device like any other: resolution, "auto", moves, the scope, the
decorator, prefetch, the testing kit and the device report.

Runs where torch_xla imports (CI's XLA job: torch_xla on the CPU, ``PJRT_DEVICE=CPU``);
skipped elsewhere. What a machine without torch_xla sees is in test_xla_missing.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import placed
from hypothesis import given
from torch import nn

torch_xla = pytest.importorskip(
    "torch_xla", reason="torch_xla is not installed: CI's XLA job (.ci/xla) runs these"
)

from devicectx import (  # noqa: E402  (after the skip: nothing to test without torch_xla)
    DeviceMismatchError,
    available_devices,
    device_agnostic,
    explain_device,
    find_devices,
    on_device,
    prefetch,
    resolve_device,
    to_device,
)
from devicectx.devices import _xla  # noqa: E402
from devicectx.devices._cli import format_report  # noqa: E402
from devicectx.devices._report import gather_report  # noqa: E402
from devicectx.testing import assert_device_agnostic  # noqa: E402
from devicectx.testing.strategies import nested, tensors  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
XLA = torch.device("xla", 0)


@pytest.fixture
def pjrt(monkeypatch: pytest.MonkeyPatch) -> str:
    """``PJRT_DEVICE`` set, as CI's job sets it (to the PJRT device in use where it is)."""
    value = os.environ.get("PJRT_DEVICE") or "CPU"
    monkeypatch.setenv("PJRT_DEVICE", value)
    return value


class Net(nn.Module):
    """A small model with a parameter on whichever device it is moved to."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


# Resolution and "auto".


def test_xla_resolves_to_torch_xlas_default_device() -> None:
    """``"xla"`` is torch_xla's default device, with its index; ``"xla:0"`` is itself."""
    assert (torch_xla.device(), XLA) == (resolve_device("xla"), resolve_device("xla:0"))
    assert XLA == resolve_device(torch.device("xla"))


def test_auto_picks_xla_where_pjrt_device_is_set(pjrt: str) -> None:
    """With PJRT_DEVICE set, "auto" is torch_xla's default device, and says why."""
    expected = f"{torch_xla.device()}: environment variable PJRT_DEVICE={pjrt!r}: "
    assert expected + "torch_xla's default device" == explain_device()
    assert torch_xla.device() == resolve_device("auto") == resolve_device(None)


def test_devicectx_device_still_comes_first(pjrt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DEVICECTX_DEVICE outranks PJRT_DEVICE, as it outranks every other rule."""
    monkeypatch.setenv("DEVICECTX_DEVICE", "cpu")
    assert "cpu: environment variable DEVICECTX_DEVICE='cpu'" == explain_device()


def test_auto_leaves_xla_alone_without_pjrt_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_xla installed (even imported) but PJRT_DEVICE unset: "auto" is torch's own
    accelerator or the CPU, and available_devices lists no XLA device."""
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    assert "xla" != resolve_device("auto").type
    assert "xla" not in {device.type for device in available_devices()}


def test_available_devices_lists_xla_after_torchs_own(pjrt: str) -> None:
    """With PJRT_DEVICE set, every XLA device of the process follows torch's devices."""
    found = available_devices()
    assert torch_xla.devices() == [device for device in found if device.type == "xla"]
    assert found[-len(torch_xla.devices()) :] == torch_xla.devices()
    assert CPU == found[0]


def test_an_index_past_the_devices_is_refused() -> None:
    """``xla:N`` past the process's XLA devices is unavailable, naming how many there are."""
    count = torch_xla.device_count()
    with pytest.raises(Exception, match=rf"there are {count} 'xla' device\(s\), 0 to {count - 1}"):
        resolve_device(f"xla:{count}")


# Moves.


@given(nested(tensors(devices=["cpu"])))
def test_a_round_trip_keeps_structure_values_and_aliasing(batch: Any) -> None:
    """A nested batch moved to xla and back has its structure, dtypes, shapes and values,
    and places that held one tensor hold one tensor."""
    there = to_device(batch, "xla")
    back = to_device(there, "cpu")
    before, moved, after = (list(placed(obj)) for obj in (batch, there, back))
    assert [path for path, _ in before] == [path for path, _ in after]
    assert {XLA} >= {tensor.device for _, tensor in moved}
    for (_, a), (_, b) in zip(before, after, strict=True):
        assert (a.dtype, a.shape, CPU) == (b.dtype, b.shape, b.device)
        assert torch.equal(a, b)
    sources, results = [t for _, t in before], [t for _, t in moved]
    for i, (a, a_moved) in enumerate(zip(sources, results, strict=True)):
        for b, b_moved in zip(sources[i + 1 :], results[i + 1 :], strict=True):
            assert (a is b) == (a_moved is b_moved)


def test_views_moved_from_xla_hold_their_own_elements() -> None:
    """A slice and a transpose on xla, moved with their base, come back with their own
    values (XLA reports no offset or strides for a view: each is copied alone)."""
    host = torch.arange(6.0)
    base = host.to(XLA)
    back = to_device([base, base[2:4], base.view(2, 3).t()], "cpu")
    assert torch.equal(host, back[0])
    assert torch.equal(host[2:4], back[1])
    assert torch.equal(host.view(2, 3).t(), back[2])


def test_empty_views_past_their_bases_end_arrive_empty() -> None:
    """Empty views of an empty base, at offsets past its end (which ``as_strided`` makes):
    on XLA, whose lowering refuses a view of no element at such an offset, each arrives as
    an empty tensor of its own shape, and the base and a repeated view keep their identity."""
    base = torch.zeros(3, 0, 1)
    views = [base.as_strided((1, 0, 1), (0, 1, 1), 2), base.as_strided((0, 1), (1, 1), 2)]
    batch = [views[0], base, views[1], views[0]]
    there = to_device(batch, "xla")
    assert there[0] is there[3]
    back = to_device(there, "cpu")
    assert [tensor.shape for tensor in batch] == [tensor.shape for tensor in back]
    assert back[0] is back[3]


def test_a_move_copies_at_the_call() -> None:
    """No staging, no stream: a tensor written after its move (non-blocking or not) does
    not change the copy, and a copy back to the host holds what the device computed."""
    for non_blocking in (False, True):
        source = {"x": torch.arange(6.0), "y": [torch.ones(2, dtype=torch.int64)]}
        moved = to_device(source, "xla", non_blocking=non_blocking)
        source["x"].add_(100)
        source["y"][0].zero_()
        assert torch.equal(torch.arange(6.0), moved["x"].cpu())
        assert torch.equal(torch.ones(2, dtype=torch.int64), moved["y"][0].cpu())
        doubled = to_device({"x": moved["x"] * 2}, "cpu", non_blocking=non_blocking)
        assert torch.equal(torch.arange(6.0) * 2, doubled["x"])


def test_find_devices_names_the_paths_on_xla() -> None:
    """find_devices groups xla tensors under their device, by path."""
    batch = {"x": torch.ones(2).to(XLA), "mask": [torch.ones(1), torch.zeros(1).to(XLA)]}
    assert {XLA: ["obj['x']", "obj['mask'][1]"], CPU: ["obj['mask'][0]"]} == find_devices(batch)


def test_on_device_allocates_on_xla() -> None:
    """Inside on_device("xla"), tensors made without device= are on torch_xla's device."""
    with on_device("xla"):
        made = torch.zeros(2), torch.arange(3), torch.tensor([1.0])
    assert [XLA] * 3 == [tensor.device for tensor in made]
    assert CPU == torch.zeros(1).device


# The decorator.


def test_a_decorated_step_returns_to_the_inputs_device() -> None:
    """output="input": the model on xla takes a batch from the host, computes on xla, and
    the result comes back to the host, equal to the step run on the host."""
    model = Net()
    batch = {"x": torch.randn(4, 3)}
    expected = model(batch["x"])
    model.to(XLA)

    @device_agnostic(output="input")
    def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        assert XLA == batch["x"].device
        return model(batch["x"])

    out = step(model, batch)
    assert CPU == out.device
    torch.testing.assert_close(expected, out)


def test_move_false_names_the_path_off_the_models_device() -> None:
    """move=False: a host tensor given with a model on xla is refused, by path, before
    the body runs."""

    @device_agnostic(move=False)
    def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
        raise AssertionError("the body ran")

    model = Net().to(XLA)
    with pytest.raises(DeviceMismatchError) as error:
        step(model, {"x": torch.ones(1, 3), "y": torch.ones(1).to(XLA)})
    assert [
        "test_move_false_names_the_path_off_the_models_device.<locals>.step() got tensors "
        "on 2 devices:",
        "    xla:0 <- batch['y']",
        "    cpu   <- batch['x']",
        "target xla:0 (from the parameters of model (Net))",
        'fix: pass to_device(batch, "xla:0"), '
        "or use @device_agnostic(move=True) to move the arguments",
    ] == str(error.value).splitlines()
    assert {XLA: ["batch['y']"], CPU: ["batch['x']"]} == error.value.devices


# prefetch and the testing kit.


def test_prefetch_delivers_every_batch_in_order() -> None:
    """prefetch to xla moves each batch when it is asked for (no streams) and hands them
    over in order, each on xla with its values."""
    batches = [{"x": torch.full((2,), float(i)), "i": i} for i in range(5)]
    fetched = prefetch(iter(batches), "xla")
    assert not fetched.streams
    got = list(fetched)
    assert list(range(5)) == [batch["i"] for batch in got]
    assert [XLA] * 5 == [batch["x"].device for batch in got]
    assert all(torch.equal(a["x"], b["x"].cpu()) for a, b in zip(batches, got, strict=True))


def test_assert_device_agnostic_runs_on_cpu_and_xla() -> None:
    """The testing kit compares a function's outputs on the CPU and on xla, run on each."""
    seen: list[torch.device] = []

    def scale(x: torch.Tensor) -> dict[str, torch.Tensor]:
        seen.append(x.device)
        return {"y": x * 2, "n": x.new_tensor(x.numel())}

    assert_device_agnostic(scale, torch.arange(4.0), devices=["cpu", "xla"])
    assert [CPU, XLA] == seen


def test_assert_device_agnostic_catches_a_tensor_left_on_the_host() -> None:
    """A function whose output stays on the host when run on xla fails the check."""

    def counts(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor([x.numel()])  # no device=: on the host wherever x is

    with pytest.raises(AssertionError) as error:
        assert_device_agnostic(counts, torch.ones(2), devices=["cpu", "xla"])
    assert "xla:0" in str(error.value)


# The device report.


def test_the_report_lists_xla_with_its_pjrt_device(pjrt: str) -> None:
    """gather_report: the torch_xla release, each XLA device named for its PJRT device."""
    report = gather_report()
    xla_rows = [info for info in report.devices if info.device.startswith("xla")]
    assert _xla.version() == report.build.xla
    assert [str(device) for device in torch_xla.devices()] == [info.device for info in xla_rows]
    assert {f"PJRT {pjrt}"} == {info.name for info in xla_rows}
    assert pjrt == report.environment["PJRT_DEVICE"]


def run_cli(*args: str, **env: str | None) -> subprocess.CompletedProcess[str]:
    """``python -m devicectx ARGS`` in a fresh process; an env value None unsets it."""
    environment = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-m", "devicectx", *args],
        capture_output=True,
        text=True,
        env={key: value for key, value in environment.items() if value is not None},
        cwd=ROOT,
        timeout=300,
        check=False,
    )


def test_python_m_devicectx_prints_xla(pjrt: str) -> None:
    """The text report: a row for torch_xla and its PJRT device, the XLA devices among the
    devices, and "auto" on xla."""
    result = run_cli(PJRT_DEVICE=pjrt)
    lines = result.stdout.splitlines()
    assert (0, "") == (result.returncode, result.stderr)
    assert format_report(gather_report()).splitlines() == lines
    assert f"xla          torch_xla {_xla.version()}, PJRT_DEVICE={pjrt}" == lines[3]
    width = max(len(str(device)) for device in available_devices()) + 2
    assert f"{'':13}{'xla:0':<{width}}PJRT {pjrt}" in lines
    auto = "xla:0: environment variable PJRT_DEVICE={!r}: torch_xla's default device"
    assert f"auto         {auto.format(pjrt)}" in lines


def test_python_m_devicectx_without_pjrt_device_says_xla_is_unused() -> None:
    """PJRT_DEVICE unset: the report says torch_xla is there but unused, lists no XLA
    device, and "auto" is torch's own."""
    result = run_cli(PJRT_DEVICE=None)
    lines = result.stdout.splitlines()
    assert 0 == result.returncode
    expected = f"torch_xla {_xla.version()}, not used: PJRT_DEVICE is unset (set it to use XLA)"
    assert f"xla          {expected}" == lines[3]
    assert not any("xla:" in line for line in lines)
