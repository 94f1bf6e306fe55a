"""Mamba2's selective scan (Bamba's mixer layers): its step, for `ddtree.models.recurrent`.

A Mamba2 layer's recurrent state is `[batch, heads, head_dim, state_size]`. A node's step inputs are its
`x` `[heads, head_dim]`, its `B` `[heads, state_size]` (the group's, repeated per head) and its time step
`dt` `[heads]` (after the bias, softplus and the model's limits). The arithmetic is that of transformers'
reference `mamba2_selective_state_update`, so a one-node step is a decode step of the model.
"""

from __future__ import annotations

import torch

from ddtree.models.recurrent import Step


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
