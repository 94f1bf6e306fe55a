"""Telemetry in a decode process: the collector beside decoding, its sinks in an exporter process.

`build` is what `telemetry.start_telemetry` runs when telemetry is on; `Telemetry` is what it returns.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from telemetry.collector import Collector
from telemetry.config import TelemetryConfig
from telemetry.process import ExporterProcess


@dataclass
class Telemetry:
    """What `start_telemetry` returns: the observer to hand the engine, and how to stop it all."""

    observer: Any
    prometheus_port: int | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)
    dropped: Callable[[], dict[str, int]] = dict  # records dropped so far, by kind (`semconv.DROPPED_*`)
    drain: Callable[[], bool] = lambda: True  # wait while the exporter takes what is queued (see `shutdown`)

    def shutdown(self, timeout_s: float = 3.0) -> None:
        """Hand the exporter every record (for as long as it keeps taking them: a backlog is not cut short, a
        stalled sink is given up on within seconds), then flush and stop the exporters, bounded by `timeout_s`:
        a dead endpoint cannot hang the exit."""
        flush = getattr(self.observer, "flush", None)
        if flush is not None:
            flush(timeout_s)  # the hand-off thread's records reach the queue
        self.drain()
        worker = threading.Thread(target=self._close_all, daemon=True)
        worker.start()
        worker.join(timeout_s)

    def _close_all(self) -> None:
        for close in self.closers:
            with contextlib.suppress(Exception):  # shutting down: nothing left to protect but the exit
                close()


def build(
    config: TelemetryConfig, device_type: str, model_name: str, detokenize: Callable[[list[int]], str] | None
) -> Telemetry:
    """The collector in this process; its sinks in an exporter process (`telemetry.process`)."""
    exporter = ExporterProcess(config, device_type, model_name, detokenize)
    # On CUDA the decode thread waits for the device every step: the collector's work runs in that wait.
    collector = Collector(
        [exporter],
        device_type,
        handoff=device_type == "cuda",
        dropped=lambda step: exporter.ledger.add_steps([step]),
    )
    return Telemetry(
        observer=collector,
        prometheus_port=exporter.prometheus_port,
        closers=[collector.close, exporter.close],
        dropped=exporter.dropped,
        drain=exporter.drain,
    )
