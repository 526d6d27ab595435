"""The emulated accelerator's random numbers: its generators, as CUDA's and MPS's.

``torch.Generator(device="emu")`` and each device's default generator (``torch.emu``'s
seeding and state functions, which ``torch.manual_seed`` and ``torch.random.fork_rng``
call). An emu generator holds a CPU generator, seeded with the seed mixed with a constant:
a seed draws the same numbers on every emu device and other numbers than on the CPU, as on
CUDA; a state is a CPU generator's. Each test plays both profiles that have generators
("cuda" and "mps"). As in test_emulated.py,
a session without ``--devicectx-accelerator=emulated`` runs these tests in a fresh process.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from helpers import skip_unless_emulated
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

from devicectx import device_agnostic
from devicectx.testing import emulated

pytestmark = pytest.mark.torch_internals  # the device's C++ meets torch's generator API

EMU1 = torch.device("emu", 1) if emulated.enabled() else None  # "emu" exists once enabled
TORCH_SEED = 67280421310721  # what torch seeds a new generator with (c10::default_rng_seed_val)
SEEDS = st.integers(min_value=0, max_value=2**64 - 1)

Draw = Callable[[torch.Generator | None, "torch.device | str"], torch.Tensor]
# Random ops that take generator=, each drawing 64 numbers: equal draws by chance are
# (next to) impossible.
RANDOM_OPS: dict[str, Draw] = {
    "randn": lambda g, d: torch.randn(64, generator=g, device=d),
    "rand": lambda g, d: torch.rand(64, generator=g, device=d),
    "randint": lambda g, d: torch.randint(0, 1000, (64,), generator=g, device=d),
    "randperm": lambda g, d: torch.randperm(64, generator=g, device=d),
    "normal_": lambda g, d: torch.empty(64, device=d).normal_(generator=g),
    "normal": lambda g, d: torch.normal(torch.zeros(64, device=d), 1.0, generator=g),
    "uniform_": lambda g, d: torch.empty(64, device=d).uniform_(generator=g),
    "bernoulli": lambda g, d: torch.bernoulli(torch.full((64,), 0.5, device=d), generator=g),
    "multinomial": lambda g, d: torch.multinomial(torch.ones(64, device=d), 32, generator=g),
    "exponential_": lambda g, d: torch.empty(64, device=d).exponential_(generator=g),
    "poisson": lambda g, d: torch.poisson(torch.full((64,), 5.0, device=d), generator=g),
    "init.normal_": lambda g, d: torch.nn.init.normal_(torch.empty(64, device=d), generator=g),
}
# Random ops without generator=: they draw from the default generator of their device.
DEFAULT_OPS: dict[str, Callable[[torch.device | str], torch.Tensor]] = {
    **{name: lambda d, op=op: op(None, d) for name, op in RANDOM_OPS.items()},
    "F.dropout": lambda d: F.dropout(torch.ones(64, device=d), 0.5),
    "nn.Dropout": lambda d: torch.nn.Dropout(0.5)(torch.ones(64, device=d)),
    "F.dropout1d": lambda d: F.dropout1d(torch.ones(64, 1, device=d), 0.5),
    "F.alpha_dropout": lambda d: F.alpha_dropout(torch.ones(64, device=d), 0.5, training=True),
}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two draws hold the same numbers (on any devices)."""
    return torch.equal(a.cpu(), b.cpu())


