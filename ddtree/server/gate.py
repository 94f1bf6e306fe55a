"""The gate in front of the routes: bodies over the size limit (413), and no new work while shutting down (503).

- A body larger than `max_body_bytes` is refused with 413 and OpenAI's error shape (`code`
  `request_too_large`): at once when `Content-Length` says so, else once the bytes read (a chunked body)
  pass the limit. A body within the limit is read whole here and handed on to the routes as one message;
  what the client sends after it (a disconnect) reaches the routes as before.
- Once the server shuts down (`draining()` is true), `/v1/*` is refused with 503 (`code`
  `server_shutting_down`, `Connection: close`); requests already admitted run to their end. `/health` and
  `/metrics` stay open (health then answers 503 itself).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ddtree.server.errors import ApiError, api_error_response

SHUTTING_DOWN = "server_shutting_down"
TOO_LARGE = "request_too_large"
RETRY_AFTER_SECONDS = 1


class RequestGate:
    def __init__(self, app: ASGIApp, max_body_bytes: int, draining: Callable[[], bool]) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.draining = draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining() and str(scope["path"]).startswith("/v1/"):
            refused = ApiError(
                503,
                "the server is shutting down and takes no new requests; retry later",
                "server_error",
                code=SHUTTING_DOWN,
                headers={"Connection": "close", "Retry-After": str(RETRY_AFTER_SECONDS)},
            )
            await api_error_response(refused)(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await api_error_response(self._too_large(f"{declared} bytes"))(scope, receive, send)
            return
        messages, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # a disconnect: hand on what came, as it came
                messages.append(message)
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                await api_error_response(self._too_large(f"over {self.max_body_bytes} bytes"))(scope, receive, send)
                return
            messages.append(message)
            if not message.get("more_body", False):
                body = b"".join(m.get("body", b"") for m in messages)
                messages = [{"type": "http.request", "body": body, "more_body": False}]
                break
        await self.app(scope, _replay(messages, receive), send)

    def _too_large(self, size: str) -> ApiError:
        return ApiError(
            413,
            f"the request body is {size}; the limit is {self.max_body_bytes} bytes",
            "invalid_request_error",
            code=TOO_LARGE,
            headers={"Connection": "close"},
        )


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
