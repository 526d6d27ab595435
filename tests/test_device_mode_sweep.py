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
a 2-core CPU; 5 s for one dtype). Here the first sample of one dtype per OpInfo (0.9 s)
picks those whose samples may hold no tensor: a tensor-free first sample, a variant of
such an OpInfo, or a function that is one of torch's constructors; all their samples of
that dtype then decide. On torch 2.13 that is the same 30 OpInfos as every sample of every
dtype gives. Those are swept for every dtype, as torch does, each sample made once for all
the modes. ``op_db``'s import takes 2 s.
"""

from __future__ import annotations

import json

import pytest
from helpers import python_output

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

def dtypes(op):
    return sorted(op.supported_dtypes("cpu"), key=str)

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
names = selected(cmi.op_db, constructors)
found = calls(cmi.op_db, names)
held = sorted(name(op) for op in cmi.op_db if name(op) in names and op.op in constructors)
report = {
    "selected": sorted(names),
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
def report() -> dict[str, list[str]]:
    """The sweep's failures in each mode, from a fresh interpreter."""
    result: dict[str, list[str]] = json.loads(python_output(_SWEEP).splitlines()[-1])
    return result


def test_the_sweep_covers_torch_factory_opinfos(report: dict[str, list[str]]) -> None:
    """The sweep finds the factory OpInfos torch's test runs (ops of tensor-free samples)."""
    assert KNOWN <= set(report["selected"])
    assert 25 <= len(report["selected"])


def test_exact_passes_everything_torch_device_passes(report: dict[str, list[str]]) -> None:
    """on_device(meta, exact=True) puts on meta whatever torch.device(meta) does."""
    assert report["torch.device"] == report["exact"]


def test_the_default_fails_only_where_an_object_holds_torch_own(
    report: dict[str, list[str]],
) -> None:
    """The default misses exactly the OpInfos that hold one of torch's own constructors,
    captured before the first block: the known list, each explained."""
    assert sorted(KNOWN) == report["held"]
    assert sorted(KNOWN | set(report["torch.device"])) == report["default"]


def test_audit_names_each_missed_call(report: dict[str, list[str]]) -> None:
    """audit=True reports every constructor the default missed, at the calling line."""
    ops = {entry.split(" at ")[0] for entry in report["audit"]}
    lines = {entry.split(" at ")[1] for entry in report["audit"]}
    assert {f"torch.{name.split('.')[0]}" for name in KNOWN} == ops
    assert all(line.startswith("<string>:") for line in lines)


def test_opinfos_made_after_a_block_hold_the_replacements(report: dict[str, list[str]]) -> None:
    """op_db imported after a block: its OpInfos hold the replacements, and all pass."""
    assert report["torch.device"] == report["default, op_db imported after a block"]
