"""``@device_agnostic`` beside torch's compilers: the contexts a compile can start in, a
compiled module given to the decorator, and ``torch.jit.script``.

The probe of :mod:`devicectx.decorator._probe` runs once per process, the first time dynamo
meets a decorated function, inside whatever the user's code is doing then: a strict
``torch.export``, ``torch.func.vmap``, a ``with torch.device(...)`` block. Each such first
meeting runs here in a fresh process (the probe has run in this one long before), which
must behave as one whose probe ran in an ordinary compile first.
"""

from __future__ import annotations

import subprocess

import pytest
import torch
from torch import nn
from warm_python import run_python

from devicectx import device_agnostic

pytestmark = pytest.mark.torch_internals
META = torch.device("meta")

_SETUP = """
import logging, torch
from devicectx import device_agnostic
from devicectx.decorator import _compiled
from torch.overrides import _get_current_function_mode_stack

logging.basicConfig(level=logging.WARNING)

@device_agnostic
def step(model, x):
    return model(x).sum(-1)

def caller(model, x):
    return step(model, x) * 2

def compiled(fn):
    return torch.compile(fn, backend="eager", fullgraph=True)
"""

_AFTER = """
later = compiled(caller)(torch.nn.Linear(4, 3, device="meta"), torch.ones(2, 4))
print(first, later.device, _compiled.fallback(), _get_current_function_mode_stack())
"""

_WARM_UP = """
compiled(caller)(torch.nn.Linear(4, 3, device="meta"), torch.ones(2, 4))
"""

# What each context's first compile gives (as with the probe run before), then a later
# compile outside it, whether decorated calls fall back, and torch's mode stack after.
_FIRST_MEETINGS = {
    "strict export": (
        """
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    @device_agnostic
    def forward(self, x):
        return self.lin(x).relu()

import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    exported = torch.export.export(Net(), (torch.ones(2, 4),), strict=True)
side_effects = sum("side effects" in str(warning.message) for warning in caught)
first = tuple(exported.module()(torch.ones(2, 4)).shape), side_effects
""",
        "((2, 3), 0) meta False []",
    ),
    "vmap": (
        """
model = torch.nn.Linear(4, 3)
first = tuple(torch.func.vmap(lambda x: compiled(caller)(model, x))(torch.ones(5, 2, 4)).shape)
""",
        "(5, 2) meta False []",
    ),
    "torch.device": (
        """
with torch.device("meta"):
    first = compiled(caller)(torch.nn.Linear(4, 3), torch.ones(2, 4)).device
""",
        "meta meta False []",
    ),
}


@pytest.mark.parametrize("context", list(_FIRST_MEETINGS))
def test_the_probe_ignores_the_context_of_the_first_compile(context: str) -> None:
    """A process whose first decorated call under ``torch.compile`` is in ``context``
    compiles it, and later ones, as if the probe had run in an ordinary compile before:
    no warning, no fallback, torch's mode stack left as it was. A strict export warns of
    no side effect of the forward (neither the probe's nor a scope on the default device)."""
    code, expected = _FIRST_MEETINGS[context]
    done = _run(_SETUP + code + _AFTER)
    if done.returncode != 0:
        # Where the same code fails without the decorator (torch 2.6: dynamo's first import
        # inside a torch.device("meta") block reads a meta tensor's value), or with the
        # probe run before in an ordinary compile (torch 2.6: strict export cannot rebuild
        # a decorated forward), the context fails whatever the probe does.
        # One control at a time: the first that fails settles it (each is a process whose
        # first compile takes seconds).
        for control in (
            (_SETUP + code).replace("@device_agnostic", ""),
            _SETUP + _WARM_UP + code,
        ):
            failed = _run(control)
            if failed.returncode != 0:
                last = failed.stderr.strip().splitlines()[-1]
                pytest.skip(
                    f"torch {torch.__version__} fails here with or without the probe: {last}"
                )
    assert 0 == done.returncode, done.stderr
    assert "does not trace @device_agnostic calls" not in done.stderr
    assert expected == done.stdout.strip()


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return run_python(code, ignore_warnings=True)


# --- a compiled module given to the decorator --------------------------------------------


class Net(nn.Module):
    """A model of the user's own, whose class can take the decorator."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)  # type: ignore[no-any-return]


def refusal(module: nn.Module) -> str:
    """What ``device_agnostic(cm)`` says, given ``module`` compiled as ``cm``."""
    cm = torch.compile(module, backend="eager")
    with pytest.raises(TypeError) as error:
        device_agnostic(cm)
    return str(error.value)


def follow(fix: str, module: nn.Module) -> torch.Tensor:
    """Run ``fix``'s code as a user would paste it, ``module`` compiled as ``cm``; then
    call ``forward`` where ``cm`` was called, with an input on the CPU."""
    scope = {"torch": torch, "device_agnostic": device_agnostic}
    scope["cm"] = torch.compile(module, backend="eager")
    exec(fix, scope)
    return scope["forward"](torch.ones(3, 4))  # type: ignore[no-any-return,operator]


def test_a_compiled_module_is_refused_with_a_fix_that_works() -> None:
    """``device_agnostic(torch.compile(model))`` names the compiled class, and its fix,
    pasted, gives a forward that moves its inputs to the model's device, compiled."""
    model = nn.Linear(4, 2, device="meta")
    fix = "forward = torch.compile(device_agnostic(cm._orig_mod.forward))"
    expected = (
        "@device_agnostic cannot decorate a module instance, cm (a Linear compiled by "
        "torch.compile): it decorates functions and methods\n"
        f"fix: {fix}, then call forward(...) where you called cm(...)"
    )
    assert expected == refusal(model)
    assert META == follow(fix, model).device


def test_a_compiled_module_of_the_users_class_is_refused_with_both_fixes() -> None:
    """For a class of the user's own, the fix offers the decorator on its ``forward`` too;
    the other fix, pasted, works."""
    fix = "forward = torch.compile(device_agnostic(cm._orig_mod.forward))"
    expected = (
        f"fix: @device_agnostic above `def forward` in class Net, or {fix}, then call forward(...)"
    )
    assert expected == refusal(Net()).splitlines()[-1]
    assert META == follow(fix, Net().to("meta")).device


# --- torch.jit.script --------------------------------------------------------------------


@device_agnostic(device="meta")
def doubled(x: torch.Tensor) -> torch.Tensor:
    """A decorated function TorchScript would compile without its decorator."""
    return x * 2


def calls_doubled(x: torch.Tensor) -> torch.Tensor:
    """A plain function whose script compiles the decorated one it calls."""
    return doubled(x) + 1


@pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")
def test_torch_jit_script_refuses_a_decorated_function() -> None:
    """``torch.jit.script`` would compile the body alone (no move, no check, no scope):
    it refuses, for the decorated function and for a function that calls it, with our
    message and a fix that works (``torch.jit.trace`` records the moves)."""
    name = "doubled"
    for fn in (doubled, calls_doubled):
        with pytest.raises(RuntimeError) as error:
            torch.jit.script(fn)
        assert (
            f"TorchScript error: @device_agnostic cannot be compiled by torch.jit.script, "
            f"which would run {name}() without it (no move, no check, no scope)\n"
            f"fix: torch.jit.trace({name}, example_inputs) records its moves, or call "
            f"{name}() outside the scripted code"
        ) in str(error.value)
    traced = torch.jit.trace(doubled, (torch.ones(2),))  # type: ignore[no-untyped-call]
    assert META == traced(torch.ones(2)).device
