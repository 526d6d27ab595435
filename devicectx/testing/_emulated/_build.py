"""Build the emulated accelerator at first use, once per set of build inputs.

The C++ sources next to this file are copied into ``$XDG_CACHE_HOME/devicectx/emulated/
torch-<version>-py<XY>/<hash>/`` (``~/.cache`` without ``XDG_CACHE_HOME``) and compiled
there with ``torch.utils.cpp_extension.load`` (ninja and a C++17 compiler); later processes
load what is there. The hash is of everything the build reads (:func:`build_inputs`): the
sources, the compiler, the flags, the include and library paths (torch's and Python's, so
each environment's own), and torch's build. Two environments with the same torch install
share one build; two with their own installs get one each, and alternating between them
rebuilds nothing: ninja rebuilds a folder whenever a compile command changes, so a folder
shared by environments with different paths would be rebuilt by each in turn. A folder
whose build finished holds a stamp (:data:`FINISHED`), and later processes import its
module directly, without asking ninja: ninja rebuilt such a folder now and then with
nothing changed (its log gave the same command two hashes in turn), about 45 s of compiler
each time; the folder's name already covers everything the build reads. A file lock
serialises processes that build at once (pytest-xdist workers): torch's own lock in the
build folder is a plain file that a build killed midway leaves behind, and every later
build then waits for it forever; under our lock no other build can be running, so a
leftover one is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import os
import shutil
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

import torch
from packaging.version import Version

SOURCES = ("runtime.cpp", "backend.cpp", "autocast.cpp", "recurrent.cpp", "bindings.cpp")
FILES = (*SOURCES, "runtime.h")
EXTENSION = "devicectx_emulated"
FINISHED = "devicectx-built"  # written in a build folder once its module has been imported
FLOOR = Version("2.6")  # pyproject.toml's torch floor: older headers differ
CFLAGS = ("-O2",)


class BuildFailed(Exception):
    """The extension could not be built or loaded; the message says why and the fix."""


def build_inputs() -> dict[str, str]:
    """What the build reads besides the sources, by name: a change in any gives another
    build folder. The compiler is named by its resolved path and its file's time (an
    upgrade in place changes the time)."""
    cpp_extension = _cpp_extension()
    compiler = os.environ.get("CXX", "c++")
    found = shutil.which(compiler)
    if found is not None:
        resolved = os.path.realpath(found)
        compiler = f"{resolved} {os.stat(resolved).st_mtime_ns}"
    return {
        "compiler": compiler,
        "flags": " ".join(CFLAGS),
        "torch": f"{torch.__version__} {torch.version.git_version}",
        "torch include": os.pathsep.join(cpp_extension.include_paths()),
        "torch lib": os.pathsep.join(cpp_extension.library_paths()),
        "python": f"{sys.implementation.cache_tag} {sysconfig.get_config_var('SOABI')}",
        "python include": sysconfig.get_paths()["include"],
    }


def cache_dir(inputs: Mapping[str, str] | None = None) -> Path:
    """Where the build of these sources with ``inputs`` (default: :func:`build_inputs`)
    lives."""
    if inputs is None:
        inputs = build_inputs()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    torch_version = torch.__version__.replace("+", "-")
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    digest = hashlib.sha256()
    for source in FILES:
        digest.update(source.encode() + b"\0" + _source(source).read_bytes() + b"\0")
    for name, value in sorted(inputs.items()):
        digest.update(f"{name}={value}".encode() + b"\0")
    folder = f"torch-{torch_version}-{python}"
    return Path(base) / "devicectx" / "emulated" / folder / digest.hexdigest()[:16]


def _source(name: str) -> Path:
    return Path(__file__).with_name(name)


def load() -> ModuleType:
    """Build (or reuse) the extension and import it.

    Raises:
        BuildFailed: no compiler, no ninja, no torch headers, an unsupported torch or
            platform, or a compile error (with the compiler's last lines).
    """
    build = cache_dir()
    if (build / FINISHED).exists():  # written last, under the lock: the module is whole
        return _import(build)
    _check_prerequisites()
    from filelock import FileLock  # a dependency of torch

    cpp_extension = _cpp_extension()

    build.mkdir(parents=True, exist_ok=True)
    with FileLock(str(build / "devicectx-build.lock")):
        (build / "lock").unlink(missing_ok=True)  # torch's, left by a killed build
        for name in FILES:
            copy = build / name
            if not copy.exists():  # copied under the lock, so never half-written
                shutil.copyfile(_source(name), copy)
        try:
            module = cpp_extension.load(
                name=EXTENSION,
                sources=[str(build / source) for source in SOURCES],
                build_directory=str(build),
                extra_cflags=list(CFLAGS),
                verbose=False,
            )
        except (RuntimeError, OSError, ImportError) as error:
            tail = "\n".join(str(error).strip().splitlines()[-12:])
            msg = (
                f"building the emulated accelerator in {build} failed:\n{tail}\n"
                "fix: check that a C++17 compiler works (c++ --version) and that torch's "
                "headers are installed; remove the folder above to build from scratch"
            )
            raise BuildFailed(msg) from None
        if not isinstance(module, ModuleType):  # load() returns the imported module
            raise BuildFailed(f"building the emulated accelerator in {build} gave no module")
        (build / FINISHED).touch()
    return module


def _import(build: Path) -> ModuleType:
    """The finished build's module, imported as ``cpp_extension.load`` imports it."""
    path = build / f"{EXTENSION}.so"
    spec = importlib.util.spec_from_file_location(EXTENSION, path)
    failure = "no module there"
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except (ImportError, OSError) as error:
            failure = str(error)
        else:
            return module
    msg = (
        f"the emulated accelerator's build in {build} cannot be imported: {failure}\n"
        f"fix: remove {build} to build it again"
    )
    raise BuildFailed(msg)


def _cpp_extension() -> ModuleType:
    """``torch.utils.cpp_extension``, imported without the line a CUDA build of torch < 2.7
    prints on stderr where no CUDA runtime is installed ("No CUDA runtime is found, using
    CUDA_HOME=..."): it would land in the output of every process that enables the device."""
    with contextlib.redirect_stderr(io.StringIO()):
        from torch.utils import cpp_extension
    return cpp_extension


def _check_prerequisites() -> None:
    if os.name != "posix":
        msg = (
            f"the emulated accelerator builds on Linux and macOS only, not on {sys.platform}\n"
            "fix: run these tests on Linux (WSL works) or macOS"
        )
        raise BuildFailed(msg)
    release = Version(Version(torch.__version__).base_version)
    if release < FLOOR:
        msg = (
            f"the emulated accelerator needs torch >= {FLOOR}, found {torch.__version__}\n"
            f"fix: pip install 'torch>={FLOOR}'"
        )
        raise BuildFailed(msg)
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        msg = (
            f"the emulated accelerator is built at first use and needs a C++17 compiler: "
            f"{compiler!r} is not on PATH\n"
            "fix: install one (apt-get install g++, or xcode-select --install), or set CXX"
        )
        raise BuildFailed(msg)
    cpp_extension = _cpp_extension()

    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        msg = (
            "the emulated accelerator is built with ninja, which is not installed\n"
            "fix: pip install ninja (or pip install -e '.[testing]' from a clone of devicectx)"
        )
        raise BuildFailed(msg) from None
    headers = Path(cpp_extension.include_paths()[0]) / "ATen" / "ATen.h"
    if not headers.exists():
        msg = (
            f"this torch install has no C++ headers ({headers} is missing)\n"
            "fix: install torch from a wheel of the package index, which ships them"
        )
        raise BuildFailed(msg)