@pytest.fixture(params=["cuda", "mps"])
def emu(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    """emu:0 playing the profile, in a session where the emulated accelerator is enabled;
    the random states of the CPU and of every emu device are restored after the test."""
    skip_unless_emulated(request)
    cpu_state, device_states = torch.get_rng_state(), torch.emu.get_rng_state_all()
    with emulated.profile(request.param):
        yield torch.device("emu", 0)
    torch.set_rng_state(cpu_state)
    torch.emu.set_rng_state_all(device_states)
    now = emulated.settings()
    switches = {name: now[name] for name in emulated.PROFILES["cuda"]}
    assert dict(emulated.PROFILES["cuda"]) == switches, "the test left configure() changed"


# torch.Generator(device="emu").


def test_a_generator_on_the_device(emu: torch.device) -> None:
    """torch.Generator(device=...) makes a generator on the emu device named, or on the
    current one; it starts from torch's seed for a new generator, as a CPU or CUDA one."""
    generator = torch.Generator(device="emu")
    assert emu == generator.device
    assert EMU1 == torch.Generator(device="emu:1").device
    with torch.emu.device(1):
        assert EMU1 == torch.Generator(device="emu").device
    assert TORCH_SEED == generator.initial_seed() == torch.Generator().initial_seed()
    assert generator is generator.manual_seed(5)
    assert 5 == generator.initial_seed()
    drawn = generator.seed()
    assert drawn == generator.initial_seed()


# Where a CUDA GPU is present, this IndexError (raised in the emulated device's C++, from
# torch's hooks) crashes the process: a segmentation fault, seen with torch 2.11 on an H100,
# as the emulated out-of-memory error does there (test_emulated.py).
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a CUDA GPU is present: a generator of an emu device that does not exist "
    "crashes the process here",
)
def test_a_generator_of_a_device_that_does_not_exist(emu: torch.device) -> None:
    """torch.Generator(device="emu:2") on two devices raises torch's IndexError."""
    with pytest.raises(IndexError, match="emu:2 does not exist: there are 2 emu devices"):
        torch.Generator(device="emu:2")


@pytest.mark.parametrize("op", list(RANDOM_OPS))
def test_a_seed_gives_the_same_numbers(emu: torch.device, op: str) -> None:
    """A random op on the device with generator= draws from it: one seed, one draw, on the
    device; not the numbers a CPU generator draws for that seed, as on CUDA."""
    draw = RANDOM_OPS[op]
    generator = torch.Generator(device=emu)
    first = draw(generator.manual_seed(0), emu)
    again = draw(generator.manual_seed(0), emu)
    other = draw(generator.manual_seed(1), emu)
    assert emu == first.device
    assert same(first, again)
    assert not same(first, other)
    assert not same(first, draw(torch.Generator().manual_seed(0), "cpu"))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=25)
@given(seed=SEEDS, op=st.sampled_from(sorted(RANDOM_OPS)))
def test_any_seed_reproduces(emu: torch.device, seed: int, op: str) -> None:
    """For any seed, generators on either device seeded with it draw the same numbers, and
    other numbers than a CPU generator seeded with it; initial_seed() gives the seed back."""
    draw = RANDOM_OPS[op]
    generator = torch.Generator(device=emu).manual_seed(seed)
    assert seed == generator.initial_seed()
    expected = draw(generator, emu)
    assert same(expected, draw(torch.Generator(device=EMU1).manual_seed(seed), EMU1))
    assert not same(expected, draw(torch.Generator().manual_seed(seed), "cpu"))


def test_generators_are_independent(emu: torch.device) -> None:
    """Drawing from one generator moves neither another (seeded alike) nor the device's
    default generator, and the default one moves neither."""
    one = torch.Generator(device=emu).manual_seed(0)
    two = torch.Generator(device=emu).manual_seed(0)
    torch.emu.manual_seed(0)
    first = torch.rand(64, device=emu, generator=one)
    torch.rand(64, device=emu, generator=one)
    torch.rand(64, device=emu)  # the default generator
    assert same(first, torch.rand(64, device=emu, generator=two))
    torch.emu.manual_seed(0)
    assert same(first, torch.rand(64, device=emu))


def test_the_state_round_trips(emu: torch.device) -> None:
    """get_state() gives a CPU uint8 tensor (as a CUDA generator's); set_state() of it
    draws the same numbers again; a CPU generator's state is the same kind of state, and
    draws the CPU generator's numbers."""
    generator = torch.Generator(device=emu).manual_seed(3)
    state = generator.get_state()
    assert (torch.device("cpu"), torch.uint8) == (state.device, state.dtype)
    first = torch.randn(64, device=emu, generator=generator)
    assert same(first, torch.randn(64, device=emu, generator=generator.set_state(state)))
    assert 3 == generator.initial_seed()
    cpu = torch.Generator().manual_seed(3)
    on_the_device = generator.set_state(cpu.get_state())
    assert same(
        torch.randn(64, generator=cpu), torch.randn(64, device=emu, generator=on_the_device)
    )


