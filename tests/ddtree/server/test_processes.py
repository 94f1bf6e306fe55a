"""`ddtree serve` as processes: an engine core process and API server processes, checked with real processes.

The output is the target's alone through any API process, `/metrics` is one exact view of them all, and the
faults end cleanly: a client gone or an API process killed frees its slots, a killed engine ends every open
request at once with a 5xx and the server with exit code 1, and nothing is left running.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddtree.server.model import ServedModel
from telemetry import semconv as sc
from tests.ddtree.server.support import ServeProcess, alone, encode, serve_process, wait_until

LONG = {"prompt": "one", "max_tokens": 1500, "temperature": 0}  # greedy on the tiny pair: no end-of-sequence
FLAGS = ("--budget", "8", "--max-model-len", "2048")


@pytest.fixture(scope="module")
def two_apis(tiny_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serve_process(tiny_dirs, log, *FLAGS, "--api-server-count", "2", "--max-batch-size", "4") as server:
        yield server
    assert server.proc.returncode == 0, server.text()  # SIGTERM: a graceful end
    assert not server.processes(workers_only=False), "nothing is left running"


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _metrics(url: str) -> Samples:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    families = text_string_to_metric_families(text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def _total(samples: Samples, name: str) -> float:
    return sum(value for (sample, _), value in samples.items() if sample == name)


def _stream(url: str, body: dict[str, object]) -> tuple[str, list[dict[str, object]]]:
    """A whole stream: its text and its events."""
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
    text = "".join(str(e["choices"][0]["text"]) for e in events if "choices" in e)  # type: ignore[index]
    return text, events


def test_greedy_output_through_any_api_process_is_the_targets_alone(
    two_apis: ServeProcess, served: ServedModel
) -> None:
    prompts = ["the draft tree", "grows from the root", "and the target", "checks every node"]
    bodies = [{"prompt": p, "max_tokens": 40, "temperature": 0} for p in prompts]
    with ThreadPoolExecutor(len(bodies)) as pool:
        whole = list(pool.map(lambda b: httpx.post(f"{two_apis.url}/v1/completions", json=b, timeout=120), bodies))
        streamed = list(pool.map(lambda b: _stream(two_apis.url, b)[0], bodies))
    for prompt, response, text in zip(prompts, whole, streamed, strict=True):
        expected = alone(served, encode(served, prompt), 40)[1]
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected
        assert text == expected


def test_metrics_sum_every_api_process_at_once(two_apis: ServeProcess) -> None:
    before = _metrics(two_apis.url)
    bodies = [{"prompt": f"count {i}", "max_tokens": 12, "temperature": 0} for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: httpx.post(f"{two_apis.url}/v1/completions", json=b, timeout=120), bodies))
    served_tokens = sum(a.json()["usage"]["completion_tokens"] for a in answers)
    steps = sum(a.json()["ddtree"]["steps"] for a in answers)
    for _ in range(6):  # the kernel spreads the scrapes over the API processes: each sees every one's counts
        after = _metrics(two_apis.url)
        assert _total(after, sc.PROM_GENERATION_TOKENS_TOTAL) - _total(before, sc.PROM_GENERATION_TOKENS_TOTAL) == (
            served_tokens
        )
        drafts = _total(after, sc.PROM_SPEC_DRAFTS_TOTAL) - _total(before, sc.PROM_SPEC_DRAFTS_TOTAL)
        assert drafts == steps
        for timed in (sc.PROM_REQUEST_QUEUE_TIME_SECONDS, sc.PROM_REQUEST_PREFILL_TIME_SECONDS):  # the engine's times
            count = f"{timed}_count"
            assert _total(after, count) - _total(before, count) == len(bodies), timed
        assert after[(sc.PROM_SLOTS, ())] == 4


def test_a_client_gone_frees_its_slot(two_apis: ServeProcess) -> None:
    with httpx.stream("POST", f"{two_apis.url}/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()  # held: an iterator dropped here would close the stream
        next(line for line in lines if line.startswith("data: "))
        wait_until(lambda: _metrics(two_apis.url)[(sc.PROM_RUNNING_REQUESTS, ())] == 1, timeout=5)
    wait_until(lambda: _metrics(two_apis.url)[(sc.PROM_RUNNING_REQUESTS, ())] == 0, timeout=5)


def test_a_killed_api_process_has_its_requests_cancelled_and_is_replaced(
    tiny_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    flags = (*FLAGS, "--api-server-count", "1", "--max-batch-size", "2")
    with serve_process(tiny_dirs, tmp_path / "serve.log", *flags) as server, ThreadPoolExecutor(2) as pool:
        engine, api = server.processes()
        streams = [pool.submit(_stream, server.url, LONG) for _ in range(2)]
        wait_until(lambda: _metrics(server.url)[(sc.PROM_RUNNING_REQUESTS, ())] == 2, timeout=30)
        api.kill()
        for stream in streams:
            with pytest.raises(httpx.HTTPError):
                stream.result(timeout=30)
        wait_until(lambda: "API process 0 is gone: 2 of its requests cancelled" in server.text(), timeout=10)
        wait_until(lambda: len(server.processes()) == 2, timeout=30)
        assert server.processes()[0].pid == engine.pid
        wait_until(lambda: _health(server.url) == 200, timeout=60)
        assert _metrics(server.url)[(sc.PROM_RUNNING_REQUESTS, ())] == 0  # the slots were freed
        body = {"prompt": "after", "max_tokens": 8, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    assert server.proc.returncode == 0


def test_a_killed_engine_fails_open_requests_at_once_and_the_server_exits_1(
    tiny_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    flags = (*FLAGS, "--api-server-count", "2", "--max-batch-size", "4")
    with serve_process(tiny_dirs, tmp_path / "serve.log", *flags) as server, ThreadPoolExecutor(4) as pool:
        engine = server.processes()[0]
        streams = [pool.submit(_stream, server.url, LONG) for _ in range(2)]
        whole = [pool.submit(httpx.post, f"{server.url}/v1/completions", json=LONG, timeout=60) for _ in range(2)]
        wait_until(lambda: _metrics(server.url)[(sc.PROM_RUNNING_REQUESTS, ())] == 4, timeout=30)
        engine.kill()
        killed = time.monotonic()
        for stream in streams:
            _, events = stream.result(timeout=10)
            assert events[-1]["error"]["type"] == "server_error", events[-1]  # type: ignore[index]
        for answer in whole:
            response = answer.result(timeout=10)
            assert response.status_code >= 500 and set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert time.monotonic() - killed < 1.0, "every open request ends within a second"
        assert server.proc.wait(30) == 1
    assert "the engine process died" in server.text()
    assert not server.processes(workers_only=False), "nothing is left running"


def _health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def test_an_engine_that_cannot_load_the_pair_is_one_line_and_exit_2(
    tiny_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    target, drafter = tiny_dirs
    broken = tmp_path / "target"
    shutil.copytree(target, broken)
    (broken / "tokenizer.json").write_text("[garbage")
    argv = [sys.executable, "-m", "ddtree.cli", "serve", "--model", str(broken), "--drafter", str(drafter)]
    proc = subprocess.run([*argv, "--port", "0"], capture_output=True, text=True, timeout=120, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ddtree: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "tokenizer.json" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_debug_metrics_come_from_the_engine_process_through_every_api_process(
    tiny_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """`DDTREE_DEBUG_METRICS=1`: telemetry runs in the engine process; its step log lists each request under
    the response's id, and its Prometheus metrics come through any API process's `/metrics`."""
    steps_log = tmp_path / "steps.jsonl"
    env = {
        "DDTREE_DEBUG_METRICS": "1",
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "prometheus",
        "DDTREE_LOG_FILE": str(steps_log),
        "DDTREE_NVML_INTERVAL_MS": "0",
    }
    flags = (*FLAGS, "--api-server-count", "2")
    served_tokens: dict[str, int] = {}
    with serve_process(tiny_dirs, tmp_path / "serve.log", *flags, env=env) as server:
        for prompt, tokens in (("abc", 12), ("hello there", 20), ("x", 7)):
            body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0}
            reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
            served_tokens[reply["id"]] = reply["usage"]["completion_tokens"]
        emitted = 0.0

        def caught_up() -> bool:  # the exporter gets steps in groups, within about a second
            nonlocal emitted
            emitted = _total(_metrics(server.url), sc.PROM_EMITTED_TOKENS_TOTAL)
            return emitted == sum(served_tokens.values())

        wait_until(caught_up, timeout=15)
    assert server.proc.returncode == 0
    lines = [json.loads(line) for line in steps_log.read_text().splitlines() if line.strip()]
    requests = {line[sc.FIELD_REQUEST_ID]: line for line in lines if line["event"] == sc.EVENT_REQUEST}
    assert {rid: r[sc.FIELD_OUTPUT_TOKENS] for rid, r in requests.items()} == served_tokens
