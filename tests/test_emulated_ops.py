"""The emulated accelerator's operators: what each leaves behind is what the CPU's leaves.

Every operator without a kernel of the device's own runs the CPU kernel through torch's
boxed CPU fallback, which copies back the arguments an operator's schema marks as written
(``Tensor(a!)``). Some operators write an argument their schema does not mark: batch
norm's running statistics. These tests hold the device's results and the state it leaves
equal to the CPU's, bit for bit (the same CPU kernel runs on the same values). As in
test_emulated.py, a session without ``--devicectx-accelerator=emulated`` runs these tests
in a fresh process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from helpers import skip_unless_emulated
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

pytestmark = pytest.mark.torch_internals  # the device's C++ meets torch's operator schemas

ATEN = torch.ops.aten


@pytest.fixture
def emu(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    """emu:0, in a session where the emulated accelerator is enabled."""
    skip_unless_emulated(request)
    yield torch.device("emu", 0)
    torch.accelerator.synchronize(0)


def on_cpu(tensors: object) -> list[torch.Tensor]:
    """The tensors of ``tensors`` (a tensor, or a tuple or list of them), on the CPU."""
    items = tensors if isinstance(tensors, (tuple, list)) else [tensors]
    return [item.detach().cpu() for item in items if isinstance(item, torch.Tensor)]


def assert_same(cpu: list[torch.Tensor], emu: list[torch.Tensor]) -> None:
    """The device's tensors hold the CPU's values bit for bit, dtype and shape included."""
    assert [(t.dtype, t.shape) for t in cpu] == [(t.dtype, t.shape) for t in emu]
    differing = [i for i, (a, b) in enumerate(zip(cpu, emu, strict=True)) if not torch.equal(a, b)]
    assert differing == [], f"cpu {cpu}\nemu {emu}"


# Batch norm's running statistics. A case runs on a device from the CPU's inputs and
# returns what a user reads after it: the outputs and every statistic.

Case = Callable[[torch.device], list[torch.Tensor]]


def stats(channels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh running statistics (mean 0, variance 1) on ``device``."""
    return torch.zeros(channels, device=device), torch.ones(channels, device=device)


def inputs(*shape: int) -> torch.Tensor:
    """Seeded values on the CPU (the device draws other numbers for a seed)."""
    generator = torch.Generator().manual_seed(sum(shape))
    return torch.randn(*shape, generator=generator)


def functional(device: torch.device) -> list[torch.Tensor]:
    """F.batch_norm in training mode, twice."""
    mean, var = stats(3, device)
    x = inputs(8, 3, 5).to(device)
    outputs = [F.batch_norm(x, mean, var, training=True, momentum=0.3) for _ in range(2)]
    return on_cpu([*outputs, mean, var])


def module(make: Callable[[], nn.Module], *shape: int) -> Case:
    """A module made by ``make``, in training mode, called twice, then once in eval mode;
    its outputs and buffers."""

    def run(device: torch.device) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layer = make().to(device)
        x = inputs(*shape).to(device)
        outputs = [layer(x), layer(x * 2)]
        outputs.append(layer.eval()(x))
        return on_cpu([*outputs, *layer.buffers()])

    return run


def operator(call: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]) -> Case:
    """An aten operator called on (input, running_mean, running_var): its outputs and the
    statistics after it."""

    def run(device: torch.device) -> list[torch.Tensor]:
        mean, var = stats(3, device)
        return on_cpu(call(inputs(8, 3, 5).to(device), mean, var)) + on_cpu([mean, var])

    return run


