"""The FastAPI app: OpenAI-compatible completions and chat on the decode thread, plus models, health, metrics.

- `POST /v1/completions`, `POST /v1/chat/completions`: whole, or streamed as server-sent events (see
  `ddtree.server.responses` for the format and `ddtree.server.schemas` for the fields and defaults).
- `GET /v1/models`: the one served model. `GET /health`: 200 while the decode thread runs, else 503.
  `GET /metrics`: Prometheus text (`ddtree.server.metrics`): HTTP, per request (from the handler's start) and
  speculative-decoding metrics, always on; telemetry's step metrics appended with `DDTREE_DEBUG_METRICS=1`.
- With an API key, `/v1/*` needs `Authorization: Bearer KEY` (else 401); `/health` and `/metrics` stay open,
  for probes and scrapers.
- Errors are OpenAI's: `{"error": {"message", "type", "param", "code"}}`; a body that does not validate is a
  400 (not FastAPI's 422), as is a string the tokenizer cannot take (a lone surrogate, a NUL) or a token id
  outside the vocabulary; a full queue is a 429 with `Retry-After`; a failed decode step is a 500; any
  other failure of ours is a 500 with one log line, never a traceback (`ddtree.server.faults`).
- A body over `INLINE_TOKENISE_BYTES` (by `Content-Length`; any without it) is tokenised off the event loop
  (`asyncio.to_thread`), so that `/health` and the streams of other requests go on while a long prompt is
  tokenised. A shorter one is tokenised on the loop: it takes a fraction of a millisecond, where the hop to a
  thread and back waits for the loop and the interpreter lock (on two loaded cores it had made the mean time
  to first token twice as long). Detokenising stays on the loop: it decodes a few ids at a time, as they come
  (`ddtree.server.text`).
- `model`: the server serves one model, the id `/v1/models` lists. A request may name it or leave `model`
  out (or null); any other name is a 404 with code `model_not_found`, as OpenAI answers, before any work.
- A body over `max_body_bytes` (by `Content-Length`, or as read) is a 413, code `request_too_large`; a body
  not all in within `body_timeout` seconds is a 408, code `request_timeout` (`ddtree.server.gate`).
- Shutdown (SIGTERM or SIGINT under `ddtree.server.run`): `draining` turns true, so new `/v1/*` requests get
  503 (code `server_shutting_down`) and `/health` 503; uvicorn stops listening and gives the requests in
  flight up to `shutdown_timeout` seconds to finish (then cancels them: those get 503, code
  `server_shutting_down`, too); the lifespan's end stops the decode thread.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, cast

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree.engine.requests import Request as DecodeRequest
from ddtree.errors import SettingsError
from ddtree.server.card import ApiModel
from ddtree.server.errors import (
    ApiError,
    api_error_response,
    bad_request,
    settings_error,
    shutting_down,
    validation_error,
)
from ddtree.server.faults import ErrorGuard
from ddtree.server.gate import RequestGate
from ddtree.server.generation import ClientGone, Generation, GenerationFailed, abandon_on_disconnect
from ddtree.server.link import EngineLink, LocalEngine
from ddtree.server.logprobs import LogprobFormatter
from ddtree.server.metrics import MetricsMiddleware, RequestMeter, ServerMetrics, telemetry_exposition
from ddtree.server.model import ServedModel, ServerSettings, load_model
from ddtree.server.prompts import chat_prompt, completion_prompt
from ddtree.server.responses import Reply, ddtree_block, usage_block
from ddtree.server.schemas import ChatRequest, CompletionRequest, Sampling
from ddtree.server.text import TextStream
from ddtree.server.worker import QueueFull, WorkerStopped
from telemetry import semconv as sc

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
RETRY_AFTER_SECONDS = 1
INLINE_TOKENISE_BYTES = 16_384  # a body up to this size is tokenised on the event loop (about a millisecond at most)
CLIENT_CLOSED = 499  # the client went away before the response (nginx's status)


@dataclass
class ServerState:
    settings: ServerSettings
    model: ApiModel
    worker: EngineLink
    metrics: ServerMetrics
    created: int
    draining: bool = False  # shutting down: no new requests


def create_app(settings: ServerSettings, model: ServedModel | None = None) -> FastAPI:
    """The app over a decode thread in this process (`LocalEngine`); `model` (already loaded) lets tests build
    several apps on one pair. `ddtree serve` runs `api_app` in API processes over an engine process instead."""
    served = model if model is not None else load_model(settings)
    worker = LocalEngine(
        lambda: served.new_session(settings.max_batch_size), settings.max_queue, served.telemetry.dropped
    )
    return api_app(settings, served.api_model(), worker, on_end=served.telemetry.shutdown)


def api_app(
    settings: ServerSettings,
    model: ApiModel,
    link: EngineLink,
    on_end: Callable[[], None] | None = None,
    multiprocess_dir: str | None = None,
) -> FastAPI:
    """The app over `link`; `on_end` runs once the link is closed (telemetry's flush, in-process);
    `multiprocess_dir`: the metrics of every API process are one view (prometheus-client's multiprocess mode)."""
    metrics = ServerMetrics(
        link.waiting,
        link.running,
        link.dropped,
        slots=link.slots,
        model=model.model_id,
        method=model.card.method,
        multiprocess_dir=multiprocess_dir,
    )
    state = ServerState(settings, model, link, metrics, int(time.time()))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await link.open()
        try:
            yield
        finally:
            await link.close(settings.shutdown_timeout)
            if on_end is not None:
                on_end()  # flushes spans, logs and metrics; bounded

    app = FastAPI(title="ddtree", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ddtree = state

    def draining() -> bool:
        return state.draining

    app.add_middleware(
        RequestGate, max_body_bytes=settings.max_body_bytes, draining=draining, body_timeout=settings.body_timeout
    )
    app.add_middleware(ErrorGuard, draining=draining)  # turns what escapes the routes and the gate into answers
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)  # outermost: counts every answer
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.include_router(_open)
    app.include_router(_v1)
    return app


def _state(request: Request) -> ServerState:
    return cast(ServerState, request.app.state.ddtree)


async def _authorize(request: Request) -> None:
    key = _state(request).settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
        raise ApiError(
            401,
            "a valid API key is needed: send the header 'Authorization: Bearer KEY'",
            "invalid_request_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


_open = APIRouter()
_v1 = APIRouter(dependencies=[Depends(_authorize)])


@_open.get("/health")
async def health(request: Request) -> JSONResponse:
    state = _state(request)
    if state.draining:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    alive = state.worker.alive
    return JSONResponse({"status": "ok" if alive else "decode loop stopped"}, status_code=200 if alive else 503)


@_open.get("/metrics")
async def metrics(request: Request) -> Response:
    state = _state(request)
    body, content_type = state.metrics.exposition()
    return Response(body + await telemetry_exposition(state.model.card.telemetry_port), media_type=content_type)


@_v1.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state = _state(request)
    card = {
        "id": state.model.model_id,
        "object": "model",
        "created": state.created,
        "owned_by": "ddtree",
        "max_model_len": state.model.max_model_len,
    }
    return {"object": "list", "data": [card]}


@_v1.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    arrived, state = time.perf_counter(), _state(request)
    prompt = await _tokenised(state, request, body, lambda: completion_prompt(state.model, body.prompt))
    max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETION_MAX_TOKENS
    return await _generate(
        state, request, body, prompt, max_tokens, state.metrics.meter(request.url.path, False, arrived)
    )


@_v1.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    arrived, state = time.perf_counter(), _state(request)
    prompt = await _tokenised(state, request, body, lambda: chat_prompt(state.model, body.messages))
    asked = body.new_tokens()
    max_tokens = asked if asked is not None else max(state.model.max_model_len - len(prompt), 1)
    return await _generate(
        state, request, body, prompt, max_tokens, state.metrics.meter(request.url.path, True, arrived)
    )


async def _tokenised(
    state: ServerState, request: Request, body: Sampling, tokenise: Callable[[], list[int]]
) -> list[int]:
    """The body's strings and model checked, then its prompt tokenised: on the event loop where the body is
    short, else in a thread."""

    def run() -> list[int]:
        problem = body.text_problem()
        if problem is not None:
            param, message = problem
            raise bad_request(message, param=param)
        _check_model(state, body.model)
        return tokenise()

    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) <= INLINE_TOKENISE_BYTES:
        return run()
    return await asyncio.to_thread(run)


async def _generate(
    state: ServerState, request: Request, body: Sampling, prompt: list[int], max_tokens: int, meter: RequestMeter
) -> Response:
    chat = meter.chat
    _check_length(len(prompt), max_tokens, state.model.max_model_len, "messages" if chat else "prompt")
    reply_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    traced = (reply_id, request.headers.get("traceparent"))  # telemetry's request id, the client's trace
    generation = _start(state, meter, body, prompt, max_tokens, traced)
    reply = Reply(
        id=reply_id,
        created=int(time.time()),
        model=state.model.model_id,
        chat=chat,
        include_usage=body.include_usage(),
    )
    streaming = False
    try:
        async with abandon_on_disconnect(request.receive, generation):
            await generation.started()
            if body.stream:
                streaming = True
                return StreamingResponse(_events(state, generation, reply), media_type="text/event-stream")
            text = await generation.text()
    except (QueueFull, WorkerStopped) as exc:  # an engine in another process answers after submit
        raise _refused(state, exc) from None
    except GenerationFailed as exc:
        if state.draining:
            raise shutting_down() from None
        raise ApiError(500, f"generation failed: {exc}", "server_error") from None
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        if not streaming:  # the stream closes the generation itself
            generation.close()
            _ended(generation)
    logprobs = generation.formatter.block(generation.scored) if generation.formatter else None
    return JSONResponse(reply.body(text, generation.finish_reason or "length", *_blocks(state, generation), logprobs))


def _start(
    state: ServerState,
    meter: RequestMeter,
    body: Sampling,
    prompt: list[int],
    max_tokens: int,
    traced: tuple[str, str | None],
) -> Generation:
    model = state.model.card
    temperature = body.temperature if body.temperature is not None else DEFAULT_TEMPERATURE
    seed = body.seed if body.seed is not None else secrets.randbits(63)
    request_id, trace_parent = traced
    eos = model.eos_token_ids
    top = body.logprobs_count()
    request = DecodeRequest(
        prompt,
        max_tokens,
        temperature,
        seed,
        eos,
        request_id,
        trace_parent,
        top_p=body.top_p if body.top_p is not None else 1.0,
        top_k=body.top_k_value(),
        logprobs=top,
    )
    try:
        request.check_settings()
    except SettingsError as exc:
        raise settings_error(exc) from None
    tokenizer = state.model.tokenizer
    text = TextStream(tokenizer, prompt, body.stop_list())
    generation = Generation(state.worker, request, text, meter, state.settings.stream_interval)
    generation.formatter = LogprobFormatter(tokenizer, meter.chat, top) if top is not None else None
    try:
        generation.submit()
    except (QueueFull, WorkerStopped) as exc:
        raise _refused(state, exc) from None
    return generation


def _refused(state: ServerState, exc: QueueFull | WorkerStopped) -> ApiError:
    """A request that got no place: 429 on a full queue, else 503."""
    if isinstance(exc, QueueFull):
        return ApiError(
            429,
            f"the server is busy: {state.settings.max_queue} requests are already waiting; retry later",
            "rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
    if state.draining:
        return shutting_down()
    return ApiError(503, "the decode loop is not running", "server_error")


async def _events(state: ServerState, generation: Generation, reply: Reply) -> AsyncIterator[str]:
    """The SSE stream, an event per piece of text. Events the handler has without waiting (it fell behind
    its engine) go out in one write. Its end, a failure or a cancelled stream (the client went away) cancels
    the job."""
    unsent = ""
    try:
        for chunk in reply.opening():
            yield chunk
        while (piece := await generation.next_text()) is not None:
            scored = generation.take_unsent()
            if piece or scored:  # a chunk carries the log-probabilities of the tokens it completes
                unsent += reply.piece(piece, generation.formatter.block(scored) if generation.formatter else None)
            if unsent and not generation.ready():
                yield unsent
                unsent = ""
        yield unsent + "".join(reply.ending(generation.finish_reason or "length", *_blocks(state, generation)))
    except GenerationFailed as exc:
        failed = ApiError(500, f"generation failed: {exc}", "server_error")
        yield f"{unsent}data: {failed.body_json()}\n\ndata: [DONE]\n\n"
    finally:
        generation.close()
        _ended(generation)


def _blocks(state: ServerState, generation: Generation) -> tuple[dict[str, int], dict[str, Any]]:
    model = state.model.card
    usage = usage_block(generation.prompt_tokens, generation.completion_tokens)
    switching = model.schedule is not None or model.adaptive
    budgets = generation.step_budgets if switching else None
    gains = generation.step_gains if model.adaptive else None
    lengths = generation.acceptance_lengths
    ddtree = ddtree_block(model.method, model.tree_budget, model.tree_topk, lengths, budgets, gains)
    return usage, ddtree


def _ended(generation: Generation) -> None:
    """The response has ended: meter the request (its finish reason: an error, or abort where it ended early)."""
    reason = generation.finish_reason or (sc.FINISHED_ERROR if generation.failed else sc.FINISHED_ABORT)
    job = generation.job
    queued = (job.queued_at, job.joined_at, job.first_at)
    generation.meter.end(reason, generation.completion_tokens, generation.acceptance_lengths, queued)


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model.model_id:
        raise ApiError(
            404,
            f"the model '{model}' does not exist; this server serves '{state.model.model_id}' (see /v1/models)",
            "invalid_request_error",
            param="model",
            code="model_not_found",
        )


def _check_length(prompt_tokens: int, max_tokens: int, limit: int, param: str) -> None:
    if prompt_tokens + max_tokens > limit:
        raise ApiError(
            400,
            f"this model's maximum context length is {limit} tokens; the request has {prompt_tokens} prompt tokens "
            f"and asks for {max_tokens} new tokens ({prompt_tokens + max_tokens} in all)",
            "invalid_request_error",
            param=param,
            code="context_length_exceeded",
        )


async def _api_error(_: Request, exc: Exception) -> Response:
    return api_error_response(cast(ApiError, exc))


async def _validation_error(_: Request, exc: Exception) -> Response:
    return api_error_response(validation_error(cast(RequestValidationError, exc)))


async def _http_error(_: Request, exc: Exception) -> Response:
    http = cast(StarletteHTTPException, exc)
    error = ApiError(http.status_code, str(http.detail), "invalid_request_error", headers=dict(http.headers or {}))
    return api_error_response(error)
