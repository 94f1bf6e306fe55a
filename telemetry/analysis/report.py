"""`ddtree analyze --out DIR`: summary.json, one PNG per plot, and report.html with the images inlined.

matplotlib draws through its Agg canvas (`Figure`, no pyplot), so no display or GUI backend is needed. Every
plot has one figure size, `FIGSIZE` inches at `DPI`.

- tokens per second over time: one line per configuration, a point per steady step (its emitted tokens over
  its own duration; a merged point in long runs, see `digest.StepSeries`), broken where the engine sat idle;
  warm-up steps are ticks on the time axis, not points.
- what the tree added over its chain: per depth, accepted drafts per request-step against the part its own
  chain would have accepted (`telemetry.analysis.chain`), from the step lines' accepted ranks.
- calibration: the reliability of the drafter's predicted acceptance length; per configuration, the mean
  acceptance length the target gave against the one predicted, in quantile bins of the prediction, with the
  fitted calibration map and the diagonal (`telemetry.analysis.calibration`).
- predicted tau: the replay's curves; a measured tau is a black cross only where it was measured on the
  same requests as the replay (same ids, or same prompts where logged), a grey circle otherwise.
- the report states how complete the log is and carries `ddtree advise`'s recommendation with its interval.
"""

from __future__ import annotations

import base64
import html
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from telemetry import semconv as sc
from telemetry.analysis.advise import NO_COST, advise, recommendation_line
from telemetry.analysis.calibration import plot_calibration
from telemetry.analysis.chain import plot_chain
from telemetry.analysis.digest import RELIABILITY_BINS, Digest

FIGSIZE = (8.0, 4.5)
DPI = 100
Plot = Callable[[Axes, Digest], None]


def _lengths(ax: Axes, d: Digest) -> None:
    for g in d.sorted_configs():
        hist: Counter[int] = d.lengths.get((g.method, g.budget, g.topk), Counter())
        total = sum(hist.values()) or 1
        xs = sorted(hist)
        ax.plot(xs, [hist[x] / total for x in xs], marker="o", label=g.label)
    ax.set_xlabel("acceptance length (accepted drafts + 1)")
    ax.set_ylabel("share of request-steps")
    ax.set_title("Acceptance length")


def _depth_rate(ax: Axes, d: Digest) -> None:
    for g in d.sorted_configs():
        rates = g.depth_rate()
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=g.label)
    ax.set_xlabel("depth")
    ax.set_ylabel("acceptance rate (given the depth above)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance rate per depth")


def _utilisation(ax: Axes, d: Digest) -> None:
    for g in d.sorted_configs():
        if not g.nodes_per_depth or not any(g.nodes_per_depth):
            continue
        depths = range(1, len(g.nodes_per_depth) + 1)
        line = ax.plot(depths, [n / g.steps for n in g.nodes_per_depth], marker="o", label=f"{g.label} nodes")
        accepted = [a / g.steps for a in g.accepted_per_depth]
        ax.plot(
            depths[: len(accepted)],
            accepted,
            ls="--",
            marker="x",
            color=line[0].get_color(),
            label=f"{g.label} accepted",
        )
    ax.set_xlabel("depth")
    ax.set_ylabel("per step")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_title("Tree utilisation: nodes against accepted, per depth")


def _reliability(ax: Axes, d: Digest) -> None:
    ax.plot([0, 1], [0, 1], color="grey", ls=":", label="calibrated")
    rows = [(p / n, a / n) for n, a, p in d.reliability if n]
    if rows:
        ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="o", label="nodes")
    else:
        ax.text(0.5, 0.5, "no node probabilities in the log (DDTREE_LOG_TREE)", ha="center", transform=ax.transAxes)
    ax.set_xlabel(f"drafter probability of the node ({RELIABILITY_BINS} bins)")
    ax.set_ylabel("share accepted")
    ax.set_title("Reliability")


def _predicted(ax: Axes, d: Digest) -> None:
    source = d.replay_source()
    if source is None:
        ax.text(0.5, 0.5, "no accepted paths in the log", ha="center", transform=ax.transAxes)
    else:
        (_, budget, _), table = source
        budgets = list(range(1, budget + 1))
        for topk in (None, *table.topks):
            taus = [table.tau(b, topk) for b in budgets]
            pts = [(b, t) for b, t in zip(budgets, taus, strict=True) if t is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label="no cap" if topk is None else f"top-k {topk}")
        _measured_taus(ax, d)
    ax.set_xlabel("budget B (draft nodes)")
    ax.set_xscale("log", base=2)
    ax.set_ylabel("tau (replayed; x: measured on the same requests)")
    ax.set_title("Predicted tau against budget")


def _measured_taus(ax: Axes, d: Digest) -> None:
    """Measured tau per ddtree configuration: a cross where the requests are the replay's, a circle elsewhere."""
    source = d.replay_source()
    same: list[tuple[int, float]] = []
    other: list[tuple[int, float]] = []
    for g in d.sorted_configs():
        if g.method == "ddtree" and source is not None:
            on_same = d.same_requests(source[0], (g.method, g.budget, g.topk))
            (same if on_same else other).append((g.budget, g.tau))
    if same:
        xs, ys = zip(*same, strict=True)
        ax.scatter(xs, ys, marker="x", color="black", zorder=3, label="measured, same requests")
    if other:
        xs, ys = zip(*other, strict=True)
        ax.scatter(xs, ys, marker="o", facecolors="none", edgecolors="grey", zorder=3, label="measured, other requests")


