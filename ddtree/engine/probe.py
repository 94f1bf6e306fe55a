"""The columns of a step's readback: the accepted tokens the session needs and, with an observer, a probe.

A step makes one device-to-host transfer, `out` ([rows, width] int64), which the session needs for its tokens
anyway. When the session has an observer, what telemetry needs of the device rides along in the same rows,
so telemetry makes no copies of its own:

    | accepted | path tokens | bonus | depths | tokens | parents | log_probs | stamps     |
    | 1        | path        | 1     | nodes  | nodes  | nodes   | nodes     | stages + 1 |

The first three blocks are the token part (`start` columns), the rest the probe (with an observer only).
A step whose requests ask for log-probabilities appends their columns (`ddtree.engine.logprobs`) after all of
these: the caller that asked for them cuts them off the end.

`log_probs` are the tree's float32 log-probabilities as their int32 bit patterns, widened to int64 (exact).
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

from ddtree.accept import AcceptResult
from ddtree.tree import DraftTree


@dataclass(frozen=True)
class ProbeLayout:
    """Where the probe's blocks sit in a readback row."""

    start: int  # columns of the token part before the probe: accepted, the path's tokens, the bonus
    nodes: int  # tree slots per row, root included
    stamps: int  # device clock stamps (0: the step has none)

    @property
    def width(self) -> int:
        """Columns of a whole row."""
        return self.start + 4 * self.nodes + self.stamps


def readout(
    result: AcceptResult, tree: DraftTree | None, stamps: torch.Tensor | None, tail: torch.Tensor | None = None
) -> tuple[torch.Tensor, ProbeLayout | None]:
    """The step's readback and its probe layout. `tree` None: no probe, the token part alone (and no layout);
    `stamps` ([stages + 1] int64 on the device) None: a probe without stamps; `tail` ([n, columns] int64)
    columns to append after the rest (the layout's `width` does not count them)."""
    tokens = torch.cat([result.accepted[:, None], result.path_tokens, result.bonus[:, None]], dim=1)  # [n, start]
    if tree is None:
        return (tokens if tail is None else torch.cat([tokens, tail], dim=1)), None
    layout = ProbeLayout(int(tokens.shape[1]), tree.width, 0 if stamps is None else int(stamps.numel()))
    bits = tree.log_probs.float().view(torch.int32).to(torch.int64)  # [n, nodes] exact bit patterns
    parts = [tokens, tree.depths.to(torch.int64), tree.tokens.to(torch.int64), tree.parents.to(torch.int64), bits]
    if stamps is not None:
        parts.append(stamps[None, :].expand(tokens.shape[0], -1))  # [n, stages + 1]
    if tail is not None:
        parts.append(tail)
    return torch.cat(parts, dim=1), layout  # [n, layout.width + tail columns]


class ReadbackProbe:
    """A `ddtree.observer.StepProbe` over the probe's columns of a readback: each field is cut out of the
    block when first read, so the decode thread only wraps the block and an observer pays for the rest where
    it reads them (telemetry does so off the decode thread)."""

    def __init__(self, block: npt.NDArray[np.int64], nodes: int, stamps: int) -> None:
        self.block = block  # [rows, 4 * nodes + stamps]
        self.nodes = nodes
        self.stamps = stamps

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
    def stamps_ns(self) -> list[int] | None:
        return self.block[0, 4 * self.nodes :].tolist() if self.stamps else None


def split_rows(block: npt.NDArray[np.int64], layout: ProbeLayout) -> tuple[list[list[int]], ReadbackProbe]:
    """A host readback ([rows, layout.width], an array of the caller's own: the probe keeps views of it) as the
    token rows (`[accepted, path tokens..., bonus]` each) and the probe."""
    if block.shape[1] != layout.width:
        raise ValueError(f"a readback of {block.shape[1]} columns for a layout of {layout.width}")
    return block[:, : layout.start].tolist(), ReadbackProbe(block[:, layout.start :], layout.nodes, layout.stamps)
