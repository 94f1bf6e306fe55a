"""An adaptive session's steps: each verifies the width its own tree predicts pays most (`ddtree.adaptive`).

A step runs in two parts, each eager or replayed as graphs by its own `StepRunner`:

    first   draft -> tree_build (the cap's tree) -> decide    keyed as a fixed step is
            the host reads the decision: one small readback, inside the `decide` stage where it is observed
    second  verify -> accept on the tree's first `width` nodes  keyed by the step's key and the width

The second part's state points at the first part's (`StepState.source`), and its graphs are captured on the
first part's captured state, so a replay of both reads what the first replay wrote.

The tree a step drafts is its row count's cap (`ddtree.adaptive.adaptive_caps`: 4, 8 and the maximum), each cap
with its own pair of runners (`CapSteps`) and its own measured step time at each of its widths and row counts
(`DecodeSession.measure_costs`, on this device and dtype, before the first request), which each steady step
of the session's own choice then moves toward what it took (`AdaptiveSteps.timed`). Every
`RECALIBRATE_EVERY` steps at a row count its cap is the one whose best width is predicted to pay most for the
row count's mean prediction curve (`ddtree.adaptive.best_cap`); every `EXPLORE_EVERY`-th step there drafts
the widest tree, so the curve's wide widths stay current.

Waiting for the decision costs a step time on a device that runs ahead of the host, and deciding costs the
decide stage and a second graph. At the end of each window of `RECALIBRATE_EVERY` decisions at a row count,
where running one width as a fixed step (the session's own runner of that width's tree: no decision, one
graph) would have made at least the predicted tokens per second that deciding made
(`ddtree.adaptive.commitment`: always where every decision chose that width), the row count commits to it.
Its steps then run as that fixed step (`AdaptiveSteps.fixed_costs` holds what each takes, measured on CUDA;
elsewhere it is taken to be the waited time), but for every `CALIBRATE_EVERY`-th, which runs the width
without waiting for its decision, read with the step's tokens (`Decision`), so the prediction still
calibrates and the next window is judged. The host waits only where the choice pays for the wait.

The prediction is calibrated as the session goes (`Calibration`): per width, the drafts the target accepted
over what the drafter predicted, summed over the request steps that ran that width and shrunk toward all
widths' ratio (`ddtree.adaptive.calibration_scale`); the scales go to the device every `RECALIBRATE_EVERY`
steps (one small copy, in stream order).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from ddtree import observer as stages
from ddtree.adaptive import adaptive_caps, adaptive_widths, best_cap, calibration_scale, commitment
from ddtree.engine import step
from ddtree.engine.graphs import StepRunner
from ddtree.engine.readback import Readback, to_device
from ddtree.engine.step import Choosing, StepModels, StepState
from ddtree.methods import TreeShape, get_method
from ddtree.observer import StepObserver

Key = tuple[Any, ...]
RECALIBRATE_EVERY = 16  # steps between two updates of the calibration scales and of a row count's cap
COST_WEIGHT = 0.1  # how far a step's measured time moves its (rows, cap, width) cost toward it
COST_RANGE = (0.5, 3.0)  # a step time outside these multiples of its cost is an outlier (a join, a capture)
EXPLORE_EVERY = 64  # every this many steps at a row count, one drafts the widest tree whatever the cap
UNREAD_BUFFERS = 4  # committed steps' decisions on their way to the host at once (at most the pipeline's depth)
CALIBRATE_EVERY = 8  # every this many steps of a committed row count, one decides (unread) for the calibration


@dataclass(frozen=True)
class Observed:
    """What a step's decision said, for the calibration once its tokens are read."""

    rows: int  # the step's row count
    cap: int  # the tree it drafted
    index: int  # the index of the width it ran
    raw: float  # the raw prediction at that width, summed over the active rows
    active: float  # rows decoding
    curve: list[float]  # the raw prediction at each of the cap's widths, summed over the active rows
    gains: list[float] = field(default_factory=list)  # each width's predicted gain over ar (the commitment's)


