"""Real clients: the structures people pass, built with the packages they come from.

transformers (a tiny BERT built from its config: a ``BatchEncoding`` in, a ``ModelOutput``
out), tensordict (a ``TensorDict`` and a ``@tensorclass`` in plain dicts; a lazy stack of
trajectories of different lengths), torch_geometric (``Data`` and ``Batch``), detection
targets (a list of dicts of tensors of different lengths, what torchvision's detection
models take) and ``PackedSequence`` (into an LSTM).
Each goes through the same checks: a ``to_device`` round trip read through every access
path the type offers, ``find_devices`` paths, a decorated ``forward``, ``output="input"``,
and a ``move=False`` mismatch that names the path.

``meta`` is the second device. It holds no values, so what a move must keep is told by
shape, dtype and identity: two access paths that give one tensor before the move give one
tensor after it. Values are compared after a round trip through the machine's accelerator,
where there is one. A client package that is missing, or does not import with the
installed torch, skips its tests with the reason.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import mps_like
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence

from devicectx import (
    DeviceMismatchError,
    MoveError,
    available_devices,
    device_agnostic,
    find_devices,
    register_container,
    to_device,
    unregister_container,
)
from devicectx.testing import assert_device_agnostic

CPU = torch.device("cpu")
META = torch.device("meta")
ACCELERATORS = available_devices()[1:2]
NO_ACCELERATOR = "no accelerator on this machine: meta stands in for one in the other tests"


def client(name: str) -> Any:
    """The package ``name``, or a skip that says why it cannot be used here."""
    reason = f"{name} is not installed: pip install -e '.[test]'"
    try:
        return pytest.importorskip(name, reason=reason, exc_type=ModuleNotFoundError)
    except Exception as error:  # installed, but broken or built against another torch
        pytest.skip(f"{name} does not import with torch {torch.__version__}: {error!r}")


def kwargs_of(**kwargs: Any) -> dict[str, Any]:
    """What a function receives from ``f(**obj)``."""
    return kwargs


def flat(label: str, value: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors in ``value`` (a tensor, or a tuple or list of them), with labels."""
    if isinstance(value, torch.Tensor):
        yield label, value
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from flat(f"{label}[{index}]", item)


@dataclasses.dataclass
class Client:
    """One real client: how to make it, read it and feed it to a module."""

    make: Callable[[], Any]
    """A fresh object, on the CPU, with each tensor of its own shape where it can be."""
    views: Callable[[Any], Iterator[tuple[str, torch.Tensor]]]
    """Every way the type offers to reach each tensor, labelled as code."""
    facts: Callable[[Any], Any]
    """What else a move must keep: keys, sizes, plain values."""
    paths: list[str]
    """``find_devices(obj, name="batch")``'s paths, in order."""
    module: Callable[[], nn.Module]
    """A module whose ``forward`` is decorated with ``@device_agnostic``."""
    forward: Callable[[nn.Module, Any], Any] = lambda module, batch: module(batch)


# transformers: a BatchEncoding in, a ModelOutput out.


def tiny_bert() -> nn.Module:
    """A BERT of 2 layers, 2 heads, width 32 and 99 words, built from its config."""
    transformers = client("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=16,
    )
    model: nn.Module = transformers.BertModel(config).eval()
    return model


