"""The module paths of devicectx before its modules moved into folders, still importable.

A pickle names a function or class by its module: ``functools.partial(to_device, ...)``
pickled by devicectx 0.1.0 says ``devicectx._move.to_device``, an ``on_device`` object says
``devicectx._context.on_device``. Each old path below is the module now at the new one (the
same object, imported when first asked for, so ``import devicectx`` loads nothing more).

Example:
    >>> import importlib
    >>> import devicectx.move._move
    >>> importlib.import_module("devicectx._move") is devicectx.move._move
    True
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["MOVED", "install"]

# Where each module went, old path -> new path.
MOVED = {
    f"devicectx.{old}": f"devicectx.{new}"
    for old, new in {
        "_torch_modes": "_torch.modes",
        "_dynamo_hooks": "_torch.dynamo",
        **{name: f"scope.{name}" for name in
           ("_context", "_constructors", "_resumed", "_precision", "_audit")},
        **{name: f"move.{name}" for name in
           ("_move", "_walk", "_rebuild", "_containers", "_alias", "_paths", "_skip",
            "_staging", "_pinned", "_transfers", "_prefetch", "_distributed")},
        **{name: f"decorator.{name}" for name in
           ("_decorator", "_wrappers", "_plan", "_compiled", "_probe", "_params", "_inputs",
            "_target", "_mismatch", "_module_watch")},
        **{name: f"devices.{name}" for name in ("_resolve", "_report", "_cli", "_oom")},
    }.items()
}  # fmt: skip


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path, and loads it as the module at the new one."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system has just set the module's __spec__ to the old path's; the
        # module keeps its own, so that it reloads and reports itself under its own name.
        module.__spec__ = module.__spec__.loader_state if module.__spec__ else None


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once: a reload of devicectx adds no second)."""
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(_OldPaths())
