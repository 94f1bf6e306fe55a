"""Step logs -> Chrome trace-event JSON (`ddtree analyze --trace-events FILE`), which Perfetto
(ui.perfetto.dev) and chrome://tracing open: one complete event ("ph": "X") per step, with its stages
nested inside it on the same track, one track per configuration.

A step line has its start time (`start_ns`) and its stages' durations; the stages run back to back from the
step's start, as the collector marks them. Events are written as they are read, so memory stays flat.

A step's args say how many requests decoded in it (`active_requests`) and how many rows it ran (`rows`,
padded; absent from old logs, whose `batch_size` is passed on under its own name). A warm-up step (it
carried compilation or graph capture) is in category `ddtree,warmup` and named so.
"""

from __future__ import annotations

import json
from typing import IO, Any

from telemetry import semconv as sc
from telemetry.analysis.steps import ConfigStats, active_requests, is_warmup, rows


class TraceEventWriter:
    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.tracks: dict[str, int] = {}
        self.events = 0
        self.stream.write('{"displayTimeUnit": "ms", "traceEvents": [\n')

    def add(self, record: dict[str, Any]) -> None:
        """One log object; only step lines with a start time become events."""
        if record.get("event") != sc.EVENT_STEP or not isinstance(record.get(sc.FIELD_START_NS), int):
            return
        label = ConfigStats(record[sc.FIELD_METHOD], record[sc.FIELD_BUDGET], record[sc.FIELD_TOPK]).label
        tid = self.tracks.get(label)
        if tid is None:
            tid = self.tracks[label] = len(self.tracks) + 1
            self._write({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": label}})
        start_us = record[sc.FIELD_START_NS] / 1000
        stages = record[sc.FIELD_STAGE_MS]
        end_ns = record.get(sc.FIELD_END_NS)
        total_us = (end_ns / 1000 - start_us) if isinstance(end_ns, int) else sum(stages.values()) * 1000
        warmup = is_warmup(record)
        args = _step_args(record) | {sc.FIELD_WARMUP: warmup}
        category = "ddtree,warmup" if warmup else "ddtree"
        name = f"{sc.SPAN_STEP} (warm-up)" if warmup else sc.SPAN_STEP
        self._write(_complete(name, start_us, total_us, tid, args, category))
        at = start_us
        for stage in sc.ALL_STAGES:
            if stage in stages:
                self._write(_complete(sc.stage_span_name(stage), at, stages[stage] * 1000, tid, {}, category))
                at += stages[stage] * 1000

    def close(self) -> None:
        self.stream.write("\n]}\n")

    def _write(self, event: dict[str, Any]) -> None:
        self.stream.write((",\n" if self.events else "") + json.dumps(event))
        self.events += 1


def _step_args(record: dict[str, Any]) -> dict[str, Any]:
    args = {
        sc.FIELD_STEP: record.get(sc.FIELD_STEP),
        sc.FIELD_ACTIVE_REQUESTS: active_requests(record),
        sc.FIELD_ROWS: rows(record),
        sc.FIELD_ACCEPTED_DRAFTS: record.get(sc.FIELD_ACCEPTED_DRAFTS),
        sc.FIELD_TREE_NODES: record.get(sc.FIELD_TREE_NODES),
        sc.FIELD_REQUEST_IDS: record.get(sc.FIELD_REQUEST_IDS),
    }
    if sc.FIELD_BATCH_SIZE in record:  # a log written before `active_requests` and `rows`
        args[sc.FIELD_BATCH_SIZE] = record[sc.FIELD_BATCH_SIZE]
    return args


def _complete(
    name: str, ts_us: float, dur_us: float, tid: int, args: dict[str, Any], category: str = "ddtree"
) -> dict[str, Any]:
    return {
        "name": name,
        "cat": category,
        "ph": "X",
        "ts": ts_us,
        "dur": max(dur_us, 0.0),
        "pid": 1,
        "tid": tid,
        "args": args,
    }
