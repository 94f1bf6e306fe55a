"""Draw one DDTree decode step (draft -> tree_build -> verify -> accept) with the observer hooks beneath.

    .venv/bin/python scripts/draw_step.py [--out docs/img/step.png]

The example is small enough to read but computed by the package itself: the tree is `ddtree.tree.build_tree`
over made-up per-depth distributions, the mask is `ddtree.tree.ancestor_mask`, and the accepted path and
bonus are `ddtree.accept.accept` over made-up target tokens. Writes a 1600 x 700 px PNG.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

from ddtree.accept import accept
from ddtree.tree import ancestor_mask, build_tree

ROOT = Path(__file__).resolve().parents[1]

# The example: after "The sky is", the previous step's bonus token "blue" is this step's root.
CONTEXT = ["The", "sky", "is"]
BONUS = "blue"
VOCAB = [",", ".", "and", "because", "the", "light", "it", "so", "sky"]
# The drafter's per-depth distributions (depth 1, 2, 3), as probabilities over VOCAB.
DEPTH_PROBS = [
    {",": 0.60, ".": 0.28, "and": 0.12},
    {"and": 0.50, "because": 0.30, "the": 0.20},
    {"the": 0.50, "light": 0.30, "it": 0.20},
]
BUDGET = 6
# What the target chooses at each node (root first), by the node's draft token path; unknown paths get "so".
TARGET_AT = {(): ",", (",",): "because", (",", "because"): "light", (",", "and"): "it", (".",): "the"}

STAGE_COLORS = {
    "draft": "#4C72B0",
    "tree_build": "#DD8452",
    "verify": "#8172B3",
    "accept": "#55A868",
}
INK = "#222222"
LABEL_BG = {"facecolor": "white", "edgecolor": "none", "pad": 0.6, "alpha": 0.85}
MUTED = "#888888"
PANEL_Y0, PANEL_Y1 = 23.0, 65.5  # stage panels; the hooks band lies below
PANELS = {"draft": (1.0, 40.0), "tree_build": (41.5, 79.5), "verify": (81.0, 119.0), "accept": (120.5, 159.0)}


def example() -> dict[str, object]:
    """The tree, mask, target tokens and accept result of the example, from the package's own functions."""
    logits = torch.full((1, len(DEPTH_PROBS), len(VOCAB)), -1e9)
    for d, probs in enumerate(DEPTH_PROBS):
        for token, p in probs.items():
            logits[0, d, VOCAB.index(token)] = math.log(p)
    tree = build_tree(logits, BUDGET)
    mask = ancestor_mask(tree)
    n = tree.width
    tokens = [BONUS] + [VOCAB[int(t)] for t in tree.tokens[0, 1:]]
    parents = [int(p) for p in tree.parents[0]]
    depths = [int(d) for d in tree.depths[0]]
    paths: list[tuple[str, ...]] = []
    for i in range(n):
        path: list[str] = []
        j = i
        while j > 0:
            path.insert(0, tokens[j])
            j = parents[j]
        paths.append(tuple(path))
    target_words = [TARGET_AT.get(p, "so") for p in paths]
    target_ids = torch.tensor([[VOCAB.index(w) for w in target_words]])
    result = accept(tree, mask, target_ids, torch.tensor([-1]))
    accepted = int(result.accepted[0])
    path_nodes = [int(x) for x in result.path[0, : accepted + 1]]
    return {
        "tokens": tokens,
        "parents": parents,
        "depths": depths,
        "probs": [math.exp(float(x)) for x in tree.log_probs[0]],
        "mask": mask[0].bool().tolist(),
        "target": target_words,
        "path": path_nodes,
        "bonus": VOCAB[int(result.bonus[0])],
    }


