"""The package's layout: folders by concern, and what moved still loads under its old path."""

import ast
import functools
import importlib
import importlib.util
import pickle
import re
from pathlib import Path
from typing import Any

import pickle_subjects
import pytest
import torch

import devicectx
import devicectx._errors
from devicectx._moved import MOVED
from devicectx._torch import NOT_TORCH_PRIVATE
from devicectx._torch.modes import CURRENT_DEVICE_KEY, SLOT_KEY

pytestmark = pytest.mark.torch_internals  # CI runs it on every minor torch release

PACKAGE = Path(devicectx.__file__).parent
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


#: The private attributes of torch's (and accelerate's) objects that devicectx reaches for,
#: flagged on any object: ``x._base`` is torch's whatever ``x`` is named. devicectx's own
#: private names (``self._lock``, ``_REGISTRY``) are not in it and are not flagged.
TORCH_PRIVATE_ATTRIBUTES = frozenset(
    {
        "_apply",
        "_backward_hooks",
        "_base",
        "_buffers",
        "_cdata",
        "_forward_hooks",
        "_forward_pre_hooks",
        "_hf_hook",
        "_is_view",
        "_modules",
        "_non_persistent_buffers_set",
        "_parameters",
        "_typed_storage",
        "_untyped_storage",
        "_version",
    }
)


#: Names of torch's private state that code reaches by a string, not an attribute path (a key
#: of ``vars(torch.utils._device)`` or of a thread-local's ``__dict__``, a ``getattr``):
#: the keys ``devicectx/_torch/modes.py`` exports for the scope's hot path. Flagged as a
#: string anywhere but a docstring, and as an attribute of any object.
TORCH_PRIVATE_KEYS = frozenset({CURRENT_DEVICE_KEY, SLOT_KEY})


def private_torch_uses(source: str, label: str) -> list[str]:
    """Where ``source`` reaches into torch's private API: an import of a private torch
    module or name, an attribute path from ``torch`` or ``nn`` through a private name, a
    private attribute of torch's objects (``TORCH_PRIVATE_ATTRIBUTES``, on any object), a
    private name of another imported module (``sys._getframe``: listed in
    ``devicectx._torch.NOT_TORCH_PRIVATE`` where it is not torch's), a string naming a
    private torch module (``sys.modules.get("torch._dynamo")``), or a key of torch's
    private state (``TORCH_PRIVATE_KEYS``: ``globals_["CURRENT_DEVICE"]``); docstrings
    aside."""

    def private(dotted: str) -> bool:
        return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))

    tree = ast.parse(source)
    bodies = [
        n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
    ]
    docstrings = {
        id(body[0].value)
        for body in (node.body for node in bodies)
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    }
    inner_attributes = {
        id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
    }
    imported_modules = {
        (alias.asname or alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } - {"torch", "devicectx"}
    found = []
    for node in ast.walk(tree):
        where = f"{label}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if private(a.name)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            if any(private(f"{node.module}.{a.name}") for a in node.names):
                found.append(f"{where} from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and (
            node.attr in TORCH_PRIVATE_ATTRIBUTES or node.attr in TORCH_PRIVATE_KEYS
        ):
            found.append(f"{where} .{node.attr}")
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in imported_modules
            and private(node.attr)
        ):
            found.append(f"{where} {node.value.id}.{node.attr}")
        elif isinstance(node, ast.Attribute) and id(node) not in inner_attributes:
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            dotted = ".".join(reversed(chain))
            if isinstance(inner, ast.Name) and inner.id in {"torch", "nn"} and private(dotted):
                found.append(f"{where} {inner.id}.{dotted}")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and (
                (node.value.startswith("torch.") and private(node.value.split()[0]))
                or node.value in TORCH_PRIVATE_KEYS
            )
        ):
            found.append(f"{where} {node.value!r}")
    return sorted(set(found))


def outside_torch_folder_uses() -> list[str]:
    """Every private use the check finds outside ``devicectx/_torch/``, the testing kit's
    Python included (its accelerator's C++ is built on torch's C++ API, not checked here)."""
    return [
        use
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "_torch"
        for use in private_torch_uses(path.read_text(), str(path.relative_to(PACKAGE)))
    ]


def test_torch_private_api_is_used_only_in_the_torch_folder() -> None:
    """Outside ``devicectx/_torch/`` (the testing kit included), no module imports, reaches
    or names a private part of torch, other than the names ``NOT_TORCH_PRIVATE`` lists: a
    new torch release is checked in that folder."""
    uses = [
        use for use in outside_torch_folder_uses() if use.split(" ", 1)[1] not in NOT_TORCH_PRIVATE
    ]
    assert uses == []


