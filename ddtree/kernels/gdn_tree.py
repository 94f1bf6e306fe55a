"""The gated delta rule over a draft tree, and its commit along the accepted path, as Triton kernels.

`ddtree.models.gdn.tree_delta_rule` (through `ddtree.models.recurrent.tree_states`) takes one batched step
per depth over every node, so a tree of n nodes and depth D costs (D + 1) x n state steps, each a handful of
kernels over `[batch, n, heads, k_dim, v_dim]` float32 states; the commit then takes one step per path node,
again as separate kernels. On an H200 with a Qwen3.5-shaped target (hidden 2048, 18 GDN layers) that made a
dflash step 50 ms against `ar`'s 5.7 (`benchmarks/hybrid_step.py`): elementwise and gather kernels, about
5,000 a step.

Here one program per (request, head, block of value columns) walks the nodes in order (parents come before
their children in a tree's node order), holding one state tile in registers: a node whose parent is the node
before it continues from the registers; any other node reloads its parent's tile, which that parent stored in
a scratch buffer because `keep` marked it (a node with a child that is not the next node). Each node's output
(its state read with its query) is written as it goes. The commit is the same step along each request's
accepted path, in place. Both compute in float32 like the torch reference, so they agree with it to rounding.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

_BLOCK_V = 32  # value columns per program


def _kernels() -> ModuleType:
    return importlib.import_module("ddtree.kernels._gdn_tree_triton")


def branch_points(parents: torch.Tensor) -> torch.Tensor:
    """[batch, n] bool: the nodes with a child that is not the node after them (`parents` `[batch, n]`, -1 for
    roots and padding), whose states a later node must reload."""
    n = parents.shape[1]
    node = torch.arange(n, device=parents.device).expand_as(parents)
    jumps = (parents >= 0) & (parents != node - 1)  # [batch, n] nodes whose parent is not the node before
    keep = torch.zeros(parents.shape, dtype=torch.int32, device=parents.device)
    keep.scatter_add_(1, parents.clamp(min=0), jumps.to(torch.int32))
    return keep > 0


def _blocks(k_dim: int, v_dim: int) -> tuple[int, int, int]:
    block_k = max(16, 1 << (k_dim - 1).bit_length())
    block_v = min(_BLOCK_V, max(16, 1 << (v_dim - 1).bit_length()))
    return block_k, block_v, -(-v_dim // block_v)


def tree_delta_rule_fused(
    query: torch.Tensor,
    steps: tuple[torch.Tensor, ...],
    parents: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """As `ddtree.models.gdn.tree_delta_rule`: every node's output `[batch, n, heads, v_dim]` in the state's dtype.

    query, key `[batch, n, heads, k_dim]`, value `[batch, n, heads, v_dim]`, decay and beta `[batch, n, heads]`
    (`steps` = (key, value, decay, beta)), float32; parents `[batch, n]`; state `[batch, heads, k_dim, v_dim]`,
    the committed state (read only; float32, or float64 for a float64 model)."""
    key, value, decay, beta = (t.contiguous() for t in steps)
    batch, n, heads, k_dim = key.shape
    v_dim = value.shape[-1]
    out = torch.empty((batch, n, heads, v_dim), dtype=state.dtype, device=key.device)
    keep = branch_points(parents)
    scratch = torch.empty((batch, n, heads, k_dim, v_dim), dtype=state.dtype, device=key.device)
    block_k, block_v, v_blocks = _blocks(k_dim, v_dim)
    _kernels().tree_delta_kernel[(batch, heads, v_blocks)](
        query.contiguous(), key, value, decay, beta, parents.contiguous(), keep.to(torch.uint8), state.contiguous(),
        out, scratch, n, HEADS=heads, K_DIM=k_dim, V_DIM=v_dim, BLOCK_K=block_k, BLOCK_V=block_v,
    )  # fmt: skip
    return out


def commit_delta_fused(
    state: torch.Tensor, steps: tuple[torch.Tensor, ...], path: torch.Tensor, advance: torch.Tensor
) -> None:
    """As the recurrent half of `ddtree.models.recurrent.commit_path` with `delta_step`: `state` `[batch, heads,
    k_dim, v_dim]` (contiguous float32) advanced in place by each request's first `advance` `[batch]` nodes of
    `path` `[batch, p]`, whose inputs are `steps` (key, value, decay, beta as for `tree_delta_rule_fused`)."""
    if not state.is_contiguous():
        raise ValueError(f"the committed state must be contiguous, got strides {state.stride()}")
    key, value, decay, beta = (t.contiguous() for t in steps)
    batch, n, heads, k_dim = key.shape
    v_dim = value.shape[-1]
    block_k, block_v, v_blocks = _blocks(k_dim, v_dim)
    _kernels().commit_delta_kernel[(batch, heads, v_blocks)](
        key, value, decay, beta, path.contiguous(), advance.contiguous(), state, n, path.shape[1],
        HEADS=heads, K_DIM=k_dim, V_DIM=v_dim, BLOCK_K=block_k, BLOCK_V=block_v,
    )  # fmt: skip
