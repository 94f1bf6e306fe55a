"""JSON step logs -> a table per configuration, acceptance by depth, what the tree added over its chain (from the
accepted ranks, `telemetry.analysis.chain`), the drafter's predicted accepted drafts against the target's
(`telemetry.analysis.calibration`), how complete the log is, and budget advice.

Reads the `ddtree.step` lines that `DDTREE_DEBUG_METRICS=1` writes. For each (method, budget, topk) it
reports tau (mean accepted drafts + 1 per request-step), tokens per step, the time of each stage, and
tokens per second; the advice is the configuration with the most tokens per second.

What each figure is over:
- acceptance (tau, the depth tables, the chain and calibration tables, tokens per step): every logged step,
  warm-up ones included (compiling a graph changes no token). Where the configuration has request lines, tau
  comes from them instead (`RequestTally`): a request whose steps all have step lines counts its steps' own
  lengths, any other request its line's `mean_acceptance_length`, so steps the telemetry lost do not bias tau.
- time (stage times, step time, tokens per second): the steady steps only. A step with `"warmup": true`
  carried compilation or CUDA-graph capture; it is counted (`warmup_steps`) and left out. A step's time is
  its own wall duration, `end_ns - start_ns` (the stage sum where a line has no times).

Step lines written before `active_requests` and `rows` carry `batch_size` instead: `active_requests` reads
len(request_ids) first, then `active_requests`, then `batch_size`; `rows` is None on such lines.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree.methods import method_label
from telemetry import semconv as sc
from telemetry.analysis.calibration import Observed, calibration_table
from telemetry.analysis.chain import chain_table
from telemetry.chain import ChainCounts, add_into


def is_warmup(s: dict[str, Any]) -> bool:
    """Whether a step line carried compilation or graph capture (lines without the field: no)."""
    return s.get(sc.FIELD_WARMUP) is True


def active_requests(s: dict[str, Any]) -> int:
    """Requests that decoded in the step: len(request_ids), else the line's count (`batch_size` on old logs)."""
    ids = s.get(sc.FIELD_REQUEST_IDS)
    if isinstance(ids, list):
        return len(ids)
    for name in (sc.FIELD_ACTIVE_REQUESTS, sc.FIELD_BATCH_SIZE):
        if isinstance(s.get(name), int):
            return int(s[name])
    return len(s.get(sc.FIELD_ACCEPTED_DRAFTS, []))


def rows(s: dict[str, Any]) -> int | None:
    """Rows the step ran (padded); None on lines that do not say (old logs)."""
    value = s.get(sc.FIELD_ROWS)
    return value if isinstance(value, int) else None


def step_duration_ms(s: dict[str, Any]) -> float:
    """The step's own wall time: end_ns - start_ns, else the sum of its stages."""
    start, end = s.get(sc.FIELD_START_NS), s.get(sc.FIELD_END_NS)
    if isinstance(start, int) and isinstance(end, int) and end > start:
        return (end - start) / 1e6
    return float(sum(s.get(sc.FIELD_STAGE_MS, {}).values()))


@dataclass
class RequestTally:
    """One configuration's request lines, against the step lines that name their requests."""

    requests: int = 0  # request lines
    complete: int = 0  # requests every step of which has a step line
    steps: int = 0  # request-steps the request lines name (the sum of their `steps`)
    logged: int = 0  # of those, the request-steps found in step lines
    length_sum: float = 0.0  # acceptance lengths: complete requests' from their steps, others' mean x steps
    length_steps: int = 0  # the request-steps in `length_sum`

    def add(self, steps: int, mean_length: float | None, seen: int, seen_lengths: int) -> None:
        """A request line (`steps`, `mean_length`) and what its step lines held (`seen` steps, lengths summed)."""
        self.requests += 1
        self.steps += steps
        self.logged += min(seen, steps)
        if seen == steps:
            self.complete += 1
            self.length_sum += seen_lengths
            self.length_steps += steps
        elif mean_length is not None:
            self.length_sum += mean_length * steps
            self.length_steps += steps

    @property
    def tau(self) -> float | None:
        return self.length_sum / self.length_steps if self.length_steps else None


