"""A budget schedule: which tree to verify at each load, as `ddtree tune` measures it and `serve --budget auto`
follows it.

The best budget depends on how many requests share a step: a wide tree pays at one row and costs more than it
gains at 64. A schedule holds one `Choice` per measured batch size (rows per step): `ddtree` with a budget and
top-k, or `ar` where no tree beat the target alone. Before each step the session takes the choice measured
nearest the rows the step runs (its power-of-two row bucket, which sets the step's cost; `nearest`: on a log
scale, 3 rows are nearer 4 than 1).

The file (`FORMAT`), written by `ddtree tune` or `ddtree advise --schedule`:

    {"format": "ddtree.schedule/1",
     "tuned_for": {"model": "...", "drafter": "...", "device": "...", "dtype": "..."},
     "choices": [{"batch_size": 1, "method": "ddtree", "budget": 64, "topk": null,
                  "predicted_tokens_per_second": 1480.2, "gain_over_ar": 2.1}, ...]}
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree.methods import TreeShape, check_tree, method_label

FORMAT = "ddtree.schedule/1"
SCHEDULED_METHODS = ("ar", "ddtree")


def nearest(sizes: Iterable[int], rows: float) -> int:
    """The size in `sizes` nearest to `rows` on a log scale; a tie goes to the smaller size."""
    target = math.log(max(rows, 1.0))
    return min(sizes, key=lambda b: (round(abs(math.log(b) - target), 9), b))


@dataclass(frozen=True)
class Choice:
    """What to verify when about `batch_size` requests share a step: `ar` (budget None) or `ddtree`."""

    batch_size: int
    method: str
    budget: int | None = None
    topk: int | None = None
    predicted_tokens_per_second: float | None = None
    gain_over_ar: float | None = None  # predicted tokens/s over ar's at this batch size

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"a schedule's batch sizes must be >= 1, got {self.batch_size}")
        if self.method not in SCHEDULED_METHODS:
            raise ValueError(f"a schedule chooses between {' and '.join(SCHEDULED_METHODS)}, got {self.method!r}")
        check_tree(self.method, self.budget, self.topk)

    @property
    def label(self) -> str:
        return method_label(self.method, self.budget, self.topk)


@dataclass(frozen=True)
class BudgetSchedule:
    choices: tuple[Choice, ...]  # sorted by batch size, one per size
    tuned_for: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        sizes = [c.batch_size for c in self.choices]
        if not sizes:
            raise ValueError("a schedule needs at least one choice")
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"a schedule's batch sizes must be distinct, got {sizes}")
        object.__setattr__(self, "choices", tuple(sorted(self.choices, key=lambda c: c.batch_size)))

    def choice_for(self, rows: float) -> Choice:
        size = nearest([c.batch_size for c in self.choices], rows)
        return next(c for c in self.choices if c.batch_size == size)

    def resolve(self, shape_of: Callable[[str, int, int | None], TreeShape]) -> ShapeSchedule:
        """The tree shapes on one drafter: `shape_of(method, budget, topk)` resolves each choice."""
        return ShapeSchedule(tuple((c.batch_size, shape_of(c.method, c.budget or 0, c.topk)) for c in self.choices))

    def mismatch(self, identity: Mapping[str, str]) -> str | None:
        """Why this schedule was not tuned for `identity` (model, drafter, device, dtype), or None if it was."""
        differ = [k for k in identity if k in self.tuned_for and self.tuned_for[k] != identity[k]]
        if not differ:
            return None
        return "; ".join(f"{k} {self.tuned_for[k]!r}, not {identity[k]!r}" for k in differ)

    def table(self) -> str:
        lines = [f"{'rows':>5}  {'choice':<16}{'tok/s':>10}{'vs ar':>8}"]
        for c in self.choices:
            speed = "-" if c.predicted_tokens_per_second is None else f"{c.predicted_tokens_per_second:.1f}"
            gain = "-" if c.gain_over_ar is None else f"{c.gain_over_ar:.2f}x"
            lines.append(f"{c.batch_size:>5}  {c.label:<16}{speed:>10}{gain:>8}")
        return "\n".join(lines)


@dataclass(frozen=True)
class ShapeSchedule:
    """A schedule resolved to tree shapes, which a decode session runs: (batch size, shape), by batch size. One
    entry is a fixed shape."""

    entries: tuple[tuple[int, TreeShape], ...]
    adaptive: bool = False  # each step chooses its width, up to the one shape's (`ddtree.adaptive`)

    @classmethod
    def fixed(cls, shape: TreeShape) -> ShapeSchedule:
        return cls(((1, shape),))

    @classmethod
    def up_to(cls, shape: TreeShape) -> ShapeSchedule:
        """Each step's width chosen by its own tree, up to `shape`'s."""
        return cls(((1, shape),), adaptive=True)

    def shape_for(self, rows: float) -> TreeShape:
        size = nearest([b for b, _ in self.entries], rows)
        return next(s for b, s in self.entries if b == size)

    @property
    def shapes(self) -> tuple[TreeShape, ...]:
        """The distinct shapes, in batch-size order."""
        return tuple(dict.fromkeys(s for _, s in self.entries))

    @property
    def widest(self) -> TreeShape:
        """The shape with the most nodes per request: the one the session's buffers are sized for."""
        return max(self.shapes, key=lambda s: (s.width, s.drafting))

    @property
    def switching(self) -> bool:
        """Whether the tree changes between steps."""
        return self.adaptive or len(self.shapes) > 1


def write_schedule(path: Path, schedule: BudgetSchedule) -> None:
    data = {
        "format": FORMAT,
        "tuned_for": dict(schedule.tuned_for),
        "choices": [
            {
                "batch_size": c.batch_size,
                "method": c.method,
                "budget": c.budget,
                "topk": c.topk,
                "predicted_tokens_per_second": _rounded(c.predicted_tokens_per_second, 1),
                "gain_over_ar": _rounded(c.gain_over_ar, 3),
            }
            for c in schedule.choices
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def read_schedule(path: Path) -> BudgetSchedule:
    """A file `write_schedule` wrote; ValueError, naming the file, for anything else."""
    source = repr(str(path))
    try:
        data: Any = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, not {FORMAT!r}")
        choices = tuple(
            Choice(
                int(c["batch_size"]),
                str(c["method"]),
                None if c.get("budget") is None else int(c["budget"]),
                None if c.get("topk") is None else int(c["topk"]),
                c.get("predicted_tokens_per_second"),
                c.get("gain_over_ar"),
            )
            for c in data["choices"]
        )
        return BudgetSchedule(choices, {str(k): str(v) for k, v in data.get("tuned_for", {}).items()})
    except OSError as exc:
        raise ValueError(f"cannot read the schedule {source}: {exc.strerror or exc}") from exc
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{source} is not a budget schedule: {exc}") from exc


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)