def box(ax, x, y, w, h, text="", color=INK, fill="white", size=11, weight="normal", style="round", lw=1.4, ls="-"):
    patch = FancyBboxPatch(
        (x, y),
        w,
        h,
        boxstyle=f"{style},pad=0.02,rounding_size=0.6" if style == "round" else style,
        linewidth=lw,
        edgecolor=color,
        facecolor=fill,
        linestyle=ls,
    )
    ax.add_patch(patch)
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, color=INK, weight=weight)


def arrow(ax, x0, y0, x1, y1, color=INK, lw=1.6, style="-|>", ls="-"):
    ax.add_patch(
        FancyArrowPatch((x0, y0), (x1, y1), arrowstyle=style, mutation_scale=14, color=color, lw=lw, linestyle=ls)
    )


def panel(ax, stage: str, number: int, caption: str) -> tuple[float, float]:
    x0, x1 = PANELS[stage]
    color = STAGE_COLORS[stage]
    ax.add_patch(
        FancyBboxPatch(
            (x0, PANEL_Y0),
            x1 - x0,
            PANEL_Y1 - PANEL_Y0,
            boxstyle="round,pad=0,rounding_size=1.2",
            linewidth=1.8,
            edgecolor=color,
            facecolor=color + "0F",
        )
    )
    ax.add_patch(Rectangle((x0, PANEL_Y1 - 5.2), x1 - x0, 5.2, facecolor=color, edgecolor=color))
    ax.text(
        x0 + 1.2,
        PANEL_Y1 - 2.6,
        f"{number}  {stage}",
        ha="left",
        va="center",
        fontsize=15,
        color="white",
        weight="bold",
        family="monospace",
    )
    ax.text((x0 + x1) / 2, PANEL_Y0 + 2.2, caption, ha="center", va="center", fontsize=10.5, color=INK, style="italic")
    return x0, x1


def tree_layout(ex: dict[str, object], x0: float, x1: float, y_top: float, y_step: float) -> dict[int, tuple]:
    """Node positions: depth down the page, leaves spread across."""
    parents: list[int] = ex["parents"]  # type: ignore[assignment]
    n = len(parents)
    children: dict[int, list[int]] = {i: [] for i in range(n)}
    for i in range(1, n):
        children[parents[i]].append(i)
    leaves: list[int] = []

    def walk(i: int) -> None:
        if not children[i]:
            leaves.append(i)
        for c in children[i]:
            walk(c)

    walk(0)
    xs: dict[int, float] = {}
    span = (x1 - x0) / max(len(leaves), 1)
    for k, leaf in enumerate(leaves):
        xs[leaf] = x0 + span * (k + 0.5)

    def place(i: int) -> float:
        if i not in xs:
            xs[i] = sum(place(c) for c in children[i]) / len(children[i])
        return xs[i]

    place(0)
    depths: list[int] = ex["depths"]  # type: ignore[assignment]
    return {i: (xs[i], y_top - depths[i] * y_step) for i in range(n)}


def draw_tree(ax, ex, x0, x1, y_top, y_step, accepted=None, target=False, probs=False):
    tokens: list[str] = ex["tokens"]
    parents: list[int] = ex["parents"]
    pos = tree_layout(ex, x0, x1, y_top, y_step)
    for i in range(1, len(tokens)):
        (xa, ya), (xb, yb) = pos[parents[i]], pos[i]
        on_path = accepted is not None and i in accepted
        ax.plot(
            [xa, xb],
            [ya - 1.3, yb + 1.3],
            color=STAGE_COLORS["accept"] if on_path else MUTED,
            lw=3 if on_path else 1.3,
            zorder=1,
        )
    for i, (x, y) in pos.items():
        w = max(4.4, 0.95 * len(tokens[i]) + 2.4)
        if accepted is None:
            fill, edge = ("#F3F3F3", INK) if i == 0 else ("white", STAGE_COLORS["tree_build"])
        elif i in accepted:
            fill, edge = "#DDF1E2", STAGE_COLORS["accept"]
        else:
            fill, edge = "#F3F3F3", "#BBBBBB"
        box(
            ax,
            x - w / 2,
            y - 1.3,
            w,
            2.6,
            tokens[i],
            color=edge,
            fill=fill,
            size=10.5,
            weight="bold" if i == 0 else "normal",
        )
        ax.text(x - w / 2 - 0.3, y + 1.4, str(i), ha="right", va="bottom", fontsize=8, color=MUTED)
        if probs and i > 0:
            ax.text(
                x, y - 1.9, f"p = {ex['probs'][i]:.2f}", ha="center", va="top", fontsize=8.5, color=MUTED, bbox=LABEL_BG
            )
        if target:
            keep = accepted is None or i in accepted
            ax.text(
                x,
                y - 1.9,
                f"\u2192 {ex['target'][i]}",
                ha="center",
                va="top",
                fontsize=9,
                color=STAGE_COLORS["verify"] if keep else "#AAAAAA",
                weight="bold" if keep else "normal",
                bbox=LABEL_BG,
            )
    return pos


