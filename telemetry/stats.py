"""What the collector hands its sinks: one `StepStats` per decode step, and the sink protocol.

Free of torch, so that the exporter process (`telemetry.process`) can import it cheaply. A step carries the
tree's raw node depths; the counts derived from them are computed on first use, so in a deployment that work
happens in the exporter process, not in the decode loop.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ddtree.methods import curve_widths
from ddtree.observer import GenerateInfo, RequestResult
from telemetry.calibration import expected_accepted
from telemetry.chain import ChainCounts, off_chain_parent_nodes
from telemetry.tally import reached_per_depth


@dataclass(frozen=True)
class StepStats:
    step: int
    info: GenerateInfo
    active: list[bool]  # per request: still decoding during this step
    depths: npt.NDArray[np.int64] | None  # [active requests, 1+budget]: each tree slot's depth, 0 = root or padding
    accepted: list[int]  # per active request: accepted drafts
    emitted: list[int]  # per active request
    stage_ns: dict[str, tuple[int, int]]  # stage -> (start, end), wall-clock ns
    start_ns: int
    end_ns: int
    slot_ids: list[str | None] | None = None  # per slot: its request when the step started (None: free);
    # None: the slots are the requests of `info`, in order
    tokens: npt.NDArray[np.int64] | None = None  # [active requests, 1+budget]: draft tokens, -1 = root or padding
    parents: npt.NDArray[np.int64] | None = None  # [active requests, 1+budget]: parent node, -1 = root or padding
    log_probs: npt.NDArray[np.float32] | None = None  # [active requests, 1+budget]: prefix log-probabilities
    warmup: bool = False  # the step carried compilation or graph capture: its times are not steady-state work
    rows: int | None = None  # rows the step ran (slots 0..rows-1, free ones included); None: one per request
    ranks: npt.NDArray[np.int64] | None = None  # [active requests, depth]: the accepted path's ranks (columns
    # past a row's accepted drafts are not its path); None: the loop read none back (SGLang's worker)
    gain: float | None = None  # an adaptive step: its width's predicted tokens/s over an ar step's

    @cached_property
    def tree_nodes(self) -> list[int]:
        """Draft nodes per active request."""
        if self.depths is None:
            return [0] * len(self.accepted)
        return [int(n) for n in (self.depths > 0).sum(axis=1)]

    @cached_property
    def nodes_per_depth(self) -> list[int]:
        """Index d: draft nodes at depth d over the active requests (index 0 unused, always 0)."""
        if self.depths is None:
            return [0]
        counts = np.bincount(self.depths.ravel(), minlength=self.depths.shape[1])
        return [0, *(int(n) for n in counts[1:])]

    @cached_property
    def accepted_per_depth(self) -> list[int]:
        """Index d: active requests that accepted a draft at depth d (same length as `nodes_per_depth`: a step
        whose tree's depths never reached the collector counts its accepted drafts in `accepted` only)."""
        return [0, *reached_per_depth(self.accepted, len(self.nodes_per_depth) - 1)]

    @cached_property
    def predicted_widths(self) -> list[int]:
        """The widths `predicted` is given at (`ddtree.methods.curve_widths` of the tree's budget)."""
        if self.log_probs is None:
            return []
        return curve_widths(int(self.log_probs.shape[1]) - 1)

    @cached_property
    def predicted(self) -> list[list[float]] | None:
        """Per active request: the drafter's expected accepted drafts at each of `predicted_widths`, the
        last being the tree the step ran; None where the step's log-probabilities did not reach the collector."""
        if self.log_probs is None:
            return None
        return expected_accepted(self.log_probs, self.predicted_widths).tolist()  # type: ignore[no-any-return]

    @cached_property
    def path_ranks(self) -> list[list[int]] | None:
        """Per active request: the rank of each accepted draft at its depth, depth 1 first (0 = the drafter's
        top-1 there; `telemetry.chain`); None where the step's ranks never reached the collector."""
        if self.ranks is None:
            return None
        return [row[:n].tolist() for row, n in zip(self.ranks, self.accepted, strict=True)]

    @cached_property
    def chain(self) -> ChainCounts | None:
        """The step's accepted drafts against the tree's chain, per depth (`telemetry.chain`); None without
        ranks."""
        if self.path_ranks is None:
            return None
        parents, depths = self.parents, self.depths
        offered = [0] if parents is None or depths is None else off_chain_parent_nodes(parents, depths)
        return ChainCounts.of(self.path_ranks, offered)

    @property
    def request_ids(self) -> list[str]:
        """The requests that decoded in this step."""
        ids = self.slot_ids if self.slot_ids is not None else self.info.request_ids
        return [rid for rid, a in zip(ids, self.active, strict=True) if a and rid is not None]

    @property
    def row_ids(self) -> list[str | None]:
        """Each active request's id, in the order of the rows of `depths`, `tokens` and `parents`."""
        ids = self.slot_ids if self.slot_ids is not None else self.info.request_ids
        return [rid for rid, a in zip(ids, self.active, strict=True) if a]

    @property
    def active_requests(self) -> int:
        """Requests that decoded in this step."""
        return len(self.accepted)

    @property
    def row_count(self) -> int:
        """Rows the step ran: the slots up to the last one still decoding, rounded up to a power of two, free and
        finished ones included."""
        if self.rows is not None:
            return self.rows
        return len(self.slot_ids) if self.slot_ids is not None else len(self.info.request_ids)

    @property
    def tree_depth(self) -> int:
        return max((d for d, n in enumerate(self.nodes_per_depth) if n), default=0)


class StatsSink(Protocol):
    def start_requests(self, info: GenerateInfo) -> None: ...

    def step(self, stats: StepStats) -> None: ...

    def end_requests(self, info: GenerateInfo, results: list[RequestResult]) -> None: ...


def call_sinks(sinks: list[Any], method: str, *args: Any) -> None:
    """Call every sink; one that raises is dropped with a warning, and decoding goes on."""
    for sink in list(sinks):
        try:
            getattr(sink, method)(*args)
        except BrokenPipeError:
            raise  # the reader of our output went away (`| head`): the program ends, quietly
        except Exception as exc:  # a telemetry bug must never break decoding
            sinks.remove(sink)
            warnings.warn(f"ddtree telemetry: {type(sink).__name__} failed and is off: {exc!r}", stacklevel=3)
