"""`ddtree tune`: a budget schedule for one pair on one device, measured in three phases.

1. A logged run: the prompts through `log_slots` slots with ddtree at the largest budget, every step logged
   with its nodes' ranks (`DDTREE_LOG_TREE=1`). Replaying it gives tau for every smaller budget and top-k,
   exactly at T = 0 (`telemetry.analysis.replay`).
2. Cost curves: `ar` and ddtree at each budget, streamed through each batch size's slots as the server fills
   them (`run_bench`, continuous): ms per step, and the tau each measured (the plan's tau at T > 0). The
   prompts are repeated to `FILL` times the batch size (`filled`), so that the slots stay full for most of
   the run: a point is the cost of a step over that many rows, not of a batch draining.
3. The plan (`telemetry.analysis.schedule.plan_schedule`): per batch size, the tree with the most predicted
   tokens/s, or `ar` where none beats it.

The time it takes is estimated before it starts, from two timed steps (`estimate_seconds`). A run with a
work directory of its own (`Kept`) resumes there: the logged run and each batch size's cost run, once finished,
are kept with a fingerprint of what made them, and a later run with the same pair, prompts and settings takes
them instead of measuring again.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddtree.bench.rows import GREEDY, BenchRow, Progress, Sampling, run_bench
from ddtree.engine.engine import Engine
from ddtree.models.target import Target
from ddtree.observer import StepObserver
from ddtree.settings import GenerationConfig
from telemetry import TelemetryConfig, start_telemetry
from telemetry.analysis.cost import CostFile, CostPoint, read_costs, write_costs
from telemetry.analysis.digest import Digest

FILL = 4  # a cost run streams at least this many requests per slot


def filled(prompts: list[list[int]], size: int) -> list[list[int]]:
    """The prompts, repeated in order to at least `FILL` x `size` of them."""
    count = max(len(prompts), FILL * size)
    return [prompts[i % len(prompts)] for i in range(count)]


@dataclass(frozen=True)
class TuneSettings:
    budgets: tuple[int, ...] = (4, 8, 16, 32, 64)
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64)
    max_new_tokens: int = 128
    log_slots: int = 16
    sampling: Sampling = GREEDY

    def __post_init__(self) -> None:
        for name, values in (("budgets", self.budgets), ("batch sizes", self.batch_sizes)):
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be one or more integers >= 1, got {list(values)}")
        if self.max_new_tokens < 1 or self.log_slots < 1:
            raise ValueError(f"new tokens and log slots must be >= 1, got {self.max_new_tokens}, {self.log_slots}")

    @property
    def log_budget(self) -> int:
        return max(self.budgets)


@dataclass(frozen=True)
class Kept:
    """A tune run's work directory, kept for a later run to resume: the logged run (`LOG`, marked finished by
    `LOG_DONE`) and one cost file per batch size, each holding `fingerprint` (what made it)."""

    directory: Path
    fingerprint: str

    LOG = "tune-log.jsonl"
    LOG_DONE = "tune-log.done.json"

    @classmethod
    def of(cls, directory: Path, prompts: list[list[int]], settings: TuneSettings, identity: dict[str, str]) -> Kept:
        made_of = {"prompts": prompts, "settings": asdict(settings), "pair": identity}
        digest = hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()
        return cls(directory, digest[:16])

    @property
    def log(self) -> Path:
        return self.directory / self.LOG

    def log_finished(self) -> bool:
        return self.log.is_file() and self._reads(self.directory / self.LOG_DONE) is not None

    def finish_log(self) -> None:
        (self.directory / self.LOG_DONE).write_text(json.dumps({"fingerprint": self.fingerprint}) + "\n")

    def points(self, size: int) -> list[CostPoint] | None:
        """Batch size `size`'s cost points from a finished run with this fingerprint; None if there is none."""
        data = self._reads(self._costs(size))
        return None if data is None else [CostPoint(**p) for p in data["points"]]

    def keep_points(self, size: int, points: list[CostPoint]) -> None:
        data = {"fingerprint": self.fingerprint, "points": [asdict(p) for p in points]}
        self._costs(size).write_text(json.dumps(data) + "\n")

    def _costs(self, size: int) -> Path:
        return self.directory / f"tune-costs-b{size}.json"

    def _reads(self, path: Path) -> dict[str, Any] | None:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and data.get("fingerprint") == self.fingerprint else None