@dataclass
class Decision:
    """A step's decision (`ddtree.adaptive.decision`'s values), read at once or on its way to the host with the
    step's tokens (`ticket` of `reader`): a committed step ran `width` without waiting for it. A fixed step
    made none: `preset` is the gain its window predicted for the width."""

    rows: int
    cap: int
    widths: tuple[int, ...]  # the cap's
    width: int  # the width the step ran
    own: bool  # the session's own choice or commitment (not a forced width): the calibration takes it
    values: list[float] | None = None
    reader: Readback | None = None
    ticket: Any = None
    preset: float | None = None

    def read(self) -> tuple[Observed | None, float]:
        """What the calibration takes (None for a forced width or a fixed step) and the gain the step's width
        was predicted."""
        if self.preset is not None:
            return None, self.preset
        if self.values is None:
            assert self.reader is not None
            self.values = [float(v) for v in self.reader.wait(self.ticket)[0]]
        _, gain, _, active, *rest = self.values
        k = len(self.widths)
        curve, gains = rest[:k], rest[k:]
        if self.width not in self.widths:  # a forced width between the cap's
            return None, gain
        index = self.widths.index(self.width)
        seen = Observed(self.rows, self.cap, index, curve[index], active, curve, gains) if self.own else None
        return seen, gains[index]

    @property
    def waited(self) -> bool:
        """The host waited for it before the step's second part (not committed): the step's time is its cost's."""
        return self.reader is None and self.preset is None


class Calibration:
    """What the session has seen of its drafter: per width (of the widest cap's list), the drafts accepted and
    the raw prediction in the steps that ran it, and per row count the mean prediction curve."""

    def __init__(self, widths: tuple[int, ...], device: torch.device) -> None:
        self.widths = widths
        self.device = device
        self.scale = torch.ones(len(widths), dtype=torch.float32, device=device)  # [K], static: graphs read it
        self.accepted = [0.0] * len(widths)
        self.predicted = [0.0] * len(widths)
        self.curves: dict[int, list[float]] = defaultdict(lambda: [0.0] * len(widths))  # rows -> summed curve
        self.seen: dict[int, list[float]] = defaultdict(lambda: [0.0] * len(widths))  # rows -> active rows
        self.steps = 0

    def observe(self, seen: Observed, accepted: int) -> None:
        self.accepted[seen.index] += accepted
        self.predicted[seen.index] += seen.raw
        curve, rows = self.curves[seen.rows], self.seen[seen.rows]
        for k, value in enumerate(seen.curve):
            curve[k] += value
            rows[k] += seen.active
        self.steps += 1
        if self.steps % RECALIBRATE_EVERY == 0:
            self.scale.copy_(to_device(calibration_scale(self.accepted, self.predicted), self.device))

    def expected(self, rows: int) -> list[float | None]:
        """A row's calibrated accepted drafts at each width, on average at this row count (None: unseen)."""
        scale = calibration_scale(self.accepted, self.predicted)
        curve, seen = self.curves[rows], self.seen[rows]
        return [
            None if n == 0 else min(float(w), s * c / n)
            for w, s, c, n in zip(self.widths, scale, curve, seen, strict=True)
        ]


