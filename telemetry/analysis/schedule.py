"""`ddtree advise --schedule`: a budget schedule (`ddtree.schedule`) planned from a cost file and a logged run.

predicted tokens/s (b, B', k') = b x tau (B', k') / step time at batch size b (B') x 1000
ar's                            = b x 1 / ar's step time at batch size b x 1000

At each batch size b of the cost file that has ar's step time, the plan takes the (B', k') with the most
predicted tokens/s, or `ar` where that tree's predicted gain over ar does not exceed `MARGIN`.

What the figures rest on:
- the step times are the cost file's curve at b (`telemetry.analysis.cost`: measured, made non-decreasing in
  the budget, interpolated) and ar's measured step time at b, both taken as measured (one bench run, no interval).
- tau, at temperature 0 (the cost file's, or not recorded) with a log to replay: the replay of the logged run
  (`telemetry.analysis.advise.predict`), exact on its requests. At T = 0 the accepted paths do not depend on
  how many requests share a step (up to the rounding of batched kernels), so one replay serves every batch
  size. Configurations whose replay is a lower bound on more than a tenth of the steps are left out (unless
  all are), as `recommend` leaves them.
- tau otherwise (T > 0, where a replay is not exact, or no log): the tau `bench` measured at each budget at
  b, top-k uncapped, on the bench's prompts. At T > 0 it is one sampled run, so the figures are estimates
  (`Plan.estimates`, and the table says so).
- the best single budget, shown for comparison, is the one fixed (B', k') with the largest sum over batch sizes
  of its predicted tokens/s over the best tree's at that size: each load counts alike (absolute tokens/s would
  let the largest batch decide alone). Only a configuration predicted at every batch size qualifies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ddtree.methods import method_label
from ddtree.schedule import BudgetSchedule, Choice
from telemetry.analysis.advise import MIN_EXACT_SHARE, check_complete, predict
from telemetry.analysis.cost import CostFile
from telemetry.analysis.digest import Digest
from telemetry.analysis.replay import ReplayTable

# A tree must be predicted more than 5% faster than ar to replace it. The step times are one bench round and
# tau rests on a sample of requests (other prompts accept differently); a predicted gain of a few percent is
# within what those can tell apart, and the schedule must not run slower than ar, the floor it guarantees.
MARGIN = 1.05

Config = tuple[int, "int | None"]  # (budget, topk)


@dataclass(frozen=True)
class PlanRow:
    """One batch size: the choice, ar's tokens/s, the best tree (chosen or not) and the best single budget."""

    choice: Choice
    ar_tokens_per_second: float
    best_tree: Config
    best_tree_gain: float  # the best tree's predicted tokens/s over ar's
    single_tokens_per_second: float | None  # the best single budget's here; None without one

    @property
    def gain_over_single(self) -> float | None:
        speed = self.choice.predicted_tokens_per_second
        if speed is None or not self.single_tokens_per_second:
            return None
        return speed / self.single_tokens_per_second