def test_a_generator_copies_and_pickles(emu: torch.device) -> None:
    """copy.deepcopy and pickle give a generator on the same device, in the same state
    (torch saves an offset for a generator not on the CPU: an emu generator's is 0)."""
    generator = torch.Generator(device=EMU1).manual_seed(4)
    torch.rand(3, device=EMU1, generator=generator)
    for copied in (copy.deepcopy(generator), pickle.loads(pickle.dumps(generator))):
        assert EMU1 == copied.device
        assert 4 == copied.initial_seed()
        expected = torch.rand(64, device=EMU1, generator=copy.deepcopy(generator))
        assert same(expected, torch.rand(64, device=EMU1, generator=copied))
    assert 0 == generator.get_offset()


def test_an_offset_is_refused(emu: torch.device) -> None:
    """set_offset() of anything but 0 raises: the generator is a Mersenne Twister, which
    has no offset (CUDA's Philox has); the fix printed restores a state instead, and works."""
    generator = torch.Generator(device=emu)
    with pytest.raises(RuntimeError) as info:
        generator.set_offset(8)
    assert [
        "emu: an emulated device's generator draws as the CPU's (a Mersenne Twister), which "
        "has no offset; got set_offset(8)",
        "fix: save and restore its state, g.set_state(g.get_state())",
    ] == str(info.value).splitlines()[:2]
    g = generator
    g.set_state(g.get_state())
    generator.set_offset(0)


# Each device's default generator: torch.emu's functions, torch.manual_seed, fork_rng.


def test_each_device_has_a_default_generator(emu: torch.device) -> None:
    """torch.emu.default_generators holds one generator per device, on it; an op without
    generator= draws from its device's, torch.emu.manual_seed seeds the current device's."""
    assert [emu, EMU1] == [g.device for g in torch.emu.default_generators]
    torch.emu.manual_seed_all(0)
    on_one = torch.rand(64, device=EMU1)
    torch.emu.manual_seed(1)  # emu:0's only
    assert (1, 0) == tuple(g.initial_seed() for g in torch.emu.default_generators)
    torch.rand(64, device=emu)
    with torch.emu.device(1):
        torch.emu.manual_seed(0)
        assert 0 == torch.emu.initial_seed()
    assert same(on_one, torch.rand(64, device=EMU1))
    assert 1 == torch.emu.initial_seed()


@pytest.mark.parametrize("op", list(DEFAULT_OPS))
def test_ops_without_a_generator_draw_from_the_devices_default(emu: torch.device, op: str) -> None:
    """An op on the device without generator= (dropout too, which takes none) draws from the
    device's default generator: torch.emu.manual_seed reproduces it, whatever the CPU's
    default generator drew meanwhile."""
    draw = DEFAULT_OPS[op]
    torch.emu.manual_seed(0)
    first = draw(emu)
    torch.emu.manual_seed(0)
    torch.rand(1000)  # the CPU's default generator
    again = draw(emu)
    assert emu == first.device
    assert same(first, again)
    torch.emu.manual_seed(1)
    assert not same(first, draw(emu))


def test_dropout_trains_with_the_devices_mask(emu: torch.device) -> None:
    """F.dropout on the device keeps each element with probability 1 - p, scaled, and its
    gradient flows through the same elements; not training, it keeps every element."""
    x = torch.ones(64, device=emu, requires_grad=True)
    torch.emu.manual_seed(0)
    dropped = F.dropout(x, 0.25)
    dropped.sum().backward()
    assert x.grad is not None
    kept = dropped.detach().cpu() != 0
    assert 0 < int(kept.sum()) < 64
    torch.testing.assert_close(torch.full((int(kept.sum()),), 4 / 3), dropped.detach().cpu()[kept])
    assert same(dropped.detach(), x.grad)
    assert same(torch.ones(64), F.dropout(torch.ones(64, device=emu), 0.25, training=False))


