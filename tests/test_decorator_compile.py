"""``@device_agnostic`` under ``torch.compile``: compiled results agree with eager ones.

dynamo sees through a wrapt ``FunctionWrapper`` to the wrapped code; these tests check that
the decorator still acts inside compiled code (inputs moved, body scoped, output placed,
mismatches refused), by results, not only by the absence of graph breaks. Each runs on both
branches of :mod:`devicectx.decorator._wrappers`: ``traced`` (the probe found the installed torch
honours devicectx's hooks: dynamo traces the call, with ``fullgraph=True``) and
``fallback`` (forced: the call runs eagerly, a graph break, so ``fullgraph=True`` refuses).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import pickle
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import torch
from helpers import accelerator, mps_like
from hypothesis import given
from torch import nn
from warm_python import run_python

from devicectx import (
    DeviceMismatchError,
    DtypeUnsupportedError,
    MoveError,
    device_agnostic,
    find_devices,
    on_device,
)
from devicectx.decorator import _compiled, _probe, _stand_ins, _wrappers
from devicectx.testing.strategies import nested

CPU = torch.device("cpu")
META = torch.device("meta")
# Each test moves the same inputs eagerly, then compiled, then again: on purpose.
pytestmark = [
    pytest.mark.torch_internals,
    pytest.mark.filterwarnings("ignore::devicectx.RepeatedMoveWarning"),
]
Unsupported = torch._dynamo.exc.Unsupported


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch: no cached frames or skip marks from another."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(params=["traced", "fallback"])
def branch(request: pytest.FixtureRequest) -> Iterator[str]:
    """The test runs with the traced path, then with the fallback forced; then as before."""
    before = _compiled.fallback()
    _wrappers.use_fallback(request.param == "fallback")
    yield str(request.param)
    _wrappers.use_fallback(before)


def compiled(fn: Callable[..., Any], fullgraph: bool = True) -> Callable[..., Any]:
    """``fn`` compiled with the eager backend: dynamo's tracing, no code generation."""
    return torch.compile(fn, fullgraph=fullgraph, backend="eager")  # type: ignore[no-any-return]


def devices(tree: Any) -> list[torch.device]:
    """The device of every tensor in a flat tuple or list (or of one tensor), in order."""
    return [t.device for t in (tree if isinstance(tree, (tuple, list)) else [tree])]


def agree(branch: str, fn: Callable[..., Any], *args: Any) -> list[torch.device]:
    """Compile ``fn`` as the branch allows and check its result devices equal eager ones.

    traced: with ``fullgraph=True``, and a second call recompiles nothing. fallback: with
    ``fullgraph=True`` torch refuses the graph break; without, the results still agree.
    """
    expected = devices(fn(*args))
    if branch == "traced":
        run = compiled(fn)
        assert expected == devices(run(*args))
        with torch._dynamo.config.patch(error_on_recompile=True):
            assert expected == devices(run(*args))
    else:
        with pytest.raises(Unsupported):
            compiled(fn)(*args)
        torch._dynamo.reset()
        assert expected == devices(compiled(fn, fullgraph=False)(*args))
    return expected


# --- the cases ---------------------------------------------------------------------------


