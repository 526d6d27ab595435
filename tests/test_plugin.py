"""The pytest plugin (``device`` fixture, ``--devices``, ``requires_device``), run with pytester."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from warm_python import run_python

import devicectx
from devicectx import DeviceUnavailableError
from devicectx.devices._resolve import accelerator_type
from devicectx.testing import emulated

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
# The plugin run as users run it, in a pytest of its own (a torch import and the plugin's
# start each, ~5-10 s): CI's main run has these; the torch range's whole suites leave them
# out, the plugin itself serving their own run there.
tooling = pytest.mark.tooling

# A device no machine has: no torch build has 100 CUDA devices.
ABSENT = "cuda:99"
# What "gpu" gets on this machine: its own accelerator, else the CPU (tests/test_resolve.py).
_ACCELERATOR = accelerator_type()
GPU_HINT = (
    f"did you mean {_ACCELERATOR!r} (this machine's accelerator) or 'auto'?"
    if _ACCELERATOR is not None
    else "did you mean 'cpu' (no accelerator here; a GPU is 'cuda' on NVIDIA and AMD, 'mps' "
    "on Apple, 'xpu' on Intel) or 'auto'?"
)

TEST_DEVICE = """
    import torch

    def test_device(device):
        assert isinstance(device, torch.device)
        assert torch.ones(2, device=device).device == device
"""


def unavailable_reason(spec: str) -> str:
    """The first line of resolve_device's error for ``spec`` on this machine."""
    with pytest.raises(DeviceUnavailableError) as info:
        devicectx.resolve_device(spec)
    return str(info.value).partition("\n")[0]


def collected_ids(pytester: pytest.Pytester, *args: str) -> list[str]:
    """The node ids that ``pytest --collect-only`` lists with ``args``."""
    result = pytester.runpytest("--collect-only", "-q", *args)
    return [line for line in result.outlines if "::" in line]


def skip_reasons(reprec: pytest.HookRecorder) -> dict[str, str]:
    """Each skipped test's node id, with its skip reason."""
    reasons = {}
    for report in reprec.getreports("pytest_runtest_logreport"):
        if report.skipped:
            assert isinstance(report.longrepr, tuple)
            reasons[report.nodeid] = report.longrepr[2].removeprefix("Skipped: ")
    return reasons


def test_fixture_ids_are_the_available_devices(pytester: pytest.Pytester) -> None:
    """Without --devices, a test taking `device` runs once per available device, by its name."""
    pytester.makepyfile(test_it=TEST_DEVICE)
    expected = [f"test_it.py::test_device[{d}]" for d in devicectx.available_devices()]
    assert expected == collected_ids(pytester)
    pytester.runpytest().assert_outcomes(passed=len(expected))


def test_fixture_values_are_torch_devices(pytester: pytest.Pytester) -> None:
    """The fixture gives each test the torch.device its id names."""
    pytester.makepyfile(
        test_it="""
        import torch

        def test_device(device, request):
            assert torch.device(request.node.callspec.id) == device
        """
    )
    pytester.runpytest("--devices=cpu,meta").assert_outcomes(passed=2)


def test_devices_option_chooses_the_devices(pytester: pytest.Pytester) -> None:
    """--devices=cpu,meta runs on exactly those, in that order, and dedupes repeats."""
    pytester.makepyfile(test_it=TEST_DEVICE)
    expected = ["test_it.py::test_device[meta]", "test_it.py::test_device[cpu]"]
    assert expected == collected_ids(pytester, "--devices=meta, cpu,meta,cpu:0")
    pytester.runpytest("--devices=meta,cpu").assert_outcomes(passed=2)


def test_missing_listed_device_is_skipped_with_reason(pytester: pytest.Pytester) -> None:
    """A listed device this machine lacks gives a skipped test that says why, not a failure."""
    pytester.makepyfile(test_it=TEST_DEVICE)
    option = f"--devices=cpu,{ABSENT}"
    reprec = pytester.inline_run(option)
    reprec.assertoutcome(passed=1, skipped=1)
    expected = {f"test_it.py::test_device[{ABSENT}]": f"{unavailable_reason(ABSENT)} ({option})"}
    assert expected == skip_reasons(reprec)


