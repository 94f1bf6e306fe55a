"""32 concurrent clients on a live server: every answer is its solo greedy output, and the counters reconcile
with the tokens served, on `/metrics` and through a real Prometheus server scraping during the load."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from ddtree.server.app import create_app
from ddtree.server.model import ServedModel
from telemetry import semconv as sc
from tests import tools
from tests.ddtree.server.conftest import settings_for
from tests.ddtree.server.support import alone, encode, live_server, wait_until
from tests.telemetry import test_prometheus as prom

CLIENTS = 32
WORDS = ["the", "draft", "tree", "grows", "from", "the", "root", "and", "the", "target", "checks", "every"]
COMPLETIONS_200 = f'{sc.PROM_HTTP_REQUESTS_TOTAL}{{endpoint="/v1/completions",status="200"}}'
GENERATED = f'{sc.PROM_GENERATED_TOKENS_TOTAL}{{endpoint="/v1/completions"}}'


@dataclass(frozen=True)
class Case:
    prompt: str
    max_tokens: int
    stream: bool
    text: str  # the solo greedy output
    tokens: int


@pytest.fixture(scope="module")
def cases(served: ServedModel) -> list[Case]:
    """Mixed prompt lengths (1..12 words) and output lengths (1..61 tokens), half of them streamed."""
    out = []
    for i in range(CLIENTS):
        prompt = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + (i * 7) % 12))
        max_tokens = 1 + (i * 13) % 61
        ids, text = alone(served, encode(served, prompt), max_tokens)
        out.append(Case(prompt, max_tokens, i % 2 == 1, text, len(ids)))
    return out


def _ask(url: str, case: Case) -> tuple[str, int]:
    """The text and completion tokens the server answers `case` with."""
    body: dict[str, Any] = {"prompt": case.prompt, "max_tokens": case.max_tokens, "temperature": 0}
    if not case.stream:
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        reply = response.json()
        return reply["choices"][0]["text"], reply["usage"]["completion_tokens"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    pieces, usage = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            data = line.removeprefix("data: ")
            if not line or data == "[DONE]":
                continue
            chunk = json.loads(data)
            pieces += [c["text"] for c in chunk["choices"]]
            usage = chunk.get("usage") or usage
    assert usage is not None
    return "".join(pieces), usage["completion_tokens"]


def _load(url: str, cases: list[Case]) -> int:
    """All cases at once, one thread each; checks every answer, returns the completion tokens served."""
    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(_ask, url, case) for case in cases]
        answers = [f.result(timeout=120) for f in futures]
    for case, (text, tokens) in zip(cases, answers, strict=True):
        assert (text, tokens) == (case.text, case.tokens), case
    return sum(tokens for _, tokens in answers)


def _samples(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    lines = [line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")]
    return {name: float(value) for name, value in lines}


@pytest.fixture
def server_url(tiny_dirs: tuple[Path, Path], served: ServedModel) -> Iterator[str]:
    app = create_app(settings_for(tiny_dirs, max_batch_size=8, max_queue=CLIENTS), served)
    with live_server(app) as (url, _, _):
        yield url


def test_32_clients_get_their_solo_greedy_outputs_and_the_counters_reconcile(
    server_url: str, cases: list[Case]
) -> None:
    served_tokens = _load(server_url, cases)
    assert served_tokens == sum(c.tokens for c in cases)
    wait_until(lambda: _samples(server_url).get(COMPLETIONS_200) == CLIENTS)  # streams count when they end
    samples = _samples(server_url)
    assert samples[COMPLETIONS_200] == CLIENTS
    assert samples[GENERATED] == served_tokens
    completions = {k: v for k, v in samples.items() if k.startswith(sc.PROM_HTTP_REQUESTS_TOTAL + "{")}
    assert sum(v for k, v in completions.items() if "/v1/completions" in k) == CLIENTS  # no 429, no 500
    first = f'{sc.PROM_TIME_TO_FIRST_TOKEN_SECONDS}_count{{endpoint="/v1/completions",'  # GenAI labels follow
    assert sum(v for k, v in samples.items() if k.startswith(first)) == CLIENTS
    longer = sum(c.tokens > 1 for c in cases)  # time per output token: requests of two or more tokens
    per_token = f'{sc.PROM_TIME_PER_OUTPUT_TOKEN_SECONDS}_count{{endpoint="/v1/completions",'
    assert sum(v for k, v in samples.items() if k.startswith(per_token)) == longer


@tools.PROMETHEUS
def test_prometheus_scraping_during_the_load_sees_the_tokens_served(
    server_url: str, cases: list[Case], tmp_path: Path
) -> None:
    prometheus = shutil.which("prometheus")
    assert prometheus is not None
    port = prom._free_port()
    target = server_url.removeprefix("http://")
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: ddtree\n    static_configs:\n"
        f"      - targets: ['{target}']\n"
    )
    server = subprocess.Popen(
        [
            prometheus,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(port, 'up{job="ddtree"}', 1.0)  # scraping before the load starts
        served_tokens = _load(server_url, cases)
        _wait_for(port, f"sum({sc.PROM_GENERATED_TOKENS_TOTAL})", float(served_tokens))
        _wait_for(port, f'sum({sc.PROM_HTTP_REQUESTS_TOTAL}{{endpoint="/v1/completions",status="200"}})', CLIENTS)
    finally:
        server.terminate()
        server.wait(timeout=10)


def _wait_for(port: int, promql: str, expected: float, timeout: float = 30.0) -> None:
    deadline, seen = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            rows = prom._query(port, promql)
        except OSError:  # Prometheus is still starting
            rows = []
        seen = float(rows[0]["value"][1]) if rows else None  # type: ignore[index]
        if seen == expected:
            return
        time.sleep(0.5)
    raise AssertionError(f"{promql} is {seen}, expected {expected}")