def cost_points(measured: Iterable[tuple[int, BenchRow]]) -> list[CostPoint]:
    """The cost file's points among bench rows (batch size, row): ar's step time, each ddtree budget's with
    its tau; other rows (dflash, auto, HF) are no points."""
    return [
        CostPoint(size, row.method, row.budget, row.ms_per_step, row.tau if row.method == "ddtree" else None)
        for size, row in measured
        if row.steps and (row.method == "ar" or (row.method == "ddtree" and row.budget))
    ]


def estimate_seconds(engine: Engine, prompts: list[list[int]], settings: TuneSettings) -> float:
    """Seconds the phases will take, roughly. Two steps are timed: `ar` at one row and ddtree at the largest
    budget and batch size; a step's time is taken as linear in the tokens it verifies (rows x tree), in
    between (so an estimate, not a promise: a GPU's steps stay flat over small trees), and a tree step as
    accepting two tokens. Compiling and capturing come on top on CUDA."""
    size, budget = max(settings.batch_sizes), settings.log_budget
    small = _step_seconds(engine, prompts[:1], GenerationConfig(method="ar", max_new_tokens=8))
    widest = GenerationConfig(method="ddtree", budget=budget, max_new_tokens=8)
    large = _step_seconds(engine, filled(prompts, size)[:size], widest)

    def step(rows: int, tree: int) -> float:
        share = (rows * (1 + tree) - 1) / max(size * (1 + budget) - 1, 1)
        return small + (large - small) * share

    runs = 2 if engine.target.device.type == "cuda" else 1  # on CUDA each row's warm-up is a whole run
    tokens = len(prompts) * settings.max_new_tokens
    seconds = tokens / settings.log_slots / 2 * step(settings.log_slots, budget)
    for rows in settings.batch_sizes:
        tokens = len(filled(prompts, rows)) * settings.max_new_tokens
        per_row = tokens / rows * step(rows, 0) + sum(tokens / rows / 2 * step(rows, b) for b in settings.budgets)
        seconds += runs * per_row
    return seconds


def _step_seconds(engine: Engine, prompts: list[list[int]], config: GenerationConfig) -> float:
    engine.generate(prompts, config)  # compiles what the timed run would
    started = time.perf_counter()
    result = engine.generate(prompts, config)
    return (time.perf_counter() - started) / max(result.steps, 1)


def logged_run(
    make_engine: Callable[[StepObserver], Engine],
    target: Target,
    prompts: list[list[int]],
    eos: tuple[int, ...],
    settings: TuneSettings,
    log: Path,
) -> Digest:
    """Phase 1: ddtree at the largest budget with every step and node rank logged to `log`; its digest."""
    config = TelemetryConfig(
        enabled=True,
        traces_exporter="none",
        metrics_exporter="none",
        log_file=str(log),
        nvml_interval_ms=0,
        log_tree=1.0,
    )
    telemetry = start_telemetry(config, device_type=target.device.type)
    try:
        engine = make_engine(telemetry.observer)
        generation = GenerationConfig(
            method="ddtree",
            budget=settings.log_budget,
            max_new_tokens=settings.max_new_tokens,
            eos_token_ids=eos,
            temperature=settings.sampling.temperature,
            seed=settings.sampling.seed,
        )
        engine.stream(prompts, generation, settings.log_slots)
    finally:
        telemetry.shutdown()
    with log.open() as lines:
        return Digest.of(lines)


def cost_curves(
    engine: Engine,
    prompts: list[list[int]],
    eos: tuple[int, ...],
    settings: TuneSettings,
    out: Path,
    progress: Callable[[int], Progress] | None = None,
    kept: Kept | None = None,
) -> CostFile:
    """Phase 2: ar and every budget at every batch size, continuous; written to `out` and read back.
    `progress(size)`: the progress callback of that batch size's run. `kept`: batch sizes measured there are
    taken from it, and each size measured now is kept there as soon as it is done."""
    points: list[CostPoint] = []
    for size in settings.batch_sizes:
        done = kept.points(size) if kept else None
        if done is None:
            done = cost_points((size, row) for row in _size_rows(engine, prompts, eos, settings, size, progress))
            if kept:
                kept.keep_points(size, done)
        points += done
    write_costs(out, points, settings.sampling.temperature)
    return read_costs(out)


def _size_rows(
    engine: Engine,
    prompts: list[list[int]],
    eos: tuple[int, ...],
    settings: TuneSettings,
    size: int,
    progress: Callable[[int], Progress] | None,
) -> list[BenchRow]:
    return run_bench(
        engine,
        filled(prompts, size),
        list(settings.budgets),
        settings.max_new_tokens,
        size,
        ["ar", "ddtree"],
        eos,
        continuous=True,
        progress=progress(size) if progress else None,
        sampling=settings.sampling,
    )
