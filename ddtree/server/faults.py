"""The middleware that no exception gets past: a failure of ours is a 500 in OpenAI's shape, never a traceback.

- An exception the routes did not turn into an answer becomes a 500 (`type` `server_error`) and one log line:
  the exception's type, the route and where it was raised; no message, no traceback (a message may quote the
  prompt, and nothing here logs prompt text). Repeats of a line are dropped by `ddtree.server.logs`.
- A request cancelled while the server shuts down (uvicorn cancels what is left when `shutdown_timeout`
  runs out) gets the 503 of a server shutting down (`code` `server_shutting_down`), and no log line. A
  cancellation at any other time is passed on.
- A response already under way cannot change its status: a stream (`text/event-stream`) ends with an error
  event and `data: [DONE]`; any other response is left unfinished, and uvicorn closes the connection.
"""

from __future__ import annotations

import asyncio
import sys
import traceback
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ddtree.server.errors import ApiError, api_error_response, internal_error, shutting_down
from ddtree.server.logs import guarded_logger
from ddtree.server.responses import DONE

log = guarded_logger(__name__)  # each kind of line once a minute

EVENT_STREAM = b"text/event-stream"


class ErrorGuard:
    def __init__(self, app: ASGIApp, draining: Callable[[], bool]) -> None:
        self.app = app
        self.draining = draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        response = _Response(send)
        try:
            await self.app(scope, receive, response.send)
        except asyncio.CancelledError:
            if not self.draining():
                raise
            _uncancel()
            await response.fail(shutting_down(), scope, receive)
        except Exception as exc:
            log.error("unexpected %s in %s %s at %s; answered 500", type(exc).__name__, *_where(scope, exc))
            await response.fail(internal_error(), scope, receive)


class _Response:
    """What of the response has been sent, and how to end it with an error."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.complete = False
        self.streaming = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            self.streaming = content_type.startswith(EVENT_STREAM)
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)

    async def fail(self, error: ApiError, scope: Scope, receive: Receive) -> None:
        if not self.started:
            await api_error_response(error)(scope, receive, self.send)
        elif self.streaming and not self.complete:
            body = f"data: {error.body_json()}\n\n{DONE}".encode()
            await self.send({"type": "http.response.body", "body": body, "more_body": False})


def _where(scope: Scope, exc: BaseException) -> tuple[str, str, str]:
    frames = traceback.extract_tb(exc.__traceback__)
    place = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
    return str(scope.get("method", "?")), str(scope.get("path", "?")), place


def _uncancel() -> None:
    """The cancellation has been handled here: the task ends with the 503, not with CancelledError."""
    task = asyncio.current_task()
    if task is not None and sys.version_info >= (3, 11):
        task.uncancel()
