"""A sink that stops draining, and a host too loaded to give the exporter any time: decoding never waits for
telemetry, what is dropped is counted exactly and said in the log, and with room to spare nothing is dropped."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path
from typing import Any

import pytest

from ddtree.engine.engine import Engine, GenerationResult
from ddtree.settings import GenerationConfig
from telemetry import TelemetryConfig, process, start_telemetry
from telemetry import semconv as sc
from tests.helpers import random_prompts, tiny_pair

DECODE_BOUND_S = 120.0  # decoding that waited for the stalled sink would never end; this only bounds the test


def config(log_file: Path, **kwargs: Any) -> TelemetryConfig:
    return TelemetryConfig(
        enabled=True, traces_exporter="none", metrics_exporter="none", log_file=str(log_file), **kwargs
    )


def generate_in_time(engine: Engine, prompts: list[list[int]], new_tokens: int) -> GenerationResult:
    """`engine.generate` on a thread of its own, which must end within `DECODE_BOUND_S`."""
    config = GenerationConfig(budget=8, max_new_tokens=new_tokens)
    with ThreadPoolExecutor(1) as pool:
        try:
            return pool.submit(engine.generate, prompts, config).result(DECODE_BOUND_S)
        except FuturesTimeout:
            pytest.fail("decoding waited for telemetry")


@pytest.fixture
def stalled_pipe(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A named pipe with a reader that reads nothing (yet), its buffer at the minimum (a page)."""
    fifo = tmp_path / "log.pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    fcntl.fcntl(reader, fcntl.F_SETPIPE_SZ, 4096)
    yield fifo, reader
    os.close(reader)


def drain(reader: int) -> tuple[threading.Thread, list[bytes]]:
    """Start reading the pipe to its end, on a thread."""
    chunks: list[bytes] = []
    os.set_blocking(reader, True)

    def read() -> None:
        while chunk := os.read(reader, 1 << 16):
            chunks.append(chunk)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, chunks


def test_a_stalled_log_pipe_costs_counted_records_never_a_stalled_step(
    stalled_pipe: tuple[Path, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    fifo, reader = stalled_pipe
    monkeypatch.setattr(process, "RECORD_BYTES", 1 << 17)  # eight step records fill the queue's MiB
    telemetry = start_telemetry(config(fifo, buffer_mb=1))
    target, drafter = tiny_pair(6, vocab=16)
    result = generate_in_time(Engine(target, drafter, observer=telemetry.observer), random_prompts(6, 2, 16), 300)
    thread, chunks = drain(reader)
    telemetry.shutdown(timeout_s=60)
    thread.join(30)
    lines = [json.loads(line) for line in b"".join(chunks).decode().splitlines()]
    logged = [line[sc.FIELD_STEP] for line in lines if line["event"] == sc.EVENT_STEP]
    reports = [line for line in lines if line["event"] == sc.EVENT_TELEMETRY and sc.FIELD_DROPPED_STEPS in line]
    dropped = [step for line in reports for step in line[sc.FIELD_DROPPED_STEP_IDS]]
    assert dropped, "the stalled pipe filled the queue"
    assert sum(line[sc.FIELD_DROPPED_STEPS] for line in reports) == len(dropped)
    assert sorted(logged + dropped) == list(range(result.steps)), "every step is logged or said dropped, once"
    assert telemetry.dropped()[sc.DROPPED_STEP] == len(dropped)
    assert reports[-1][sc.FIELD_DROPPED_TOTAL] == sum(telemetry.dropped().values())
    requests = [line for line in lines if line["event"] == sc.EVENT_REQUEST]
    own_steps = sorted(len(o.acceptance_lengths) for o in result.outputs)
    assert sorted(line[sc.FIELD_STEPS] for line in requests) == own_steps, "request lines keep their step counts"


def test_an_exporter_without_cpu_time_loses_nothing(tmp_path: Path) -> None:
    """The most loaded host there is: the exporter process stopped (SIGSTOP) while a batch decodes. Records
    wait in the queue; once it runs again, every step reaches the log and nothing is counted as dropped."""
    telemetry = start_telemetry(config(tmp_path / "steps.jsonl"))
    exporter: Any = telemetry.observer.sinks[0]
    target, drafter = tiny_pair(7, vocab=16)
    os.kill(exporter.process.pid, signal.SIGSTOP)
    try:
        result = generate_in_time(Engine(target, drafter, observer=telemetry.observer), random_prompts(7, 4, 16), 120)
    finally:
        os.kill(exporter.process.pid, signal.SIGCONT)
    telemetry.shutdown(timeout_s=60)
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    steps = [line for line in lines if line["event"] == sc.EVENT_STEP]
    assert sorted(line[sc.FIELD_STEP] for line in steps) == list(range(result.steps))
    requests = [line for line in lines if line["event"] == sc.EVENT_REQUEST]
    assert sum(sum(line[sc.FIELD_EMITTED]) for line in steps) + len(requests) == result.new_tokens
    assert telemetry.dropped() == {sc.DROPPED_STEP: 0, sc.DROPPED_REQUEST: 0}
    assert not any(line["event"] == sc.EVENT_TELEMETRY and sc.FIELD_DROPPED_STEPS in line for line in lines)


PARENT = """
import os, sys
from ddtree.engine.engine import Engine
from ddtree.settings import GenerationConfig
from telemetry import TelemetryConfig, start_telemetry
from tests.helpers import random_prompts, tiny_pair
config = TelemetryConfig(enabled=True, traces_exporter="none", metrics_exporter="none", log_file=sys.argv[1])
t = start_telemetry(config)
print(t.observer.sinks[0].process.pid, flush=True)
target, drafter = tiny_pair(8, vocab=16)
Engine(target, drafter, observer=t.observer).generate(random_prompts(8, 2, 16), GenerationConfig(max_new_tokens=60))
os._exit(0)  # no shutdown: the way a crash or a kill ends a server
"""


@pytest.mark.parametrize("stalled", [False, True], ids=["file", "stalled-pipe"])
def test_the_exporter_process_ends_with_its_parent(
    tmp_path: Path, stalled_pipe: tuple[Path, int], stalled: bool
) -> None:
    """Also when the exporter is blocked writing to a pipe that no one drains, where it never reads again."""
    log = stalled_pipe[0] if stalled else tmp_path / "log.jsonl"
    parent = subprocess.Popen(  # the exporter shares its stdout: read its first line, never wait for the end
        [sys.executable, "-c", PARENT, str(log)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    assert parent.wait(120) == 0
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the exporter process outlived its parent"


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie whose parent is gone counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
