"""Pieces of a decoder layer that the target's loop and the drafter share (the HF module layout: `self_attn`
with `o_proj`, `post_attention_layernorm`, `mlp`)."""

from __future__ import annotations

from typing import Any

import torch


def merge_heads(attended: torch.Tensor) -> torch.Tensor:
    """`[batch, heads, n, head_dim]` -> `[batch, n, heads * head_dim]`."""
    batch, _, n, _ = attended.shape
    return attended.transpose(1, 2).reshape(batch, n, -1)


def residual_mlp(layer: Any, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """The rest of a layer after attention: output projection, residual, MLP, residual.

    `x` `[batch, n, hidden]` is the layer's input; `attended` `[batch, heads, n, head_dim]` its attention output.
    """
    x = x + layer.self_attn.o_proj(merge_heads(attended))
    result: torch.Tensor = x + layer.mlp(layer.post_attention_layernorm(x))
    return result
