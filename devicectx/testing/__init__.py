"""devicectx.testing: test your own code on every device (``pip install -e '.[testing]'``).

- :func:`assert_device_agnostic`: run a function on each device and compare the outputs;
- :mod:`devicectx.testing.strategies`: hypothesis strategies for devices, tensors and nested
  batches (needs hypothesis);
- :mod:`devicectx.testing.emulated`: an emulated accelerator (``emu``) for machines without a
  GPU: memory of its own, streams, events, pinned memory, copies that finish later; it
  plays other devices too (``profile("mps")``: no float64; a memory limit);
- a pytest plugin, active wherever devicectx is installed: the ``device`` fixture, the
  ``--devices=cpu,meta`` and ``--devicectx-accelerator=emulated`` options and the
  ``@pytest.mark.requires_device("cuda")`` marker.

These names (and ``emulated``) are imported on first use: the pytest plugin lives in this
package, so it is imported into every test session, and must cost nothing there and work
without hypothesis.

The modules: ``_assertions`` (``assert_device_agnostic``), with ``_inputs`` (each device's
copies of the call's inputs), ``_compare`` (the comparison of the outputs and its message),
``_left`` (what a call left in its modules, compared after the outputs) and ``_sets`` (sets
of tensors paired across devices); ``strategies``; ``emulated`` (the
emulated accelerator's API), ``_emulated`` (its C++ sources, their build, and its device
module) and ``emulate`` (its command-line runner, ``python -m devicectx.testing.emulate
train.py``); ``_plugin`` (the pytest plugin).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from devicectx.testing import strategies
    from devicectx.testing._assertions import assert_device_agnostic

__all__ = ["assert_device_agnostic", "strategies"]


def __getattr__(name: str) -> object:
    if name == "assert_device_agnostic":
        return import_module("devicectx.testing._assertions").assert_device_agnostic
    if name == "emulated":  # as after `from devicectx.testing import emulated`
        return import_module("devicectx.testing.emulated")
    if name != "strategies":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return import_module("devicectx.testing.strategies")
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] != "hypothesis":
            raise
        msg = (
            "devicectx.testing.strategies needs hypothesis, which is not installed\n"
            "fix: pip install -e '.[testing]' (from a clone of devicectx)"
        )
        raise ModuleNotFoundError(msg, name="hypothesis") from None
