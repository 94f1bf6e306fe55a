"""Run records: `runs.json` in a drafter directory, one record per training run, oldest first.

A record holds the run's index (from 1), its first and last step, its wall seconds and the training seconds
of all runs so far, why it stopped, its loss curve (at most 50 points: the mean loss of consecutive steps),
the data it trained on and its configuration; after `--eval-heldout`, the mean acceptance length tau of
dflash and ddtree B=32 on the held-out prompts: teacher-forced on all 64 (`ddtree.train.teacher`), or, in
records older than that measure, decoded on the first 16 (their `eval` has no `measure`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ddtree.methods import method_label

if TYPE_CHECKING:
    from ddtree.train.data import TrainingSequence

RUNS_FILE = "runs.json"
CURVE_POINTS = 50
EVAL_BUDGET = 32
EVAL_LABELS = (method_label("dflash"), method_label("ddtree", EVAL_BUDGET))  # the keys of a record's eval tau


def loss_curve(history: Sequence[dict[str, float]], points: int = CURVE_POINTS) -> list[list[float]]:
    """`[[step, mean loss], ...]`: the history cut into at most `points` runs of consecutive steps, each
    given by its last step and its mean loss."""
    if not history:
        return []
    chunks = np.array_split(np.arange(len(history)), min(points, len(history)))
    curve = []
    for chunk in chunks:
        losses = [history[i]["loss"] for i in chunk]
        curve.append([int(history[chunk[-1]]["step"]), round(float(np.mean(losses)), 4)])
    return curve


def describe_data(data: Sequence[TrainingSequence]) -> dict[str, int]:
    tokens = sum(len(s.ids) for s in data)
    return {"sequences": len(data), "tokens": tokens, "response_tokens": tokens - sum(s.prompt_len for s in data)}


def run_record(report: dict[str, Any], history: Sequence[dict[str, float]], data: dict[str, int]) -> dict[str, Any]:
    """The record of one run, from the trainer's report and the history of this run's steps."""
    return {
        "start_step": report["start_step"],
        "end_step": report["steps"],
        "wall_seconds": report["run_seconds"],
        "cumulative_seconds": report["wall_seconds"],
        "stopped": report["stopped"],
        "final_loss": report["final_loss"],
        "loss_curve": loss_curve(history),
        "evals": report.get("evals", []),
        "data": data,
        "config": report["config"],
    }


def read_runs(directory: Path) -> list[dict[str, Any]]:
    """The records of `directory`'s runs.json; none when it has none."""
    path = directory / RUNS_FILE
    return read_runs_file(path) if path.is_file() else []


def read_runs_file(path: Path) -> list[dict[str, Any]]:
    try:
        runs = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{str(path)!r} is not JSON: {exc}") from exc
    if not isinstance(runs, list):
        raise ValueError(f"{str(path)!r} should hold a list of run records, got {type(runs).__name__}")
    return runs


def write_runs(directory: Path, runs: list[dict[str, Any]]) -> None:
    tmp = directory / (RUNS_FILE + ".tmp")
    tmp.write_text(json.dumps(runs, indent=1) + "\n")
    tmp.replace(directory / RUNS_FILE)


def append_run(directory: Path, record: dict[str, Any]) -> dict[str, Any]:
    """Add `record` as the next run (its index set here); returns it.

    The record's times come on the trainer state's clock, which starts at zero with a fresh state (a run
    from `--init` or from scratch). In the file they continue the records before it: the run's cumulative
    seconds are the last record's plus its own, and its evaluations' seconds move with them."""
    runs = read_runs(directory)
    before = float(runs[-1]["cumulative_seconds"]) if runs else 0.0
    cumulative = round(before + float(record["wall_seconds"]), 1)
    shift = cumulative - float(record["cumulative_seconds"])
    evals = [{**e, "seconds": round(float(e["seconds"]) + shift, 1)} for e in record.get("evals", [])]
    record = {"run": len(runs) + 1, **record, "cumulative_seconds": cumulative, "evals": evals}
    write_runs(directory, [*runs, record])
    return record


def inherit_runs(source: Path, directory: Path) -> bool:
    """Start `directory`'s runs.json with `source`'s records, where `directory` has none: a drafter trained
    from `source`'s weights keeps their history. Returns whether it did."""
    runs = read_runs(source)
    if not runs or read_runs(directory):
        return False
    directory.mkdir(parents=True, exist_ok=True)
    write_runs(directory, runs)
    return True


def add_eval(directory: Path, evaluation: dict[str, Any]) -> None:
    """Store a held-out evaluation in the last run's record."""
    runs = read_runs(directory)
    if not runs:
        raise ValueError(f"no run record in {str(directory / RUNS_FILE)!r} to add an evaluation to")
    runs[-1]["eval"] = evaluation
    write_runs(directory, runs)


def tau_points(
    runs: Sequence[dict[str, Any]], teacher_forced_only: bool = False
) -> dict[str, list[tuple[float, float]]]:
    """Per label of `EVAL_LABELS`: (cumulative training minutes, tau) of every evaluation: those within a run
    (`--eval-every`, always teacher-forced), else the one after it (`--eval-heldout`; with
    `teacher_forced_only`, only where it was teacher-forced: older records hold a decoded measure on fewer
    prompts, which is not comparable)."""
    points: dict[str, list[tuple[float, float]]] = {label: [] for label in EVAL_LABELS}
    for run in runs:
        evals = [(float(e["seconds"]), e["tau"]) for e in run.get("evals", [])]
        comparable = not teacher_forced_only or run.get("eval", {}).get("measure") == "teacher-forced"
        if "eval" in run and not evals and comparable:  # the in-run evaluations end with the run's own
            evals.append((float(run["cumulative_seconds"]), run["eval"].get("tau", {})))
        for seconds, tau in evals:
            for label in EVAL_LABELS:
                if label in tau:
                    points[label].append((seconds / 60, float(tau[label])))
    return points
