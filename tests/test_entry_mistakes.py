"""Mistakes made where a function is decorated or a block is written: each raises there, at
once, with a fix that works when pasted as written."""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from devicectx import (
    DeviceMismatchError,
    DeviceUnavailableError,
    InvalidDeviceError,
    device_agnostic,
    on_device,
    resolve_device,
    set_repeated_move_warning,
    shrink_batch_on_oom,
    to_device,
)

META = torch.device("meta")


def fix_code(error: pytest.ExceptionInfo[BaseException], before: str = "\0") -> str:
    """The code of the error's fix: its last line after ``fix: ``, up to ``before``."""
    fix = str(error.value).splitlines()[-1]
    assert fix.startswith("fix: ")
    return fix.removeprefix("fix: ").partition(before)[0]


def pasted(code: str, **names: Any) -> dict[str, Any]:
    """Run a fix as a user would paste it into their file; the names after."""
    scope: dict[str, Any] = {
        "device_agnostic": device_agnostic,
        "on_device": on_device,
        "torch": torch,
        **names,
    }
    exec(code, scope)
    return scope


class Net(nn.Module):
    """A model of the user's own: its class can take the decorator."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]


# --- @device_agnostic given the device in the function's place -----------------------


def test_a_positional_device_name_is_refused_with_the_keyword_fix() -> None:
    """``@device_agnostic("meta")`` raises at the decorator's line, not at the ``def``
    with Python's "'str' object is not callable"."""
    with pytest.raises(TypeError) as error:
        device_agnostic("meta")  # type: ignore[call-overload]
    expected = (
        "@device_agnostic takes the device by keyword, and got 'meta' where the function "
        "to decorate goes\n"
        'fix: @device_agnostic(device="meta")'
    )
    assert expected == str(error.value)


def test_the_positional_device_fix_works_when_pasted() -> None:
    """The fix, written above a ``def``, decorates it for that device."""
    with pytest.raises(TypeError) as error:
        device_agnostic("meta")  # type: ignore[call-overload]
    code = fix_code(error) + "\ndef step(model, x):\n    return model(x)\n"
    step = pasted(code)["step"]
    assert META == step(nn.Linear(4, 2, device="meta"), torch.ones(3, 4)).device


@pytest.mark.parametrize(
    ("spec", "written"),
    [(torch.device("meta"), '"meta"'), (torch.device("cpu"), '"cpu"'), (0, "0")],
)
def test_a_positional_torch_device_or_index_is_refused_with_its_keyword_fix(
    spec: Any, written: str
) -> None:
    """A ``torch.device`` or an index where the function goes gets the same fix, the
    device written as ``device=`` takes it."""
    with pytest.raises(TypeError) as error:
        device_agnostic(spec)
    assert f"and got {spec!r} where the function to decorate goes" in str(error.value)
    assert f"@device_agnostic(device={written})" == fix_code(error)


@pytest.mark.parametrize("value", [[1, 2], torch.ones(2), True, 2.5])
def test_anything_else_that_cannot_be_called_is_refused_at_once(value: Any) -> None:
    """A value that is neither a function nor a device is refused where it is passed,
    naming its type."""
    with pytest.raises(TypeError) as error:
        device_agnostic(value)
    expected = (
        f"@device_agnostic decorates functions and methods, and got a "
        f"{type(value).__qualname__}, which cannot be called\n"
        "fix: write @device_agnostic on the line above the `def` of the function to decorate"
    )
    assert expected == str(error.value)


def test_a_malformed_option_names_the_option_and_output_names_input() -> None:
    """A malformed ``device=`` or ``output=`` is refused where it is written, naming the
    option; for ``output=``, the one value that is no device too, guessed when mistyped."""
    with pytest.raises(InvalidDeviceError) as error:
        device_agnostic(output="inputs")
    lines = str(error.value).splitlines()
    assert lines[0].startswith("@device_agnostic(output=\"inputs\"): invalid device 'inputs'")
    assert [
        'output= also takes "input": the device the inputs came from',
        'fix: output="input"',
    ] == lines[-2:]
    with pytest.raises(InvalidDeviceError) as error:
        device_agnostic(device="inputs")
    assert str(error.value).startswith('@device_agnostic(device="inputs"): invalid device')
    assert "input" not in str(error.value).splitlines()[-1]