def test_missing_device_reason_in_the_summary(pytester: pytest.Pytester) -> None:
    """The skip reason shows in pytest's -rs summary, naming the option."""
    pytester.makepyfile(test_it=TEST_DEVICE)
    result = pytester.runpytest("-rs", f"--devices={ABSENT}")
    expected = [f"SKIPPED [1] test_it.py: {unavailable_reason(ABSENT)} (--devices={ABSENT})"]
    assert expected == [line for line in result.outlines if line.startswith("SKIPPED")]


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        (
            "--devices=cpu,gpu",
            [
                f"ERROR: --devices=cpu,gpu: invalid device 'gpu': unknown device type 'gpu', "
                f"{GPU_HINT}",
                "valid forms: 'auto', 'cpu', 'cuda', 'cuda:1', 'mps', 'xpu', 'meta' (any device "
                "type torch knows, with an optional ':index'), an int index on the current "
                "accelerator, a torch.device, or None (same as 'auto')",
                "fix: --devices=cpu,meta (devices separated by commas)",
            ],
        ),
        (
            "--devices=cpu,,meta",
            [
                "ERROR: --devices='cpu,,meta': an empty device name",
                "fix: list devices separated by commas, e.g. --devices=cpu,meta",
            ],
        ),
        (
            "--devices=",
            [
                "ERROR: --devices='': an empty device name",
                "fix: list devices separated by commas, e.g. --devices=cpu,meta",
            ],
        ),
    ],
    ids=["unknown-type", "empty-item", "empty"],
)
def test_bad_devices_option_is_a_usage_error(
    pytester: pytest.Pytester, option: str, expected: list[str]
) -> None:
    """A malformed --devices stops the run with a usage error that says what to write."""
    pytester.makepyfile(test_it=TEST_DEVICE)
    result = pytester.runpytest(option)
    assert pytest.ExitCode.USAGE_ERROR == result.ret
    assert expected == [line for line in result.errlines if line]


def test_tests_without_device_are_untouched(pytester: pytest.Pytester) -> None:
    """A test that does not take `device` keeps its id and runs once, even with --devices."""
    pytester.makepyfile(test_it="def test_plain(): pass")
    assert ["test_it.py::test_plain"] == collected_ids(pytester, "--devices=cpu,meta")


def test_unused_plugin_looks_up_no_device(pytester: pytest.Pytester) -> None:
    """A session in which no test takes `device` never asks torch for the machine's devices."""
    from devicectx.testing._plugin import _CHOICES

    pytester.makepyfile(test_it="def test_plain(): pass")
    reprec = pytester.inline_run()
    reprec.assertoutcome(passed=1)
    config = reprec.getcalls("pytest_sessionfinish")[0].session.config
    assert _CHOICES not in config.stash


def devicectx_lines(result: pytest.RunResult) -> list[str]:
    """The report's devicectx lines, each with the indented lines that follow it."""
    lines: list[str] = []
    taking = False
    for line in result.outlines:
        taking = line.startswith("devicectx:") or (taking and line.startswith("    "))
        if taking:
            lines.append(line)
    return lines


RECORD_DEVICES = """
    import devicectx

    def test_record():
        with open("devices.txt", "w") as file:
            file.write(", ".join(map(str, devicectx.available_devices())))
"""


@tooling
def test_report_says_when_the_fixture_gives_the_cpu_only(pytester: pytest.Pytester) -> None:
    """Without options, the report names the devices the `device` fixture gives; where that
    is the CPU alone (no accelerator), it says that checks against the CPU compare it with
    itself, and how to add a device (in a process of its own: this one may have the
    emulated accelerator enabled)."""
    pytester.makepyfile(test_it=TEST_DEVICE, test_record=RECORD_DEVICES)
    result = pytester.runpytest_subprocess()
    devices = (pytester.path / "devices.txt").read_text()
    if devices == "cpu":
        expected = [
            "devicectx: the `device` fixture gives cpu only (no accelerator here): checks "
            "with devices=['cpu', device] compare the CPU with itself",
            "    fix: pytest --devicectx-accelerator=emulated, or pytest --devices=cpu,meta",
        ]
    else:  # a machine with an accelerator: it is listed, and nothing is said of "only"
        expected = [f"devicectx: the `device` fixture gives {devices}"]
    assert expected == devicectx_lines(result)


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("--devices=cpu,meta", ["devicectx: the `device` fixture gives cpu, meta"]),
        (
            f"--devices=meta,{ABSENT}",
            [f"devicectx: the `device` fixture gives meta (skipped here: {ABSENT})"],
        ),
        (
            "--devices=cpu",
            [
                "devicectx: the `device` fixture gives cpu only (--devices=cpu): checks with "
                "devices=['cpu', device] compare the CPU with itself",
                "    fix: pytest --devices=cpu,meta",
            ],
        ),
        (
            f"--devices=cpu,{ABSENT}",
            [
                f"devicectx: the `device` fixture gives cpu only (--devices=cpu,{ABSENT}; "
                f"skipped here: {ABSENT}): checks with devices=['cpu', device] compare the "
                "CPU with itself",
                f"    fix: pytest --devices=cpu,{ABSENT},meta",
            ],
        ),
    ],
    ids=["two", "one-skipped", "cpu", "cpu-and-absent"],
)
def test_report_names_the_devices_option(
    pytester: pytest.Pytester, option: str, expected: list[str]
) -> None:
    """With --devices, the report header names the devices the fixture gives (and those it
    skips); the CPU alone is said, with a fix that keeps what was listed."""
    pytester.makepyfile(test_it=TEST_DEVICE)
    assert expected == devicectx_lines(pytester.runpytest(option))


