"""The Triton kernel of `ddtree.kernels.ancestors`, which explains it and launches it.

Imported lazily, on the first call (the core install may lack triton).
"""

from __future__ import annotations

import triton.language as tl

from ddtree.kernels._jit import jit as _jit


@_jit
def ancestors_kernel(
    parents_ptr: tl.tensor,  # [batch, width] int64: parent node, -1 for the root and unused nodes
    out_ptr: tl.tensor,  # [batch, width, width] uint8, zeroed: out[b, i, j] = 1 for j = i or an ancestor of i
    width: tl.tensor,
    ROWS: tl.constexpr,
) -> None:
    """One program per (request, block of ROWS nodes): each node walks up its parents, one hop per round, and
    marks every node it passes, itself included; a round is one gather of ROWS parents."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # [ROWS] nodes
    row = out_ptr + (b * width + i) * width  # [ROWS] start of each node's row
    cur = tl.where(i < width, i, -1).to(tl.int64)  # [ROWS] the node reached so far, -1 once past the root
    while tl.max(cur, 0) >= 0:
        ok = cur >= 0
        tl.store(row + cur, tl.full((ROWS,), 1, tl.uint8), mask=ok)
        cur = tl.load(parents_ptr + b * width + tl.where(ok, cur, 0), mask=ok, other=-1)
