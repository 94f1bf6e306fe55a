"""Recurrent layers of hybrid targets (gated delta-net, Mamba2) over a chain or a draft tree.

Such a layer keeps two states per request: the last `K - 1` inputs of its short causal convolution
(`conv [batch, channels, K - 1]`) and its recurrent state (float32). A token's step reads its predecessor's
states; in a tree a node's predecessor is its parent, so

- its convolution window is its own input and its `K - 1` nearest ancestors' (past the root: the
  committed inputs), not its neighbours' in the flattened tree (`tree_windows`, `tree_conv`);
- its recurrent state is its parent's, advanced by its own step. `tree_states` takes one batched step per
  depth, over every node and request, from the parent states of the depth before.

What a verify's nodes feed their steps (`NodeInputs`) is kept until the accept: the committed states then
advance along the accepted path only (`commit_path`), so nothing of the other nodes survives the step. A
layer's step (`Step`) maps `(state, *inputs)` to the next state over any leading dimensions: the gated
delta rule (`ddtree.models.gdn`) or Mamba2's selective scan (`ddtree.models.mamba2`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

Step = Callable[..., torch.Tensor]  # (state [..., *state], *inputs [..., *input]) -> state [..., *state]
# (state [batch, *state], inputs' steps, path [batch, p], advance [batch]) -> None: a layer's own fused commit
PathCommit = Callable[[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class NodeInputs:
    """What each node of a verify fed its layer's states, for the commit along the accepted path."""

    conv_in: torch.Tensor  # [batch, n, channels] the convolution's inputs
    steps: tuple[torch.Tensor, ...]  # each [batch, n, ...]: the node's inputs to its layer's `Step`

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_in, *self.steps))


def tree_windows(parents: torch.Tensor, depths: torch.Tensor, kernel: int) -> torch.Tensor:
    """[batch, n, kernel] where each node's convolution window sits in `[history | nodes]` (`kernel - 1`
    committed inputs, then the n nodes' inputs): column `kernel - 1` is the node itself, column
    `kernel - 1 - j` its ancestor j levels up, and past the root the committed inputs, newest last.

    `parents` `[batch, n]` (-1: a root or padding), `depths` `[batch, n]` (0: a root or padding)."""
    history = kernel - 1
    node = torch.arange(parents.shape[1], device=parents.device).expand_as(parents)
    columns = [node + history]
    for j in range(1, kernel):
        past = history - (j - depths)  # where the node's j-th predecessor sits once it is past the root
        node = parents.gather(1, node.clamp(min=0)).where(node >= 0, node)  # -1 stays -1
        columns.append(torch.where(depths >= j, node + history, past.clamp(min=0)))
    return torch.stack(columns[::-1], dim=-1)


def tree_conv(
    conv_in: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    windows: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The convolution (then SiLU) of every node over its own window. `conv_in` `[batch, n, channels]`,
    `conv_state` `[batch, channels, kernel - 1]`, `weight` `[channels, kernel]`, `windows` from
    `tree_windows`; returns `[batch, n, channels]` in `conv_in`'s dtype."""
    batch, n, channels = conv_in.shape
    kernel = weight.shape[-1]
    table = torch.cat([conv_state.transpose(1, 2), conv_in.to(conv_state.dtype)], dim=1)  # [batch, K-1+n, C]
    gathered = table.gather(1, windows.reshape(batch, n * kernel, 1).expand(-1, -1, channels))
    window = gathered.view(batch * n, kernel, channels).transpose(1, 2).to(weight.dtype)  # [batch*n, C, K]
    out = F.silu(F.conv1d(window, weight[:, None, :], bias, groups=channels))  # [batch*n, C, 1]
    return out.view(batch, n, channels).to(conv_in.dtype)


def chain_conv(
    conv_in: torch.Tensor,
    lengths: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """A chain's convolution (a prefill: each request's first `lengths` `[batch]` tokens in order, then
    padding) from `conv_state`, which it then holds the last `kernel - 1` real inputs of. Returns
    `[batch, n, channels]`."""
    kernel, n = weight.shape[-1], conv_in.shape[1]
    table = torch.cat([conv_state, conv_in.transpose(1, 2).to(conv_state.dtype)], dim=2)  # [batch, C, K-1+n]
    out = F.silu(F.conv1d(table.to(weight.dtype), weight[:, None, :], bias, groups=weight.shape[0]))[:, :, -n:]
    last = lengths[:, None] + torch.arange(kernel - 1, device=lengths.device)[None, :]  # [batch, K-1]
    conv_state.copy_(table.gather(2, last[:, None, :].expand(-1, table.shape[1], -1)))
    return out.transpose(1, 2).to(conv_in.dtype)


def tree_states(
    step: Step,
    inputs: tuple[torch.Tensor, ...],
    parents: torch.Tensor,
    depths: torch.Tensor,
    state: torch.Tensor,
    max_depth: int,
) -> torch.Tensor:
    """Every node's state `[batch, n, *state]` after its own step: its parent's (the committed `state`
    `[batch, *state]` for a root) advanced by `step` on the node's `inputs` (each `[batch, n, ...]`). One
    batched step per depth 0..`max_depth` (a host-side bound on `depths`)."""
    batch, n = parents.shape
    rows = torch.arange(batch, device=parents.device)[:, None]
    tail = (None,) * (state.dim() - 1)
    nodes = state[:, None].expand(batch, n, *state.shape[1:]).clone()
    for depth in range(max_depth + 1):
        parent = nodes[rows, parents.clamp(min=0)]
        before = torch.where((parents >= 0)[(..., *tail)], parent, state[:, None])
        nodes = torch.where((depths == depth)[(..., *tail)], step(before, *inputs), nodes)
    return nodes


def commit_path(
    step: Step,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    inputs: NodeInputs,
    path: torch.Tensor,
    advance: torch.Tensor,
    fused: PathCommit | None = None,
) -> None:
    """Advance the committed states (in place) by each request's first `advance` `[batch]` nodes of `path`
    `[batch, p]` (node indices of the verify that fed `inputs`; p bounds `advance`): the recurrent state by
    `step`, one batched step per path position, or by `fused`, which does the same in one call."""
    batch, p = path.shape
    if fused is not None:
        fused(state, inputs.steps, path, advance)
    else:
        rows = torch.arange(batch, device=path.device)
        tail = (None,) * (state.dim() - 1)
        for j in range(p):
            node = path[:, j]
            stepped = step(state, *(x[rows, node] for x in inputs.steps))
            state.copy_(torch.where((j < advance)[(..., *tail)], stepped, state))
    history = conv_state.shape[2]
    kept = inputs.conv_in.gather(1, path[:, :, None].expand(-1, -1, inputs.conv_in.shape[2]))  # [batch, p, C]
    table = torch.cat([conv_state, kept.transpose(1, 2).to(conv_state.dtype)], dim=2)  # [batch, C, K-1+p]
    last = advance[:, None] + torch.arange(history, device=path.device)[None, :]  # [batch, K-1]
    conv_state.copy_(table.gather(2, last[:, None, :].expand(-1, table.shape[1], -1)))