class AdaptiveSteps:
    """An adaptive session's steps: a `CapSteps` per cap, the calibration they share, each row count's cap, and
    the width it is committed to (run by `fixed`, the session's runner of that width's tree)."""

    def __init__(
        self,
        models: Callable[[TreeShape], StepModels],
        shape: TreeShape,
        observer: StepObserver,
        cuda_graphs: bool,
        show_tree: Callable[[str, StepState], None],
        fixed: Callable[[TreeShape], StepRunner[StepState]],
    ) -> None:
        self.widths = adaptive_widths(shape.budget)
        self.calibration = Calibration(self.widths, models(shape).target.device)
        self.caps = {
            c: CapSteps(models(tree), tree, self.calibration, observer, cuda_graphs, show_tree)
            for c in adaptive_caps(shape.budget)
            for tree in [width_shape(shape, c)]
        }
        self.shape = shape
        self.widest = shape.budget
        self.fixed = fixed
        self.cap_of: dict[int, int] = {}  # row count -> its cap (the widest until chosen)
        self.steps_at: dict[int, int] = defaultdict(int)
        self.measured = False
        self.forced: int | None = None  # a width every step runs instead of its choice (measuring, tests)
        self.forced_cap: int | None = None  # the cap it drafts (None: the widest)
        self.forced_fixed = False  # forced steps run as the width's fixed step (measuring `fixed_costs`)
        self.committed: dict[int, tuple[int, int, float]] = {}  # row count -> (cap, width, its window's gain)
        self.fixed_costs: dict[int, dict[int, float]] = defaultdict(dict)  # row count -> width -> fixed step's s
        self._window: dict[int, list[Observed]] = defaultdict(list)  # row count -> its window's decisions

    @property
    def runners(self) -> list[StepRunner[StepState]]:
        return [r for c in self.caps.values() for r in c.runners]

    def pairs(self) -> list[tuple[int, int]]:
        """Every (cap, width) a step can run."""
        return [(cap, w) for cap, steps in self.caps.items() for w in steps.widths]

    def set_cost(self, rows: int, cap: int, width: int, seconds: float) -> None:
        self.caps[cap].set_cost(rows, width, seconds)

    def cap(self, rows: int) -> int:
        """The cap a step of `rows` rows drafts."""
        if self.forced is not None or self.forced_cap is not None:
            return self.widest if self.forced_cap is None else self.forced_cap
        if self.steps_at[rows] % EXPLORE_EVERY == 0:
            return self.widest
        return self.cap_of.get(rows, self.widest)

    def fixed_width(self, rows: int) -> int | None:
        """The width the next step of `rows` rows runs as a fixed step, or None: it drafts its cap's tree."""
        if self.forced is not None:
            return self.forced if self.forced_fixed else None
        committed = self.committed.get(rows)
        if committed is None or committed[0] != self.cap(rows) or self.steps_at[rows] % CALIBRATE_EVERY == 0:
            return None
        return committed[1]

    def is_new(self, key: Key) -> bool:
        width = self.fixed_width(key[0])
        if width is not None:
            return self.fixed(width_shape(self.shape, width)).is_new(key)
        return self.caps[self.cap(key[0])].first.is_new(key)

    def run(self, key: Key, make: Callable[..., StepState]) -> tuple[StepState, TreeShape, Decision]:
        """One step: a committed row count's fixed step, or its cap's two parts (`CapSteps.run`), unread
        where the row count is committed."""
        rows, width, cap = key[0], self.fixed_width(key[0]), self.cap(key[0])
        committed = None if self.forced is not None else self.committed.get(rows)  # forced: not the row count's
        self.steps_at[rows] += 1
        if width is not None:
            tree = width_shape(self.shape, width)
            preset = 0.0 if committed is None else committed[2]
            decision = Decision(rows, cap, (), width, committed is not None, preset=preset)
            return self.fixed(tree).run(key, make), tree, decision
        unread = committed[1] if committed is not None and committed[0] == cap else None
        return self.caps[cap].run(key, make, self.forced, unread)

    def timed(self, decision: Decision, seen: Observed | None, seconds: float) -> None:
        """A steady step of the session's own took `seconds` (from the end of the step before to its end): the
        cost of what it ran (a waited decision's (rows, cap, width), or a fixed step's (rows, width)) moves
        toward it, so the costs follow what real steps take. An unread decision's step times neither."""
        if decision.preset is not None and decision.own:
            costs = self.fixed_costs[decision.rows]
            if decision.width in costs:
                costs[decision.width] = toward(costs[decision.width], seconds)
        elif seen is not None and decision.waited:
            self.caps[seen.cap].retime(seen.rows, seen.index, seconds)

    def unwaited(self, rows: int, cap: int) -> list[float]:
        """Each of `cap`'s widths' step time at `rows` rows run as a fixed step (unmeasured: the waited time;
        never more: a step without the decision does less)."""
        fixed = self.fixed_costs[rows]
        steps = self.caps[cap]
        return [min(fixed.get(w, t), t) for w, t in zip(steps.widths, steps.seconds[rows], strict=True)]

    def observe(self, seen: Observed, accepted: int) -> None:
        """A step's decision against the drafts its rows then accepted. Every `RECALIBRATE_EVERY` decisions at a
        row count, its cap is chosen again, and the row count commits to a width or not
        (`ddtree.adaptive.commitment`, over the window's decisions on the cap it keeps)."""
        self.calibration.observe(seen, accepted)
        rows, window = seen.rows, self._window[seen.rows]
        window.append(seen)
        if len(window) < RECALIBRATE_EVERY:
            return
        cap = self.cap_of.get(rows, self.widest)
        if len(self.caps) > 1:
            costs = {c: steps.seconds[rows] for c, steps in self.caps.items() if rows in steps.seconds}
            if len(costs) == len(self.caps):
                cap = self.cap_of[rows] = best_cap(self.calibration.expected(rows), costs)
        del self._window[rows]
        steps = self.caps[cap]
        mine = [(s.gains, s.active) for s in window if s.cap == cap and s.gains]
        measured = rows in steps.seconds
        index = commitment(mine, steps.seconds[rows], self.unwaited(rows, cap)) if measured and mine else None
        if index is None:
            self.committed.pop(rows, None)
        else:
            gain = sum(g[index] for g, _ in mine) / len(mine)
            self.committed[rows] = (cap, steps.widths[index], gain)