def test_every_name_the_allow_list_gives_is_needed() -> None:
    """Each entry of ``NOT_TORCH_PRIVATE`` is used outside the torch folder and gives a
    reason, so the list cannot keep names nothing needs."""
    used = {use.split(" ", 1)[1] for use in outside_torch_folder_uses()}
    assert sorted(set(NOT_TORCH_PRIVATE) - used) == []
    assert all(reason.strip() for reason in NOT_TORCH_PRIVATE.values())


def test_the_private_api_check_finds_each_kind_of_use() -> None:
    """The check above finds private imports, attribute paths, torch objects' private
    attributes, other modules' private names, module names and keys of torch's private
    state, once each, and passes public ones, devicectx's own private names and
    docstrings."""
    sample = (
        '"""torch._C in a docstring."""\n'
        "import torch.utils._device\n"
        "from torch._C import _len_torch_function_stack\n"
        "x = torch._C._get_privateuse1_backend_name()\n"
        "y = nn.Module._apply\n"
        "z = sys.modules.get('torch.jit._builtins')\n"
        "public = (torch.__version__, torch.compiler.is_compiling, nn.Module.to, 'torch.fx')\n"
        "b = t._base\n"
        "p = m._parameters['w']\n"
        "import sys\n"
        "f = sys._getframe(1)\n"
        "own = (self._lock, _REGISTRY, state._held, x.__dict__)\n"
        "DEVICE_GLOBALS['CURRENT_DEVICE'] = device\n"
        "slot = holder.device_context\n"
        "own_keys = ('CURRENT', 'device', 'context')\n"
    )
    assert [use.split(" ", 1)[0] for use in private_torch_uses(sample, "s")] == [
        f"s:{line}" for line in (11, 13, 14, 2, 3, 4, 5, 6, 8, 9)
    ]


def test_every_test_file_that_reaches_the_torch_folder_is_run_on_every_torch() -> None:
    """A test file that imports from ``devicectx._torch`` carries the ``torch_internals``
    mark, so CI runs it on every minor torch release."""
    tests = Path(__file__).parent
    unmarked = [
        path.name
        for path in sorted(tests.glob("test_*.py"))
        if any(module.startswith("devicectx._torch") for module, _ in imports_of(path))
        and "pytest.mark.torch_internals" not in path.read_text()
    ]
    assert unmarked == []


#: The folders whose ``__init__`` docstring is the map of their modules (a newcomer's first read).
INDEXED_FOLDERS = ("move", "devices", "_torch", "testing", "scope", "decorator")


def unnamed_modules(folder: str) -> list[str]:
    """The modules and subpackages of ``devicectx/<folder>`` that its ``__init__``
    docstring does not name (as ``name``, or at the end of a dotted path:
    ``devicectx.testing.emulated``)."""
    root = PACKAGE / folder
    docstring = ast.get_docstring(ast.parse((root / "__init__.py").read_text())) or ""
    names = sorted(
        path.stem if path.is_file() else path.name
        for path in root.iterdir()
        if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").is_file()
    )
    return [
        f"devicectx/{folder}/{name}"
        for name in names
        if not re.search(rf"(``|[.~`]){re.escape(name)}(?!\w)", docstring)
    ]


@pytest.mark.parametrize("folder", INDEXED_FOLDERS)
def test_each_folder_docstring_names_every_module_in_it(folder: str) -> None:
    """The folder's ``__init__`` docstring names every module and subpackage in it, so that
    it stays the map a newcomer reads the folder by."""
    assert unnamed_modules(folder) == []


def test_every_exception_and_warning_is_devicectx_x() -> None:
    """Every exception and warning class ``devicectx._errors`` defines reports ``devicectx``
    as its module and is exported there: a traceback names what to catch, and a pickle
    of the class (by that name) loads as itself."""
    defined = [
        value
        for value in vars(devicectx._errors).values()
        if isinstance(value, type)
        and issubclass(value, (devicectx.DeviceError, devicectx.DeviceWarning))
    ]
    assert {devicectx.DeviceError, devicectx.DeviceWarning} < set(defined)
    assert [(cls.__name__, "devicectx", cls) for cls in defined] == [
        (cls.__name__, cls.__module__, getattr(devicectx, cls.__name__, None)) for cls in defined
    ]
