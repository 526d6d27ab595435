"""Section 7: a training loop's time per step with batches moved ahead by ``prefetch``.

The loop: a ``DataLoader`` (``pin_memory=False``, no workers, ``batch_size=None``) over a
dataset whose every item is the transfer section's detection batch (pageable memory), and a
step that reads the batch and then computes for about as long as one batch's copy takes in
that loop (square matmuls on the batch's device, their count calibrated against the loop of
copies alone: an isolated copy, waited for, is not what a loop of them costs per batch).
Per step, each subject timing whole epochs:

- ``compute only``: the step on a batch moved once, before the loop;
- ``copy only``: ``to_device`` of each batch, no step;
- the bound: ``max(compute only, copy only)``, what perfect overlap gives;
- ``to_device in the step``, ``send_to_device in the step``: the move when the step asks;
- ``to_device in the step, caller's stream``, on a GPU (not the emulated accelerator): the
  same with ``STATE.copy_stream`` off (``devicectx.move._staging._state``), the staged
  copies queued on the caller's stream instead of the device's copy stream (shown beside
  the others, with no target of its own; ``benchmarks/copy_stream.py`` times the two alone);
- ``prefetch``: ``for batch in prefetch(loader, device)`` (depth 2), made once;
- with the pinned batch, ``prefetch`` as it treats a ``DataLoader(pin_memory=True)`` with
  workers, whose pin-memory thread pins each batch on the host: its copies do not wait
  for the step's stream (the loop's own loader pins nothing, so a pinned batch from it may
  be a device copy's destination, and its copies wait for the steps queued before);
- ``CudaDataPrefetcher``: torchtnt's, where it is installed and the device is CUDA.

Every epoch ends with ``torch.accelerator.synchronize()`` on an accelerator, so it is timed
until its work has run. Then what ``@device_agnostic(device=d)`` on the step adds when the
batch it is given is already on ``d`` (a prefetched batch): the decorated call minus the
plain one, with the decorator's scope and with ``scope=False`` (the check alone).

Devices: the CPU (nothing to copy: what the iterator itself costs) and ``meta`` (a real move
on the host, no streams), always; the accelerator where there is one, else the testing
kit's emulated accelerator where it builds (its figures show overlap, not speed; its
copies are made undelayed). On the host, "one batch's copy" is the host's share of a move
(``to_device`` to ``meta``), so that what the iterator costs per step shows.

On an accelerator the loop runs twice: with the pageable batch (what a ``DataLoader``
without ``pin_memory`` gives), and
with the batch in pinned memory (what a ``DataLoader(pin_memory=True)`` with workers hands
over, pinned in its own thread). They are two regimes. From pageable memory the host must
copy every byte into pinned memory first, in the loop's thread: where that host copy takes
longer than the step's device work, the loop is bound by the host, and moving in the step
already overlaps it with the device work queued before (kernels are queued, not waited
for), so no device stream can make the loop faster than the host copy. From pinned memory
the host does little; moving in the step queues each copy on the stream that computes, after
the step before it, while ``prefetch`` copies on a stream of its own, beside the compute.

Epochs are 32 steps on a real accelerator (8 elsewhere, 3 in quick mode): each epoch ends
with a wait for the device, and a lookahead pays its fill (``depth`` copies before the first
step) and drain once per epoch, as training does once per epoch of hundreds of steps.

Targets: on a GPU, ``prefetch`` <= 1.15x the bound, and <= 0.8x ``to_device`` in the step
with the pageable batch, <= 0.6x with the pinned one; elsewhere, ``prefetch`` no slower than
``to_device`` in the step. Each row also prints the bound as a fraction of moving in the
step: no lookahead does better than that, so an in-step target below it waits for a
faster copy (or compute), not for a better prefetcher.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _devices import accelerator, emulated_copies_undelayed
from _report import Row, judge
from _timing import Config, Measurement, Subject, as_json, fmt_ns, measure_group
from _transfer import _pinned, _threads
from _transfer import batches as transfer_batches
from _trees import Tree, load
from torch.utils.data import DataLoader, Dataset

from devicectx import device_agnostic, prefetch, set_repeated_move_warning, to_device
from devicectx.move._staging._state import STATE, swapped

CPU = torch.device("cpu")
META = torch.device("meta")
SECTION = "7 prefetch"
PREFETCH = "prefetch"
# The pinned batch as a DataLoader(pin_memory=True) with workers hands it over: pinned by
# its pin-memory thread on the host, so that its copies need not wait for the step's
# stream (prefetch tells such a loader apart; the loop's loader, pinning nothing itself,
# it cannot).
PIN_THREAD = "prefetch, batches as a pin-memory thread's"
IN_STEP = "to_device in the step"
CALLERS_STREAM = "to_device in the step, caller's stream"
DECORATED = "@device_agnostic(device=d)"
UNSCOPED = "@device_agnostic(device=d, scope=False)"
SUBJECTS = (
    "compute only",
    "copy only",
    IN_STEP,
    CALLERS_STREAM,
    "send_to_device in the step",
    PREFETCH,
    PIN_THREAD,
    "CudaDataPrefetcher",
)


def section_prefetch(config: Config, quick: bool) -> tuple[dict[str, Any], list[Row]]:
    """(7) the loop above on the CPU, meta, and an accelerator (real or emulated)."""
    tree = transfer_batches(quick)[0]
    devices: list[tuple[torch.device, str]] = [(CPU, "cpu"), (META, "meta")]
    found = accelerator()
    skipped = {}
    if found is not None:
        # Under `python -m devicectx.testing.emulate`, the accelerator is the emulated one:
        # its rows are judged as such, not against a GPU's targets.
        devices.append((found, "emulated" if found.type == "emu" else "accelerator"))
    else:
        emulated = _emulated()
        if isinstance(emulated, torch.device):
            devices.append((emulated, "emulated"))
        else:
            skipped["emulated"] = emulated
    cases: dict[str, Any] = {}
    rows: list[Row] = []
    previous = set_repeated_move_warning(False)  # the same batch every step, on purpose
    try:
        for device, kind in devices:
            on_host = kind in ("cpu", "meta")
            steps = 3 if quick else 32 if kind == "accelerator" else 8
            for pinned in (False,) if on_host else (False, True):
                with contextlib.nullcontext() if on_host else _threads():
                    case, case_rows = _case(config, tree, device, kind, steps, pinned)
                cases[f"{kind}: {device}{' (pinned)' if pinned else ''}"] = case
                rows.extend(case_rows)
    finally:
        set_repeated_move_warning(previous)
    return {"cases": cases, "skipped": skipped}, rows


def _emulated() -> torch.device | str:
    """The emulated accelerator's first device, or why there is none."""
    try:
        emulated = load("devicectx.testing.emulated", "enable")
    except ImportError as error:
        return f"not available: {error}"
    try:
        emulated()
    except Exception as error:  # no compiler, no headers: the kit says why
        return f"not available: {type(error).__name__}: {error}"
    emulated_copies_undelayed()
    device = accelerator()
    return device if device is not None else "not available: enable() gave none"