@dataclass(frozen=True)
class Plan:
    schedule: BudgetSchedule
    rows: tuple[PlanRow, ...]  # by batch size, one per choice
    single: Config | None  # the best single fixed (budget, topk); None where none is predicted at every size
    estimates: bool  # tau measured at T > 0: the figures are estimates
    source: str  # where tau came from
    step_source: str  # where the step times came from
    margin: float = MARGIN
    warnings: tuple[str, ...] = ()

    def table(self) -> str:
        single = "-" if self.single is None else method_label("ddtree", *self.single)
        wide = max(18, len(single) + 5)
        lines = [
            f"schedule; tau: {self.source}" + ("; these figures are estimates" if self.estimates else ""),
            f"step times from {self.step_source}; ar kept unless a tree is predicted over {self.margin:.2f}x ar",
            *(f"warning: {w}" for w in self.warnings),
            f"{'rows':>5}  {'choice':<18}{'tok/s':>10}{'vs ar':>8}{'best tree':>22}{'vs ' + single:>{wide}}",
        ]
        for r in self.rows:
            c = r.choice
            tree = f"{method_label('ddtree', *r.best_tree)} {r.best_tree_gain:.2f}x"
            vs_single = "-" if r.gain_over_single is None else f"{r.gain_over_single:.2f}x"
            lines.append(
                f"{c.batch_size:>5}  {c.label:<18}{c.predicted_tokens_per_second or 0:>10.1f}"
                f"{c.gain_over_ar or 1:>7.2f}x{tree:>22}{vs_single:>{wide}}"
            )
        lines.append(f"best single budget: {single} (the most tokens/s relative to each batch size's best tree)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        """The plan as one JSON-ready object (`advise --json --schedule`)."""
        return {
            "source": self.source,
            "step_source": self.step_source,
            "estimates": self.estimates,
            "margin": self.margin,
            "warnings": list(self.warnings),
            "single": None if self.single is None else {"budget": self.single[0], "topk": self.single[1]},
            "rows": [
                {
                    "batch_size": r.choice.batch_size,
                    "label": r.choice.label,
                    "method": r.choice.method,
                    "budget": r.choice.budget,
                    "topk": r.choice.topk,
                    "predicted_tokens_per_second": r.choice.predicted_tokens_per_second,
                    "gain_over_ar": r.choice.gain_over_ar,
                    "ar_tokens_per_second": r.ar_tokens_per_second,
                    "best_tree": {"budget": r.best_tree[0], "topk": r.best_tree[1], "gain_over_ar": r.best_tree_gain},
                    "gain_over_single": r.gain_over_single,
                }
                for r in self.rows
            ],
        }


def plan_schedule(
    costs: CostFile,
    digest: Digest | None = None,
    tuned_for: Mapping[str, str] | None = None,
    margin: float = MARGIN,
) -> Plan:
    """The schedule over the batch sizes of `costs` that have ar's step time (see the module docstring).
    Raises ValueError when no batch size has ar's step time, when a batch size has no tau (none measured and no
    replay), or for a margin under 1; IncompleteLog (a ValueError) when too little of the replayed run is logged."""
    if not margin >= 1.0:
        raise ValueError(f"the margin over ar must be >= 1 (a tree predicted slower than ar), got {margin}")
    sizes = sorted(b for b in costs.curves if b in costs.ar_step_ms)
    if not sizes:
        raise ValueError(
            f"no batch size of the cost file has ar's step time (batch sizes {sorted(costs.curves)}): "
            "a schedule is measured against ar at each one"
        )
    warnings = [f"batch size {b} has no ar step time: left out" for b in sorted(costs.curves) if b not in sizes]
    speeds, source = _speeds(costs, digest, sizes, warnings)
    single = _best_single(speeds)
    rows = tuple(_row(b, speeds[b], costs.ar_step_ms[b], single, margin) for b in sizes)
    estimates = costs.temperature is not None and costs.temperature > 0
    schedule = BudgetSchedule(tuple(r.choice for r in rows), dict(tuned_for or {}))
    step_source = ", ".join(dict.fromkeys(costs.curves[b].source.removesuffix(f" at batch size {b}") for b in sizes))
    return Plan(schedule, rows, single, estimates, source, step_source, margin, tuple(warnings))


def _speeds(
    costs: CostFile, digest: Digest | None, sizes: list[int], warnings: list[str]
) -> tuple[dict[int, dict[Config, float]], str]:
    """Per batch size, the predicted tokens/s of each (budget, topk); and where tau came from."""
    greedy = not costs.temperature
    replay = digest.replay_source() if digest is not None else None
    if digest is not None and replay is None:
        warnings.append("the log has no ddtree request lines with accepted paths to replay: tau from the cost file")
    elif replay is not None and not greedy:
        warnings.append(f"the log is not replayed at temperature {costs.temperature} (a replay is exact at 0 only)")
    if digest is not None and replay is not None and greedy:
        key, table = replay
        warnings.extend(check_complete(digest.completeness(key)))
        speeds = {b: _replayed(table, b, costs) for b in sizes}
        label = method_label(*key)
        return speeds, f"replayed from {label} in the log ({table.steps} request-steps of {table.requests} requests)"
    return _measured(costs, sizes, "no log with accepted paths to replay" if greedy else "not replayed")


def _measured(costs: CostFile, sizes: list[int], why: str) -> tuple[dict[int, dict[Config, float]], str]:
    """The tokens/s of each budget whose tau the cost file measured at each size; ValueError where it has none."""
    temperature = "temperature not recorded" if costs.temperature is None else f"T={costs.temperature:g}"
    missing = [b for b in sizes if not costs.tau.get(b)]
    if missing:
        raise ValueError(f"no tau at batch sizes {missing}: the cost file measured none there ({temperature}, {why})")
    speeds: dict[int, dict[Config, float]] = {
        b: {(budget, None): b * tau / costs.curves[b].step_ms(budget) * 1000 for budget, tau in costs.tau[b].items()}
        for b in sizes
    }
    return speeds, f"measured in the cost file at each batch size ({temperature})"


def _replayed(table: ReplayTable, batch: int, costs: CostFile) -> dict[Config, float]:
    """The replay's trusted predictions priced at `batch` rows per step on the curve of that batch size."""
    predictions = predict(table, float(batch), costs.curves[batch])
    trusted = [p for p in predictions if p.exact_share >= MIN_EXACT_SHARE] or predictions
    return {(p.budget, p.topk): p.predicted_tokens_per_second or 0.0 for p in trusted}


def _best_single(speeds: Mapping[int, Mapping[Config, float]]) -> Config | None:
    """The (budget, topk) predicted at every batch size with the largest sum of its tokens/s over the best's
    at each size; the smaller budget on a tie."""
    common = set.intersection(*(set(s) for s in speeds.values()))
    best = {b: max(s.values()) for b, s in speeds.items()}
    score = {c: sum(s[c] / best[b] for b, s in speeds.items()) for c in common}
    return max(score, key=lambda c: (round(score[c], 9), -c[0], c[1] is None), default=None)


def _row(batch: int, speeds: Mapping[Config, float], ar_ms: float, single: Config | None, margin: float) -> PlanRow:
    ar = batch / ar_ms * 1000
    tree = max(speeds, key=lambda c: (speeds[c], -c[0]))
    gain = speeds[tree] / ar
    if gain > margin:
        choice = Choice(batch, "ddtree", tree[0], tree[1], speeds[tree], gain)
    else:
        choice = Choice(batch, "ar", None, None, ar, 1.0)
    return PlanRow(choice, ar, tree, gain, None if single is None else speeds[single])
