"""The served model: the server's settings, loading the pair, and the facts every response reports."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ddtree.engine.engine import Engine
from ddtree.engine.session import DecodeSession
from ddtree.errors import UserError
from ddtree.models.chat import eos_ids
from ddtree.runtime import (
    EngineOptions,
    GenerateRequest,
    check_request,
    find_schedule,
    load_schedule,
    pair_identity,
    resolve_paths,
)
from ddtree.schedule import BudgetSchedule
from ddtree.server.card import ApiModel, ModelCard
from ddtree.server.connections import connection_budget, descriptors_needed, fd_limit
from ddtree.settings import GenerationConfig
from telemetry import TelemetryConfig, start_telemetry

DEFAULT_MAX_MODEL_LEN = 2048  # or the model's max_position_embeddings when that is smaller


@dataclass(frozen=True)
class ServerSettings:
    model: str | None = None  # None: the default pair (pulled on first use)
    drafter: str | None = None
    method: str = "ddtree"
    budget: int = 32  # the fixed budget: without auto_budget, and where auto finds no schedule
    topk: int | None = None
    auto_budget: bool = False  # follow the schedule `ddtree tune` wrote for this pair and device
    budget_schedule: str | None = None  # follow this schedule file (implies auto_budget)
    adaptive: bool = False  # each step verifies the width its tree predicts pays most, up to `budget`
    served_model_name: str | None = None  # the name /v1/models lists and responses carry; None: the directory's
    max_batch_size: int = 8  # the session's slots: requests decoded together
    max_queue: int = 64  # requests waiting for a slot; one more gets 429
    max_model_len: int | None = None  # prompt + new tokens; None: DEFAULT_MAX_MODEL_LEN capped by the model
    api_key: str | None = None
    max_body_bytes: int = 1 << 20  # a request body over this is refused with 413
    shutdown_timeout: float = 30.0  # seconds requests in flight get to finish once shutdown starts
    # Connections (ddtree.server.connections, ddtree.server.gate): slow or idle clients cannot pile up.
    header_timeout: float = 10.0  # seconds to a request's whole head, from connect or the previous response
    body_timeout: float = 30.0  # seconds from the head to the whole body; then 408 and the connection closed
    max_connections: int | None = None  # open at once; None: sized from `ulimit -n` (connection_budget)
    backlog: int | None = None  # queued by the kernel before accept (uvicorn's); None: sized as max_connections
    keep_alive_timeout: int = 5  # seconds an idle keep-alive connection is kept (uvicorn's timeout_keep_alive)
    max_header_bytes: int = 16 * 1024  # a head still incomplete past this size is a 400 (h11_max_incomplete_event_size)
    # Processes (ddtree.server.launch): API server processes on the one port; None: fitted to the machine's cores.
    api_server_count: int | None = None
    stream_interval: int = 1  # tokens gathered per SSE chunk (vLLM's --stream-interval); 1: a chunk per step
    options: EngineOptions = field(default_factory=EngineOptions)


def check_settings(settings: ServerSettings) -> None:
    """Check what can be checked before anything loads (UserError, in the words of the flags)."""
    check_request(_generate_request(settings))
    settings.options.check()
    if (settings.auto_budget or settings.budget_schedule) and settings.method != "ddtree":
        raise UserError(f"--budget auto chooses ddtree trees; it needs --method ddtree, not {settings.method}")
    if settings.adaptive and (settings.auto_budget or settings.budget_schedule):
        raise UserError("--budget adaptive chooses each step's width itself; it takes no --budget-schedule")
    if settings.budget_schedule is not None:
        load_schedule(settings.budget_schedule)  # it exists and parses
    _check_counts(
        {
            "--max-batch-size": settings.max_batch_size,
            "--max-queue": settings.max_queue,
            "--api-server-count": settings.api_server_count,
            "--stream-interval": settings.stream_interval,
        }
    )
    if settings.max_model_len is not None and settings.max_model_len < 2:
        raise UserError(f"--max-model-len must be >= 2, got {settings.max_model_len}")
    if settings.max_body_bytes < 1:
        raise UserError(f"--max-body-bytes must be >= 1, got {settings.max_body_bytes}")
    if not settings.shutdown_timeout >= 0:
        raise UserError(f"--shutdown-timeout must be >= 0, got {settings.shutdown_timeout}")
    _check_connections(settings)
    if settings.api_key is not None and not settings.api_key.strip():
        raise UserError("--api-key must not be empty")
    name = settings.served_model_name
    if name is not None and (not name.strip() or name != name.strip() or "\x00" in name):
        raise UserError(f"--served-model-name must be a non-empty name without surrounding spaces, got {name!r}")


def _check_counts(counts: dict[str, int | None]) -> None:
    """Each flag's count, where given, is at least 1."""
    for flag, value in counts.items():
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")


