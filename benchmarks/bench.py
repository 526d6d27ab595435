"""devicectx beside its peers, in one process: ratios against the speed targets.

Run it from the repository root (the peers come with ``pip install -e .[bench]``)::

    python benchmarks/bench.py                 # full run, a few minutes
    python benchmarks/bench.py --quick         # smoke mode, seconds; the numbers mean little
    python benchmarks/bench.py --json out.json --markdown out.md

It prints a markdown table (one row per comparison: devicectx, the peers, the ratio, the
target and whether it is met) followed by every measurement, and writes all figures as
JSON. A subject that raises ``NotImplementedError`` or is not installed is reported as
"not available"; any other exception as "error", with its message. Nothing is asserted:
the benchmark reports, the reader judges.
"""

from __future__ import annotations

import argparse
import functools
import json
import operator
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _devices import accelerator, emulated_copies_undelayed
from _diagnostics import section_diagnostics
from _imports import section_import
from _prefetch import section_prefetch
from _report import TOLERANCE, Row, judge, render, rows_from, times
from _targets import (
    decorator_off_default,
    entry,
    in_block,
    moved_off_default,
    off_default_devices,
)
from _timing import Config, Measurement, Subject, as_json, bind, fmt_ns, measure_group
from _transfer import section_transfer
from _trees import (
    PEERS,
    Tree,
    aliased,
    count_copies,
    flat3,
    load,
    many_leaves,
    movers,
    nested,
    tensors_in,
)

from devicectx import device_agnostic, find_devices, on_device, to_device

CPU = torch.device("cpu")
META = torch.device("meta")
Section = dict[str, Any]


