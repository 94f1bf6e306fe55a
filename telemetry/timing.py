"""Stage clocks. On CUDA a mark is a recorded event, resolved later when it has completed (never a
sync); on CPU a mark is `perf_counter_ns`. Either way, resolved marks become wall-clock nanoseconds.
"""

from __future__ import annotations

import time
from typing import Any, Protocol


class StageClock(Protocol):
    def begin_step(self) -> None:
        """A step starts: its marks go to the stream that is current now."""

    def mark(self) -> Any:
        """Record now (on the device's stream for CUDA)."""

    def ready(self, marks: list[Any]) -> bool:
        """True when every mark can be read without waiting."""

    def to_wall_ns(self, marks: list[Any], first_wall_ns: int) -> list[int]:
        """Wall-clock times of `marks`, given the wall time of the first one. Call only when ready."""

    def release(self, marks: list[Any]) -> None:
        """The marks have been read: they may be recorded again."""


class CpuClock:
    def begin_step(self) -> None:
        pass

    def mark(self) -> int:
        return time.perf_counter_ns()

    def ready(self, marks: list[Any]) -> bool:
        return True

    def to_wall_ns(self, marks: list[Any], first_wall_ns: int) -> list[int]:
        return [first_wall_ns + (m - marks[0]) for m in marks]

    def release(self, marks: list[Any]) -> None:
        pass


class CudaClock:
    """Events are pooled: creating and destroying a CUDA event per mark costs more than recording one. The
    stream is looked up once a step: a lookup builds a Python stream object and costs twice what recording
    an event does (7.6 against 3.5 us on the H200 host)."""

    def __init__(self) -> None:
        import torch

        self._event = torch.cuda.Event
        self._current_stream = torch.cuda.current_stream
        self._stream: Any = None
        self._free: list[Any] = []

    def begin_step(self) -> None:
        self._stream = self._current_stream()

    def mark(self) -> Any:
        event: Any = self._free.pop() if self._free else self._event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(self._stream)
        return event

    def ready(self, marks: list[Any]) -> bool:
        return bool(marks[-1].query())  # events complete in stream order

    def to_wall_ns(self, marks: list[Any], first_wall_ns: int) -> list[int]:
        return [first_wall_ns + int(marks[0].elapsed_time(m) * 1e6) for m in marks]

    def release(self, marks: list[Any]) -> None:
        self._free.extend(marks)


def clock_for(device_type: str) -> StageClock:
    return CudaClock() if device_type == "cuda" else CpuClock()
