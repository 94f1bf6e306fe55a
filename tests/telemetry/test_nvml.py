"""The NVML sampler against a stand-in `pynvml` module (CI has no GPU), and without NVML at all."""

from __future__ import annotations

import io
import json
import sys
import time
import types
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from telemetry import semconv as sc
from telemetry.config import TelemetryConfig
from telemetry.logging import make_logger
from telemetry.nvml import NvmlSampler


def fake_nvml(samples: bool) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")
    ns = types.SimpleNamespace
    nvml.NVML_GPU_UTILIZATION_SAMPLES, nvml.NVML_CLOCK_SM, nvml.NVML_TEMPERATURE_GPU = 1, 2, 3
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetCount = lambda: 1
    nvml.nvmlDeviceGetHandleByIndex = lambda i: f"gpu{i}"
    got = [ns(timeStamp=10, sampleValue=ns(uiVal=40)), ns(timeStamp=20, sampleValue=ns(uiVal=60))] if samples else []
    nvml.nvmlDeviceGetSamples = lambda h, kind, since: (0, got)
    nvml.nvmlDeviceGetUtilizationRates = lambda h: ns(gpu=7)
    nvml.nvmlDeviceGetMemoryInfo = lambda h: ns(used=1024)
    nvml.nvmlDeviceGetPowerUsage = lambda h: 150_000  # milliwatts
    nvml.nvmlDeviceGetClockInfo = lambda h, kind: 1980  # MHz
    nvml.nvmlDeviceGetTemperature = lambda h, kind: 41
    return nvml


def run_sampler(monkeypatch: pytest.MonkeyPatch, module: Any) -> tuple[bool, dict[str, float], str]:
    monkeypatch.setitem(sys.modules, "pynvml", module)
    reader = InMemoryMetricReader()
    log = io.StringIO()
    sampler = NvmlSampler(
        MeterProvider(metric_readers=[reader]).get_meter("t"), 10, make_logger(TelemetryConfig(), log)
    )
    started = sampler.start()
    time.sleep(0.1)
    sampler.stop()
    values: dict[str, float] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                values[metric.name] = metric.data.data_points[0].value
    return started, values, log.getvalue()


@pytest.mark.parametrize(("samples", "utilization"), [(True, 50.0), (False, 7.0)])
def test_gauges_from_nvml(monkeypatch: pytest.MonkeyPatch, samples: bool, utilization: float) -> None:
    started, values, _ = run_sampler(monkeypatch, fake_nvml(samples))
    assert started
    assert values == {
        sc.METRIC_GPU_UTILIZATION: utilization,
        sc.METRIC_GPU_MEMORY_USED: 1024,
        sc.METRIC_GPU_POWER: 150.0,
        sc.METRIC_GPU_SM_CLOCK: 1980e6,
        sc.METRIC_GPU_TEMPERATURE: 41,
    }


def test_without_nvml_one_line_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = types.ModuleType("pynvml")

    def fail() -> None:
        raise OSError("NVML Shared Library Not Found")

    broken.nvmlInit = fail  # type: ignore[attr-defined]
    started, values, log = run_sampler(monkeypatch, broken)
    assert not started and values == {}
    lines = [json.loads(line) for line in log.splitlines()]
    assert len(lines) == 1 and lines[0]["nvml"] == "unavailable" and "Not Found" in lines[0]["reason"]
