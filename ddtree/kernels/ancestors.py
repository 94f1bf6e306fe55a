"""`ddtree.tree.ancestor_mask` in one Triton kernel.

The torch function finds reachability by repeated squaring of the parent relation: log2(nodes) rounds of a
batched matmul and its elementwise work, about 30 kernels for a 65-node tree, each a launch on a GPU. Here
one program per (request, block of nodes) walks each node up its parents, one gather per hop (a tree's depth
bounds the hops), and marks the nodes it passes in a zeroed matrix: a memset and one kernel. Parents come
before their children in a tree's node order, but the walk does not rely on it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from ddtree.tree import DraftTree

_MAX_ROWS = 128  # nodes per program


def _kernels() -> ModuleType:
    return importlib.import_module("ddtree.kernels._ancestors_triton")


def ancestor_mask_fused(tree: DraftTree) -> torch.Tensor:
    """[batch, nodes, nodes] bool, as `ddtree.tree.ancestor_mask(tree)`: entry (i, j) is true when node j is
    node i or one of its ancestors. Needs a CUDA device or TRITON_INTERPRET=1 (see
    `ddtree.kernels.tree_build.triton_available`)."""
    parents = tree.parents.contiguous()  # [batch, width]
    batch, width = parents.shape
    out = torch.zeros((batch, width, width), dtype=torch.uint8, device=parents.device)  # [batch, width, width]
    if batch * width == 0:
        return out.view(torch.bool)
    rows = min(_MAX_ROWS, max(2, 1 << (width - 1).bit_length()))
    _kernels().ancestors_kernel[(batch, -(-width // rows))](parents, out, width, ROWS=rows)
    return out.view(torch.bool)