def _stages(ax: Axes, d: Digest) -> None:
    groups = d.sorted_configs()
    bottom = [0.0] * len(groups)
    for stage in [s for s in sc.ALL_STAGES if s in sc.STAGES or any(s in g.stage_ms for g in groups)]:
        ms = [g.stage_mean_ms(stage) for g in groups]
        ax.bar([g.label for g in groups], ms, bottom=bottom, label=stage)
        bottom = [b + m for b, m in zip(bottom, ms, strict=True)]
    ax.set_xlabel("configuration")
    ax.set_ylabel("ms per steady step")
    ax.set_title("Stage times (warm-up steps left out)")


def _throughput(ax: Axes, d: Digest) -> None:
    since = d.first_ns()
    for g in d.sorted_configs():
        series = d.series.get((g.method, g.budget, g.topk))
        if series is None:
            continue
        xs, ys = series.rates(since)
        line = ax.plot(xs, ys, marker="." if len(xs) < 200 else None, label=g.label)
        if series.warmup_ns:
            ticks = [(t - since) / 1e9 for t in series.warmup_ns]
            color = line[0].get_color()
            ax.scatter(ticks, [0.0] * len(ticks), marker="|", s=200, color=color, label=f"{g.label} warm-up")
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("tokens/s (each step's tokens / its duration)")
    ax.set_title("Tokens per second over time")


def _chain(ax: Axes, d: Digest) -> None:
    plot_chain(ax, [(g.label, g.chain) for g in d.sorted_configs()])


def _calibration(ax: Axes, d: Digest) -> None:
    plot_calibration(ax, [(g.label, g.calibration) for g in d.sorted_configs()])


PLOTS: dict[str, Plot] = {
    "acceptance_lengths": _lengths,
    "acceptance_per_depth": _depth_rate,
    "tree_over_chain": _chain,
    "calibration": _calibration,
    "tree_utilisation": _utilisation,
    "reliability": _reliability,
    "predicted_tau": _predicted,
    "stage_times": _stages,
    "tokens_per_second": _throughput,
}


def _gpu_figure(d: Digest) -> Figure:
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    axes = fig.subplots(3, 1, sharex=True)
    for gpu, series in sorted(d.gpu.items()):
        xs, ys = series.means(since_ns=d.first_ns())
        for ax, i, scale in zip(axes, range(3), (1.0, 2**-30, 1.0), strict=True):
            ax.plot(xs, [y[i] * scale for y in ys], label=f"gpu {gpu}")
    for ax, label in zip(axes, ("utilisation %", "memory GiB", "power W"), strict=True):
        ax.set_ylabel(label)
    axes[-1].set_xlabel("seconds since the first step")
    axes[0].set_title("GPU (NVML samples)")
    return fig


def write_report(digest: Digest, out: Path, table: str) -> list[Path]:
    """Write summary.json, the plots and report.html under `out`; return the files written."""
    out.mkdir(parents=True, exist_ok=True)
    summary = digest.summary()
    summary["advice"] = _advice(digest)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    figures: dict[str, Figure] = {}
    for name, plot in PLOTS.items():
        fig = Figure(figsize=FIGSIZE, dpi=DPI)
        ax = fig.add_subplot()
        plot(ax, digest)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        figures[name] = fig
    if digest.gpu:
        figures["gpu"] = _gpu_figure(digest)
    images = []
    for name, fig in figures.items():
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, format="png")
        images.append(path)
    html_path = out / "report.html"
    html_path.write_text(_html(summary, table, images))
    return [out / "summary.json", *images, html_path]


def _advice(digest: Digest) -> dict[str, Any]:
    """`ddtree advise` on the log with its own cost curve, and the line the report prints; the reason if not."""
    try:
        result = advise(digest)
    except ValueError as exc:
        return {"text": f"no recommendation: {exc}"}
    rec = result["recommended"]
    return result | {"text": recommendation_line(rec) if rec is not None else f"no recommendation: {NO_COST}"}


def _html(summary: dict[str, Any], table: str, images: list[Path]) -> str:
    lines = summary["lines"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>ddtree analyze</title>",
        "<style>body{font-family:sans-serif;max-width:60em;margin:auto}pre{overflow-x:auto}</style></head><body>",
        "<h1>ddtree analyze</h1>",
        f"<p>{lines['steps']} step lines, {lines['requests']} request lines, {lines['bad']} bad lines "
        f"of {lines['lines']}.</p>",
        f"<p>{html.escape(summary['completeness']['text'])}</p>",
        f"<pre>{html.escape(table)}</pre>",
        f"<p>{html.escape(summary['fastest'])}</p>",
        f"<p>{html.escape(summary['advice']['text'])}</p>",
    ]
    for path in images:
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        title = path.stem.replace("_", " ")
        parts.append(
            f"<figure><img alt='{title}' src='data:image/png;base64,{data}'><figcaption>{title}</figcaption></figure>"
        )
    parts.append("</body></html>")
    return "\n".join(parts)