@device_agnostic(device="meta")
def scaled(x: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Moved inputs, and a tensor the body makes without ``device=``."""
    return x * 2, batch["y"], torch.zeros(2)


def calls_scaled(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A compiled caller of a decorated helper."""
    a, b, c = scaled(x, {"y": x + 1})
    return a + 1, b, c


def test_compiled_caller_matches_eager(branch: str) -> None:
    """Inputs moved and the body's new tensors on the target, compiled as in eager."""
    assert [META, META, META] == agree(branch, calls_scaled, torch.ones(2))


def test_compiling_the_decorated_function_itself(branch: str) -> None:
    """``torch.compile(decorated)`` runs the decorator too."""
    x = torch.ones(2)
    assert [META, META, META] == agree(branch, scaled, x, {"y": x})


@device_agnostic(output="input")
def made_elsewhere(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A body that returns a tensor on another device than its inputs."""
    return x + 1, torch.zeros(2, device="cpu")


def test_output_input_is_applied_when_compiled(branch: str) -> None:
    """``output="input"`` brings the result back to the inputs' device, compiled too."""
    assert [META, META] == agree(branch, lambda x: made_elsewhere(x), torch.ones(2, device="meta"))


@device_agnostic(device="meta", exclude=("keep",))
def with_excluded(x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One argument moved, one left where it is."""
    return x + 0, keep + 0


def test_exclude_is_kept_when_compiled(branch: str) -> None:
    """An excluded argument is not moved in compiled code either."""
    assert [META, CPU] == agree(branch, lambda x: with_excluded(x, keep=x), torch.ones(2))


WEIGHTS = torch.ones(2)


@device_agnostic
def weighted(model: nn.Module, x: torch.Tensor, w: torch.Tensor = WEIGHTS) -> torch.Tensor:
    """A tensor default the call may leave out: moved with the arguments, as if passed."""
    return model(x) * w  # type: ignore[no-any-return]


@device_agnostic
def weighted_by_keyword(
    model: nn.Module, x: torch.Tensor, *, table: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """A keyword-only default holding no tensor: left as it is."""
    return model(x) if table is None else model(x) * table["w"]  # type: ignore[no-any-return]


@device_agnostic
def weighted_by_table(
    model: nn.Module,
    x: torch.Tensor,
    *,
    table: dict[str, torch.Tensor] = {"w": WEIGHTS},  # noqa: B006
) -> torch.Tensor:
    """A keyword-only default holding a tensor in a dict."""
    return model(x) * table["w"]  # type: ignore[no-any-return]


def test_tensor_defaults_left_out_are_moved_when_compiled(branch: str) -> None:
    """A default holding a tensor, left out of the call, is moved when compiled as in eager
    code (the compiled function itself, and a compiled caller); one passed, or one holding
    no tensor, changes nothing; the default itself stays where it is."""
    model = nn.Linear(2, 2, device="meta")
    cases: list[Callable[..., Any]] = [
        weighted,
        lambda x: weighted(model, x) + 1,
        lambda x: weighted(model, x, w=torch.ones(2)),
        lambda x: weighted(model, x, torch.ones(2, device="meta")),
        lambda x: weighted_by_keyword(model, x),
        lambda x: weighted_by_table(model, x),
    ]
    for fn in cases:
        torch._dynamo.reset()
        args = (model, torch.ones(2)) if fn is weighted else (torch.ones(2),)
        assert [META] == agree(branch, fn, *args)
    assert CPU == WEIGHTS.device


class Net(nn.Module):
    """A model whose decorated forward and other method make tensors of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    @device_agnostic
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), torch.zeros(2)

    @device_agnostic
    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum() + torch.zeros(1)


def test_compiled_module(branch: str) -> None:
    """A compiled module with a decorated forward: inputs go to the module's device."""
    net = Net().to("meta")
    assert [META, META] == agree(branch, net, torch.ones(2))


def test_module_called_inside_a_compiled_function(branch: str) -> None:
    """A decorated module called from compiled code still moves its inputs."""
    net = Net().to("meta")

    def caller(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out, new = net(x)
        return out * 2, new, net.forward(x)[1]

    assert [META, META, META] == agree(branch, caller, torch.ones(2))


def test_other_module_method_inside_a_compiled_function(branch: str) -> None:
    """A decorated method that is not ``forward``, called from a compiled one, acts too."""

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net.score(x)

    assert [META] == agree(branch, Outer().to("meta"), torch.ones(2))


class Nested(nn.Module):
    """A decorated ``forward`` that calls another decorated method of the model."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    @device_agnostic
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))

    @device_agnostic
    def act(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h.relu(), torch.zeros(1)  # type: ignore[return-value]


def test_nested_decorated_methods_compiled_after_eager_calls(branch: str) -> None:
    """The inner call reads the default device its caller's traced scope set: a mode dynamo
    made without running its ``__init__``, whose device is among dynamo's pending writes
    (it was read off the object: dynamo's internal AttributeError, once an eager scope had
    run in the process)."""
    scaled(torch.ones(1), {"y": torch.ones(1)})  # an eager call in a scope, before
    assert [META, META] == agree(branch, Nested().to("meta"), torch.ones(2))


class Maker:
    """Class, static and plain methods, decorated outside ``@classmethod``/``@staticmethod``."""

    @device_agnostic(device="meta")
    @classmethod
    def make(cls, x: torch.Tensor) -> tuple[type, torch.Tensor]:
        return cls, x + torch.zeros(1)

    @device_agnostic(device="meta")
    @staticmethod
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @device_agnostic(device="meta")
    def plain(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.zeros(1)


def test_methods_when_compiled(branch: str) -> None:
    """Class, static and plain methods, through the class and an instance: all decorated."""
    maker = Maker()

    def caller(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cls, made = Maker.make(x)
        assert cls is Maker
        return (
            made,
            maker.make(x)[1],
            Maker.double(x),
            maker.double(x),
            maker.plain(x),
            Maker.plain(maker, x),
        )

    assert [META] * 6 == agree(branch, caller, torch.ones(1))


def test_decorated_generator_runs_eagerly_when_compiled(branch: str) -> None:
    """A decorated generator is not traced: its call and each resume run eagerly, correctly."""

    @device_agnostic(device="meta")
    def generate(x: torch.Tensor) -> Iterator[torch.Tensor]:
        yield x + torch.zeros(1)

    def caller(x: torch.Tensor) -> torch.Tensor:
        return next(generate(x)) * 2

    assert META == compiled(caller, fullgraph=False)(torch.ones(1)).device
    torch._dynamo.reset()
    with pytest.raises(Unsupported):
        compiled(caller)(torch.ones(1))


@device_agnostic(device="meta", move=False)
def strict(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A helper that refuses to move anything."""
    return pred + target


def calls_strict(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A compiled caller of a ``move=False`` helper."""
    return strict(pred, target)


def test_mismatch_raises_our_error_when_compiled(branch: str) -> None:
    """move=False and mixed devices: DeviceMismatchError, not PyTorch's kernel error."""
    for fn in (calls_strict, strict):
        with pytest.raises(DeviceMismatchError) as error:
            compiled(fn, fullgraph=False)(torch.ones(2, device="meta"), torch.ones(2))
        assert {META: ["pred"], CPU: ["target"]} == error.value.devices


@device_agnostic(move=False)
def untargeted(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A helper that refuses to move anything, with no target."""
    return pred + target


def test_mismatch_without_a_target_under_move_false_says_the_eager_fix_when_compiled(
    branch: str,
) -> None:
    """move=False, no target, mixed devices: compiled, the error's fix is the eager one
    (pass the tensors on one device), not a target that would move nothing."""
    with pytest.raises(DeviceMismatchError) as eager:
        untargeted(torch.ones(2, device="meta"), torch.ones(2))
    with pytest.raises(DeviceMismatchError) as error:
        compiled(untargeted, fullgraph=False)(torch.ones(2, device="meta"), torch.ones(2))
    fix = str(eager.value).splitlines()[-1]
    assert fix.startswith('fix: pass target.to("meta"), or use @device_agnostic(device="meta")')
    assert fix == str(error.value).splitlines()[-1]


def test_mismatch_under_fullgraph_quotes_our_message() -> None:
    """fullgraph=True: the mismatch is torch's Unsupported error, and it quotes ours."""
    with pytest.raises(DeviceMismatchError) as eager:
        strict(torch.ones(2, device="meta"), torch.ones(2))
    for fn in (calls_strict, strict):
        torch._dynamo.reset()
        with pytest.raises(Unsupported) as error:
            compiled(fn)(torch.ones(2, device="meta"), torch.ones(2))
        # torch quotes it as the repr of a string, in wrappings that vary by release.
        assert "DeviceMismatchError" in str(error.value)
        assert repr(str(eager.value))[1:-1] in str(error.value)


@device_agnostic
def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A model-forward helper."""
    return model(x)  # type: ignore[no-any-return]


def test_a_split_by_mistake_under_fullgraph_is_refused() -> None:
    """fullgraph=True and a model spread by mistake: torch's Unsupported error carries our
    refusal, naming the module argument (the eager call names the stray part by path)."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3, device="meta"), nn.Linear(3, 3))
    with pytest.raises(DeviceMismatchError) as eager:
        forward(model, torch.ones(2))
    assert "model[1]" in str(eager.value)
    with pytest.raises(Unsupported) as error:
        compiled(forward)(model, torch.ones(2))
    assert "forward() got model (Sequential)" in str(error.value)


def test_matching_devices_compile_without_error(branch: str) -> None:
    """move=False with everything on the target compiles and runs."""
    x = torch.ones(2, device="meta")
    assert [META] == agree(branch, calls_strict, x, x)


def test_mismatch_after_other_compiles(branch: str) -> None:
    """In a process that compiled other decorated functions before, a mismatch is still ours."""
    # When the traced calls of all decorated functions shared one code object, the second
    # ran the first's compiled code with its own globals: a NameError for the first's graph.
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).to("meta")

    @device_agnostic
    def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    @device_agnostic(move=False)
    def checked(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    assert META == compiled(forward, fullgraph=False)(model, torch.ones(2)).device
    with pytest.raises(DeviceMismatchError) as error:
        compiled(checked, fullgraph=False)(model, torch.ones(2))
    assert {CPU: ["x"]} == error.value.devices


@pytest.mark.xfail(
    raises=torch._dynamo.exc.TorchDynamoException,
    strict=False,
    reason="known limit: under torch.compile, put @device_agnostic above @classmethod "
    "(below it, some torch releases fail: 2.15)",
)
def test_decorator_inside_classmethod_when_compiled() -> None:
    """``@classmethod`` over ``@device_agnostic``: what dynamo does varies by release."""

    class Inner:
        @classmethod
        @device_agnostic(device="meta")
        def make(cls, x: torch.Tensor) -> torch.Tensor:
            return x + 0

    def caller(x: torch.Tensor) -> torch.Tensor:
        return Inner.make(x)

    assert META == compiled(caller)(torch.ones(1)).device


# --- the probe ---------------------------------------------------------------------------


def test_probe_finds_the_traced_path_works_here() -> None:
    """On every supported torch, the probe's compiled calls agree with eager ones."""
    assert _wrappers.probe() is None


def test_probe_tells_a_dropped_wrapper() -> None:
    """A torch that dropped the wrapper (here: no wrapper at all) is found out."""
    reason = _probe.run(lambda function, **options: function)
    assert reason  # here: the FakeTensor device error of a forward given a CPU input


def test_probe_decides_at_first_use() -> None:
    """Undecided, the first compile that meets a decorated function runs the probe."""
    before = _compiled.fallback()
    _wrappers.use_fallback(None)
    try:
        assert [META, META, META] == devices(compiled(calls_scaled)(torch.ones(2)))
        assert _compiled.fallback() is False
    finally:
        _wrappers.use_fallback(before)


def test_probe_that_fails_means_the_fallback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the probe fails, decorated calls run eagerly for the process, with a warning."""
    before = _compiled.fallback()
    # The probe's calls made without the wrapper: as on a torch that drops it.
    monkeypatch.setattr(_wrappers, "_decorate", lambda function, **options: function)
    _wrappers.use_fallback(None)
    try:
        with caplog.at_level(logging.WARNING, logger="devicectx"):
            got = compiled(calls_scaled, fullgraph=False)(torch.ones(2))
        assert [META, META, META] == devices(got)
        assert _compiled.fallback() is True
        assert "under torch.compile they run eagerly, as graph breaks" in caplog.text
    finally:
        _wrappers.use_fallback(before)


# --- on an accelerator -------------------------------------------------------------------


@pytest.mark.requires_device("cuda")
def test_cuda_scopes_compile_with_fullgraph() -> None:
    """``on_device("cuda:0")``, ``on_device("cuda")`` and ``device="cuda"`` inside
    ``fullgraph=True``: the driver is asked while tracing, not traced."""

    @device_agnostic(device="cuda")
    def on_gpu(x: torch.Tensor) -> torch.Tensor:
        return x + torch.zeros(1)

    def caller(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with on_device("cuda:0"):
            a = torch.zeros(1)
        with on_device("cuda"):
            b = torch.zeros(1)
        return a, b, on_gpu(x)

    gpu = torch.device("cuda", torch.cuda.current_device())
    expected = [torch.device("cuda", 0), gpu, gpu]
    assert expected == devices(caller(torch.ones(1)))
    assert expected == devices(compiled(caller)(torch.ones(1)))


# --- wrapt without its C extension -------------------------------------------------------

_PURE_WRAPT = """
import torch, wrapt, wrapt.wrappers
from devicectx import device_agnostic
assert wrapt.FunctionWrapper is wrapt.wrappers.FunctionWrapper, "wrapt's C extension is in use"

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
    torch.compile(lambda x: head(x), fullgraph=True, backend="eager")(torch.ones(1)),
]
print(sorted({str(t.device) for t in results}))
"""


def test_wrapt_without_its_extension() -> None:
    """With wrapt's pure-Python wrappers (``WRAPT_DISABLE_EXTENSIONS=1``), eager calls,
    bound methods and ``torch.compile`` act as with the C ones."""
    env = {**os.environ, "WRAPT_DISABLE_EXTENSIONS": "1"}
    done = run_python(_PURE_WRAPT, env=env)
    assert 0 == done.returncode, done.stderr
    assert "['meta']" == done.stdout.strip()


# --- what the traced call cannot walk, or never traces -----------------------------------

needs_accelerator = pytest.mark.requires_device("accelerator")
# torch 2.6's graph break takes no message: there torch's error names only the eager call.
QUOTES = "msg" in inspect.signature(torch._dynamo.graph_break).parameters


def quoted(message: str, error: BaseException) -> bool:
    """Whether torch's error quotes ``message`` (as the repr of a string, in wrappings that
    vary by release)."""
    return repr(message)[1:-1] in str(error)


@dataclasses.dataclass
class Batch:
    """A dataclass of tensors, which torch's pytree does not walk."""

    x: torch.Tensor
    note: str = "batch"


class Walked(NamedTuple):
    """A namedtuple of tensors, which torch's pytree walks."""

    x: torch.Tensor


@dataclasses.dataclass
class Settings:
    """A dataclass without tensors."""

    scale: int = 2
    name: str = "settings"


@given(nested(max_depth=2))
def test_a_leaf_the_traced_call_keeps_holds_no_tensor_the_eager_walk_finds(tree: Any) -> None:
    """Every pytree leaf in which the eager walk finds a tensor sends the traced call to the
    eager one (sets aside: dynamo traces no set of tensors)."""
    for leaf in torch.utils._pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            continue
        paths = [path for paths in find_devices(leaf).values() for path in paths]
        # A set member's path is written list(...)[i]: the set wraps all before it.
        if any(not path.startswith("list(") for path in paths):
            assert _compiled._unwalked(leaf, 0), f"{type(leaf).__name__} kept: {leaf!r}"


@needs_accelerator
def test_objects_pytree_does_not_walk_are_moved_by_the_eager_call() -> None:
    """A BatchEncoding and a dataclass of tensors: a graph break, then the eager call moves
    them, as without torch.compile."""
    transformers = pytest.importorskip("transformers")
    device = accelerator()

    @device_agnostic(device=device)
    def step(enc: Any, batch: Batch) -> tuple[torch.Tensor, list[torch.device]]:
        return enc["ids"] * batch.x, [enc["ids"].device, batch.x.device]

    def inputs() -> tuple[Any, Batch]:
        return transformers.BatchEncoding({"ids": torch.arange(3.0)}), Batch(torch.ones(3))

    expected, seen = step(*inputs())
    got, seen_compiled = compiled(step, fullgraph=False)(*inputs())
    assert [device, device] == seen == seen_compiled
    assert device == got.device
    assert expected.tolist() == got.tolist()


@needs_accelerator
def test_objects_pytree_does_not_walk_under_fullgraph_name_the_path_and_the_fix() -> None:
    """fullgraph=True: torch's error quotes ours, with the argument's path and type and a
    fix, which runs as written and keeps the call traced."""
    transformers = pytest.importorskip("transformers")
    device = accelerator()

    @device_agnostic(device=device)
    def step(inputs: dict[str, Any], batch: Any) -> torch.Tensor:
        return inputs["enc"]["ids"] + batch.x  # type: ignore[no-any-return]

    def enc() -> Any:
        return transformers.BatchEncoding({"ids": torch.arange(3.0)})

    def message(path: str, kind: str, fix: str) -> str:
        return (
            f"test_objects_pytree_does_not_walk_under_fullgraph_name_the_path_and_the_fix."
            f"<locals>.step() got {path}, a {kind}, whose tensors only the eager call moves and "
            f"checks: torch.compile's trace of the call walks only the containers torch's "
            f"pytree knows, and a {kind} is none of them\n"
            f"fix: {fix} (the call is then traced), or compile without fullgraph=True / "
            f"export with strict=False (this call then runs eagerly)"
        )

    with pytest.raises(Unsupported) as error:
        compiled(step)({"enc": enc()}, Batch(torch.ones(3)))
    assert not QUOTES or quoted(
        message("inputs['enc']", "BatchEncoding", "pass dict(inputs['enc'])"), error.value
    )
    torch._dynamo.reset()
    batch = Walked(torch.ones(3))  # the fix for the BatchEncoding, and a namedtuple
    assert device == compiled(step)({"enc": dict(enc())}, batch).device

    torch._dynamo.reset()
    with pytest.raises(Unsupported) as error:
        compiled(step)({"enc": {"ids": torch.arange(3.0)}}, Batch(torch.ones(3)))
    # Where dynamo does not trace the walk of a registered dataclass (2.6), that fix is not given.
    registers = _compiled._TORCH >= _compiled._TRACES_REGISTERED_DATACLASSES
    register = "torch.export.register_dataclass(Batch)"
    fix = (
        f"{register} before compiling or exporting"
        if registers
        else "pass the tensors it holds as arguments"
    )
    assert not QUOTES or quoted(message("batch", "Batch", fix), error.value)
    if registers:
        exec(register, {"torch": torch, "Batch": Batch})
        try:
            torch._dynamo.reset()
            assert device == compiled(step)({"enc": dict(enc())}, Batch(torch.ones(3))).device
        finally:
            torch.utils._pytree._deregister_pytree_node(Batch)


def test_a_strict_export_refused_for_a_dataclass_names_export_s_own_fix() -> None:
    """Strict ``torch.export`` traces with dynamo and quotes the same refusal: its fix names
    export's way out (``strict=False``), which runs as written and gives the eager result."""

    @device_agnostic
    def loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        return model(batch.x).sum()

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return loss(self.linear, Batch(x))

    net, args = Net(), (torch.ones(2, 3),)
    torch._dynamo.reset()
    with pytest.raises(Unsupported) as error:
        torch.export.export(net, args, strict=True)
    assert not QUOTES or quoted(
        "export with strict=False (this call then runs eagerly)", error.value
    )
    exported = torch.export.export(net, args, strict=False)
    assert torch.equal(net(*args), exported.module()(*args))


@needs_accelerator
def test_pytree_containers_and_a_dataclass_without_tensors_trace_whole() -> None:
    """Containers pytree walks, a dataclass of settings and a set of names: no graph break."""
    device = accelerator()

    class Pair(NamedTuple):
        first: torch.Tensor
        second: torch.Tensor

    @device_agnostic(device=device)
    def step(
        batch: dict[str, Any], pair: Pair, settings: Settings, keys: frozenset[str]
    ) -> torch.Tensor:
        out = batch["x"] * settings.scale + pair.first + batch["more"][0] + pair.second
        return out if "x" in keys else -out

    def inputs() -> tuple[Any, ...]:
        tensors = torch.ones(2), torch.arange(2.0), torch.full((2,), 3.0)
        batch = {"x": tensors[0], "more": [tensors[1]]}
        return batch, Pair(tensors[2], tensors[0]), Settings(), frozenset({"x"})

    expected = step(*inputs())
    got = compiled(step)(*inputs())
    assert (device, expected.tolist()) == (got.device, got.tolist())


@needs_accelerator
def test_output_input_with_no_tensor_input_returns_to_the_cpu_when_compiled() -> None:
    """``output="input"`` where no input is a tensor (a list of numbers): the result goes
    back to the CPU, traced as in the eager call."""
    device = accelerator()

    @device_agnostic(device=device, output="input")
    def scaled(values: list[float]) -> torch.Tensor:
        return torch.tensor(values) * 2

    got = compiled(scaled)([1.0, 2.0])
    assert (CPU, [2.0, 4.0]) == (got.device, got.tolist())

    @device_agnostic(device=device, output="input", exclude=("x",))
    def excluded(x: torch.Tensor) -> torch.Tensor:
        return x * 2  # an excluded argument's device is not looked at: the result stays

    assert device == compiled(excluded)(torch.ones(2, device=device)).device


@needs_accelerator
def test_float64_on_a_device_without_it_is_refused_before_the_body_when_compiled() -> None:
    """On a device without float64, a float64 argument is refused as the eager call refuses
    it (DtypeUnsupportedError, naming each path), not by the backend in the body;
    fullgraph=True quotes it."""
    with mps_like() as device:

        @device_agnostic(device=device)
        def step(x: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return x + batch["y"]

        def inputs() -> tuple[Any, ...]:
            x = torch.ones(2, dtype=torch.float64)
            return x, {"y": torch.ones(2), "z": x, "s": torch.tensor(1.0, dtype=torch.float64)}

        with pytest.raises(DtypeUnsupportedError) as eager:
            step(*inputs())
        assert {torch.float64: ["x", "batch['z']", "batch['s']"]} == eager.value.paths
        with pytest.raises(DtypeUnsupportedError) as error:
            compiled(step, fullgraph=False)(*inputs())
        assert str(eager.value) == str(error.value)
        assert (device, eager.value.paths) == (error.value.device, error.value.paths)
        torch._dynamo.reset()
        with pytest.raises(Unsupported) as refused:
            compiled(step)(*inputs())
        assert "DtypeUnsupportedError" in str(refused.value)
        assert quoted(str(eager.value), refused.value)


def test_a_tensor_on_meta_to_move_is_refused_as_the_eager_call_refuses_it() -> None:
    """A tensor on meta (shapes only) that the call would move to the model's device: a
    graph break, and the eager call's MoveError with its fix, not torch's raw
    "Cannot copy out of meta tensor" from the traced move; fullgraph=True says why."""

    @device_agnostic
    def run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)  # type: ignore[no-any-return]

    model, x = nn.Linear(4, 4), torch.ones(3, 4, device="meta")
    with pytest.raises(MoveError) as eager:
        run(model, x)
    with pytest.raises(MoveError) as error:
        compiled(run, fullgraph=False)(model, x)
    assert str(eager.value) == str(error.value)
    assert "fix: give x values: it is on meta" in str(error.value)
    torch._dynamo.reset()
    with pytest.raises(Unsupported) as refused:
        compiled(run)(model, x)
    if "msg" in inspect.signature(torch._dynamo.graph_break).parameters:  # not on 2.6
        assert "run() got x on meta, which holds shapes only: nothing to copy to cpu" in str(
            refused.value
        )


@needs_accelerator
def test_a_float64_scalar_beside_inputs_on_a_device_without_float64_stays_when_compiled() -> None:
    """Where the inputs choose the target, nothing moves, as in the eager call: a 0-dim
    float64 CPU tensor beside them stays on the CPU, on a device without float64 too."""
    with mps_like() as device:

        @device_agnostic
        def scale(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
            return x * factor

        x, factor = torch.arange(3.0, device=device), torch.tensor(2.0, dtype=torch.float64)
        expected = scale(x, factor)
        got = compiled(scale)(x, factor)
        assert (device, torch.float32) == (got.device, got.dtype)
        assert expected.tolist() == got.tolist()


# --- torch 2.6's stand-ins of the errors ----------------------------------------------
# 2.6's graph break takes no message, so traced code raises these; they are plain classes,
# so their behaviour is checked on every release.


def test_a_dtype_stand_in_whose_error_is_no_longer_kept_names_no_device() -> None:
    """The stand-in of DtypeUnsupportedError whose error is past the latest kept answers
    ``device`` None (its message still names the device), not a device it makes up."""
    error = _stand_ins.TracedDtypeError("a message no traced call made")
    assert (None, {}) == (error.device, error.paths)


def test_a_mismatch_stand_in_whose_error_is_no_longer_kept_answers_empty() -> None:
    """The stand-in of DeviceMismatchError whose error is no longer kept answers no
    devices, no target and no reason."""
    error = _stand_ins.TracedMismatchError("a message no traced call made")
    assert ({}, None, "") == (error.devices, error.target, error.reason)


def test_stand_ins_print_and_pickle_as_the_public_errors() -> None:
    """A stand-in prints as the public error users catch (torch's report quotes the class),
    is one, and survives pickling with its message and its class."""
    for stand_in, public in (
        (_stand_ins.TracedMismatchError, DeviceMismatchError),
        (_stand_ins.TracedDtypeError, DtypeUnsupportedError),
    ):
        error = stand_in("f() got tensors on 2 devices")
        assert f"<class 'devicectx.{public.__name__}'>" == repr(stand_in)
        line = traceback.format_exception_only(error)[-1]
        assert f"devicectx.{public.__name__}: f() got tensors on 2 devices\n" == line
        assert isinstance(error, public)
        again = pickle.loads(pickle.dumps(error))
        assert (stand_in, str(error)) == (type(again), str(again))


class _Racing(str):
    """A message whose hash, the first time it is taken once armed, runs ``then``: another
    thread keeping an error at that moment."""

    then: Callable[[], None] | None = None

    def __hash__(self) -> int:
        then, self.then = self.then, None
        if then is not None:
            then()
        return str.__hash__(self)


class _Said(DeviceMismatchError):
    """A mismatch whose ``str()`` is its message object itself (a :class:`_Racing`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, devices={}, target=None, reason="")

    def __str__(self) -> str:
        return self.args[0]  # type: ignore[no-any-return]


def test_two_threads_trimming_the_kept_errors_at_once() -> None:
    """Two threads keep errors at once: where the other thread drops the oldest first, the
    trim goes on (no KeyError), and the latest kept is the last one kept."""
    made = _stand_ins.Made(limit=1)
    oldest = _Racing("oldest")
    made.keep(_Said(oldest))
    failed: list[BaseException] = []

    def keep_in_another_thread() -> None:
        def keep() -> None:
            try:
                made.keep(_Said("from the other thread"))
            except BaseException as error:  # pragma: no cover - what the test is after
                failed.append(error)

        thread = threading.Thread(target=keep)
        thread.start()
        thread.join()

    # The trim below takes the oldest's hash to drop it; the other thread drops it first.
    oldest.then = keep_in_another_thread
    assert "newest" == made.keep(_Said("newest"))
    assert [] == failed
    messages = ["oldest", "newest", "from the other thread"]
    assert ["from the other thread"] == [m for m in messages if made.get(m) is not None]


@needs_accelerator
def test_a_dtype_refusal_from_compiled_code_past_the_kept_errors_names_no_device() -> None:
    """A dtype refusal raised again from compiled code after many other refusals: on torch
    2.6 (a stand-in, its error no longer kept) it names no device; later releases raise
    the eager call's error, with the device."""
    with mps_like() as device:

        @device_agnostic(device=device)
        def step(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        run = compiled(step, fullgraph=False)
        with pytest.raises(DtypeUnsupportedError):
            run(torch.ones(2, dtype=torch.float64))
        for index in range(_stand_ins.MADE.limit):  # made later, they push it out
            _stand_ins.MADE.keep(_Said(f"another refusal {index}"))
        with pytest.raises(DtypeUnsupportedError) as error:
            run(torch.ones(2, dtype=torch.float64))
        stand_in = isinstance(error.value, _stand_ins.TracedDtypeError)
        assert (None if stand_in else device) == error.value.device
        assert ({} if stand_in else {torch.float64: ["x"]}) == error.value.paths


def test_calls_that_run_eagerly_say_why_under_fullgraph() -> None:
    """fullgraph=True refuses a call that runs eagerly (dtypes=, a generator, the fallback):
    torch's error quotes why, and the fix."""

    @device_agnostic(device="meta", dtypes="device")
    def cast(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @device_agnostic(device="meta")
    def generate(x: torch.Tensor) -> Iterator[torch.Tensor]:
        yield x * 2

    @device_agnostic(device="meta")
    def plain(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    prefix = "test_calls_that_run_eagerly_say_why_under_fullgraph.<locals>."
    fix = (
        "fix: compile without fullgraph=True / export with strict=False (its calls then run "
        "eagerly), or "
    )
    cases = [
        (
            cast,
            f"{prefix}cast() is decorated with dtypes=, whose casts the traced call does not "
            f"make: under torch.compile its calls run eagerly (a graph break)\n"
            f"{fix}drop dtypes= and cast the inputs before the call (x.float())",
            False,
        ),
        (
            lambda x: next(generate(x)),
            f"{prefix}generate() is a generator function: @device_agnostic runs its calls "
            f"eagerly under torch.compile (a graph break), entering its scope at each resume\n"
            f"{fix}call {prefix}generate() outside the compiled code",
            False,
        ),
        (
            plain,
            f"@device_agnostic runs {prefix}plain() eagerly under torch.compile (a graph "
            f"break): torch {torch.__version__} does not trace decorated calls as devicectx "
            f"expects (the warning on the devicectx logger says why)\n"
            f"{fix}call {prefix}plain() outside the compiled code",
            True,
        ),
    ]
    before = _compiled.fallback()
    for fn, message, fallback in cases:
        torch._dynamo.reset()
        _wrappers.use_fallback(fallback)
        try:
            with pytest.raises(Unsupported) as error:
                compiled(fn)(torch.ones(2))
        finally:
            _wrappers.use_fallback(before)
        assert not QUOTES or quoted(message, error.value), str(error.value)
