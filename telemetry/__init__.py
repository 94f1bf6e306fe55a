"""Observability for speculative decoding: hooks, names, and (when enabled) exporters.

`start_telemetry()` reads the environment. With `DDTREE_DEBUG_METRICS` off it returns the no-op observer
and imports nothing from OpenTelemetry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ddtree.observer import NOOP, NoopObserver, StepObserver
from telemetry.config import TelemetryConfig, TelemetryConfigError

__all__ = ["NOOP", "NoopObserver", "StepObserver", "TelemetryConfig", "TelemetryConfigError", "start_telemetry"]


class _Off:
    observer: StepObserver = NOOP
    prometheus_port: int | None = None

    def dropped(self) -> dict[str, int]:
        return {}

    def shutdown(self, timeout_s: float = 0.0) -> None:
        pass


def start_telemetry(
    config: TelemetryConfig | None = None,
    device_type: str = "cpu",
    model_name: str = "",
    detokenize: Callable[[list[int]], str] | None = None,
) -> Any:
    """Set up telemetry from `config` (default: the environment). Returns an object with `observer`,
    `prometheus_port`, `dropped()` (records dropped so far, by kind) and `shutdown()`."""
    config = config or TelemetryConfig.from_env()
    if not config.enabled:
        return _Off()
    from telemetry.setup import build

    return build(config, device_type, model_name, detokenize)
