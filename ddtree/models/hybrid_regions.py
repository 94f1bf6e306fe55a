"""The pure parts of a hybrid target's layer, the regions that `HybridTarget.compile_layers` fuses.

Each mixer's layer is split where its state is read or written: what comes before (the input norm and the
projections) and what comes after (the output projection, the residual and the MLP) are pure functions of
tensors and weights, and `torch.compile` fuses them; the short convolution, the recurrent steps, the cache
writes and attention stay eager, so a compiled region holds no in-place update. As for the dense targets
(`Target.compile_layers`), one compiled function serves every layer of its kind, since layers differ only in
their weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.nn import functional as F

from ddtree.models.gdn import l2norm
from ddtree.models.layers import merge_heads


def gdn_in(layer: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GDN layer's input `x` `[batch, n, hidden]` normed and projected: the convolution's input
    `[batch, n, channels]` (queries, keys, values), the output gate `z` `[batch, n, v_heads, v_dim]`, beta and
    the decay (log space, float32) `[batch, n, v_heads]`. Qwen3-Next's fused projections are grouped per key
    head; Qwen3.5's are separate."""
    attn = layer.linear_attn
    h = layer.input_layernorm(x)
    batch, n, _ = h.shape
    if hasattr(attn, "in_proj_qkvz"):
        q, k, v, z, b, a = attn.fix_query_key_value_ordering(attn.in_proj_qkvz(h), attn.in_proj_ba(h))
        conv_in = torch.cat([t.reshape(batch, n, -1) for t in (q, k, v)], dim=-1)
    else:
        conv_in, b, a = attn.in_proj_qkv(h), attn.in_proj_b(h), attn.in_proj_a(h)
        z = attn.in_proj_z(h).reshape(batch, n, -1, attn.head_v_dim)
    decay = -attn.A_log.float().exp() * F.softplus(a.float() + attn.dt_bias)
    return conv_in, z, b.sigmoid(), decay


def gdn_qkv(
    mixed: torch.Tensor, k_heads: int, state: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The convolution's output `[batch, n, channels]` as queries and keys `[batch, n, v_heads, k_dim]` (each
    key head repeated for its value heads) and values `[batch, n, v_heads, v_dim]`, in the model's dtype."""
    batch, n, _ = mixed.shape
    v_heads, k_dim, v_dim = state
    q, k, v = torch.split(mixed, [k_heads * k_dim, k_heads * k_dim, v_heads * v_dim], dim=-1)
    q = q.reshape(batch, n, k_heads, k_dim).repeat_interleave(v_heads // k_heads, dim=2)
    k = k.reshape(batch, n, k_heads, k_dim).repeat_interleave(v_heads // k_heads, dim=2)
    return q, k, v.reshape(batch, n, v_heads, v_dim)


def gdn_tree_qkv(
    mixed: torch.Tensor, k_heads: int, state: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gdn_qkv` for the step over a tree, in float32: the query l2-normed and scaled by `k_dim ** -0.5`, the
    key l2-normed, as the reference recurrent kernel takes them."""
    q, k, v = gdn_qkv(mixed, k_heads, state)
    return l2norm(q.float()) / (state[1] ** 0.5), l2norm(k.float()), v.float()


def gdn_rest(layer: Any, x: torch.Tensor, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The rest of a GDN layer: the gated norm of the mixer's output `[batch, n, v_heads, v_dim]` by `z`, the
    output projection, the residual and the MLP."""
    attn = layer.linear_attn
    batch, n, _, v_dim = out.shape
    normed = attn.norm(out.to(x.dtype).reshape(-1, v_dim), z.reshape(-1, v_dim)).reshape(batch, n, -1)
    return _mlp(layer, x + attn.out_proj(normed))


def attention_in(
    layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dims: tuple[int, int, Callable[..., Any]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """An attention layer's queries, keys and values `[batch, heads, n, head_dim]`, normed and rotated, and
    the Qwen models' output gate `[batch, n, heads * head_dim]` (their query projection carries one per head;
    None where it does not). `dims`: the attention heads, the head size and the model's rotary function."""
    attn = layer.self_attn
    heads, dim, rotate = dims
    h = layer.input_layernorm(x)
    batch, n, _ = h.shape
    projected = attn.q_proj(h)
    gate: torch.Tensor | None = None
    if projected.shape[-1] == 2 * heads * dim:
        query, gate = torch.chunk(projected.view(batch, n, -1, 2 * dim), 2, dim=-1)
        gate = gate.reshape(batch, n, -1)
    else:
        query = projected.view(batch, n, -1, dim)
    k = attn.k_proj(h).view(batch, n, -1, dim)
    if hasattr(attn, "q_norm"):
        query, k = attn.q_norm(query), attn.k_norm(k)
    v = attn.v_proj(h).view(batch, n, -1, dim).transpose(1, 2)
    q, k = rotate(query.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v, gate


def attention_rest(layer: Any, x: torch.Tensor, attended: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """The rest of an attention layer: the gate, the output projection, the residual and the MLP."""
    merged = merge_heads(attended)
    if gate is not None:
        merged = merged * torch.sigmoid(gate)
    return _mlp(layer, x + layer.self_attn.o_proj(merged))


def mamba2_in(layer: Any, x: torch.Tensor, channels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Mamba2 layer's input normed and projected: the gate `[batch, n, inner]`, the convolution's input
    `[batch, n, channels]` and the time steps `[batch, n, heads]` (bias, softplus and limits applied)."""
    mixer = layer.mamba
    h = layer.input_layernorm(x)
    gate, conv_in, dt = mixer.in_proj(h).split([mixer.intermediate_size, channels, mixer.num_heads], dim=-1)
    low, high = mixer.time_step_limit
    return gate, conv_in, torch.clamp(F.softplus(dt + mixer.dt_bias.to(dt.dtype)), min=low, max=high)


def mamba2_rest(layer: Any, x: torch.Tensor, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The rest of a Mamba2 layer: the gated norm of the scan's output `[batch, n, heads, head_dim]`, the
    output projection, the residual and the feed-forward."""
    mixer = layer.mamba
    batch, n = out.shape[:2]
    mixed = mixer.out_proj(mixer.norm(out.reshape(batch, n, -1), gate).to(x.dtype))
    return _mlp(layer, x + mixed)


def _mlp(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """The MLP and its residual; Bamba names it `feed_forward`, and a mixture of experts may pair its output."""
    if hasattr(layer, "feed_forward"):
        out = layer.feed_forward(layer.pre_ff_layernorm(x))
    else:
        out = layer.mlp(layer.post_attention_layernorm(x))
    result: torch.Tensor = x + (out[0] if isinstance(out, tuple) else out)
    return result


@dataclass(frozen=True)
class HybridRegions:
    """The functions a hybrid target's layers run around their states: eager, or compiled."""

    gdn_in: Callable[..., Any] = gdn_in
    gdn_tree_qkv: Callable[..., Any] = gdn_tree_qkv
    gdn_rest: Callable[..., Any] = gdn_rest
    attention_in: Callable[..., Any] = attention_in
    attention_rest: Callable[..., Any] = attention_rest
    mamba2_in: Callable[..., Any] = mamba2_in
    mamba2_rest: Callable[..., Any] = mamba2_rest

    @classmethod
    def compiled(cls, dynamic: bool) -> HybridRegions:
        """Each region under `torch.compile`: per shape (`dynamic=False`, a step's few shapes) or once for
        symbolic sizes (the prefill's many)."""
        eager = cls()
        return cls(**{f.name: torch.compile(getattr(eager, f.name), dynamic=dynamic) for f in fields(cls)})
