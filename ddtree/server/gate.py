"""The gate in front of the routes: bodies over the size limit (413), and no new work while shutting down (503).

- A body larger than `max_body_bytes` is refused with 413 and OpenAI's error shape (`code`
  `request_too_large`): at once when `Content-Length` says so, else once the bytes read (a chunked body)
  pass the limit. A body within the limit is read whole here and handed on to the routes as one message;
  what the client sends after it (a disconnect) reaches the routes as before.
- Once the server shuts down (`draining()` is true), `/v1/*` is refused with 503 (`code`
  `server_shutting_down`, `Connection: close`); requests already admitted run to their end. `/health` and
  `/metrics` stay open (health then answers 503 itself).
- A body that has not all arrived `body_timeout` seconds after the request's head is refused with 408
  (`code` `request_timeout`, `Connection: close`), so that a client that stalls mid-body holds no handler
  and no connection (the request's head has its own timeout, in `ddtree.server.connections`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ddtree.server.errors import ApiError, api_error_response, request_timeout, shutting_down

TOO_LARGE = "request_too_large"


class RequestGate:
    def __init__(
        self, app: ASGIApp, max_body_bytes: int, draining: Callable[[], bool], body_timeout: float = 30.0
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.draining = draining
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        got = self._refusal(scope) or await self._body(receive)
        if isinstance(got, ApiError):
            await api_error_response(got)(scope, receive, send)
            return
        await self.app(scope, _replay(got, receive), send)

    def _refusal(self, scope: Scope) -> ApiError | None:
        """What to refuse before reading the body: a server shutting down, a declared size over the limit."""
        if self.draining() and str(scope["path"]).startswith("/v1/"):
            return shutting_down()
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            return self._too_large(f"{declared} bytes")
        return None

    async def _body(self, receive: Receive) -> list[Message] | ApiError:
        """The body within `body_timeout` (else 408) and the size limit (else 413)."""
        try:
            return await asyncio.wait_for(self._read_body(receive), self.body_timeout)
        except asyncio.TimeoutError:
            return request_timeout(self.body_timeout)
        except _TooLarge:
            return self._too_large(f"over {self.max_body_bytes} bytes")

    async def _read_body(self, receive: Receive) -> list[Message]:
        """The body as one message (or what came before a disconnect, as it came); _TooLarge past the limit."""
        messages, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # a disconnect: hand on what came, as it came
                messages.append(message)
                return messages
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                raise _TooLarge
            messages.append(message)
            if not message.get("more_body", False):
                body = b"".join(m.get("body", b"") for m in messages)
                return [{"type": "http.request", "body": body, "more_body": False}]

    def _too_large(self, size: str) -> ApiError:
        return ApiError(
            413,
            f"the request body is {size}; the limit is {self.max_body_bytes} bytes",
            "invalid_request_error",
            code=TOO_LARGE,
            headers={"Connection": "close"},
        )


class _TooLarge(Exception):
    """The body read so far is over the limit."""


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server rejects it before us; nothing to check
    return None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay
