"""A live telemetry exporter for tests: what its Prometheus endpoint serves, read over HTTP.

`dead_endpoint()` is a loopback port nobody listens on; `STAND_IN_NVML` is a `pynvml` module that the
exporter process imports instead of NVML when its directory comes first on the path (CI has no GPU).
"""

from __future__ import annotations

import re
import socket
import time
import urllib.request
from collections.abc import Callable

STAND_IN_NVML = """
from types import SimpleNamespace as ns
NVML_GPU_UTILIZATION_SAMPLES, NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 2, 3
def nvmlInit(): pass
def nvmlDeviceGetCount(): return 1
def nvmlDeviceGetHandleByIndex(i): return i
def nvmlDeviceGetSamples(handle, kind, since): return 0, []
def nvmlDeviceGetUtilizationRates(handle): return ns(gpu=7)
def nvmlDeviceGetMemoryInfo(handle): return ns(used=1024)
def nvmlDeviceGetPowerUsage(handle): return 150000
def nvmlDeviceGetClockInfo(handle, kind): return 1980
def nvmlDeviceGetTemperature(handle, kind): return 41
"""

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="')


def dead_endpoint() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def scrape(port: int) -> dict[str, list[tuple[set[str], float]]]:
    """Metric name -> (label names, value) of each sample the endpoint serves now."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    samples: dict[str, list[tuple[set[str], float]]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            labels = set(_LABEL.findall(match.group(2) or ""))
            samples.setdefault(match.group(1), []).append((labels, float(match.group(3))))
    return samples


def total(samples: dict[str, list[tuple[set[str], float]]], name: str) -> float:
    return sum(value for _, value in samples.get(name, []))


def scrape_until(
    port: int, done: Callable[[dict[str, list[tuple[set[str], float]]]], bool], timeout_s: float = 30.0
) -> dict[str, list[tuple[set[str], float]]]:
    """Scrape every 0.2 s until `done` says so or the time is up; the last scrape."""
    deadline = time.monotonic() + timeout_s
    samples = scrape(port)
    while not done(samples) and time.monotonic() < deadline:
        time.sleep(0.2)
        samples = scrape(port)
    return samples