class CapSteps:
    """The two runners of the steps that draft `shape`'s tree, the widths they choose between, and the step
    time of each width at each row count (`costs`, static tensors updated in place; `seconds`, their values)."""

    def __init__(
        self,
        models: StepModels,
        shape: TreeShape,
        calibration: Calibration,
        observer: StepObserver,
        cuda_graphs: bool,
        show_tree: Callable[[str, StepState], None],
    ) -> None:
        self.shape = shape
        self.widths = adaptive_widths(shape.budget)
        self.device = models.target.device
        self.widths_t = torch.tensor(self.widths, dtype=torch.long, device=self.device)  # [K]
        self.trees = {w: width_shape(shape, w) for w in self.widths}  # what a step of each width verifies
        self.costs: dict[int, torch.Tensor] = {}  # row count -> [K] seconds per step
        self.seconds: dict[int, list[float]] = {}  # the same, on the host
        self.scale = calibration.scale[: len(self.widths)]  # [K] a view: the calibration's updates reach it
        self._show_tree = show_tree
        self._decided: list[float] | None = None
        self._unread = False  # the step running now does not wait for its decision
        self._readback = Readback(self.device, 1)  # a pinned buffer and an event: no implicit sync
        self._later = Readback(self.device, UNREAD_BUFFERS)  # committed steps' decisions, read with their tokens
        self.first = StepRunner(
            [
                (stages.STAGE_DRAFT, partial(step.draft, models)),
                (stages.STAGE_TREE_BUILD, partial(step.build, models)),
                (stages.STAGE_DECIDE, partial(step.decide, models)),
            ],
            observer,
            cuda_graphs,
            finish=_nothing,
            device=self.device,
            after_stage=self._after_first,
        )
        self.second = StepRunner(
            [
                (stages.STAGE_VERIFY, partial(step.narrow_verify, models)),
                (stages.STAGE_ACCEPT, partial(step.accept_step, models)),
            ],
            observer,
            cuda_graphs,
            finish=partial(step.finish, models),
            device=self.device,
        )

    @property
    def runners(self) -> tuple[StepRunner[StepState], StepRunner[StepState]]:
        return self.first, self.second

    def cost(self, rows: int) -> torch.Tensor:
        """The static [K] step times at `rows` rows (ones until measured: then the widest tree's tokens decide)."""
        cost = self.costs.get(rows)
        if cost is None:
            cost = self.costs[rows] = torch.ones(len(self.widths), dtype=torch.float32, device=self.device)
        return cost

    @torch.inference_mode()
    def set_cost(self, rows: int, width: int, seconds: float) -> None:
        """A step of `width` at `rows` rows, the host waiting for its decision, takes `seconds` (the session's own
        measure, or the caller's): what the device's choice weighs."""
        index = self.widths.index(width)
        self.cost(rows)[index] = seconds
        self.seconds.setdefault(rows, [1.0] * len(self.widths))[index] = seconds

    def retime(self, rows: int, index: int, seconds: float) -> None:
        """`AdaptiveSteps.timed`, for a waited step of width index `index`."""
        if rows not in self.seconds:
            return
        self.set_cost(rows, self.widths[index], toward(self.seconds[rows][index], seconds))

    def run(
        self, key: Key, make: Callable[..., StepState], forced: int | None, unread: int | None = None
    ) -> tuple[StepState, TreeShape, Decision]:
        """One step: the first part, the decision read back, the second part at the chosen width (or `forced`);
        or, committed to width `unread`, the second part at once and the decision read with the step's tokens.
        `make(**fields)` makes a fresh state of the step's shape with those fields. Returns the second part's
        state, the tree it verified and its `Decision`."""
        self._decided, self._unread = None, unread is not None
        n = key[0]
        first = self.first.run(key, lambda: make(choice_of=Choosing(self.widths_t, self.cost(n), self.scale)))
        decision = Decision(n, self.shape.budget, self.widths, 0, own=forced is None)
        if unread is not None:  # copied now, before a later step's first part overwrites it
            decision.width, decision.reader = unread, self._later
            decision.ticket = self._later.start(first.decision[None, :])
        else:
            decision.values = self._decided or self._read(first)  # read in the decide stage, or now
            decision.width = self.widths[int(decision.values[0])] if forced is None else forced
        width = decision.width
        captured = self.first.captured_state(key) or first
        second = self.second.run(
            (*key, width),
            lambda: make(source=first, width=width),
            lambda: make(source=captured, width=width),
        )
        return second, self.trees.get(width) or width_shape(self.shape, width), decision

    def _after_first(self, stage: str, state: StepState) -> None:
        self._show_tree(stage, state)
        if stage == stages.STAGE_DECIDE and not self._unread:  # the readback inside the stage that needs it
            self._decided = self._read(state)

    def _read(self, state: StepState) -> list[float]:
        row, *_ = self._readback.wait(self._readback.start(state.decision[None, :]))  # [1, 4 + 2K]
        return [float(v) for v in row]


def toward(cost: float, seconds: float) -> float:
    """`cost` moved `COST_WEIGHT` of the way toward a step's `seconds`, unless the step is an outlier (outside
    `COST_RANGE` of the cost: it carried a join's prefill or a capture)."""
    return cost + COST_WEIGHT * (seconds - cost) if COST_RANGE[0] * cost <= seconds <= COST_RANGE[1] * cost else cost


def width_shape(shape: TreeShape, width: int) -> TreeShape:
    """`shape`'s tree cut to its first `width` draft nodes, as its method resolves one (`ar`'s at width 0)."""
    method = get_method("ar" if width == 0 else shape.method)
    return method.shape(width, shape.topk if width else None, depth=width)  # depth: for chains only


def _nothing(state: StepState) -> None:
    pass
