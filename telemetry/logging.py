"""structlog set-up: one JSON object per line (or console lines), to stderr, stdout or a file.

Prompt and completion content is logged only when `DDTREE_LOG_CONTENT` opts in.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from typing import IO, Any, TextIO, cast

import structlog

from ddtree.methods import mean_acceptance_length
from ddtree.observer import GenerateInfo, RequestResult
from telemetry import semconv as sc
from telemetry.chain import per_depth
from telemetry.config import TelemetryConfig, TelemetryConfigError
from telemetry.paths import PathTracker, path_ranks
from telemetry.stats import StepStats


def open_log_stream(config: TelemetryConfig) -> IO[str]:
    """The stream the logs go to. An unwritable file, or a named pipe that no one reads, is a clear error,
    raised at start-up (opening a pipe without a reader would wait for one)."""
    if config.log_file is None:
        return sys.stderr
    if config.log_file == "-":
        return sys.stdout
    path = config.log_file
    try:
        if stat.S_ISFIFO(os.stat(path).st_mode):
            return _open_pipe(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise TelemetryConfigError(f"DDTREE_LOG_FILE {path!r} is not writable: {exc.strerror}") from exc
    try:
        return open(path, "a", buffering=1, encoding="utf-8")
    except OSError as exc:
        raise TelemetryConfigError(f"DDTREE_LOG_FILE {path!r} is not writable: {exc.strerror}") from exc


def _open_pipe(path: str) -> IO[str]:
    """A named pipe, opened for writing only if it has a reader now; then blocking, like a file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise TelemetryConfigError(f"DDTREE_LOG_FILE {path!r} is a named pipe that no process reads") from exc
        raise TelemetryConfigError(f"DDTREE_LOG_FILE {path!r} is not writable: {exc.strerror}") from exc
    os.set_blocking(fd, True)
    return open(fd, "w", buffering=1, encoding="utf-8")


def make_logger(config: TelemetryConfig, stream: IO[str]) -> Any:
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if config.log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    return structlog.wrap_logger(
        structlog.PrintLogger(file=cast(TextIO, stream)),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
    )


class LogSink:
    """`ddtree.step` per decode step and `ddtree.request` per finished request.

    A step line carries its accepted paths' ranks (`telemetry.chain`) where the loop read them back. A request's
    line lists its steps' accepted paths (node indices), found when it ends (`PathTracker`); a share
    `tree_share` of the step lines carry each node's path rank and log-probability."""

    def __init__(self, logger: Any, log_content: bool = False, trace_ids: Any = None, tree_share: float = 0.0) -> None:
        self.log = logger
        self.log_content = log_content
        self.trace_ids = trace_ids  # callable: step stats -> trace id hex, or None
        self.tree_share = tree_share
        self.paths = PathTracker()

    def start_requests(self, info: GenerateInfo) -> None:
        pass

    def step(self, stats: StepStats) -> None:
        depth = stats.tree_depth
        fields: dict[str, Any] = {
            sc.FIELD_STEP: stats.step,
            sc.FIELD_METHOD: stats.info.method,
            sc.FIELD_ACTIVE_REQUESTS: stats.active_requests,
            sc.FIELD_ROWS: stats.row_count,
            sc.FIELD_WARMUP: stats.warmup,
            sc.FIELD_BUDGET: stats.info.budget,
            sc.FIELD_TOPK: stats.info.topk,
            sc.FIELD_TREE_NODES: stats.tree_nodes,
            sc.FIELD_NODES_PER_DEPTH: stats.nodes_per_depth[1 : depth + 1],
            sc.FIELD_ACCEPTED_DRAFTS: stats.accepted,
            sc.FIELD_ACCEPTED_PER_DEPTH: stats.accepted_per_depth[1 : depth + 1],
            sc.FIELD_EMITTED: stats.emitted,
            sc.FIELD_STAGE_MS: {s: round((e - b) / 1e6, 4) for s, (b, e) in stats.stage_ns.items()},
            sc.FIELD_REQUEST_IDS: stats.request_ids,
            sc.FIELD_TRACE_ID: self.trace_ids(stats) if self.trace_ids else None,
            sc.FIELD_START_NS: stats.start_ns,
            sc.FIELD_END_NS: stats.end_ns,
        }
        if stats.gain is not None:
            fields[sc.FIELD_PREDICTED_GAIN] = round(stats.gain, 4)
        predicted = stats.predicted
        if predicted is not None and stats.predicted_widths:
            fields[sc.FIELD_PREDICTED_ACCEPTED] = [round(row[-1], 4) for row in predicted]
            fields[sc.FIELD_PREDICTED_WIDTHS] = stats.predicted_widths
            fields[sc.FIELD_PREDICTED_AT_WIDTHS] = [[round(v, 4) for v in row] for row in predicted]
        ranks, chain = stats.path_ranks, stats.chain
        if ranks is not None and chain is not None:  # a loop that reads back no ranks (SGLang's) leaves them out
            fields[sc.FIELD_ACCEPTED_RANKS] = ranks
            fields[sc.FIELD_OFF_CHAIN_PARENT_NODES_PER_DEPTH] = per_depth(chain.off_parent_nodes, depth)
        if stats.parents is not None and stats.parents.shape[1] > 1 and sampled(stats.step, self.tree_share):
            fields[sc.FIELD_NODE_RANKS] = [path_ranks(row) for row in stats.parents.tolist()]
            if stats.log_probs is not None:
                counts = stats.tree_nodes
                fields[sc.FIELD_NODE_LOG_PROBS] = [
                    [round(float(v), 4) for v in row[1 : n + 1]] for row, n in zip(stats.log_probs, counts, strict=True)
                ]
        self.paths.add(stats)
        self.log.info(sc.EVENT_STEP, **fields)

    def end_requests(self, info: GenerateInfo, results: list[RequestResult]) -> None:
        for prompt, result in zip(info.prompt_tokens, results, strict=True):
            lengths = result.acceptance_lengths
            fields: dict[str, Any] = {
                sc.FIELD_REQUEST_ID: result.request_id,
                sc.FIELD_METHOD: info.method,
                sc.FIELD_PROMPT_TOKENS: len(prompt),
                sc.FIELD_OUTPUT_TOKENS: len(result.output_tokens),
                sc.FIELD_STEPS: len(lengths),
                sc.FIELD_MEAN_ACCEPTANCE: _rounded(mean_acceptance_length(lengths)),
                sc.FIELD_FINISH_REASON: result.finish_reason,
                sc.FIELD_BUDGET: info.budget,
                sc.FIELD_TOPK: info.topk,
            }
            found = self.paths.finish(result)
            if found is not None:
                fields[sc.FIELD_PATH_STEPS], fields[sc.FIELD_ACCEPTED_PATHS] = found
            if self.log_content:
                fields[sc.FIELD_PROMPT_TOKEN_IDS] = prompt
                fields[sc.FIELD_OUTPUT_TOKEN_IDS] = result.output_tokens
            self.log.info(sc.EVENT_REQUEST, **fields)


def sampled(step: int, share: float) -> bool:
    """Whether step `step` is one of the `share` of steps kept (evenly spread, the same on every run)."""
    return int((step + 1) * share) != int(step * share)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
