"""Being told when a module's tensors may have changed: after ``Module._apply``, and when a
parameter, buffer or submodule is registered.

``torch.nn.Module._apply`` is private, and wrapped here: no hook tells of a move, and every
move of a module's tensors (``.to()``, ``.cuda()``, ``.half()``, ``to_empty()``, ...) goes
through it. Checked on torch 2.6.0, 2.13.0 and 2.15.0 (``_apply(self, fn, recurse=True)``,
recursing through ``module._apply`` of each child, in ``torch/nn/modules/module.py``). The
registration hooks are public (``torch.nn.modules.module.register_module_*_registration_hook``,
torch 2.0 on).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules import module as _torch_module

__all__ = ["RegistrationHook", "watch_modules"]

RegistrationHook = Callable[[nn.Module, str, object], None]
_HOOKS = (
    "register_module_parameter_registration_hook",
    "register_module_buffer_registration_hook",
    "register_module_module_registration_hook",
)


def watch_modules(
    after_apply: Callable[[nn.Module], None], on_registration: Callable[[str], RegistrationHook]
) -> bool:
    """Call ``after_apply(module)`` when a module's ``_apply`` returns (or raises: a partial
    change is a change), for each module it reaches (a child's before its parent's), and
    ``on_registration(table)`` 's hook when a tensor or submodule is registered in
    ``table`` (``"_parameters"``, ``"_buffers"``, ``"_modules"``), before torch writes it.

    Returns:
        False, and nothing installed, on a torch that lacks ``_apply`` or the hooks.
    """
    original = nn.Module.__dict__.get("_apply")
    if not callable(original) or not all(hasattr(_torch_module, h) for h in _HOOKS):
        return False

    @functools.wraps(original)
    def _apply(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            after_apply(self)

    nn.Module._apply = _apply  # type: ignore[method-assign]
    _torch_module.register_module_parameter_registration_hook(on_registration("_parameters"))
    _torch_module.register_module_buffer_registration_hook(on_registration("_buffers"))
    _torch_module.register_module_module_registration_hook(on_registration("_modules"))
    return True
