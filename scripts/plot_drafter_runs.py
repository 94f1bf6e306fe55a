"""Held-out tau against cumulative training time, one colour per drafter variant, from their runs.json.

    python scripts/plot_drafter_runs.py WORK/drafter/runs.json OTHER/drafter/runs.json --out runs.png

Each variant is one runs.json (`ddtree drafter train ... --eval-heldout` adds tau to each run's record);
its label is the name of the directory that holds it unless `--labels` names them. dflash is the solid
line, ddtree B=32 the dashed one; runs without an evaluation are left out. `--teacher-forced` leaves out the
older records' decoded measure (16 prompts), which is not comparable with the teacher-forced one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ddtree.train.runs import EVAL_LABELS, read_runs_file, tau_points

STYLES = dict(zip(EVAL_LABELS, ("-", "--"), strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="runs.json files, one per drafter variant")
    parser.add_argument("--out", required=True, help="PNG file to write")
    parser.add_argument("--labels", help="comma-separated variant names (default: the directories' names)")
    parser.add_argument("--teacher-forced", action="store_true", help="plot the teacher-forced measure only")
    args = parser.parse_args(argv)
    paths = [Path(p) for p in args.runs]
    labels = args.labels.split(",") if args.labels else [p.resolve().parent.name for p in paths]
    if len(labels) != len(paths):
        parser.error(f"--labels names {len(labels)} variants for {len(paths)} runs.json files")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    plotted = 0
    for index, (path, label) in enumerate(zip(paths, labels, strict=True)):
        try:
            runs = read_runs_file(path)
        except (OSError, ValueError) as exc:
            print(f"plot_drafter_runs: {exc}", file=sys.stderr)
            return 2
        for method, points in tau_points(runs, args.teacher_forced).items():
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, STYLES[method], marker="o", color=f"C{index}", label=f"{label}: {method}")
                plotted += 1
    if not plotted:
        print("plot_drafter_runs: no run has a held-out evaluation (train with --eval-heldout)", file=sys.stderr)
        return 2
    ax.set_xlabel("cumulative training time (minutes)")
    ax.set_ylabel("held-out tau (mean acceptance length)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
