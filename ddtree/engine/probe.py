"""The columns of a step's readback: the accepted tokens the session needs and, with an observer, a probe.

A step makes one device-to-host transfer, `out` ([rows, width] int64), which the session needs for its tokens
anyway. When the session has an observer, what telemetry needs of the device rides along in the same rows,
so telemetry makes no copies of its own:

    | accepted | path tokens | bonus | depths | tokens | parents | log_probs | ranks | stamps     |
    | 1        | path        | 1     | nodes  | nodes  | nodes   | nodes     | depth | stages + 1 |

The first three blocks are the token part (`start` columns), the rest the probe (with an observer only).
A step whose requests ask for log-probabilities appends their columns (`ddtree.engine.logprobs`) after all of
these: the caller that asked for them cuts them off the end.

`log_probs` are the tree's float32 log-probabilities as their int32 bit patterns, widened to int64 (exact).
`ranks` are the accepted path's ranks (`ddtree.accept.accepted_ranks`: the rank of the accepted node at each
depth 1..depth among its siblings, 0 = the drafter's top-1), computed on the device from the tree and the path,
so telemetry learns how far the path left the drafter's chain without a copy of its own; `depth` is the
deepest a tree of the step can reach (0 for a root-only tree: `ar` steps have none).
`stamps` (the GPU clock at the step's start and after each stage, `ddtree.kernels.clock`) are the same in
every row, and present only in a step replayed from a graph that stamps. `readout` builds the row on the
device; `split_rows` and `ReadbackProbe` take it apart on the host: the layout lives here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt
import torch

from ddtree.accept import AcceptResult, accepted_ranks
from ddtree.tree import DraftTree


@dataclass(frozen=True)
class ProbeLayout:
    """Where the probe's blocks sit in a readback row."""

    start: int  # columns of the token part before the probe: accepted, the path's tokens, the bonus
    nodes: int  # tree slots per row, root included
    stamps: int  # device clock stamps (0: the step has none)
    ranks: int = 0  # the accepted path's rank columns, depth 1..ranks (0: none)

    @property
    def width(self) -> int:
        """Columns of a whole row."""
        return self.start + 4 * self.nodes + self.ranks + self.stamps


def readout(
    result: AcceptResult,
    tree: DraftTree | None,
    stamps: torch.Tensor | None,
    tail: torch.Tensor | None = None,
    depth: int | None = None,
) -> tuple[torch.Tensor, ProbeLayout | None]:
    """The step's readback and its probe layout. `tree` None: no probe, the token part alone (and no layout);
    `stamps` ([stages + 1] int64 on the device) None: a probe without stamps; `tail` ([n, columns] int64)
    columns to append after the rest (the layout's `width` does not count them); `depth`: the accepted path's
    rank columns, the deepest the tree can reach (None: every draft slot, `nodes - 1`)."""
    tokens = torch.cat([result.accepted[:, None], result.path_tokens, result.bonus[:, None]], dim=1)  # [n, start]
    if tree is None:
        return (tokens if tail is None else torch.cat([tokens, tail], dim=1)), None
    ranks = accepted_ranks(tree, result.path, tree.width - 1 if depth is None else depth)  # [n, depth]
    stamped = 0 if stamps is None else int(stamps.numel())
    layout = ProbeLayout(int(tokens.shape[1]), tree.width, stamped, int(ranks.shape[1]))
    bits = tree.log_probs.float().view(torch.int32).to(torch.int64)  # [n, nodes] exact bit patterns
    parts = [tokens, tree.depths.to(torch.int64), tree.tokens.to(torch.int64), tree.parents.to(torch.int64), bits]
    parts.append(ranks.to(torch.int64))  # after the tree: [n, depth]
    if stamps is not None:
        parts.append(stamps[None, :].expand(tokens.shape[0], -1))  # [n, stages + 1]
    if tail is not None:
        parts.append(tail)
    return torch.cat(parts, dim=1), layout  # [n, layout.width + tail columns]


class ReadbackProbe:
    """A `ddtree.observer.StepProbe` over the probe's columns of a readback: each field is cut out of the
    block when first read, so the decode thread only wraps the block and an observer pays for the rest where
    it reads them (telemetry does so off the decode thread)."""

    def __init__(self, block: npt.NDArray[np.int64], nodes: int, stamps: int, ranks: int = 0) -> None:
        self.block = block  # [rows, 4 * nodes + ranks + stamps]
        self.nodes = nodes
        self.stamps = stamps
        self.depth = ranks  # rank columns

    def _column(self, index: int) -> npt.NDArray[np.int64]:
        return self.block[:, index * self.nodes : (index + 1) * self.nodes]  # [rows, nodes]

    @cached_property
    def depths(self) -> npt.NDArray[np.int64]:
        return self._column(0)

    @cached_property
    def tokens(self) -> npt.NDArray[np.int64]:
        return self._column(1)

    @cached_property
    def parents(self) -> npt.NDArray[np.int64]:
        return self._column(2)

    @cached_property
    def log_probs(self) -> npt.NDArray[np.float32]:
        return self._column(3).astype(np.int32).view(np.float32)

    @cached_property
    def ranks(self) -> npt.NDArray[np.int64]:
        return self.block[:, 4 * self.nodes : 4 * self.nodes + self.depth]  # [rows, depth]

    @cached_property
    def stamps_ns(self) -> list[int] | None:
        return self.block[0, 4 * self.nodes + self.depth :].tolist() if self.stamps else None


def split_rows(block: npt.NDArray[np.int64], layout: ProbeLayout) -> tuple[list[list[int]], ReadbackProbe]:
    """A host readback ([rows, layout.width], an array of the caller's own: the probe keeps views of it) as the
    token rows (`[accepted, path tokens..., bonus]` each) and the probe."""
    if block.shape[1] != layout.width:
        raise ValueError(f"a readback of {block.shape[1]} columns for a layout of {layout.width}")
    return block[:, : layout.start].tolist(), ReadbackProbe(
        block[:, layout.start :], layout.nodes, layout.stamps, layout.ranks
    )