def native_batch_norm_out(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> object:
    """native_batch_norm.out, the out= variant, which writes the statistics as well."""
    saved = torch.empty(3, device=x.device), torch.empty(3, device=x.device)
    return ATEN.native_batch_norm.out(
        x, None, None, mean, var, True, 0.1, 1e-5,
        out=torch.empty_like(x), save_mean=saved[0], save_invstd=saved[1],
    )  # fmt: skip


RUNNING_STATISTICS: dict[str, Case] = {
    "F.batch_norm": functional,
    "BatchNorm1d": module(lambda: nn.BatchNorm1d(3), 8, 3),
    "BatchNorm1d (N, C, L)": module(lambda: nn.BatchNorm1d(3), 8, 3, 5),
    "BatchNorm2d": module(lambda: nn.BatchNorm2d(3), 4, 3, 5, 5),
    "BatchNorm2d channels_last": module(
        lambda: nn.BatchNorm2d(3).to(memory_format=torch.channels_last), 4, 3, 5, 5
    ),
    "BatchNorm3d": module(lambda: nn.BatchNorm3d(3), 2, 3, 4, 4, 4),
    "BatchNorm1d momentum=None": module(lambda: nn.BatchNorm1d(3, momentum=None), 8, 3),
    "BatchNorm1d affine=False": module(lambda: nn.BatchNorm1d(3, affine=False), 8, 3),
    "InstanceNorm1d": module(lambda: nn.InstanceNorm1d(3, track_running_stats=True), 8, 3, 5),
    "InstanceNorm2d": module(
        lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True), 4, 3, 5, 5
    ),
    "SyncBatchNorm, one process": module(lambda: nn.SyncBatchNorm(3), 8, 3, 5),
    "native_batch_norm": operator(
        lambda x, m, v: ATEN.native_batch_norm(x, None, None, m, v, True, 0.1, 1e-5)
    ),
    "native_batch_norm.out": operator(native_batch_norm_out),
    "batch_norm_update_stats": operator(lambda x, m, v: ATEN.batch_norm_update_stats(x, m, v, 0.1)),
    "_native_batch_norm_legit": operator(
        lambda x, m, v: ATEN._native_batch_norm_legit(x, None, None, m, v, True, 0.1, 1e-5)
    ),
    "_batch_norm_with_update": operator(
        lambda x, m, v: ATEN._batch_norm_with_update(x, None, None, m, v, 0.1, 1e-5)
    ),
}


@pytest.mark.parametrize("name", list(RUNNING_STATISTICS))
def test_batch_norm_updates_the_running_statistics(emu: torch.device, name: str) -> None:
    """Each way of training a batch norm (functional, modules, the aten operators under
    them) leaves the running statistics the CPU leaves, and normalizes as the CPU does."""
    case = RUNNING_STATISTICS[name]
    assert_same(case(torch.device("cpu")), case(emu))


def test_running_statistics_of_a_view_are_written_through(emu: torch.device) -> None:
    """Statistics that are a strided view of a larger tensor (one flat buffer for several
    layers) are written in place, into the larger tensor, as on the CPU."""

    def run(device: torch.device) -> list[torch.Tensor]:
        flat = torch.zeros(12, device=device)
        mean, var = flat[0::2], flat[1::2].fill_(1.0)
        F.batch_norm(inputs(8, 6).to(device), mean, var, training=True)
        return on_cpu(flat)

    assert_same(run(torch.device("cpu")), run(emu))


def test_batch_norm_backward_gives_the_cpus_gradients(emu: torch.device) -> None:
    """A training step through BatchNorm2d gives the CPU's gradients and statistics."""

    def run(device: torch.device) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layer = nn.BatchNorm2d(3).to(device)
        x = inputs(4, 3, 5, 5).to(device).requires_grad_()
        (layer(x) ** 2).sum().backward()
        assert x.grad is not None
        assert layer.weight.grad is not None
        return on_cpu([x.grad, layer.weight.grad, *layer.buffers()])

    assert_same(run(torch.device("cpu")), run(emu))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    batch=st.integers(2, 5),
    channels=st.integers(1, 4),
    momentum=st.one_of(st.none(), st.floats(0.0, 1.0)),
    steps=st.integers(1, 3),
)
def test_batch_norm_statistics_match_the_cpu_for_any_shape(
    emu: torch.device,
    shape: list[int],
    batch: int,
    channels: int,
    momentum: float | None,
    steps: int,
) -> None:
    """For any input shape, momentum (None: the cumulative average) and number of steps,
    the device's BatchNorm leaves the CPU's statistics and outputs."""
    layers = {0: nn.BatchNorm1d, 1: nn.BatchNorm1d, 2: nn.BatchNorm2d}

    def run(device: torch.device) -> list[torch.Tensor]:
        layer = layers[len(shape)](channels, momentum=momentum).to(device)
        x = inputs(batch, channels, *shape).to(device)
        outputs = [layer(x + step) for step in range(steps)]
        return on_cpu([*outputs, *layer.buffers()])

    assert_same(run(torch.device("cpu")), run(emu))


