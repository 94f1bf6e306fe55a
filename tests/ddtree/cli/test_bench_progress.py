"""`ddtree bench` says what it benchmarks before the rows run, and shows a progress bar on stderr on a
terminal; off one (pipes, these tests) a progress line now and then, and stdout holds the header and the table."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ddtree.bench import rows as bench_rows
from ddtree.bench.rows import BatchRun, Prompts, RowRunner, run_rows
from ddtree.cli.bench import ProgressBar
from ddtree.cli.main import main


def _runner(method: str, budget: int | None) -> RowRunner:
    def timed(batch: Prompts, first: int) -> BatchRun:
        return BatchRun([tuple(p) for p in batch], 1, 0.25, [1] * len(batch))

    return RowRunner(method, budget, lambda batch, first: None, timed)


@pytest.mark.parametrize(("device", "warm_ups"), [("cpu", 2), ("cuda", 4)])
def test_run_rows_reports_every_run_as_it_ends(device: str, warm_ups: int) -> None:
    """Warm-ups first (one batch per row on CPU, every batch on CUDA), then the timed schedule; counts rise
    by one to the total, and the labels name the row."""
    seen: list[tuple[int, int, str]] = []
    runners = [_runner("ar", None), _runner("ddtree", 16)]
    batches = [[[1]], [[2]]]
    run_rows(runners, batches, 3, torch.device(device), lambda *call: seen.append(call))
    total = warm_ups + 2 * 2 * 3
    assert [done for done, _, _ in seen] == list(range(1, total + 1))
    assert {t for _, t, _ in seen} == {total}
    labels = [label for _, _, label in seen]
    assert labels[:warm_ups] == sorted(labels[:warm_ups]) and all(x.startswith("warm-up ") for x in labels[:warm_ups])
    assert set(labels[warm_ups:]) == {"ar", "ddtree B=16"}


def test_the_bar_draws_on_a_terminal_and_lines_come_now_and_then_off_one() -> None:
    drawn, logged = io.StringIO(), io.StringIO()
    now = [0.0]
    with ProgressBar(terminal=True, stream=drawn) as bar, ProgressBar(False, logged, lambda: now[0]) as off:
        for done, at in ((1, 5.0), (2, 31.0), (3, 40.0), (4, 50.0), (5, 52.0)):
            now[0] = at
            bar(done, 5, "ddtree B=16")
            off(done, 5, "ddtree B=16")
        text = drawn.getvalue()
    assert "bench" in text and "5/5" in text and "ddtree B=16" in text
    lines = logged.getvalue().splitlines()  # 30 s apart at most, and the last run
    assert lines == ["bench: 2/5 runs, ddtree B=16, 31 s", "bench: 5/5 runs, ddtree B=16, 52 s"]
    assert off.bar is None and bar.bar is None  # closed at the end of the block


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _bench(tiny_dirs: tuple[Path, Path]) -> list[str]:
    target, drafter = tiny_dirs
    pair = ["--model", str(target), "--drafter", str(drafter), "--device", "cpu"]
    return ["bench", *pair, "--methods", "ar,ddtree", "--budgets", "4", "--num-prompts", "2", "--max-new-tokens", "4"]


def test_bench_prints_its_header_before_the_rows_run_and_a_line_off_a_terminal(
    tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    printed_first: list[str] = []
    real = bench_rows.run_bench

    def run_bench(*args: Any, **kwargs: Any) -> Any:
        printed_first.append(capsys.readouterr().out)
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_rows, "run_bench", run_bench)
    assert main(_bench(tiny_dirs)) == 0
    out, err = capsys.readouterr()
    (header,) = printed_first
    assert header.startswith("2 prompts, 4 new tokens max, batch 1, device cpu, float32, eager")
    assert "ddtree B=4" in out
    assert re.fullmatch(r"(bench: \d/6 runs, .*\n)*bench: 6/6 runs, (ar|ddtree B=4), \d+ s\n", err), err


def test_bench_draws_a_bar_on_a_terminal(
    tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(_bench(tiny_dirs)) == 0
    total = 2 + 2 * 2  # two rows: a warm-up each on CPU, then two batches of one prompt each
    assert f"{total}/{total}" in terminal.getvalue() and "warm-up ar" in terminal.getvalue()
    out = capsys.readouterr().out
    assert out.startswith("2 prompts, ") and "\r" not in out and "run/s" not in out, "the bar stays off stdout"
