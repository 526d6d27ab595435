"""``@device_agnostic`` under ``torch.compile``: the same results as eager, no graph break.

dynamo sees through a wrapt ``FunctionWrapper`` to the wrapped code; these tests check
that the decorator still acts inside compiled code (inputs moved, body scoped, output
placed, mismatches refused), by results, not only by the absence of graph breaks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from devicectx import DeviceMismatchError, device_agnostic

CPU = torch.device("cpu")
META = torch.device("meta")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch: no cached frames or skip marks from another."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(fn: Callable[..., Any], fullgraph: bool = True) -> Callable[..., Any]:
    """``fn`` compiled with the eager backend: dynamo's tracing, no code generation."""
    return torch.compile(fn, fullgraph=fullgraph, backend="eager")  # type: ignore[no-any-return]


def graph_breaks(fn: Callable[..., Any], *args: Any) -> int:
    """How many graph breaks dynamo finds tracing ``fn(*args)``."""
    count: int = torch._dynamo.explain(fn)(*args).graph_break_count
    return count


def devices(tree: Any) -> list[torch.device]:
    """The device of every tensor in a flat tuple or list, in order."""
    return [t.device for t in tree]


@device_agnostic(device="meta")
def scaled(x: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Moved inputs, and a tensor the body makes without ``device=``."""
    return x * 2, batch["y"], torch.zeros(2)


def calls_scaled(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A compiled caller of a decorated helper."""
    a, b, c = scaled(x, {"y": x + 1})
    return a + 1, b, c


def test_compiled_caller_matches_eager() -> None:
    """Inputs moved and the body's new tensors on the target, compiled as in eager."""
    x = torch.ones(2)
    expected = devices(calls_scaled(x))
    assert [META, META, META] == expected
    run = compiled(calls_scaled)
    assert expected == devices(run(x))
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert expected == devices(run(torch.ones(2)))
    assert 0 == graph_breaks(calls_scaled, x)


def test_compiling_the_decorated_function_itself() -> None:
    """``torch.compile(decorated)`` traces the decorator too."""
    x = torch.ones(2)
    assert [META, META, META] == devices(compiled(scaled)(x, {"y": x}))


@device_agnostic(output="input")
def made_elsewhere(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A body that returns a tensor on another device than its inputs."""
    return x + 1, torch.zeros(2, device="cpu")


def calls_made_elsewhere(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A compiled caller of a helper with ``output="input"``."""
    return made_elsewhere(x)


def test_output_input_is_applied_when_compiled() -> None:
    """``output="input"`` brings the result back to the inputs' device, compiled too."""
    x = torch.ones(2, device="meta")
    assert [META, META] == devices(calls_made_elsewhere(x))
    assert [META, META] == devices(compiled(calls_made_elsewhere)(x))
    assert 0 == graph_breaks(calls_made_elsewhere, x)


@device_agnostic(device="meta", exclude=("keep",))
def with_excluded(x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One argument moved, one left where it is."""
    return x + 0, keep + 0


def test_exclude_is_kept_when_compiled() -> None:
    """An excluded argument is not moved in compiled code either."""

    def caller(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return with_excluded(x, keep=x)

    x = torch.ones(2)
    assert [META, CPU] == devices(caller(x))
    assert [META, CPU] == devices(compiled(caller)(x))


class Net(nn.Module):
    """A model whose decorated forward makes a tensor of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    @device_agnostic
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), torch.zeros(2)


def test_compiled_module() -> None:
    """A compiled module with a decorated forward: inputs go to the module's device."""
    net = Net().to("meta")
    assert [META, META] == devices(compiled(net)(torch.ones(2)))


def test_module_called_inside_a_compiled_function() -> None:
    """A decorated module called from compiled code still moves its inputs."""
    net = Net().to("meta")

    def caller(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, new = model(x)
        return out * 2, new

    x = torch.ones(2)
    assert [META, META] == devices(caller(net, x))
    assert [META, META] == devices(compiled(caller)(net, x))
    assert 0 == graph_breaks(caller, net, x)


@device_agnostic(device="meta", move=False)
def strict(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A helper that refuses to move anything."""
    return pred + target


def calls_strict(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A compiled caller of a ``move=False`` helper."""
    return strict(pred, target)


def test_mismatch_raises_our_error_when_compiled() -> None:
    """move=False and mixed devices: DeviceMismatchError, not PyTorch's kernel error."""
    with pytest.raises(DeviceMismatchError) as error:
        compiled(calls_strict, fullgraph=False)(torch.ones(2, device="meta"), torch.ones(2))
    assert {META: ["pred"], CPU: ["target"]} == error.value.devices


def test_mismatch_under_fullgraph_quotes_our_message() -> None:
    """fullgraph=True: torch reports any exception in traced code as Unsupported, quoting ours."""
    with pytest.raises(torch._dynamo.exc.Unsupported) as error:
        compiled(calls_strict)(torch.ones(2, device="meta"), torch.ones(2))
    quoted = "DeviceMismatchError('strict() got tensors on 2 devices:\\n    meta <- pred\\n"
    assert quoted in str(error.value)


def test_matching_devices_compile_without_error() -> None:
    """move=False with everything on the target compiles and runs."""
    x = torch.ones(2, device="meta")
    assert META == compiled(calls_strict)(x, x).device


class Maker:
    """Class and static methods, decorated outside ``@classmethod``/``@staticmethod``."""

    @device_agnostic(device="meta")
    @classmethod
    def make(cls, x: torch.Tensor) -> tuple[type, torch.Tensor]:
        return cls, x + torch.zeros(1)

    @device_agnostic(device="meta")
    @staticmethod
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_classmethod_and_staticmethod_when_compiled() -> None:
    """dynamo calls their ``__func__``: the wrapper still acts, for both."""

    def caller(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cls, made = Maker.make(x)
        assert cls is Maker
        return made, Maker().double(x)

    x = torch.ones(1)
    assert [META, META] == devices(caller(x))
    assert [META, META] == devices(compiled(caller)(x))


def test_decorated_generator_runs_eagerly_when_compiled() -> None:
    """A decorated generator is not traced: its call and each resume run eagerly, correctly."""

    @device_agnostic(device="meta")
    def generate(x: torch.Tensor) -> Iterator[torch.Tensor]:
        yield x + torch.zeros(1)

    def caller(x: torch.Tensor) -> torch.Tensor:
        return next(generate(x)) * 2

    assert META == compiled(caller, fullgraph=False)(torch.ones(1)).device
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compiled(caller)(torch.ones(1))


@pytest.mark.xfail(
    raises=torch._dynamo.exc.InternalTorchDynamoError,
    reason="known limit: under torch.compile, put @device_agnostic above @classmethod",
)
def test_decorator_inside_classmethod_when_compiled() -> None:
    """``@classmethod`` over ``@device_agnostic``: dynamo reads the hook statically and fails."""

    class Inner:
        @classmethod
        @device_agnostic(device="meta")
        def make(cls, x: torch.Tensor) -> torch.Tensor:
            return x + 0

    def caller(x: torch.Tensor) -> torch.Tensor:
        return Inner.make(x)

    assert META == compiled(caller)(torch.ones(1)).device


_PURE_WRAPT = """
import torch, wrapt
from devicectx import device_agnostic
assert wrapt.FunctionWrapper.__module__ == "wrapt.wrappers", "wrapt's C extension is in use"

@device_agnostic(device="meta")
def scaled(x):
    return x * 2, torch.zeros(1)

class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)

    @device_agnostic
    def forward(self, x):
        return self.lin(x)

head = Head().to("meta")
results = [
    *scaled(torch.ones(1)),
    *torch.compile(scaled, fullgraph=True, backend="eager")(torch.ones(1)),
    head(torch.ones(1)),
    device_agnostic(head.lin.forward)(torch.ones(1)),
    torch.compile(head, fullgraph=True, backend="eager")(torch.ones(1)),
]
print(sorted({str(t.device) for t in results}))
"""


def test_wrapt_without_its_extension() -> None:
    """With wrapt's pure-Python wrappers (``WRAPT_DISABLE_EXTENSIONS=1``), eager calls,
    bound methods and ``torch.compile(decorated)`` act as with the C ones."""
    env = {**os.environ, "WRAPT_DISABLE_EXTENSIONS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _PURE_WRAPT], env=env, capture_output=True, text=True, check=False
    )
    assert 0 == done.returncode, done.stderr
    assert "['meta']" == done.stdout.strip()
