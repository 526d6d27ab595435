"""Property tests of your own device-agnostic forward helper: copy this file and adapt it.

The devicectx pytest plugin is active wherever devicectx is installed, so this runs as is:

    pytest examples/property_test_forward.py                    # on every device here
    pytest examples/property_test_forward.py --devices=cpu,meta # on the ones you name
    python examples/property_test_forward.py --devices=cpu,meta # the same, through pytest

It puts the pieces of ``devicectx.testing`` together (from a clone,
``pip install -e '.[testing]'``):

- the plugin's ``device`` fixture: each test runs once per device (``[cpu]``, ``[cuda:0]``,
  ``[meta]``); ``meta`` checks shapes and dtypes on a machine without a GPU;
- ``devicectx.testing.strategies``: hypothesis strategies for tensors and devices;
- ``assert_device_agnostic``: the helper gives the CPU's result on every device, each time
  on that device.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from devicectx import device_agnostic, find_devices
from devicectx.testing import assert_device_agnostic
from devicectx.testing import strategies as dst

FEATURES, CLASSES = 4, 3
Batch = dict[str, torch.Tensor]

# Tensor work can take longer than hypothesis's default 200 ms deadline on a busy machine.
examples = settings(deadline=None, max_examples=25)


class Classifier(nn.Module):
    """Your model: here a small MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(FEATURES, 8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.body(x)))
        return out


@device_agnostic
def predict(model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    """Your forward helper: logits, predictions, and the loss over the labelled rows.

    ``@device_agnostic`` moves the batch to the model's device and runs the body there,
    so ``weight``, made without ``device=``, lands there too. Take the decorator away and
    ``test_predict_is_device_agnostic[meta]`` fails: "predict is not device-agnostic: it
    raised on meta, not on cpu: RuntimeError: Tensor on device cpu is not on the expected
    device meta!".
    """
    logits = model(batch["x"])
    labels = batch["labels"]
    labelled = labels >= 0
    weight = torch.ones(CLASSES)
    losses = nn.functional.cross_entropy(
        logits, labels.clamp(min=0), weight=weight, reduction="none"
    )
    loss = (losses * labelled).sum() / labelled.sum().clamp(min=1)
    return {"logits": logits, "predicted": logits.argmax(-1), "loss": loss}


def batches(devices: st.SearchStrategy[torch.device] | None = None) -> st.SearchStrategy[Batch]:
    """Batches of 1 to 8 rows: features on ``devices`` (default: the CPU), labels (-1: none)."""

    def batch(rows: int) -> st.SearchStrategy[Batch]:
        features = dst.tensors(
            devices=["cpu"] if devices is None else devices,
            dtypes=[torch.float32],
            shapes=st.just((rows, FEATURES)),
        )
        labels = st.lists(st.integers(-1, CLASSES - 1), min_size=rows, max_size=rows)
        return st.fixed_dictionaries({"x": features, "labels": labels.map(torch.tensor)})

    return st.integers(1, 8).flatmap(batch)


@pytest.fixture(scope="module")
def model() -> Classifier:
    """The model under test, on the CPU; each test puts its own copy where it needs it."""
    torch.manual_seed(0)
    return Classifier().eval()


@examples
@given(batch=batches())
def test_predict_is_device_agnostic(model: Classifier, device: torch.device, batch: Batch) -> None:
    """predict gives the CPU's result on each device (on meta: the same shapes and dtypes)."""
    assert_device_agnostic(predict, model, batch, devices=["cpu", device])


@examples
@given(batch=batches(devices=dst.devices()))  # on any device of this machine
def test_outputs_land_on_the_models_device(
    model: Classifier, device: torch.device, batch: Batch
) -> None:
    """Wherever the batch comes from, every output is on the model's device, one row per row."""
    placed = copy.deepcopy(model).to(device)
    out = predict(placed, batch)
    assert {device} == set(find_devices(out))
    rows = batch["x"].shape[0]
    assert (rows, CLASSES) == out["logits"].shape
    assert (rows,) == out["predicted"].shape


if __name__ == "__main__":
    # In a fresh process: pytest must import this file (and devicectx) itself.
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", __file__, *sys.argv[1:]]))
