"""Mamba2's selective scan (Bamba's mixer layers): its step, for `ddtree.models.recurrent`.

A Mamba2 layer's recurrent state is `[batch, heads, head_dim, state_size]`. A node's step inputs are its
`x` `[heads, head_dim]`, its `B` `[heads, state_size]` (the group's, repeated per head) and its time step
`dt` `[heads]` (after the bias, softplus and the model's limits). The arithmetic is that of transformers'
reference `mamba2_selective_state_update`, so a one-node step is a decode step of the model. With `fused`,
the tree's steps and the commit run as the Triton kernels of `ddtree.kernels.ssm_tree` (the target's
`triton` attention choice), which compute the same in the state's dtype.
"""

from __future__ import annotations

import torch

from ddtree.models.recurrent import NodeInputs, PathCommit, Step, tree_states


def ssm_step(a: torch.Tensor) -> Step:
    """The step of a layer whose (negative, float32) per-head decay rates are `a` `[heads]`."""

    def step(state: torch.Tensor, x: torch.Tensor, b: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        decay = torch.exp(dt.float() * a)[..., None, None]  # [..., heads, 1, 1]
        written = (dt[..., None, None] * b[..., None, :]) * x[..., None]  # [..., heads, head_dim, state_size]
        return state * decay + written

    return step


def ssm_read(states: torch.Tensor, c: torch.Tensor, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """A token's output `[..., heads, head_dim]` from its state `[..., heads, head_dim, state_size]`: read
    along `c` `[..., heads, state_size]`, plus the skip `d` `[heads]` times its `x` `[..., heads, head_dim]`."""
    return (states * c[..., None, :]).sum(dim=-1) + x * d[:, None]


def tree_ssm(
    inputs: NodeInputs,
    c: torch.Tensor,
    a: torch.Tensor,
    d: torch.Tensor,
    order: tuple[torch.Tensor, torch.Tensor, int],
    state: torch.Tensor,
    fused: bool = False,
) -> torch.Tensor:
    """Every tree node's output `[batch, n, heads, head_dim]` (the state's dtype): its state, from its
    parent's by `ssm_step(a)` on `inputs.steps` (x, B, dt), read along its `c` `[batch, n, heads,
    state_size]` plus the skip `d`. `order`: parents and depths `[batch, n]` and the depth bound; with
    `fused`, the Triton kernel."""
    parents, depths, max_depth = order
    x = inputs.steps[0]
    if fused:
        from ddtree.kernels.ssm_tree import tree_ssm_fused

        return tree_ssm_fused(inputs.steps, c, a, d, parents, state)
    nodes = tree_states(ssm_step(a), inputs.steps, parents, depths, state, max_depth)
    return ssm_read(nodes, c.to(nodes.dtype), x, d)


def ssm_commit(a: torch.Tensor) -> PathCommit:
    """The fused commit of a Mamba2 layer's state along the accepted path (`commit_path`'s `fused`)."""

    def commit(state: torch.Tensor, steps: tuple[torch.Tensor, ...], path: torch.Tensor, advance: torch.Tensor) -> None:
        from ddtree.kernels.ssm_tree import commit_ssm_fused

        commit_ssm_fused(state, steps, path, advance, a)

    return commit
