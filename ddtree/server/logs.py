"""Log records that repeat are let through once per kind and window, so that a flood cannot fill the disk.

Hostile traffic makes the same record again and again: uvicorn's "Invalid HTTP request received.", asyncio's
"socket.accept() out of system resource" (with a traceback each), our own one-line "unexpected ..." entries.
`OncePerWindow` is a `logging.Filter` that passes the first record of a kind, drops the repeats for
`window_s` seconds, and marks the first record after the window with how many it dropped. A kind is the
logger, the level, the first line of the message and the exception's type.

A filter on a logger sees only the records logged on that logger itself: our loggers that may repeat put one
on themselves (`guarded_logger`); `guard_logs()`, called when the server is made, puts one on asyncio's and
uvicorn's (idempotent).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

WINDOW_S = 60.0
MAX_KINDS = 1024  # kinds remembered; past this the memory is cleared (a flood of distinct records stays bounded)
GUARDED = ("asyncio", "uvicorn.error")

Kind = tuple[str, int, str, str]


class OncePerWindow(logging.Filter):
    """Passes one record per kind per window; the next one after the window says how many were dropped."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self.clock = clock
        self._lock = threading.Lock()
        self._seen: dict[Kind, tuple[float, int]] = {}  # kind -> (window start, records dropped in it)

    def filter(self, record: logging.LogRecord) -> bool:
        kind = _kind(record)
        now = self.clock()
        with self._lock:
            start, dropped = self._seen.get(kind, (None, 0))
            if start is not None and now - start < self.window_s:
                self._seen[kind] = (start, dropped + 1)
                return False
            if len(self._seen) >= MAX_KINDS:
                self._seen.clear()
            self._seen[kind] = (now, 0)
        if dropped:
            record.msg = f"{record.msg} [{dropped} more like this dropped in the last {self.window_s:.0f} s]"
        return True


def _kind(record: logging.LogRecord) -> Kind:
    try:
        message = record.getMessage()
    except Exception:  # a record whose arguments do not fit its message: still one kind
        message = str(record.msg)
    exc_type = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
    return record.name, record.levelno, message.split("\n", 1)[0], exc_type


def guard_logs(names: tuple[str, ...] = GUARDED) -> None:
    """A `OncePerWindow` on each logger of `names` that has none yet."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, OncePerWindow) for f in logger.filters):
            logger.addFilter(OncePerWindow())


def guarded_logger(name: str) -> logging.Logger:
    """`logging.getLogger(name)` with a `OncePerWindow` on it."""
    guard_logs((name,))
    return logging.getLogger(name)
