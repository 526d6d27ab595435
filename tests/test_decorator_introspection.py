"""``@device_agnostic`` as code that takes functions apart sees it: a bound method's
``__func__`` and ``__self__`` (``types.MethodType``; ``weakref.WeakMethod`` holds it), and a
classmethod's signature and kind (``inspect``, ``help()``, ``mock``'s autospec)."""

from __future__ import annotations

import asyncio
import copy
import gc
import inspect
import pickle
import sys
import types
import weakref
from unittest import mock

import pytest
import torch

from devicectx import DeviceMismatchError, device_agnostic

pytestmark = pytest.mark.torch_internals  # CI runs it on every minor torch release

META = torch.device("meta")


class Stage:
    """Module level, so that its methods pickle: each decorated in the class body."""

    @device_agnostic(device="meta")
    def run(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @device_agnostic(device="meta", move=False)
    def checked(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @device_agnostic(device="meta")
    async def fetch(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class Sampler:
    """A classmethod with the decorator written above ``@classmethod``, and one below."""

    @device_agnostic(device="meta")
    @classmethod
    def above(cls, x: torch.Tensor, k: int = 1) -> torch.Tensor:
        """Decorated above ``@classmethod``."""
        return x + k

    @classmethod
    @device_agnostic(device="meta")
    def below(cls, x: torch.Tensor, k: int = 1) -> torch.Tensor:
        """Decorated below ``@classmethod``."""
        return x + k

    @device_agnostic(device="meta")
    @classmethod
    async def fetch_above(cls, x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @classmethod
    @device_agnostic(device="meta")
    async def fetch_below(cls, x: torch.Tensor) -> torch.Tensor:
        return x + 1


# --- a bound method taken apart -------------------------------------------------------


def test_a_bound_method_s_func_is_the_decorated_function() -> None:
    """``stage.run.__func__`` is what the class holds, the decorated function, as for a
    bound method of any decorated function; ``__self__`` is the instance."""
    stage = Stage()

    method = stage.run

    assert method.__func__ is Stage.__dict__["run"]
    assert method.__self__ is stage


def test_a_function_reached_through_its_class_has_no_func() -> None:
    """Through the class, a decorated method is a function, which has no ``__func__``."""
    assert not hasattr(Stage.run, "__func__")


def test_a_method_rebuilt_from_func_and_self_moves() -> None:
    """``types.MethodType(m.__func__, m.__self__)`` (what method-copying helpers do) makes a
    method that moves the inputs, as the method it was taken from does."""
    stage = Stage()
    method = stage.run

    rebuilt = types.MethodType(method.__func__, method.__self__)

    assert META == rebuilt(torch.ones(1)).device


def test_a_method_rebuilt_from_func_and_self_checks() -> None:
    """A rebuilt method of ``move=False`` refuses an input on another device."""
    stage = Stage()
    method = stage.checked

    rebuilt = types.MethodType(method.__func__, method.__self__)

    with pytest.raises(DeviceMismatchError):
        rebuilt(torch.ones(1))


def test_a_weak_method_dies_with_its_instance() -> None:
    """The weak method answers None once the instance is gone, and keeps it alive no
    longer than a weak method of a plain method does."""
    stage = Stage()
    weak = weakref.WeakMethod(stage.run)

    del stage
    gc.collect()

    assert weak() is None


def test_weak_methods_of_one_method_are_equal() -> None:
    """Two weak methods of one instance's decorated method compare equal, as for a plain
    method (a registry finds a callback so to remove it)."""
    stage = Stage()

    assert weakref.WeakMethod(stage.run) == weakref.WeakMethod(stage.run)


def test_an_async_method_rebuilt_is_a_coroutine_function_that_moves() -> None:
    """An async method so rebuilt is a coroutine function, whose call moves the inputs."""
    stage = Stage()
    method = types.MethodType(stage.fetch.__func__, stage)

    assert inspect.iscoroutinefunction(method)
    assert META == asyncio.run(method(torch.ones(1))).device


def test_a_rebuilt_method_pickles_and_copies_decorated() -> None:
    """A rebuilt method pickles as a bound method does (its instance and name) and
    deep-copies with a copy of its instance; both come back decorated."""
    stage = Stage()
    rebuilt = types.MethodType(stage.run.__func__, stage)

    for back in (pickle.loads(pickle.dumps(rebuilt)), copy.deepcopy(rebuilt)):
        assert META == back(torch.ones(1)).device
        assert isinstance(back.__self__, Stage)
        assert back.__self__ is not stage


# --- a classmethod, with the decorator above or below it ------------------------------


@pytest.mark.parametrize("name", ["above", "below"])
def test_a_classmethod_s_signature_drops_cls(name: str) -> None:
    """``inspect.signature`` (``help()``, Sphinx) of the classmethod reads the function's
    parameters, ``cls`` dropped, whichever order the decorators are written in."""
    method = getattr(Sampler, name)

    signature = inspect.signature(method)

    assert "(x: 'torch.Tensor', k: 'int' = 1) -> 'torch.Tensor'" == str(signature)


@pytest.mark.parametrize("name", ["above", "below"])
def test_help_shows_the_classmethod_s_parameters(name: str) -> None:
    """``help()`` of the class shows the classmethod's own parameters, not ``*args``."""
    import pydoc

    text = pydoc.render_doc(Sampler, renderer=pydoc.plaintext)

    assert f"{name}(x: 'torch.Tensor', k: 'int' = 1) -> 'torch.Tensor'" in text


@pytest.mark.parametrize("name", ["fetch_above", "fetch_below"])
def test_an_async_classmethod_is_a_coroutine_function(name: str) -> None:
    """An async classmethod stays a coroutine function for ``inspect`` and ``asyncio``,
    and its call moves the inputs."""
    method = getattr(Sampler, name)

    assert inspect.iscoroutinefunction(method)
    assert META == asyncio.run(method(torch.ones(1))).device


@pytest.mark.parametrize("name", ["above", "below"])
@pytest.mark.skipif(
    sys.version_info < (3, 11), reason="Python 3.10's autospec checks no classmethod's calls"
)
def test_autospec_of_a_classmethod_refuses_a_call_it_would_refuse(name: str) -> None:
    """``mock.patch.object(..., autospec=True)`` checks calls against the classmethod's
    signature: one with too many arguments is refused, one that fits is accepted."""
    with mock.patch.object(Sampler, name, autospec=True):
        patched = getattr(Sampler, name)
        patched(torch.ones(1), k=2)
        with pytest.raises(TypeError, match="too many positional arguments"):
            patched(torch.ones(1), 2, "extra")


@pytest.mark.parametrize("name", ["above", "below"])
def test_a_classmethod_rebuilt_from_func_and_self_moves(name: str) -> None:
    """A classmethod rebuilt from ``__func__`` and ``__self__`` moves the inputs, whichever
    order the decorators are written in."""
    method = getattr(Sampler, name)

    rebuilt = types.MethodType(method.__func__, method.__self__)

    assert META == rebuilt(torch.ones(1)).device
    assert Sampler is rebuilt.__self__


def documented_step(model: torch.nn.Module, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    """One step."""
    return model(x) * scale  # type: ignore[no-any-return]


def test_torch_compile_of_a_decorated_function_keeps_what_it_says_of_itself() -> None:
    """``torch.compile(device_agnostic(f))`` reads as ``torch.compile(f)`` does: the
    signature, docstring and qualified name of ``f`` (help(), IDEs, ``create_autospec``);
    they were the internal entry's, ``(*args, **kwargs)``."""
    plain = torch.compile(documented_step, backend="eager")
    stacked = torch.compile(device_agnostic(documented_step), backend="eager")
    assert inspect.signature(plain) == inspect.signature(stacked)
    assert ("One step.", "documented_step") == (stacked.__doc__, stacked.__qualname__)
    model = torch.nn.Linear(2, 2).to("meta")
    assert torch.device("meta") == stacked(model, torch.ones(2), scale=2.0).device