class _Repeated(Dataset[Any]):
    """``steps`` items, each the same batch (a loader hands out the same tensors)."""

    def __init__(self, batch: Any, steps: int) -> None:
        self.batch = batch
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, index: int) -> Any:
        return self.batch


def _case(
    config: Config, tree: Tree, device: torch.device, kind: str, steps: int, pinned: bool
) -> tuple[dict[str, Any], list[Row]]:
    on_accelerator = kind in ("accelerator", "emulated")
    sync = torch.accelerator.synchronize if on_accelerator else _nothing
    batch = _pinned(tree.tree) if pinned else tree.tree
    loader = DataLoader(_Repeated(batch, steps), batch_size=None, pin_memory=False)
    copy_ns = _copy_ns(loader, device, on_accelerator, sync)
    step, repeats = _calibrated_step(device if on_accelerator else CPU, copy_ns, sync)
    resident = to_device(batch, device)
    prefetched = prefetch(loader, device, depth=2)
    pin_thread = _as_pinned_by_a_thread(loader, device) if pinned and prefetched.streams else None
    epochs: dict[str, Callable[[], Callable[[], Any]]] = {
        "compute only": lambda: _epoch(loader, lambda b: step(resident), sync),
        "copy only": lambda: _epoch(loader, lambda b: _moved(b, device), sync),
        IN_STEP: lambda: _epoch(loader, lambda b: step(_moved(b, device)), sync),
        "send_to_device in the step": lambda: _send_to_device(loader, device, step, sync),
        PREFETCH: lambda: _epoch(prefetched, step, sync),
        PIN_THREAD: lambda: _epoch(pin_thread, step, sync),
        "CudaDataPrefetcher": lambda: _torchtnt(loader, device, step, sync),
    }
    subjects = {}
    for name, make in epochs.items():
        if name == PIN_THREAD and pin_thread is None:
            continue
        subjects[name] = Subject(make)
        if name == IN_STEP and kind == "accelerator":  # the emulated one: copy_stream.py
            subjects[CALLERS_STREAM] = Subject(make, functools.partial(copy_stream_set, False))
    measured = measure_group(subjects, config)
    per_step = {name: _per_step(m, steps) for name, m in measured.items()}
    added = _decorator_adds(config, resident, device)
    bound = None
    if per_step["compute only"] is not None and per_step["copy only"] is not None:
        bound = max(per_step["compute only"], per_step["copy only"])
    subjects_json = as_json(measured)
    for name, figures in subjects_json.items():
        figures["per_step_ns"] = per_step[name]
    label = f"{tree.label}{', pinned,' if pinned else ''} -> {device}"
    case = {
        "label": label,
        "kind": kind,
        "source": "pinned" if pinned else "pageable",
        "steps": steps,
        "copy_ns": copy_ns,
        "matmuls_per_step": repeats,
        "bound_ns": bound,
        "subjects": subjects_json,
        "added_ns": added,
        "prefetch_streams": prefetched.streams,
    }
    return case, _rows(label, kind, pinned, per_step, bound, added)