@dataclass
class ConfigStats:
    method: str
    budget: int
    topk: int | None
    steps: int = 0  # step lines, warm-up ones included
    warmup_steps: int = 0
    request_steps: int = 0  # sum over step lines of the requests that decoded in them
    rows: int = 0  # sum over the step lines that say (`rows_steps`) of the rows they ran, padding included
    rows_steps: int = 0
    accepted: int = 0
    emitted: int = 0
    steady_emitted: int = 0  # tokens of the steps that were not warm-up
    steady_ms: float = 0.0  # their wall time, summed
    stage_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(sc.STAGES, 0.0))  # steady steps
    nodes_per_depth: list[int] = field(default_factory=list)
    accepted_per_depth: list[int] = field(default_factory=list)
    requests: RequestTally = field(default_factory=RequestTally)
    chain: ChainCounts = field(default_factory=ChainCounts)  # the lines with accepted ranks (`telemetry.chain`)
    calibration: Observed = field(default_factory=Observed)  # the lines with predictions (`analysis.calibration`)

    @property
    def label(self) -> str:
        return method_label(self.method, self.budget, self.topk)

    @property
    def timed_steps(self) -> int:
        return self.steps - self.warmup_steps

    @property
    def step_tau(self) -> float:
        """tau over the logged step lines."""
        return (self.accepted + self.request_steps) / self.request_steps if self.request_steps else 0.0

    @property
    def tau(self) -> float:
        """tau from the request lines where there are any (see the module docstring), else the step lines'."""
        from_requests = self.requests.tau
        return from_requests if from_requests is not None else self.step_tau

    @property
    def step_ms(self) -> float:
        """Mean wall time of a steady step."""
        return self.steady_ms / self.timed_steps if self.timed_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        """The steady steps' tokens over their own durations."""
        return self.steady_emitted / self.steady_ms * 1000 if self.steady_ms else 0.0

    @property
    def active_per_step(self) -> float:
        """Requests that decoded in a step, on average."""
        return self.request_steps / self.steps if self.steps else 0.0

    @property
    def rows_per_step(self) -> float | None:
        """Rows a step ran, on average (padded); None where no line says (old logs)."""
        return self.rows / self.rows_steps if self.rows_steps else None

    def stage_mean_ms(self, stage: str) -> float:
        return self.stage_ms.get(stage, 0.0) / self.timed_steps if self.timed_steps else 0.0

    def depth_acceptance(self) -> list[float]:
        return [a / n if n else 0.0 for a, n in zip(self.accepted_per_depth, self.nodes_per_depth, strict=False)]

    def depth_rate(self) -> list[float]:
        """Index d-1: of the request-steps that accepted depth d-1 (all of them for d = 1), the share that
        accepted depth d too."""
        reached = [self.request_steps, *self.accepted_per_depth]
        return [a / r if r else 0.0 for a, r in zip(reached[1:], reached[:-1], strict=True)]

    def add(self, s: dict[str, Any]) -> None:
        """One `ddtree.step` line of this configuration."""
        self.steps += 1
        self.request_steps += len(s[sc.FIELD_ACCEPTED_DRAFTS])
        self.accepted += sum(s[sc.FIELD_ACCEPTED_DRAFTS])
        emitted = sum(s.get(sc.FIELD_EMITTED, []))
        self.emitted += emitted
        if (ran := rows(s)) is not None:
            self.rows += ran
            self.rows_steps += 1
        add_into(self.nodes_per_depth, s[sc.FIELD_NODES_PER_DEPTH])
        add_into(self.accepted_per_depth, s[sc.FIELD_ACCEPTED_PER_DEPTH])
        ranks = s.get(sc.FIELD_ACCEPTED_RANKS)
        if isinstance(ranks, list):  # older logs and loops that read no ranks back have none
            offered = s.get(sc.FIELD_OFF_CHAIN_PARENT_NODES_PER_DEPTH) or []
            self.chain.merge(ChainCounts.of(ranks, [0, *offered]))
        predicted = s.get(sc.FIELD_PREDICTED_ACCEPTED)
        if isinstance(predicted, list):  # older logs and `ar` steps (no tree) have none
            self.calibration.add(predicted, s[sc.FIELD_ACCEPTED_DRAFTS])
        if is_warmup(s):
            self.warmup_steps += 1
            return
        self.steady_emitted += emitted
        self.steady_ms += step_duration_ms(s)
        for stage, ms in s[sc.FIELD_STAGE_MS].items():
            self.stage_ms[stage] = self.stage_ms.get(stage, 0.0) + ms


@dataclass(frozen=True)
class Completeness:
    """How much of the run the log holds: request lines against step lines, and the telemetry's drop reports."""

    request_steps: int  # request-steps the request lines name
    logged: int  # of those, found in step lines
    requests: int
    complete_requests: int
    step_lines: int
    dropped_steps: int = 0  # step records the telemetry said it dropped (`ddtree.telemetry` lines)
    dropped_requests: int = 0
    unfinished_requests: int = 0  # requests with step lines and no request line
    unfinished_steps: int = 0  # their request-steps

    @property
    def share(self) -> float | None:
        """The smaller of the shares logged (request-steps; step records), None when nothing tells."""
        shares = []
        if self.request_steps:
            shares.append(self.logged / self.request_steps)
        if self.dropped_steps:
            shares.append(self.step_lines / (self.step_lines + self.dropped_steps))
        return min(shares) if shares else None

    def line(self) -> str:
        if self.request_steps:
            text = (
                f"{self.logged} of {self.request_steps} request-steps logged, {self.logged / self.request_steps:.1%}"
                f" ({self.complete_requests} of {self.requests} requests complete)"
            )
        else:
            text = f"completeness unknown: no request lines to check the {self.step_lines} step lines against"
        if self.dropped_steps or self.dropped_requests:
            text += (
                f"; the telemetry reported {self.dropped_steps} step records and {self.dropped_requests}"
                " request records dropped"
            )
        if self.unfinished_requests:
            text += (
                f"; {self.unfinished_requests} requests ({self.unfinished_steps} request-steps) have step lines"
                " but no request line"
            )
        return text


