"""The one protocol through which telemetry observes a decode loop; the engine imports nothing else of it.

The loop calls these hooks at fixed points of every step. With telemetry off it holds `NOOP`, whose
methods do nothing, allocate nothing and import nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final, Protocol

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from ddtree.accept import AcceptResult
    from ddtree.methods import TreeShape
    from ddtree.tree import DraftTree

# The stages of a step, in order: the names the hooks are called with. `telemetry.semconv` names its spans and
# metric labels after them.
STAGE_DRAFT: Final = "draft"
STAGE_TREE_BUILD: Final = "tree_build"
STAGE_DECIDE: Final = "decide"  # an adaptive step's choice of width, its one small readback included
STAGE_VERIFY: Final = "verify"
STAGE_ACCEPT: Final = "accept"
STAGES: Final = (STAGE_DRAFT, STAGE_TREE_BUILD, STAGE_VERIFY, STAGE_ACCEPT)
# Every stage a step may have, in order: an adaptive step (`--budget adaptive`) decides its width between them.
ALL_STAGES: Final = (STAGE_DRAFT, STAGE_TREE_BUILD, STAGE_DECIDE, STAGE_VERIFY, STAGE_ACCEPT)


@dataclass(frozen=True)
class GenerateInfo:
    """Requests that join a decode session: one entry per request in the lists. `Engine.generate` sends one
    for its whole batch; a server sends one as requests join (with their slots) while others decode."""

    method: str
    budget: int | None  # None: it follows the load (`on_step_start` names each step's shape)
    topk: int | None
    temperature: float
    max_new_tokens: int
    seed: int
    request_ids: list[str]
    prompt_tokens: list[list[int]]
    slots: list[int] | None = None  # the session slot of each request; None: slots 0..n-1 (a whole batch)
    trace_parents: list[str | None] | None = None  # per request: a W3C `traceparent` to parent its span

    @property
    def tree(self) -> tuple[str, int | None, int | None]:
        """(method, budget, topk): the tree these settings verify."""
        return self.method, self.budget, self.topk

    def with_tree(self, method: str, budget: int | None, topk: int | None) -> GenerateInfo:
        """These settings with a step's own tree (a session whose budget follows the load); itself where that
        is its tree already."""
        if (method, budget, topk) == self.tree:
            return self
        return replace(self, method=method, budget=budget, topk=topk)


@dataclass(frozen=True)
class RequestResult:
    request_id: str
    output_tokens: list[int]
    acceptance_lengths: list[int]
    finish_reason: str  # "stop" (end of sequence) or "length"


class StepProbe(Protocol):
    """What telemetry needs of a step's device state, read back by the loop with the step's tokens: host arrays
    (the observer's own), one row per row of the step. A loop may compute them on first access (the engine's
    probe takes its columns apart only when they are read), so an observer reads them off the decode thread."""

    @property
    def depths(self) -> npt.NDArray[np.int64]:
        """[rows, nodes]: each tree slot's depth, 0 = root or padding."""

    @property
    def tokens(self) -> npt.NDArray[np.int64]:
        """[rows, nodes]: draft tokens, -1 = root or padding."""

    @property
    def parents(self) -> npt.NDArray[np.int64]:
        """[rows, nodes]: parent node, -1 = root or padding."""

    @property
    def log_probs(self) -> npt.NDArray[np.float32]:
        """[rows, nodes]: the drafter's log-probabilities, -inf = padding."""

    @property
    def ranks(self) -> npt.NDArray[np.int64]:
        """[rows, depth]: the accepted path's ranks, the rank of the accepted node at depth 1..depth among its
        siblings (0 = its parent's most probable child, the drafter's top-1 at that depth: `ddtree.accept.
        accepted_ranks`); a row's columns past its accepted drafts are not its path. No columns where the tree
        is the root alone."""

    @property
    def stamps_ns(self) -> list[int] | None:
        """GPU clock at the step's start, then at the end of each stage in `STAGES` order; None: the
        step was not stamped (its stage hooks ran)."""