def test_torch_manual_seed_seeds_every_device(emu: torch.device) -> None:
    """torch.manual_seed(n) and torch.seed() seed every emu device's default generator
    (through torch.emu.manual_seed_all), as they seed every CUDA device's; the device then
    draws other numbers than the CPU, as a GPU does."""
    torch.manual_seed(7)
    first = torch.randn(64, device=EMU1)
    assert [7, 7] == [g.initial_seed() for g in torch.emu.default_generators]
    torch.manual_seed(7)
    assert same(first, torch.randn(64, device=EMU1))
    assert not same(first, torch.randn(64))
    seed = torch.seed()
    assert [seed, seed] == [g.initial_seed() for g in torch.emu.default_generators]


def test_seed_and_seed_all(emu: torch.device) -> None:
    """torch.emu.seed() seeds the current device's default generator with a random number;
    seed_all() seeds every device's with one."""
    torch.emu.manual_seed_all(0)
    torch.emu.seed()
    seeds = [g.initial_seed() for g in torch.emu.default_generators]
    assert 0 == seeds[1] != seeds[0] == torch.emu.initial_seed()
    torch.emu.seed_all()
    assert 1 == len({g.initial_seed() for g in torch.emu.default_generators})


def test_the_rng_state_functions(emu: torch.device) -> None:
    """get_rng_state and set_rng_state (per device, default the current one) and their
    _all forms restore what a device's default generator draws."""
    torch.emu.manual_seed_all(2)
    states = torch.emu.get_rng_state_all()
    state_one = torch.emu.get_rng_state(EMU1)
    assert torch.equal(states[1], state_one)
    first = torch.rand(64, device=emu)
    on_one = torch.rand(64, device="emu:1")
    torch.emu.set_rng_state(states[0])
    assert same(first, torch.rand(64, device=emu))
    torch.emu.set_rng_state(state_one, 1)
    assert same(on_one, torch.rand(64, device=EMU1))
    torch.emu.set_rng_state_all(states)
    assert same(first, torch.rand(64, device=emu))
    assert same(on_one, torch.rand(64, device=EMU1))
    assert torch.equal(torch.emu.get_rng_state("emu"), torch.emu.get_rng_state(0))


BAD_DEVICES = {
    "cpu": ["'cpu' is not an emulated device", "fix: pass 'emu', 'emu:0' or an index"],
    2: ["emu:2 does not exist: there are 2 emulated devices", "fix: pass emu:0 to emu:1"],
    "emu:2": ["emu:2 does not exist: there are 2 emulated devices", "fix: pass emu:0 to emu:1"],
}


@pytest.mark.parametrize("device", list(BAD_DEVICES))
def test_a_bad_device_for_the_rng_state(emu: torch.device, device: str | int) -> None:
    """get_rng_state of a device that is no emulated device raises ValueError with the fix."""
    with pytest.raises(ValueError, match="fix: pass") as info:
        torch.emu.get_rng_state(device)
    assert BAD_DEVICES[device] == str(info.value).splitlines()


def test_fork_rng_restores_the_devices_generators(emu: torch.device) -> None:
    """torch.random.fork_rng(device_type="emu") restores each device's default generator
    (each its own: after the block, emu:1 draws what it drew first, whatever emu:0 did)."""
    torch.emu.manual_seed_all(0)
    torch.emu.manual_seed(1)
    expected = [torch.rand(64, device=emu), torch.rand(64, device=EMU1)]
    torch.emu.manual_seed_all(0)
    torch.emu.manual_seed(1)
    with torch.random.fork_rng(devices=[0, 1], device_type="emu"):
        torch.rand(64, device=emu)
        torch.rand(64, device=EMU1)
    assert same(expected[1], torch.rand(64, device=EMU1))
    assert same(expected[0], torch.rand(64, device=emu))


def dropout_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.dropout(x @ w, p=0.5, training=True)


