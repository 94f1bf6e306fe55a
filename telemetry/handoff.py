"""A thread that runs telemetry's per-step work off the decode thread.

On CUDA the decode thread spends most of a step waiting for the device (the wait releases the interpreter
lock), so work handed to this thread runs in that wait instead of between the steps: resolving a step's
record and handing it to the sinks cost the decode thread one queue put. Calls run in the order they were
posted, one at a time; each is short, so the decode thread, once its wait ends, gets the lock back within one
call. When the thread falls behind by `LIMIT` calls, droppable ones (step records) are refused rather than piling
up (`post` returns False, and the caller counts what it lost); the others (requests starting and ending)
are always kept.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any

LIMIT = 4096  # calls waiting before droppable ones are dropped


class HandOff:
    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self.calls: SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = SimpleQueue()
        self.warned: set[str] = set()
        self.thread = threading.Thread(target=self._run, name="ddtree-telemetry", daemon=True)
        self.thread.start()

    def post(self, fn: Callable[..., Any], *args: Any, droppable: bool = False) -> bool:
        """Run `fn(*args)` on the thread, after every call posted before it; False if a droppable call was
        refused because the thread is `limit` calls behind."""
        if droppable and self.calls.qsize() >= self.limit:
            return False
        self.calls.put((fn, args))
        return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every call posted so far has run; False if `timeout_s` passed first or the thread is gone."""
        done = threading.Event()
        self.calls.put((done.set, ()))
        return self.thread.is_alive() and done.wait(timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Run what is posted, then stop the thread."""
        self.calls.put(None)
        self.thread.join(timeout_s)

    def _run(self) -> None:
        while (call := self.calls.get()) is not None:
            fn, args = call
            try:
                fn(*args)
            except Exception as exc:  # a telemetry bug must never break decoding: warn once per kind and go on
                self._warn_once(type(exc).__name__, f"ddtree telemetry: {fn.__qualname__} failed: {exc!r}")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
