"""`ddtree analyze` (stdin, bad lines, summary.json, PNG plots, report.html, trace events) and `ddtree advise`
on logs of real runs of a tiny pair."""

from __future__ import annotations

import base64
import html
import io
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.figure import Figure
from PIL import Image

from ddtree.cli.main import main
from ddtree.engine.engine import Engine
from ddtree.settings import GenerationConfig
from telemetry import semconv as sc
from telemetry.analysis.cost import (
    CostPoint,
    cost_curve,
    non_decreasing,
    read_costs,
    write_costs,
)
from telemetry.analysis.digest import Digest
from telemetry.analysis.report import DPI, FIGSIZE, PLOTS
from telemetry.analysis.steps import LineCounts, iter_records
from telemetry.collector import Collector
from telemetry.config import TelemetryConfig
from telemetry.logging import LogSink, make_logger
from tests.helpers import random_prompts, tiny_pair

BUDGETS = (4, 16)


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float]]:
    """A log of ddtree at two budgets (node detail on every other step), two GPU samples and bad lines; the
    real tau of each budget."""
    log = io.StringIO()
    sink = LogSink(make_logger(TelemetryConfig(), log), tree_share=0.5)
    engine = Engine(*tiny_pair(3, vocab=12, block_size=5), observer=Collector([sink], "cpu"))
    prompts = random_prompts(3, 4, vocab=12)
    taus = {}
    for budget in BUDGETS:
        out = engine.generate(prompts, GenerationConfig(budget=budget, max_new_tokens=20))
        lengths = [a for o in out.outputs for a in o.acceptance_lengths]
        taus[budget] = sum(lengths) / len(lengths)
    first = json.loads(log.getvalue().splitlines()[0])[sc.FIELD_START_NS]
    gpu = [
        {
            "event": sc.EVENT_GPU,
            sc.FIELD_GPU: 0,
            sc.FIELD_TIME_NS: first + i * 10**8,
            sc.FIELD_GPU_UTILIZATION: 50.0 + i,
        }
        | {sc.FIELD_GPU_MEMORY_USED: 2**30, sc.FIELD_GPU_POWER: 100.0}
        for i in range(2)
    ]
    path = tmp_path_factory.mktemp("log") / "steps.jsonl"
    path.write_text(log.getvalue() + "not json\n[1, 2]\n" + "".join(json.dumps(g) + "\n" for g in gpu))
    return path, taus


