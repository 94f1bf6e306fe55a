"""`ddtree advise`: the budget and top-k with the best predicted tokens/s, from one logged run.

predicted tokens/s (B', k') = requests per step x replayed tau (B', k') / step time (B')

The replayed tau comes from `telemetry.replay` over the run with the largest budget. The step time against
the budget is a cost curve: measured by `ddtree bench --cost-curve FILE` (wall time per step), or taken from
the log itself (the stage times of each ddtree budget it holds; two budgets at least). A larger tree never
costs less, so the measured times are first made non-decreasing in the budget (neighbours that disagree are
pooled: isotonic regression), then interpolated linearly between budgets; below the smallest measured
budget the time is that budget's (no extrapolation towards zero), and beyond the largest it grows along the
last segment. A top-k cap changes the tree's shape, not its size, so the curve does not depend on it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from telemetry.analysis import ConfigStats
from telemetry.digest import Digest
from telemetry.replay import ReplayTable

MIN_EXACT_SHARE = 0.9  # a (B', k') whose replay is a lower bound on more steps than this is not recommended


@dataclass(frozen=True)
class CostCurve:
    points: tuple[tuple[int, float], ...]  # (budget, ms per step), sorted by budget, two or more budgets
    source: str

    def step_ms(self, budget: int) -> float:
        pts = self.points
        if budget <= pts[0][0]:
            return pts[0][1]
        i = 1
        while i < len(pts) - 1 and pts[i][0] < budget:
            i += 1
        (b0, m0), (b1, m1) = pts[i - 1], pts[i]
        return m0 + (m1 - m0) * (budget - b0) / (b1 - b0)


def cost_curve(points: list[tuple[int, float]], source: str) -> CostCurve:
    """A curve through `points` (several points at one budget are averaged)."""
    by_budget: dict[int, list[float]] = {}
    for budget, ms in points:
        if budget < 1 or not ms > 0:
            raise ValueError(f"a cost point needs a budget >= 1 and a positive step time, got ({budget}, {ms})")
        by_budget.setdefault(budget, []).append(ms)
    if len(by_budget) < 2:
        raise ValueError(f"a cost curve needs step times at two or more budgets; {source} has {len(by_budget)}")
    budgets = sorted(by_budget)
    times = non_decreasing([sum(by_budget[b]) / len(by_budget[b]) for b in budgets])
    return CostCurve(tuple(zip(budgets, times, strict=True)), source)


def non_decreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    blocks: list[tuple[float, int]] = []  # (mean, size)
    for v in values:
        blocks.append((v, 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(), blocks.pop()
            blocks.append(((m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2))
    return [m for m, n in blocks for _ in range(n)]


def cost_from_log(configs: list[ConfigStats]) -> CostCurve:
    """The log's own curve: stage time per step of each ddtree budget that ran."""
    return cost_curve([(g.budget, g.step_ms) for g in configs if g.method == "ddtree" and g.steps], "the log")


def read_cost(path: Path) -> CostCurve:
    """A curve written by `ddtree bench --cost-curve`: {"points": [{"budget": B, "step_ms": ms}, ...]}."""
    try:
        data = json.loads(path.read_text())
        points = [(int(p["budget"]), float(p["step_ms"])) for p in data["points"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{str(path)!r} is not a cost curve ({exc!r})") from exc
    return cost_curve(points, repr(str(path)))


def write_cost(path: Path, points: list[tuple[int, float]], batch_size: int) -> None:
    """The format `read_cost` reads."""
    rows = [{"budget": b, "step_ms": ms} for b, ms in points]
    path.write_text(json.dumps({"batch_size": batch_size, "points": rows}, indent=2) + "\n")


@dataclass(frozen=True)
class Prediction:
    budget: int
    topk: int | None
    predicted_tau: float
    predicted_tokens_per_second: float
    exact_share: float  # steps whose replay is exact, not a lower bound


def predict(table: ReplayTable, rows_per_step: float, cost: CostCurve) -> list[Prediction]:
    out = []
    for topk in (None, *table.topks):
        for budget in range(1, table.budget + 1):
            tau = table.tau(budget, topk)
            if tau is None or (topk is not None and topk >= budget):
                continue
            speed = rows_per_step * tau / cost.step_ms(budget) * 1000
            out.append(Prediction(budget, topk, tau, speed, table.exact_share(budget, topk)))
    return out


def recommend(predictions: list[Prediction]) -> Prediction:
    trusted = [p for p in predictions if p.exact_share >= MIN_EXACT_SHARE] or predictions
    return max(trusted, key=lambda p: (p.predicted_tokens_per_second, -p.budget))


def advise(digest: Digest, cost: CostCurve | None = None) -> dict[str, Any]:
    """The predictions, the recommendation, and predicted against measured for the ddtree configurations
    in the log. Raises ValueError when the log has no accepted paths or no cost curve can be made."""
    source = digest.replay_source()
    if source is None:
        raise ValueError("the log has no ddtree request lines with accepted paths to replay")
    key, table = source
    configs = digest.sorted_configs()
    cost = cost or cost_from_log(configs)
    logged = digest.configs.get(key)
    rows = logged.request_steps / logged.steps if logged and logged.steps else 1.0
    predictions = predict(table, rows, cost)
    best = recommend(predictions)
    by_config = {(p.budget, p.topk): p for p in predictions}
    measured = []
    for g in configs:
        p = by_config.get((g.budget, g.topk if g.topk is None or g.topk < g.budget else None))
        if g.method == "ddtree" and p is not None:
            measured.append(
                {
                    "budget": g.budget,
                    "topk": g.topk,
                    "measured_tau": g.tau,
                    "measured_tokens_per_second": g.tokens_per_second,
                    "predicted_tau": p.predicted_tau,
                    "predicted_tokens_per_second": p.predicted_tokens_per_second,
                }
            )
    return {
        "source": {"budget": key[1], "topk": key[2], "steps": table.steps, "ranked_steps": table.ranked_steps},
        "cost": {"source": cost.source, "points": [{"budget": b, "step_ms": ms} for b, ms in cost.points]},
        "configs": [asdict(p) for p in predictions],
        "recommended": {"budget": best.budget, "topk": best.topk},
        "measured": measured,
    }


def format_advice(result: dict[str, Any], top: int = 10) -> str:
    src = result["source"]
    lines = [
        f"replayed from ddtree B={src['budget']} ({src['steps']} request-steps, {src['ranked_steps']} with node ranks);"
        f" step time from {result['cost']['source']}",
        f"{'budget':>7}{'topk':>6}{'tau':>8}{'tok/s':>10}{'exact':>8}",
    ]
    ranked = sorted(result["configs"], key=lambda p: -p["predicted_tokens_per_second"])[:top]
    for p in ranked:
        topk = "-" if p["topk"] is None else p["topk"]
        lines.append(
            f"{p['budget']:>7}{topk:>6}{p['predicted_tau']:>8.2f}{p['predicted_tokens_per_second']:>10.1f}"
            f"{p['exact_share']:>8.0%}"
        )
    if result["measured"]:
        lines.append("predicted against measured (tau, tokens/s):")
        for m in result["measured"]:
            lines.append(
                f"  B={m['budget']} topk={m['topk']}: tau {m['predicted_tau']:.2f} vs {m['measured_tau']:.2f}, "
                f"{m['predicted_tokens_per_second']:.1f} vs {m['measured_tokens_per_second']:.1f} tokens/s"
            )
    rec = result["recommended"]
    lines.append(f"recommended: --budget {rec['budget']}" + (f" --topk {rec['topk']}" if rec["topk"] else ""))
    return "\n".join(lines)