def _loss(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return pred


def _step(batch: Any) -> Any:
    return batch


def _loss_scoped(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    with torch.device(CPU):
        return _loss(pred, target, weight)


def _step_scoped(batch: Any) -> Any:
    with torch.device(CPU):
        return _step(batch)


Fn = Callable[..., Any]


def _call_of(tree: Tree) -> tuple[Fn, Fn, Callable[[Fn], Callable[[], Any]]]:
    """A function taking ``tree`` (the flat tuple as three arguments, else one batch), the
    same function inside ``with torch.device(cpu)``, and how to call either on ``tree``."""
    if tree.key == "flat3":
        a, b, c = tree.tree
        return _loss, _loss_scoped, lambda fn: lambda: fn(a, b, c)
    batch = tree.tree
    return _step, _step_scoped, lambda fn: lambda: fn(batch)


def _bare(fn: Fn) -> Fn:
    return device_agnostic(fn)


def _to_cpu(fn: Fn) -> Fn:
    return device_agnostic(device=CPU)(fn)


def _to_cpu_unscoped(fn: Fn) -> Fn:
    return device_agnostic(device=CPU, scope=False)(fn)


# The decorator's three forms: the target inferred from the inputs, an explicit target
# (the inputs checked against it), and no scope; in each, nothing needs moving.
_DECORATED: dict[str, Callable[[Fn], Fn]] = {
    "@device_agnostic": _bare,
    "@device_agnostic(device=d)": _to_cpu,
    "@device_agnostic(device=d, scope=False)": _to_cpu_unscoped,
}
_SCOPED = "call inside torch.device(d)"


def section_decorator(config: Config, trees: list[Tree]) -> tuple[Section, list[Row]]:
    """(1) the decorator on arguments already on the target, beside the peers' moves.

    What the decorator adds is the decorated call's time minus the plain call's; the peers
    are timed doing the move alone, the equivalent of what the decorator does on the way in.
    """
    cases: Section = {}
    rows: list[Row] = []
    for tree in trees:
        body, scoped, call = _call_of(tree)
        subjects = {"call": Subject(functools.partial(call, body))}
        for name, decorate in _DECORATED.items():
            subjects[name] = Subject(functools.partial(_decorated, call, decorate, body))
        subjects[_SCOPED] = Subject(functools.partial(call, scoped))
        subjects.update({name: Subject(make) for name, make in movers(tree.tree, CPU).items()})
        measured = measure_group(subjects, config)
        base = measured["call"].median_ns
        added = {name: _minus(measured[name].median_ns, base) for name in [*_DECORATED, _SCOPED]}
        cases[tree.key] = {
            "label": tree.label,
            "leaves": tree.leaves,
            "subjects": as_json(measured),
            "added_ns": added,
        }
        scope_text = f"with torch.device(d) {fmt_ns(added[_SCOPED])}"
        peer_text = f"{times(measured, ['to_device', *PEERS])}; {scope_text}"
        against, target = "send_to_device", None
        if tree.key == "flat3":
            target = 0.5
        elif tree.key == "nested":
            against, target = "to_device", 1.2
        for name in _DECORATED:
            rows.append(
                judge(
                    "1 decorator",
                    f"{tree.label}, on target: time {name} adds",
                    added[name],
                    peer_text,
                    measured[against].median_ns,
                    against,
                    target,
                    missing=_missing(measured[name], measured["call"]),
                )
            )
        peers = (
            ("send_to_device", "optree.tree_map") if tree.key == "nested" else ("send_to_device",)
        )
        for peer in peers:
            rows.append(
                judge(
                    "1 decorator",
                    f"{tree.label}, on target: to_device (vs {peer})",
                    measured["to_device"].median_ns,
                    times(measured, PEERS),
                    measured[peer].median_ns,
                    peer,
                    0.5 if tree.key == "nested" else None,
                    missing=_missing(measured["to_device"]),
                )
            )
    for tree in trees:
        cases[f"{tree.key} dtypes="], dtype_rows = _dtype_policy(config, tree)
        rows.extend(dtype_rows)
    forward_case, forward_row = _decorated_forward(config)
    cases["forward"] = forward_case
    rows.append(forward_row)
    for device in off_default_devices():  # a non-default target: each call enters a scope
        cases[f"flat3 on {device}"], off_rows = decorator_off_default(config, device)
        rows.extend(off_rows)
        cases[f"flat3 to {device}"], moved_rows = moved_off_default(config, device)
        rows.extend(moved_rows)
    return {"device": str(CPU), "cases": cases}, rows


# The dtype policy, where nothing needs a cast (float32 inputs on a device that holds
# every dtype): "device" resolves to no policy; a mapping looks at each argument's dtype.
_POLICIES: dict[str, Callable[[Fn], Fn]] = {
    'dtypes="device"': lambda fn: device_agnostic(device=CPU, dtypes="device")(fn),
    "dtypes={float64: float32}": lambda fn: device_agnostic(
        device=CPU, dtypes={torch.float64: torch.float32}
    )(fn),
}


def _dtype_policy(config: Config, tree: Tree) -> tuple[dict[str, Any], list[Row]]:
    """The decorated call with a dtype policy that casts nothing, against the same
    decorated call without one (target: 1.1x)."""
    body, _, call = _call_of(tree)
    subjects = {
        "@device_agnostic(device=d)": Subject(functools.partial(_decorated, call, _to_cpu, body))
    }
    for name, decorate in _POLICIES.items():
        subjects[name] = Subject(functools.partial(_decorated, call, decorate, body))
    leaves = list(tensors_in(tree.tree))
    if len(leaves) > 100:  # the floor of any check written in Python, on the same leaves
        subjects[_DTYPES_ALONE] = Subject(functools.partial(_same, _dtypes_read(leaves)))
        subjects[_DEVICE_READS] = Subject(functools.partial(_same, _reads(leaves, False)))
        subjects[_DTYPE_READS] = Subject(functools.partial(_same, _reads(leaves, True)))
    measured = measure_group(subjects, config)
    base = measured["@device_agnostic(device=d)"]
    rows = [
        judge(
            "1 decorator",
            f"{tree.label}, nothing to cast: @device_agnostic(device=d, {name})",
            measured[name].median_ns,
            times(measured, ["@device_agnostic(device=d)"]),
            base.median_ns,
            "@device_agnostic(device=d)",
            1.1,
            missing=_missing(measured[name], base),
        )
        for name in _POLICIES
    ]
    if _DTYPES_ALONE not in measured:  # a few leaves: the subject's own call would swamp it
        return {"label": tree.label, "subjects": as_json(measured)}, rows
    rows.append(
        judge(
            "1 decorator",
            f"{tree.label}, for information: reading each leaf's dtype alone (C's map, no "
            "Python loop), the least a mapping adds to the call",
            measured[_DTYPES_ALONE].median_ns,
            times(measured, ["@device_agnostic(device=d)"]),
            base.median_ns,
            "@device_agnostic(device=d)",
            None,
        )
    )
    if _DTYPE_READS in measured:
        rows.append(
            judge(
                "1 decorator",
                f"{tree.label}, for information: a Python loop checking each leaf's dtype "
                "beside its device",
                measured[_DTYPE_READS].median_ns,
                times(measured, [_DEVICE_READS]),
                measured[_DEVICE_READS].median_ns,
                _DEVICE_READS,
                None,
            )
        )
    return {"label": tree.label, "subjects": as_json(measured)}, rows


# What a mapping's check costs at the least: the same loop over the leaves, checking each
# one's device against the target, then also its dtype against the mapping's keys. Their
# ratio is the floor of the mapping's row on many leaves, for any walk written in Python.
_DEVICE_READS = "loop: device check"
_DTYPE_READS = "loop: device and dtype check"


# Less than any mapping can cost: every leaf's dtype read once, in C (map and a set's
# isdisjoint), with no check of its device and no walk of the structure. A mapping's row
# cannot be under 1 + this subject's ratio to the call without one.
_DTYPES_ALONE = "dtype reads alone"
_DTYPE = operator.attrgetter("dtype")


def _dtypes_read(leaves: list[torch.Tensor]) -> Callable[[], bool]:
    casts = frozenset({torch.float64})
    return lambda: casts.isdisjoint(map(_DTYPE, leaves))


def _reads(leaves: list[torch.Tensor], dtypes: bool) -> Callable[[], bool]:
    casts = frozenset({torch.float64})
    if dtypes:
        return lambda: any(t.device != CPU or t.dtype in casts for t in leaves)
    return lambda: any(t.device != CPU for t in leaves)


class _Mlp(torch.nn.Module):
    """Two linear layers: the model whose ``forward`` the forward row decorates."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


class _DecoratedMlp(_Mlp):
    @device_agnostic
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def _decorated_forward(config: Config) -> tuple[Section, Row]:
    """What ``@device_agnostic`` on ``forward`` adds to ``model(x)``: no target, for users.

    Beyond a function's cost, a method pays wrapt's binding on each ``model.forward`` and
    the check that the model's parameters are on one device (a walk over them).
    """
    plain, decorated, x = _Mlp(), _DecoratedMlp(), torch.randn(4, 16)
    decorated.load_state_dict(plain.state_dict())
    subjects = {
        "model(x)": Subject(functools.partial(bind, plain, x)),
        "decorated model(x)": Subject(functools.partial(bind, decorated, x)),
    }
    with torch.no_grad():
        measured = measure_group(subjects, config)
    added = _minus(measured["decorated model(x)"].median_ns, measured["model(x)"].median_ns)
    case = {"label": "2-layer MLP (16-16-16), 4x16 input", "subjects": as_json(measured),
            "added_ns": {"decorated model(x)": added}}  # fmt: skip
    row = judge(
        "1 decorator",
        "nn.Module forward decorated (2-layer MLP, 4 parameters), on target: time it adds",
        added,
        f"model(x) {fmt_ns(measured['model(x)'].median_ns)}",
        measured["model(x)"].median_ns,
        "model(x)",
        None,
        missing=_missing(measured["decorated model(x)"], measured["model(x)"]),
    )
    return case, row


def section_move(
    config: Config, trees: list[Tree], small: Tree, large: Tree
) -> tuple[Section, list[Row]]:
    """(2) a real move from cpu to meta: time, copies made, linearity in the leaves.

    ``small`` and ``large`` are two of ``trees`` of the same shape, for the linearity row.
    """
    cases: Section = {}
    rows: list[Row] = []
    measured_at: dict[str, dict[str, Measurement]] = {}
    for tree in trees:
        subjects = {name: Subject(make) for name, make in movers(tree.tree, META).items()}
        measured = measure_group(subjects, config)
        measured_at[tree.key] = measured
        copies: dict[str, int | None] = {}
        for name, subject in subjects.items():
            copies[name] = None
            if measured[name].ok:
                copies[name] = count_copies(tree.tree, subject.make()())
        cases[tree.key] = {
            "label": tree.label,
            "leaves": tree.leaves,
            "distinct_tensors": len({id(t) for t in tensors_in(tree.tree)}),
            "subjects": as_json(measured),
            "copies": copies,
        }
        peer_text = "; ".join(
            f"{name} {fmt_ns(measured[name].median_ns)} ({_copies(copies[name])})"
            if measured[name].ok
            else f"{name} {measured[name].status}"
            for name in PEERS
        )
        ours = _missing(measured["to_device"])
        if measured["to_device"].ok:
            ours = f"{fmt_ns(measured['to_device'].median_ns)} ({_copies(copies['to_device'])})"
        rows.append(
            judge(
                "2 move",
                f"{tree.label}, cpu->meta: to_device",
                measured["to_device"].median_ns,
                peer_text,
                measured["optree.tree_map"].median_ns,
                "optree.tree_map",
                1.0 if tree is large else None,
                ours_text=ours,
                missing=_missing(measured["to_device"]),
            )
        )
        if tree.key.startswith("aliased"):
            made = copies["to_device"]
            rows.append(
                Row(
                    "2 move",
                    f"{tree.label}, cpu->meta: copies made",
                    ours if made is None else _copies(made),
                    peer_text,
                    "",
                    "1 copy",
                    ours if made is None else ("yes" if made == 1 else "no"),
                )
            )
    per_leaf = {}
    for name in ("to_device", *PEERS):
        a, b = (measured_at[tree.key][name].median_ns for tree in (small, large))
        per_leaf[name] = None if a is None or b is None else (b / large.leaves) / (a / small.leaves)
    rows.append(
        judge(
            "2 move",
            f"linearity: per-leaf time at {large.leaves:,} / at {small.leaves:,} leaves",
            per_leaf["to_device"],
            "; ".join(f"{n} {_x(per_leaf[n])}" for n in PEERS),
            1.0,
            "",
            1.25,
            ours_text=None if per_leaf["to_device"] is None else _x(per_leaf["to_device"]),
            tolerance=0.0,
            missing=_missing(*(measured_at[t.key]["to_device"] for t in (small, large))),
        )
    )
    case, encoding_row = _batch_encoding(config)
    if case is not None:
        cases["batch_encoding"] = case
    rows.append(encoding_row)
    cases["token_ids"], ids_row = _token_ids(config, trees[3].leaves * 10)
    rows.append(ids_row)
    return {"device": str(META), "cases": cases, "per_leaf_growth": per_leaf}, rows


def _token_ids(config: Config, n: int) -> tuple[Section, Row]:
    """A batch that also holds a long Python list (the samples' token ids, or their file
    names), cpu->meta: ``to_device`` beside the peers that pass non-tensors by (optree and
    TensorDict take no such tree: optree maps every int too)."""
    batch = {"input_ids": torch.randint(0, 30_000, (8, 128)), "ids": list(range(n))}
    subjects = {
        name: Subject(make)
        for name, make in movers(batch, META).items()
        if name in ("to_device", "send_to_device", "apply_to_collection")
    }
    measured = measure_group(subjects, config)
    peers = [measured[name] for name in ("send_to_device", "apply_to_collection")]
    peer_text = "; ".join(
        f"{name} {fmt_ns(m.median_ns)}" if m.ok else f"{name} {m.status}"
        for name, m in zip(("send_to_device", "apply_to_collection"), peers, strict=True)
    )
    return {"ints": n, "subjects": as_json(measured)}, judge(
        "2 move",
        f"1 tensor and a list of {n:,} ints, cpu->meta: to_device",
        measured["to_device"].median_ns,
        peer_text,
        peers[0].median_ns,
        "send_to_device",
        0.25,
        missing=_missing(measured["to_device"]),
    )


def _batch_encoding(config: Config) -> tuple[Section | None, Row]:
    """A tokenizer's batch (transformers' ``BatchEncoding``: a ``UserDict`` with its own
    ``.to``), cpu->meta: ``to_device`` beside ``send_to_device``, which only calls that
    ``.to``. Each call moves a new ``BatchEncoding`` of the same tensors: its ``.to``
    moves in place, and a second call would find nothing left to move."""
    what = "BatchEncoding (3 tensors), cpu->meta: to_device"
    try:
        from transformers import BatchEncoding
    except ImportError:
        return None, judge("2 move", what, None, "transformers not installed", None, "", None)
    data = {
        "input_ids": torch.randint(0, 30_000, (8, 128)),
        "token_type_ids": torch.zeros(8, 128, dtype=torch.long),
        "attention_mask": torch.ones(8, 128, dtype=torch.long),
    }

    def accelerate() -> Callable[[], Any]:
        send_to_device = load("accelerate.utils", "send_to_device")
        return lambda: send_to_device(BatchEncoding(data), META)

    subjects = {
        "to_device": Subject(lambda: lambda: to_device(BatchEncoding(data), META)),
        "send_to_device": Subject(accelerate),
    }
    measured = measure_group(subjects, config)
    peer = measured["send_to_device"]
    return {"subjects": as_json(measured)}, judge(
        "2 move",
        what,
        measured["to_device"].median_ns,
        f"send_to_device {fmt_ns(peer.median_ns)}" if peer.ok else f"send_to_device {peer.status}",
        peer.median_ns,
        "send_to_device",
        None,
        missing=_missing(measured["to_device"]),
    )


def section_find(config: Config, trees: list[Tree]) -> tuple[Section, list[Row]]:
    """(2) ``find_devices`` beside ``optree.tree_flatten`` (and its with-path variant)."""
    cases: Section = {}
    rows: list[Row] = []
    for tree in trees:
        subjects = {
            "find_devices": Subject(functools.partial(bind, find_devices, tree.tree)),
            "optree.tree_flatten": Subject(
                functools.partial(_bind_peer, "optree", "tree_flatten", tree.tree)
            ),
            "optree.tree_flatten_with_path": Subject(
                functools.partial(_bind_peer, "optree", "tree_flatten_with_path", tree.tree)
            ),
        }
        measured = measure_group(subjects, config)
        cases[tree.key] = {"label": tree.label, "subjects": as_json(measured)}
        rows.append(
            judge(
                "2 find",
                f"{tree.label}: find_devices",
                measured["find_devices"].median_ns,
                times(measured, [n for n in subjects if n != "find_devices"]),
                measured["optree.tree_flatten"].median_ns,
                "optree.tree_flatten",
                1.0,
                missing=_missing(measured["find_devices"]),
            )
        )
    return {"cases": cases}, rows


# The bare call timed a second time, as a subject of its own: how far apart two timings of
# the same thing land in this run, beside rows whose targets are a few percent.
NOISE = "no scope, again"


def section_scope(config: Config) -> tuple[Section, list[Row]]:
    """(3) the cost of a torch call with no scope, inside torch's scope and inside ours."""
    cases: Section = {}
    rows: list[Row] = []
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    linear, x = torch.nn.Linear(16, 16), torch.randn(4, 16)
    ops: dict[str, Callable[[], object]] = {
        "a + b (8x8)": lambda: a + b,
        "torch.zeros(8, 8)": lambda: torch.zeros(8, 8),
        "nn.Linear(16, 16) forward": lambda: linear(x),
    }
    existing = {"a + b (8x8)", "nn.Linear(16, 16) forward"}  # ops on existing tensors
    for op, fn in ops.items():
        same = functools.partial(_same, fn)
        subjects = {
            "no scope": Subject(same),
            NOISE: Subject(same),
            "torch.device(meta)": Subject(same, lambda: torch.device(META)),
            "on_device(meta)": Subject(same, lambda: on_device(META)),
            "torch.device(cpu)": Subject(same, lambda: torch.device(CPU)),
            "on_device(cpu)": Subject(same, lambda: on_device(CPU)),
        }
        with torch.no_grad():
            measured = measure_group(subjects, config)
        cases[op] = {"subjects": as_json(measured)}
        m = {name: measured[name].median_ns for name in subjects}
        peers = "; ".join(
            f"{name} {fmt_ns(m[name])}" for name in subjects if "on_device" not in name
        )
        # Ops on existing tensors should not notice the scope; constructors pay for it,
        # no more than inside torch's own.
        against = "no scope" if op in existing else "torch.device(meta)"
        rows.append(
            judge("3 scope", f"{op} inside on_device(meta)", m["on_device(meta)"], peers,
                  m[against], against, 1.05 if op in existing else 1.0,
                  missing=_missing(measured["on_device(meta)"]))
        )  # fmt: skip
        rows.append(
            judge("3 scope", f"{op} inside on_device(cpu), cpu default", m["on_device(cpu)"],
                  peers, m["no scope"], "no scope", 1.0, target_text="~1.0x",
                  missing=_missing(measured["on_device(cpu)"]))
        )  # fmt: skip
    case, bert_rows = _scoped_bert(config)
    cases["BERT forward"] = case
    rows.extend(bert_rows)
    for device in off_default_devices():  # a block entered and left per call
        cases[f"block entry ({device})"], entry_rows = entry(config, device)
        rows.extend(entry_rows)
    found = accelerator()
    if found is not None:
        case, bert_rows = _accelerator_bert(config, found)
        cases["BERT forward on the accelerator"] = case
        rows.extend(bert_rows)
    return {"default_device": str(torch.get_default_device()), "cases": cases}, rows


def _scoped_bert(config: Config) -> tuple[Section, list[Row]]:
    """A transformers BERT forward on the CPU inside scopes: what a GPU forward pays.

    Inside ``on_device("meta")`` the scope is active and its target is not where the model
    runs, as with a CUDA model under a CPU default; the decorated forward then scopes its
    body to the model's device (cpu), a second scope.
    """
    from transformers import BertConfig, BertModel

    bert_config = BertConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                             intermediate_size=64, vocab_size=1000)  # fmt: skip
    torch.manual_seed(0)
    plain = BertModel(bert_config).eval()
    decorated = _decorated_bert(BertModel, bert_config, scope=True)
    unscoped = _decorated_bert(BertModel, bert_config, scope=False)
    ids = torch.randint(0, 1000, (2, 8))
    subjects = {
        "no scope": Subject(functools.partial(bind, plain, ids)),
        NOISE: Subject(functools.partial(bind, plain, ids)),
        "torch.device(meta)": Subject(
            functools.partial(bind, plain, ids), lambda: torch.device(META)
        ),
        "on_device(meta)": Subject(functools.partial(bind, plain, ids), lambda: on_device(META)),
        "decorated, in on_device(meta)": Subject(
            functools.partial(bind, decorated, ids), lambda: on_device(META)
        ),
        "decorated(scope=False)": Subject(functools.partial(bind, unscoped, ids)),
        "torch.device(meta) per call": Subject(
            functools.partial(bind, in_block, lambda: torch.device(META), plain, ids)
        ),
        "on_device(meta) per call": Subject(
            functools.partial(bind, in_block, lambda: on_device(META), plain, ids)
        ),
    }
    with torch.no_grad():
        measured = measure_group(subjects, config)
    m = {name: measured[name].median_ns for name in subjects}
    label = "BERT forward (transformers, 4 layers, hidden 32, batch 2x8)"
    peers = f"no scope {fmt_ns(m['no scope'])}; {NOISE} {fmt_ns(m[NOISE])}; "
    peers += f"torch.device(meta) {fmt_ns(m['torch.device(meta)'])}"
    rows = [
        judge("3 scope", f"{label} inside on_device(meta)", m["on_device(meta)"], peers,
              m["no scope"], "no scope", 1.05, missing=_missing(measured["on_device(meta)"])),
        judge("3 scope", f"{label}, @device_agnostic, called inside on_device(meta)",
              m["decorated, in on_device(meta)"], peers, m["no scope"], "no scope", 1.05,
              missing=_missing(measured["decorated, in on_device(meta)"])),
        judge("3 scope", f"{label}, @device_agnostic(scope=False), no scope",
              m["decorated(scope=False)"], peers, m["no scope"], "no scope", 1.02,
              missing=_missing(measured["decorated(scope=False)"])),
        judge("3 scope", f"{label}, on_device(meta) entered per call",
              m["on_device(meta) per call"],
              peers + f"; torch.device(meta) per call {fmt_ns(m['torch.device(meta) per call'])}",
              m["no scope"], "no scope", 1.05,
              missing=_missing(measured["on_device(meta) per call"])),
    ]  # fmt: skip
    return {"label": label, "subjects": as_json(measured)}, rows


