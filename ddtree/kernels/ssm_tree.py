"""Mamba2's selective scan over a draft tree, and its commit along the accepted path, as Triton kernels.

The same walk as `ddtree.kernels.gdn_tree`, for the step of `ddtree.models.mamba2`: the torch version
(`ddtree.models.recurrent.tree_states`) takes one batched step per depth over every node, (D + 1) x n state
steps of `[batch, n, heads, head_dim, state_size]` a verify, and the commit one step per path node, each a
handful of kernels; the GDN layers' profile on an H200 put nearly all of a hybrid's verify there
(`docs/hybrid.md`). Here one program per (request, head, block of head_dim rows) walks the nodes in order
with one state tile in registers, reloading a parent's tile from scratch only at branch points
(`gdn_tree.branch_points`), and writes each node's output as it goes; the commit is the same step along
each request's accepted path, in place. The state keeps its dtype (float32, or float64 for a float64 model).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from ddtree.kernels.gdn_tree import branch_points

_BLOCK_P = 32  # head_dim rows per program


def _kernels() -> ModuleType:
    return importlib.import_module("ddtree.kernels._ssm_tree_triton")


def _blocks(head_dim: int, state_size: int) -> tuple[int, int, int]:
    block_p = min(_BLOCK_P, max(16, 1 << (head_dim - 1).bit_length()))
    block_s = max(16, 1 << (state_size - 1).bit_length())
    return block_p, block_s, -(-head_dim // block_p)


def tree_ssm_fused(
    steps: tuple[torch.Tensor, ...],
    c: torch.Tensor,
    a: torch.Tensor,
    d: torch.Tensor,
    parents: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """As `ddtree.models.mamba2.tree_ssm`: every node's output `[batch, n, heads, head_dim]` in the state's dtype.

    `steps` = (x `[batch, n, heads, head_dim]`, B `[batch, n, heads, state_size]`, dt `[batch, n, heads]`), C as
    B, `a` the decay rates `[heads]` (float32), `d` the skip `[heads]`, parents `[batch, n]`, state `[batch,
    heads, head_dim, state_size]` the committed state (read only)."""
    x, b, dt = (t.contiguous() for t in steps)
    batch, n, heads, head_dim = x.shape
    size = b.shape[-1]
    out = torch.empty((batch, n, heads, head_dim), dtype=state.dtype, device=x.device)
    keep = branch_points(parents)
    scratch = torch.empty((batch, n, heads, head_dim, size), dtype=state.dtype, device=x.device)
    block_p, block_s, p_blocks = _blocks(head_dim, size)
    _kernels().tree_ssm_kernel[(batch, heads, p_blocks)](
        x, b, c.contiguous(), dt, a.float().contiguous(), d.contiguous(), parents.contiguous(), keep.to(torch.uint8),
        state.contiguous(), out, scratch, n, HEADS=heads, HEAD_DIM=head_dim, STATE=size, BLOCK_P=block_p,
        BLOCK_S=block_s,
    )  # fmt: skip
    return out


def commit_ssm_fused(
    state: torch.Tensor, steps: tuple[torch.Tensor, ...], path: torch.Tensor, advance: torch.Tensor, a: torch.Tensor
) -> None:
    """As the recurrent half of `ddtree.models.recurrent.commit_path` with `ssm_step(a)`: `state` `[batch,
    heads, head_dim, state_size]` (contiguous) advanced in place by each request's first `advance` `[batch]`
    nodes of `path` `[batch, p]`, whose inputs are `steps` (x, B, dt as for `tree_ssm_fused`)."""
    if not state.is_contiguous():
        raise ValueError(f"the committed state must be contiguous, got strides {state.stride()}")
    x, b, dt = (t.contiguous() for t in steps)
    batch, n, heads, head_dim = x.shape
    size = b.shape[-1]
    block_p, block_s, p_blocks = _blocks(head_dim, size)
    _kernels().commit_ssm_kernel[(batch, heads, p_blocks)](
        x, b, dt, a.float().contiguous(), path.contiguous(), advance.contiguous(), state, n, path.shape[1],
        HEADS=heads, HEAD_DIM=head_dim, STATE=size, BLOCK_P=block_p, BLOCK_S=block_s,
    )  # fmt: skip
