"""`ddtree bench`: acceptance (tau) and speed of ar, dflash and ddtree on one prompt set, in one run.

tau is the mean acceptance length: per verify step, accepted drafts + 1, averaged over all steps of all
requests. Speed is new tokens over wall time; `speedup` is the ratio to `ar` in the same run, which is
the only comparison these numbers support. The rows are interleaved: every row runs a batch of prompts
before the next batch starts, the first row rotating from batch to batch, so that drift on a GPU (clocks,
heat, what ran just before) hits every row alike instead of the rows run last.

Every row decodes with one `Sampling`: greedy at temperature 0, else sampled, prompt i of the set seeded
seed + i whatever batch it runs in. With a budget schedule, a row `auto` runs ddtree with its tree chosen each
step from the schedule by the rows the step runs; with `adaptive`, a row `adaptive` runs ddtree with each step's
width chosen by its own tree (`ddtree.adaptive`), up to that budget.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from ddtree.adaptive import ADAPTIVE  # the row of ddtree choosing each step's width, up to its budget
from ddtree.engine.engine import Engine, GenerationResult
from ddtree.errors import UserError
from ddtree.methods import get_method, mean_acceptance_length, method_label
from ddtree.models.target import Target
from ddtree.schedule import BudgetSchedule
from ddtree.settings import GenerationConfig

HF_BASELINE = "hf"  # `--baseline hf`: HF transformers `generate`, greedy, static cache
AUTO = "auto"  # the row of ddtree following a budget schedule


@dataclass(frozen=True)
class Sampling:
    """How every row decodes: greedy at `temperature` 0, else sampled, prompt i of the set with seed + i."""

    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        """`temperature 0 (greedy), seed 0`, `temperature 0.7, seed 3`: as the bench's header says it."""
        return f"temperature {self.temperature:g}{' (greedy)' if self.greedy else ''}, seed {self.seed}"


GREEDY = Sampling()


@dataclass(frozen=True)
class BenchRow:
    method: str  # a method of `ddtree.methods`, HF_BASELINE, AUTO (ddtree on a schedule, budget None) or ADAPTIVE
    budget: int | None
    tau: float | None  # None for the HF baseline, which does not draft
    steps: int
    new_tokens: int
    seconds: float
    token_ids: tuple[tuple[int, ...], ...] = ()  # per prompt, in order: what the method generated
    new_shapes: int = 0  # timed steps that compiled or captured a step shape: one-off costs in `seconds`

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def ms_per_step(self) -> float:
        return self.seconds * 1000 / self.steps if self.steps else 0.0

    @property
    def label(self) -> str:
        return row_label(self.method, self.budget)


def row_label(method: str, budget: int | None) -> str:
    """How the table names a row: `hf generate`, `auto`, `adaptive<=64`, or the method's label (`ddtree B=32`)."""
    if method == ADAPTIVE:
        return f"{ADAPTIVE}<={budget}"
    return "hf generate" if method == HF_BASELINE else method_label(method, budget)


Prompts = list[list[int]]


class BatchRun(NamedTuple):
    """What a timed batch run made and took."""

    rows: list[tuple[int, ...]]  # the tokens each prompt got
    steps: int
    seconds: float
    lengths: list[int]  # every step's acceptance length, per request
    new_shapes: int = 0  # steps that compiled or captured a new step shape inside `seconds`


Progress = Callable[[int, int, str], None]  # after each batch run, warm-ups too: (runs done, runs in all, what ran)


@dataclass(frozen=True)
class RowRunner:
    """One row of the bench: `warm` runs a batch untimed, `timed` runs it once and says what it took; both
    are given the batch and the index of its first prompt in the set (which seeds its sampling)."""

    method: str
    budget: int | None
    warm: Callable[[Prompts, int], object]
    timed: Callable[[Prompts, int], BatchRun]