# Operators that torch gives a backend out of tree no kernel for, or a composite one: the
# convolutions (torch's default for the device raises NotImplementedError), layer and group
# norm (a decomposition, a few ulps off the CPU). The device runs the CPU's kernels.

LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "Conv1d": (lambda: nn.Conv1d(3, 4, 3), (2, 3, 8)),
    "Conv2d": (lambda: nn.Conv2d(3, 4, 3, padding=1, stride=2), (2, 3, 7, 7)),
    "Conv2d channels_last": (
        lambda: nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last),
        (2, 3, 6, 6),
    ),
    "Conv2d depthwise, no bias": (lambda: nn.Conv2d(4, 4, 3, groups=4, bias=False), (2, 4, 6, 6)),
    "Conv3d": (lambda: nn.Conv3d(3, 2, 2, dilation=2), (1, 3, 5, 5, 5)),
    "ConvTranspose2d": (
        lambda: nn.ConvTranspose2d(3, 2, 3, stride=2, output_padding=1),
        (2, 3, 4, 4),
    ),
    "LayerNorm": (lambda: nn.LayerNorm(6), (2, 3, 6)),
    "GroupNorm": (lambda: nn.GroupNorm(2, 4), (2, 4, 6)),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layers_give_the_cpus_outputs_and_gradients(emu: torch.device, name: str) -> None:
    """Convolutions (every kind nn has), LayerNorm and GroupNorm compute the CPU's outputs
    and gradients bit for bit, those of the input included."""
    make, shape = LAYERS[name]

    def run(device: torch.device) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layer = make().to(device)
        x = inputs(*shape).to(device).requires_grad_()
        y = layer(x)
        (y**2).sum().backward()
        gradients = [p.grad for p in layer.parameters()]
        assert x.grad is not None
        assert None not in gradients
        return on_cpu([y, x.grad, *gradients])

    assert_same(run(torch.device("cpu")), run(emu))


def test_a_convolution_on_the_second_device_stays_there(emu: torch.device) -> None:
    """A convolution of emu:1 tensors gives an emu:1 result, while emu:0 is current."""
    layer = nn.Conv2d(3, 2, 3)
    expected = layer(inputs(1, 3, 5, 5))
    y = layer.to("emu:1")(inputs(1, 3, 5, 5).to("emu:1"))
    assert torch.device("emu", 1) == y.device
    assert_same(on_cpu(expected), on_cpu(y))


def test_a_convolution_refuses_two_devices(emu: torch.device) -> None:
    """A convolution of an emu:1 input with emu:0 weights raises torch's device error, as
    CUDA's kernels do for two GPUs."""
    layer = nn.Conv2d(3, 2, 3).to(emu)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        layer(torch.zeros(1, 3, 5, 5, device="emu:1"))


# Operators whose schema marks what they write: the fallback copies it back. Fused
# optimizers write their state through tensor lists.

OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "Adam fused": lambda p: torch.optim.Adam(p, lr=0.1, fused=True),
    "AdamW fused": lambda p: torch.optim.AdamW(p, lr=0.1, fused=True),
    "SGD fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "Adagrad fused": lambda p: torch.optim.Adagrad(p, lr=0.1, fused=True),
    "Adam foreach": lambda p: torch.optim.Adam(p, lr=0.1, foreach=True),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_steps_leave_the_cpus_state(emu: torch.device, name: str) -> None:
    """Three steps of a fused or foreach optimizer leave the CPU's parameters and state."""

    def run(device: torch.device) -> list[torch.Tensor]:
        parameter = nn.Parameter(inputs(5).to(device))
        optimizer = OPTIMIZERS[name]([parameter])
        for step in range(3):
            parameter.grad = torch.full((5,), 0.3 * step - 0.2, device=device)
            optimizer.step()
        state = optimizer.state[parameter]
        return on_cpu([parameter, *(state[key] for key in sorted(state))])

    assert_same(run(torch.device("cpu")), run(emu))