def test_analyze_from_stdin_writes_plots_report_and_summary(
    logged: tuple[Path, dict[int, float]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    path, taus = logged
    monkeypatch.setattr("sys.stdin", io.StringIO(path.read_text()))
    assert main(["analyze", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "2 bad lines" in printed and "ddtree B=16" in printed

    summary = json.loads((tmp_path / "summary.json").read_text())
    lines = path.read_text().splitlines()
    assert summary["lines"]["bad"] == 2 and summary["lines"]["lines"] == len(lines)
    assert summary["lines"]["steps"] == sum('"ddtree.step"' in line for line in lines)
    for config in summary["configs"]:
        assert config["tau"] == pytest.approx(taus[config["budget"]])
        lengths = {int(k): v for k, v in config["acceptance_lengths"].items()}
        assert sum(lengths.values()) == config["request_steps"]
        assert sum(k * v for k, v in lengths.items()) / config["request_steps"] == pytest.approx(config["tau"])
        assert all(0 <= r <= 1 for r in config["acceptance_rate_per_depth"])
    replay = {r["budget"]: r for r in summary["replay"]}
    full = next(p for p in replay[16]["predicted"] if p["budget"] == 16 and p["topk"] is None)
    assert full["tau"] == pytest.approx(taus[16])  # the replay at the logged budget is the run itself
    assert replay[16]["ranked_steps"] == pytest.approx(replay[16]["steps"] / 2, abs=len(BUDGETS) * 4)
    assert sum(b["nodes"] for b in summary["reliability"]) > 0

    pngs = sorted(tmp_path.glob("*.png"))
    assert {p.stem for p in pngs} == {*PLOTS, "gpu"}
    for png in pngs:
        with Image.open(png) as image:
            assert image.format == "PNG" and image.size == (FIGSIZE[0] * DPI, FIGSIZE[1] * DPI)
            assert np.asarray(image.convert("L")).std() > 5, f"{png.name} is blank"
    html = (tmp_path / "report.html").read_text()
    images = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", html)
    assert sorted(base64.b64decode(i) for i in images) == sorted(p.read_bytes() for p in pngs)
    assert "src='http" not in html and f"{summary['lines']['steps']} step lines" in html
    assert f"{summary['configs'][1]['tau']:.2f}" in html


def test_every_plot_labels_its_axes(logged: tuple[Path, dict[int, float]]) -> None:
    with logged[0].open() as stream:
        digest = Digest.of(stream)
    for name, plot in PLOTS.items():
        ax = Figure().add_subplot()
        plot(ax, digest)
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title(), name
        assert ax.has_data(), name


def test_bad_lines_are_counted_not_fatal() -> None:
    counts = LineCounts()
    text = ['{"event": "ddtree.step"}', "garbage", "", '"a string"', '{"event": "other"}']
    assert len(list(iter_records(text, counts))) == 2
    assert (counts.lines, counts.bad, counts.steps, counts.other) == (4, 2, 1, 1)


def test_trace_events_nest_stages_in_their_steps(logged: tuple[Path, dict[int, float]], tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    assert main(["analyze", str(logged[0]), "--trace-events", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    steps = [e for e in events if e["name"] == sc.SPAN_STEP]
    assert len(steps) == sum('"ddtree.step"' in line for line in logged[0].read_text().splitlines())
    stages = [e for e in events if e["ph"] == "X" and e["name"] != sc.SPAN_STEP]
    assert len(stages) == len(sc.STAGES) * len(steps)
    for step in steps:
        inside = [s for s in stages if s["tid"] == step["tid"] and step["ts"] <= s["ts"] < step["ts"] + step["dur"]]
        assert [s["name"] for s in inside] == [sc.stage_span_name(s) for s in sc.STAGES]
        assert inside[-1]["ts"] + inside[-1]["dur"] <= step["ts"] + step["dur"] + 1


def test_advise_predicts_the_smaller_run_and_recommends_one_of_its_configs(
    logged: tuple[Path, dict[int, float]], capsys: Any
) -> None:
    path, taus = logged
    assert main(["advise", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    configs = {(c["budget"], c["topk"]) for c in result["configs"]}
    assert (result["recommended"]["budget"], result["recommended"]["topk"]) in configs
    assert {(b, None) for b in range(1, 17)} <= configs and (4, 2) in configs
    best = max(result["configs"], key=lambda c: c["predicted_tokens_per_second"])
    assert best["predicted_tokens_per_second"] >= min(c["predicted_tokens_per_second"] for c in result["configs"])
    measured = {m["budget"]: m for m in result["measured"]}
    assert measured[16]["predicted_tau"] == pytest.approx(taus[16])
    assert measured[4]["measured_tau"] == pytest.approx(taus[4])
    assert measured[4]["predicted_tau"] == pytest.approx(taus[4], rel=0.25)
    assert [p["budget"] for p in result["cost"]["points"]] == list(BUDGETS)


def test_advise_with_a_cost_file_and_its_errors(
    logged: tuple[Path, dict[int, float]], tmp_path: Path, capsys: Any
) -> None:
    path = logged[0]
    cost = tmp_path / "cost.json"
    write_costs(cost, [CostPoint(4, "ddtree", b, 1.0) for b in (1, 16)])  # flat: the largest tau wins
    assert read_costs(cost).for_rows(4).step_ms(8) == pytest.approx(1.0)
    assert main(["advise", str(path), "--cost", str(cost), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    best_tau = max(c["predicted_tau"] for c in result["configs"] if c["exact_share"] >= 0.9)
    rec = result["recommended"]
    assert rec in result["configs"] and rec["predicted_tau"] == pytest.approx(best_tau)
    rows = result["source"]["steps"] / _steps_of(path, 16)  # requests per step of the replayed run
    for c in result["configs"]:  # flat cost: tokens/s is requests per step x tau per millisecond
        assert c["predicted_tokens_per_second"] == pytest.approx(rows * c["predicted_tau"] * 1000)
    assert main(["advise", str(path), "--cost", str(cost)]) == 0
    assert "recommended: --budget" in capsys.readouterr().out

    cost.write_text('{"points": [{"budget": 4, "step_ms": 2.0}]}')
    assert main(["advise", str(path), "--cost", str(cost)]) == 2
    assert "two or more budgets" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_advise_takes_the_curve_of_the_batch_size_nearest_the_logged_load(
    logged: tuple[Path, dict[int, float]], tmp_path: Path, capsys: Any
) -> None:
    """A cost file of several batch sizes: the curve nearest the replayed run's requests per step is the one
    priced (flat there, steep at the other load), and the advice says which it took."""
    path = logged[0]
    rows = json.loads(_advise_json(path, capsys))["source"]["steps"] / _steps_of(path, 16)
    near, far = max(1, round(rows)), max(1, round(rows)) * 16
    cost = tmp_path / "cost.json"
    write_costs(
        cost,
        [CostPoint(near, "ddtree", b, 1.0) for b in (1, 16)]
        + [CostPoint(far, "ddtree", b, float(b)) for b in (1, 16)]
        + [CostPoint(near, "ar", None, 0.5)],
    )
    costs = read_costs(cost)
    assert costs.ar_step_ms == {near: 0.5} and costs.batch_for(rows) == near
    assert main(["advise", str(path), "--cost-curve", str(cost), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["cost"]["source"].endswith(f"at batch size {near}")
    for c in result["configs"]:  # the flat curve: tokens/s is requests per step x tau per millisecond
        assert c["predicted_tokens_per_second"] == pytest.approx(rows * c["predicted_tau"] * 1000)


def test_a_cost_file_of_the_first_format_reads_as_one_curve(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text(
        json.dumps({"batch_size": 16, "points": [{"budget": 4, "step_ms": 2.0}, {"budget": 8, "step_ms": 3}]})
    )
    costs = read_costs(old)
    assert list(costs.curves) == [16] and costs.for_rows(1.0).points == ((4, 2.0), (8, 3.0))
    for bad in ('{"curves": []}', '{"curves": [{"batch_size": 0, "points": []}]}', "[1, 2]"):
        old.write_text(bad)
        with pytest.raises(ValueError, match=r"cost curve|batch sizes"):
            read_costs(old)


def _advise_json(path: Path, capsys: Any) -> str:
    assert main(["advise", str(path), "--json"]) == 0
    return capsys.readouterr().out


def _steps_of(path: Path, budget: int) -> int:
    return sum(
        1
        for line in path.read_text().splitlines()
        if '"ddtree.step"' in line and json.loads(line)[sc.FIELD_BUDGET] == budget
    )


def test_the_cost_curve_never_falls_and_does_not_extrapolate_below_its_first_budget() -> None:
    assert non_decreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    curve = cost_curve([(4, 2.0), (8, 3.0), (8, 5.0), (16, 3.0), (32, 7.0)], "test")
    assert [b for b, _ in curve.points] == [4, 8, 16, 32]
    assert curve.step_ms(1) == curve.step_ms(4) == 2.0
    assert curve.step_ms(12) == pytest.approx(3.5) and curve.step_ms(64) == pytest.approx(14.0)
    with pytest.raises(ValueError, match="two or more budgets"):
        cost_curve([(4, 1.0), (4, 2.0)], "test")
    with pytest.raises(ValueError, match="positive step time"):
        cost_curve([(4, 1.0), (8, 0.0)], "test")


SAME, OTHER = [f"r{i}" for i in range(4)], [f"s{i}" for i in range(4)]


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The lines of ddtree B=16 and B=4 on the same four requests (ids r0..r3), and B=8 on other ones."""
    log = io.StringIO()
    sink = LogSink(make_logger(TelemetryConfig(), log), tree_share=0.5)
    engine = Engine(*tiny_pair(3, vocab=12, block_size=5), observer=Collector([sink], "cpu"))
    for budget, ids, seed in ((16, SAME, 4), (4, SAME, 4), (8, OTHER, 5)):
        prompts = random_prompts(seed, len(ids), vocab=12)
        engine.generate(prompts, GenerationConfig(budget=budget, max_new_tokens=16), request_ids=ids)
    return [json.loads(line) for line in log.getvalue().splitlines()]


def _digest_of(lines: list[dict[str, Any]]) -> Digest:
    return Digest.of(json.dumps(x) for x in lines)


def _write_lines(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_tokens_per_second_is_each_steps_own_one_line_per_configuration_broken_at_gaps(
    three: list[dict[str, Any]],
) -> None:
    """B=4's second half is moved 30 s later (idle time between runs) and B=16's first step is a warm-up: the
    plot's lines, read back from the Axes, hold each steady step's tokens over its own duration."""
    lines = [dict(x) for x in three]
    steps = {b: [x for x in lines if x["event"] == sc.EVENT_STEP and x[sc.FIELD_BUDGET] == b] for b in (4, 8, 16)}
    moved = steps[4][len(steps[4]) // 2 :]
    for s in moved:
        s[sc.FIELD_START_NS] += 30 * 10**9
        s[sc.FIELD_END_NS] += 30 * 10**9
    steps[16][0][sc.FIELD_WARMUP] = True
    digest = _digest_of(lines)
    ax = Figure().add_subplot()
    PLOTS["tokens_per_second"](ax, digest)
    plotted = {line.get_label(): line for line in ax.get_lines()}
    assert set(plotted) == {g.label for g in digest.sorted_configs()}
    since = min(x[sc.FIELD_START_NS] for x in lines if x["event"] == sc.EVENT_STEP)
    for g in digest.sorted_configs():
        xs, ys = (np.asarray(v, dtype=float) for v in plotted[g.label].get_data())
        steady = [s for s in steps[g.budget] if not s.get(sc.FIELD_WARMUP)]
        want = [sum(s[sc.FIELD_EMITTED]) / (s[sc.FIELD_END_NS] - s[sc.FIELD_START_NS]) * 1e9 for s in steady]
        assert ys[np.isfinite(ys)] == pytest.approx(want)
        assert xs[np.isfinite(xs)] == pytest.approx([(s[sc.FIELD_START_NS] - since) / 1e9 for s in steady])
    xs, ys = (np.asarray(v, dtype=float) for v in plotted["ddtree B=4"].get_data())
    cut = (moved[0][sc.FIELD_START_NS] - since) / 1e9
    first = int(np.flatnonzero(np.isclose(xs, cut))[0])  # the first moved step
    assert np.isnan(ys[first - 1]) and xs[first - 2] < cut - 29  # no line across the idle 30 s
    warm = [c for c in ax.collections if c.get_label() == "ddtree B=16 warm-up"]
    assert len(warm) == 1 and np.asarray(warm[0].get_offsets())[:, 0].tolist() == pytest.approx(
        [(steps[16][0][sc.FIELD_START_NS] - since) / 1e9]
    )


def test_predicted_tau_marks_as_measured_only_runs_on_the_replays_requests(three: list[dict[str, Any]]) -> None:
    digest = _digest_of(three)
    ax = Figure().add_subplot()
    PLOTS["predicted_tau"](ax, digest)
    points = {c.get_label(): sorted(np.asarray(c.get_offsets())[:, 0].tolist()) for c in ax.collections}
    assert points == {"measured, same requests": [4.0, 16.0], "measured, other requests": [8.0]}
    by_budget = {g.budget: g.tau for g in digest.sorted_configs()}
    same = next(c for c in ax.collections if c.get_label() == "measured, same requests")
    assert sorted(np.asarray(same.get_offsets())[:, 1].tolist()) == pytest.approx(sorted([by_budget[4], by_budget[16]]))


def test_advise_shows_the_request_steps_and_a_seeded_bootstrap_interval_of_each_prediction(
    three: list[dict[str, Any]], tmp_path: Path, capsys: Any
) -> None:
    path = _write_lines(tmp_path / "three.jsonl", three)
    assert main(["advise", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert main(["advise", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == result  # seeded: the same intervals every time
    src = result["source"]
    assert src["budget"] == 16 and src["requests"] == len(SAME)
    for c in result["configs"]:
        assert c["request_steps"] == (src["steps"] if c["topk"] is None else src["ranked_steps"])
        assert c["requests"] == len(SAME)
        low, high = c["tau_interval"]
        assert low <= c["predicted_tau"] + 1e-9 and c["predicted_tau"] <= high + 1e-9
        speed_low, speed_high = c["tokens_per_second_interval"]
        assert speed_low <= c["predicted_tokens_per_second"] * (1 + 1e-9) <= speed_high * (1 + 1e-9)
    full = next(c for c in result["configs"] if (c["budget"], c["topk"]) == (16, None))
    assert full["tau_interval"][0] < full["tau_interval"][1]
    assert {m["budget"]: m["same_requests"] for m in result["measured"]} == {4: True, 8: False, 16: True}
    assert main(["advise", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "tau 95%" in printed and "req-steps" in printed
    assert "B=8 topk=None" in printed and "(measured on other requests)" in printed
    rec = result["recommended"]
    assert (
        f"recommended: --budget {rec['budget']}" in printed and f"over {rec['request_steps']} request-steps" in printed
    )
    assert f"95% {rec['tokens_per_second_interval'][0]:.1f}-{rec['tokens_per_second_interval'][1]:.1f}" in printed


def test_advise_on_one_budget_prints_the_replayed_tau_table_without_a_cost_curve(
    three: list[dict[str, Any]], tmp_path: Path, capsys: Any
) -> None:
    path = _write_lines(tmp_path / "one.jsonl", [x for x in three if x.get(sc.FIELD_BUDGET) == 16])
    assert main(["advise", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "no cost curve" in printed and "recommended" not in printed
    rows = [line.split() for line in printed.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows if r[1] == "-"] == ["1", "2", "4", "8", "16"]
    assert main(["advise", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["cost"] is None and result["recommended"] is None
    assert all(c["predicted_tokens_per_second"] is None and c["tau_interval"] for c in result["configs"])


def test_the_report_carries_the_completeness_and_the_recommendation_with_its_interval(
    three: list[dict[str, Any]], tmp_path: Path
) -> None:
    path = _write_lines(tmp_path / "three.jsonl", three)
    assert main(["analyze", str(path), "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    rec = summary["advice"]["recommended"]
    assert rec["tokens_per_second_interval"][0] <= rec["predicted_tokens_per_second"]
    page = (tmp_path / "out" / "report.html").read_text()
    assert html.escape(summary["advice"]["text"]) in page and f"--budget {rec['budget']}" in page and "95%" in page
    assert summary["completeness"]["share"] == 1.0 and "request-steps logged, 100.0%" in page