def test_report_has_no_devices_line_where_no_test_takes_the_fixture(
    pytester: pytest.Pytester,
) -> None:
    """A session without options in which no test takes `device` reports nothing of it."""
    pytester.makepyfile(test_it="def test_plain(): pass")
    assert [] == devicectx_lines(pytester.runpytest())


def test_fixture_through_another_fixture(pytester: pytest.Pytester) -> None:
    """A module-scoped fixture may take `device`: it is built once per device."""
    pytester.makepyfile(
        test_it="""
        import pytest
        import torch

        BUILT = []

        @pytest.fixture(scope="module")
        def model(device):
            BUILT.append(device)
            return torch.nn.Linear(2, 2, device=device)

        def test_one(model, device):
            assert model.weight.device == device

        def test_two(model, device):
            assert model.weight.device == device

        def test_built_once_per_device():
            assert [torch.device("cpu"), torch.device("meta")] == BUILT
        """
    )
    pytester.runpytest("--devices=cpu,meta").assert_outcomes(passed=5)


def test_hypothesis_test_may_take_the_fixture(pytester: pytest.Pytester) -> None:
    """A @given test taking `device` passes hypothesis's function-scoped-fixture health check."""
    pytester.makepyfile(
        test_it="""
        from hypothesis import given, strategies as st
        import torch

        @given(n=st.integers(0, 3))
        def test_zeros(device, n):
            assert torch.zeros(n, device=device).device == device
        """
    )
    pytester.runpytest("--devices=cpu,meta").assert_outcomes(passed=2)


def test_own_device_argument_wins(pytester: pytest.Pytester) -> None:
    """A test or conftest that defines `device` itself is not parametrized by the plugin."""
    pytester.makeconftest(
        """
        import pytest

        @pytest.fixture
        def device():
            return "from conftest"
        """
    )
    pytester.makepyfile(
        test_it="""
        import pytest
        from hypothesis import given, strategies as st

        def test_conftest_fixture(device):
            assert device == "from conftest"

        @pytest.mark.parametrize("device", ["a", "b"])
        def test_parametrized(device):
            assert device in ("a", "b")

        @pytest.mark.parametrize("n, device", [(1, "c")])
        def test_parametrized_pair(n, device):
            assert device == "c"

        @given(device=st.just("drawn"))
        def test_drawn(device):
            assert device == "drawn"
        """
    )
    expected = [
        "test_it.py::test_conftest_fixture",
        "test_it.py::test_parametrized[a]",
        "test_it.py::test_parametrized[b]",
        "test_it.py::test_parametrized_pair[1-c]",
        "test_it.py::test_drawn",
    ]
    assert expected == collected_ids(pytester, "--devices=cpu,meta")
    pytester.runpytest("--devices=cpu,meta").assert_outcomes(passed=5)