class StepObserver(Protocol):
    def on_session(self, stamped: bool) -> None:
        """A decode session takes this observer (before its first step). From then on each of its steps reads
        back a probe with its tokens (`on_probe`), so the tree's arrays need no copies in `on_tree`. With
        `stamped`, a step replayed from a CUDA graph times its stages on the device: it gets `on_step_start`
        and no stage hooks or `on_tree` (its probe has `stamps_ns`), while the first step of each step shape
        runs eagerly with the stage hooks, so which kind a step is shows only at its first stage hook.
        Loops that never call this (SGLang's worker) send every step's stage hooks and `on_tree` and no
        `on_probe`."""

    def on_generate_start(self, info: GenerateInfo) -> None:
        """A batch of requests begins (before prefill)."""

    def on_step_start(self, step: int, batch_size: int, warmup: bool = False, shape: TreeShape | None = None) -> None:
        """A decode step begins over `batch_size` rows; with `warmup`, it will compile or capture graphs
        (the first step of a shape), so its times are not what the shape's steps cost. `shape`: the tree it
        verifies, where the loop knows it (a session whose budget follows the load changes it between steps)."""

    def on_width(self, step: int, shape: TreeShape, gain: float) -> None:
        """An adaptive step verified `shape`'s tree (the `ar` shape: no drafts), predicted to make `gain` times
        the tokens per second of an `ar` step; once its decision is read (with its tokens, where the step did
        not wait for it), before `on_accept`."""

    def on_stage_start(self, stage: str) -> None:
        """A stage (`STAGES`) begins: right after the step began or the previous stage
        ended (the loop does no work in between, so the two may share one time stamp)."""

    def on_stage_end(self, stage: str) -> None:
        """The stage that began last ends."""

    def on_tree(self, tree: DraftTree) -> None:
        """The tree this step verifies, inside the tree_build stage (device tensors: read them without a sync)."""

    def on_probe(self, step: int, probe: StepProbe) -> None:
        """Step `step`'s probe reached the host with its tokens, before its `on_accept` (only in a session that
        called `on_session`). `probe.stamps_ns` are in the GPU's clock (`%globaltimer`), not the host's: only
        their differences mean something (stage i took `stamps_ns[i + 1] - stamps_ns[i]` ns)."""

    def on_accept(self, step: int, result: AcceptResult, accepted: list[int]) -> None:
        """Step `step`'s tokens reached the host; `accepted` is the per-request count of accepted drafts.

        Steps may be pipelined: step k+1 may start and run its stages (the stage hooks and `on_tree` always
        belong to the step started last) before step k's `on_accept` and `on_step_end`. `result` is then a
        view of the device buffers that step k+1 may already have overwritten: read `accepted` instead."""

    def on_step_end(self, step: int, emitted: list[int]) -> None:
        """The step's tokens reached the host; `emitted` counts the tokens each request kept this step."""

    def on_generate_end(self, results: list[RequestResult]) -> None:
        """All requests of the batch are done."""


class NoopObserver:
    """Observes nothing. Every hook is an empty method."""

    def on_session(self, stamped: bool) -> None:
        pass

    def on_generate_start(self, info: GenerateInfo) -> None:
        pass

    def on_step_start(self, step: int, batch_size: int, warmup: bool = False, shape: TreeShape | None = None) -> None:
        pass

    def on_width(self, step: int, shape: TreeShape, gain: float) -> None:
        pass

    def on_stage_start(self, stage: str) -> None:
        pass

    def on_stage_end(self, stage: str) -> None:
        pass

    def on_tree(self, tree: DraftTree) -> None:
        pass

    def on_probe(self, step: int, probe: StepProbe) -> None:
        pass

    def on_accept(self, step: int, result: AcceptResult, accepted: list[int]) -> None:
        pass

    def on_step_end(self, step: int, emitted: list[int]) -> None:
        pass

    def on_generate_end(self, results: list[RequestResult]) -> None:
        pass


NOOP = NoopObserver()
