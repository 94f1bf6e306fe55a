"""The gated delta-net (GDN) of Qwen3-Next and Qwen3.5: its step, for `ddtree.models.recurrent`.

A GDN layer's recurrent state is a matrix per value head (`[batch, v_heads, k_dim, v_dim]`, float32). A
node's step inputs are its key (l2-normed), value, decay (log-space) and beta. The arithmetic is that of
transformers' reference `torch_recurrent_gated_delta_rule`, so a one-node step is a decode step of the
model as transformers runs it. With `fused`, the tree's steps and the commit run as the Triton kernels of
`ddtree.kernels.gdn_tree` (the target's `triton` attention choice), which compute the same in float32.
"""

from __future__ import annotations

import torch

from ddtree.models.recurrent import NodeInputs, tree_states


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / |x|` over the last dimension, as the reference kernels compute it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_step(
    state: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """One token's step of the gated delta rule: `state` `[..., v_heads, k_dim, v_dim]` decayed by
    `exp(decay)`, then corrected toward `value` along `key` by `beta` (`[..., v_heads, k_dim]`,
    `[..., v_heads, v_dim]`, `[..., v_heads]`)."""
    state = state * decay.exp()[..., None, None]
    remembered = (state * key[..., None]).sum(dim=-2)  # [..., v_heads, v_dim]
    delta = (value - remembered) * beta[..., None]
    return state + key[..., None] * delta[..., None, :]


def gdn_inputs(
    conv_in: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor
) -> NodeInputs:
    """A verify's node inputs for `delta_step` (key `[batch, n, v_heads, k_dim]`, value, decay, beta)."""
    return NodeInputs(conv_in, (key, value, decay, beta))


def tree_delta_rule(
    query: torch.Tensor,
    inputs: NodeInputs,
    parents: torch.Tensor,
    depths: torch.Tensor,
    state: torch.Tensor,
    max_depth: int,
    fused: bool = False,
) -> torch.Tensor:
    """Every node's output `[batch, n, v_heads, v_dim]` (float32): its query `[batch, n, v_heads, k_dim]`
    (normed and scaled) read from its own state (`tree_states`; with `fused`, the Triton kernel)."""
    if fused:
        from ddtree.kernels.gdn_tree import tree_delta_rule_fused

        return tree_delta_rule_fused(query, inputs.steps, parents, state)
    nodes = tree_states(delta_step, inputs.steps, parents, depths, state, max_depth)
    return (nodes * query[..., None]).sum(dim=-2)


def commit_delta(
    state: torch.Tensor, steps: tuple[torch.Tensor, ...], path: torch.Tensor, advance: torch.Tensor
) -> None:
    """The fused commit of a GDN layer's state along the accepted path (`commit_path`'s `fused`)."""
    from ddtree.kernels.gdn_tree import commit_delta_fused

    commit_delta_fused(state, steps, path, advance)