def _rows(
    label: str,
    kind: str,
    pinned: bool,
    per_step: dict[str, float | None],
    bound: float | None,
    added: dict[str, float | None],
) -> list[Row]:
    peers = "; ".join(
        f"{name} {fmt_ns(per_step[name]) if per_step[name] is not None else 'not available'}"
        for name in SUBJECTS
        if name != PREFETCH and name in per_step
    )
    peers += f"; bound {fmt_ns(bound)}"
    if bound is not None and per_step[IN_STEP]:
        # No lookahead beats the bound: a target below this ratio is out of reach until the
        # copy or the compute itself gets faster.
        peers += f" ({bound / per_step[IN_STEP]:.2f}x moving in the step)"
    gpu = kind == "accelerator"
    in_step_target = (0.6 if pinned else 0.8) if gpu else 1.0
    where = {"cpu": "CPU", "meta": "meta", "accelerator": "GPU", "emulated": "emulated"}[kind]
    rows = [
        judge(
            SECTION,
            f"{label} ({where}): per step, prefetch vs moving in the step",
            per_step[PREFETCH],
            peers,
            per_step[IN_STEP],
            IN_STEP,
            in_step_target,
            target_text=None if gpu else "no slower",
        ),
        judge(
            SECTION,
            f"{label} ({where}): per step, prefetch vs the bound max(compute, copy)",
            per_step[PREFETCH],
            peers,
            bound,
            "bound",
            1.15 if gpu else None,
        ),
    ]
    if per_step.get(PIN_THREAD) is not None:
        rows.append(
            judge(
                SECTION,
                f"{label} ({where}): per step, {PIN_THREAD} vs the bound max(compute, copy)",
                per_step[PIN_THREAD],
                f"prefetch {fmt_ns(per_step[PREFETCH])}; bound {fmt_ns(bound)}",
                bound,
                "bound",
                1.15 if gpu else None,
            )
        )
    rows.append(
        judge(
            SECTION,
            f"{label} ({where}): time {DECORATED} adds to the step, batch prefetched",
            added[DECORATED],
            f"with scope=False {fmt_ns(added[UNSCOPED])}; "
            f"per step with prefetch {fmt_ns(per_step[PREFETCH])}",
            per_step[PREFETCH],
            "per step",
            None,
        )
    )
    return rows


def _nothing() -> None:
    pass


@contextlib.contextmanager
def copy_stream_set(on: bool) -> Iterator[None]:
    """Staged copies behind queued work on the device's copy stream (``on``), or on the
    caller's stream, for the block."""
    with swapped(STATE.replace(copy_stream=on)):
        yield


