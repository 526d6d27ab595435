"""``@device_agnostic``: binding forms, target choice, moving and checking, scopes, threads, GC."""

from __future__ import annotations

import asyncio
import copy
import functools
import gc
import inspect
import multiprocessing
import pickle
import re
import threading
import weakref
from collections import namedtuple
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import accelerator as accelerator_at
from torch import nn

from devicectx import (
    DeviceMismatchError,
    InvalidDeviceError,
    device_agnostic,
    find_devices,
    on_device,
)
from devicectx.scope._stack import active_device

pytestmark = pytest.mark.torch_internals  # CI runs it on every minor torch release

CPU = torch.device("cpu")
META = torch.device("meta")

Pair = namedtuple("Pair", ["first", "second"])


@dataclass
class Batch:
    ids: torch.Tensor
    mask: torch.Tensor
    tag: str


def allocated() -> torch.device:
    """Where a factory call without ``device=`` allocates right now."""
    return torch.zeros(1).device


def devices_of(*tensors: torch.Tensor) -> list[torch.device]:
    """The device of each tensor, in order."""
    return [t.device for t in tensors]


class Net(nn.Module):
    """A small model whose forward is decorated in the class body."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    @device_agnostic
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), torch.zeros(2)


# --- binding forms ---------------------------------------------------------------------


def test_bare_form_runs_on_the_inputs_device() -> None:
    """Bare ``@device_agnostic``: inputs that agree choose the device, and the body follows."""

    @device_agnostic
    def body(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, torch.zeros(1)

    x = torch.ones(2, device="meta")
    same, new = body(x)
    assert same is x
    assert META == new.device
    assert CPU == allocated()


def test_called_form_with_no_arguments() -> None:
    """``@device_agnostic()`` behaves as the bare form."""

    @device_agnostic()
    def body(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(1)

    assert META == body(torch.ones(1, device="meta")).device


def test_keeps_name_doc_wrapped_and_signature() -> None:
    """The decorated function reads as the original: name, qualname, doc, signature."""

    def loss(pred: torch.Tensor, target: torch.Tensor, *, weight: float = 1.0) -> torch.Tensor:
        """Mean squared error."""
        return pred

    decorated = device_agnostic(device="meta")(loss)
    assert "loss" == decorated.__name__
    assert loss.__qualname__ == decorated.__qualname__
    assert "Mean squared error." == decorated.__doc__
    assert loss is decorated.__wrapped__  # type: ignore[attr-defined]
    assert inspect.signature(loss) == inspect.signature(decorated)


def test_generator_and_async_functions_are_still_recognised() -> None:
    """inspect still tells generator and async functions apart after decoration."""

    @device_agnostic
    def gen() -> Iterator[int]:
        yield 1

    @device_agnostic
    async def coro() -> int:
        return 1

    assert inspect.isgeneratorfunction(gen)
    assert inspect.iscoroutinefunction(coro)


def test_instance_method() -> None:
    """A method of a plain class: ``self`` is bound, the tensor arguments move."""

    class Scaler:
        def __init__(self) -> None:
            self.factor = 2.0

        @device_agnostic(device="meta")
        def scale(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.factor

    scaler = Scaler()
    assert META == scaler.scale(torch.ones(2)).device
    assert META == Scaler.scale(scaler, torch.ones(2)).device


@pytest.mark.parametrize("order", ["outside", "inside"])
def test_classmethod(order: str) -> None:
    """A classmethod, with the decorator outside or inside ``@classmethod``."""
    if order == "outside":

        class Maker:
            @device_agnostic(device="meta")
            @classmethod
            def make(cls, x: torch.Tensor) -> tuple[type, torch.Tensor]:
                return cls, x

    else:

        class Maker:  # type: ignore[no-redef]
            @classmethod
            @device_agnostic(device="meta")
            def make(cls, x: torch.Tensor) -> tuple[type, torch.Tensor]:
                return cls, x

    cls, x = Maker.make(torch.ones(1))
    assert Maker is cls
    assert META == x.device
    assert META == Maker().make(torch.ones(1))[1].device


@pytest.mark.parametrize("order", ["outside", "inside"])
def test_staticmethod(order: str) -> None:
    """A staticmethod, called on the class and on an instance."""
    if order == "outside":

        class Tools:
            @device_agnostic(device="meta")
            @staticmethod
            def double(x: torch.Tensor) -> torch.Tensor:
                return x * 2

    else:

        class Tools:  # type: ignore[no-redef]
            @staticmethod
            @device_agnostic(device="meta")
            def double(x: torch.Tensor) -> torch.Tensor:
                return x * 2

    assert META == Tools.double(torch.ones(1)).device
    assert META == Tools().double(torch.ones(1)).device


class Head(nn.Module):
    """A model with a decorated method that is not ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_bound_method_decorated_after_the_fact() -> None:
    """``device_agnostic(model.score)``: the bound model counts as the instance, so the
    inputs follow its device and a model off the target is named as ``self``."""
    head = Head().to("meta")
    score = device_agnostic(head.score)
    assert META == score(torch.ones(2)).device
    strict = device_agnostic(device="cpu")(head.score)
    with pytest.raises(DeviceMismatchError, match=r"Head\.score\(\) got self \(Head\) on meta"):
        strict(torch.ones(2))


