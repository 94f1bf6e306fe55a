"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

The refusals more than one module gives are built here: `shutting_down` (503, `server_shutting_down`),
`request_timeout` (408, `request_timeout`) and `internal_error` (500, a failure of ours, no details).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ddtree.errors import SettingsError

FIELDS = {"max_new_tokens": "max_tokens"}  # a setting's request field, where the names differ
SHUTTING_DOWN = "server_shutting_down"
REQUEST_TIMEOUT = "request_timeout"
RETRY_AFTER_SECONDS = 1


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body_json(self) -> str:
        return json.dumps(self.body(), separators=(",", ":"))


def api_error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param=param, code=code)


def settings_error(exc: SettingsError) -> ApiError:
    """A setting the library refused, as a 400 that names the request's field."""
    field = FIELDS.get(exc.setting, exc.setting)
    return bad_request(exc.named(field), param=field)


def shutting_down() -> ApiError:
    """A request refused because the server is shutting down: while draining, or still unfinished when the
    shutdown timeout ran out."""
    return ApiError(
        503,
        "the server is shutting down and takes no new requests; retry later",
        "server_error",
        code=SHUTTING_DOWN,
        headers={"Connection": "close", "Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def request_timeout(seconds: float) -> ApiError:
    return ApiError(
        408,
        f"the request body was not received within {seconds:g} s; the connection is closed",
        "invalid_request_error",
        code=REQUEST_TIMEOUT,
        headers={"Connection": "close"},
    )


def internal_error() -> ApiError:
    return ApiError(500, "the server failed on this request (an internal error); it has been logged", "server_error")


def validation_error(exc: RequestValidationError) -> ApiError:
    """FastAPI's 422 as OpenAI's 400: one line per problem, the first problem's field as `param`."""
    problems = []
    params = []
    for error in exc.errors():
        loc = [str(part) for part in error.get("loc", ()) if part != "body"]
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        if error.get("type") == "extra_forbidden":
            message = "this server does not support this field (an unsupported field is refused, not ignored)"
        problems.append(f"{loc[0]}: {message}" if loc and error.get("type") != "json_invalid" else message)
        params.append(loc[0] if loc and error.get("type") != "json_invalid" else None)
    return bad_request("; ".join(problems) or "invalid request body", param=params[0] if params else None)
