"""An adaptive session's steps: each verifies the width its own tree predicts pays most (`ddtree.adaptive`).

A step runs in two parts, each eager or replayed as graphs by its own `StepRunner`:

    first   draft -> tree_build (the widest tree) -> decide    keyed as a fixed step is
            the host reads the decision [3]: one small readback, inside the `decide` stage where it is observed
    second  verify -> accept on the tree's first `width` nodes  keyed by the step's key and the width

The second part's state points at the first part's (`StepState.source`), and its graphs are captured on the
first part's captured state, so a replay of both reads what the first replay wrote. The cost of each width at
each row count is measured by the session (`measure`), on this device and dtype, before its first request.

The prediction is calibrated as the session goes: per width, the drafts the target accepted over what the
drafter predicted, summed over the request steps that ran that width and shrunk toward all widths' ratio
(`ddtree.adaptive.calibration_scale`). The decision carries the raw prediction at the chosen width, the step's
tokens carry what was accepted, and every `RECALIBRATE_EVERY` steps the scales go to the device (one small
copy, in stream order).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ddtree import observer as stages
from ddtree.adaptive import adaptive_widths, calibration_scale
from ddtree.engine import step
from ddtree.engine.graphs import StepRunner
from ddtree.engine.readback import Readback, to_device
from ddtree.engine.step import Choosing, StepModels, StepState
from ddtree.methods import TreeShape, get_method
from ddtree.observer import StepObserver

Key = tuple[Any, ...]
RECALIBRATE_EVERY = 16  # steps between two updates of the device's calibration scales


Observed = tuple[int, float]  # a step's width index and its raw prediction there, summed over its active rows


class AdaptiveSteps:
    """The two runners of an adaptive session whose widest tree is `shape`, the widths it chooses between,
    and the step time of each width at each row count (`costs`, static tensors updated in place)."""

    def __init__(
        self,
        models: StepModels,
        shape: TreeShape,
        observer: StepObserver,
        cuda_graphs: bool,
        show_tree: Callable[[str, StepState], None],
    ) -> None:
        self.widths = adaptive_widths(shape.budget)
        self.device = models.target.device
        self.widths_t = torch.tensor(self.widths, dtype=torch.long, device=self.device)  # [K]
        method = get_method(shape.method)
        self.shapes = {
            w: TreeShape("ar", 0, None, "ar") if w == 0 else TreeShape(shape.method, w, shape.topk, method.label(w))
            for w in self.widths
        }
        self.costs: dict[int, torch.Tensor] = {}  # row count -> [K] seconds per step
        self.scale = torch.ones(len(self.widths), dtype=torch.float32, device=self.device)  # [K], static
        self.accepted = [0.0] * len(self.widths)  # per width: drafts accepted in the steps that ran it
        self.predicted = [0.0] * len(self.widths)  # per width: the raw prediction in those steps
        self._observed = 0
        self.measured = False
        self.forced: int | None = None  # a width every step runs instead of its choice (measuring, tests)
        self._show_tree = show_tree
        self._decided: tuple[int, float, float] | None = None
        self._readback = Readback(self.device, 1)  # a pinned buffer and an event: no implicit sync
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
        """A step of `width` at `rows` rows takes `seconds` (the session's own measure, or the caller's)."""
        self.cost(rows)[self.widths.index(width)] = seconds

    def is_new(self, key: Key) -> bool:
        return self.first.is_new(key)

    def run(self, key: Key, make: Callable[..., StepState]) -> tuple[StepState, TreeShape, float, Observed | None]:
        """One step: the first part, the decision read back, the second part at the chosen width (or `forced`).
        `make(**fields)` makes a fresh state of the step's shape with those fields. Returns the second part's
        state, the tree it verified, the gain the choice predicted over `ar`, and what `observe` takes once
        the step's tokens are read (None for a forced width)."""
        self._decided = None
        n = key[0]
        first = self.first.run(key, lambda: make(choice_of=Choosing(self.widths_t, self.cost(n), self.scale)))
        if self._decided is None:  # a replayed one-graph step: no stage hooks ran
            self._decided = self._read(first)
        index, gain, raw = self._decided
        observed = (index, raw) if self.forced is None else None
        width = self.widths[index] if self.forced is None else self.forced
        captured = self.first.captured_state(key) or first
        second = self.second.run(
            (*key, width),
            lambda: make(source=first, width=width),
            lambda: make(source=captured, width=width),
        )
        return second, self.shapes.get(width) or self._shape(width), gain, observed

    def observe(self, observed: Observed, accepted: int) -> None:
        """A step's raw prediction at its width (`run`'s) against the drafts its rows then accepted."""
        index, raw = observed
        self.accepted[index] += accepted
        self.predicted[index] += raw
        self._observed += 1
        if self._observed % RECALIBRATE_EVERY == 0:
            self.scale.copy_(to_device(calibration_scale(self.accepted, self.predicted), self.device))

    def _after_first(self, stage: str, state: StepState) -> None:
        self._show_tree(stage, state)
        if stage == stages.STAGE_DECIDE:  # the readback inside the stage that needs it
            self._decided = self._read(state)

    def _read(self, state: StepState) -> tuple[int, float, float]:
        (index, gain, raw), *_ = self._readback.wait(self._readback.start(state.decision[None, :]))  # [1, 3]
        return int(index), float(gain), float(raw)

    def _shape(self, width: int) -> TreeShape:
        """The tree of a forced width that is none of the chosen ones (tests)."""
        widest = self.shapes[self.widths[-1]]
        return TreeShape(widest.method, width, widest.topk, get_method(widest.method).label(width))


def _nothing(state: StepState) -> None:
    pass


def timed_steps(run: Callable[[], object], steps: int, device: torch.device) -> float:
    """Seconds per call of `run` over `steps` calls, the device drained before and after."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        run()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps
