"""JSON step logs -> a table per configuration, acceptance by depth, and budget advice.

Reads the `ddtree.step` lines that `DDTREE_DEBUG_METRICS=1` writes. For each (method, budget, topk) it
reports tau (mean accepted drafts + 1 per request-step), tokens per step, the time of each stage, and
tokens per second over the stage time; the advice is the configuration with the most tokens per second.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
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
        stats = groups.setdefault(key, ConfigStats(*key))
        stats.steps += 1
        stats.request_steps += len(s[sc.FIELD_ACCEPTED_DRAFTS])
        stats.accepted += sum(s[sc.FIELD_ACCEPTED_DRAFTS])
        stats.emitted += sum(s.get(sc.FIELD_EMITTED, []))
        for stage, ms in s[sc.FIELD_STAGE_MS].items():
            stats.stage_ms[stage] = stats.stage_ms.get(stage, 0.0) + ms
        _add_into(stats.nodes_per_depth, s[sc.FIELD_NODES_PER_DEPTH])
        _add_into(stats.accepted_per_depth, s[sc.FIELD_ACCEPTED_PER_DEPTH])
    return sorted(groups.values(), key=lambda g: (g.method, g.budget))


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