def test_plain_function_gets_no_instance() -> None:
    """A decorated plain function whose first parameter is a module: that module is an
    argument (never taken for an instance), so it chooses the target and is not moved."""

    @device_agnostic
    def apply(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    head = nn.Linear(2, 2).to("meta")
    assert META == apply(head, torch.ones(2)).device
    assert META == next(head.parameters()).device


def test_module_forward_follows_the_module() -> None:
    """``forward`` decorated in the class body: inputs go to the module's device."""
    net = Net().to("meta")
    out, new = net(torch.ones(2))
    assert [META, META] == devices_of(out, new)


def test_decorating_a_class_is_refused() -> None:
    """A class is not a function: the error says to decorate its methods."""
    with pytest.raises(TypeError, match="decorate the methods"):
        device_agnostic(Net)


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", -1, 1.5, True, [0]])
def test_malformed_device_fails_at_decoration(spec: object) -> None:
    """A malformed ``device=`` is a bug in the decorating code: it fails at once, named."""
    with pytest.raises(InvalidDeviceError, match=r"^@device_agnostic\(device="):
        device_agnostic(device=spec)  # type: ignore[arg-type]


# --- which device ------------------------------------------------------------------------


def test_device_argument_beats_the_module() -> None:
    """``device=`` wins; a module elsewhere is an error, never moved."""

    @device_agnostic(device="meta")
    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x

    model = nn.Linear(2, 2)
    with pytest.raises(DeviceMismatchError):
        step(model, torch.ones(2))
    assert CPU == model.weight.device


def test_device_argument_beats_on_device() -> None:
    """``device=`` wins over an enclosing ``on_device`` block."""

    @device_agnostic(device="meta")
    def body(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, torch.zeros(1)

    with on_device("cpu"):
        assert [META, META] == devices_of(*body(torch.ones(1)))


def test_module_beats_on_device() -> None:
    """The module's device wins over an enclosing ``on_device`` block."""

    @device_agnostic
    def step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, torch.zeros(1)

    with on_device("cpu"):
        assert [META, META] == devices_of(*step(nn.Linear(2, 2).to("meta"), torch.ones(2)))


def test_instance_beats_module_arguments() -> None:
    """For a module's method, the instance chooses, not a module passed in."""

    class Student(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        @device_agnostic
        def distill(self, teacher: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return x

    student = Student().to("meta")
    teacher = nn.Linear(2, 2)
    assert META == student.distill(teacher, torch.ones(2)).device
    assert CPU == teacher.weight.device


CLASS_WEIGHTS = torch.tensor([1.0, 2.0])  # a default argument's tensor, on the CPU


@pytest.mark.filterwarnings("ignore::devicectx.RepeatedMoveWarning")
def test_a_tensor_default_is_moved_as_if_passed() -> None:
    """A default holding a tensor, left out of a call, is moved (and checked) as if the
    call had passed it; passed, the caller's value wins. The default stays where it is."""

    @device_agnostic(device="meta")
    def weighted(x: torch.Tensor, weight: torch.Tensor = CLASS_WEIGHTS) -> torch.Tensor:
        return weight

    @device_agnostic(device="meta")
    def scaled(x: torch.Tensor, *, extra: Any = (CLASS_WEIGHTS,)) -> torch.Tensor:
        return extra[0]

    assert META == weighted(torch.ones(2)).device
    assert META == weighted(x=torch.ones(2)).device
    assert META == scaled(torch.ones(2)).device
    own = torch.zeros(2, device="meta")
    assert weighted(torch.ones(2), own) is own
    assert weighted(torch.ones(2), weight=own) is own
    assert CPU == CLASS_WEIGHTS.device

    @device_agnostic(move=False)
    def checked(x: torch.Tensor, weight: torch.Tensor = CLASS_WEIGHTS) -> None:
        pass

    with pytest.raises(DeviceMismatchError) as error:
        checked(torch.ones(2, device="meta"))
    assert {META: ["x"], CPU: ["weight"]} == error.value.devices


@pytest.mark.filterwarnings("ignore::devicectx.RepeatedMoveWarning")
def test_a_tensor_default_of_a_method_is_moved() -> None:
    """The same in a method: ``self`` is not one of the call's arguments."""

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2, device="meta")

        @device_agnostic
        def loss(self, x: torch.Tensor, weight: torch.Tensor = CLASS_WEIGHTS) -> torch.Tensor:
            return weight

    head = Head()
    assert META == head.loss(torch.ones(2)).device
    assert META == Head.loss(head, torch.ones(2)).device
    own = torch.zeros(2, device="meta")
    assert head.loss(torch.ones(2), own) is own


def test_first_module_argument_chooses() -> None:
    """The first module argument chooses; later ones are neither checked nor moved."""

    @device_agnostic
    def step(model: nn.Module, teacher: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x

    teacher = nn.Linear(2, 2)
    assert META == step(nn.Linear(2, 2).to("meta"), teacher, x=torch.ones(2)).device
    assert CPU == teacher.weight.device


def test_module_passed_by_keyword_chooses() -> None:
    """A module passed by keyword counts as a module argument."""

    @device_agnostic
    def step(x: torch.Tensor, model: nn.Module) -> torch.Tensor:
        return x

    assert META == step(torch.ones(2), model=nn.Linear(2, 2).to("meta")).device


def test_data_parallel_is_looked_through() -> None:
    """A DataParallel-wrapped model chooses by the model it holds."""

    @device_agnostic
    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x

    # Built empty, then filled: where there is a GPU, DataParallel moves what it is given to
    # it (impossible from meta); with no parameters yet, it moves nothing.
    wrapped = nn.DataParallel(nn.Sequential())
    wrapped.module.append(nn.Linear(2, 2, device="meta"))
    assert META == step(wrapped, torch.ones(2)).device


def test_distributed_data_parallel_is_looked_through(tmp_path: Path) -> None:
    """A DDP-wrapped model (a real one-process gloo group) chooses the target and is checked.

    DDP's parameters are its model's, so this shows the wrapper works end to end, not
    that it is looked through (which only the device it reports could show, and that is
    the same either way).
    """
    import torch.distributed as dist

    @device_agnostic(move=False)
    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x

    store = f"file://{tmp_path / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        wrapped = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))  # on the CPU
        assert CPU == step(wrapped, torch.ones(2)).device
        with pytest.raises(DeviceMismatchError) as info:
            step(wrapped, torch.ones(2, device="meta"))
        assert CPU == info.value.target
    finally:
        dist.destroy_process_group()


def test_module_moved_between_calls_is_followed() -> None:
    """Nothing about the module is cached: after ``model.to``, the next call follows it."""
    net = Net()
    assert CPU == net(torch.ones(2))[0].device
    net.to("meta")
    assert META == net(torch.ones(2))[0].device


def test_module_without_parameters_does_not_choose() -> None:
    """A module with no parameters or buffers has no device: the next rule decides."""

    @device_agnostic
    def step(act: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(1)

    with on_device("meta"):
        assert META == step(nn.ReLU(), torch.ones(2)).device


def test_module_spread_over_devices_is_refused() -> None:
    """A module whose parameters are on several devices raises before the body runs."""
    net = Net()
    net.lin.bias = nn.Parameter(torch.zeros(2, device="meta"))
    with pytest.raises(DeviceMismatchError) as error:
        net(torch.ones(2))
    assert {CPU: ["self.lin.weight"], META: ["self.lin.bias"]} == error.value.devices
    assert CPU == error.value.target  # where most of it is: the bias is the stray


def test_on_device_beats_the_inputs() -> None:
    """Inside ``on_device``, inputs elsewhere are moved to its device."""

    @device_agnostic
    def body(x: torch.Tensor) -> torch.Tensor:
        return x

    with on_device("meta"):
        assert META == body(torch.ones(1)).device


def test_torch_default_device_is_not_on_device() -> None:
    """torch's own default (``set_default_device``) does not choose: only on_device does."""

    @device_agnostic
    def body(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, torch.zeros(1)

    with torch.device("cpu"):
        x, new = body(torch.ones(1, device="meta"))
    assert [META, META] == devices_of(x, new)


def test_nested_decorated_call_follows_the_outer_scope() -> None:
    """A decorated function called from a decorated body sees the outer target."""

    @device_agnostic
    def inner(x: torch.Tensor) -> torch.Tensor:
        return x

    @device_agnostic(device="meta")
    def outer(x: torch.Tensor) -> torch.device | None:
        assert META == inner(torch.ones(1)).device
        return active_device()

    assert META == outer(torch.ones(1))
    assert active_device() is None


def test_inputs_that_disagree_are_refused() -> None:
    """With no rule to choose, inputs on two devices raise before the body runs."""
    ran = []

    @device_agnostic
    def body(a: torch.Tensor, b: torch.Tensor) -> None:
        ran.append(True)

    with pytest.raises(DeviceMismatchError) as error:
        body(torch.ones(1), torch.ones(1, device="meta"))
    assert [] == ran
    assert {CPU: ["a"], META: ["b"]} == error.value.devices


def test_cpu_scalars_do_not_disagree() -> None:
    """A 0-dim CPU tensor next to meta tensors does not count: the call runs on meta."""

    @device_agnostic(move=False)
    def body(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * scale, torch.zeros(1)

    scale = torch.tensor(2.0)
    out, new = body(torch.ones(2, device="meta"), scale)
    assert [META, META] == devices_of(out, new)
    assert CPU == scale.device


def test_under_vmap_a_per_sample_scalar_counts_as_its_batch() -> None:
    """Under ``torch.func.vmap`` a (B,) CPU tensor is 0-dim per sample, but torch does not
    mix it with another device: it counts as the tensor it is, and the call is refused
    before the body, as the same call without vmap is."""
    ran: list[bool] = []

    @device_agnostic(move=False)
    def scale(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        ran.append(True)
        return x * s

    x, s = torch.ones(3, 4, device="meta"), torch.ones(3)
    with pytest.raises(DeviceMismatchError) as error:
        torch.func.vmap(scale)(x, s)
    assert [] == ran
    assert {CPU, META} == set(error.value.devices)
    inner = torch.func.vmap(lambda y, t: torch.func.grad(lambda u: scale(u, t).sum())(y))
    with pytest.raises(DeviceMismatchError):  # through grad's wrapper too
        inner(x, s)
    assert [] == ran
    assert META == torch.func.vmap(scale, in_dims=(0, None))(x, torch.tensor(2.0)).device
    assert [True] == ran  # a real scalar mixes with any device: it ran


def test_no_tensors_no_scope() -> None:
    """A call without tensors and with no rule naming a device runs where it is."""

    @device_agnostic
    def body(n: int) -> torch.Tensor:
        return torch.zeros(n)

    assert CPU == body(2).device


def test_auto_follows_the_environment_at_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """``device="auto"`` is resolved per call, so DEVICECTX_DEVICE changes are seen."""

    @device_agnostic(device="auto")
    def body() -> torch.Tensor:
        return torch.zeros(1)

    monkeypatch.setenv("DEVICECTX_DEVICE", "meta")
    assert META == body().device
    monkeypatch.setenv("DEVICECTX_DEVICE", "cpu")
    assert CPU == body().device


# --- moving and checking -----------------------------------------------------------------


def test_nested_arguments_are_moved_and_not_mutated() -> None:
    """Every tensor at any depth moves; containers keep their types; inputs are untouched."""
    seen: list[Any] = []

    @device_agnostic(device="meta")
    def body(batch: dict[str, Any], pair: Pair, data: Batch, n: int, *, name: str) -> None:
        seen.extend([batch, pair, data, n, name])

    ids = torch.ones(2)
    batch = {"x": [ids, (torch.ones(1),)], "note": "keep"}
    pair = Pair(torch.ones(1), 3)
    data = Batch(ids=torch.ones(2), mask=torch.ones(2), tag="t")
    body(batch, pair, data, 5, name="n")
    moved_batch, moved_pair, moved_data, n, name = seen
    assert [META, META] == devices_of(moved_batch["x"][0], moved_batch["x"][1][0])
    assert "keep" == moved_batch["note"]
    assert Pair is type(moved_pair)
    assert [META, META] == devices_of(moved_pair.first, moved_data.ids)
    assert Batch is type(moved_data)
    assert (5, "n") == (n, name)
    assert CPU == batch["x"][0].device  # type: ignore[index]
    assert ids is batch["x"][0]  # type: ignore[index]


def test_tensor_passed_twice_is_moved_once() -> None:
    """Aliasing across arguments is kept: one tensor in, one moved tensor out."""

    @device_agnostic(device="meta")
    def body(a: torch.Tensor, b: dict[str, torch.Tensor]) -> bool:
        return a is b["same"]

    x = torch.ones(2)
    assert body(x, {"same": x})


def test_tensors_already_on_target_are_not_copied() -> None:
    """A tensor already on the target arrives as the same object."""

    @device_agnostic(device="meta")
    def body(x: torch.Tensor) -> torch.Tensor:
        return x

    x = torch.ones(1, device="meta")
    assert x is body(x)


def test_move_false_passes_when_all_on_target() -> None:
    """``move=False`` and everything on the target: the call runs with the same objects."""

    @device_agnostic(device="meta", move=False)
    def body(x: torch.Tensor) -> torch.Tensor:
        return x

    x = torch.ones(1, device="meta")
    assert x is body(x)


def test_move_false_refuses_before_the_body() -> None:
    """``move=False`` and a tensor elsewhere: the body never runs, arguments unchanged."""
    ran = []

    @device_agnostic(device="meta", move=False)
    def body(x: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
        ran.append(True)

    x = torch.ones(1, device="meta")
    batch = {"mask": torch.ones(1)}
    with pytest.raises(DeviceMismatchError) as error:
        body(x, batch)
    assert [] == ran
    assert {META: ["x"], CPU: ["batch['mask']"]} == error.value.devices
    assert META == error.value.target
    assert CPU == batch["mask"].device


def test_module_argument_is_never_moved() -> None:
    """Tensors move to the module's device; the module itself stays the same object."""

    @device_agnostic
    def step(model: nn.Module, x: torch.Tensor) -> tuple[nn.Module, torch.Tensor]:
        return model, x

    model = nn.Linear(2, 2).to("meta")
    weight = model.weight
    same, x = step(model, torch.ones(2))
    assert model is same
    assert weight is model.weight
    assert META == x.device


def test_module_inside_a_container_is_never_moved() -> None:
    """A module nested in an argument stays where it is; the tensors around it move."""

    @device_agnostic(device="meta")
    def body(parts: list[Any]) -> list[Any]:
        return parts

    layer = nn.Linear(2, 2)
    moved = body([layer, torch.ones(1)])
    assert layer is moved[0]
    assert (CPU, META) == (layer.weight.device, moved[1].device)


@pytest.mark.parametrize("how", ["position", "keyword"])
def test_exclude_by_name(how: str) -> None:
    """Excluded parameters are neither moved nor checked, by position or by keyword."""

    @device_agnostic(device="meta", move=False, exclude=("keep",))
    def body(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return keep

    keep = torch.ones(1)
    x = torch.ones(1, device="meta")
    assert keep is (body(x, keep) if how == "position" else body(x, keep=keep))


def test_exclude_keeps_values_in_place_while_others_move() -> None:
    """With ``move=True``, the excluded argument stays; the others move around it."""

    @device_agnostic(device="meta", exclude="cache")
    def body(
        x: torch.Tensor, cache: torch.Tensor, y: torch.Tensor, *, z: torch.Tensor
    ) -> list[torch.device]:
        return devices_of(x, cache, y, z)

    assert [META, CPU, META, META] == body(
        torch.ones(1), torch.ones(1), torch.ones(1), z=torch.ones(1)
    )


def test_an_in_place_write_to_a_leaf_that_requires_grad_fails_only_where_nothing_moved() -> None:
    """The body writes to the copy the call moved: no leaf, so torch lets an in-place op
    change it, the caller's leaf untouched; where nothing moved, torch refuses the write to
    the leaf itself (docs/limits.md says so)."""

    @device_agnostic(device="meta")
    def normalized(x: torch.Tensor) -> torch.Tensor:
        return x.div_(x.norm())

    x = torch.ones(3, requires_grad=True)
    assert META == normalized(x).device
    assert torch.equal(torch.ones(3), x.detach())
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        normalized(torch.ones(3, device="meta", requires_grad=True))


def test_exclude_varargs_and_varkw() -> None:
    """Naming ``*args`` or ``**kwargs`` excludes all that they collect."""

    @device_agnostic(device="meta", exclude=("rest", "extra"))
    def body(x: torch.Tensor, *rest: torch.Tensor, **extra: torch.Tensor) -> list[torch.device]:
        return devices_of(x, *rest, *extra.values())

    assert [META, CPU, CPU, CPU] == body(
        torch.ones(1), torch.ones(1), torch.ones(1), e=torch.ones(1)
    )


class Holder:
    """Each kind of method, with ``keep`` excluded; ``check`` moves nothing."""

    @device_agnostic(device="meta", exclude=("keep",))
    def run(self, x: torch.Tensor, keep: torch.Tensor) -> list[torch.device]:
        return devices_of(x, keep)

    @device_agnostic(device="meta", exclude=("keep",))
    @classmethod
    def run_class(cls, x: torch.Tensor, keep: torch.Tensor) -> list[torch.device]:
        return devices_of(x, keep)

    @device_agnostic(device="meta", exclude=("keep",))
    @staticmethod
    def run_static(x: torch.Tensor, keep: torch.Tensor) -> list[torch.device]:
        return devices_of(x, keep)

    @device_agnostic(device="meta", move=False)
    def check(self, x: torch.Tensor, y: torch.Tensor) -> None:
        pass


HOLDER = Holder()
BINDING_FORMS: dict[str, Callable[..., Any]] = {
    "holder.run": HOLDER.run,
    "Holder.run(holder, ...)": functools.partial(Holder.run, HOLDER),
    "Holder.run_class": Holder.run_class,
    "holder.run_class": HOLDER.run_class,
    "Holder.run_static": Holder.run_static,
    "holder.run_static": HOLDER.run_static,
}


@pytest.mark.parametrize("form", BINDING_FORMS)
def test_exclude_on_a_method_counts_from_after_self(form: str) -> None:
    """For a method, positions are counted without ``self`` (or ``cls``), however it is
    called: through the class with the instance first too, where wrapt binds it."""
    assert [META, CPU] == BINDING_FORMS[form](torch.ones(1), torch.ones(1))


@pytest.mark.parametrize("form", ["holder.check", "Holder.check(holder, ...)"])
def test_mismatch_on_a_method_names_the_arguments_after_self(form: str) -> None:
    """A method's arguments keep their names in the error, however it is called."""
    check = HOLDER.check if form == "holder.check" else functools.partial(Holder.check, HOLDER)
    with pytest.raises(DeviceMismatchError) as error:
        check(torch.ones(1, device="meta"), torch.ones(1))
    assert {META: ["x"], CPU: ["y"]} == error.value.devices


def test_exclude_unknown_name_is_refused() -> None:
    """A name the function does not take is a typo: refused at decoration."""

    def loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return pred

    with pytest.raises(ValueError, match="'lables'"):
        device_agnostic(exclude=("lables",))(loss)


# --- output and scope ----------------------------------------------------------------


def test_output_input_returns_to_where_inputs_came_from() -> None:
    """``output="input"``: a result made elsewhere goes back to the inputs' device."""

    @device_agnostic(output="input")
    def body(x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"made": torch.zeros(1, device="cpu"), "same": x}

    x = torch.ones(1, device="meta")
    result = body(x)
    assert META == result["made"].device
    assert x is result["same"]


@dataclass
class Transition:
    """An RL transition: a reward, a 0-dim CPU tensor as an environment gives it."""

    reward: torch.Tensor


Reward = namedtuple("Reward", "value")


@pytest.mark.requires_device("accelerator")
@pytest.mark.parametrize(
    "wrap",
    [lambda r: r, lambda r: [r], lambda r: {"r": r}, Reward, Transition],
    ids=["bare", "list", "dict", "namedtuple", "dataclass"],
)
def test_output_input_returns_0_dim_inputs_to_where_they_came_from(
    wrap: Callable[[torch.Tensor], Any],
) -> None:
    """0-dim CPU tensors alone (a reward): the result goes back to the CPU, whatever holds
    them; in a dataclass or a namedtuple it stayed on the target."""

    @device_agnostic(device=accelerator_at(), output="input")
    def passed_through(obj: Any) -> Any:
        assert {accelerator_at()} == set(find_devices(obj))
        return obj

    result = passed_through(wrap(torch.tensor(1.5)))
    assert {CPU} == set(find_devices(result))


@pytest.mark.requires_device("accelerator")
@pytest.mark.parametrize(
    "observation",
    [np.ones(4, dtype=np.float32), [1.0, 1.0, 1.0, 1.0], None],
    ids=["numpy", "list", "nothing"],
)
def test_output_input_returns_to_the_cpu_where_no_input_is_a_tensor(observation: Any) -> None:
    """No tensor among the inputs (an RL policy given the numpy array ``env.step``
    returned, Python numbers, nothing but the model): the caller's data lives on the
    host, so the result goes back to the CPU; it stayed on the model's device."""
    net = nn.Linear(4, 2).to(accelerator_at())

    @device_agnostic(output="input")
    def policy(net: nn.Linear, obs: Any) -> torch.Tensor:
        made = torch.ones(4) if obs is None else torch.as_tensor(obs, dtype=torch.float32)
        return net(made).detach()

    assert CPU == policy(net, observation).device

    @device_agnostic(output="input")
    def rollout(net: nn.Linear, obs: Any) -> Iterator[torch.Tensor]:
        yield policy.__wrapped__(net, obs)

    assert [CPU] == [item.device for item in rollout(net, observation)]


class _Held:
    """A plain object holding a tensor, which the decorator's look does not see into."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


@pytest.mark.requires_device("accelerator")
def test_output_input_leaves_a_result_whose_inputs_it_could_not_look_at() -> None:
    """No tensor input the look saw, but one it did not look at (in a plain object, or an
    excluded argument): the caller's data may be on the device, so the result stays there,
    as before the CPU default for host data; it is not copied to the CPU."""
    device = accelerator_at()
    net = nn.Linear(4, 2).to(device)

    @device_agnostic(output="input")
    def held(net: nn.Linear, batch: _Held) -> torch.Tensor:
        return net(batch.x)

    @device_agnostic(output="input", exclude=("x",))
    def excluded(net: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return net(x)

    x = torch.ones(4, device=device)
    assert [device, device] == [held(net, _Held(x)).device, excluded(net, x).device]


def test_output_device_moves_the_result() -> None:
    """``output=<device>`` moves the result there, whatever the target."""

    @device_agnostic(device="cpu", output="meta")
    def body(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, torch.zeros(1)

    assert [META, META] == devices_of(*body(torch.ones(1)))


def test_output_none_leaves_the_result() -> None:
    """The default ``output=None`` leaves the result where the body put it."""

    @device_agnostic(device="meta")
    def body() -> torch.Tensor:
        return torch.zeros(1, device="cpu")

    assert CPU == body().device


def test_scope_false_leaves_the_default_device() -> None:
    """``scope=False``: inputs move, but the body's own tensors follow torch's default."""

    @device_agnostic(device="meta", scope=False)
    def body(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, torch.zeros(1)

    assert [META, CPU] == devices_of(*body(torch.ones(1)))


def test_scope_is_left_on_exception() -> None:
    """An exception in the body leaves the scope: the default device is restored."""

    @device_agnostic(device="meta")
    def body() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError):
        body()
    assert CPU == allocated()


# --- generators and async ------------------------------------------------------------


def test_generator_is_scoped_at_each_resume_and_output_per_item() -> None:
    """The device is entered at every resume and left at every yield; items are placed."""

    @device_agnostic(device="cpu", output="meta")
    def gen(x: torch.Tensor) -> Iterator[torch.Tensor]:
        for _ in range(3):
            assert CPU == allocated()
            yield torch.zeros(1, device="cpu")

    x = torch.ones(1)
    with on_device("meta"):
        items = []
        for item in gen(x):
            assert META == allocated()
            items.append(item.device)
    assert [META, META, META] == items


def test_generator_send_throw_and_return() -> None:
    """send, throw and the return value pass through the scoped generator."""

    @device_agnostic(device="meta")
    def gen() -> Iterator[Any]:
        received = yield torch.zeros(1)
        try:
            yield received
        except KeyError:
            yield "caught"
        return "done"

    it = gen()
    assert META == next(it).device
    assert "hi" == it.send("hi")
    assert "caught" == it.throw(KeyError("k"))
    with pytest.raises(StopIteration) as stop:
        next(it)
    assert "done" == stop.value.value
    assert CPU == allocated()


def test_generator_inputs_are_checked_at_the_call() -> None:
    """A generator's inputs are checked when it is called, before any item is asked for."""

    @device_agnostic(device="meta", move=False)
    def gen(x: torch.Tensor) -> Iterator[int]:
        yield 1

    with pytest.raises(DeviceMismatchError):
        gen(torch.ones(1))


def test_async_function() -> None:
    """An async function's body runs scoped, and ``output=`` applies to the awaited result."""

    @device_agnostic(device="cpu", output="meta")
    async def work(x: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        await asyncio.sleep(0)
        return allocated(), torch.zeros(1, device="cpu")

    x = torch.ones(1)
    with on_device("meta"):
        inside, result = asyncio.run(work(x))
    assert (CPU, META) == (inside, result.device)


def test_async_tasks_keep_their_own_targets() -> None:
    """Two interleaved decorated coroutines each see their own device."""

    @device_agnostic
    async def work(x: torch.Tensor, hops: int) -> list[torch.device]:
        seen = []
        for _ in range(hops):
            await asyncio.sleep(0)
            seen.append(allocated())
        return seen

    async def main() -> list[list[torch.device]]:
        return list(
            await asyncio.gather(work(torch.ones(1, device="meta"), 4), work(torch.ones(1), 4))
        )

    assert [[META] * 4, [CPU] * 4] == asyncio.run(main())


def test_async_generator() -> None:
    """An async generator is scoped at each resume; items are placed by ``output=``."""

    @device_agnostic(device="cpu", output="meta")
    async def agen() -> AsyncIterator[tuple[torch.device, torch.Tensor]]:
        for _ in range(2):
            await asyncio.sleep(0)
            yield allocated(), torch.zeros(1, device="cpu")

    async def main() -> list[tuple[torch.device, torch.device]]:
        return [(inside, item.device) async for inside, item in agen()]

    assert [(CPU, META), (CPU, META)] == asyncio.run(main())


# --- threads and garbage ----------------------------------------------------------------


def test_threads_each_see_their_own_target() -> None:
    """Eight threads calling one decorated function concurrently never see each other."""

    @device_agnostic
    def body(x: torch.Tensor) -> torch.device:
        return allocated()

    barrier = threading.Barrier(8)
    results: dict[int, list[torch.device]] = {}

    def run(index: int) -> None:
        x = torch.ones(1, device="meta" if index % 2 else "cpu")
        barrier.wait()
        results[index] = [body(x) for _ in range(200)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    expected = {i: [META if i % 2 else CPU] * 200 for i in range(8)}
    assert expected == results


def make_decorated() -> Callable[[torch.Tensor], torch.Tensor]:
    """A fresh function, decorated, with nothing else holding it."""

    def body(x: torch.Tensor) -> torch.Tensor:
        return x + torch.zeros(1)

    return device_agnostic(device="meta")(body)


@pytest.mark.parametrize("calls", [0, 2])
def test_decorated_function_is_freed_without_the_cycle_collector(calls: int) -> None:
    """Dropping the last reference frees the wrapper and the function: no reference cycle."""
    # torch keeps the frames of a process's first meta op alive (its Python kernel's, and
    # through them its caller's): one undecorated first, so that they are not the body's.
    torch.ones(1, device="meta") + torch.zeros(1, device="meta")
    gc.collect()
    gc.disable()
    try:
        decorated = make_decorated()
        for _ in range(calls):
            decorated(torch.ones(1))
        wrapper_ref = weakref.ref(decorated)
        function_ref = weakref.ref(decorated.__wrapped__)  # type: ignore[attr-defined]
        del decorated
        assert wrapper_ref() is None
        assert function_ref() is None
    finally:
        gc.enable()


def test_failed_call_leaves_no_cycle() -> None:
    """A call that raises DeviceMismatchError leaves nothing to the cycle collector."""
    gc.collect()
    gc.disable()
    try:

        @device_agnostic(move=False, device="meta")
        def body(x: torch.Tensor) -> None:
            pass

        with pytest.raises(DeviceMismatchError):
            body(torch.ones(1))
        ref = weakref.ref(body)
        del body
        assert ref() is None
    finally:
        gc.enable()


# --- pickling and copying ---------------------------------------------------------------


@device_agnostic(device="meta")
def allocates_on_meta(size: int) -> str:
    """Module level, so it can be pickled: where a factory call allocates inside it."""
    return str(torch.zeros(size).device)


def test_pickles_by_reference_like_a_function() -> None:
    """A module-level decorated function pickles as its name and comes back as itself."""
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        assert pickle.loads(pickle.dumps(allocates_on_meta, protocol)) is allocates_on_meta


def test_local_function_is_refused_by_pickle_as_functions_are() -> None:
    """A decorated local function cannot be pickled, with pickle's own error for functions."""

    @device_agnostic
    def local(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises((pickle.PicklingError, AttributeError), match="local"):
        pickle.dumps(local)


def _subtract(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a - b


checked = device_agnostic(move=False)(_subtract)  # decorated under another name
offset = device_agnostic(device="meta")(functools.partial(_subtract, b=torch.ones(1)))


@pytest.mark.parametrize("name", ["checked", "offset"])
def test_a_decorated_object_its_name_does_not_lead_to_pickles_decorated_again(name: str) -> None:
    """Decorated under another name than its function's, or a partial (which has none), it
    is pickled as its function and comes back decorated as it was; pickle refused both, the
    first with "not the same object as" the undecorated function."""
    decorated = globals()[name]
    back = pickle.loads(pickle.dumps(decorated))
    assert back is not decorated
    if name == "checked":
        assert back.__wrapped__ is _subtract
        with pytest.raises(DeviceMismatchError):
            back(torch.ones(1), torch.ones(1, device="meta"))
    else:
        assert META == back(torch.ones(1)).device


def test_cloudpickle_ships_a_function_by_value_decorated() -> None:
    """cloudpickle pickles the functions of ``__main__`` (a notebook's, a script's: what Ray,
    joblib and Dask ship to their workers) by value, from their code, as it does a module
    registered so: a decorated function and a module's decorated forward come back
    decorated. The function came back undecorated, moving nothing, silently."""
    cloudpickle = pytest.importorskip("cloudpickle")
    import pickle_subjects

    cloudpickle.register_pickle_by_value(pickle_subjects)
    try:
        step = cloudpickle.loads(cloudpickle.dumps(pickle_subjects.step))
        # What a class shipped by value holds (in this process cloudpickle hands back the
        # class it has, so its forward is pickled alone here).
        forward = cloudpickle.loads(cloudpickle.dumps(vars(pickle_subjects.Model)["forward"]))
    finally:
        cloudpickle.unregister_pickle_by_value(pickle_subjects)
    assert step is not pickle_subjects.step
    assert META == step(torch.ones(2)).device
    model = pickle_subjects.Model().to("meta")
    assert forward is not vars(pickle_subjects.Model)["forward"]
    assert META == forward(model, torch.ones(2, 2)).device


def test_runs_in_a_spawned_process() -> None:
    """Sent to a spawned worker (as a DataLoader or torch.multiprocessing does), it still
    scopes its body there."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert "meta" == pool.submit(allocates_on_meta, 2).result()


class Maker:
    """Module level, so its methods can be pickled: a class method and a static method."""

    @device_agnostic(device="meta")
    @classmethod
    def make(cls, size: int) -> tuple[type, str]:
        return cls, str(torch.zeros(size).device)

    @device_agnostic(device="meta")
    @staticmethod
    def make_static(size: int) -> str:
        return str(torch.zeros(size).device)


def test_bound_methods_pickle_as_methods_do() -> None:
    """A decorated method pickles as its instance (or class) and name, as a bound method does,
    and comes back decorated."""
    model = Net().to("meta")
    forward = pickle.loads(pickle.dumps(model.forward))
    assert forward.__self__ is not model
    assert META == forward.__self__.lin.weight.device
    assert [META, META] == devices_of(*forward(torch.ones(2)))
    assert (Maker, "meta") == pickle.loads(pickle.dumps(Maker.make))(1)
    assert (Maker, "meta") == pickle.loads(pickle.dumps(Maker().make))(1)
    assert "meta" == pickle.loads(pickle.dumps(Maker().make_static))(1)
    through_class = pickle.loads(pickle.dumps(Holder.run))  # wrapt 1 keeps no owner here
    assert [META, CPU] == through_class(HOLDER, torch.ones(1), torch.ones(1))


def test_a_bound_method_shows_as_a_bound_method() -> None:
    """A decorated method reached through its instance (or its class, for a classmethod)
    shows as Python shows a bound method, not as wrapt's proxy with two addresses."""
    model = Net()
    assert f"<bound method Net.forward of {model!r}>" == repr(model.forward)
    assert f"<bound method Maker.make of {Maker!r}>" == repr(Maker.make)
    assert f"<bound method Maker.make of {Maker!r}>" == repr(Maker().make)  # its class


def test_a_function_shows_as_a_function() -> None:
    """A decorated function, a method reached through its class and a static method show as
    Python shows a function (a method through its class was shown bound to the class, as a
    classmethod is); a decorated bound method, as the bound method."""
    assert re.fullmatch(r"<function allocates_on_meta at 0x[0-9a-f]+>", repr(allocates_on_meta))
    assert re.fullmatch(r"<function Net\.forward at 0x[0-9a-f]+>", repr(Net.forward))
    for static in (Maker.make_static, Maker().make_static):
        assert re.fullmatch(r"<function Maker\.make_static at 0x[0-9a-f]+>", repr(static))
    model = Net()
    assert f"<bound method Net.forward of {model!r}>" == repr(
        device_agnostic(Net.forward.__wrapped__.__get__(model))
    )


def test_bound_methods_copy_as_methods_do() -> None:
    """copy keeps a decorated method's instance; deepcopy binds it to a copy of the instance."""
    model = Net().to("meta")
    assert copy.copy(model.forward).__self__ is model
    copied = copy.deepcopy(model.forward)
    assert copied.__self__ is not model
    assert copied.__self__.lin.weight is not model.lin.weight
    assert [META, META] == devices_of(*copied(torch.ones(2)))
    assert (Maker, "meta") == copy.deepcopy(Maker.make)(1)


class Scorer(nn.Module):
    """A model holding a decorated function as an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.loss = allocates_on_meta


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy])
def test_copies_are_the_same_function(copier: Callable[[Any], Any]) -> None:
    """copy and deepcopy return the decorated function itself, so a model holding one copies."""
    assert copier(allocates_on_meta) is allocates_on_meta
    model = Scorer()
    copied = copier(model)
    assert copied.loss is allocates_on_meta
    assert "meta" == copied.loss(1)


def test_deepcopy_of_a_model_with_a_decorated_forward() -> None:
    """A model whose forward is decorated in the class body deep-copies and still works."""
    model = Net().to("meta")
    copied = copy.deepcopy(model)
    assert copied.lin.weight is not model.lin.weight
    assert [META, META] == devices_of(*copied(torch.ones(2)))


class Student(nn.Module):
    """A model keeping its forward decorated as an attribute, as the fix for decorating a
    module instance writes it (``forward = device_agnostic(model.forward)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.step = device_agnostic(self.forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_a_deep_copied_model_holding_its_decorated_forward_runs_the_copy() -> None:
    """An EMA teacher deep-copied from its student computes with the teacher's weights: the
    wrapper of a bound method is copied with the method (as Python copies one undecorated)
    and keeps its options; pickle agrees."""
    student = Student()
    for teacher in (copy.deepcopy(student), pickle.loads(pickle.dumps(student))):
        with torch.no_grad():
            teacher.scale.fill_(10.0)
        assert 10.0 == teacher.step(torch.ones(1)).item()
        assert teacher.step.__wrapped__.__self__ is teacher
        assert 1.0 == student.step(torch.ones(1)).item()
    options = device_agnostic(student.forward, output="input")
    assert "input" == copy.deepcopy(options)._self_plan.options["output"]


def test_a_deep_copied_decorated_partial_copies_its_tensors() -> None:
    """A decorated ``partial`` holding a tensor deep-copies it, as the partial alone does;
    a decorated function stays itself (above)."""
    weight = torch.ones(1)
    scaled = device_agnostic(functools.partial(torch.mul, weight))
    copied = copy.deepcopy(scaled)
    assert copied is not scaled
    assert copied.__wrapped__.args[0] is not weight
    weight.fill_(3.0)
    assert 1.0 == copied(torch.ones(1)).item()


# --- a real accelerator (skipped without one) ------------------------------------------


def accelerator() -> torch.device:
    """This machine's accelerator at its current index."""
    found = torch.accelerator.current_accelerator()
    assert found is not None
    return torch.device(found.type, torch.accelerator.current_device_index())


@pytest.mark.requires_device("accelerator")
def test_accelerator_round_trip_with_output_input() -> None:
    """CPU tensors in, the work on the GPU, CPU tensors back: the case ``"input"`` is for."""
    gpu = accelerator()

    @device_agnostic(device=gpu, output="input", non_blocking=True)
    def work(x: torch.Tensor) -> tuple[torch.Tensor, torch.device]:
        return x * 2 + torch.ones(2), allocated()

    result, inside = work(torch.ones(2))
    assert (CPU, gpu) == (result.device, inside)
    assert [3.0, 3.0] == result.tolist()


@pytest.mark.requires_device("accelerator")
def test_accelerator_module_chooses_and_mismatch_names_it() -> None:
    """A model on the GPU draws CPU inputs to it; with move=False they are refused."""
    gpu = accelerator()
    net = Net().to(gpu)
    out, new = net(torch.ones(2))
    assert [gpu, gpu] == devices_of(out, new)

    @device_agnostic(move=False)
    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model.lin(x)

    with pytest.raises(DeviceMismatchError) as error:
        step(net, torch.ones(2))
    assert {CPU: ["x"]} == error.value.devices


@pytest.mark.requires_device("accelerator")
def test_accelerator_decorated_call_makes_its_index_current() -> None:
    """With two devices, a decorated call to the one that is not current makes its index
    current for the body, a nested call to the other its own; each index comes back after
    a return and after an exception, at every call."""
    if torch.accelerator.device_count() < 2:
        pytest.skip("needs an accelerator with two devices (the emulated one has two)")
    first, second = accelerator_at(0), accelerator_at(1)
    seen: list[tuple[int, torch.device]] = []

    def record() -> None:
        seen.append((torch.accelerator.current_device_index(), allocated()))

    @device_agnostic(device=first)
    def inner() -> None:
        record()
        raise ValueError("inner")

    @device_agnostic(device=second)
    def outer() -> None:
        record()
        with pytest.raises(ValueError, match="inner"):
            inner()
        record()

    assert 0 == torch.accelerator.current_device_index()
    for _ in range(2):  # the second time, with what the first learnt of each device
        outer()
        assert 0 == torch.accelerator.current_device_index()
    assert [(1, second), (0, first), (1, second)] * 2 == seen


@pytest.mark.requires_device("accelerator")
def test_a_returned_parameter_moved_back_keeps_its_gradient_path() -> None:
    """output="input" copies a returned parameter as ``.to`` does: a loss on the copy
    reaches the model's parameter (a tied weight, a codebook returned for a regulariser)."""
    model = nn.Linear(3, 1).to(accelerator_at())

    @device_agnostic(output="input")
    def forward(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return model(x), model.weight

    _, weight = forward(model, torch.ones(2, 3))
    assert (torch.device("cpu"), False) == (weight.device, weight.is_leaf)
    weight.sum().backward()
    assert model.weight.grad is not None
    assert torch.equal(torch.ones(1, 3), model.weight.grad.cpu())


@pytest.mark.requires_device("accelerator")
def test_a_body_that_turns_grad_on_under_the_callers_no_grad_differentiates_its_inputs() -> None:
    """Under the caller's no_grad, a body that turns autograd on (a saliency map, an inner
    step) sees its moved inputs as it sees the caller's: requiring grad, their gradients
    reaching the caller's tensors, as undecorated; the result moved back keeps its path."""
    model = nn.Linear(3, 1).to(accelerator_at())
    x = torch.ones(2, 3, requires_grad=True)
    temperature = nn.Parameter(torch.tensor(2.0))

    def inner(model: nn.Module, x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            loss = (model(x) / temperature).sum()
            (saliency,) = torch.autograd.grad(loss, x, retain_graph=True)
            loss.backward()
        return saliency

    with torch.no_grad():
        saliency = device_agnostic(output="input")(inner)(model, x, temperature)
    assert temperature.grad is not None
    decorated = (saliency, temperature.grad.clone())
    temperature.grad = None
    with torch.no_grad():
        undecorated = inner(model.cpu(), x, temperature)
    assert torch.allclose(decorated[0], undecorated)
    assert temperature.grad is not None
    assert torch.allclose(decorated[1], temperature.grad)


@pytest.mark.requires_device("accelerator")
@pytest.mark.parametrize("compiled", [False, True])
def test_a_loose_parameter_trains_through_a_decorated_call(compiled: bool) -> None:
    """A learnable parameter passed beside a model (a temperature, a prompt) reaches the
    body as a copy through autograd: its gradient lands on the caller's parameter, which
    the caller's optimizer steps, eagerly and compiled alike."""
    device = accelerator_at()
    model = nn.Linear(3, 3).to(device)
    temperature = nn.Parameter(torch.tensor(2.0))
    optimizer = torch.optim.SGD([temperature], lr=0.5)
    seen: list[tuple[bool, bool]] = []

    @device_agnostic
    def loss_fn(model: nn.Module, x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            seen.append((temperature.is_leaf, isinstance(temperature, nn.Parameter)))
        return (model(x) / temperature).logsumexp(-1).mean()

    call = torch.compile(loss_fn, backend="eager") if compiled else loss_fn
    call(model, torch.randn(4, 3), temperature).backward()

    assert temperature.grad is not None
    assert torch.device("cpu") == temperature.grad.device
    optimizer.step()
    assert 2.0 != temperature.item()
    assert compiled or [(False, False)] == seen