@dataclass
class _Totals:
    """A row's figures summed over its timed runs; token rows per batch index, from the first round."""

    tokens: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)
    steps: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    lengths: list[int] = field(default_factory=list)
    new_shapes: int = 0

    def add(self, batch: int, run: BatchRun) -> None:
        self.tokens.setdefault(batch, run.rows)
        self.steps += run.steps
        self.new_tokens += sum(len(r) for r in run.rows)
        self.seconds += run.seconds
        self.lengths += run.lengths
        self.new_shapes += run.new_shapes

    def row(self, runner: RowRunner) -> BenchRow:
        tau = None if runner.method == HF_BASELINE else mean_acceptance_length(self.lengths)
        tokens = tuple(t for b in sorted(self.tokens) for t in self.tokens[b])
        return BenchRow(
            runner.method, runner.budget, tau, self.steps, self.new_tokens, self.seconds, tokens, self.new_shapes
        )


def bench_schedule(batches: int, rows: int, rounds: int) -> list[tuple[int, int, int]]:
    """(round, batch index, row index) in run order: every row runs a batch before the next batch starts,
    and the first row moves on by one from batch to batch, across rounds too (batch b of round r starts at
    row (r * batches + b) mod `rows`), so that drift in clocks or load hits every row alike."""
    return [
        (round_index, batch, (round_index * batches + batch + k) % rows)
        for round_index in range(rounds)
        for batch in range(batches)
        for k in range(rows)
    ]


def run_rows(
    runners: list[RowRunner],
    batches: list[Prompts],
    rounds: int,
    device: torch.device,
    progress: Progress | None = None,
) -> list[BenchRow]:
    """Warm every row up, then run `bench_schedule`; a row's figures sum over all its batches and rounds.

    The warm-up keeps first-call costs out of the timings. On CUDA every row runs every batch once: graphs
    are captured and regions compiled per step shape (key span, batch), and every shape the timed runs meet
    must exist. Elsewhere each row runs the first batch. `progress` hears of every run as it ends (outside
    the timings)."""
    if rounds < 1:
        raise UserError(f"rounds must be >= 1, got {rounds}")
    firsts = [sum(len(b) for b in batches[:i]) for i in range(len(batches))]  # index of each batch's first prompt
    warm_ups = [(r, i) for r in runners for i in range(len(batches) if device.type == "cuda" else min(1, len(batches)))]
    schedule = bench_schedule(len(batches), len(runners), rounds)
    total = len(warm_ups) + len(schedule)
    report = progress or (lambda done, total, label: None)
    for done, (runner, index) in enumerate(warm_ups, 1):
        runner.warm(batches[index], firsts[index])
        report(done, total, f"warm-up {row_label(runner.method, runner.budget)}")
    totals = [_Totals() for _ in runners]
    for done, (_, index, row) in enumerate(schedule, len(warm_ups) + 1):
        totals[row].add(index, runners[row].timed(batches[index], firsts[index]))
        report(done, total, row_label(runners[row].method, runners[row].budget))
    return [t.row(r) for t, r in zip(totals, runners, strict=True)]


