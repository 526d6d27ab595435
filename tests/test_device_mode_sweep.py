"""torch's own sweep of its device context, ported: every factory OpInfo inside a meta block.

``TestDeviceUtils.test_device_mode_ops`` (pytorch ``test/test_utils.py``) calls every OpInfo
of ``op_db`` whose samples hold no tensor, with ``device=`` removed, inside
``with torch.device("meta")``, and checks that every tensor it returns is on meta. Here the
same calls run inside ``torch.device("meta")``, ``on_device("meta", exact=True)`` and
``on_device("meta")``, in a fresh interpreter where ``op_db`` is imported before devicectx
(as a library imported first would be): an OpInfo holds its function in an attribute
(``op=torch.ones``), a reference held in an object, which the default leaves to torch (the
one documented limit). Imported again after a block, the OpInfos hold the replacements,
and the default passes everything.

Which OpInfos: torch's test generates the samples of every OpInfo for every dtype (31 s on
a 2-core CPU), then keeps those whose samples hold no tensor. Here that selection is
written down (:data:`SELECTED`, the 30 OpInfos it gives on torch 2.13), and each run adds
every OpInfo whose function is one of torch's constructors (read from the OpInfos, no
sample made): a new OpInfo of a constructor, the kind the default can miss, is swept
without an edit here, and a new gap fails the suite. Only the selected OpInfos' samples
are made, each once for all the modes, of one dtype of each family an OpInfo supports
(bool, integers, floating, complex: float32, int64, complex64 where supported), not of
every dtype as torch's test does: the device a constructor gets does not depend on its
dtype, and the samples of every dtype take 8 s (``logspace`` alone has 3,800 without a
tensor). ``DEVICECTX_SWEEP_SELECTION=recompute`` does it all the long way: the selection
from the samples (the first sample of one dtype of every OpInfo, then all samples of that
dtype of the candidates), checked against :data:`SELECTED`, and every dtype swept (about
40 s more on a 2-core CPU): run it after a torch release adds OpInfos. ``op_db``'s import
takes 2 s, its import again after a block 0.5 s.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from helpers import once_per_session, python_output

pytestmark = pytest.mark.torch_internals  # CI runs it on every minor torch release

pytest.importorskip("expecttest")  # torch.testing._internal imports it

# The OpInfos whose function is one of torch's constructors held in the OpInfo itself:
# inside on_device(meta) without exact=True their results stay on the CPU. A new name here
# is a new gap (the sweep fails); a name gone is a gap closed (update the list).
KNOWN = {
    "arange",
    "empty",
    "empty_permuted",
    "eye",
    "full",
    "linspace",
    "linspace.tensor_overload",
    "logspace",
    "logspace.tensor_overload",
    "ones",
    "scalar_tensor",
    "tril_indices",
    "triu_indices",
    "zeros",
}

# The OpInfos of op_db whose samples may hold no tensor (torch 2.13): what the sweep calls.
# Those of a constructor are found at each run; the rest are listed, and
# DEVICECTX_SWEEP_SELECTION=recompute checks the list (see the module docstring).
SELECTED = sorted(
    KNOWN
    | {
        "broadcast_shapes",
        "empty_strided",
        "normal.number_mean",
        "randint",
        "randn",
        "signal.windows.bartlett",
        "signal.windows.blackman",
        "signal.windows.cosine",
        "signal.windows.exponential",
        "signal.windows.gaussian",
        "signal.windows.general_cosine",
        "signal.windows.general_hamming",
        "signal.windows.hamming",
        "signal.windows.hann",
        "signal.windows.kaiser",
        "signal.windows.nuttall",
    }
)
RECOMPUTE = os.environ.get("DEVICECTX_SWEEP_SELECTION") == "recompute"

_SWEEP = r"""
import importlib, json, warnings
warnings.simplefilter("ignore")
import torch
torch.set_num_threads(1)
import torch.testing._internal.common_methods_invocations as cmi
from torch.utils._pytree import tree_all_only, tree_any
import devicectx
from devicectx import StrayTensorWarning, on_device

def free(sample):
    parts = (sample.input, sample.args, sample.kwargs)
    return not tree_any(lambda x: isinstance(x, torch.Tensor), parts)

def name(op):
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name

PREFERRED = (torch.float32, torch.int64, torch.bool, torch.complex64)

def family(dtype):
    return (dtype.is_complex, dtype.is_floating_point, dtype == torch.bool)

def dtypes(op):
    # Every dtype, as torch's test takes them, when the selection is recomputed; else one
    # of each family (bool, integers, floating, complex): the device a constructor gets
    # does not depend on its dtype, and the samples of every dtype take 8 s.
    every = sorted(op.supported_dtypes("cpu"), key=str)
    if RECOMPUTE:
        return every
    chosen = {}
    for dtype in [*PREFERRED, *every]:
        if dtype in every:
            chosen.setdefault(family(dtype), dtype)
    return sorted(chosen.values(), key=str)

def samples(op, dtype):
    try:
        return list(op.sample_inputs("cpu", dtype, requires_grad=False))
    except Exception:
        return []

