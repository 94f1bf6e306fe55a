"""Host <-> device transfers of the decode loop without implicit syncs.

`Readback` carries a step's accepted tokens to the host: a non-blocking copy into one of a few reused pinned
buffers, then an explicit wait on that copy's event when the tokens are needed. With several buffers the
copy of step k waits while step k+1 is already queued on the device.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch


class Readback:
    def __init__(self, device: torch.device, buffers: int) -> None:
        self.cuda = device.type == "cuda"
        self.buffers = buffers
        self.pinned: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self.events: list[Any] = []
        self.turn = 0

    def start(self, t: torch.Tensor) -> Any:
        """Begin copying `t` to the host; returns a ticket for `wait`. On CPU the values are read at once."""
        if not self.cuda:
            return t.tolist()
        shape = tuple(t.shape)
        pool = self.pinned.setdefault(shape, [])
        if not pool:
            pool.extend(torch.empty(shape, dtype=t.dtype, pin_memory=True) for _ in range(self.buffers))
        if not self.events:
            self.events = [torch.cuda.Event() for _ in range(self.buffers)]  # type: ignore[no-untyped-call]
        index = self.turn % self.buffers
        self.turn += 1
        pool[index].copy_(t, non_blocking=True)
        self.events[index].record()
        return pool[index], self.events[index]

    def ready(self, ticket: Any) -> bool:
        """Whether a `start`ed copy has reached the host (its event has passed), without waiting."""
        return not self.cuda or bool(ticket[1].query())

    def wait(self, ticket: Any) -> list[list[int]]:
        """The values of a `start`ed copy (an explicit wait on its event, not an implicit sync)."""
        if not self.cuda:
            rows: list[list[int]] = ticket
            return rows
        host, event = ticket
        event.synchronize()
        values: list[list[int]] = host.numpy().tolist()
        return values

    def wait_array(self, ticket: Any) -> npt.NDArray[np.int64]:
        """The values of a `start`ed int64 copy as an array of the caller's own (the pinned buffer is reused),
        after the same explicit wait as `wait`: for a caller that slices the rows rather than lists them."""
        if not self.cuda:
            return np.array(ticket, dtype=np.int64)
        host, event = ticket
        event.synchronize()
        values: npt.NDArray[np.int64] = host.numpy().copy()
        return values


def to_device(values: list[Any], device: torch.device) -> torch.Tensor:
    """Host values to the device without an implicit sync (pinned memory, non-blocking copy)."""
    host = torch.tensor(values, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
