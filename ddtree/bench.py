"""`ddtree bench`: acceptance (tau) and speed of ar, dflash and ddtree on one prompt set, in one run.

tau is the mean acceptance length: per verify step, accepted drafts + 1, averaged over all steps of all
requests. Speed is new tokens over wall time; `speedup` is the ratio to `ar` in the same run, which is
the only comparison these numbers support.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from ddtree.engine.decode import Engine, GenerationConfig, GenerationResult
from ddtree.errors import UserError
from ddtree.models.target import Target
from ddtree.train.data import chat_ids


@dataclass(frozen=True)
class BenchRow:
    method: str
    budget: int | None
    tau: float
    steps: int
    new_tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def label(self) -> str:
        return self.method if self.budget is None else f"{self.method} B={self.budget}"


def heldout_prompts(path: str | None = None) -> list[str]:
    """The committed held-out prompts (none used in training), or a JSONL file of `{"prompt": ...}`."""
    source = Path(path) if path else Path(str(resources.files("ddtree.data").joinpath("heldout_prompts.jsonl")))
    try:
        return [json.loads(line)["prompt"] for line in source.read_text().splitlines() if line.strip()]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cannot read prompts from {str(source)!r}: {exc}") from exc


def run_bench(
    target: Target,
    drafter: Any,
    tokenizer: Any,
    prompts: list[str],
    budgets: list[int],
    max_new_tokens: int,
    batch_size: int,
    methods: list[str],
    eos: tuple[int, ...],
) -> list[BenchRow]:
    engine = Engine(target, drafter)
    encoded = [chat_ids(tokenizer, p) for p in prompts]
    runs: list[tuple[str, int | None]] = []
    for method in methods:
        runs += [(method, b) for b in budgets] if method == "ddtree" else [(method, None)]
    warm = GenerationConfig(method=methods[-1], budget=budgets[0], max_new_tokens=4, eos_token_ids=eos)
    engine.generate(encoded[:batch_size], warm)  # first-call costs stay out of the timings
    rows = []
    for method, budget in runs:
        config = GenerationConfig(method=method, budget=budget or 1, max_new_tokens=max_new_tokens, eos_token_ids=eos)
        results = _run_batches(engine, encoded, config, batch_size)
        lengths = [a for r in results for o in r.outputs for a in o.acceptance_lengths]
        tau = sum(lengths) / len(lengths) if lengths else 0.0
        steps, new_tokens = sum(r.steps for r in results), sum(r.new_tokens for r in results)
        rows.append(BenchRow(method, budget, tau, steps, new_tokens, sum(r.seconds for r in results)))
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
    base = next((r.tokens_per_second for r in rows if r.method == "ar"), None)
    lines = [f"{'method':<14}{'tau':>7}{'steps':>8}{'tokens':>8}{'tok/s':>10}{'vs ar':>8}"]
    for r in rows:
        ratio = f"{r.tokens_per_second / base:.2f}x" if base else "-"
        lines.append(f"{r.label:<14}{r.tau:>7.2f}{r.steps:>8}{r.new_tokens:>8}{r.tokens_per_second:>10.1f}{ratio:>8}")
    return "\n".join(lines)


def rows_json(rows: list[BenchRow]) -> list[dict[str, Any]]:
    return [
        {
            "method": r.method,
            "budget": r.budget,
            "tau": round(r.tau, 4),
            "steps": r.steps,
            "new_tokens": r.new_tokens,
            "seconds": round(r.seconds, 4),
            "tokens_per_second": round(r.tokens_per_second, 2),
        }
        for r in rows
    ]


@dataclass(frozen=True)
class PairSpec:
    """Where a process finds the pair: paths, device and dtype, as `ddtree.runtime.load_pair` takes them."""

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
    from ddtree.runtime import load_pair
    from telemetry import start_telemetry

    telemetry = None
    try:
        target, drafter, _ = load_pair(pair.model, pair.drafter, pair.device, pair.dtype)
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
