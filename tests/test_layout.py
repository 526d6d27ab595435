"""The package's layout: folders by concern, and what moved still loads under its old path."""

import ast
import functools
import importlib
import pickle
from pathlib import Path
from typing import Any

import pickle_subjects
import pytest
import torch

import devicectx
from devicectx._moved import MOVED

PACKAGE = Path(devicectx.__file__).parent
FOLDERS = ("_torch", "scope", "move", "decorator", "devices")
PICKLES = Path(__file__).parent / "data" / "pickles-0.1.0.pkl"
META = torch.device("meta")


def made_with_0_1_0() -> dict[str, bytes]:
    """The pickles devicectx 0.1.0 made (protocols 2 and 5), by what they hold."""
    with PICKLES.open("rb") as file:
        pickles: dict[str, bytes] = pickle.load(file)
    return pickles


def loaded(name: str) -> list[Any]:
    """The object pickled as ``name`` by 0.1.0, once per protocol, loaded here."""
    found = [
        pickle.loads(data) for key, data in made_with_0_1_0().items() if key.startswith(f"{name}/")
    ]
    assert len(found) == 2, name
    return found


@pytest.mark.parametrize(
    "name",
    ["to_device", "find_devices", "register_container", "device_agnostic", "on_device",
     "current_device", "resolve_device", "explain_device", "available_devices",
     "shrink_batch_on_oom", "MoveError", "DeviceMismatchError"],
)  # fmt: skip
def test_public_objects_pickled_by_0_1_0_load_as_themselves(name: str) -> None:
    """A function or class of devicectx pickled by 0.1.0 (under the module path it had
    then) loads as the same object."""
    assert all(obj is getattr(devicectx, name) for obj in loaded(name))


def test_partials_and_scopes_pickled_by_0_1_0_still_work() -> None:
    """A partial of to_device, a configured decorator and an on_device object pickled by
    0.1.0 load and do what they did."""
    for move in loaded("partial(to_device)"):
        assert move({"x": torch.zeros(2)})["x"].device == META
    for decorate in loaded("device_agnostic(device=)"):
        assert decorate(lambda x: x)(torch.zeros(1)).device == META
    for scope in loaded("on_device('meta')"):
        with scope:
            assert torch.zeros(1).device == META
    for error in loaded("InvalidDeviceError()"):
        assert isinstance(error, devicectx.InvalidDeviceError)


def test_decorated_functions_and_modules_pickled_by_0_1_0_load_and_run() -> None:
    """Decorated functions, methods and a module pickled by 0.1.0 load as the decorated
    objects of their module and run as they do."""
    a, b = torch.ones(2), torch.zeros(2)
    assert all(f is pickle_subjects.loss and f(a, b) == 2 for f in loaded("loss"))
    assert all(f(torch.ones(2)).device == META for f in loaded("step"))  # new: no warning
    assert all(f().device == META for f in loaded("built"))
    assert all(isinstance(f(), pickle_subjects.Model) for f in loaded("Model.make"))
    assert all(torch.equal(f(a), 2 * a) for f in loaded("Model.double"))
    for model in loaded("Model()"):
        assert isinstance(model, pickle_subjects.Model)
        assert model(torch.ones(1, 2)).shape == (1, 2)
    for forward in loaded("Model().forward"):
        assert forward(torch.ones(1, 2)).shape == (1, 2)


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_each_old_module_path_is_the_moved_module(old: str, new: str) -> None:
    """Each module path from before the folders imports the module now at its new path,
    which keeps its own name and spec."""
    module = importlib.import_module(new)
    assert importlib.import_module(old) is module
    assert (module.__name__, module.__spec__ and module.__spec__.name) == (new, new)


def test_the_layout_lists_every_module_that_moved() -> None:
    """The old-path table covers every module of the folders, and only those."""
    in_folders = {
        f"devicectx.{path.parent.name}.{path.stem}"
        for folder in FOLDERS
        for path in (PACKAGE / folder).glob("*.py")
        if path.stem != "__init__"
    }
    assert set(MOVED.values()) == in_folders


def imports_of(path: Path) -> list[tuple[str, str]]:
    """Every ``(module, name)`` a file imports from devicectx, ``name`` empty for a plain
    ``import`` (the package's imports are all absolute: a relative one fails here)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import"
            found += [(node.module or "", alias.name) for alias in node.names]
    return [(module, name) for module, name in found if module.startswith("devicectx")]


@functools.cache
def is_module(name: str) -> bool:
    """Whether ``devicectx.<...>.name`` is a module of the package (not a re-export)."""
    return importlib.util.find_spec(name) is not None


def package_sources() -> list[Path]:
    """The package's Python files, outside the testing kit."""
    return [
        path for path in PACKAGE.rglob("*.py") if "testing" not in path.relative_to(PACKAGE).parts
    ]


def test_no_folder_imports_the_package_above_it() -> None:
    """No module of the package takes a name from ``devicectx/__init__.py`` (its table of
    contents, which imports them): only modules, from where they live."""
    offending = [
        f"{path.relative_to(PACKAGE.parent)}: from {module} import {name}"
        for path in package_sources()
        if path.parent != PACKAGE or path.stem not in {"__init__", "__main__"}
        for module, name in imports_of(path)
        if module == "devicectx" and not is_module(f"devicectx.{name}")
    ]
    assert offending == []


def test_the_torch_folder_depends_on_nothing_of_devicectx_but_its_errors() -> None:
    """``devicectx/_torch/`` is the bottom layer: it imports nothing of devicectx but the
    errors, so a new torch release is checked there alone."""
    imported = {
        module if not name or not is_module(f"{module}.{name}") else f"{module}.{name}"
        for path in (PACKAGE / "_torch").glob("*.py")
        for module, name in imports_of(path)
    }
    assert imported <= {"devicectx._errors", "devicectx._torch"}