def draw_draft(ax) -> None:
    x0, x1 = panel(ax, "draft", 1, "one drafter forward: a distribution per depth")
    ax.text(x0 + 1.2, 58.6, "context", fontsize=9.5, color=MUTED, va="center")
    x = x0 + 1.2
    for word in CONTEXT:
        w = 0.9 * len(word) + 2.2
        box(ax, x, 54.0, w, 2.8, word, color=MUTED, fill="#F3F3F3", size=10)
        x += w + 0.5
    bx = x0 + 17.0
    ax.text(bx, 58.6, "block: [bonus, mask, ...]", fontsize=9.5, color=MUTED, va="center")
    for k, word in enumerate([BONUS, "mask", "mask", "mask"]):
        w = 4.3
        box(
            ax,
            bx + k * (w + 0.5),
            54.0,
            w,
            2.8,
            word,
            color=STAGE_COLORS["draft"],
            fill="#E3EAF5" if k == 0 else "white",
            size=9.5,
            weight="bold" if k == 0 else "normal",
        )
    mid = (x0 + x1) / 2
    arrow(ax, mid, 53.2, mid, 50.6)
    box(ax, x0 + 5, 45.4, x1 - x0 - 10, 4.8, "", color=STAGE_COLORS["draft"], fill="#E3EAF5")
    ax.text(mid, 48.6, "DFlash drafter", ha="center", va="center", fontsize=11, weight="bold")
    ax.text(mid, 46.6, "the target's embeddings and head", ha="center", va="center", fontsize=9, color=MUTED)
    arrow(ax, mid, 45.0, mid, 42.4)
    width = (x1 - x0 - 3) / 3
    for d, probs in enumerate(DEPTH_PROBS):
        cx = x0 + 1.5 + d * width
        ax.text(
            cx + width / 2, 40.4, f"depth {d + 1}", ha="center", fontsize=10, weight="bold", color=STAGE_COLORS["draft"]
        )
        for r, (token, p) in enumerate(probs.items()):
            y = 36.8 - r * 3.2
            ax.text(cx + 5.0, y, token, ha="right", va="center", fontsize=9.5)
            ax.add_patch(Rectangle((cx + 5.4, y - 1.0), p * 6.5, 2.0, color=STAGE_COLORS["draft"], alpha=0.3 + 0.7 * p))
            ax.text(cx + 5.7 + p * 6.5, y, f"{p:.2f}", va="center", fontsize=8, color=MUTED)
    ax.text(mid, 27.0, "the head runs over min(L, B) of its L depths", ha="center", fontsize=9.5, color=MUTED)


def draw_tree_build(ax, ex) -> None:
    x0, x1 = panel(ax, "tree_build", 2, f"the B = {BUDGET} most probable prefixes")
    mid = (x0 + x1) / 2
    ax.text(mid, 58.6, "a prefix's probability: the product over its depths", ha="center", fontsize=9.5, color=MUTED)
    ax.text(mid, 56.6, "nodes numbered by it: a parent precedes its children", ha="center", fontsize=9.5, color=MUTED)
    draw_tree(ax, ex, x0 + 2, x1 - 2, 52.0, 7.2, probs=True)