# Lazy modules. torch's Module.to keeps a parameter object only between the CPU and torch's
# own GPUs; to a backend registered out of tree (the emulated device) or to meta it makes a
# new Parameter, and an uninitialized parameter becomes an empty ordinary one. A lazy
# module made on the device, or called once before the move, works there as on the CPU.

LAZY: dict[str, tuple[Callable[..., nn.Module], tuple[int, ...]]] = {
    "LazyLinear": (lambda **device: nn.LazyLinear(3, **device), (5, 4)),
    "LazyConv2d": (lambda **device: nn.LazyConv2d(2, 3, **device), (2, 3, 5, 5)),
    "LazyBatchNorm1d": (lambda **device: nn.LazyBatchNorm1d(**device), (8, 3)),
}


def lazy_run(name: str, device: torch.device, *, made_there: bool) -> list[torch.Tensor]:
    """The lazy module ``name``, made on ``device`` (``made_there``) or called once on the
    CPU and then moved, in training mode: two calls, its outputs and its tensors."""
    make, shape = LAZY[name]
    x = inputs(*shape)
    torch.manual_seed(0)
    reference = make()
    reference(x)
    if made_there:
        layer = make(device=device)
        layer(x.to(device))
        # The device drew its initial values from its own generator: the CPU's, to compare.
        layer.load_state_dict(reference.state_dict())
    else:
        layer = reference.to(device)
    outputs = [layer(x.to(device)), layer(x.to(device) * 2)]
    return on_cpu([*outputs, *layer.parameters(), *layer.buffers()])


@pytest.mark.parametrize("made_there", [True, False], ids=["made_there", "called_then_moved"])
@pytest.mark.parametrize("name", list(LAZY))
def test_a_lazy_module_infers_its_shapes_on_the_device(
    emu: torch.device, name: str, made_there: bool
) -> None:
    """A lazy module made with device= on the device, or called once before .to(), infers
    its shapes and computes the CPU's values there (the two ways the docs give)."""
    cpu = lazy_run(name, torch.device("cpu"), made_there=made_there)
    assert_same(cpu, lazy_run(name, emu, made_there=made_there))


def test_moving_an_uninitialized_lazy_module_makes_ordinary_parameters(emu: torch.device) -> None:
    """LazyLinear(3).to(device) leaves empty ordinary parameters, which its first call
    refuses, as on meta (torch's Module.to for a backend out of tree): what the docs say."""
    for device in (emu, torch.device("meta")):
        layer = nn.LazyLinear(3).to(device)
        assert (nn.Parameter, (0,)) == (type(layer.weight), tuple(layer.weight.shape))
        # torch 2.7 and later check the inferred shape; 2.6's matmul refuses the empty weight.
        with pytest.raises((AssertionError, RuntimeError)):
            layer(torch.zeros(5, 4, device=device))


# Conjugate and negative views: a bit on the tensor, which copies resolve.


def _conjugate_cases(z: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    """What complex code does with conjugate views: a power spectrum, a Hermitian product,
    a view copied out, a negative view, the backward of a complex product (autograd
    multiplies by the other input's conjugate)."""
    w = w.clone().requires_grad_()
    (w * z).abs().sum().backward()
    assert w.grad is not None
    return [
        (z * z.conj()).real,
        z.conj() @ w.detach(),
        z.conj().cpu(),
        z.real._neg_view().cpu(),
        z.conj().clone().cpu(),
        w.grad,
    ]


def test_conjugate_and_negative_views_give_the_cpus_values(emu: torch.device) -> None:
    """As on the CPU and a GPU: conjugate and negative views copy and compute resolved (the
    device's copy once recursed through torch's conjugate fallback until the stack ran out,
    killing the process)."""
    z = torch.tensor([1 + 2j, 3 - 4j, -0.5 + 0j])
    w = torch.tensor([2 - 1j, 0.5j, 1 + 1j])
    assert_same(on_cpu(_conjugate_cases(z, w)), on_cpu(_conjugate_cases(z.to(emu), w.to(emu))))