def _check_connections(settings: ServerSettings) -> None:
    for flag, seconds in (("--header-timeout", settings.header_timeout), ("--body-timeout", settings.body_timeout)):
        if not 0 < seconds < float("inf"):
            raise UserError(f"{flag} must be > 0 seconds, got {seconds}")
    _check_counts(
        {
            "--max-connections": settings.max_connections,
            "--keep-alive-timeout": settings.keep_alive_timeout,
            "--max-header-bytes": settings.max_header_bytes,
            "--backlog": settings.backlog,
        }
    )
    fds = fd_limit()
    connections, backlog = connection_budget(settings.max_connections, settings.backlog, fds)
    needed = descriptors_needed(connections, backlog)
    explicit = settings.max_connections is not None or settings.backlog is not None  # the defaults fit
    if explicit and fds is not None and needed > fds:
        raise UserError(
            f"--max-connections {connections} with --backlog {backlog} can take {needed} file descriptors, "
            f"but the limit is {fds} (ulimit -n): lower them or raise the limit"
        )


@dataclass
class ServedModel:
    """The loaded pair and what the server needs to know about it."""

    engine: Engine
    tokenizer: Any
    model_id: str  # the name /v1/models lists and responses carry
    generation: GenerationConfig  # method, budget, top-k and end-of-sequence ids of every request
    max_model_len: int
    vocab_size: int
    tree_budget: int  # the budget and top-k the engine verifies (`Engine.shape`; with a schedule, the widest)
    tree_topk: int | None
    schedule: BudgetSchedule | None = None  # the budget follows the load (`--budget auto`)
    telemetry: Any = field(default_factory=lambda: start_telemetry(TelemetryConfig()))  # the off one by default
    model_dir: str = ""  # the target's directory (its tokenizer's)

    def card(self) -> ModelCard:
        """What the API server processes need to know (`ddtree.server.card`)."""
        target = self.engine.target
        choices = self.schedule.choices if self.schedule is not None else None
        return ModelCard(
            model_id=self.model_id,
            model_dir=self.model_dir,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            method=self.generation.method,
            eos_token_ids=tuple(self.generation.eos_token_ids),
            tree_budget=self.tree_budget,
            tree_topk=self.tree_topk,
            schedule=tuple((c.batch_size, c.label) for c in choices) if choices is not None else None,
            adaptive=self.generation.adaptive,
            device=str(target.device),
            dtype=str(target.dtype).removeprefix("torch."),
            graphs=bool(self.engine.cuda_graphs),
            telemetry_port=getattr(self.telemetry, "prometheus_port", None) or None,
        )

    def api_model(self) -> ApiModel:
        return ApiModel(self.card(), self.tokenizer)

    def new_session(self, slots: int) -> DecodeSession:
        """A fresh session of `slots` slots for requests of up to `max_model_len` tokens."""
        self.engine.sessions.clear()  # never hand out a session that a failed step may have left half-updated
        session = self.engine.session(self.generation, slots, self.max_model_len)
        if session.cuda_graphs:  # compile and capture every row count now, not in the first requests' steps
            session.warm_up()  # an adaptive session's step costs measured with it
        elif session.adaptive is not None:
            session.measure_costs()  # now, not in the first request's wait
        return session