def run_bench(
    engine: Engine,
    encoded: list[list[int]],
    budgets: list[int],
    max_new_tokens: int,
    batch_size: int,
    methods: list[str],
    eos: tuple[int, ...],
    rounds: int = 1,
    baseline: bool = False,
    continuous: bool = False,
    progress: Progress | None = None,
    sampling: Sampling = GREEDY,
    schedule: BudgetSchedule | None = None,
    adaptive: int | None = None,
) -> list[BenchRow]:
    """One row per method (per budget for methods tuned by it), and HF generate's first with `baseline`, all
    on the same prompts and engine. The rows are interleaved per batch (`bench_schedule`), `rounds` times
    over: on a GPU one method's ms per step moved by 14% with what ran before it, and rows run one after
    another would carry such drift into their ratios.

    `continuous`: our rows stream all the prompts through `batch_size` slots (`Engine.stream`, a request
    joining as soon as a slot frees, as in the server) instead of static batches, where every batch steps
    until its slowest request ends; HF generate, which has no such mode, keeps static batches. `progress`:
    as `run_rows` takes it. `sampling`: how our rows decode; HF generate decodes greedily only (ValueError
    with `baseline` at a temperature above 0). `schedule`: an `AUTO` row too, after the ddtree rows (or
    last), whatever `methods` are; `adaptive`: an `ADAPTIVE` row of at most that budget, likewise."""
    if baseline and not sampling.greedy:
        raise ValueError(f"HF generate's row decodes greedily only; temperature must be 0, got {sampling.temperature}")
    slots = batch_size if continuous else None
    runners = [engine_runner(engine, m, b, max_new_tokens, eos, slots, sampling) for m, b in _runs(methods, budgets)]
    if schedule is not None:
        after = max((i + 1 for i, r in enumerate(runners) if r.method == "ddtree"), default=len(runners))
        runners.insert(after, schedule_runner(engine, schedule, max_new_tokens, eos, slots, sampling))
    if adaptive is not None:
        after = max((i + 1 for i, r in enumerate(runners) if r.method in ("ddtree", AUTO)), default=len(runners))
        config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=eos, budget=adaptive, adaptive=True)
        runners.insert(after, session_runner(engine, ADAPTIVE, adaptive, config, slots, sampling))
    if baseline:  # warmed up last, so that HF compiles its forward after our graphs are captured
        runners.append(hf_runner(engine.target, max_new_tokens, eos, batch_size))
    size = len(encoded) if continuous else batch_size
    batches = [encoded[i : i + size] for i in range(0, len(encoded), size)]
    rows = run_rows(runners, batches, rounds, engine.target.device, progress)
    return rows[-1:] + rows[:-1] if baseline else rows


def _runs(methods: list[str], budgets: list[int]) -> list[tuple[str, int | None]]:
    runs: list[tuple[str, int | None]] = []
    for method in methods:
        runs += [(method, b) for b in budgets] if get_method(method).tuned_by_budget else [(method, None)]
    return runs


def engine_runner(
    engine: Engine,
    method: str,
    budget: int | None,
    max_new_tokens: int,
    eos: tuple[int, ...],
    slots: int | None = None,
    sampling: Sampling = GREEDY,
) -> RowRunner:
    """A row of our engine: `method` at `budget` (ignored by methods not tuned by it), as `session_runner`
    runs it."""
    config = GenerationConfig(method=method, budget=budget or 1, max_new_tokens=max_new_tokens, eos_token_ids=eos)
    return session_runner(engine, method, budget, config, slots, sampling)


def schedule_runner(
    engine: Engine,
    schedule: BudgetSchedule,
    max_new_tokens: int,
    eos: tuple[int, ...],
    slots: int | None = None,
    sampling: Sampling = GREEDY,
) -> RowRunner:
    """The `AUTO` row: ddtree with each step's tree chosen from `schedule` by the rows the step runs."""
    config = GenerationConfig(method="ddtree", max_new_tokens=max_new_tokens, eos_token_ids=eos, schedule=schedule)
    return session_runner(engine, AUTO, None, config, slots, sampling)


def session_runner(
    engine: Engine,
    method: str,
    budget: int | None,
    config: GenerationConfig,
    slots: int | None = None,
    sampling: Sampling = GREEDY,
) -> RowRunner:
    """A row (named `method`, `budget`) decoding with `config` at `sampling`, on a copy of `engine` with a
    session cache of its own: the engine keeps a few sessions, and with rows interleaved a shared cache would
    drop a row's sessions (and their captured graphs) between its batches. Its warm-up is the whole batch on
    CUDA, a short run elsewhere. `slots`: each batch is streamed through that many slots (`Engine.stream`);
    None: it is decoded as one batch. A batch whose first prompt is prompt `first` of the set seeds its
    requests from `sampling.seed + first`."""
    engine = engine.sibling()
    config = replace(config, temperature=sampling.temperature, seed=sampling.seed)
    short = replace(config, max_new_tokens=min(8, config.max_new_tokens))
    warm_config = config if engine.target.device.type == "cuda" else short

    def run(batch: Prompts, first: int, run_config: GenerationConfig) -> GenerationResult:
        run_config = replace(run_config, seed=run_config.seed + first)
        return engine.generate(batch, run_config) if slots is None else engine.stream(batch, run_config, slots)

    def timed(batch: Prompts, first: int) -> BatchRun:
        _sync(engine.target.device)
        result = run(batch, first, config)
        _sync(engine.target.device)
        lengths = [a for o in result.outputs for a in o.acceptance_lengths]
        rows = [tuple(o.token_ids) for o in result.outputs]
        return BatchRun(rows, result.steps, result.seconds, lengths, result.new_shapes)

    return RowRunner(method, budget, lambda batch, first: run(batch, first, warm_config), timed)