def test_fixture_requested_at_run_time_fails_clearly(pytester: pytest.Pytester) -> None:
    """request.getfixturevalue('device') cannot be parametrized, and the error says so."""
    pytester.makepyfile(
        test_it="""
        def test_dynamic(request):
            request.getfixturevalue("device")
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    expected = [
        "the 'device' fixture was requested by name at run time (request.getfixturevalue), "
        "so it could not be parametrized over the devices",
        "fix: take `device` as an argument of the test, or of a fixture it uses",
    ]
    start = result.outlines.index(expected[0])
    assert expected == result.outlines[start : start + 2]


MARKED = f"""
    import pytest

    @pytest.mark.requires_device("cpu")
    def test_cpu():
        pass

    @pytest.mark.requires_device("meta")
    def test_meta():
        pass

    @pytest.mark.requires_device("{ABSENT}")
    def test_absent():
        pass

    @pytest.mark.requires_device("cpu")
    @pytest.mark.requires_device("{ABSENT}")
    def test_both():
        pass
"""


def test_marker_skips_with_reason_when_device_is_absent(pytester: pytest.Pytester) -> None:
    """requires_device skips, with the reason, exactly the tests whose device is absent."""
    pytester.makepyfile(test_it=MARKED)
    reprec = pytester.inline_run("--strict-markers")
    reprec.assertoutcome(passed=2, skipped=2)
    reason = f"requires_device({ABSENT!r}): {unavailable_reason(ABSENT)}"
    expected = {"test_it.py::test_absent": reason, "test_it.py::test_both": reason}
    assert expected == skip_reasons(reprec)


def test_marker_skip_points_at_the_test(pytester: pytest.Pytester) -> None:
    """The -rs summary locates a marker skip at the test, as skipif does."""
    pytester.makepyfile(test_it=MARKED)
    result = pytester.runpytest("-rs", "--strict-markers", "-k", "test_absent")
    reason = f"requires_device({ABSENT!r}): {unavailable_reason(ABSENT)}"
    expected = [f"SKIPPED [1] test_it.py:11: {reason}"]
    assert expected == [line for line in result.outlines if line.startswith("SKIPPED")]


def test_marker_is_registered(pytester: pytest.Pytester) -> None:
    """`pytest --markers` documents requires_device, so --strict-markers accepts it."""
    result = pytester.runpytest("--markers")
    expected = (
        "@pytest.mark.requires_device(device): skip the test, with the reason, unless this "
        "machine has the device: a kind ('cuda', 'mps', 'xpu'), one device ('cuda:1'), or "
        "'accelerator' for any accelerator torch.accelerator reports (devicectx)"
    )
    assert expected in result.outlines


@pytest.mark.parametrize(
    ("marker", "expected"),
    [
        (
            "requires_device('gpu')",
            [
                "@pytest.mark.requires_device('gpu'): invalid device 'gpu': unknown device "
                f"type 'gpu', {GPU_HINT}",
                "valid forms: 'auto', 'cpu', 'cuda', 'cuda:1', 'mps', 'xpu', 'meta' (any device "
                "type torch knows, with an optional ':index'), an int index on the current "
                "accelerator, a torch.device, or None (same as 'auto')",
                "fix: @pytest.mark.requires_device('cuda')",
            ],
        ),
        (
            "requires_device()",
            [
                "@pytest.mark.requires_device(): give exactly one device",
                "fix: @pytest.mark.requires_device('cuda')",
            ],
        ),
        (
            "requires_device('cpu', kind='cuda')",
            [
                "@pytest.mark.requires_device('cpu', kind='cuda'): give exactly one device",
                "fix: @pytest.mark.requires_device('cpu')",
            ],
        ),
        (
            "requires_device('cuda:1', 'meta')",
            [
                "@pytest.mark.requires_device('cuda:1', 'meta'): give exactly one device",
                "fix: @pytest.mark.requires_device('cuda:1')",
            ],
        ),
    ],
    ids=["unknown-type", "no-device", "keyword", "two-devices"],
)
def test_malformed_marker_errors_its_test(
    pytester: pytest.Pytester, marker: str, expected: list[str]
) -> None:
    """A malformed requires_device errors its own test with what to write, and no other."""
    pytester.makepyfile(
        test_it=f"""
        import pytest

        @pytest.mark.{marker}
        def test_marked():
            pass

        def test_other():
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, errors=1)
    start = result.outlines.index(expected[0])
    assert expected == result.outlines[start : start + len(expected)]


def test_marker_takes_its_device_by_keyword(pytester: pytest.Pytester) -> None:
    """``requires_device(device="cpu")``, as a user may write it, is the positional form:
    the CPU is everywhere, and a device that is not here skips with the reason."""
    pytester.makepyfile(
        test_it="""
        import pytest

        @pytest.mark.requires_device(device="cpu")
        def test_cpu():
            pass

        @pytest.mark.requires_device(device="cuda:7")
        def test_absent():
            pass
        """
    )
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=1, skipped=1)
    assert any("requires_device('cuda:7'): device 'cuda:7'" in line for line in result.outlines)


