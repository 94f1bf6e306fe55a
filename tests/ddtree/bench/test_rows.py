from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ddtree.bench.rows import (
    BatchRun,
    BenchRow,
    RowRunner,
    bench_schedule,
    format_rows,
    hf_runner,
    rows_json,
    run_bench,
    run_rows,
)
from ddtree.cli.main import main
from ddtree.engine import engine as engine_module
from ddtree.engine.engine import Engine
from ddtree.engine.session import DecodeSession
from ddtree.errors import UserError
from ddtree.settings import GenerationConfig
from tests.helpers import random_prompts, tiny_pair


def test_bench_rows(tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target, drafter = tiny_dirs
    out = tmp_path / "rows.json"
    argv = ["bench", "--model", str(target), "--drafter", str(drafter), "--budgets", "2,16", "--limit", "3"]
    assert main([*argv, "--max-new-tokens", "8", "--batch-size", "2", "--json", str(out), "--baseline", "hf"]) == 0
    rows = json.loads(out.read_text())
    assert [(r["method"], r["budget"]) for r in rows] == [
        ("hf", None),
        ("ar", None),
        ("dflash", None),
        ("ddtree", 2),
        ("ddtree", 16),
    ]
    assert rows[0]["tau"] is None and rows[1]["tau"] == 1.0
    assert rows[0]["token_ids"] == rows[1]["token_ids"], "our ar equals HF generate, token for token"
    assert all(r["token_ids"] == rows[0]["token_ids"] for r in rows), "every method emits the same tokens"
    assert [len(t) for t in rows[0]["token_ids"]] == [8, 8, 8] and rows[0]["new_tokens"] == 24
    table = capsys.readouterr().out
    assert "vs ar" in table and "vs hf" in table and "hf generate" in table


def test_bench_telemetry_overhead(tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, drafter = tiny_dirs
    argv = ["bench", "--model", str(target), "--drafter", str(drafter), "--methods", "ddtree", "--budgets", "4"]
    assert main([*argv, "--limit", "2", "--max-new-tokens", "4", "--telemetry-overhead", "--rounds", "1"]) == 0
    assert "on/off" in capsys.readouterr().out


def test_bench_rejects_unknown_methods(tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, drafter = tiny_dirs
    assert main(["bench", "--model", str(target), "--drafter", str(drafter), "--methods", "beam"]) == 2
    assert "--methods" in capsys.readouterr().err


def test_overhead_schedule_alternates() -> None:
    """Every batch runs off and on back to back, and goes first both ways over the rounds."""
    from ddtree.bench.rows import overhead_schedule

    runs = overhead_schedule(3, 2)
    assert len(runs) == 2 * 2 * 3
    pairs = [runs[i : i + 2] for i in range(0, len(runs), 2)]
    assert all({a[1], b[1]} == {False, True} and a[0] == b[0] for a, b in pairs), "off and on back to back"
    assert {(a[0], a[1]) for a, _ in pairs} == {(b, on) for b in range(3) for on in (False, True)}


def test_telemetry_overhead_observes_only_the_on_side(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    """Only the on engine observes, and it observes every batch it runs (the off warm-up pass is not seen)."""
    from ddtree.bench.rows import PairSpec, telemetry_overhead
    from ddtree.settings import GenerationConfig
    from telemetry.config import TelemetryConfig

    target, drafter = tiny_dirs
    log = tmp_path / "steps.jsonl"
    config = TelemetryConfig(enabled=True, traces_exporter="none", metrics_exporter="none", log_file=str(log))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12]]
    generation = GenerationConfig(budget=4, max_new_tokens=6)
    off, on = telemetry_overhead(PairSpec(str(target), str(drafter), "cpu"), prompts, generation, 2, 2, config)
    assert off > 0 and on > 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    requests = [line for line in lines if line["event"] == "ddtree.request"]
    # The warm-up batch (2 prompts), then batches of 2 and 1 prompts in each of 2 rounds: 8 requests, once each.
    assert len(requests) == 2 + 2 * 3
    assert all(r["output_tokens"] == 6 for r in requests)


def test_bench_tree_build_times_the_torch_path_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--tree-build", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [("1", "32"), ("1", "256"), ("32", "32"), ("32", "256")]
    assert all(float(r[2]) > 0 and r[3] == "-" for r in rows), "torch timed; no fused path without a GPU"


def test_bench_writes_a_cost_curve_that_advise_reads(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    from telemetry.analysis.cost import read_costs

    target, drafter = tiny_dirs
    cost = tmp_path / "cost.json"
    argv = ["bench", "--model", str(target), "--drafter", str(drafter), "--methods", "ar,ddtree", "--budgets", "2,16"]
    assert main([*argv, "--limit", "2", "--max-new-tokens", "4", "--cost-curve", str(cost)]) == 0
    curve = read_costs(cost).for_rows(1)
    assert [b for b, _ in curve.points] == [2, 16] and all(ms > 0 for _, ms in curve.points)
    (only,) = json.loads(cost.read_text())["curves"]
    assert only["batch_size"] == 1 and only["ar_step_ms"] > 0


def test_bench_writes_one_curve_per_batch_size(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--batch-sizes`: a table per batch size in one run, and a curve per batch size with ar's time beside it,
    which advise picks by the load nearest the log's."""
    from telemetry.analysis.cost import read_costs

    target, drafter = tiny_dirs
    cost, out = tmp_path / "cost.json", tmp_path / "rows.json"
    argv = ["bench", "--model", str(target), "--drafter", str(drafter), "--methods", "ar,ddtree", "--budgets", "2,8"]
    argv += ["--num-prompts", "4", "--max-new-tokens", "4", "--batch-sizes", "1,4", "--cost-curve", str(cost)]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "batch 1," in printed and "batch 4," in printed and printed.count("ddtree B=8") == 2
    costs = read_costs(cost)
    assert sorted(costs.curves) == sorted(costs.ar_step_ms) == [1, 4]
    assert all([b for b, _ in c.points] == [2, 8] for c in costs.curves.values())
    assert costs.for_rows(1.0) is costs.curves[1] and costs.for_rows(3.0) is costs.curves[4]
    rows = json.loads(out.read_text())
    assert sorted({(r["batch_size"], r["method"], r["budget"]) for r in rows}) == [
        (1, "ar", None),
        (1, "ddtree", 2),
        (1, "ddtree", 8),
        (4, "ar", None),
        (4, "ddtree", 2),
        (4, "ddtree", 8),
    ]


def test_batch_sizes_beyond_the_prompts_are_refused(
    tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    target, drafter = tiny_dirs
    argv = ["bench", "--model", str(target), "--drafter", str(drafter), "--num-prompts", "2", "--batch-sizes", "1,4"]
    assert main(argv) == 2
    assert "--batch-sizes 4 needs at least as many prompts; there are 2" in capsys.readouterr().err


@pytest.mark.parametrize(("batches", "rows", "rounds"), [(3, 4, 2), (5, 2, 1), (1, 3, 3)])
def test_bench_schedule_runs_each_row_once_per_batch_and_rotates(batches: int, rows: int, rounds: int) -> None:
    runs = bench_schedule(batches, rows, rounds)
    assert sorted(runs) == [(r, b, i) for r in range(rounds) for b in range(batches) for i in range(rows)]
    groups = [runs[i : i + rows] for i in range(0, len(runs), rows)]
    assert [g[0][:2] for g in groups] == [(r, b) for r in range(rounds) for b in range(batches)], "batch by batch"
    assert all({run[:2] for run in g} == {g[0][:2]} for g in groups), "every row runs a batch before the next"
    starts = [(r * batches + b) % rows for r in range(rounds) for b in range(batches)]
    assert [g[0][2] for g in groups] == starts, "rotation, across rounds too"


def _recording_runner(index: int, log: list[tuple[str, int, int]]) -> RowRunner:
    """A row that logs (what, row, first prompt's id) and returns (prompt id, this row's timed runs so far)."""

    def timed(batch: list[list[int]], first: int) -> BatchRun:
        assert first == batch[0][0], "the index of the batch's first prompt in the set (ids are indices here)"
        log.append(("timed", index, batch[0][0]))
        runs = sum(1 for entry in log if entry[:2] == ("timed", index))
        return BatchRun([(p[0], runs) for p in batch], 1, 0.5, [2] * len(batch), new_shapes=index)

    def warm(batch: list[list[int]], first: int) -> None:
        assert first == batch[0][0]
        log.append(("warm", index, batch[0][0]))

    return RowRunner("ddtree", index, warm, timed)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_run_rows_warms_every_row_first_then_follows_the_schedule(device: str) -> None:
    """Warm-up: every batch on CUDA, the first elsewhere. Sums over rounds; token ids of the first round."""
    log: list[tuple[str, int, int]] = []
    batches = [[[0], [1]], [[2], [3]], [[4]]]
    rows = run_rows([_recording_runner(i, log) for i in range(3)], batches, 2, torch.device(device))
    warmed = [0, 2, 4] if device == "cuda" else [0]
    assert log[: 3 * len(warmed)] == [("warm", i, b) for i in range(3) for b in warmed]
    assert log[3 * len(warmed) :] == [("timed", i, 2 * b) for _, b, i in bench_schedule(3, 3, 2)]
    assert [r.budget for r in rows] == [0, 1, 2]
    for row in rows:
        assert (row.steps, row.new_tokens, row.seconds, row.tau) == (6, 20, 3.0, 2.0)  # 2 tokens a prompt
        assert row.token_ids == ((0, 1), (1, 1), (2, 2), (3, 2), (4, 3)), "first round, in prompt order"


def _figures(row: BenchRow) -> tuple[object, ...]:
    return row.method, row.budget, row.tau, row.steps, row.new_tokens, row.token_ids


# On CUDA, HF's generate compiles the target's forward, after which our graph captures can fail: in these
# tests every run of our rows comes before HF's first run, as in one bench, where ours warm up first.


def test_interleaved_rows_equal_rows_run_alone() -> None:
    target, drafter = tiny_pair(3)
    engine = Engine(target, drafter)
    prompts = random_prompts(4, 5, 32)
    runs = [("ar", 2), ("dflash", 2), ("ddtree", 2), ("ddtree", 8)]
    alone = [run_bench(engine, prompts, [b], 6, 2, [m], ())[0] for m, b in runs]
    together = run_bench(engine, prompts, [2, 8], 6, 2, ["ar", "dflash", "ddtree"], (), baseline=True)
    hf = run_rows([hf_runner(target, 6, ())], [prompts[:2], prompts[2:4], prompts[4:]], 1, target.device)
    assert [_figures(r) for r in together] == [_figures(r) for r in hf + alone]
    assert [(r.method, r.budget) for r in together][:2] == [("hf", None), ("ar", None)], "HF's row first"
    assert all(r.token_ids == together[0].token_ids for r in together), "greedy: every row emits the same"
    assert len(together[0].token_ids) == 5


def test_interleaved_rows_keep_their_sessions(monkeypatch: pytest.MonkeyPatch) -> None:
    """More sessions than an engine keeps, and still each (row, batch size) makes its session once: none is
    dropped between a row's batches, so none is made (and its graphs captured) again in the timed runs."""
    made: list[tuple[object, ...]] = []
    real = engine_module.DecodeSession

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append((args[2], args[3], args[5]))  # method, budget, slots
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "DecodeSession", counting)
    target, drafter = tiny_pair(3)
    engine = Engine(target, drafter)
    run_bench(engine, random_prompts(4, 5, 32), [2, 8], 6, 2, ["ar", "dflash", "ddtree"], (), rounds=2)
    assert len(made) == len(set(made)) == 4 * 2 > engine_module.KEPT_SESSIONS  # 4 rows; batches of 2 and of 1
    assert not engine.sessions, "the caller's engine is left as it was"


def test_rounds_sum_steps_and_tokens_and_keep_one_round_of_token_ids() -> None:
    target, drafter = tiny_pair(5)
    engine = Engine(target, drafter)
    prompts = random_prompts(6, 3, 32)
    one = run_bench(engine, prompts, [4], 5, 2, ["dflash", "ddtree"], (), rounds=1)
    two = run_bench(engine, prompts, [4], 5, 2, ["dflash", "ddtree"], (), rounds=2, baseline=True)
    one = run_rows([hf_runner(target, 5, ())], [prompts[:2], prompts[2:]], 1, target.device) + one
    assert [r.method for r in two] == ["hf", "dflash", "ddtree"]
    for a, b in zip(one, two, strict=True):
        assert (b.steps, b.new_tokens) == (2 * a.steps, 2 * a.new_tokens)
        assert b.token_ids == a.token_ids and len(b.token_ids) == 3
        assert b.tau == a.tau


def test_new_shapes_in_timed_runs_are_summed_and_said_under_the_table() -> None:
    rows = run_rows([_recording_runner(i, []) for i in (0, 3)], [[[0]], [[1]]], 2, torch.device("cpu"))
    assert [r.new_shapes for r in rows] == [0, 3 * 2 * 2]  # each timed run's count, two batches, two rounds
    table = format_rows(rows).splitlines()
    assert table[-1] == "ddtree B=3: 12 of its timed steps compiled or captured a new step shape (one-off costs in it)"
    assert len(table) == 4 and [r["new_shapes"] for r in rows_json(rows)] == [0, 12]


def test_an_engine_counts_the_steps_that_made_a_new_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where steps compile or capture per shape (CUDA), the first run of a shape counts it; the same run again
    makes none (here on the CPU, with the session told that its steps compile per shape)."""
    monkeypatch.setattr(DecodeSession, "compiles_per_shape", property(lambda self: True))
    engine = Engine(*tiny_pair(5))
    prompts = random_prompts(7, 2, 32)
    config = GenerationConfig(budget=4, max_new_tokens=6)
    first, again = engine.generate(prompts, config), engine.generate(prompts, config)
    assert first.new_shapes > 0 and again.new_shapes == 0
    engine.stream(prompts, config, slots=1)
    assert engine.stream(prompts, config, slots=1).new_shapes == 0


def test_rounds_below_one_are_a_clear_error(tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, drafter = tiny_pair(3)
    with pytest.raises(UserError, match="rounds must be >= 1, got 0"):
        run_bench(Engine(target, drafter), random_prompts(1, 2, 32), [4], 4, 1, ["ddtree"], (), rounds=0)
    argv = ["bench", "--model", str(tiny_dirs[0]), "--drafter", str(tiny_dirs[1]), "--limit", "1"]
    assert main([*argv, "--rounds", "0"]) == 2
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().err


def test_continuous_rows_emit_what_static_rows_emit_and_hf_keeps_its_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Continuous batching streams all prompts through `batch_size` slots: each prompt's tokens are the same
    as in static batches; HF generate has no such mode and runs the same static batches either way."""
    target, drafter = tiny_pair(3)
    engine = Engine(target, drafter)
    prompts = random_prompts(9, 5, 32)
    static = run_bench(engine, prompts, [4], 6, 2, ["ar", "ddtree"], (3,), baseline=True)
    streams: list[tuple[int, int]] = []
    real = Engine.stream

    def spy(self: Engine, batch: list[list[int]], config: Any, slots: int) -> Any:
        streams.append((len(batch), slots))
        return real(self, batch, config, slots)

    monkeypatch.setattr(Engine, "stream", spy)
    streamed = run_bench(engine, prompts, [4], 6, 2, ["ar", "ddtree"], (3,), baseline=True, continuous=True)
    assert streams and set(streams) == {(5, 2)}, "every prompt streamed through two slots"
    assert [(r.method, r.token_ids) for r in streamed] == [(r.method, r.token_ids) for r in static]
    assert streamed[0].steps == static[0].steps, "HF: the same batches of two"
    assert all(len(r.token_ids) == 5 for r in streamed)