def hf_runner(target: Target, max_new_tokens: int, eos: tuple[int, ...], batch_size: int | None = None) -> RowRunner:
    """HF transformers `generate` on the target: greedy, static cache (which it compiles on CUDA), prompts
    left-padded per batch of `batch_size` (None: each batch it is given as one). New tokens count up to and
    including the first end-of-sequence token; a batch's steps are its longest row's new tokens."""
    from transformers.utils import logging

    logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    model: Any = target.model
    pad = eos[0] if eos else 0

    def chunks(batch: Prompts) -> list[Prompts]:
        size = batch_size or len(batch)
        return [batch[i : i + size] for i in range(0, len(batch), size)]

    def generate(batch: Prompts, first: int = 0) -> list[list[tuple[int, ...]]]:
        return [_hf_batch(model, chunk, max_new_tokens, eos, pad) for chunk in chunks(batch)]

    def timed(batch: Prompts, first: int) -> BatchRun:
        _sync(target.device)
        started = time.perf_counter()
        parts = generate(batch)
        _sync(target.device)
        steps = sum(max(len(r) for r in rows) for rows in parts)
        return BatchRun([r for rows in parts for r in rows], steps, time.perf_counter() - started, [])

    return RowRunner(HF_BASELINE, None, generate, timed)


def _hf_batch(
    model: Any, prompts: list[list[int]], max_new_tokens: int, eos: tuple[int, ...], pad: int
) -> list[tuple[int, ...]]:
    """Run one left-padded batch through `model.generate`; return the new tokens of each row, up to and
    including its first end-of-sequence token."""
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        cache_implementation="static",
        eos_token_id=list(eos) or None,
        pad_token_id=pad,
    )
    rows = []
    for row in out[:, width:].tolist():
        stop = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(tuple(row[:stop]))
    return rows


def _run_batches(
    engine: Engine, prompts: list[list[int]], config: GenerationConfig, batch_size: int
) -> list[GenerationResult]:
    """Generate for all prompts, `batch_size` at a time, with the device idle before and after each batch."""
    results = []
    for start in range(0, len(prompts), batch_size):
        _sync(engine.target.device)
        results.append(engine.generate(prompts[start : start + batch_size], config))
        _sync(engine.target.device)
    return results


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_rows(rows: list[BenchRow]) -> str:
    """The bench table: tau, steps, tokens, tokens/s, ms per step, and ratios to HF generate and to `ar`."""
    bases = {m: next((r.tokens_per_second for r in rows if r.method == m), None) for m in (HF_BASELINE, "ar")}
    head = f"{'method':<16}{'tau':>6}{'steps':>8}{'tokens':>8}{'tok/s':>10}{'ms/step':>9}{'vs hf':>8}{'vs ar':>8}"
    lines = [head]
    for r in rows:
        ratios = [f"{r.tokens_per_second / b:.2f}x" if b else "-" for b in bases.values()]
        tau = f"{r.tau:.2f}" if r.tau is not None else "-"
        lines.append(
            f"{r.label:<16}{tau:>6}{r.steps:>8}{r.new_tokens:>8}{r.tokens_per_second:>10.1f}{r.ms_per_step:>9.2f}"
            + "".join(f"{x:>8}" for x in ratios)
        )
    lines += [
        f"{r.label}: {r.new_shapes} of its timed steps compiled or captured a new step shape (one-off costs in it)"
        for r in rows
        if r.new_shapes
    ]
    return "\n".join(lines)


