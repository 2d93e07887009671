"""Streams and events of `torch.npu`, with torch.cuda's API.

Kernels run synchronously on the host in program order, so every stream is always idle: waits and
synchronisations return at once, and an event holds the host time at which it was recorded
(`elapsed_time` measures the host work between two events, in milliseconds).
"""

from __future__ import annotations

from typing import Any

import torch

from .device import _checked_index, _get_device_index

__all__ = ["Event", "ExternalStream", "Stream", "StreamContext", "current_stream",
           "default_stream", "set_stream", "stream"]


class Stream(torch.Stream):
    """An npu stream: `Stream(device=None, priority=0)`."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs):
        if kwargs:  # (stream_id=, device_index=, device_type=): wraps an existing stream
            return super().__new__(cls, **kwargs)
        index = _checked_index(device)
        return super().__new__(cls, device=torch.device("npu", index), priority=priority)

    def wait_event(self, event: "Event") -> None:
        event.wait(self)

    def wait_stream(self, stream: "Stream") -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: "Event | None" = None) -> "Event":
        if event is None:
            event = Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        from .graphs import _capturing, _check_not_capturing

        graph = _capturing
        if graph is not None and (self.stream_id, self.device_index) == (
                graph._stream.stream_id, graph._stream.device_index):
            _check_not_capturing("Stream.synchronize() on the capturing stream")

    @property
    def npu_stream(self) -> int:
        return self.stream_id

    def __repr__(self) -> str:
        return f"<torch_npu.npu.Stream device=npu:{self.device_index} npu_stream={self.stream_id}>"


class ExternalStream(Stream):
    """A stream created elsewhere, identified by `stream_ptr` (kept as the stream's id)."""

    def __new__(cls, stream_ptr: int, device: Any = None, **kwargs):
        index = _checked_index(device)
        return super().__new__(cls, stream_id=int(stream_ptr), device_index=index,
                               device_type=_npu_device_type())


class Event(torch.Event):
    """An npu event: `Event(enable_timing=False, blocking=False, interprocess=False)`."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        return super().__new__(cls, device=torch.device("npu", _get_device_index(None)),
                               enable_timing=enable_timing, blocking=blocking,
                               interprocess=interprocess)

    def elapsed_time(self, end_event: torch.Event) -> float:
        """Milliseconds of host time between this event's record and `end_event`'s."""
        if not isinstance(end_event, torch.Event) or end_event.device.type != "npu":
            raise TypeError(f"expected other to be an npu torch.Event, but got {end_event!r}")
        return float(torch.ops.opennpu._npu_event_elapsed_ms(self.event_id, end_event.event_id))

    def recorded_time(self) -> int:
        """When the event was last recorded: the host steady clock, in nanoseconds."""
        return int(torch.ops.opennpu._npu_event_recorded_ns(self.event_id))

    def __repr__(self) -> str:
        return f"<torch_npu.npu.Event event_id={self.event_id}>"


_DEVICE_TYPE: int | None = None


def _npu_device_type() -> int:
    global _DEVICE_TYPE
    if _DEVICE_TYPE is None:
        _DEVICE_TYPE = torch.Stream(device="npu").device_type
    return _DEVICE_TYPE


def _wrap(s: torch.Stream) -> Stream:
    return Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


def current_stream(device: Any = None) -> Stream:
    """The calling thread's current stream on `device` (default: the current device)."""
    return _wrap(torch.accelerator.current_stream(_checked_index(device)))


def default_stream(device: Any = None) -> Stream:
    return Stream(stream_id=0, device_index=_checked_index(device), device_type=_npu_device_type())


def set_stream(stream: torch.Stream | None) -> None:
    if stream is not None:
        torch.accelerator.set_stream(stream)


class StreamContext:
    """Makes `stream` current on its device for the duration of a `with` block (None: no-op)."""

    def __init__(self, stream: torch.Stream | None):
        self.stream = stream
        self.prev: torch.Stream | None = None

    def __enter__(self):
        if self.stream is not None:
            self.prev = torch.accelerator.current_stream(self.stream.device_index)
            torch.accelerator.set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc_info) -> bool:
        if self.prev is not None:
            torch.accelerator.set_stream(self.prev)
        return False


def stream(stream: torch.Stream | None) -> StreamContext:
    return StreamContext(stream)


def _erase_stream(tensor: torch.Tensor, stream: torch.Stream) -> None:
    """torch_npu.erase_stream: drops the mark that `tensor.record_stream(stream)` left, so that
    the tensor's memory returns to the pool when freed rather than after `stream`'s work. Here
    record_stream marks nothing (work runs in program order on the host, so freed memory is
    reusable at once): after the argument checks there is nothing to erase."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"torch_npu.erase_stream: tensor should be torch.Tensor, could not be "
                        f"{type(tensor)}")
    if not isinstance(stream, torch.Stream) or stream.device.type != "npu":
        raise TypeError(f"torch_npu.erase_stream: stream should be torch_npu.npu.Stream, could "
                        f"not be {stream!r}")
