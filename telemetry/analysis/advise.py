"""`ddtree advise`: the budget and top-k with the best predicted tokens/s, from one logged run.

predicted tokens/s (B', k') = active requests per step x replayed tau (B', k') / step time (B')

The replayed tau comes from `telemetry.analysis.replay` over the run with the largest budget. The step time against
the budget is a cost curve: measured by `ddtree bench --cost-curve FILE` (wall time per step), or taken from
the log itself (the stage times of each ddtree budget it holds; two budgets at least). A larger tree never
costs less, so the measured times are first made non-decreasing in the budget (neighbours that disagree are
pooled: isotonic regression), then interpolated linearly between budgets; below the smallest measured
budget the time is that budget's (no extrapolation towards zero), and beyond the largest it grows along the
last segment. A top-k cap changes the tree's shape, not its size, so the curve does not depend on it. A log
with one budget and no cost file has no curve: advise then gives the replayed tau table alone (no tokens/s,
no recommendation).

What the figures rest on, and how sure they are:
- each prediction names the request-steps its tau is replayed over (every replayed step without a cap, the
  steps with node ranks under one) and the requests behind them. Its interval is a bootstrap over requests
  (`telemetry.analysis.replay`: 1000 resamples, seeded, 95%); the tokens/s interval is the tau interval times the same
  (active requests / step time), the step time being taken as measured.
- measured tokens/s is the steady steps' own tokens over their own durations (warm-up steps, which carried
  compilation or graph capture, left out), the time the log's cost curve is made of: like against like.
  A measured run on other requests than the replayed one is marked so: its tau differs by its prompts too.
- completeness: the share of the replayed configuration's request-steps that have step lines (its request
  lines say how many there were), and of step records the telemetry did not report dropped, the smaller of
  the two. Below `WARN_BELOW` (99%) the advice carries a warning. Below `REFUSE_BELOW` (90%) it is refused
  (`IncompleteLog`; the CLI exits with status 2): the replay keeps only requests whose every step was seen,
  and at a tenth of the steps missing those are a selection (short requests lose fewer), not the run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from telemetry.analysis.adaptive import AR, AdaptiveLog
from telemetry.analysis.cost import CostCurve, CostFile, cost_from_log
from telemetry.analysis.digest import Digest, Key
from telemetry.analysis.replay import ReplayTable
from telemetry.analysis.steps import Completeness, ConfigStats, warmup_note

MIN_EXACT_SHARE = 0.9  # a (B', k') whose replay is a lower bound on more steps than this is not recommended
WARN_BELOW = 0.99  # completeness share under which the advice warns
REFUSE_BELOW = 0.90  # and under which it is refused
NO_COST = (
    "no cost curve: the log times ddtree's steady steps at one budget only; for tokens/s and a recommendation"
    " give it a cost curve (`ddtree bench --cost-curve FILE`, then `ddtree advise LOG --cost-curve FILE`)"
)


class IncompleteLog(ValueError):
    """Too few of the run's steps are in the log to advise on."""


@dataclass(frozen=True)
class Prediction:
    budget: int
    topk: int | None
    predicted_tau: float
    predicted_tokens_per_second: float | None  # None without a cost curve
    exact_share: float  # steps whose replay is exact, not a lower bound
    request_steps: int  # the replayed request-steps the tau rests on
    requests: int
    tau_interval: tuple[float, float] | None = None  # bootstrap over requests
    tokens_per_second_interval: tuple[float, float] | None = None


def predict(table: ReplayTable, active_per_step: float, cost: CostCurve | None) -> list[Prediction]:
    configs = [
        (budget, topk)
        for topk in (None, *table.topks)
        for budget in range(1, table.budget + 1)
        if table.tau(budget, topk) is not None and (topk is None or topk < budget)
    ]
    out = []
    for (budget, topk), interval in zip(configs, table.bootstrap(configs), strict=True):
        tau = table.tau(budget, topk)
        assert tau is not None
        per_tau = active_per_step / cost.step_ms(budget) * 1000 if cost is not None else None
        speed = per_tau * tau if per_tau is not None else None
        speeds = (interval[0] * per_tau, interval[1] * per_tau) if interval and per_tau is not None else None
        steps = table.steps if topk is None else table.ranked_steps
        share = table.exact_share(budget, topk)
        out.append(Prediction(budget, topk, tau, speed, share, steps, table.requests, interval, speeds))
    return out


def recommend(predictions: list[Prediction]) -> Prediction | None:
    """The most tokens/s among the trusted predictions; None without tokens/s (no cost curve)."""
    timed = [p for p in predictions if p.predicted_tokens_per_second is not None]
    trusted = [p for p in timed if p.exact_share >= MIN_EXACT_SHARE] or timed
    return max(trusted, key=lambda p: (p.predicted_tokens_per_second or 0.0, -p.budget), default=None)


def check_complete(completeness: Completeness) -> list[str]:
    """Warnings for a log below `WARN_BELOW`; IncompleteLog below `REFUSE_BELOW`."""
    share = completeness.share
    if share is None or share >= WARN_BELOW:
        return []
    if share < REFUSE_BELOW:
        raise IncompleteLog(
            f"the log is too incomplete to advise on: {completeness.line()}; the telemetry lost "
            f"{1 - share:.1%} of the run, advise needs {REFUSE_BELOW:.0%}: rerun where the log's sink keeps up"
        )
    return [f"incomplete log: {completeness.line()} (under {WARN_BELOW:.0%}): the replay is over the complete requests"]


def advise(
    digest: Digest, cost: CostCurve | CostFile | None = None, adaptive: AdaptiveLog | None = None
) -> dict[str, Any]:
    """The predictions, the recommendation, and predicted against measured for the ddtree configurations
    in the log. A cost file of several batch sizes gives the curve nearest the replayed run's active requests
    per step. With a cost file and `adaptive` (the same log's predictions, read alongside the digest) also
    the adaptive rule replayed, as the drafter predicted and calibrated per width (`AdaptiveReplay`). Raises
    ValueError when the log has no accepted paths, IncompleteLog when too much is missing."""
    source = digest.replay_source()
    if source is None:
        raise ValueError("the log has no ddtree request lines with accepted paths to replay")
    key, table = source
    completeness = digest.completeness(key)
    warnings = check_complete(completeness)
    configs = digest.sorted_configs()
    logged = digest.configs.get(key)
    active = logged.active_per_step if logged and logged.steps else 1.0
    cost_file = cost
    if isinstance(cost, CostFile):
        cost = cost.for_rows(active)
    cost = cost or cost_from_log(configs)
    predictions = predict(table, active, cost)
    best = recommend(predictions)
    return {
        "source": {
            "budget": key[1],
            "topk": key[2],
            "steps": table.steps,
            "ranked_steps": table.ranked_steps,
            "requests": table.requests,
        },
        "completeness": {"share": completeness.share, "text": completeness.line()},
        "warnings": warnings,
        "notes": [note] if (note := warmup_note(configs)) else [],
        "cost": None
        if cost is None
        else {"source": cost.source, "points": [{"budget": b, "step_ms": ms} for b, ms in cost.points]},
        "configs": [asdict(p) for p in predictions],
        "recommended": None if best is None else asdict(best),
        "measured": _measured(digest, key, configs, predictions),
        "adaptive": _adaptive(key, cost_file, adaptive) if isinstance(cost_file, CostFile) else None,
    }


def _adaptive(key: Key, cost: CostFile, log: AdaptiveLog | None) -> dict[str, Any] | None:
    """The adaptive rule over the replayed configuration's steps, at the steps' own rows and as if at each
    batch size of the cost file: as the drafter predicted, and calibrated per width (cross-fitted)."""
    replay = log.replays.get(key) if log is not None else None
    if replay is None or not replay.steps:
        return None
    return {
        "widths": list(replay.widths),
        "by_rows": [
            {
                "rows": rows,
                "predicted": replay.evaluate(cost, rows=rows),
                "calibrated": replay.evaluate(cost, calibrated=True, rows=rows),
            }
            for rows in [None, *sorted(cost.curves)]
        ],
    }


def _measured(digest: Digest, key: Key, configs: list[ConfigStats], predictions: list[Prediction]) -> list[Any]:
    by_config = {(p.budget, p.topk): p for p in predictions}
    measured = []
    for g in configs:
        p = by_config.get((g.budget, g.topk if g.topk is None or g.topk < g.budget else None))
        if g.method == "ddtree" and p is not None:
            measured.append(
                {
                    "budget": g.budget,
                    "topk": g.topk,
                    "same_requests": digest.same_requests(key, (g.method, g.budget, g.topk)),
                    "steady_steps": g.timed_steps,
                    "warmup_steps": g.warmup_steps,
                    "measured_tau": g.tau,
                    "measured_tokens_per_second": g.tokens_per_second if g.timed_steps else None,
                    "predicted_tau": p.predicted_tau,
                    "predicted_tokens_per_second": p.predicted_tokens_per_second,
                }
            )
    return measured


def _span(interval: Any, digits: int) -> str:
    return "-" if interval is None else f"{interval[0]:.{digits}f}-{interval[1]:.{digits}f}"


def _row(p: dict[str, Any]) -> str:
    topk = "-" if p["topk"] is None else p["topk"]
    speed = p["predicted_tokens_per_second"]
    return (
        f"{p['budget']:>7}{topk:>6}{p['predicted_tau']:>8.2f}{_span(p['tau_interval'], 2):>13}"
        f"{'-' if speed is None else f'{speed:.1f}':>10}{_span(p['tokens_per_second_interval'], 1):>17}"
        f"{p['request_steps']:>10}{p['exact_share']:>8.0%}"
    )