def _accelerator_bert(config: Config, device: torch.device) -> tuple[Section, list[Row]]:
    """A BERT forward on the accelerator, the CPU torch's default (the
    usual case), each call waited for: plain, inside torch's scope and ours, decorated."""
    from transformers import BertConfig, BertModel

    bert_config = BertConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=2,
                             intermediate_size=512, vocab_size=1000)  # fmt: skip
    torch.manual_seed(0)
    plain = BertModel(bert_config).eval().to(device)
    decorated = _decorated_bert(BertModel, bert_config, scope=True).to(device)
    unscoped = _decorated_bert(BertModel, bert_config, scope=False).to(device)
    ids = torch.randint(0, 1000, (8, 64), device=device)
    subjects = {
        "no scope": Subject(functools.partial(_waited, plain, ids)),
        f"torch.device({device})": Subject(
            functools.partial(_waited, plain, ids), lambda: torch.device(device)
        ),
        f"on_device({device})": Subject(
            functools.partial(_waited, plain, ids), lambda: on_device(device)
        ),
        "@device_agnostic": Subject(functools.partial(_waited, decorated, ids)),
        "@device_agnostic(scope=False)": Subject(functools.partial(_waited, unscoped, ids)),
    }
    with torch.no_grad():
        measured = measure_group(subjects, config)
    m = {name: measured[name].median_ns for name in subjects}
    label = f"BERT forward on {device} (4 layers, hidden 128, batch 8x64), cpu default"
    peers = f"no scope {fmt_ns(m['no scope'])}; "
    peers += f"torch.device({device}) {fmt_ns(m[f'torch.device({device})'])}"
    rows = [
        judge("3 scope", f"{label}, inside on_device({device})", m[f"on_device({device})"],
              peers, m["no scope"], "no scope", 1.05,
              missing=_missing(measured[f"on_device({device})"])),
        judge("3 scope", f"{label}, @device_agnostic", m["@device_agnostic"], peers,
              m["no scope"], "no scope", 1.05, missing=_missing(measured["@device_agnostic"])),
        judge("3 scope", f"{label}, @device_agnostic(scope=False)",
              m["@device_agnostic(scope=False)"], peers, m["no scope"], "no scope", 1.02,
              missing=_missing(measured["@device_agnostic(scope=False)"])),
    ]  # fmt: skip
    return {"label": label, "device": str(device), "subjects": as_json(measured)}, rows


