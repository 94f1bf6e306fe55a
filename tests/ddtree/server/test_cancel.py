"""Cancellation: a job cancelled mid-generation or while waiting frees its slot; a client that drops a stream
cancels its request (a real uvicorn server on a free port)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from ddtree.engine.requests import Request
from ddtree.server.app import ServerState, create_app
from ddtree.server.model import ServedModel
from ddtree.server.worker import DecodeWorker, Job, Update
from tests.ddtree.server.conftest import settings_for
from tests.ddtree.server.support import encode, wait_until


@pytest.fixture
def worker(served: ServedModel) -> Iterator[DecodeWorker]:
    w = DecodeWorker(lambda: served.new_session(2), max_queue=4)
    w.start()
    yield w
    w.stop()
    assert not w.alive


def test_a_job_cancelled_mid_generation_leaves_its_slot(worker: DecodeWorker, served: ServedModel) -> None:
    updates: queue.Queue[Update] = queue.Queue()
    job = Job(Request(encode(served, "Hello"), 100), updates.put)
    other = Job(Request(encode(served, "tree"), 12), lambda update: None)
    worker.step_hook = lambda steps, slots: worker.cancel(job) if steps == 3 else None
    worker.submit(job)
    worker.submit(other)
    wait_until(lambda: worker.cancelled == 1 and worker.running() == 0)
    assert worker.session is not None and len(worker.session.free_slots()) == 2
    got = []
    while not updates.empty():
        got.append(updates.get())
    assert got and all(u.finish_reason is None and u.error is None for u in got)  # no end: it was cut off
    assert 1 <= sum(len(u.token_ids) for u in got) < 100


def test_a_waiting_job_cancelled_never_runs(worker: DecodeWorker, served: ServedModel) -> None:
    worker.pause()
    updates: list[Update] = []
    job = Job(Request(encode(served, "Hello"), 5), updates.append)
    worker.submit(job)
    assert worker.waiting() == 1
    worker.cancel(job)
    assert worker.waiting() == 0
    worker.resume()
    done: list[Update] = []
    worker.submit(Job(Request(encode(served, "x"), 3), done.append))
    wait_until(lambda: bool(done) and done[-1].finish_reason is not None)
    assert updates == [] and worker.cancelled == 0


@pytest.fixture
def live(tiny_dirs: tuple[Path, Path], served: ServedModel) -> Iterator[tuple[str, ServerState]]:
    """A real uvicorn server on a free port, in a thread; its URL and state."""
    app = create_app(settings_for(tiny_dirs), served)
    state: ServerState = app.state.ddtree
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", state
    finally:
        server.should_exit = True
        thread.join(10)
    assert not thread.is_alive() and not state.worker.alive


BODY = {"prompt": "Hello", "max_tokens": 150, "temperature": 0}


def test_a_dropped_stream_cancels_its_request(live: tuple[str, ServerState]) -> None:
    url, state = live
    state.worker.step_hook = lambda steps, slots: time.sleep(0.02)  # 150 tokens would take seconds
    with (
        httpx.Client(timeout=10) as http,
        http.stream("POST", f"{url}/v1/completions", json={**BODY, "stream": True}) as response,
    ):
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert '"text"' in first and state.worker.running() == 1
    wait_until(lambda: state.worker.running() == 0, timeout=5)
    assert state.worker.cancelled == 1 and state.worker.steps < 100


def test_a_client_gone_before_a_whole_response_cancels_its_request(live: tuple[str, ServerState]) -> None:
    url, state = live
    started = threading.Event()

    def slow(steps: int, slots: int) -> None:
        started.set()
        time.sleep(0.02)

    state.worker.step_hook = slow
    with httpx.Client(timeout=httpx.Timeout(10, read=0.3)) as http, pytest.raises(httpx.ReadTimeout):
        http.post(f"{url}/v1/completions", json=BODY)
    assert started.is_set()
    wait_until(lambda: state.worker.running() == 0, timeout=5)
    assert state.worker.cancelled == 1 and state.worker.steps < 100
    wait_until(lambda: 'status="499"' in httpx.get(f"{url}/metrics").text, timeout=5)


def test_a_first_token_read_at_the_join_goes_out_before_the_next_step(
    worker: DecodeWorker, served: ServedModel
) -> None:
    """A session without pipelining reads the prefill's token at the join: the round that delivers it is
    handed on (`delivered`) at once, not after the step that follows."""
    events: list[str] = []
    worker.delivered = lambda: events.append("delivered")
    worker.step_hook = lambda steps, slots: events.append("step")
    done: list[Update] = []
    job = Job(Request(encode(served, "Hello"), 4), lambda u: (events.append("update"), done.append(u)))
    worker.submit(job)
    wait_until(lambda: bool(done) and done[-1].finish_reason is not None)
    assert worker.session is not None and worker.session.pipeline_depth == 1
    assert events[:2] == ["update", "delivered"]  # before: the next step's update and hook came first
    assert events.index("delivered") < events.index("step")
