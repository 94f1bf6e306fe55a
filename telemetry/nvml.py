"""NVML sampler: one daemon thread reads each GPU's utilisation, memory, power, SM clock and temperature
at a fixed interval and sets OTel gauges. Without NVML it logs one line and does nothing else.

Utilisation comes from `nvmlDeviceGetSamples` (the driver's own samples since the last read, averaged), so
short bursts between two reads are not missed; where the driver has none, a point query stands in.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from telemetry import semconv as sc


class NvmlSampler:
    def __init__(self, meter: Any, interval_ms: int, log: Any) -> None:
        self.interval = interval_ms / 1000
        self.log = log
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.last_sample_us: dict[int, int] = {}
        self.gauges = {
            "util": meter.create_gauge(sc.METRIC_GPU_UTILIZATION, unit=sc.UNIT_PERCENT, description="GPU busy time"),
            "mem": meter.create_gauge(sc.METRIC_GPU_MEMORY_USED, unit=sc.UNIT_BYTES, description="GPU memory used"),
            "power": meter.create_gauge(sc.METRIC_GPU_POWER, unit=sc.UNIT_WATTS, description="GPU power draw"),
            "clock": meter.create_gauge(sc.METRIC_GPU_SM_CLOCK, unit=sc.UNIT_HERTZ, description="SM clock"),
            "temp": meter.create_gauge(sc.METRIC_GPU_TEMPERATURE, unit=sc.UNIT_CELSIUS, description="GPU temperature"),
        }

    def start(self) -> bool:
        """Start sampling; False (with one log line) when NVML or a GPU is not there."""
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception as exc:  # NVML missing, no driver, no GPU: all mean "no samples"
            self.log.info(sc.EVENT_TELEMETRY, nvml="unavailable", reason=str(exc) or type(exc).__name__)
            return False
        self.thread = threading.Thread(target=self._run, args=(pynvml, handles), name="ddtree-nvml", daemon=True)
        self.thread.start()
        return True

    def _run(self, nvml: Any, handles: list[Any]) -> None:
        while not self.stop_event.is_set():
            for index, handle in enumerate(handles):
                try:
                    self._sample(nvml, handle, index)
                except Exception as exc:  # a failing query must not end decoding
                    self.log.info(sc.EVENT_TELEMETRY, nvml="sample failed", reason=str(exc))
                    return
            self.stop_event.wait(self.interval)

    def _sample(self, nvml: Any, handle: Any, index: int) -> None:
        labels = {sc.LABEL_GPU: str(index)}
        util, memory = self._utilization(nvml, handle, index), nvml.nvmlDeviceGetMemoryInfo(handle).used
        power = nvml.nvmlDeviceGetPowerUsage(handle) / 1000
        self.gauges["util"].set(util, labels)
        self.gauges["mem"].set(memory, labels)
        self.gauges["power"].set(power, labels)
        self.gauges["clock"].set(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM) * 1e6, labels)
        self.gauges["temp"].set(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU), labels)
        fields = {sc.FIELD_GPU_UTILIZATION: util, sc.FIELD_GPU_MEMORY_USED: memory, sc.FIELD_GPU_POWER: power}
        self.log.info(sc.EVENT_GPU, **{sc.FIELD_GPU: index, sc.FIELD_TIME_NS: time.time_ns()}, **fields)

    def _utilization(self, nvml: Any, handle: Any, index: int) -> float:
        try:
            _, samples = nvml.nvmlDeviceGetSamples(
                handle, nvml.NVML_GPU_UTILIZATION_SAMPLES, self.last_sample_us.get(index, 0)
            )
        except Exception:  # not supported on this GPU or driver: fall back to the point query
            samples = []
        if samples:
            self.last_sample_us[index] = max(s.timeStamp for s in samples)
            return float(sum(s.sampleValue.uiVal for s in samples) / len(samples))
        return float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=2)
