"""The step-line contract as the analysis reads it: warm-up steps left out of time, missing steps found from the
request lines and the telemetry's drop reports, `advise` warning and refusing on incomplete logs, and old logs
(`batch_size`, no `warmup`) still read. Logs of real runs of a tiny pair, edited the way the telemetry would
have written them."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import pytest

from ddtree.cli.main import main
from ddtree.engine.engine import Engine
from ddtree.settings import GenerationConfig
from telemetry import semconv as sc
from telemetry.analysis.advise import REFUSE_BELOW, WARN_BELOW
from telemetry.analysis.cost import CostPoint, write_costs
from telemetry.analysis.digest import Digest
from telemetry.collector import Collector
from telemetry.config import TelemetryConfig
from telemetry.logging import LogSink, make_logger
from tests.helpers import random_prompts, tiny_pair

BUDGETS = (4, 16)
IDS = [f"r{i}" for i in range(4)]
Line = dict[str, Any]


@pytest.fixture(scope="module")
def run() -> tuple[list[Line], dict[int, float]]:
    """The lines of ddtree at two budgets on the same four requests, and each budget's real tau."""
    log = io.StringIO()
    sink = LogSink(make_logger(TelemetryConfig(), log), tree_share=0.5)
    engine = Engine(*tiny_pair(3, vocab=12, block_size=5), observer=Collector([sink], "cpu"))
    prompts = random_prompts(3, len(IDS), vocab=12)
    taus = {}
    for budget in BUDGETS:
        out = engine.generate(prompts, GenerationConfig(budget=budget, max_new_tokens=20), request_ids=IDS)
        lengths = [a for o in out.outputs for a in o.acceptance_lengths]
        taus[budget] = sum(lengths) / len(lengths)
    return [json.loads(line) for line in log.getvalue().splitlines()], taus


def _steps(lines: list[Line], budget: int | None = None) -> list[Line]:
    return [x for x in lines if x["event"] == sc.EVENT_STEP and budget in (None, x[sc.FIELD_BUDGET])]