def encoding() -> Any:
    """A ``BatchEncoding`` made from tensors, as a tokenizer makes it (no download).

    No attention mask: BERT reads a mask's values to pick its attention path, and meta
    tensors have none.
    """
    transformers = client("transformers")
    ids = torch.randint(0, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    return transformers.BatchEncoding(
        {"input_ids": ids, "token_type_ids": torch.zeros(2, 7, dtype=torch.long)}
    )


def encoding_views(enc: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """By key, attribute, ``.data``, ``values()`` and ``**enc``."""
    values, splat = list(enc.values()), kwargs_of(**enc)
    for index, key in enumerate(enc.keys()):
        yield f"enc[{key!r}]", enc[key]
        yield f"enc.{key}", getattr(enc, key)
        yield f"enc.data[{key!r}]", enc.data[key]
        yield f"list(enc.values())[{index}]", values[index]
        yield f"f(**enc): {key}", splat[key]


class Encoder(nn.Module):
    """A BERT encoder behind a decorated forward that takes a ``BatchEncoding``."""

    def __init__(self) -> None:
        super().__init__()
        self.bert = tiny_bert()

    @device_agnostic
    def forward(self, batch: Any) -> Any:
        return self.bert(**batch, output_hidden_states=True)


def model_output() -> Any:
    """What BERT returns: a ``ModelOutput``, an ``OrderedDict`` that is also a dataclass."""
    with torch.no_grad():
        return tiny_bert()(**encoding(), output_hidden_states=True)


def output_views(out: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """By attribute, key, index, ``to_tuple()``, ``values()``, ``items()`` and ``**out``."""
    as_tuple, values, items = out.to_tuple(), list(out.values()), dict(out.items())
    splat = kwargs_of(**out)
    for index, key in enumerate(out.keys()):
        yield from flat(f"out.{key}", getattr(out, key))
        yield from flat(f"out[{key!r}]", out[key])
        yield from flat(f"out[{index}]", out[index])
        yield from flat(f"out.to_tuple()[{index}]", as_tuple[index])
        yield from flat(f"list(out.values())[{index}]", values[index])
        yield from flat(f"dict(out.items())[{key!r}]", items[key])
        yield from flat(f"f(**out): {key}", splat[key])


def output_facts(out: Any) -> Any:
    """Keys, and the fields that are None and so no keys."""
    return list(out.keys()), len(out), out.attentions, "attentions" in out


class Head(nn.Module):
    """A classifier over BERT's output, returning a ``ModelOutput`` of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 3)

    @device_agnostic
    def forward(self, out: Any) -> Any:
        outputs = client("transformers.modeling_outputs")
        logits = self.lin(out.pooler_output) + self.lin(out["hidden_states"][0].mean(1))
        return outputs.SequenceClassifierOutput(logits=logits, hidden_states=out[2])


# tensordict: a TensorDict and a tensorclass, in plain dicts.


@functools.cache
def sample_class() -> type:
    """A ``@tensorclass``: an image, a label and a plain note (made once: one type)."""
    tensordict = client("tensordict")

    class Sample:
        image: torch.Tensor
        label: torch.Tensor
        note: str

    return tensordict.tensorclass(Sample)  # type: ignore[no-any-return]


def tensordict_batch() -> dict[str, Any]:
    """A ``TensorDict`` (nested, locked: it refuses new keys), a ``@tensorclass`` in a
    list, and plain values."""
    tensordict = client("tensordict")
    sample = sample_class()
    return {
        "td": tensordict.TensorDict(
            {"obs": torch.randn(4, 3), "next": {"reward": torch.randn(4, 1)}}, batch_size=[4]
        ).lock_(),
        "samples": [sample(image=torch.randn(4, 2, 2), label=torch.arange(4), note="kept")],
        "step": 3,
    }


def tensordict_views(batch: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """A TensorDict by key, nested key, ``get`` and ``items()``; a tensorclass by field
    and ``get``."""
    td, sample = batch["td"], batch["samples"][0]
    yield "batch['td']['obs']", td["obs"]
    yield "batch['td'].get('obs')", td.get("obs")
    yield "dict(batch['td'].items())['obs']", dict(td.items())["obs"]
    yield "batch['td']['next', 'reward']", td["next", "reward"]
    yield "batch['td']['next']['reward']", td["next"]["reward"]
    yield "batch['samples'][0].image", sample.image
    yield "batch['samples'][0].get('image')", sample.get("image")
    yield "batch['samples'][0].label", sample.label


def tensordict_facts(batch: dict[str, Any]) -> Any:
    """Batch sizes, locks, the tensorclass's plain field and the dict's plain value."""
    td, sample = batch["td"], batch["samples"][0]
    sizes = td.batch_size, td["next"].batch_size, sample.batch_size
    return sizes, td.is_locked, td["next"].is_locked, sample.note, batch["step"]


class Policy(nn.Module):
    """Reads a TensorDict and a tensorclass, as an RL policy reads its batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    @device_agnostic
    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        sample = batch["samples"][0]
        return self.lin(batch["td"]["obs"]) + sample.image.sum((1, 2))[:, None] * batch["step"]


# tensordict: a lazy stack of trajectories of different lengths, which no dense stack holds.


def trajectories() -> Any:
    """A ``LazyStackedTensorDict`` of two trajectories, 2 and 3 steps long, each with a
    nested reward: reading an entry across the stack needs ``as_list=True``."""
    tensordict = client("tensordict")
    return tensordict.LazyStackedTensorDict.lazy_stack(
        [
            tensordict.TensorDict(
                {"obs": torch.randn(steps, 3), "next": {"reward": torch.randn(steps)}}, []
            )
            for steps in (2, 3)
        ],
        0,
    )


def trajectory_views(lazy: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Each stacked tensordict by position and through the stack, by key and nested key."""
    obs, rewards = lazy.get("obs", as_list=True), lazy.get(("next", "reward"), as_list=True)
    for index, td in enumerate(lazy.tensordicts):
        yield f"lazy.tensordicts[{index}]['obs']", td["obs"]
        yield f"lazy[{index}]['obs']", lazy[index]["obs"]
        yield f"lazy.get('obs', as_list=True)[{index}]", obs[index]
        yield f"lazy.tensordicts[{index}]['next', 'reward']", td["next", "reward"]
        yield f"lazy.get(('next', 'reward'), as_list=True)[{index}]", rewards[index]


def trajectory_facts(lazy: Any) -> Any:
    """The stack's batch size and dimension, and each trajectory's length."""
    return lazy.batch_size, lazy.stack_dim, [len(o) for o in lazy.get("obs", as_list=True)]


class Critic(nn.Module):
    """A value per trajectory: the mean of its steps' values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)

    @device_agnostic
    def forward(self, lazy: Any) -> torch.Tensor:
        return torch.stack([self.lin(obs).mean() for obs in lazy.get("obs", as_list=True)])


# torch_geometric: Data and Batch.


def graph(nodes: int, label: int) -> Any:
    """A ``Data``: node features, edges in a chain, a graph label and a name."""
    data = client("torch_geometric.data")
    chain = torch.stack([torch.arange(nodes - 1), torch.arange(1, nodes)])
    features = torch.randn(nodes, 4)
    return data.Data(x=features, edge_index=chain, y=torch.tensor([label]), name=f"g{label}")


def graph_batch() -> Any:
    """A ``Batch`` of two graphs, with its ``batch`` and ``ptr`` vectors."""
    data = client("torch_geometric.data")
    return data.Batch.from_data_list([graph(3, 0), graph(5, 1)])


def graph_views(g: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """By attribute, key, ``to_dict()``, iteration, and each example of a batch."""
    as_dict, pairs = g.to_dict(), dict(iter(g))
    for key in sorted(g.keys()):
        if isinstance(g[key], torch.Tensor):
            yield f"g.{key}", getattr(g, key)
            yield f"g[{key!r}]", g[key]
            yield f"g.to_dict()[{key!r}]", as_dict[key]
            yield f"dict(iter(g))[{key!r}]", pairs[key]
    for index in range(getattr(g, "num_graphs", 0) if hasattr(g, "get_example") else 0):
        example = g.get_example(index)
        for key in sorted(example.keys()):
            if isinstance(example[key], torch.Tensor):
                yield f"g.get_example({index}).{key}", example[key]


def graph_facts(g: Any) -> Any:
    """Keys, sizes and the plain ``name`` attribute."""
    return sorted(g.keys()), g.num_nodes, g.num_edges, g.name


class GraphNet(nn.Module):
    """A node encoder and a sum over each graph's nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    @device_agnostic
    def forward(self, g: Any) -> torch.Tensor:
        hidden = self.lin(g.x)
        graphs = getattr(g, "num_graphs", 1)
        index = getattr(g, "batch", None)
        if index is None:  # a lone graph
            index = torch.zeros(g.num_nodes, dtype=torch.long)
        return torch.zeros(graphs, 2).index_add(0, index, hidden)


# Detection targets: a list of images and a list of dicts of tensors, of different lengths.


def detection_batch() -> dict[str, list[Any]]:
    """Two images of different sizes; targets with 2, 0 and 3 boxes."""
    boxes = [torch.rand(n, 4) for n in (2, 0, 3)]
    return {
        "images": [torch.rand(3, 8, 6), torch.rand(3, 5, 7), torch.rand(3, 6, 6)],
        "targets": [
            {"boxes": b, "labels": torch.arange(len(b)), "centers": b[:, :2]} for b in boxes
        ],
    }


def detection_views(batch: dict[str, list[Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each image; each target's entries."""
    for index, image in enumerate(batch["images"]):
        yield f"batch['images'][{index}]", image
    for index, target in enumerate(batch["targets"]):
        for key, value in target.items():
            yield f"batch['targets'][{index}][{key!r}]", value


def detection_facts(batch: dict[str, list[Any]]) -> Any:
    """How many boxes each target has; whether ``centers`` is a view of ``boxes`` (asked
    where there are boxes: an empty view is copied alone, as ``.to`` copies it)."""
    targets = batch["targets"]
    views = [t["centers"]._base is t["boxes"] for t in targets if len(t["boxes"])]
    return [len(t["boxes"]) for t in targets], views


class Detector(nn.Module):
    """Takes ``(images, targets)`` as torchvision's detection models do; returns losses."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Conv2d(3, 4, 3)
        self.box = nn.Linear(4, 4)

    @device_agnostic
    def forward(self, images: list[torch.Tensor], targets: list[dict[str, Any]]) -> Any:
        features = [self.backbone(image[None]).mean((2, 3)) for image in images]
        losses = [
            (self.box(feature) - target["boxes"]).abs().sum()
            for feature, target in zip(features, targets, strict=True)
        ]
        return {"loss_box": torch.stack(losses).sum(), "features": features}


# PackedSequence: variable-length sequences into an LSTM.


def packed() -> PackedSequence:
    """Three sequences of lengths 2, 5 and 3, so both index vectors are there."""
    return pack_sequence([torch.randn(n, 3) for n in (2, 5, 3)], enforce_sorted=False)


def packed_views(p: PackedSequence) -> Iterator[tuple[str, torch.Tensor]]:
    """By field and by position (a PackedSequence is a namedtuple)."""
    yield "p.data", p.data
    yield "p[0]", p[0]
    yield "p.sorted_indices", p.sorted_indices
    yield "p[2]", p[2]
    yield "p.unsorted_indices", p.unsorted_indices
    yield "p[3]", p[3]


def packed_facts(p: PackedSequence) -> Any:
    """``batch_sizes`` stays on the CPU, where PyTorch requires it."""
    return p.batch_sizes.tolist(), p.batch_sizes.device


class Tagger(nn.Module):
    """An LSTM over a packed batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 4)

    @device_agnostic
    def forward(self, p: PackedSequence) -> PackedSequence:
        out, _ = self.lstm(p)
        return out  # type: ignore[no-any-return]


CLIENTS = {
    "transformers-BatchEncoding": Client(
        encoding,
        encoding_views,
        lambda enc: list(enc.keys()),
        ["batch['input_ids']", "batch['token_type_ids']"],
        Encoder,
    ),
    "transformers-ModelOutput": Client(
        model_output,
        output_views,
        output_facts,
        [
            "batch.last_hidden_state",
            "batch.pooler_output",
            "batch.hidden_states[0]",
            "batch.hidden_states[1]",
            "batch.hidden_states[2]",
        ],
        Head,
    ),
    "tensordict": Client(
        tensordict_batch,
        tensordict_views,
        tensordict_facts,
        [
            "batch['td']['obs']",
            "batch['td']['next']['reward']",
            "batch['samples'][0].image",
            "batch['samples'][0].label",
        ],
        Policy,
    ),
    "tensordict-ragged-lazy-stack": Client(
        trajectories,
        trajectory_views,
        trajectory_facts,
        [
            "batch.tensordicts[0]['obs']",
            "batch.tensordicts[0]['next']['reward']",
            "batch.tensordicts[1]['obs']",
            "batch.tensordicts[1]['next']['reward']",
        ],
        Critic,
    ),
    "torch_geometric-Data": Client(
        lambda: graph(4, 7),
        graph_views,
        graph_facts,
        ["batch.x", "batch.edge_index", "batch.y"],
        GraphNet,
    ),
    "torch_geometric-Batch": Client(
        graph_batch,
        graph_views,
        graph_facts,
        ["batch.x", "batch.edge_index", "batch.y", "batch.batch", "batch.ptr"],
        GraphNet,
    ),
    "detection-targets": Client(
        detection_batch,
        detection_views,
        detection_facts,
        [
            "batch['images'][0]",
            "batch['images'][1]",
            "batch['images'][2]",
            *(
                f"batch['targets'][{i}][{key!r}]"
                for i in range(3)
                for key in ("boxes", "labels", "centers")
            ),
        ],
        Detector,
        lambda module, batch: module(batch["images"], batch["targets"]),
    ),
    "PackedSequence": Client(
        packed,
        packed_views,
        packed_facts,
        ["batch.data", "batch.sorted_indices", "batch.unsorted_indices"],
        Tagger,
    ),
}
clients = pytest.mark.parametrize("case", list(CLIENTS.values()), ids=list(CLIENTS))


def same_tensor(views: dict[str, torch.Tensor]) -> list[int]:
    """For each view, the position of the first view that gives the same tensor object."""
    tensors = list(views.values())
    return [next(i for i, seen in enumerate(tensors) if seen is t) for t in tensors]


def assert_agrees(case: Client, original: Any, moved: Any, device: torch.device) -> None:
    """``moved`` is ``original`` on ``device``: same type and facts; every access path
    gives a tensor on ``device`` of the same shape and dtype; and paths that shared a
    tensor share one, while paths that did not, do not."""
    before, after = dict(case.views(original)), dict(case.views(moved))
    assert type(original) is type(moved)
    assert case.facts(original) == case.facts(moved)
    assert list(before) == list(after)
    shapes = {label: (tuple(t.shape), t.dtype) for label, t in before.items()}
    assert shapes == {label: (tuple(t.shape), t.dtype) for label, t in after.items()}
    assert {label: device for label in before} == {label: t.device for label, t in after.items()}
    assert same_tensor(before) == same_tensor(after)


@clients
def test_round_trip_through_every_access_path(case: Client) -> None:
    """Moved to meta, every access path agrees; the input is left as it was; moving the
    result again gives it back itself."""
    original = case.make()
    facts = case.facts(original)
    moved = to_device(original, META)
    assert_agrees(case, original, moved, META)
    assert facts == case.facts(original)
    assert {CPU} == {t.device for _, t in case.views(original)}
    assert to_device(moved, META) is moved
    assert to_device(original, CPU) is original


@pytest.mark.skipif(not ACCELERATORS, reason=NO_ACCELERATOR)
@pytest.mark.parametrize("device", ACCELERATORS, ids=str)
@clients
def test_values_survive_a_round_trip_through_an_accelerator(
    case: Client, device: torch.device
) -> None:
    """To the accelerator and back: every access path gives the value it gave."""
    original = case.make()
    there = to_device(original, device)
    assert_agrees(case, original, there, device)
    back = to_device(there, CPU)
    assert_agrees(case, original, back, CPU)
    values = {label: t.tolist() for label, t in case.views(original)}
    assert values == {label: t.tolist() for label, t in case.views(back)}


@clients
def test_find_devices_names_each_tensor_once(case: Client) -> None:
    """find_devices lists each place that holds a tensor once, as code would reach it."""
    original = case.make()
    assert {CPU: case.paths} == find_devices(original, name="batch")
    assert {META: case.paths} == find_devices(to_device(original, META), name="batch")


@clients
def test_decorated_forward_moves_the_input_to_the_module(case: Client) -> None:
    """A module on meta with a decorated forward takes the client on the CPU."""
    module = case.module().to(META)
    result = case.forward(module, case.make())
    found = find_devices(result)
    assert [META] == list(found)
    assert found[META]


@clients
def test_output_input_returns_every_view_to_the_caller(case: Client) -> None:
    """``output="input"``: a result made on the CPU reaches the caller's device (meta)
    whole, every access path agreeing."""

    @device_agnostic(output="input", scope=False)
    def produce(like: Any) -> Any:
        return case.make()

    result = produce(to_device(case.make(), META))
    assert_agrees(case, case.make(), result, META)


@clients
def test_mismatch_names_every_path(case: Client) -> None:
    """``move=False``: the error lists the path of each tensor off the target."""

    @device_agnostic(move=False, device="meta")
    def consume(batch: Any) -> None:
        pass

    with pytest.raises(DeviceMismatchError) as error:
        consume(case.make())
    assert {CPU: case.paths} == error.value.devices


def test_mismatch_message_for_a_batch_encoding() -> None:
    """The whole message for a BERT on meta given a ``BatchEncoding`` on the CPU."""

    @device_agnostic(move=False)
    def encode(model: nn.Module, batch: Any) -> Any:
        return model(**batch)

    with pytest.raises(DeviceMismatchError) as error:
        encode(tiny_bert().to(META), encoding())
    assert [
        "test_mismatch_message_for_a_batch_encoding.<locals>.encode() got tensors on cpu, "
        "not on its target:",
        "    cpu <- batch['input_ids'], batch['token_type_ids']",
        "target meta (from the parameters of model (BertModel))",
        'fix: pass to_device(batch, "meta"), '
        "or use @device_agnostic(move=True) to move the arguments",
    ] == str(error.value).splitlines()


def test_model_output_views_agree_after_a_decorated_bert_forward() -> None:
    """The reported case: BERT's output, returned through ``output="input"``, agrees
    through attributes, keys, indices and ``to_tuple()``."""
    model = tiny_bert()

    @device_agnostic(output="input", scope=False)
    def encode(batch: Any) -> Any:
        ids = torch.zeros(batch["input_ids"].shape, dtype=torch.long)
        return model(input_ids=ids, output_hidden_states=True)

    out = encode(to_device(encoding(), META))
    assert META == out.last_hidden_state.device
    assert out.last_hidden_state is out["last_hidden_state"]
    assert out.last_hidden_state is out[0]
    assert out.last_hidden_state is out.to_tuple()[0]
    assert out.hidden_states is out["hidden_states"]


def loss_set_by_key() -> Any:
    """A ``SequenceClassifierOutput`` given its loss by key after it was made, as custom
    heads do: its keys list the loss last, its fields list it first."""
    outputs = client("transformers.modeling_outputs")
    out = outputs.SequenceClassifierOutput(logits=torch.randn(2, 3))
    out["loss"] = torch.tensor(0.5)
    return out


def loss_set_by_attribute() -> Any:
    """A ``CausalLMOutputWithPast`` given its loss by attribute after it was made."""
    outputs = client("transformers.modeling_outputs")
    hidden = (torch.randn(2, 5, 4), torch.randn(2, 5, 4))
    out = outputs.CausalLMOutputWithPast(logits=torch.randn(2, 5, 7), hidden_states=hidden)
    out.loss = torch.tensor(1.5)
    return out


late_loss = pytest.mark.parametrize(
    ("make", "keys"),
    [
        (loss_set_by_key, ["logits", "loss"]),
        (loss_set_by_attribute, ["logits", "hidden_states", "loss"]),
    ],
    ids=["by-key", "by-attribute"],
)


@late_loss
def test_model_output_keeps_the_order_its_entries_were_set_in(
    make: Callable[[], Any], keys: list[str]
) -> None:
    """A ``ModelOutput`` whose keys are not in its field order moves with its keys in
    their order, so that indices and ``to_tuple()`` still give what they gave, every
    access path agreeing; the input is left as it was."""
    out = make()
    assert keys == list(out.keys())
    moved = to_device(out, META)
    assert_agrees(CLIENTS["transformers-ModelOutput"], out, moved, META)
    assert keys == list(moved.keys())
    assert moved.loss is moved["loss"] is moved[len(keys) - 1]
    assert keys == list(out.keys())
    assert {CPU} == {t.device for _, t in output_views(out)}


@late_loss
def test_model_output_out_of_field_order_returns_to_the_caller(
    make: Callable[[], Any], keys: list[str]
) -> None:
    """``output="input"``: such a ``ModelOutput`` made on the CPU reaches the caller's
    device (meta) with its keys in their order, every access path agreeing."""

    @device_agnostic(output="input", scope=False)
    def head(features: torch.Tensor) -> Any:
        return make()

    result = head(torch.zeros(2, device=META))
    assert_agrees(CLIENTS["transformers-ModelOutput"], make(), result, META)
    assert keys == list(result.keys())


@pytest.mark.skipif(not ACCELERATORS, reason=NO_ACCELERATOR)
@pytest.mark.parametrize("device", ACCELERATORS, ids=str)
def test_bert_on_an_accelerator_answers_on_the_cpu(device: torch.device) -> None:
    """The case ``output="input"`` is for: CPU inputs, the model on the accelerator, the
    output back on the CPU with the values a CPU run gives, every view agreeing."""
    expected = model_output()

    @device_agnostic(output="input")
    def encode(model: nn.Module, batch: Any) -> Any:
        return model(**batch, output_hidden_states=True)

    with torch.no_grad():
        out = encode(tiny_bert().to(device), encoding())
    assert_agrees(CLIENTS["transformers-ModelOutput"], expected, out, CPU)
    torch.testing.assert_close(expected.to_tuple(), out.to_tuple())


def test_a_cast_reaches_into_a_tensorclass() -> None:
    """``dtypes=`` casts a tensorclass's fields as it casts a TensorDict's entries (it
    raised the device's refusal from the tensorclass's own ``.to``): its batch size and
    plain field are kept, and the original is unchanged."""
    sample = sample_class()
    batch = sample(
        image=torch.randn(4, 2, 2, dtype=torch.float64),
        label=torch.arange(4),
        note="kept",
        batch_size=[4],
    )
    for device in (torch.device("cpu"), torch.device("meta")):
        moved = to_device(batch, device, dtypes={torch.float64: torch.float32})
        assert type(moved) is type(batch)
        assert (torch.float32, torch.int64) == (moved.image.dtype, moved.label.dtype)
        assert (device, torch.Size([4]), "kept") == (
            moved.image.device,
            moved.batch_size,
            moved.note,
        )
    assert torch.float64 == batch.image.dtype


@pytest.mark.parametrize("lazy", [False, True], ids=["TensorDict", "LazyStackedTensorDict"])
def test_a_cast_keeps_a_tensordict_locked(lazy: bool) -> None:
    """A move that casts (``dtypes=``) takes a locked TensorDict or lazy stack apart to cast
    its tensors; it comes back locked, nested tensordicts too, as its own ``.to`` keeps it,
    and the original is unchanged."""
    tensordict = client("tensordict")
    if lazy:
        batch = trajectories().to(torch.float64).lock_()
    else:
        batch = tensordict.TensorDict(
            {"obs": torch.randn(2, dtype=torch.float64), "next": {"r": torch.randn(2)}}, []
        ).lock_()

    def parts(td: Any) -> list[Any]:  # the stacked tensordicts, or the one
        return list(td.tensordicts) if lazy else [td]

    def dtypes(td: Any) -> list[torch.dtype]:
        return [t.dtype for part in parts(td) for t in part.values(True, True)]

    before = dtypes(batch)
    assert torch.float64 in before
    for device in (torch.device("cpu"), torch.device("meta")):
        moved = to_device(batch, device, dtypes={torch.float64: torch.float32})
        assert type(moved) is type(batch)
        assert moved.is_locked
        assert {torch.float32} == set(dtypes(moved))
        assert all(part.is_locked and part["next"].is_locked for part in parts(moved))
    assert batch.is_locked
    assert before == dtypes(batch)


@pytest.mark.parametrize("differs", ["batch_size", "names"])
def test_a_tensordict_output_whose_batch_dimensions_differ_is_caught(differs: str) -> None:
    """The kit compares a TensorDict's batch_size and names, not only its entries: a batch
    that lost its batch dimension on one device has the same entries, another len()."""
    tensordict = client("tensordict")
    x = torch.ones(4, 3)

    def batched(x: torch.Tensor) -> Any:
        on_cpu = x.device.type == "cpu"
        if differs == "batch_size":
            return tensordict.TensorDict({"a": x}, batch_size=[4] if on_cpu else [])
        names = ["time" if on_cpu else "batch"]
        return tensordict.TensorDict({"a": x}, batch_size=[4], names=names)

    with pytest.raises(AssertionError) as raised:
        assert_device_agnostic(batched, x, devices=["cpu", "meta"])
    expected = {
        "batch_size": "    out.batch_size: torch.Size([]), expected torch.Size([4])",
        "names": "    out.names: ['batch'], expected ['time']",
    }[differs]
    assert expected in str(raised.value).splitlines()
    same = tensordict.TensorDict
    assert_device_agnostic(lambda x: same({"a": x}, [4]), x, devices=["cpu", "meta"])


@pytest.mark.requires_device("accelerator")
def test_a_batch_of_graphs_gets_a_registration_of_a_class_code_can_name() -> None:
    """torch_geometric makes ``DataBatch`` at run time (no module holds it): the fix that
    teaches devicectx the type registers ``Batch``, which it is, and works as written."""
    batch = graph_batch()
    batch.x = batch.x.double()
    assert "DataBatch" == type(batch).__name__
    with mps_like() as device:
        with pytest.raises(MoveError) as caught:
            to_device(batch, device, dtypes="device")
        fix = str(caught.value).split("\nfix: ", 1)[1]
        assert (
            "devicectx.register_container(Batch, children=batch_children, "
            "rebuild=batch_rebuild) (a DataBatch, made at run time, is a Batch)"
        ) in fix

        def batch_children(obj: Any) -> list[tuple[str, Any]]:
            return list(obj.to_dict().items())

        def batch_rebuild(obj: Any, new: list[Any]) -> Any:
            out = copy.copy(obj)
            for (key, _), value in zip(batch_children(obj), new, strict=True):
                out[key] = value
            return out

        Batch = client("torch_geometric.data").Batch  # as the fix names it
        register_container(Batch, children=batch_children, rebuild=batch_rebuild)
        try:
            moved = to_device(batch, device, dtypes="device")
        finally:
            unregister_container(Batch)
    assert (torch.float32, device) == (moved.x.dtype, moved.x.device)
    assert 2 == moved.num_graphs


@pytest.mark.requires_device("accelerator")
def test_a_graph_with_float64_features_gets_the_cast_its_own_to_needs() -> None:
    """On a device without float64, a torch_geometric Data with float64 features moves
    with its own .to, which dtypes= does not cast: the MoveError's fix casts its features
    (``data.x = data.x.to(torch.float32)``), and the call then runs, applied as written."""
    graph_data = graph(3, 0)
    graph_data.x = graph_data.x.double()
    with mps_like() as device:

        @device_agnostic(device=device, dtypes="device")
        def features(data: Any) -> torch.Tensor:
            return data.x.sum(0)  # type: ignore[no-any-return]

        with pytest.raises(MoveError) as caught:
            features(graph_data)
        fix = str(caught.value).split("\nfix: ", 1)[1]
        assert fix.startswith("data.x = data.x.to(torch.float32) before the call, as a Data ")
        data = graph_data
        exec(fix.split(" before the call", 1)[0])
        assert torch.float32 == features(data).dtype