@dataclass
class LineCounts:
    lines: int = 0
    bad: int = 0  # not a JSON object
    steps: int = 0
    requests: int = 0
    other: int = 0  # JSON objects that are not step or request lines (GPU samples, telemetry notes)


def iter_records(lines: Iterable[str], counts: LineCounts) -> Iterator[dict[str, Any]]:
    """The JSON objects among `lines`, one at a time (memory does not grow with the file); lines that are not
    JSON objects are counted in `counts.bad` and skipped."""
    for line in lines:
        if not line.strip():
            continue
        counts.lines += 1
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            counts.bad += 1
            continue
        event = record.get("event")
        if event == sc.EVENT_STEP:
            counts.steps += 1
        elif event == sc.EVENT_REQUEST:
            counts.requests += 1
        else:
            counts.other += 1
        yield record


def read_steps(path: str | Path) -> list[dict[str, Any]]:
    steps = []
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # other lines (a console renderer, a warning) are not ours
        if isinstance(record, dict) and record.get("event") == sc.EVENT_STEP:
            steps.append(record)
    return steps


def summarise(steps: Iterable[dict[str, Any]]) -> list[ConfigStats]:
    groups: dict[tuple[str, int, int | None], ConfigStats] = {}
    for s in steps:
        key = (s[sc.FIELD_METHOD], s[sc.FIELD_BUDGET], s[sc.FIELD_TOPK])
        groups.setdefault(key, ConfigStats(*key)).add(s)
    return sort_configs(groups.values())


def sort_configs(groups: Iterable[ConfigStats]) -> list[ConfigStats]:
    return sorted(groups, key=lambda g: (g.method, g.budget, g.topk or 0))


def warmup_note(groups: list[ConfigStats]) -> str:
    """'12 warm-up steps left out of stage times and tokens/s', or '' when there were none."""
    n = sum(g.warmup_steps for g in groups)
    return f"{n} warm-up step{'s' if n != 1 else ''} left out of stage times and tokens/s" if n else ""


def advice(groups: list[ConfigStats]) -> str:
    if not groups:
        return "no ddtree.step lines found"
    timed = [g for g in groups if g.timed_steps]
    if not timed:
        return f"no steady steps to time: {warmup_note(groups)}"
    best = max(timed, key=lambda g: g.tokens_per_second)
    stage_total = sum(best.stage_ms.values())
    share = {s: ms / stage_total for s, ms in best.stage_ms.items()} if stage_total else {}
    heaviest = max(share, key=lambda k: share[k]) if share else "-"
    note = warmup_note(groups)
    return (
        f"fastest: {best.label} at {best.tokens_per_second:.1f} tokens/s (tau {best.tau:.2f}); "
        f"its steps spend {share.get(heaviest, 0.0):.0%} of their time in {heaviest}" + (f"; {note}" if note else "")
    )


def format_table(groups: list[ConfigStats]) -> str:
    shown = [s for s in sc.ALL_STAGES if s in sc.STAGES or any(s in g.stage_ms for g in groups)]  # decide: adaptive
    head = f"{'config':<18}{'steps':>7}{'warm':>6}{'tau':>7}{'tok/step':>10}{'step ms':>9}" + "".join(
        f"{s:>12}" for s in shown
    )
    lines = [head + f"{'tok/s':>9}"]
    for g in groups:
        stages = "".join(f"{g.stage_mean_ms(s):>12.3f}" for s in shown)
        per_step = g.emitted / g.steps if g.steps else 0.0
        lines.append(
            f"{g.label:<18}{g.steps:>7}{g.warmup_steps:>6}{g.tau:>7.2f}{per_step:>10.2f}{g.step_ms:>9.2f}{stages}"
            f"{g.tokens_per_second:>9.1f}"
        )
    for g in groups:
        if g.nodes_per_depth:
            rates = " ".join(f"{r:.2f}" for r in g.depth_acceptance())
            lines.append(f"{g.label}: accepted / verified nodes by depth: {rates}")
    lines.extend(chain_table([(g.label, g.chain) for g in groups]))
    lines.extend(calibration_table([(g.label, g.calibration) for g in groups]))
    return "\n".join(lines)
