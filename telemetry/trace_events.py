"""Step logs -> Chrome trace-event JSON (`ddtree analyze --trace-events FILE`), which Perfetto
(ui.perfetto.dev) and chrome://tracing open: one complete event ("ph": "X") per step, with its stages
nested inside it on the same track, one track per configuration.

A step line has its start time (`start_ns`) and its stages' durations; the stages run back to back from the
step's start, as the collector marks them. Events are written as they are read, so memory stays flat.
"""

from __future__ import annotations

import json
from typing import IO, Any

from telemetry import semconv as sc
from telemetry.analysis import ConfigStats


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
        args = {
            "step": record.get(sc.FIELD_STEP),
            "batch_size": record.get(sc.FIELD_BATCH_SIZE),
            "accepted_drafts": record.get(sc.FIELD_ACCEPTED_DRAFTS),
            "tree_nodes": record.get(sc.FIELD_TREE_NODES),
            "request_ids": record.get(sc.FIELD_REQUEST_IDS),
        }
        self._write(_complete(sc.SPAN_STEP, start_us, total_us, tid, args))
        at = start_us
        for stage in sc.STAGES:
            if stage in stages:
                self._write(_complete(sc.stage_span_name(stage), at, stages[stage] * 1000, tid, {}))
                at += stages[stage] * 1000

    def close(self) -> None:
        self.stream.write("\n]}\n")

    def _write(self, event: dict[str, Any]) -> None:
        self.stream.write((",\n" if self.events else "") + json.dumps(event))
        self.events += 1


def _complete(name: str, ts_us: float, dur_us: float, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "cat": "ddtree",
        "ph": "X",
        "ts": ts_us,
        "dur": max(dur_us, 0.0),
        "pid": 1,
        "tid": tid,
        "args": args,
    }