def draw_verify(ax, ex) -> None:
    x0, x1 = panel(ax, "verify", 3, "one target forward over [root] + nodes")
    tokens: list[str] = ex["tokens"]
    depths: list[int] = ex["depths"]
    mask: list[list[bool]] = ex["mask"]
    target: list[str] = ex["target"]
    n = len(tokens)
    cell = 2.4
    gx, gy = x0 + 8.6, 53.0  # top-left of the grid
    mid = (x0 + x1) / 2
    ax.text(mid, 58.6, "ancestor-only mask: each node sees the KV prefix,", ha="center", fontsize=9.5, color=MUTED)
    ax.text(mid, 56.6, "its ancestors and itself", ha="center", fontsize=9.5, color=MUTED)
    ax.text(gx + n * cell + 0.6, gy + 0.4, "pos", fontsize=8.5, color=MUTED, va="bottom")
    ax.text(gx + n * cell + 3.9, gy + 0.4, "target", fontsize=8.5, color=MUTED, va="bottom")
    for i in range(n):
        y = gy - (i + 0.5) * cell
        ax.text(
            gx - 0.6, y, f"{i} {tokens[i]}", ha="right", va="center", fontsize=9, weight="bold" if i == 0 else "normal"
        )
        ax.text(gx + (i + 0.5) * cell, gy + 0.4, str(i), ha="center", va="bottom", fontsize=8, color=MUTED)
        for j in range(n):
            on = mask[i][j]
            ax.add_patch(
                Rectangle(
                    (gx + j * cell, gy - (i + 1) * cell),
                    cell,
                    cell,
                    facecolor=STAGE_COLORS["verify"] if on else "white",
                    alpha=0.85 if on else 1.0,
                    edgecolor="#CCCCCC",
                    lw=0.8,
                )
            )
        ax.text(gx + n * cell + 0.6, y, f"p+{depths[i]}", va="center", fontsize=8.5, color=MUTED)
        ax.text(
            gx + n * cell + 3.9,
            y,
            f"\u2192 {target[i]}",
            va="center",
            fontsize=9.5,
            color=STAGE_COLORS["verify"],
            weight="bold",
        )
    ax.text(mid, 31.6, "node i at position start + depth(i)", ha="center", fontsize=9.5, color=MUTED)
    ax.text(mid, 29.4, "the target's token at every node:", ha="center", fontsize=9.5, color=MUTED)
    ax.text(mid, 27.2, "argmax at T = 0, a seeded sample at T > 0", ha="center", fontsize=9.5, color=MUTED)


def draw_accept(ax, ex) -> None:
    x0, x1 = panel(ax, "accept", 4, "walk the target's tokens down the tree")
    path: list[int] = ex["path"]
    tokens: list[str] = ex["tokens"]
    mid = (x0 + x1) / 2
    ax.text(mid, 58.6, "a node is accepted when the target chose its token", ha="center", fontsize=9.5, color=MUTED)
    ax.text(mid, 56.6, "at its parent (\u2192: the target's token there)", ha="center", fontsize=9.5, color=MUTED)
    pos = draw_tree(ax, ex, x0 + 1.5, x1 - 9.5, 53.0, 6.3, accepted=set(path), target=True)
    lx, ly = pos[path[-1]]
    bx, by = x1 - 5.8, ly - 6.3
    arrow(ax, lx + 2.2, ly - 1.4, bx - 2.2, by + 1.0, color=STAGE_COLORS["accept"], ls="--")
    box(
        ax,
        bx - 3.6,
        by - 1.3,
        7.2,
        2.6,
        ex["bonus"],
        color=STAGE_COLORS["accept"],
        fill="white",
        size=10.5,
        weight="bold",
        ls="--",
    )
    ax.text(bx, by - 1.9, "bonus", ha="center", va="top", fontsize=9, color=STAGE_COLORS["accept"])
    kept = " ".join(tokens[i] for i in path[1:]) + " " + ex["bonus"]
    accepted = len(path) - 1
    ax.text(
        mid,
        29.2,
        f"emits \u201c{kept}\u201d ({accepted} accepted + bonus)",
        ha="center",
        fontsize=9.8,
        weight="bold",
        color=INK,
    )
    ax.text(
        mid,
        27.0,
        f"KV compacted to the path; \u201c{ex['bonus']}\u201d roots the next step",
        ha="center",
        fontsize=9.5,
        color=MUTED,
    )


