"""JSON step logs -> a table per configuration, acceptance by depth, and budget advice.

Reads the `ddtree.step` lines that `DDTREE_DEBUG_METRICS=1` writes. For each (method, budget, topk) it
reports tau (mean accepted drafts + 1 per request-step), tokens per step, the time of each stage, and
tokens per second over the stage time; the advice is the configuration with the most tokens per second.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree.methods import method_label
from telemetry import semconv as sc


@dataclass
class ConfigStats:
    method: str
    budget: int
    topk: int | None
    steps: int = 0
    request_steps: int = 0
    accepted: int = 0
    emitted: int = 0
    stage_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(sc.STAGES, 0.0))
    nodes_per_depth: list[int] = field(default_factory=list)
    accepted_per_depth: list[int] = field(default_factory=list)

    @property
    def label(self) -> str:
        return method_label(self.method, self.budget, self.topk)

    @property
    def tau(self) -> float:
        return (self.accepted + self.request_steps) / self.request_steps if self.request_steps else 0.0

    @property
    def step_ms(self) -> float:
        return sum(self.stage_ms.values()) / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        total_ms = sum(self.stage_ms.values())
        return self.emitted / total_ms * 1000 if total_ms else 0.0

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
        self.emitted += sum(s.get(sc.FIELD_EMITTED, []))
        for stage, ms in s[sc.FIELD_STAGE_MS].items():
            self.stage_ms[stage] = self.stage_ms.get(stage, 0.0) + ms
        _add_into(self.nodes_per_depth, s[sc.FIELD_NODES_PER_DEPTH])
        _add_into(self.accepted_per_depth, s[sc.FIELD_ACCEPTED_PER_DEPTH])


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


def _add_into(total: list[int], values: list[int]) -> None:
    total.extend([0] * (len(values) - len(total)))
    for i, v in enumerate(values):
        total[i] += v


def advice(groups: list[ConfigStats]) -> str:
    if not groups:
        return "no ddtree.step lines found"
    best = max(groups, key=lambda g: g.tokens_per_second)
    share = {s: ms / sum(best.stage_ms.values()) for s, ms in best.stage_ms.items()} if best.step_ms else {}
    heaviest = max(share, key=lambda k: share[k]) if share else "-"
    return (
        f"fastest: {best.label} at {best.tokens_per_second:.1f} tokens/s (tau {best.tau:.2f}); "
        f"its steps spend {share.get(heaviest, 0.0):.0%} of their time in {heaviest}"
    )


def format_table(groups: list[ConfigStats]) -> str:
    head = f"{'config':<18}{'steps':>7}{'tau':>7}{'tok/step':>10}{'step ms':>9}" + "".join(
        f"{s:>12}" for s in sc.STAGES
    )
    lines = [head + f"{'tok/s':>9}"]
    for g in groups:
        stages = "".join(f"{g.stage_ms.get(s, 0.0) / g.steps:>12.3f}" for s in sc.STAGES)
        per_step = g.emitted / g.steps if g.steps else 0.0
        lines.append(
            f"{g.label:<18}{g.steps:>7}{g.tau:>7.2f}{per_step:>10.2f}{g.step_ms:>9.2f}{stages}{g.tokens_per_second:>9.1f}"
        )
    for g in groups:
        if g.nodes_per_depth:
            rates = " ".join(f"{r:.2f}" for r in g.depth_acceptance())
            lines.append(f"{g.label}: accepted / verified nodes by depth: {rates}")
    return "\n".join(lines)
