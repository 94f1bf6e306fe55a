"""What the tree added over its chain, per depth: `ddtree analyze`'s table, its summary.json entry and its plot.

From the step lines' `accepted_ranks` (and `off_chain_parent_nodes_per_depth`), summed per configuration into a
`telemetry.chain.ChainCounts`; the glossary there defines every column. Per depth d, over the request-steps
whose step lines carry ranks (in accepted drafts per request-step, so that each column sums to a tau share):

- accepted: accepted drafts at depth d; on chain: those the tree's own chain (rank 0 at every depth above and
  at d) would have accepted too; tree added: the rest, at or below the path's first rank > 0. So
  tau(tree) = 1 + sum(accepted), tau(chain prefix) = 1 + sum(on chain), and their difference is sum(tree added).
- not top-1: accepted drafts at depth d whose own rank is > 0 (where the path branched off, or a later branch).
- parent off chain: accepted / offered nodes at depth d whose parent is off the chain, and that rate.

Logs written before the step lines carried ranks, and loops that read none back (SGLang's worker), have none:
the table says so instead of showing zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from telemetry.chain import ChainCounts, count_at, per_depth

if TYPE_CHECKING:
    from matplotlib.axes import Axes  # only the report draws: the table needs no matplotlib

NO_RANKS = (
    "what the tree added over its chain: no accepted ranks in this log (step lines written before they carried"
    " `accepted_ranks`, or by a loop that reads none back, have none)"
)


def shown(items: Sequence[tuple[str, ChainCounts]]) -> list[tuple[str, ChainCounts]]:
    """The configurations with ranked request-steps that drafted something (`ar` has nothing to show)."""
    return [(label, c) for label, c in items if c.request_steps and c.depth]


def chain_table(items: Sequence[tuple[str, ChainCounts]]) -> list[str]:
    """The table's lines, for (label, counts) per configuration; one line saying why where there is none."""
    rows = shown(items)
    if not rows:
        ranked = any(c.request_steps for _, c in items)
        return [NO_RANKS if not ranked else "what the tree added over its chain: no drafts accepted or offered"]
    lines = ["what the tree added over its chain (accepted drafts per request-step, by depth):"]
    for label, c in rows:
        tree, chain = c.tree_tau or 1.0, c.chain_tau or 1.0
        lines.append(
            f"{label}: {c.request_steps} request-steps with ranks; tau {tree:.3f} (tree) against {chain:.3f} (its"
            f" chain prefix): the tree added {tree - chain:+.3f}"
        )
        lines.append(
            f"  {'depth':>5}{'accepted':>10}{'on chain':>10}{'tree added':>12}{'not top-1':>11}"
            f"{'parent off chain: accepted / offered':>40}"
        )
        n = c.request_steps
        for d in range(1, c.depth + 1):
            offered, off = count_at(c.off_parent_nodes, d), count_at(c.off_parent, d)
            rate = f"{off} / {offered} = {off / offered:.3f}" if offered else f"{off} / 0"
            lines.append(
                f"  {d:>5}{count_at(c.accepted, d) / n:>10.3f}{c.on_chain(d) / n:>10.3f}"
                f"{count_at(c.tree_added, d) / n:>12.3f}{count_at(c.off_chain, d) / n:>11.3f}{rate:>40}"
            )
    return lines


def chain_summary(c: ChainCounts) -> dict[str, Any] | None:
    """summary.json's entry for one configuration (per-depth lists start at depth 1); None without ranks."""
    if not c.request_steps:
        return None
    depth = c.depth
    return {
        "request_steps": c.request_steps,
        "tree_tau": c.tree_tau,
        "chain_tau": c.chain_tau,
        "accepted_per_depth": per_depth(c.accepted, depth),
        "on_chain_per_depth": [c.on_chain(d) for d in range(1, depth + 1)],
        "tree_added_per_depth": per_depth(c.tree_added, depth),
        "off_chain_per_depth": per_depth(c.off_chain, depth),
        "off_chain_parent_accepted_per_depth": per_depth(c.off_parent, depth),
        "off_chain_parent_nodes_per_depth": per_depth(c.off_parent_nodes, depth),
    }


def plot_chain(ax: Axes, items: Sequence[tuple[str, ChainCounts]]) -> None:
    """Per depth: accepted drafts per request-step (solid) and its chain's part (dashed), the gap shaded: what
    the tree added over its chain."""
    from matplotlib.ticker import MaxNLocator

    rows = shown(items)
    for label, c in rows:
        depths = list(range(1, c.depth + 1))
        accepted = [count_at(c.accepted, d) / c.request_steps for d in depths]
        on_chain = [c.on_chain(d) / c.request_steps for d in depths]
        added = (c.tree_tau or 1.0) - (c.chain_tau or 1.0)
        line = ax.plot(depths, accepted, marker="o", label=f"{label} tree (tau +{added:.2f} over its chain)")
        color = line[0].get_color()
        ax.plot(depths, on_chain, ls="--", marker="x", color=color, label=f"{label} its chain")
        ax.fill_between(depths, on_chain, accepted, color=color, alpha=0.2)
    if not rows:
        ax.text(0.5, 0.5, "no accepted ranks in the log", ha="center", transform=ax.transAxes)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("depth")
    ax.set_ylabel("accepted drafts per request-step")
    ax.set_ylim(bottom=0)
    ax.set_title("What the tree added over its chain")