def _write(tmp_path: Path, lines: list[Line], name: str = "log.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _digest(lines: list[Line]) -> Digest:
    return Digest.of(json.dumps(x) for x in lines)


def _with_warmup(lines: list[Line]) -> list[Line]:
    """The first step of each budget marked warm-up and made 100 times slower, as a graph capture would."""
    lines = copy.deepcopy(lines)
    for budget in BUDGETS:
        first = _steps(lines, budget)[0]
        first[sc.FIELD_WARMUP] = True
        first[sc.FIELD_STAGE_MS] = {s: ms * 100 for s, ms in first[sc.FIELD_STAGE_MS].items()}
        first[sc.FIELD_END_NS] = first[sc.FIELD_START_NS] + (first[sc.FIELD_END_NS] - first[sc.FIELD_START_NS]) * 100
    return lines


def _fixed_times(lines: list[Line], step_ms: float = 2.0) -> list[Line]:
    """The steps re-timed back to back at `step_ms` each (stage times scaled to match), so that what is
    compared with the clock's readings does not depend on how busy this machine was during the run."""
    lines = copy.deepcopy(lines)
    clock = min(s[sc.FIELD_START_NS] for s in _steps(lines))
    for step in _steps(lines):
        took = step[sc.FIELD_END_NS] - step[sc.FIELD_START_NS]
        scale = step_ms * 1e6 / took if took > 0 else 1.0
        step[sc.FIELD_STAGE_MS] = {s: ms * scale for s, ms in step[sc.FIELD_STAGE_MS].items()}
        step[sc.FIELD_START_NS], step[sc.FIELD_END_NS] = clock, clock + int(step_ms * 1e6)
        clock += int(step_ms * 1e6)
    return lines


def _steady(lines: list[Line], budget: int) -> tuple[float, float]:
    """(mean ms per steady step, steady tokens per second) of a budget, from the lines themselves."""
    steady = [s for s in _steps(lines, budget) if not s.get(sc.FIELD_WARMUP)]
    ns = [s[sc.FIELD_END_NS] - s[sc.FIELD_START_NS] for s in steady]
    tokens = sum(sum(s[sc.FIELD_EMITTED]) for s in steady)
    return sum(ns) / len(ns) / 1e6, tokens / sum(ns) * 1e9


def test_warmup_steps_are_left_out_of_stage_times_and_tokens_per_second(
    run: tuple[list[Line], dict[int, float]], tmp_path: Path, capsys: Any
) -> None:
    lines = _with_warmup(run[0])
    digest = _digest(lines)
    for g in digest.sorted_configs():
        step_ms, speed = _steady(lines, g.budget)
        assert g.warmup_steps == 1 and g.timed_steps == len(_steps(lines, g.budget)) - 1
        assert g.step_ms == pytest.approx(step_ms) and g.tokens_per_second == pytest.approx(speed)
        steady = [s for s in _steps(lines, g.budget) if not s.get(sc.FIELD_WARMUP)]
        want = sum(s[sc.FIELD_STAGE_MS][sc.STAGE_DRAFT] for s in steady) / len(steady)
        assert g.stage_mean_ms(sc.STAGE_DRAFT) == pytest.approx(want)
        assert g.tau == pytest.approx(run[1][g.budget])  # acceptance counts every step, warm-up ones too
    assert main(["analyze", str(_write(tmp_path, lines))]) == 0
    printed = capsys.readouterr().out
    assert "2 warm-up steps left out of stage times and tokens/s" in printed


def test_advise_compares_the_steady_steps_own_tokens_per_second(
    run: tuple[list[Line], dict[int, float]], tmp_path: Path, capsys: Any
) -> None:
    """With a cost curve of steady steps (what `bench --cost-curve` measures), prediction and measurement at the
    logged budget agree: both leave the warm-up out. The steps are re-timed (`_fixed_times`): the agreement
    depends on the tokens each step emitted, not on this machine's load during the run."""
    lines = _with_warmup(_fixed_times(run[0]))
    cost = tmp_path / "cost.json"
    write_costs(cost, [CostPoint(len(IDS), "ddtree", b, _steady(lines, b)[0]) for b in BUDGETS])
    assert main(["advise", str(_write(tmp_path, lines)), "--cost", str(cost), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    measured = {m["budget"]: m for m in result["measured"]}
    for budget in BUDGETS:
        assert measured[budget]["measured_tokens_per_second"] == pytest.approx(_steady(lines, budget)[1])
        assert measured[budget]["warmup_steps"] == 1 and measured[budget]["same_requests"]
    m = measured[16]
    assert 0.75 < m["predicted_tokens_per_second"] / m["measured_tokens_per_second"] < 1.33
    assert result["notes"] == ["2 warm-up steps left out of stage times and tokens/s"] and not result["warnings"]


def _request_steps(lines: list[Line]) -> int:
    return sum(x[sc.FIELD_STEPS] for x in lines if x["event"] == sc.EVENT_REQUEST)


def _drop_best_steps(lines: list[Line], budget: int, until: float) -> list[Line]:
    """The lines without the step lines of `budget` that accepted most, dropped until under `until` of the
    budget's request-steps are left: the steps a slow sink would lose, chosen to bias a step-line tau."""
    steps = sorted(_steps(lines, budget), key=lambda s: -sum(s[sc.FIELD_ACCEPTED_DRAFTS]) / len(s[sc.FIELD_EMITTED]))
    total = _request_steps([x for x in lines if x.get(sc.FIELD_BUDGET) == budget])
    left, dropped = total, set()
    for s in steps:
        if left / total < until:
            break
        dropped.add(s[sc.FIELD_STEP])
        left -= len(s[sc.FIELD_REQUEST_IDS])
    return [x for x in lines if not (x in steps and x[sc.FIELD_STEP] in dropped)]


def test_missing_steps_are_found_and_tau_comes_from_the_request_lines(
    run: tuple[list[Line], dict[int, float]], tmp_path: Path, capsys: Any
) -> None:
    lines, taus = run
    cut = _drop_best_steps(lines, 16, until=0.7)
    digest = _digest(cut)
    g = digest.configs["ddtree", 16, None]
    total = _request_steps([x for x in lines if x.get(sc.FIELD_BUDGET) == 16])
    logged = sum(len(s[sc.FIELD_REQUEST_IDS]) for s in _steps(cut, 16))
    assert (g.requests.steps, g.requests.logged) == (total, logged)
    assert g.step_tau < taus[16] - 0.05  # what the step lines alone say: the best steps are gone
    assert g.tau == pytest.approx(taus[16], abs=1e-3)  # the request lines' figure
    complete = digest.completeness()
    assert complete.share == pytest.approx((logged + _request_steps(lines) - total) / _request_steps(lines))

    assert main(["analyze", str(_write(tmp_path, cut))]) == 0
    printed = capsys.readouterr().out
    assert f"{complete.logged} of {complete.request_steps} request-steps logged, {complete.share:.1%}" in printed
    assert f"{taus[16]:.2f}" in next(line for line in printed.splitlines() if line.startswith("ddtree B=16 "))


def test_advise_warns_on_a_slightly_incomplete_log_and_refuses_a_very_incomplete_one(
    run: tuple[list[Line], dict[int, float]], tmp_path: Path, capsys: Any
) -> None:
    lines = run[0]
    steps = _steps(lines, 16)
    total = _request_steps([x for x in lines if x.get(sc.FIELD_BUDGET) == 16])
    smallest = min(steps, key=lambda s: len(s[sc.FIELD_REQUEST_IDS]))  # one step with the fewest requests
    share = 1 - len(smallest[sc.FIELD_REQUEST_IDS]) / total
    assert REFUSE_BELOW <= share < WARN_BELOW
    slight = _write(tmp_path, [x for x in lines if x is not smallest], "slight.jsonl")
    assert main(["advise", str(slight)]) == 0
    logged = total - len(smallest[sc.FIELD_REQUEST_IDS])
    assert f"warning: incomplete log: {logged} of {total} request-steps logged" in capsys.readouterr().out

    very = _write(tmp_path, _drop_best_steps(lines, 16, until=REFUSE_BELOW), "very.jsonl")
    assert main(["advise", str(very)]) == 2
    err = capsys.readouterr().err
    assert "too incomplete to advise on" in err and "request-steps logged" in err and len(err.splitlines()) == 1


def test_dropped_records_the_telemetry_reports_are_counted(
    run: tuple[list[Line], dict[int, float]], tmp_path: Path, capsys: Any
) -> None:
    """A log whose request lines were lost too: the drop reports and the requests without a line tell."""
    lines = run[0]
    gone = _steps(lines, 4)[:2]
    report = {
        "event": sc.EVENT_TELEMETRY,
        sc.FIELD_DROPPED_STEPS: 2,
        sc.FIELD_DROPPED_STEP_IDS: [s[sc.FIELD_STEP] for s in gone],
        sc.FIELD_DROPPED_REQUESTS: 4,
        sc.FIELD_DROPPED_REQUEST_IDS: IDS,
        sc.FIELD_DROPPED_TOTAL: 6,
    }
    kept = [x for x in lines if x not in gone and not (x["event"] == sc.EVENT_REQUEST and x[sc.FIELD_BUDGET] == 4)]
    digest = _digest([*kept, report, {"event": sc.EVENT_TELEMETRY, "nvml": "unavailable"}])
    complete = digest.completeness()
    steps = len(_steps(kept))
    assert (complete.dropped_steps, complete.dropped_requests, complete.step_lines) == (2, 4, steps)
    request_share = complete.logged / complete.request_steps
    assert complete.share == pytest.approx(min(request_share, steps / (steps + 2)))
    assert complete.unfinished_requests == len(IDS)  # B=4's requests: steps logged, request lines lost
    assert complete.unfinished_steps == sum(len(s[sc.FIELD_REQUEST_IDS]) for s in _steps(kept, 4))
    assert main(["analyze", str(_write(tmp_path, [*kept, report]))]) == 0
    printed = capsys.readouterr().out
    assert "the telemetry reported 2 step records and 4 request records dropped" in printed
    assert f"{len(IDS)} requests ({complete.unfinished_steps} request-steps) have step lines but no request" in printed


def _old_format(lines: list[Line]) -> list[Line]:
    """The lines as logs written before `active_requests`, `rows` and `warmup` had them."""
    old = copy.deepcopy(lines)
    for s in _steps(old):
        s[sc.FIELD_BATCH_SIZE] = s.pop(sc.FIELD_ROWS)
        del s[sc.FIELD_ACTIVE_REQUESTS], s[sc.FIELD_WARMUP]
    return old


def test_old_logs_read_with_batch_size_and_no_warmup(
    run: tuple[list[Line], dict[int, float]], tmp_path: Path, capsys: Any
) -> None:
    lines, taus = run
    digest = _digest(_old_format(lines))
    new = _digest(lines)
    for old_g, new_g in zip(digest.sorted_configs(), new.sorted_configs(), strict=True):
        assert old_g.warmup_steps == 0 and old_g.tau == pytest.approx(taus[old_g.budget])
        assert (old_g.step_ms, old_g.active_per_step) == (new_g.step_ms, new_g.active_per_step)
        ran = [s[sc.FIELD_ROWS] for s in _steps(lines, new_g.budget)]
        assert old_g.rows_per_step is None and new_g.rows_per_step == pytest.approx(sum(ran) / len(ran))
    trace = tmp_path / "trace.json"
    assert main(["analyze", str(_write(tmp_path, _old_format(lines))), "--trace-events", str(trace)]) == 0
    steps = [e for e in json.loads(trace.read_text())["traceEvents"] if e["name"] == sc.SPAN_STEP]
    for event, line in zip(steps, _steps(lines), strict=True):
        assert event["args"][sc.FIELD_ACTIVE_REQUESTS] == len(line[sc.FIELD_REQUEST_IDS])
        assert event["args"][sc.FIELD_ROWS] is None and event["args"][sc.FIELD_BATCH_SIZE] == line[sc.FIELD_ROWS]


def test_trace_events_say_active_requests_rows_and_warmup(
    run: tuple[list[Line], dict[int, float]], tmp_path: Path
) -> None:
    lines = _with_warmup(run[0])
    trace = tmp_path / "trace.json"
    assert main(["analyze", str(_write(tmp_path, lines)), "--trace-events", str(trace)]) == 0
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    steps = [e for e in events if e["name"].startswith(sc.SPAN_STEP)]
    assert len(steps) == len(_steps(lines))
    for event, line in zip(steps, _steps(lines), strict=True):
        args = event["args"]
        assert args[sc.FIELD_ACTIVE_REQUESTS] == line[sc.FIELD_ACTIVE_REQUESTS] == len(line[sc.FIELD_REQUEST_IDS])
        assert args[sc.FIELD_ROWS] == line[sc.FIELD_ROWS] and sc.FIELD_BATCH_SIZE not in args
        assert args[sc.FIELD_WARMUP] == (event["cat"] == "ddtree,warmup") == bool(line.get(sc.FIELD_WARMUP))
    assert sum(e["cat"] == "ddtree,warmup" for e in steps) == len(BUDGETS)
