"""What the app's handlers need of the engine (`EngineLink`), and the in-process link.

`ddtree serve` runs the engine in a process of its own and each API process reaches it through
`ddtree.server.client.EngineClient`. `LocalEngine` is the same surface over a decode thread in this process:
the app's tests use it, so that the HTTP behaviour is checked without starting processes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from ddtree.engine.session import DecodeSession
from ddtree.server.worker import DecodeWorker, Job


class EngineLink(Protocol):
    @property
    def alive(self) -> bool: ...

    def submit(self, job: Job) -> None: ...

    def cancel(self, job: Job, reason: str = "cancelled") -> None: ...

    def waiting(self) -> int: ...

    def running(self) -> int: ...

    def slots(self) -> int: ...

    def dropped(self) -> dict[str, int]: ...

    async def open(self) -> None: ...

    async def close(self, timeout: float) -> None: ...


class LocalEngine(DecodeWorker):
    """The decode thread in this process, as an `EngineLink`."""

    def __init__(
        self, make_session: Callable[[], DecodeSession], max_queue: int, dropped: Callable[[], dict[str, int]]
    ) -> None:
        super().__init__(make_session, max_queue)
        self._dropped = dropped

    def dropped(self) -> dict[str, int]:
        return self._dropped()

    async def open(self) -> None:
        self.start()

    async def close(self, timeout: float) -> None:
        await asyncio.to_thread(self.stop, timeout)
