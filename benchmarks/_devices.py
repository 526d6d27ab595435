"""The accelerator the benchmark times: the machine's, or the testing kit's emulated one."""

from __future__ import annotations

import warnings

import torch
from _trees import load


def accelerator() -> torch.device | None:
    """``torch.accelerator``'s device at its current index; None without one."""
    if not torch.accelerator.is_available():
        return None
    kind = torch.accelerator.current_accelerator()
    assert kind is not None
    return torch.device(kind.type, torch.accelerator.current_device_index())


def script_accelerator() -> torch.device | None:
    """The set-up of a standalone script that moves the same batches over and over: the
    accelerator (None, said on stdout, where there is none), emulated copies undelayed, and
    the repeated-move warning off (the repeats are on purpose)."""
    device = accelerator()
    if device is None:
        print("no accelerator: run it under python -m devicectx.testing.emulate")
        return None
    emulated_copies_undelayed()
    load("devicectx", "set_repeated_move_warning")(False)
    warnings.simplefilter("ignore")
    return device


def emulated_copies_undelayed() -> bool:
    """Whether the accelerator is the testing kit's emulated one (under ``python -m
    devicectx.testing.emulate``, or enabled by a section); if so, its non_blocking copies
    are made undelayed.

    Each such copy waits 2 ms on purpose, to show ordering bugs in tests: a batch of 10,000
    pinned leaves would take 20 s a move. The emulated figures show the shape of the work
    (what overlaps, what a declined staging costs beside the copies), not a device's speed.
    """
    device = accelerator()
    if device is None or device.type != "emu":
        return False
    configure = load("devicectx.testing.emulated", "configure")
    configure(delay_ms=0)
    return True