@pytest.mark.requires_device("cuda")
def test_fixture_ids_on_cuda(pytester: pytest.Pytester) -> None:
    """On a CUDA machine the ids name each CUDA index, and --devices=cuda means the current one."""
    pytester.makepyfile(test_it=TEST_DEVICE)
    count = torch.cuda.device_count()
    expected = ["test_it.py::test_device[cpu]"]
    expected += [f"test_it.py::test_device[cuda:{i}]" for i in range(count)]
    assert expected == collected_ids(pytester)
    current = f"cuda:{torch.cuda.current_device()}"
    assert [f"test_it.py::test_device[{current}]"] == collected_ids(pytester, "--devices=cuda")
    pytester.runpytest().assert_outcomes(passed=len(expected))


def run_in_root(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter of this venv, from the project root."""
    return run_python(textwrap.dedent(code), cwd=ROOT, timeout=120)


def test_import_devicectx_imports_no_test_tools() -> None:
    """`import devicectx` (and `import devicectx.testing`) never imports hypothesis or pytest."""
    result = run_in_root(
        """
        import sys
        import devicectx
        import devicectx.testing
        loaded = {m.partition(".")[0] for m in sys.modules}
        print(sorted(loaded & {"hypothesis", "pytest", "_pytest"}))
        import devicectx.testing.strategies
        print("hypothesis" in sys.modules)
        """
    )
    assert ("[]\nTrue\n", "") == (result.stdout, result.stderr)


def test_plugin_works_without_hypothesis(tmp_path: Path) -> None:
    """In an environment without hypothesis, the plugin loads and the fixture works."""
    (tmp_path / "test_it.py").write_text(textwrap.dedent(TEST_DEVICE))
    result = run_in_root(
        f"""
        import sys
        from importlib.abc import MetaPathFinder

        class NoHypothesis(MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.partition(".")[0] == "hypothesis":
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

        sys.meta_path.insert(0, NoHypothesis())
        import pytest
        code = pytest.main(
            [{str(tmp_path)!r}, "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
             "--devices=cpu,meta"]
        )
        try:
            from devicectx.testing import strategies
        except ModuleNotFoundError as error:
            print(error)
        sys.exit(code)
        """
    )
    assert 0 == result.returncode, result.stdout + result.stderr
    expected = [
        "2 passed",
        "devicectx.testing.strategies needs hypothesis, which is not installed",
        "fix: pip install -e '.[testing]' (from a clone of devicectx)",
    ]
    assert expected == [line.partition(" in ")[0] for line in result.stdout.splitlines()[-3:]]


@tooling
def test_example_passes_under_the_plugin() -> None:
    """examples/property_test_forward.py passes as a user would run it, on cpu and meta."""
    example = ROOT / "examples" / "property_test_forward.py"
    command = [sys.executable, "-m", "pytest", str(example), "-q", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [*command, "--devices=cpu,meta"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert 0 == result.returncode, result.stdout + result.stderr
    assert "failed" not in result.stdout
    assert "skipped" not in result.stdout


def test_accelerator_marker_follows_torch_accelerator(pytester: pytest.Pytester) -> None:
    """requires_device('accelerator') runs where torch.accelerator has a device, and
    otherwise skips, saying so."""
    pytester.makepyfile(
        test_it="""
        import pytest

        @pytest.mark.requires_device("accelerator")
        def test_any():
            pass
        """
    )
    reprec = pytester.inline_run("--strict-markers")
    if torch.accelerator.is_available():
        reprec.assertoutcome(passed=1)
        return
    reprec.assertoutcome(skipped=1)
    expected = {
        "test_it.py::test_any": "requires_device('accelerator'): no accelerator here "
        "(torch.accelerator.is_available() is False)"
    }
    assert expected == skip_reasons(reprec)


MARKED_DEVICE_TESTS = """
    import pytest
    import torch

    @pytest.mark.requires_device("accelerator")
    def test_accelerator(device):
        assert device.type not in ("cpu", "meta")

    @pytest.mark.requires_device("meta")
    def test_meta(device):
        assert device.type == "meta"
"""


def test_marker_and_fixture_compose(pytester: pytest.Pytester) -> None:
    """A test marked requires_device that takes `device` runs only on the devices the
    marker accepts: an accelerator test never as [cpu]; where none of the devices fits,
    one skipped test says why."""
    pytester.makepyfile(test_it=MARKED_DEVICE_TESTS)
    assert [
        "test_it.py::test_accelerator[accelerator]",
        "test_it.py::test_meta[meta]",
    ] == collected_ids(pytester, "--devices=cpu,meta")
    reprec = pytester.inline_run("--devices=cpu,meta")
    reprec.assertoutcome(passed=1, skipped=1)
    reason = skip_reasons(reprec)["test_it.py::test_accelerator[accelerator]"]
    assert reason == (
        "requires_device('accelerator'): none of the devices to test on is one "
        "(they are: cpu, meta)"
    )
    accelerators = [d for d in devicectx.available_devices() if d.type not in ("cpu", "meta")]
    expected = [f"test_it.py::test_accelerator[{d}]" for d in accelerators] or [
        "test_it.py::test_accelerator[accelerator]"
    ]
    assert expected == collected_ids(pytester, "-k", "test_accelerator")


EMULATED_TESTS = """
    import pytest
    import torch

    def test_device(device):
        assert torch.ones(2, device=device).device == device

    @pytest.mark.requires_device("accelerator")
    def test_accelerator():
        assert torch.accelerator.is_available()
"""


@pytest.fixture
def build_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the emulated accelerator's build cache where it is: pytester's subprocesses get
    a HOME of their own, and would build it from scratch (a minute) in each test."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    monkeypatch.setenv("XDG_CACHE_HOME", base)


CONFTEST_PLAYING_MPS = """
from devicectx.testing import emulated

emulated.enable(devices=3, profile="mps")
"""


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            ["--devicectx-accelerator=emulated"],
            [
                "ERROR: --devicectx-accelerator=emulated: plays a CUDA GPU, and the emulated "
                "accelerator is already enabled playing mps (enable(profile=...) or configure() "
                "in a conftest or a plugin)",
                "fix: --devicectx-accelerator=emulated:mps to keep it, or emulated:cuda to play "
                "CUDA",
            ],
        ),
        (
            ["--devicectx-accelerator=emulated:mps", "--devicectx-emulated-devices=2"],
            [
                "ERROR: --devicectx-emulated-devices=2: the emulated accelerator is already "
                "enabled with 3 devices (enable() in a conftest or a plugin), a count fixed for "
                "the process",
                "fix: --devicectx-emulated-devices=3, or leave the option out",
            ],
        ),
    ],
    ids=["cuda-over-mps", "count"],
)
@pytest.mark.usefixtures("build_cache")
@tooling
def test_options_that_conflict_with_a_conftests_enable_are_usage_errors(
    pytester: pytest.Pytester, options: list[str], expected: list[str]
) -> None:
    """A conftest that enabled the emulated accelerator (3 devices, playing MPS), then an
    option asking for another device or count: a usage error whose fix is an option, not
    the device silently kept (plain ``emulated`` plays CUDA)."""
    pytester.makeconftest(CONFTEST_PLAYING_MPS)
    pytester.makepyfile(test_it="def test_plain(): pass")
    result = pytester.runpytest_subprocess(*options)
    if any("C++17 compiler" in line for line in result.errlines + result.outlines):
        pytest.skip("the emulated accelerator cannot be built here")
    assert expected == [line for line in result.errlines if line.strip()][: len(expected)]


@pytest.mark.parametrize("option", ["emulated:mps", "emulated:cuda"])
@pytest.mark.usefixtures("build_cache")
@tooling
def test_an_option_that_names_the_profile_agrees_with_a_conftests_enable(
    pytester: pytest.Pytester, option: str
) -> None:
    """Naming the profile on the command line keeps the conftest's count (3 devices) and
    plays the profile named: mps holds no float64, cuda does."""
    pytester.makeconftest(CONFTEST_PLAYING_MPS)
    pytester.makepyfile(
        test_it=f"""
        import torch
        from devicectx import supports_dtype

        def test_played(device):
            assert supports_dtype("emu:0", torch.float64) is {option.endswith("cuda")}
        """
    )
    result = pytester.runpytest_subprocess(f"--devicectx-accelerator={option}")
    result.assert_outcomes(passed=4)


def emulated_header(result: pytest.RunResult) -> list[str]:
    """The report header's devicectx lines."""
    return [line for line in result.outlines if line.startswith("devicectx:")]


# One xdist worker is enough to check what workers do, and starts one torch less than two.
@pytest.mark.parametrize("workers", [[], ["-n", "1"]], ids=["in-process", "xdist"])
@pytest.mark.usefixtures("build_cache")
@tooling
def test_emulated_accelerator_option(pytester: pytest.Pytester, workers: list[str]) -> None:
    """--devicectx-accelerator=emulated enables emu before collection: the device fixture
    runs on emu:0 and emu:1, the accelerator marker passes, with xdist workers too."""
    pytester.makepyfile(test_it=EMULATED_TESTS)
    result = pytester.runpytest_subprocess("--devicectx-accelerator=emulated", "-v", *workers)
    header = emulated_header(result)
    if any("unavailable" in line for line in header):
        pytest.skip("\n".join(result.outlines[:12]))
    assert 1 == len(header)
    assert header[0].startswith("devicectx: emulated accelerator 'emu' enabled, 2 devices")
    assert header[0].endswith(" s); the `device` fixture gives cpu, emu:0, emu:1")
    result.assert_outcomes(passed=4)
    for test_id in ["test_device[cpu]", "test_device[emu:0]", "test_device[emu:1]"]:
        assert any(test_id in line and "PASSED" in line for line in result.outlines), test_id


@tooling
def test_emulated_build_failure_skips_with_the_reason(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the emulated accelerator cannot be built, the tests that need it are skipped
    with the reason, which the report header prints once, even with xdist workers."""
    pytester.makepyfile(test_it=EMULATED_TESTS)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    result = pytester.runpytest_subprocess("--devicectx-accelerator=emulated", "-rs", "-n", "1")
    # On a machine with an accelerator of its own, its tests run on it (test_device[cuda:0],
    # test_accelerator); the emulated devices' are skipped either way.
    real = torch.accelerator.is_available() and not emulated.enabled()
    if real:
        result.assert_outcomes(passed=1 + torch.accelerator.device_count() + 1, skipped=2)
    else:
        result.assert_outcomes(passed=1, skipped=3)
    reason = (
        "the emulated accelerator is built at first use and needs a C++17 compiler: "
        "'/nonexistent/c++' is not on PATH"
    )
    header = "devicectx: the emulated accelerator is unavailable; tests that need it are skipped:"
    start = result.outlines.index(header)
    assert [
        header,
        f"    {reason}",
        "    fix: install one (apt-get install g++, or xcode-select --install), or set CXX",
    ] == result.outlines[start : start + 3]
    assert 1 == sum(line.startswith("devicectx:") for line in result.outlines)
    skipped = sorted(line for line in result.outlines if line.startswith("SKIPPED"))
    marker_skip = (
        []
        if real
        else [
            f"SKIPPED [1] test_it.py:7: requires_device('accelerator'): the emulated accelerator "
            f"is unavailable: {reason}"
        ]
    )
    assert [
        *marker_skip,
        f"SKIPPED [2] test_it.py: the emulated accelerator is unavailable: {reason}",
    ] == skipped


EMULATED_MARKED = """
    import pytest

    @pytest.mark.requires_device("emu:1")
    def test_second(device):
        assert device.index == 1

    @pytest.mark.requires_device("emu")
    def test_any_emulated():
        pass
"""


@tooling
def test_emulated_device_marker_skips_without_the_option(pytester: pytest.Pytester) -> None:
    """requires_device('emu:1') in a run without the emulated accelerator skips, saying
    how to turn it on, with or without the `device` fixture (in a process of its own:
    this one may have it enabled)."""
    pytester.makepyfile(test_it=EMULATED_MARKED)
    result = pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(skipped=2)
    how = "the emulated accelerator is not enabled (run pytest --devicectx-accelerator=emulated)"
    assert [
        f"SKIPPED [1] test_it.py:3: requires_device('emu:1'): {how}",
        f"SKIPPED [1] test_it.py:7: requires_device('emu'): {how}",
    ] == [line for line in result.outlines if line.startswith("SKIPPED")]


@tooling
def test_emulated_device_marker_skips_when_the_build_fails(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the emulated accelerator cannot be built, a test that takes `device` and
    requires an emulated device or any accelerator is skipped with the build's reason,
    not a collection error."""
    pytester.makepyfile(
        test_it=EMULATED_MARKED
        + """
    @pytest.mark.requires_device("accelerator")
    def test_accelerator(device):
        pass
"""
    )
    if torch.accelerator.is_available() and not emulated.enabled():
        pytest.skip("checks a machine whose only accelerator would be the emulated one")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    result = pytester.runpytest_subprocess("--devicectx-accelerator=emulated", "-rs")
    result.assert_outcomes(skipped=4)
    why = (
        "the emulated accelerator is unavailable: the emulated accelerator is built at first "
        "use and needs a C++17 compiler: '/nonexistent/c++' is not on PATH"
    )
    assert [
        f"SKIPPED [1] test_it.py:3: {why}",
        f"SKIPPED [1] test_it.py:7: requires_device('emu'): {why}",
        f"SKIPPED [2] test_it.py:11: {why}",
    ] == sorted(line for line in result.outlines if line.startswith("SKIPPED"))


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            ["--devicectx-emulated-devices=4"],
            [
                "ERROR: --devicectx-emulated-devices=4: sets the emulated accelerator's device "
                "count, and --devicectx-accelerator=emulated is not given",
                "fix: pytest --devicectx-accelerator=emulated --devicectx-emulated-devices=4",
            ],
        ),
        (
            ["--devicectx-accelerator=emulated:foo"],
            [
                "ERROR: --devicectx-accelerator: emulated profile 'foo' does not exist: the "
                "profiles are 'cuda', 'mps'",
                "fix: --devicectx-accelerator=emulated:mps",
            ],
        ),
        (
            ["--devicectx-accelerator=cuda"],
            [
                "ERROR: --devicectx-accelerator=cuda: the choices are emulated (which plays a "
                "CUDA GPU) and emulated:PROFILE (emulated:mps plays MPS)",
                "fix: --devicectx-accelerator=emulated",
            ],
        ),
        (
            ["--devicectx-accelerator=mps"],
            [
                "ERROR: --devicectx-accelerator=mps: the choices are emulated (which plays a "
                "CUDA GPU) and emulated:PROFILE (emulated:mps plays MPS)",
                "fix: --devicectx-accelerator=emulated:mps",
            ],
        ),
        (
            ["--devicectx-accelerator=emulated", "--devicectx-emulated-devices=0"],
            [
                "ERROR: --devicectx-emulated-devices=0: between 1 and 16 emulated devices",
                "fix: --devicectx-emulated-devices=4",
            ],
        ),
    ],
    ids=["count-without-accelerator", "unknown-profile", "cuda", "mps", "count-out-of-range"],
)
def test_bad_emulated_options_are_usage_errors(
    pytester: pytest.Pytester, options: list[str], expected: list[str]
) -> None:
    """A device count without the emulated accelerator, an unknown profile or a count out
    of range stops the run before any build, with the fix as command-line options."""
    pytester.makepyfile(test_it=TEST_DEVICE)
    result = pytester.runpytest_inprocess(*options)
    assert pytest.ExitCode.USAGE_ERROR == result.ret
    assert expected == [line for line in result.errlines if line]


