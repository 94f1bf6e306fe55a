"""Hybrid targets: gated delta-net (GDN) layers interleaved with gated full attention (Qwen3-Next, Qwen3.5),
run by our layer loop like the dense targets.

The attention layers keep the tree attention and the KV cache (`HybridCache` holds them for the attention
layers only). Each GDN layer keeps its convolution and recurrent states per request; a verify runs its nodes
from their parents' states (`ddtree.models.gdn`) and leaves what they fed their steps in the cache, and
`HybridCache.compact` (the accept's commit) advances the states along the accepted path. A prefill runs each
prompt as a chain, through transformers' own chunked kernel.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ddtree.kernels.tree_attention import tree_attention
from ddtree.kv_cache import KVCache
from ddtree.models.gdn import NodeInputs, chain_conv, commit_path, l2norm, tree_conv, tree_delta_rule, tree_windows
from ddtree.models.layers import merge_heads
from ddtree.models.target import HYBRID_MODEL_TYPES, Target, TokenOrder

LINEAR = "linear_attention"


class HybridCache(KVCache):
    """The attention layers' keys and values (`KVCache`, indexed by attention layer), and each GDN layer's
    committed states: `conv [gdn_layers, batch, channels, kernel - 1]` (the model's dtype) and
    `recurrent [gdn_layers, batch, v_heads, k_dim, v_dim]` (float32). `pending`: what the last verify's nodes
    fed each GDN layer, until `compact` commits the accepted path."""

    def __init__(self, target: HybridTarget, batch: int, capacity: int) -> None:
        dtype, device = target.dtype, target.device
        super().__init__(len(target.attention_layers), batch, target.kv_heads, target.head_dim, capacity, dtype, device)
        g = target.gdn
        layers = len(target.gdn_layers)
        self.conv = torch.zeros((layers, batch, g.channels, g.kernel - 1), dtype=dtype, device=device)
        self.recurrent = torch.zeros((layers, batch, g.v_heads, g.k_dim, g.v_dim), dtype=torch.float32, device=device)
        self.pending: dict[int, NodeInputs] = {}
        self.pending_steps = 0  # nodes of a path the pending inputs can commit (the verify's depth bound + 1)

    def narrow(self, rows: int) -> HybridCache:
        view = HybridCache.__new__(HybridCache)
        view.keys, view.values = self.keys[:, :rows], self.values[:, :rows]
        view.lengths = self.lengths[:rows]
        view.capacity = self.capacity
        view.conv, view.recurrent = self.conv[:, :rows], self.recurrent[:, :rows]
        view.pending, view.pending_steps = {}, 0
        return view

    def load_rows(self, rows: torch.Tensor, source: KVCache) -> None:
        super().load_rows(rows, source)
        if not isinstance(source, HybridCache):
            raise TypeError("a hybrid target's cache takes rows from another hybrid cache only")
        self.conv[:, rows] = source.conv
        self.recurrent[:, rows] = source.recurrent

    def compact(self, path: torch.Tensor, advance: torch.Tensor) -> None:
        steps = path[:, : max(self.pending_steps, 1)]
        for layer, inputs in self.pending.items():
            commit_path(self.conv[layer], self.recurrent[layer], inputs, steps, advance)
        self.pending.clear()
        super().compact(path, advance)


class GDNShape:
    """A GDN layer's sizes, from the config."""

    def __init__(self, config: Any) -> None:
        self.k_heads = int(config.linear_num_key_heads)
        self.v_heads = int(config.linear_num_value_heads)
        self.k_dim = int(config.linear_key_head_dim)
        self.v_dim = int(config.linear_value_head_dim)
        self.kernel = int(config.linear_conv_kernel_dim)
        self.channels = 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


class HybridTarget(Target):
    """A target whose layers are GDN (`linear_attention`) or gated full attention (`full_attention`)."""

    def __init__(self, model: nn.Module, feature_layers: tuple[int, ...] = ()) -> None:
        super().__init__(model, feature_layers)
        types = list(self.config.layer_types)
        self.gdn_layers = [i for i, t in enumerate(types) if t == LINEAR]
        self.attention_layers = [i for i, t in enumerate(types) if t != LINEAR]
        self._slot = {layer: j for j, layer in enumerate(self.gdn_layers)} | {
            layer: j for j, layer in enumerate(self.attention_layers)
        }
        self.gdn = GDNShape(self.config)
        module = sys.modules[type(model).__module__]
        self._rotate = module.apply_rotary_pos_emb  # partial rotary, as the model applies it
        self._chunk_rule = module.torch_chunk_gated_delta_rule
        self._mrope = hasattr(self.rotary, "mrope_section")  # Qwen3.5 takes [3, batch, n] positions

    def new_cache(self, batch: int, capacity: int) -> HybridCache:
        return HybridCache(self, batch, capacity)

    def compile_layers(self) -> None:
        """The hybrid layers run eagerly for now (compiled regions cover the dense targets' layers)."""

    def _rotary_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return positions[None].expand(3, -1, -1) if self._mrope else positions

    def _layer(
        self,
        layer: Any,
        index: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor,
        cache: KVCache,
        key_span: int,
        regions: tuple[Any, Any],
        attention: str,
        order: TokenOrder | None = None,
    ) -> torch.Tensor:
        if not isinstance(cache, HybridCache):
            raise TypeError("a hybrid target runs on its own cache (HybridTarget.new_cache)")
        h = layer.input_layernorm(x)
        if index in self.gdn_layers:
            mixed = self._gdn(layer.linear_attn, self._slot[index], h, cache, order or TokenOrder())
        else:
            rope = (cos, sin)
            mixed = self._attention(
                layer.self_attn, self._slot[index], h, rope, slots, mask, cache, key_span, attention
            )
        x = x + mixed
        out = layer.mlp(layer.post_attention_layernorm(x))
        result: torch.Tensor = x + (out[0] if isinstance(out, tuple) else out)  # a mixture of experts may pair it
        return result

    def _attention(
        self,
        attn: Any,
        slot: int,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
        mask: torch.Tensor,
        cache: HybridCache,
        key_span: int,
        attention: str,
    ) -> torch.Tensor:
        """Gated attention: the query projection carries a gate per head, applied to the attention's output."""
        batch, n, _ = h.shape
        dim = self.head_dim
        query, gate = torch.chunk(attn.q_proj(h).view(batch, n, -1, 2 * dim), 2, dim=-1)
        q = attn.q_norm(query).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(h).view(batch, n, -1, dim)).transpose(1, 2)
        v = attn.v_proj(h).view(batch, n, -1, dim).transpose(1, 2)
        q, k = self._rotate(q, k, *rope)
        cache.write(slot, slots, k, v)
        if attention == "triton":  # `mask` is `visible`, which the kernel reads as it is
            out = tree_attention(q, cache.keys[slot], cache.values[slot], cache.lengths, mask, attn.scaling)
        else:
            keys, values = cache.read(slot, key_span)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
        gated = merge_heads(out) * torch.sigmoid(gate.reshape(batch, n, -1))
        result: torch.Tensor = attn.o_proj(gated)
        return result

    def _gdn(self, attn: Any, slot: int, h: torch.Tensor, cache: HybridCache, order: TokenOrder) -> torch.Tensor:
        batch, n, _ = h.shape
        g = self.gdn
        conv_in, z, b, a = _projections(attn, h)
        weight = attn.conv1d.weight[:, 0, :]  # [channels, kernel]
        conv_state, state = cache.conv[slot], cache.recurrent[slot]
        if order.parents is None:  # a chain: each request's first `lengths` tokens
            lengths = order.lengths if order.lengths is not None else torch.full_like(cache.lengths[:batch], n)
            mixed = chain_conv(conv_in, lengths, conv_state, weight)
        else:
            windows = tree_windows(order.parents, order.depths if order.depths is not None else order.parents, g.kernel)
            mixed = tree_conv(conv_in, conv_state, weight, windows)
        q, k, v = torch.split(mixed, [g.k_heads * g.k_dim, g.k_heads * g.k_dim, g.v_heads * g.v_dim], dim=-1)
        repeat = g.v_heads // g.k_heads
        q = q.reshape(batch, n, g.k_heads, g.k_dim).repeat_interleave(repeat, dim=2)
        k = k.reshape(batch, n, g.k_heads, g.k_dim).repeat_interleave(repeat, dim=2)
        v = v.reshape(batch, n, g.v_heads, g.v_dim)
        beta = b.sigmoid()
        decay = -attn.A_log.float().exp() * F.softplus(a.float() + attn.dt_bias)
        if order.parents is None:
            out = self._chain_rule(q, k, v, decay, beta, order, state)
        else:
            inputs = NodeInputs(conv_in, l2norm(k.float()), v.float(), decay, beta.float())
            query = l2norm(q.float()) / (g.k_dim**0.5)
            depths = order.depths if order.depths is not None else torch.zeros_like(order.parents)
            out = tree_delta_rule(query, inputs, order.parents, depths, state, order.max_depth).to(h.dtype)
            cache.pending[slot] = inputs
            cache.pending_steps = order.max_depth + 1
        normed = attn.norm(out.reshape(-1, g.v_dim), z.reshape(-1, g.v_dim)).reshape(batch, n, -1)
        result: torch.Tensor = attn.out_proj(normed)
        return result

    def _chain_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        decay: torch.Tensor,
        beta: torch.Tensor,
        order: TokenOrder,
        state: torch.Tensor,
    ) -> torch.Tensor:
        """transformers' chunked kernel over a chain; padding steps are identities (no decay, no write), so the
        state it leaves is the one after each request's real tokens."""
        if order.lengths is not None:
            real = (torch.arange(q.shape[1], device=q.device)[None, :] < order.lengths[:, None])[..., None]
            decay, beta = decay * real, beta * real
        out, final = self._chunk_rule(
            q, k, v, g=decay, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        state.copy_(final)
        result: torch.Tensor = out
        return result


def _projections(attn: Any, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The convolution's inputs `[batch, n, channels]` (queries, keys, values), the output gate `z`
    `[batch, n, v_heads, v_dim]`, and `b`, `a` `[batch, n, v_heads]`: Qwen3-Next's fused projections
    (grouped per key head), or Qwen3.5's separate ones."""
    batch, n, _ = h.shape
    if hasattr(attn, "in_proj_qkvz"):
        q, k, v, z, b, a = attn.fix_query_key_value_ordering(attn.in_proj_qkvz(h), attn.in_proj_ba(h))
        conv_in = torch.cat([x.reshape(batch, n, -1) for x in (q, k, v)], dim=-1)
        return conv_in, z, b, a
    z = attn.in_proj_z(h).reshape(batch, n, -1, attn.head_v_dim)
    return attn.in_proj_qkv(h), z, attn.in_proj_b(h), attn.in_proj_a(h)


def make_target(model: nn.Module, feature_layers: tuple[int, ...] = ()) -> Target:
    """Our layer loop for `model`: `HybridTarget` for the hybrid model types, `Target` for the dense ones."""
    hybrid = getattr(model.config, "model_type", None) in HYBRID_MODEL_TYPES
    return (HybridTarget if hybrid else Target)(model, feature_layers)
