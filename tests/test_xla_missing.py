"""XLA where torch_xla is not installed, or does not import: nothing else changes, and
asking for ``xla`` says why it is missing and how to get it.

Skipped where torch_xla is installed: test_xla.py covers that machine.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from devicectx import DeviceUnavailableError, available_devices, explain_device, resolve_device
from devicectx.devices import _xla
from devicectx.devices._cli import format_report
from devicectx.devices._report import ENV_VARS, gather_report

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch_xla") is not None,
    reason="torch_xla is installed here: test_xla.py covers this machine",
)

RELEASE = Version(torch.__version__).release
FIX = f'fix: pip install "torch-xla=={RELEASE[0]}.{RELEASE[1]}.*", or pass one of those'


def here() -> str:
    """The "available here" line of an unavailable-device error on this machine."""
    return "available here: " + ", ".join(str(d) for d in [*available_devices(), "meta"])


@pytest.fixture
def fresh_state() -> Iterator[None]:
    """What devicectx knows of torch_xla, forgotten before the test and restored after."""
    kept = _xla.STATE
    _xla.STATE = _xla._Found()
    yield
    _xla.STATE = kept


def test_xla_without_torch_xla_says_what_to_install() -> None:
    """resolve_device("xla") names the missing package and the install command."""
    with pytest.raises(DeviceUnavailableError) as error:
        resolve_device("xla")
    assert [
        "device 'xla' is not available: 'xla' devices come from the torch_xla package, "
        "which is not installed here",
        here(),
        FIX,
    ] == str(error.value).splitlines()


def test_pjrt_device_alone_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """PJRT_DEVICE set without torch_xla: "auto", the devices and the report are as
    without it (the variable may be left over from another environment)."""
    before = explain_device(), available_devices(), format_report(gather_report())
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert before == (explain_device(), available_devices(), format_report(gather_report()))


def test_the_report_has_no_xla_row() -> None:
    """No torch_xla: no xla row, no torch_xla release, no PJRT_DEVICE among the variables."""
    report = gather_report()
    assert (None, False) == (report.build.xla, "PJRT_DEVICE" in ENV_VARS)
    assert not any(line.startswith("xla") for line in format_report(report).splitlines())


@pytest.fixture
def broken_torch_xla(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_state: None) -> str:
    """A torch_xla 2.9.0 on the path that fails to import, as a release built for another
    torch does; the text of its error."""
    message = "libtorch_xla.so: undefined symbol: _ZN5torch4lazy"
    package = tmp_path / "torch_xla"
    package.mkdir()
    (package / "__init__.py").write_text(f"raise ImportError({message!r})\n")
    metadata = tmp_path / "torch_xla-2.9.0.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_xla\nVersion: 2.9.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return message


def test_a_torch_xla_that_does_not_import_is_named(broken_torch_xla: str) -> None:
    """resolve_device("xla") quotes the import error of an installed torch_xla."""
    with pytest.raises(DeviceUnavailableError) as error:
        resolve_device("xla")
    assert [
        "device 'xla' is not available: torch_xla is installed but does not import: "
        f"ImportError: {broken_torch_xla}",
        here(),
        FIX,
    ] == str(error.value).splitlines()


def test_auto_with_pjrt_device_and_a_broken_torch_xla_raises(
    broken_torch_xla: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PJRT_DEVICE asks for XLA and torch_xla fails to import: "auto" refuses, rather than
    run on another device unnoticed; the report shows the problem and the release."""
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    with pytest.raises(DeviceUnavailableError) as error:
        resolve_device("auto")
    assert [
        "environment variable PJRT_DEVICE='TPU' asks for an XLA device, and torch_xla is "
        f"installed but does not import: ImportError: {broken_torch_xla}",
        f'fix: pip install "torch-xla=={RELEASE[0]}.{RELEASE[1]}.*", or unset PJRT_DEVICE '
        "to use torch's own devices",
    ] == str(error.value).splitlines()
    report = gather_report()
    assert (None, "2.9.0") == (report.auto, report.build.xla)
    assert report.problem is not None
    assert str(error.value) == report.problem.message