@tooling
def test_an_emulated_device_in_devices_without_the_option_says_how(
    pytester: pytest.Pytester,
) -> None:
    """--devices=cpu,emu:0 in a run without the emulated accelerator stops with a usage error
    whose fix turns it on (in a process of its own: this one may have it enabled)."""
    pytester.makepyfile(test_it=TEST_DEVICE)
    result = pytester.runpytest_subprocess("--devices=cpu,emu:0")
    assert pytest.ExitCode.USAGE_ERROR == result.ret
    assert [
        "ERROR: --devices=cpu,emu:0: 'emu:0' is a device of devicectx's emulated accelerator, "
        "which is not enabled in this run",
        "fix: pytest --devicectx-accelerator=emulated --devices=cpu,emu:0",
    ] == [line for line in result.errlines if line]


@pytest.mark.usefixtures("build_cache")
@tooling
def test_the_emulated_devices_option_fix_works(pytester: pytest.Pytester) -> None:
    """The fix that error prints runs the test on the CPU and emu:0."""
    pytester.makepyfile(test_it=TEST_DEVICE)
    result = pytester.runpytest_subprocess(
        "--devicectx-accelerator=emulated", "--devices=cpu,emu:0", "-v"
    )
    if any("unavailable" in line for line in emulated_header(result)):
        pytest.skip("\n".join(result.outlines[:12]))
    result.assert_outcomes(passed=2)
    for test_id in ["test_device[cpu]", "test_device[emu:0]"]:
        assert any(f"{test_id} PASSED" in line for line in result.outlines), test_id


@tooling
def test_an_emulated_device_in_devices_is_skipped_when_the_build_fails(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the emulated accelerator asked for and unbuildable, --devices=cpu,emu:0 runs the
    CPU's test and skips emu:0's with the build's reason, as the fixture's own devices."""
    pytester.makepyfile(test_it=TEST_DEVICE)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    result = pytester.runpytest_subprocess(
        "--devicectx-accelerator=emulated", "--devices=cpu,emu:0", "-rs"
    )
    result.assert_outcomes(passed=1, skipped=1)
    assert [
        "SKIPPED [1] test_it.py: the emulated accelerator is unavailable: the emulated "
        "accelerator is built at first use and needs a C++17 compiler: '/nonexistent/c++' is "
        "not on PATH (--devices=cpu,emu:0)"
    ] == [line for line in result.outlines if line.startswith("SKIPPED")]