def _waited(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], Any]:
    """A call of ``model(ids)`` that returns once the accelerator has run it."""

    def call() -> Any:
        out = model(ids)
        torch.accelerator.synchronize()
        return out

    return call


def _decorated_bert(base: type[torch.nn.Module], config: Any, *, scope: bool) -> torch.nn.Module:
    """``base(config)`` whose ``forward`` is decorated, with the same weights as a seed-0 one."""
    forward = device_agnostic(scope=scope)(base.forward)
    decorated_class = type(f"Decorated{base.__name__}", (base,), {"forward": forward})
    torch.manual_seed(0)
    model: torch.nn.Module = decorated_class(config).eval()
    return model


def _bind_peer(module: str, name: str, *args: Any) -> Callable[[], Any]:
    return bind(load(module, name), *args)


def _same(fn: Callable[[], object]) -> Callable[[], object]:
    return fn


def _decorated(
    call: Callable[[Fn], Callable[[], Any]], decorate: Callable[[Fn], Fn], body: Fn
) -> Callable[[], Any]:
    return call(decorate(body))


def _missing(*measured: Measurement) -> str:
    """Why a figure made from these measurements is missing: "error" wins over the rest."""
    statuses = {m.status for m in measured if not m.ok}
    return "error" if "error" in statuses else "not available"