def load_model(settings: ServerSettings) -> ServedModel:
    """Check the settings, then load and check the pair (UserError for anything the user can fix)."""
    check_settings(settings)
    model, drafter_dir = resolve_paths(settings.model, settings.drafter, settings.method)
    target, drafter, tokenizer = settings.options.load_models(model, drafter_dir)
    vocab_size = int(target.config.vocab_size)
    check_request(_generate_request(settings), vocab_size)
    max_model_len = _max_model_len(settings.max_model_len, target.config)
    if tokenizer is None:
        raise UserError(f"serve needs a model directory with a tokenizer; {model} has none")
    telemetry = start_telemetry(
        _server_telemetry(TelemetryConfig.from_env()),
        device_type=target.device.type,
        model_name=settings.served_model_name or Path(model).name,
        detokenize=lambda ids: str(tokenizer.decode(ids)),
    )
    engine = settings.options.engine(target, drafter, telemetry.observer)
    schedule = _schedule(settings, pair_identity(model, drafter_dir, target)) if settings.method == "ddtree" else None
    generation = GenerationConfig(
        method=settings.method,
        budget=settings.budget,
        topk=settings.topk,
        eos_token_ids=eos_ids(tokenizer, target),
        schedule=schedule,
        adaptive=settings.adaptive,
    )
    shape = engine.shape(generation)
    budget, topk = shape.budget, shape.topk  # an unset top-k stays None: null in the `ddtree` block, as in logs
    return ServedModel(
        engine=engine,
        tokenizer=tokenizer,
        model_id=settings.served_model_name or Path(model).name,
        generation=generation,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        tree_budget=budget,
        tree_topk=topk,
        schedule=schedule,
        telemetry=telemetry,
        model_dir=model,
    )


def _schedule(settings: ServerSettings, identity: dict[str, str]) -> BudgetSchedule | None:
    """The schedule to follow: the file given, or the one tuned for this pair and device; where `auto` finds
    none, one line on stderr says so and the fixed budget serves."""
    if settings.budget_schedule is not None:
        given = load_schedule(settings.budget_schedule)
        mismatch = given.mismatch(identity)
        if mismatch is not None:
            print(f"ddtree serve: the budget schedule was tuned for {mismatch}; following it as asked", file=sys.stderr)
        return given
    if not settings.auto_budget:
        return None
    schedule, found = find_schedule(identity)
    if schedule is None:
        print(
            f"ddtree serve: --budget auto: {found} (`ddtree tune` makes one); serving the fixed budget "
            f"{settings.budget}",
            file=sys.stderr,
        )
    return schedule


def _server_telemetry(config: TelemetryConfig) -> TelemetryConfig:
    """`DDTREE_DEBUG_METRICS=1` in the server: the telemetry layer's Prometheus metrics are served through the
    server's own `/metrics` (one endpoint), so its exporter listens on a free loopback port of its own."""
    if config.enabled and config.metrics_exporter == "prometheus":
        return replace(config, prometheus_host="127.0.0.1", prometheus_port=0)
    return config


def _generate_request(settings: ServerSettings) -> GenerateRequest:
    generation = GenerationConfig(
        method=settings.method, budget=settings.budget, topk=settings.topk, adaptive=settings.adaptive
    )
    return GenerateRequest(model=settings.model, drafter=settings.drafter, generation=generation)


def _max_model_len(asked: int | None, config: Any) -> int:
    limit = getattr(config, "max_position_embeddings", None)
    if asked is None:
        return min(DEFAULT_MAX_MODEL_LEN, int(limit)) if limit else DEFAULT_MAX_MODEL_LEN
    if limit and asked > int(limit):
        raise UserError(f"--max-model-len {asked} exceeds the model's max_position_embeddings ({limit})")
    return asked