def selected(op_db, constructors):
    # Those whose first sample (of one dtype) holds no tensor, and their variants, and those
    # whose function is one of torch's constructors: all their samples of that dtype looked at.
    firsts = {}
    for op in op_db:
        types = dtypes(op)
        if types:
            dtype = torch.float32 if torch.float32 in types else types[0]
            first = next(iter(op.sample_inputs("cpu", dtype, requires_grad=False)), None)
            firsts[name(op)] = (op, dtype, first is not None and free(first))
    families = {op.name for op, _, first_free in firsts.values() if first_free}
    return {
        key
        for key, (op, dtype, first_free) in firsts.items()
        if first_free or ((op.name in families or op.op in constructors)
                          and any(free(s) for s in samples(op, dtype)))
    }

def calls(op_db, names):
    # Every tensor-free sample of every dtype, as torch's test takes them, device= removed.
    found = []
    for op in op_db:
        if name(op) in names:
            for dtype in dtypes(op):
                for sample in samples(op, dtype):
                    if free(sample):
                        kwargs = sample.kwargs.copy()
                        kwargs.pop("device", None)
                        found.append((name(op), sample.input, sample.args, kwargs))
    return found

def sweep(op_db, found, block):
    funcs = {name(op): op.get_op() for op in op_db}
    failed = set()
    for key, first, args, kwargs in found:
        try:
            with block():
                result = funcs[key](first, *args, **kwargs)
            ok = tree_all_only(torch.Tensor, lambda t: t.device.type == "meta", result)
        except Exception:
            ok = False
        if not ok:
            failed.add(key)
    return sorted(failed)

def audited(op_db, found):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sweep(op_db, found, lambda: on_device("meta", audit=True))
    messages = [str(w.message) for w in caught if issubclass(w.category, StrayTensorWarning)]
    return sorted({m.split(" ")[0] + " at " + m.split(" ")[2] for m in messages})

constructors = set(torch.utils._device._device_constructors())
listed = {name(op) for op in cmi.op_db if name(op) in LISTED}
candidates = listed | {name(op) for op in cmi.op_db if op.op in constructors}
report = {"recomputed": sorted(selected(cmi.op_db, constructors)) if RECOMPUTE else None}
found = calls(cmi.op_db, candidates)
names = {call[0] for call in found}  # (torch 2.6 lists torch.fill, whose samples hold tensors)
held = sorted(name(op) for op in cmi.op_db if name(op) in names and op.op in constructors)
report |= {
    "selected": sorted(names),
    "listed, no call without tensors": sorted(listed - names),
    "held": held,
    "torch.device": sweep(cmi.op_db, found, lambda: torch.device("meta")),
    "exact": sweep(cmi.op_db, found, lambda: on_device("meta", exact=True)),
    "default": sweep(cmi.op_db, found, lambda: on_device("meta")),
    "audit": audited(cmi.op_db, [call for call in found if call[0] in held]),
}
importlib.reload(cmi)  # after a block: the OpInfos now hold the replacements
after = sweep(cmi.op_db, found, lambda: on_device("meta"))
report["default, op_db imported after a block"] = after
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The sweep's failures in each mode, from a fresh interpreter (one in a session)."""
    given = f"LISTED = {set(SELECTED)!r}\nRECOMPUTE = {RECOMPUTE!r}\n"
    result: dict[str, Any] = once_per_session(
        tmp_path_factory,
        "device-mode-sweep",
        lambda: json.loads(python_output(given + _SWEEP).splitlines()[-1]),
    )
    return result


@pytest.mark.skipif(not RECOMPUTE, reason="DEVICECTX_SWEEP_SELECTION=recompute: about 40 s more")
def test_the_listed_selection_is_what_the_samples_give(report: dict[str, Any]) -> None:
    """SELECTED is the selection worked out from the samples, as torch's test makes them."""
    assert SELECTED == report["recomputed"]


def test_every_listed_opinfo_has_a_call_without_tensors(report: dict[str, Any]) -> None:
    """Each listed OpInfo this torch has is swept: it has a sample that holds no tensor (a
    listed name that stopped having one is stale)."""
    assert [] == report["listed, no call without tensors"]


def test_the_sweep_covers_torch_factory_opinfos(report: dict[str, Any]) -> None:
    """The sweep runs the factory OpInfos torch's test runs (ops of tensor-free samples)."""
    assert KNOWN <= set(report["selected"])
    assert 25 <= len(report["selected"])


def test_exact_passes_everything_torch_device_passes(report: dict[str, Any]) -> None:
    """on_device(meta, exact=True) puts on meta whatever torch.device(meta) does."""
    assert report["torch.device"] == report["exact"]


def test_the_default_fails_only_where_an_object_holds_torch_own(
    report: dict[str, Any],
) -> None:
    """The default misses exactly the OpInfos that hold one of torch's own constructors,
    captured before the first block: the known list, each explained."""
    assert sorted(KNOWN) == report["held"]
    assert sorted(KNOWN | set(report["torch.device"])) == report["default"]


def test_audit_names_each_missed_call(report: dict[str, Any]) -> None:
    """audit=True reports every constructor the default missed, at the calling line."""
    ops = {entry.split(" at ")[0] for entry in report["audit"]}
    lines = {entry.split(" at ")[1] for entry in report["audit"]}
    assert {f"torch.{name.split('.')[0]}" for name in KNOWN} == ops
    assert all(line.startswith("<string>:") for line in lines)


def test_opinfos_made_after_a_block_hold_the_replacements(report: dict[str, Any]) -> None:
    """op_db imported after a block: its OpInfos hold the replacements, and all pass."""
    assert report["torch.device"] == report["default, op_db imported after a block"]