def _copies(count: int | None) -> str:
    return "1 copy" if count == 1 else f"{count} copies"


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _x(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def _environment(args: argparse.Namespace, config: Config) -> dict[str, Any]:
    versions: dict[str, str | None] = {}
    for package in ("devicectx", "accelerate", "lightning-utilities", "optree", "tensordict"):
        try:
            from importlib.metadata import version

            versions[package] = version(package)
        except Exception:
            versions[package] = None
    return {
        "command": " ".join(["python", "benchmarks/bench.py", *sys.argv[1:]]),
        "mode": "quick" if args.quick else "full",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "packages": versions,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "min_time_s": config.min_time,
        "trials": config.trials,
        "tolerance": TOLERANCE,
    }


_SECTIONS = (
    "decorator", "move", "find_devices", "scope", "import", "transfer", "diagnostics", "prefetch"
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run every section, print the markdown report, write the JSON; return 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke mode: tiny trees, few loops")
    parser.add_argument("--json", type=Path, help="where to write the figures (JSON)")
    parser.add_argument("--markdown", type=Path, help="also write the markdown report here")
    parser.add_argument("--nominal-gbps", type=float, help="the accelerator's host link, GB/s")
    parser.add_argument(
        "--only", action="append", choices=_SECTIONS, help="run this section only (repeatable)"
    )
    parser.add_argument(
        "--trials", type=int, help="timed loops per subject (default 25, 3 with --quick)"
    )
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parent
    json_path = args.json or here / ("results-quick.json" if args.quick else "results.json")
    # One intra-op thread: these inputs are far below torch's parallel grain size anyway,
    # and a second thread on a small shared machine only adds noise.
    torch.set_num_threads(1)
    emulated = emulated_copies_undelayed()
    config = Config(min_time=0.002, trials=3) if args.quick else Config(min_time=0.02, trials=25)
    if args.trials is not None:
        config = Config(min_time=config.min_time, trials=max(1, args.trials))
    small, large = (100, 1_000) if args.quick else (1_000, 10_000)
    trees = [flat3(), nested(), many_leaves(small), many_leaves(large)]
    sections: Section = {}
    rows: list[Row] = []
    steps: list[tuple[str, Callable[[], tuple[Section, list[Row]]]]] = [
        ("decorator", lambda: section_decorator(config, trees)),
        ("move", lambda: section_move(config, [*trees, aliased(10)], trees[2], trees[3])),
        ("find_devices", lambda: section_find(config, trees)),
        ("scope", lambda: section_scope(config)),
        ("import", lambda: section_import(args.quick)),
        ("transfer", lambda: section_transfer(config, args.quick, args.nominal_gbps)),
        ("diagnostics", lambda: section_diagnostics(config)),
        ("prefetch", lambda: section_prefetch(config, args.quick)),
    ]
    for name, run in steps:
        if args.only and name not in args.only:
            continue
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        sections[name], new_rows = run()
        print(f"measured {name} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        rows.extend(new_rows)
    environment = {**_environment(args, config), "emulated_accelerator": emulated}
    report = {"environment": environment, "rows": rows_from(rows), **sections}
    markdown = render(report)
    print(markdown)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