def draw_hooks(ax) -> None:
    ax.text(1.0, 20.3, "StepObserver hooks (ddtree.observer)", fontsize=12.5, weight="bold", color=INK, va="center")
    ax.text(
        43.0,
        20.3,
        "the engine's only view of telemetry; the default, NOOP, does nothing and imports nothing",
        fontsize=10,
        color=MUTED,
        va="center",
    )
    y = 13.6
    ax.plot([1.0, 159.0], [y, y], color=MUTED, lw=1.2, zorder=0)
    d0, d1 = PANELS["draft"]
    a0, a1 = PANELS["accept"]
    hooks = [
        ("on_step_start(step,\n  rows, warmup)", INK, d0, d0 + 14.5),
        ('on_stage_start("draft")\non_stage_end("draft")', STAGE_COLORS["draft"], d0 + 16.0, d1),
        (
            'on_stage_start("tree_build")\non_tree(tree)\non_stage_end("tree_build")',
            STAGE_COLORS["tree_build"],
            *PANELS["tree_build"],
        ),
        ('on_stage_start("verify")\non_stage_end("verify")', STAGE_COLORS["verify"], *PANELS["verify"]),
        ('on_stage_start("accept")\non_stage_end("accept")', STAGE_COLORS["accept"], a0, a0 + 17.0),
        ("on_probe(step, probe)\non_accept(step, result,\n  accepted)\non_step_end(step, emitted)", INK, a0 + 18.5, a1),
    ]
    for text, color, a, b in hooks:
        lines = text.count("\n") + 1
        h = 2.6 + 2.0 * lines
        box(ax, a, y - h / 2, b - a, h, "", color=color, fill="white", lw=1.3)
        ax.text(
            (a + b) / 2, y, text, ha="center", va="center", fontsize=8.6, family="monospace", color=INK, linespacing=1.3
        )
    ax.text(
        80.0,
        3.6,
        "A step replayed from a CUDA graph with device clock stamps calls no stage hooks and no on_tree: the "
        "stamps, the tree and the tokens come back\nin the one readback of the step and reach the observer as "
        "on_probe. The first step of each shape runs eagerly, with every hook.",
        ha="center",
        va="center",
        fontsize=9.5,
        color=MUTED,
        linespacing=1.35,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "img" / "step.png"), help="PNG to write")
    args = parser.parse_args(argv)
    ex = example()
    fig = plt.figure(figsize=(16, 7), dpi=100)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 160)
    ax.set_ylim(0, 70)
    ax.axis("off")
    ax.text(80.0, 68.0, "One DDTree decode step", ha="center", va="center", fontsize=16, weight="bold")
    draw_draft(ax)
    draw_tree_build(ax, ex)
    draw_verify(ax, ex)
    draw_accept(ax, ex)
    for a, b in (("draft", "tree_build"), ("tree_build", "verify"), ("verify", "accept")):
        arrow(ax, PANELS[a][1] + 0.1, 44.0, PANELS[b][0] - 0.1, 44.0, lw=2.2)
    draw_hooks(ax)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, facecolor="white")
    plt.close(fig)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