def _shown(result: dict[str, Any], top: int) -> list[dict[str, Any]]:
    """The rows to print: the fastest `top`; without tokens/s, budgets 1, 2, 4, ... uncapped and the caps at
    the logged budget."""
    configs = result["configs"]
    if result["cost"] is not None:
        return sorted(configs, key=lambda p: -p["predicted_tokens_per_second"])[:top]
    logged = result["source"]["budget"]
    grid = {1 << i for i in range(logged.bit_length())} | {logged}
    return [p for p in configs if (p["topk"] is None and p["budget"] in grid) or p["budget"] == logged]


def format_advice(result: dict[str, Any], top: int = 10) -> str:
    src = result["source"]
    cost = result["cost"]
    lines = [
        f"replayed from ddtree B={src['budget']}: {src['steps']} request-steps of {src['requests']} requests, "
        f"{src['ranked_steps']} with node ranks; {result['completeness']['text']}",
        f"step time from {cost['source']}" if cost is not None else NO_COST,
        *(f"warning: {w}" for w in result["warnings"]),
        *(f"note: {n}" for n in result["notes"]),
        f"{'budget':>7}{'topk':>6}{'tau':>8}{'tau 95%':>13}{'tok/s':>10}{'tok/s 95%':>17}{'req-steps':>10}{'exact':>8}",
        *(_row(p) for p in _shown(result, top)),
    ]
    if result["measured"]:
        lines.append("predicted against measured (tau, tokens/s of the steady steps):")
    for m in result["measured"]:
        speeds = ""
        if m["predicted_tokens_per_second"] is not None and m["measured_tokens_per_second"] is not None:
            speeds = f", {m['predicted_tokens_per_second']:.1f} vs {m['measured_tokens_per_second']:.1f} tokens/s"
        other = "" if m["same_requests"] else " (measured on other requests)"
        lines.append(
            f"  B={m['budget']} topk={m['topk']}: tau {m['predicted_tau']:.2f} vs {m['measured_tau']:.2f}{speeds}"
            f"{other}"
        )
    rec = result["recommended"]
    if rec is not None:
        lines.append(recommendation_line(rec))
    lines.extend(adaptive_lines(result.get("adaptive")))
    return "\n".join(lines)


def adaptive_lines(adaptive: dict[str, Any] | None) -> list[str]:
    """What the adaptive rule would have made, replayed: against the best fixed width or `ar`, per batch size."""
    if adaptive is None:
        return []
    lines = [
        f"adaptive width per step (of {adaptive['widths']} and ar), replayed under the cost file "
        "(rows: the log's own, or each batch size of the file):",
        f"  {'rows':>6}{'steps':>7}{'best fixed':>18}{'adaptive':>10}{'x':>7}{'calibrated':>12}{'x':>7}  widths chosen",
    ]
    for entry in adaptive["by_rows"]:
        raw, cal = entry["predicted"], entry["calibrated"]
        fixed = raw["fixed_tokens_per_second"]
        width = max(fixed, key=fixed.get)
        best = f"{_width(width, 'W=')} {fixed[width]:.0f}"
        chosen = " ".join(f"{_width(w)}:{n}" for w, n in cal["chosen_widths"].items())
        lines.append(
            f"  {entry['rows'] or 'log':>6}{raw['steps']:>7}{best:>18}{raw['adaptive_tokens_per_second']:>10.0f}"
            f"{raw['adaptive_over_best_fixed']:>7.3f}{cal['adaptive_tokens_per_second']:>12.0f}"
            f"{cal['adaptive_over_best_fixed']:>7.3f}  {chosen}"
        )
    return lines


def _width(width: str, prefix: str = "") -> str:
    """A replayed width's label: `ar` for width 0 (no tree)."""
    return "ar" if width == str(AR) else prefix + width


def recommendation_line(rec: dict[str, Any]) -> str:
    """'recommended: --budget 8 --topk 2 (predicted 412.0 tokens/s, 95% 398.1-425.3, over 480 request-steps)'."""
    flags = f"--budget {rec['budget']}" + (f" --topk {rec['topk']}" if rec["topk"] else "")
    interval = rec["tokens_per_second_interval"]
    spread = f", 95% {_span(interval, 1)}" if interval is not None else ", no interval (under two requests)"
    return (
        f"recommended: {flags} (predicted {rec['predicted_tokens_per_second']:.1f} tokens/s{spread}, "
        f"tau {rec['predicted_tau']:.2f}, over {rec['request_steps']} request-steps of {rec['requests']} requests)"
    )