def test_above_a_descriptor_decorator_the_fix_says_below_it_and_works() -> None:
    """Written above ``@property``, ``@cached_property`` or ``@singledispatchmethod`` (where
    ``@classmethod`` takes it), the refusal says where it goes; written there, it works."""

    def refusal(make: Any) -> str:
        with pytest.raises(TypeError) as error:
            device_agnostic(device="meta")(make(lambda self, x=None: torch.ones(2)))
        return fix_code(error)

    assert "write @device_agnostic below @property, on the line above its `def`" == refusal(
        property
    )
    assert "write @device_agnostic below @cached_property, on the line above its `def`" == refusal(
        functools.cached_property
    )
    assert (
        "write @device_agnostic on each implementation, below its @<lambda>.register (the "
        "method dispatches, then the implementation moves)"
    ) == refusal(functools.singledispatchmethod)

    class Fixed:
        @property
        @device_agnostic(device="meta")
        def weight(self) -> torch.Tensor:
            return torch.ones(2)

        @functools.cached_property
        @device_agnostic(device="meta")
        def cached(self) -> torch.Tensor:
            return torch.ones(2)

        @functools.singledispatchmethod
        def scale(self, x: object) -> object:
            return x

        @scale.register
        @device_agnostic(device="meta")
        def _(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.ones(2)

    fixed = Fixed()
    assert [META] * 3 == [
        fixed.weight.device,
        fixed.cached.device,
        fixed.scale(torch.ones(2)).device,
    ]


@pytest.mark.parametrize(
    ("below", "name"),
    [
        (contextlib.contextmanager, "contextmanager"),
        (contextlib.asynccontextmanager, "asynccontextmanager"),
        (functools.lru_cache, "lru_cache (or @cache)"),
        (functools.cache, "lru_cache (or @cache)"),
    ],
)
def test_above_a_context_manager_or_a_cache_the_fix_says_below_it(
    below: Callable[..., Any], name: str
) -> None:
    """Above ``@contextmanager`` the body would run at the ``with``, after the call; above
    ``@lru_cache`` each moved copy would be a new key: refused where written."""

    def body(x: torch.Tensor) -> Any:
        yield x

    with pytest.raises(
        TypeError, match=rf"^@device_agnostic written above @{re.escape(name)}"
    ) as error:
        device_agnostic(below(body))
    assert f"write @device_agnostic below @{name}, on the line above the `def`" == fix_code(error)
    if "contextmanager" in name:  # the fix covers the generator's code, not the with body
        below_it = (
            "(below it, the generator's own code runs in the call's scope; the `with` body, "
            "run at its `yield`, does not: put `with on_device(...):` around the `yield` for "
            "that)"
        )
        assert str(error.value).splitlines()[0].endswith(below_it)


def test_below_a_context_manager_or_a_cache_the_body_is_the_calls() -> None:
    """Written below, the generator's body runs in the call's scope, on the target, and the
    cache keys are the caller's own tensors: the second call is a hit."""

    @contextlib.contextmanager
    @device_agnostic(device="meta")
    def opened(x: torch.Tensor) -> Iterator[torch.Tensor]:
        yield x + torch.zeros(1)

    with opened(torch.ones(1)) as made:
        assert META == made.device

    @functools.lru_cache
    @device_agnostic(device="meta")
    def embedded(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    x = torch.ones(1)
    assert embedded(x) is embedded(x)
    assert 1 == embedded.cache_info().hits


def test_a_classmethod_and_a_staticmethod_are_still_decorated() -> None:
    """``classmethod`` objects are not callable, yet the decorator takes them (written above
    ``@classmethod``): the check of what it got lets them through."""

    class Maker:
        @device_agnostic(device="meta")  # type: ignore[misc]
        @classmethod
        def make(cls, x: torch.Tensor) -> torch.Tensor:
            return x

        @device_agnostic(device="meta")  # type: ignore[misc]
        @staticmethod
        def same(x: torch.Tensor) -> torch.Tensor:
            return x

    assert META == Maker.make(torch.ones(1)).device
    assert META == Maker.same(torch.ones(1)).device


# --- @on_device without its parentheses ------------------------------------------------


def test_bare_on_device_is_refused_at_the_def_with_the_fix() -> None:
    """``@on_device`` without parentheses took the function for the device: refused at the
    ``def``, not at the first call with "missing 1 required positional argument"."""
    with pytest.raises(InvalidDeviceError) as error:

        @on_device  # type: ignore[arg-type]
        def make() -> torch.Tensor:
            return torch.ones(1)

    qualname = "test_bare_on_device_is_refused_at_the_def_with_the_fix.<locals>.make"
    expected = (
        f"on_device got the function {qualname} where the device goes "
        "(@on_device written without parentheses?)\n"
        'fix: @on_device("auto") above `def make`, or name the device: @on_device("cuda:0")'
    )
    assert expected == str(error.value)


def test_the_bare_on_device_fix_works_when_pasted() -> None:
    """The fix's first form, written above the ``def``, scopes the function."""
    with pytest.raises(InvalidDeviceError) as error:

        @on_device  # type: ignore[arg-type]
        def make() -> torch.Tensor:
            return torch.ones(1)

    code = fix_code(error, " above") + "\ndef make():\n    return torch.ones(1)\n"
    make = pasted(code)["make"]
    assert resolve_device("auto") == make().device


def test_on_device_given_a_callable_object_is_refused_where_written() -> None:
    """A partial (any callable that is not a device) is refused where the block is made."""
    with pytest.raises(InvalidDeviceError, match=r"got a partial where the device goes"):
        on_device(functools.partial(print))  # type: ignore[arg-type]


def test_on_device_above_a_class_without_parentheses_says_to_decorate_methods() -> None:
    """A bare ``@on_device`` above a class gets the refusal of decorating a class."""
    with pytest.raises(TypeError, match="on_device cannot decorate the class Net"):
        on_device(Net)  # type: ignore[arg-type]


# --- @device_agnostic given a module instance ---------------------------------------------


def test_a_module_instance_is_refused_with_the_bound_forward_fix() -> None:
    """``model = device_agnostic(model)`` is refused: the proxy it made did not take the
    model for the module that picks the device. The fix names the caller's variable."""
    model = nn.Linear(4, 2, device="meta")
    with pytest.raises(TypeError) as error:
        model = device_agnostic(model)
    expected = (
        "@device_agnostic cannot decorate a module instance, model (a Linear): it decorates "
        "functions and methods\n"
        "fix: forward = device_agnostic(model.forward), then call forward(...) where you "
        "called model(...)"
    )
    assert expected == str(error.value)
    forward = pasted(fix_code(error, ", then"), model=model)["forward"]
    assert META == forward(torch.ones(3, 4)).device


class Trainer:
    """Holds its model as an attribute, and decorates it where it is set."""

    def __init__(self) -> None:
        self.model = nn.Linear(4, 2, device="meta")
        self.model = device_agnostic(self.model)


class Wrapper(nn.Module):
    """A module holding its model as a submodule (kept in ``_modules``, not ``__dict__``)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(4, 2, device="meta")
        self.model = device_agnostic(self.model)


@pytest.mark.parametrize("owner", [Trainer, Wrapper])
def test_a_module_held_by_self_is_named_as_the_caller_holds_it(owner: type) -> None:
    """``self.model = device_agnostic(self.model)``: the message and the fix name
    ``self.model``, which the caller wrote, not ``model``."""
    with pytest.raises(TypeError) as error:
        owner()
    assert str(error.value).startswith(
        "@device_agnostic cannot decorate a module instance, self.model (a Linear): "
    )
    assert fix_code(error, ", then") == "forward = device_agnostic(self.model.forward)"


def test_a_module_instance_of_the_users_class_gets_the_class_fix_first() -> None:
    """For a module class of the user's own, the fix is the decorator on its ``forward``."""
    net = Net()
    with pytest.raises(TypeError) as error:
        device_agnostic(device="meta")(net)
    assert (
        "@device_agnostic above `def forward` in class Net, or "
        "forward = device_agnostic(net.forward), then call forward(...)"
    ) == fix_code(error)


def test_a_module_instance_with_no_name_is_named_by_its_class() -> None:
    """A module made in the call has no name: the message says its class, the fix
    ``model``."""
    with pytest.raises(TypeError) as error:
        device_agnostic(nn.ReLU())
    assert str(error.value).startswith(
        "@device_agnostic cannot decorate a module instance, a ReLU: "
    )
    assert fix_code(error, ", then") == "forward = device_agnostic(model.forward)"


# --- a module bound in a decorated partial ----------------------------------------------


def fwd(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)  # type: ignore[no-any-return]


def fwd_keyword(x: torch.Tensor, model: nn.Module) -> torch.Tensor:
    return model(x)  # type: ignore[no-any-return]


def test_a_module_bound_in_a_partial_is_the_calls_module() -> None:
    """The model bound in ``partial(fwd, model)`` picks the target as a module argument
    does: the input follows it (before, torch failed on the mix)."""
    model = nn.Linear(4, 2, device="meta")
    step = device_agnostic(functools.partial(fwd, model))
    assert META == step(torch.ones(3, 4)).device
    keyword = device_agnostic(functools.partial(fwd_keyword, model=model))
    assert META == keyword(torch.ones(3, 4)).device


def test_a_module_bound_in_a_partial_off_the_device_is_named() -> None:
    """With ``device=`` elsewhere, the module bound in the partial is refused by its
    parameter's name, before the body runs."""
    model = nn.Linear(4, 2, device="meta")
    step = device_agnostic(device="cpu")(functools.partial(fwd, model))
    with pytest.raises(DeviceMismatchError, match=r"model"):
        step(torch.ones(3, 4))


def test_a_partial_keeps_its_options_and_signature() -> None:
    """What the decorator returns for such a partial takes the same arguments and keeps the
    decorator's options (``output=``)."""
    step = device_agnostic(output="meta")(functools.partial(fwd, nn.Linear(4, 2)))
    assert ["x"] == list(inspect.signature(step).parameters)
    assert META == step(torch.ones(3, 4)).device


@pytest.mark.parametrize("option", ["device", "output"])
def test_a_device_this_machine_lacks_names_the_option_and_function_at_the_call(
    option: str,
) -> None:
    """A well-formed device the machine lacks waits for a call (another machine may have
    it); there the error says whose option it is."""
    if torch.mtia.is_available():  # pragma: no cover - Meta's accelerator
        pytest.skip("this machine has an MTIA device")

    @device_agnostic(**{option: "mtia:0"})
    def helper(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(DeviceUnavailableError) as raised:
        helper(torch.ones(1))
    assert str(raised.value).startswith(
        f'@device_agnostic({option}="mtia:0") of '
        f"{helper.__qualname__}(): device 'mtia:0' is not available: "
    )


# --- an on/off option given a value that only reads as one --------------------------------


@pytest.mark.parametrize("value", ["no", "False", 0, np.bool_(False), None])
@pytest.mark.parametrize(
    ("call", "option"),
    [
        ("to_device(torch.ones(1), 'meta', {})", "non_blocking"),
        ("to_device(torch.ones(1), 'meta', {})", "coalesce"),
        ("on_device('meta', {})", "exact"),
        ("set_repeated_move_warning({})", "enabled"),
        ("shrink_batch_on_oom({})", "remember"),
        ("device_agnostic({})", "scope"),
    ],
)
def test_a_switch_given_no_bool_is_refused_with_a_fix_that_works(
    call: str, option: str, value: object
) -> None:
    """``non_blocking="no"`` is truthy: refused, as torch's ``.to`` refuses it, not taken for
    True; the fix's False, pasted, is taken."""
    names = {
        "to_device": to_device,
        "set_repeated_move_warning": set_repeated_move_warning,
        "shrink_batch_on_oom": shrink_batch_on_oom,
        "value": value,
    }
    previous = set_repeated_move_warning(True)
    try:
        with pytest.raises(TypeError, match=rf"\({option}=.*{option} takes True or False") as error:
            pasted(call.format(f"{option}=value"), **names)
        fixes = fix_code(error).split(" or ")
        assert fixes[1].endswith(f"{option}=False)")
        pasted(call.format(f"{option}=False"), **names)  # the same call, with the fix's value
    finally:
        set_repeated_move_warning(previous)