def _moved(batch: Any, device: torch.device) -> Any:
    return to_device(batch, device, non_blocking=True)


def _epoch(batches: Any, step: Callable[[Any], Any], sync: Callable[[], None]) -> Callable[[], Any]:
    def run() -> None:
        for batch in batches:
            step(batch)
        sync()

    return run


def _as_pinned_by_a_thread(loader: Any, device: torch.device) -> Any:
    """``prefetch(loader, device)`` taking the pinned batches as a pin-memory thread's: the
    setting it makes for a ``DataLoader(pin_memory=True)`` with workers."""
    prefetched = prefetch(loader, device, depth=2)
    streams = prefetched._streams
    assert streams is not None
    streams.pinned_when_read = True
    return prefetched


def _send_to_device(
    loader: Any, device: torch.device, step: Callable[[Any], Any], sync: Callable[[], None]
) -> Callable[[], Any]:
    send = load("accelerate.utils", "send_to_device")
    return _epoch(loader, lambda b: step(send(b, device, non_blocking=True)), sync)


def _torchtnt(
    loader: Any, device: torch.device, step: Callable[[Any], Any], sync: Callable[[], None]
) -> Callable[[], Any]:
    if device.type != "cuda":
        raise NotImplementedError("CUDA only")
    prefetcher = load("torchtnt.utils.data", "CudaDataPrefetcher")(loader, device, 2)
    return _epoch(prefetcher, step, sync)


def _per_step(measured: Measurement, steps: int) -> float | None:
    return None if measured.median_ns is None else measured.median_ns / steps


def _copy_ns(loader: Any, device: torch.device, on_accelerator: bool, sync: Any) -> float:
    """How long one batch's copy takes, per batch of a loop over ``loader`` that only
    copies (an epoch, then a wait for the device): to the accelerator; on the host, the
    host's share of a move (``to_device`` to ``meta``: the walk and a tensor per leaf)."""
    target = device if on_accelerator else META
    copies = _epoch(loader, lambda batch: _moved(batch, target), sync)
    return _median_ns(copies) / len(loader)


def _calibrated_step(
    device: torch.device, copy_ns: float, sync: Callable[[], None]
) -> tuple[Callable[[Any], Any], int]:
    """A step that reads the batch (a little of it: on the host, reading all of it would
    cost more than the move), then computes for about ``copy_ns`` on ``device``; and how
    many matmuls that takes."""
    side = 1024 if device.type == "cuda" else 128
    a = torch.randn(side, side, device=device)
    out = torch.empty_like(a)

    def one() -> None:
        torch.mm(a, a, out=out)
        sync()

    repeats = max(1, round(copy_ns / _median_ns(one)))

    def step(batch: Any) -> Any:
        seen = batch["images"].flatten()[:4096].sum()  # waits for the copy, reads little
        for _ in range(repeats):
            torch.mm(a, a, out=out)
        return seen

    return step, repeats


def _median_ns(fn: Callable[[], None], runs: int = 7) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return float(statistics.median(times))


def _decorator_adds(config: Config, batch: Any, device: torch.device) -> dict[str, float | None]:
    """What ``@device_agnostic(device=d)`` adds to a step given a batch already on ``d``:
    with its scope (an ``on_device(d)`` block around the body, when ``d`` is not the
    default device), and with ``scope=False`` (the check alone)."""

    def plain(batch: Any) -> Any:
        return batch

    decorated = {
        DECORATED: device_agnostic(device=device)(plain),
        UNSCOPED: device_agnostic(device=device, scope=False)(plain),
    }
    subjects = {"plain": Subject(functools.partial(_bound, plain, batch))}
    for name, fn in decorated.items():
        subjects[name] = Subject(functools.partial(_bound, fn, batch))
    measured = measure_group(subjects, config)
    base = measured["plain"].median_ns
    return {
        name: None if base is None or measured[name].median_ns is None
        else measured[name].median_ns - base  # type: ignore[operator]
        for name in decorated
    }  # fmt: skip


def _bound(fn: Callable[[Any], Any], batch: Any) -> Callable[[], Any]:
    return lambda: fn(batch)
