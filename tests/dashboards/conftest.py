"""A served run for the dashboard tests: a real `ddtree serve` app under uvicorn with DDTREE_DEBUG_METRICS=1
(a dead trace endpoint, so that dropped spans are counted), a telemetry exporter with a stand-in NVML for the
GPU gauges (CI has no GPU), and, where Debian's `prometheus` is installed, a real Prometheus scraping both
while concurrent requests run."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from ddtree.server.app import create_app
from ddtree.server.model import load_model
from telemetry import TelemetryConfig, start_telemetry
from telemetry import semconv as sc
from tests.ddtree.server.conftest import settings_for
from tests.ddtree.server.support import live_server
from tests.telemetry import test_prometheus as prom
from tests.telemetry.live import STAND_IN_NVML, dead_endpoint, scrape

PROMPTS = ["the draft tree", "grows from the root", "and the target", "checks every node", "x", "a b c d e f"]
Served = dict[str, set[str]]  # metric name -> the label names it is served with


@dataclass
class Run:
    url: str  # the server's
    gpu_port: int  # the stand-in GPU exporter's
    prometheus_port: int | None  # None: no prometheus binary here
    served: Served  # what both endpoints served once the load was done


def wait_for(done: Callable[[], bool], timeout: float = 60.0) -> bool:
    """Poll every half second until `done()`; whether it came true in time."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


@contextmanager
def prometheus(config: str, data: Path) -> Iterator[int]:
    """A Prometheus server on `config` (YAML text); its port."""
    binary = shutil.which("prometheus")
    assert binary is not None, "CI must install Debian's prometheus"
    data.mkdir(parents=True)
    (data / "prometheus.yml").write_text(config)
    port = prom._free_port()
    argv = [
        binary,
        f"--config.file={data / 'prometheus.yml'}",
        f"--storage.tsdb.path={data / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield port
    finally:
        server.terminate()
        server.wait(timeout=10)


def query(port: int, promql: str) -> list[dict[str, object]] | None:
    """The query's result rows; None while Prometheus is not answering yet."""
    try:
        return prom._query(port, promql)  # asserts that Prometheus accepted the query
    except OSError:
        return None


def value(port: int, promql: str) -> float | None:
    """The first row's value; None without one."""
    rows = query(port, promql)
    return float(rows[0]["value"][1]) if rows else None  # type: ignore[index]


def _ask(url: str, i: int) -> None:
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 24, "temperature": 0, "stream": i % 2 == 1}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text


def _served(*ports: int) -> Served:
    names: Served = {}
    for port in ports:
        for name, rows in scrape(port).items():
            names.setdefault(name, set()).update(*(labels for labels, _ in rows))
    return names


def _config(server: str, gpu: int) -> str:
    return (
        "global:\n  scrape_interval: 1s\nscrape_configs:\n"
        f"  - job_name: ddtree\n    static_configs:\n      - targets: ['{server}']\n"
        f"  - job_name: gpu\n    static_configs:\n      - targets: ['127.0.0.1:{gpu}']\n"
    )


@pytest.fixture(scope="module")
def run(tiny_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("served")
    (tmp / "pynvml.py").write_text(STAND_IN_NVML)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(tmp))  # the exporter process imports the stand-in pynvml
        for name, value in {
            "DDTREE_DEBUG_METRICS": "1",
            "OTEL_METRICS_EXPORTER": "prometheus",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": dead_endpoint(),  # spans are dropped and counted
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "DDTREE_LOG_FILE": str(tmp / "steps.jsonl"),
        }.items():
            mp.setenv(name, value)
        settings = settings_for(tiny_dirs, max_batch_size=4)
        served = load_model(settings)
        gpu_config = TelemetryConfig(
            enabled=True,
            traces_exporter="none",
            metrics_exporter="prometheus",
            prometheus_port=0,
            nvml_interval_ms=50,
            log_file=str(tmp / "gpu.jsonl"),
        )
        gpu = start_telemetry(gpu_config, "cuda")
    try:
        with live_server(create_app(settings, served)) as (url, _, _):
            yield from _under_load(url, gpu.prometheus_port, tmp)
    finally:
        gpu.shutdown()


def _under_load(url: str, gpu_port: int, tmp: Path) -> Iterator[Run]:
    with maybe_prometheus(_config(url.removeprefix("http://"), gpu_port), tmp / "prometheus") as port:
        if port is not None:  # scraping before the load starts
            assert wait_for(lambda: value(port, "count(up == 1)") == 2.0)
        with ThreadPoolExecutor(4) as pool:  # concurrent requests: batched steps
            list(pool.map(lambda i: _ask(url, i), range(2 * len(PROMPTS))))
        server_port = int(url.rsplit(":", 1)[1])
        generated = sum(v for _, v in scrape(server_port).get(sc.PROM_GENERATION_TOKENS_TOTAL, []))
        assert generated > 2 * len(PROMPTS)  # tokens past each request's first one came from decode steps
        assert wait_for(lambda: any("dropped_spans" in n for n in scrape(server_port)))
        # the exporter process's step metrics trail the responses (more so on a loaded machine)
        assert wait_for(lambda: f"{sc.PROM_ACCEPTANCE_LENGTH}_count" in scrape(server_port))
        assert wait_for(lambda: any("gpu" in n for n in scrape(gpu_port)))
        yield Run(url, gpu_port, port, _served(server_port, gpu_port))


@contextmanager
def maybe_prometheus(config: str, data: Path) -> Iterator[int | None]:
    """`prometheus(config, data)` where the binary is installed, else None (the tests that need it skip)."""
    if shutil.which("prometheus") is None:
        yield None
        return
    with prometheus(config, data) as port:
        yield port
