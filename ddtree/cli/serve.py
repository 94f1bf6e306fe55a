"""`ddtree serve`: an OpenAI-compatible HTTP server on the decode session (argument glue over `ddtree.server`).

Bad values are refused before anything loads or is pulled; once the pair is loaded and uvicorn listens, one
line on stderr says what is served where (`ddtree.server.run.startup_line`).
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from ddtree.adaptive import ADAPTIVE
from ddtree.cli.common import (
    POSITIVE,
    add_command,
    budget_args,
    device_args,
    engine_options,
    float_flag,
    int_flag,
    model_args,
    tree_budget,
)
from ddtree.methods import METHOD_NAMES

if TYPE_CHECKING:
    from ddtree.server.model import ServerSettings

API_KEY_ENV = "DDTREE_API_KEY"
AUTO = "auto"
FIXED_BUDGET = 32  # what `--budget auto` serves where it finds no schedule
EXAMPLES = (
    "ddtree serve  # the default pair on 127.0.0.1:8000",
    "ddtree serve --model TARGET --drafter DRAFTER --budget 16 --host 0.0.0.0 --max-batch-size 16",
    "ddtree tune && ddtree serve --budget auto  # the budget follows the load, as tuned on this device",
    "ddtree serve --budget adaptive --max-budget 64  # each step verifies the width that pays most",
    "curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\",
    """    -d '{"prompt": "Hello", "max_tokens": 32}'""",
)


def add_parser(sub: Any) -> None:
    serve = add_command(
        sub, "serve", "an OpenAI-compatible HTTP server (completions, chat) on the decode session", EXAMPLES
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind; 127.0.0.1 is this machine only")
    serve.add_argument("--port", type=int_flag(0, 65535), default=8000, help="port to listen on (0: any free port)")
    model_args(serve)
    serve.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model's name in /v1/models, responses and metrics (default: the model directory's name)",
    )
    serve.add_argument("--method", choices=METHOD_NAMES, default="ddtree", help="decoding method of every request")
    budget_args(
        serve,
        AUTO,
        help="draft tree nodes per step (ddtree); 'auto': per step, what `ddtree tune` chose for the number of "
        "requests decoding (falls back to 32, saying so, where this pair and device have no schedule); 'adaptive':"
        " per step, the width the step's own tree predicts pays most, up to --max-budget",
    )
    serve.add_argument(
        "--budget-schedule", metavar="FILE", help="follow this schedule (from `ddtree tune --out`); implies auto"
    )
    serve.add_argument(
        "--topk", type=POSITIVE, default=None, help="candidates per depth (default: min(budget, vocabulary))"
    )
    serve.add_argument("--max-batch-size", type=POSITIVE, default=8, help="requests decoded together (session slots)")
    serve.add_argument("--max-queue", type=POSITIVE, default=64, help="requests waiting for a slot; more get 429")
    serve.add_argument(
        "--max-model-len",
        type=int_flag(2),
        default=None,
        help="prompt + new tokens (default: 2048, or the model's limit)",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV}; /health, /metrics stay open)",
    )
    serve.add_argument("--max-body-bytes", type=POSITIVE, default=1 << 20, help="larger request bodies get 413")
    serve.add_argument(
        "--shutdown-timeout", type=float_flag(0), default=30.0, help="seconds requests in flight get on SIGTERM"
    )
    serve.add_argument(
        "--api-server-count",
        type=POSITIVE,
        default=None,
        help="API server processes (HTTP, tokenizing, SSE) on the one port, beside the engine's process "
        "(default: a quarter of the cores, 1 to 4; the start-up line says how many)",
    )
    serve.add_argument(
        "--stream-interval",
        type=POSITIVE,
        default=1,
        help="tokens gathered per streamed chunk (1: a chunk per decode step, as each step's tokens come)",
    )
    _connection_args(serve)
    device_args(serve, graphs=True)
    serve.set_defaults(func=_serve)


def _connection_args(serve: argparse.ArgumentParser) -> None:
    """What a client may hold: the server's timeouts and limits against slow or hostile connections."""
    seconds = float_flag(0, above=True)
    serve.add_argument("--header-timeout", type=seconds, default=10.0, help="seconds to send a request's headers")
    serve.add_argument("--body-timeout", type=seconds, default=30.0, help="seconds to send a body (else 408)")
    serve.add_argument(
        "--max-connections", type=POSITIVE, default=None, help="connections open at once (default: from ulimit -n)"
    )
    serve.add_argument("--backlog", type=POSITIVE, default=None, help="pending connections (default: with the cap)")
    serve.add_argument("--keep-alive-timeout", type=POSITIVE, default=5, help="seconds an idle connection stays open")
    serve.add_argument("--max-header-bytes", type=POSITIVE, default=16384, help="larger request heads get 400")


def _serve(args: argparse.Namespace) -> int:
    from ddtree.server.model import ServerSettings, check_settings

    settings = ServerSettings(
        model=args.model,
        drafter=args.drafter,
        method=args.method,
        budget=FIXED_BUDGET if args.budget == AUTO else tree_budget(args)[0],
        topk=args.topk,
        adaptive=args.budget == ADAPTIVE,
        auto_budget=args.budget == AUTO or args.budget_schedule is not None,
        budget_schedule=args.budget_schedule,
        served_model_name=args.served_model_name,
        max_batch_size=args.max_batch_size,
        max_queue=args.max_queue,
        max_model_len=args.max_model_len,
        # read here, not as the flag's default, so that `--help` never shows the key
        api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        max_connections=args.max_connections,
        backlog=args.backlog,
        keep_alive_timeout=args.keep_alive_timeout,
        max_header_bytes=args.max_header_bytes,
        api_server_count=args.api_server_count,
        stream_interval=args.stream_interval,
        options=engine_options(args),
    )
    check_settings(settings)  # before the default pair is pulled or anything loads
    _check_serve_capacity(settings)  # before the server starts and reports healthy

    from ddtree.server.launch import serve

    # prints the start-up line; returns once a graceful shutdown is done (0), or the engine process died (1)
    return serve(settings, args.host, args.port)


def _check_serve_capacity(settings: ServerSettings) -> None:
    """The session the server will make (its slots, each for `--max-model-len` tokens), checked from the
    configs against the model's context length and the device's memory."""
    from ddtree.models.target import read_target_config
    from ddtree.runtime import check_capacity, load_schedule, resolve_paths
    from ddtree.server.model import DEFAULT_MAX_MODEL_LEN
    from ddtree.settings import GenerationConfig

    model, drafter = resolve_paths(settings.model, settings.drafter, settings.method)
    limit = getattr(read_target_config(model), "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
    tokens = min(settings.max_model_len or DEFAULT_MAX_MODEL_LEN, int(limit))  # over the limit: load_model says so
    schedule = load_schedule(settings.budget_schedule) if settings.budget_schedule else None
    generation = GenerationConfig(
        method=settings.method,
        budget=settings.budget,
        topk=settings.topk,
        schedule=schedule,
        adaptive=settings.adaptive,
    )
    check_capacity(model, drafter, generation, settings.max_batch_size, tokens, settings.options)
