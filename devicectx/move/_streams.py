"""The copy stream of each accelerator device: where devicectx queues the copies that need not
wait for the work already queued on the caller's stream.

One stream per device, made at first use and shared by every move to that device and every
:func:`devicectx.prefetch` (copies from the host go through one copy engine anyway), from
every thread: a stream takes work from any thread, and the *current* stream is per thread.

:func:`copy_stream` is the stream (None where the device has no streams, no events, or no
``Tensor.record_stream``: moves there stay on the caller's stream, in order);
:func:`queued_on` makes it the current stream of its device for a block, so that the move
engine, which queues its copies and allocates its results on the current stream, does both
there; the caller then makes its own stream wait on an event recorded after the block.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["copy_stream", "forget", "queued_on"]

_STREAMS: dict[torch.device, Any] = {}  # device (with its index) -> stream, or None: none
_LOCK = threading.Lock()


def copy_stream(device: torch.device) -> Any:
    """The copy stream of accelerator ``device`` (an indexed device: ``cuda:0``); None where
    the device has no streams, no events to hand work over with, or no ``record_stream``
    (without it, memory allocated on the copy stream and used on another could be reused
    while that stream still reads it)."""
    try:
        return _STREAMS[device]
    except KeyError:
        pass
    if device.index is None:  # the current device of its type, as torch reads it
        device = torch.device(device.type, torch.accelerator.current_device_index())
    with _LOCK:
        if device not in _STREAMS:
            try:
                stream = torch.Stream(device=device)
                stream.record_event()  # events work on this device too
                torch.empty(1, device=device).record_stream(stream)  # and record_stream
            except Exception:  # a backend without streams or events
                stream = None
            _STREAMS[device] = stream
        return _STREAMS[device]


@contextlib.contextmanager
def queued_on(stream: Any, device: torch.device) -> Iterator[Any]:
    """``stream`` made the current stream of its device (``device``) for the block; yields
    the stream that was current, which is current again after it, as is the device that was
    current (``torch.accelerator.set_stream`` changes both)."""
    previous = torch.accelerator.current_stream(device)
    index_before = torch.accelerator.current_device_index()
    torch.accelerator.set_stream(stream)
    try:
        yield previous
    finally:
        torch.accelerator.set_stream(previous)
        torch.accelerator.set_device_index(index_before)


def forget() -> None:
    """Ask each device again for its copy stream: what a device can do has changed (the
    testing kit's emulated device plays another device). Streams handed out stay valid."""
    with _LOCK:
        _STREAMS.clear()


def _forget_in_child() -> None:
    # A forked child cannot use its parent's streams: it makes its own, when it needs them.
    global _LOCK
    _LOCK = threading.Lock()
    _STREAMS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