def rows_json(rows: list[BenchRow], sampling: Sampling = GREEDY) -> list[dict[str, Any]]:
    """The rows as `--out` writes them, each with the temperature and seed it decoded at."""
    return [
        {
            "method": r.method,
            "budget": r.budget,
            "tau": None if r.tau is None else round(r.tau, 4),
            "steps": r.steps,
            "new_tokens": r.new_tokens,
            "seconds": round(r.seconds, 4),
            "tokens_per_second": round(r.tokens_per_second, 2),
            "ms_per_step": round(r.ms_per_step, 3),
            "new_shapes": r.new_shapes,
            "temperature": sampling.temperature,
            "seed": sampling.seed,
            "token_ids": [list(t) for t in r.token_ids],
        }
        for r in rows
    ]


@dataclass(frozen=True)
class PairSpec:
    """Where a process finds the pair: paths, device and dtype, as `ddtree.models.pair.load_models` takes them."""

    model: str
    drafter: str | None
    device: str = "auto"
    dtype: str = "auto"


def overhead_schedule(batches: int, rounds: int) -> list[tuple[int, bool]]:
    """(batch index, telemetry on) in run order: every batch off and on back to back, the order alternating
    from batch to batch and round to round, so that drift in clocks or load hits both sides alike."""
    return [
        (index, on)
        for round_index in range(rounds)
        for index in range(batches)
        for on in ((False, True) if (round_index + index) % 2 == 0 else (True, False))
    ]


def telemetry_overhead(
    pair: PairSpec,
    prompts: list[list[int]],
    config: GenerationConfig,
    batch_size: int,
    rounds: int,
    telemetry_config: Any,
) -> tuple[float, float]:
    """Tokens per second with telemetry off and on, interleaved (`overhead_schedule`) over `rounds`.

    One worker process loads the pair once and holds two engines on it, one without an observer and one
    with telemetry's collector; the exporters, NVML and the log stream run in telemetry's exporter process,
    as in a deployment, so nothing of telemetry's runs inside the worker while the off engine decodes. One
    process, not one per side: two processes with telemetry off in both differed by up to 16% on a GPU
    host (their CUDA contexts, allocators and cores differ), far more than the cost being measured. Every
    batch runs once on both engines before any timing."""
    import multiprocessing

    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    context = multiprocessing.get_context("spawn")
    totals = {False: [0, 0.0], True: [0, 0.0]}
    ours, theirs = context.Pipe()
    process = context.Process(
        target=_overhead_worker, args=(theirs, pair, telemetry_config, batches, config), daemon=True
    )
    process.start()
    try:
        _reply(ours)  # loaded and warmed up
        for index, on in overhead_schedule(len(batches), rounds):
            ours.send((index, on))
            tokens, seconds = _reply(ours)
            totals[on][0] += tokens
            totals[on][1] += seconds
    finally:
        with contextlib.suppress(OSError):
            ours.send(None)
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    return totals[False][0] / totals[False][1], totals[True][0] / totals[True][1]


def _reply(conn: Any) -> Any:
    try:
        kind, value = conn.recv()
    except EOFError:
        raise UserError("a telemetry-overhead worker process died (see its output above)") from None
    if kind == "error":
        raise UserError(f"telemetry-overhead worker: {value}")
    return value


def _overhead_worker(
    conn: Any, pair: PairSpec, telemetry_config: Any, batches: list[list[list[int]]], config: GenerationConfig
) -> None:
    """The process of `telemetry_overhead`: load, warm up, then run the (batch, on) pairs it is sent until None."""
    from ddtree.models.pair import load_models
    from telemetry import start_telemetry

    telemetry = None
    try:
        target, drafter, _ = load_models(pair.model, pair.drafter, pair.device, pair.dtype)
        telemetry = start_telemetry(telemetry_config, device_type=target.device.type)
        engines = {False: Engine(target, drafter), True: Engine(target, drafter, observer=telemetry.observer)}
        for batch in batches:
            engines[False].generate(batch, config)
        engines[True].generate(batches[0], config)
        conn.send(("ready", None))
        while (message := conn.recv()) is not None:
            index, on = message
            result = _run_batches(engines[on], batches[index], config, len(batches[index]))[0]
            conn.send(("ok", (result.new_tokens, result.seconds)))
    except Exception as exc:  # reported to the parent, which exits with a clear message
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if telemetry is not None:
            telemetry.shutdown()
