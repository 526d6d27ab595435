"""The package as installed: version, public names, typing marker, and the README's commands."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import typing
from importlib.metadata import version
from pathlib import Path

import torch

import devicectx
import devicectx.testing

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
SETUP_COMMANDS = re.findall(r"^pip install .*$", README, flags=re.MULTILINE)


def test_version_matches_metadata_and_pyproject() -> None:
    """__version__ comes from the installed metadata, which comes from pyproject.toml."""
    # a regex, not tomllib: the tests run on Python 3.10 too
    declared = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert declared is not None
    assert declared.group(1) == version("devicectx") == devicectx.__version__


def test_all_is_sorted_and_importable() -> None:
    """__all__ is sorted, and every name in it exists."""
    assert sorted(devicectx.__all__) == devicectx.__all__
    for name in devicectx.__all__:
        assert hasattr(devicectx, name), name


def test_public_annotations_evaluate_at_run_time() -> None:
    """What runtime-typing tools read (``typing.get_type_hints``: sphinx-autodoc-typehints,
    beartype, pydantic, typer) resolves for every public function and class, and the public
    aliases are types, which a user composes in an annotation Python evaluates."""
    public = [getattr(devicectx, name) for name in devicectx.__all__]
    public.append(devicectx.testing.assert_device_agnostic)
    for item in public:
        if inspect.isclass(item):
            typing.get_type_hints(item.__init__)
        elif inspect.isfunction(inspect.unwrap(item)):
            typing.get_type_hints(item)
    assert {torch.device, str, int, type(None)} == set(typing.get_args(devicectx.DeviceLike))
    assert devicectx.DeviceLike == devicectx.DeviceLike | None  # a str alias raises TypeError

    def helper(device: devicectx.DeviceLike = "auto") -> torch.device:
        return devicectx.resolve_device(device)

    assert devicectx.DeviceLike == typing.get_type_hints(helper)["device"]


def test_py_typed_marker_ships() -> None:
    """The package carries py.typed, so type checkers read its annotations."""
    assert (Path(devicectx.__file__).parent / "py.typed").is_file()


def test_import_pulls_in_neither_hypothesis_nor_pytest() -> None:
    """``import devicectx`` stays light: the testing kit's dependencies are optional."""
    code = "import sys, devicectx; print(sorted({'hypothesis', 'pytest'} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert "[]" == result.stdout.strip()


def test_the_testing_kit_s_modules_are_attributes_of_its_package() -> None:
    """After ``import devicectx.testing``, ``devicectx.testing.emulated`` is there, as the
    package docstring lists it, without importing it by its own name first."""
    code = "import devicectx.testing as t; print(t.emulated.__name__, t.emulated.enabled())"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert "devicectx.testing.emulated False" == result.stdout.strip()


def test_import_does_not_load_dynamo() -> None:
    """``import devicectx`` adds milliseconds to ``import torch``: dynamo loads only when used."""
    code = "import sys, devicectx; print(sorted({'torch._dynamo', 'sympy'} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert "[]" == result.stdout.strip()


def test_readme_has_exactly_two_setup_commands() -> None:
    """The README gives two set-up commands: run the quickstart, and run the tests."""
    assert 2 == len(SETUP_COMMANDS), SETUP_COMMANDS
    quickstart, tests = SETUP_COMMANDS
    assert quickstart.endswith("python examples/quickstart.py")
    assert "[test]" in tests


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run finds the README's test command the same way this test does."""
    script = (ROOT / ".ci" / "run").read_text()
    pattern = re.search(r'grep -m 1 "(.*?)" README.md', script)
    assert pattern is not None
    grep_pattern = pattern.group(1).replace("\\\\", "\\")
    matches = [line for line in README.splitlines() if re.match(grep_pattern, line)]
    assert [SETUP_COMMANDS[1]] == matches[:1]


def test_readme_states_the_torch_floor_that_pyproject_declares() -> None:
    """The README's "PyTorch >= X" is pyproject's floor, the release CI tests as the floor."""
    declared = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    stated = re.search(r"PyTorch >= ([\d.]+)", README)
    assert declared is not None
    assert stated is not None
    assert declared.group(1) == stated.group(1)
