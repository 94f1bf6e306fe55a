"""The always-on metrics of `ddtree serve` reconcile exactly with what the responses say: concurrent requests
(whole and streamed, completions and chat) are summed from their `usage` and `ddtree` blocks and compared
with the scraped counters and histograms; the budget label follows a schedule; `ar` and `dflash` count their
own drafts; failed, aborted and stopped requests are counted by finish reason."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from ddtree.engine.session import DecodeSession
from ddtree.schedule import BudgetSchedule, Choice, write_schedule
from ddtree.server.app import create_app
from ddtree.server.metrics import ServerMetrics
from ddtree.server.model import ServedModel, load_model
from telemetry import semconv as sc
from tests.ddtree.server.conftest import BUDGET, settings_for
from tests.ddtree.server.support import alone, encode, live_server, state, wait_until

Samples = list[tuple[str, dict[str, str], float]]
WORDS = ["the", "draft", "tree", "grows", "from", "the", "root", "and", "the", "target", "checks", "every"]
CASES = 8  # the queue's size: on three slots, five of them wait for one
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def scrape(client: TestClient | str) -> Samples:
    text = client.get("/metrics").text if isinstance(client, TestClient) else httpx.get(f"{client}/metrics").text
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    return sum(v for n, ls, v in samples if n == name and labels.items() <= ls.items())


def _case(i: int) -> tuple[str, dict[str, Any], bool]:
    """Completions and chat, whole and streamed, prompts of 1..12 words, 1..40 new tokens."""
    words = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + (i * 5) % 12))
    chat, stream = i % 3 == 0, i % 2 == 1
    body: dict[str, Any] = {"max_tokens": 1 + (i * 11) % 40, "temperature": 0 if i % 4 else 0.8, "seed": i}
    body |= {"messages": [{"role": "user", "content": words}]} if chat else {"prompt": words}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, chat


def _ask(client: TestClient, i: int) -> dict[str, Any]:
    """The answer's operation, finish reason, `usage` and `ddtree` block."""
    path, body, chat = _case(i)
    reply = client.post(path, json=body)
    assert reply.status_code == 200, reply.text
    operation = sc.GEN_AI_OPERATION_CHAT if chat else sc.GEN_AI_OPERATION_TEXT_COMPLETION
    if not body.get("stream"):
        whole = reply.json()
        return {"op": operation, "finish": whole["choices"][0]["finish_reason"], **whole}
    chunks = [json.loads(line.removeprefix("data: ")) for line in reply.text.split("\n\n")[:-2]]
    finish = next(c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    return {"op": operation, "finish": finish, "usage": chunks[-1]["usage"], "ddtree": chunks[-1]["ddtree"]}


def _load(client: TestClient, cases: int, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """All cases at once: queued while the decode thread holds, then let go together."""
    monkeypatch.setattr(state(client).model.tokenizer, "chat_template", TEMPLATE)  # the tiny pair has none
    worker = state(client).worker
    worker.pause()
    with ThreadPoolExecutor(cases) as pool:
        futures = [pool.submit(_ask, client, i) for i in range(cases)]
        try:
            wait_until(lambda: worker.waiting() == cases)
        finally:
            worker.resume()
        return [f.result(60) for f in futures]


def _per_position(histogram: list[int]) -> dict[str, int]:
    """Entry i of a summed acceptance histogram counts steps that accepted i drafts: each reached depths 1..i."""
    return {str(p): sum(histogram[p:]) for p in range(1, len(histogram)) if sum(histogram[p:])}


def _summed_histogram(answers: list[dict[str, Any]]) -> list[int]:
    histograms = [a["ddtree"]["acceptance_histogram"] for a in answers]
    width = max(len(h) for h in histograms)
    return [sum(h[i] for h in histograms if i < len(h)) for i in range(width)]


def _check_speculation(samples: Samples, answers: list[dict[str, Any]], served: ServedModel) -> None:
    labels = {sc.LABEL_METHOD: served.generation.method, sc.LABEL_MODEL: served.model_id}
    steps = sum(a["ddtree"]["steps"] for a in answers)
    histogram = _summed_histogram(answers)
    accepted = sum(i * n for i, n in enumerate(histogram))
    assert steps > 0 and accepted > 0  # the tiny pair does accept drafts at T=0
    assert total(samples, sc.PROM_SPEC_DRAFTS_TOTAL, **labels) == steps
    assert total(samples, sc.PROM_SPEC_DRAFTS_TOTAL, **labels, budget=str(BUDGET)) == steps
    assert total(samples, sc.PROM_SPEC_DRAFT_TOKENS_TOTAL, **labels) == steps * BUDGET
    assert total(samples, sc.PROM_SPEC_ACCEPTED_TOKENS_TOTAL, **labels) == accepted
    per_pos = {ls[sc.LABEL_POSITION]: v for n, ls, v in samples if n == sc.PROM_SPEC_ACCEPTED_PER_POS_TOTAL and v}
    assert per_pos == _per_position(histogram)


def _check_request_acceptance(samples: Samples, answers: list[dict[str, Any]]) -> None:
    means = [a["ddtree"]["mean_acceptance_length"] for a in answers if a["ddtree"]["steps"]]
    assert 0 < len(means) < len(answers)  # requests of one token have no step and are not observed
    name = sc.PROM_SPEC_REQUEST_ACCEPTANCE_LENGTH
    assert total(samples, f"{name}_count") == len(means)
    assert total(samples, f"{name}_sum") == pytest.approx(math.fsum(means), rel=1e-12)  # float sums, any order
    buckets = {ls["le"]: v for n, ls, v in samples if n == f"{name}_bucket"}
    expected = {str(le): float(sum(m <= le for m in means)) for le in sc.REQUEST_ACCEPTANCE_LENGTH_BUCKETS}
    assert buckets == {**expected, "+Inf": float(len(means))}


def _check_requests(samples: Samples, answers: list[dict[str, Any]], served: ServedModel) -> None:
    for op in (sc.GEN_AI_OPERATION_TEXT_COMPLETION, sc.GEN_AI_OPERATION_CHAT):
        mine = [a for a in answers if a["op"] == op]
        assert mine, op
        labels = {sc.LABEL_GEN_AI_OPERATION: op, sc.LABEL_GEN_AI_MODEL: served.model_id}
        labels[sc.LABEL_GEN_AI_PROVIDER] = sc.GEN_AI_SYSTEM_DDTREE
        assert total(samples, sc.PROM_PROMPT_TOKENS_TOTAL, **labels) == sum(a["usage"]["prompt_tokens"] for a in mine)
        generated = sum(a["usage"]["completion_tokens"] for a in mine)
        assert total(samples, sc.PROM_GENERATION_TOKENS_TOTAL, **labels) == generated
        reasons = Counter(a["finish"] for a in mine)
        for reason in sc.FINISHED_REASONS:
            assert total(samples, sc.PROM_REQUEST_SUCCESS_TOTAL, **labels, finished_reason=reason) == reasons[reason]
        for histogram in (
            sc.PROM_REQUEST_DURATION_SECONDS,
            sc.PROM_REQUEST_QUEUE_TIME_SECONDS,
            sc.PROM_REQUEST_PREFILL_TIME_SECONDS,
        ):
            assert total(samples, f"{histogram}_count", **labels) == len(mine), histogram
        assert total(samples, f"{sc.PROM_TIME_TO_FIRST_TOKEN_SECONDS}_count", **labels) == len(mine)
        longer = sum(a["usage"]["completion_tokens"] > 1 for a in mine)
        assert total(samples, f"{sc.PROM_TIME_PER_OUTPUT_TOKEN_SECONDS}_count", **labels) == longer


def test_concurrent_requests_reconcile_with_the_scraped_metrics(
    client: TestClient, served: ServedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    answers = _load(client, CASES, monkeypatch)
    samples = scrape(client)
    _check_speculation(samples, answers, served)
    _check_request_acceptance(samples, answers)
    _check_requests(samples, answers, served)
    generated = sum(a["usage"]["completion_tokens"] for a in answers)
    assert total(samples, sc.PROM_GENERATED_TOKENS_TOTAL) == generated  # the older counter, by endpoint
    assert total(samples, sc.PROM_SLOTS) == 3 and total(samples, sc.PROM_RUNNING_REQUESTS) == 0


def test_no_created_series(client: TestClient) -> None:
    replies = [client.post("/v1/completions", json={"prompt": word, "max_tokens": 4}) for word in WORDS[:4]]
    assert all(r.status_code == 200 for r in replies)
    blocks = [r.json()["ddtree"] for r in replies]
    assert any(b["steps"] for b in blocks), f"no request took a decode step: {blocks}"  # else no draft to count
    names = {name for name, _, _ in scrape(client)}
    assert sc.PROM_SPEC_DRAFTS_TOTAL in names and f"{sc.PROM_REQUEST_DURATION_SECONDS}_count" in names
    assert not [name for name in names if name.endswith("_created")]


SCHEDULE = BudgetSchedule((Choice(1, "ddtree", 12), Choice(2, "ar"), Choice(3, "ddtree", 3, 2)))


@pytest.fixture(scope="module")
def scheduled(tiny_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    path = tmp_path_factory.mktemp("schedule") / "schedule.json"
    write_schedule(path, SCHEDULE)
    return load_model(settings_for(tiny_dirs, budget_schedule=str(path), auto_budget=True))


def test_the_budget_label_follows_the_schedule(
    tiny_dirs: tuple[Path, Path], scheduled: ServedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_for(tiny_dirs, budget_schedule="unused", auto_budget=True)
    with TestClient(create_app(settings, scheduled)) as client:
        answers = [*_load(client, 6, monkeypatch), _ask(client, 2)]  # then one alone (23 tokens), in slot 0
        samples = scrape(client)
    budgets = Counter(b for a in answers for b in a["ddtree"]["step_budgets"])
    assert {3, 12} <= set(budgets), budgets  # the load changed the tree
    by_budget = {ls[sc.LABEL_BUDGET]: v for n, ls, v in samples if n == sc.PROM_SPEC_DRAFTS_TOTAL}
    assert by_budget == {str(b): n for b, n in budgets.items()}
    assert total(samples, sc.PROM_SPEC_DRAFT_TOKENS_TOTAL) == sum(b * n for b, n in budgets.items())
    assert total(samples, sc.PROM_SPEC_ACCEPTED_TOKENS_TOTAL) == sum(
        i * n for i, n in enumerate(_summed_histogram(answers))
    )


@pytest.mark.parametrize("method", ["ar", "dflash"])
def test_ar_and_dflash_count_their_drafts(
    tiny_dirs: tuple[Path, Path], method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_for(tiny_dirs, method=method)
    served = load_model(settings)
    with TestClient(create_app(settings, served)) as client:
        answers = _load(client, 4, monkeypatch)
        samples = scrape(client)
    budget = answers[0]["ddtree"]["budget"]  # ar: 0, dflash: the drafter's depth
    assert budget == (0 if method == "ar" else 4)
    steps = sum(a["ddtree"]["steps"] for a in answers)
    labels = {sc.LABEL_METHOD: method, sc.LABEL_MODEL: served.model_id}
    assert total(samples, sc.PROM_SPEC_DRAFTS_TOTAL, **labels, budget=str(budget)) == steps > 0
    assert total(samples, sc.PROM_SPEC_DRAFT_TOKENS_TOTAL, **labels) == steps * budget
    histogram = _summed_histogram(answers)
    assert total(samples, sc.PROM_SPEC_ACCEPTED_TOKENS_TOTAL, **labels) == sum(i * n for i, n in enumerate(histogram))


def _reasons(samples: Samples) -> dict[str, float]:
    return {ls[sc.LABEL_FINISHED_REASON]: v for n, ls, v in samples if n == sc.PROM_REQUEST_SUCCESS_TOTAL and v}


def test_a_failed_request_is_counted_as_an_error_and_a_stop_string_as_stop(
    client: TestClient, served: ServedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = state(client).worker
    assert worker.session is not None
    real, failed = DecodeSession.step, []

    def broken(session: DecodeSession) -> list[int]:  # the first step of any session fails, the rest run
        if not failed:
            failed.append(session)
            raise RuntimeError("device lost")
        return real(session)

    monkeypatch.setattr(DecodeSession, "step", broken)
    answer = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8})
    assert answer.status_code == 500 and failed, answer.text
    _, text = alone(served, encode(served, "Hello"), 40)
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    body = {"prompt": "Hello", "max_tokens": 40, "temperature": 0, "stop": [stop]}
    stopped = client.post("/v1/completions", json=body).json()  # a fresh session
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert _reasons(scrape(client)) == {sc.FINISHED_ERROR: 1, "stop": 1}


@pytest.fixture
def live_url(tiny_dirs: tuple[Path, Path], served: ServedModel) -> Iterator[tuple[str, Any]]:
    app = create_app(settings_for(tiny_dirs), served)
    with live_server(app) as (url, _, _):
        yield url, app.state.ddtree


def test_a_dropped_stream_is_counted_as_an_abort(live_url: tuple[str, Any]) -> None:
    url, server = live_url
    server.worker.step_hook = lambda steps, slots: time.sleep(0.02)  # 150 tokens would take seconds
    body = {"prompt": "Hello", "max_tokens": 150, "temperature": 0, "stream": True}
    with httpx.Client(timeout=10) as http, http.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        next(line for line in response.iter_lines() if line.startswith("data: "))
    wait_until(lambda: _reasons(scrape(url)) == {sc.FINISHED_ABORT: 1}, timeout=10)
    samples = scrape(url)
    assert total(samples, f"{sc.PROM_REQUEST_DURATION_SECONDS}_count") == 1
    assert total(samples, sc.PROM_GENERATION_TOKENS_TOTAL) >= 1


def test_updates_are_counted_once_a_turn_and_always_before_a_scrape() -> None:
    metrics = ServerMetrics(lambda: 0, lambda: 0, model="m", method="ddtree")
    labels = metrics.gen_ai_labels(sc.GEN_AI_OPERATION_TEXT_COMPLETION)

    def accepted() -> float:
        return (
            metrics.registry.get_sample_value(
                sc.PROM_SPEC_ACCEPTED_TOKENS_TOTAL, {"method": "ddtree", "model_name": "m"}
            )
            or 0.0
        )

    metrics.took(labels, 3, [3], [8])  # no event loop: at once
    assert accepted() == 2

    async def on_the_loop() -> tuple[float, float, float]:
        metrics.took(labels, 4, [2, 3], [8, 8])
        held = accepted()  # not yet: the turn's updates are counted together
        scraped = b"ddtree_spec_decode_accepted_tokens_total" in metrics.exposition()[0] and accepted()
        metrics.took(labels, 1, [2], [8])
        await asyncio.sleep(0)
        return held, scraped, accepted()

    assert asyncio.run(on_the_loop()) == (2, 5, 6)
