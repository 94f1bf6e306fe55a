"""Step-time cost curves: ms per step against the tree budget, one curve per batch size (rows per step).

`ddtree bench --cost-curve FILE` measures them (with `--batch-sizes`, at several row counts) and `ddtree advise`
reads them. A larger tree never costs less, so a curve's times are made non-decreasing in the budget (isotonic
regression) and interpolated linearly between budgets; below the smallest measured budget the time is that
budget's, beyond the largest it grows along the last segment. `ar` (no tree) is kept beside each curve: the
step time every tree has to beat at that load.

The file (`FORMAT`):

    {"format": "ddtree.cost/2", "temperature": 0.0,
     "curves": [{"batch_size": 1, "ar_step_ms": 1.5, "points": [{"budget": 4, "step_ms": 1.9, "tau": 2.1}, ...]},
                ...]}

A point's `tau` is the acceptance length measured in the same run (absent where it was not measured): at T > 0,
where replaying a log is not exact, the schedule (`telemetry.analysis.schedule`) uses it. `temperature` is the
runs' sampling temperature (absent in older files). A file of the first format, `{"batch_size": B, "points":
[...]}`, reads as one curve at batch size B.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from telemetry.analysis.steps import ConfigStats
from telemetry.calibration import apply_map, isotonic

FORMAT = "ddtree.cost/2"


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
    """The closest non-decreasing sequence in least squares (`telemetry.calibration.isotonic`)."""
    if not values:
        return []
    positions = list(range(len(values)))
    return [float(v) for v in apply_map(isotonic(positions, values), positions)]


def cost_from_log(configs: list[ConfigStats]) -> CostCurve | None:
    """The log's own curve: the mean steady step time of each ddtree budget that ran; None with fewer than two."""
    points = [(g.budget, g.step_ms) for g in configs if g.method == "ddtree" and g.timed_steps and g.step_ms > 0]
    if len({b for b, _ in points}) < 2:
        return None
    return cost_curve(points, "the log (steady steps)")


@dataclass(frozen=True)
class CostPoint:
    """One measured row: `method` ar (budget None) or ddtree at `budget`, at `batch_size` rows per step."""

    batch_size: int
    method: str
    budget: int | None
    step_ms: float
    tau: float | None = None  # the run's mean acceptance length, where it was measured


@dataclass(frozen=True)
class CostFile:
    """Curves by batch size, ar's step time at each where it was measured, and the measured tau of each
    budget at each batch size where the file has it."""

    curves: dict[int, CostCurve]
    ar_step_ms: dict[int, float]
    tau: dict[int, dict[int, float]] = field(default_factory=dict)  # batch size -> budget -> tau
    temperature: float | None = None  # None: not recorded

    def batch_for(self, rows: float) -> int:
        """The measured batch size nearest to `rows` (on a log scale: 3 rows are nearer 4 than 1)."""
        target = math.log(max(rows, 1.0))
        return min(self.curves, key=lambda b: (abs(math.log(b) - target), b))

    def for_rows(self, rows: float) -> CostCurve:
        """The curve measured at the batch size nearest to `rows`."""
        return self.curves[self.batch_for(rows)]


def read_costs(path: Path) -> CostFile:
    """A file written by `write_costs` (or one curve in the first format); ValueError for anything else."""
    source = repr(str(path))
    try:
        data = json.loads(path.read_text())
        raw = data["curves"] if "curves" in data else [{**data, "batch_size": data.get("batch_size", 1)}]
        parsed = [
            (
                int(c["batch_size"]),
                c.get("ar_step_ms"),
                [(int(p["budget"]), float(p["step_ms"])) for p in c["points"]],
                {int(p["budget"]): float(p["tau"]) for p in c["points"] if p.get("tau") is not None},
            )
            for c in raw
        ]
        temperature = None if data.get("temperature") is None else float(data["temperature"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{source} is not a cost curve ({exc!r})") from exc
    if not parsed:
        raise ValueError(f"{source} holds no cost curve")
    curves, ar, taus = {}, {}, {}
    for batch, ar_ms, points, tau in parsed:
        if batch < 1 or batch in curves:
            raise ValueError(f"{source}: batch sizes must be distinct and >= 1, got {batch}")
        curves[batch] = cost_curve(points, f"{source} at batch size {batch}")
        if ar_ms is not None:
            ar[batch] = float(ar_ms)
        if tau:
            taus[batch] = tau
    return CostFile(curves, ar, taus, temperature)


def write_costs(path: Path, points: list[CostPoint], temperature: float = 0.0) -> None:
    """The file `read_costs` reads: ddtree's points grouped by batch size, ar's time beside them, measured at
    `temperature`."""
    curves = []
    for batch in sorted({p.batch_size for p in points}):
        here = [p for p in points if p.batch_size == batch]
        ar = [p.step_ms for p in here if p.method == "ar"]
        curve: dict[str, object] = {"batch_size": batch}
        if ar:
            curve["ar_step_ms"] = round(sum(ar) / len(ar), 4)
        curve["points"] = [_point(p) for p in here if p.method == "ddtree" and p.budget]
        curves.append(curve)
    data = {"format": FORMAT, "temperature": temperature, "curves": curves}
    path.write_text(json.dumps(data, indent=2) + "\n")


def _point(p: CostPoint) -> dict[str, object]:
    point: dict[str, object] = {"budget": p.budget, "step_ms": round(p.step_ms, 4)}
    if p.tau is not None:
        point["tau"] = round(p.tau, 4)
    return point