def mask_gradient_holds(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``w.grad`` is the gradient of ``y.sum()`` with the dropout mask ``y`` shows:
    a recompute that drew another mask gives another gradient."""
    assert w.grad is not None
    expected = x.detach().T @ ((y.detach() != 0).float() * 2.0).to(x.device)
    return torch.allclose(w.grad.to(x.device), expected, atol=1e-5)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_recomputes_dropout_with_the_same_mask(
    emu: torch.device, reentrant: bool
) -> None:
    """torch.utils.checkpoint saves and restores the device's random state for the
    recompute where ``torch.emu._initialized`` says the device has started, as
    ``torch.cuda._initialized`` does: without it, the recompute drew another mask."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, device=emu, requires_grad=True)
    w = torch.randn(8, 8, device=emu, requires_grad=True)
    y = checkpoint(dropout_block, x, w, use_reentrant=reentrant)
    y.sum().backward()
    assert mask_gradient_holds(x, w, y)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpoint_inside_a_decorated_call_recomputes_the_same_mask(
    emu: torch.device, reentrant: bool
) -> None:
    """The decorator outside the checkpoint (as decorator.md shows): checkpoint then sees
    the moved inputs, and saves the target's random state with them."""

    @device_agnostic(device=emu, output="input")
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return checkpoint(dropout_block, x, w, use_reentrant=reentrant)  # type: ignore[no-any-return]

    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    y = block(x, w)
    y.sum().backward()
    assert mask_gradient_holds(x, w, y)


# Another device's generator.


@pytest.mark.parametrize("op", list(RANDOM_OPS))
def test_a_cpu_generator_is_refused(emu: torch.device, op: str) -> None:
    """A random op on the device given a CPU generator raises RuntimeError in CUDA's words;
    both fixes it prints work: a generator on the device, or CPU numbers moved."""
    draw = RANDOM_OPS[op]
    with pytest.raises(RuntimeError) as info:
        draw(torch.Generator().manual_seed(0), EMU1)
    first, fix = str(info.value).splitlines()[:2]
    assert first.startswith("Expected a 'emu' device type for generator but found 'cpu' (aten::")
    assert first.endswith(
        " on the emulated device, which refuses another device's generator as CUDA and MPS do)"
    )
    assert (
        'fix: make the generator on the device, torch.Generator(device="emu:1"), or draw on '
        "the generator's device and move the numbers, torch.randn(3, generator=g).to(device)"
    ) == fix
    assert EMU1 == draw(torch.Generator(device="emu:1"), EMU1).device
    g = torch.Generator().manual_seed(0)
    assert EMU1 == torch.randn(3, generator=g).to(EMU1).device


def test_an_emu_generator_is_refused_on_the_cpu(emu: torch.device) -> None:
    """A random op on the CPU given an emu generator raises torch's RuntimeError, as it does
    for a CUDA generator."""
    with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator but"):
        torch.randn(3, generator=torch.Generator(device=emu))


def test_generators_switched_off(emu: torch.device) -> None:
    """configure(generators=False) plays a backend without generators of its own:
    torch.Generator(device="emu") raises NotImplementedError; the refusal of a CPU generator
    then prints the fixes that work there, and ops still draw from the default generator."""
    with emulated.configure(generators=False):
        assert not emulated.settings()["generators"]
        with pytest.raises(NotImplementedError) as info:
            torch.Generator(device=emu)
        with pytest.raises(RuntimeError) as refused:
            torch.randn(3, device=emu, generator=torch.Generator())
        torch.emu.manual_seed(0)
        first = torch.randn(64, device=emu)
        torch.emu.manual_seed(0)
        assert same(first, torch.randn(64, device=emu))
    assert (
        "emu: generators are switched off (devicectx.testing.emulated.configure("
        "generators=False)), as on a backend without a torch.Generator of its own"
    ) == str(info.value).splitlines()[0]
    assert (
        "fix: draw on the generator's device and move the numbers, "
        "torch.randn(3, generator=g).to(device), or leave generator= out (generators are "
        "switched off: devicectx.testing.emulated.configure(generators=False))"
    ) == str(refused.value).splitlines()[1]
    assert emu == torch.Generator(device=emu).device
