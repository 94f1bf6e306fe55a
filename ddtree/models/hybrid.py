"""Hybrid targets, run by our layer loop like the dense targets: recurrent layers interleaved with full
attention. Gated delta-net (GDN) with gated attention (Qwen3-Next, Qwen3.5), and Mamba2 with attention
(Bamba).

The attention layers keep the tree attention and the KV cache (`HybridCache` holds them for the attention
layers only). Each recurrent layer keeps its convolution and recurrent states per request; a verify runs its
nodes from their parents' states (`ddtree.models.recurrent`) and leaves what they fed their steps in the
cache, and `HybridCache.compact` (the accept's commit) advances the states along the accepted path. A prefill
runs each prompt as a chain, through transformers' own chunked kernel.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ddtree.kv_cache import KVCache
from ddtree.models.gdn import commit_delta, delta_step, gdn_inputs, tree_delta_rule
from ddtree.models.hybrid_regions import HybridRegions, gdn_qkv
from ddtree.models.mamba2 import ssm_commit, ssm_step, tree_ssm
from ddtree.models.recurrent import (
    NodeInputs,
    PathCommit,
    Step,
    chain_conv,
    commit_path,
    tree_conv,
    tree_windows,
)
from ddtree.models.target import COMPILED_SHAPES, HYBRID_MODEL_TYPES, Target, TokenOrder, attend

LINEAR = "linear_attention"  # the recurrent layers' type in `config.layer_types` (GDN or Mamba2)
MAMBA2_MODEL_TYPES = ("bamba",)


class HybridCache(KVCache):
    """The attention layers' keys and values (`KVCache`, indexed by attention layer), and each recurrent
    layer's committed states: `conv [recurrent_layers, batch, channels, kernel - 1]` (the model's dtype) and
    `recurrent [recurrent_layers, batch, *state]` (`MixerShape.state_dtype`). `pending`: what the last
    verify's nodes fed each recurrent layer, its step and its fused commit (or None), until `compact` commits
    the accepted path."""

    def __init__(self, target: HybridTarget, batch: int, capacity: int) -> None:
        dtype, device = target.dtype, target.device
        super().__init__(len(target.attention_layers), batch, target.kv_heads, target.head_dim, capacity, dtype, device)
        m, layers = target.mixer, len(target.recurrent_layers)
        self.conv = torch.zeros((layers, batch, m.channels, m.kernel - 1), dtype=dtype, device=device)
        self.recurrent = torch.zeros((layers, batch, *m.state), dtype=m.state_dtype, device=device)
        self.pending: dict[int, tuple[Step, NodeInputs, PathCommit | None]] = {}
        self.pending_steps = 0  # nodes of a path the pending inputs can commit (the verify's depth bound + 1)

    def narrow(self, rows: int) -> HybridCache:
        view = super().narrow(rows)
        assert isinstance(view, HybridCache)
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
        for layer, (step, inputs, fused) in self.pending.items():
            commit_path(step, self.conv[layer], self.recurrent[layer], inputs, steps, advance, fused)
        self.pending.clear()
        super().compact(path, advance)


@dataclass(frozen=True)
class MixerShape:
    """A recurrent layer's sizes: the convolution's channels and kernel, the state's shape and dtype
    (float32, as transformers' kernels keep it; float64 for a float64 Mamba2), and the GDN's heads."""

    mamba2: bool
    channels: int
    kernel: int
    state: tuple[int, ...]  # GDN: (v_heads, k_dim, v_dim); Mamba2: (heads, head_dim, state_size)
    state_dtype: torch.dtype
    k_heads: int = 0  # the GDN's query and key heads (0 for Mamba2)

    @classmethod
    def of(cls, config: Any, dtype: torch.dtype) -> MixerShape:
        if config.model_type in MAMBA2_MODEL_TYPES:
            heads, head_dim, size = int(config.mamba_n_heads), int(config.mamba_d_head), int(config.mamba_d_state)
            inner, groups = int(config.mamba_expand * config.hidden_size), int(config.mamba_n_groups)
            state_dtype = torch.promote_types(dtype, torch.float32)
            return cls(True, inner + 2 * groups * size, int(config.mamba_d_conv), (heads, head_dim, size), state_dtype)
        k_heads, v_heads = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        k_dim, v_dim = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
        channels = 2 * k_heads * k_dim + v_heads * v_dim
        return cls(False, channels, int(config.linear_conv_kernel_dim), (v_heads, k_dim, v_dim), torch.float32, k_heads)

    def node_input_bytes(self, dtype_bytes: int) -> int:
        """What one node feeds a layer's step, its convolution input aside: the GDN's key, value, decay and
        beta (float32); Mamba2's x, B and dt (the model's dtype)."""
        heads, a, b = self.state
        if self.mamba2:
            return dtype_bytes * heads * (a + b + 1)
        return 4 * heads * (a + b + 2)


class HybridTarget(Target):
    """A target whose layers are recurrent (`linear_attention`: GDN or Mamba2) or full attention (gated in
    the Qwen models)."""

    def __init__(self, model: nn.Module, feature_layers: tuple[int, ...] = ()) -> None:
        super().__init__(model, feature_layers)
        types = list(self.config.layer_types)
        self.recurrent_layers = [i for i, t in enumerate(types) if t == LINEAR]
        self.attention_layers = [i for i, t in enumerate(types) if t != LINEAR]
        self._slot = {layer: j for j, layer in enumerate(self.recurrent_layers)} | {
            layer: j for j, layer in enumerate(self.attention_layers)
        }
        self.mixer = MixerShape.of(self.config, self.dtype)
        module = sys.modules[type(model).__module__]
        self._rotate = module.apply_rotary_pos_emb  # partial rotary, as the model applies it
        self._chunk_rule = getattr(module, "mamba2_chunk_scan" if self.mixer.mamba2 else "torch_chunk_gated_delta_rule")
        self._mrope = hasattr(self.rotary, "mrope_section")  # Qwen3.5 takes [3, batch, n] positions

    def new_cache(self, batch: int, capacity: int) -> HybridCache:
        return HybridCache(self, batch, capacity)

    def compile_layers(self) -> None:
        """Fuse each layer's work around its state with `torch.compile` (`ddtree.models.hybrid_regions`): the
        norm and projections before a mixer, its output projection, residual and MLP after; the convolution,
        the recurrent steps, the cache writes and attention stay eager."""
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, COMPILED_SHAPES)
        self._compiled = HybridRegions.compiled(dynamic=False)
        self._compiled_any = HybridRegions.compiled(dynamic=True)

    def _regions(self, fused: bool, any_shape: bool) -> Any:
        """The `HybridRegions` a forward's layers run: eager, or compiled per shape or for any."""
        if not fused or not hasattr(self, "_compiled"):
            return HybridRegions()
        return self._compiled_any if any_shape else self._compiled

    def _rotary_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return positions[None].expand(3, -1, -1) if self._mrope else positions

    def _prepare(self, order: TokenOrder | None) -> TokenOrder:
        """A tree's depths (zeros where not given) and convolution windows, the same for every layer."""
        if order is None or order.parents is None:
            return order or TokenOrder()
        depths = order.depths if order.depths is not None else torch.zeros_like(order.parents)
        return replace(order, depths=depths, windows=tree_windows(order.parents, depths, self.mixer.kernel))

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
        regions: Any,
        attention: str,
        order: TokenOrder | None = None,
    ) -> torch.Tensor:
        if not isinstance(cache, HybridCache):
            raise TypeError("a hybrid target runs on its own cache (HybridTarget.new_cache)")
        slot, order = self._slot[index], order or TokenOrder()  # `_prepare` made it
        if hasattr(layer, "linear_attn"):
            return self._gdn(layer, slot, x, cache, order, regions, fused=attention == "triton")
        if hasattr(layer, "mamba"):
            return self._mamba2(layer, slot, x, cache, order, regions, fused=attention == "triton")
        q, k, v, gate = regions.attention_in(
            layer, x, cos, sin, (self.config.num_attention_heads, self.head_dim, self._rotate)
        )
        cache.write(slot, slots, k, v)
        attended = attend(q, cache, slot, mask, key_span, layer.self_attn.scaling, attention)
        result: torch.Tensor = regions.attention_rest(layer, x, attended, gate)
        return result

    def _convolve(
        self, conv_in: torch.Tensor, conv: Any, slot: int, cache: HybridCache, order: TokenOrder
    ) -> torch.Tensor:
        """The short convolution of a chain or of every tree node over its own ancestors (then SiLU)."""
        weight, bias = conv.weight[:, 0, :], conv.bias  # [channels, kernel], [channels] or None
        if order.windows is None:  # a chain: each request's first `lengths` tokens
            lengths = order.lengths if order.lengths is not None else torch.full_like(cache.lengths, conv_in.shape[1])
            return chain_conv(conv_in, lengths, cache.conv[slot], weight, bias)
        return tree_conv(conv_in, cache.conv[slot], weight, order.windows, bias)

    def _gdn(
        self, layer: Any, slot: int, x: torch.Tensor, cache: HybridCache, order: TokenOrder, regions: Any, fused: bool
    ) -> torch.Tensor:
        """A GDN layer; over a tree, `fused` runs its steps and commit as Triton kernels (`attention` triton)."""
        conv_in, z, beta, decay = regions.gdn_in(layer, x)
        mixed = self._convolve(conv_in, layer.linear_attn.conv1d, slot, cache, order)
        state = cache.recurrent[slot]
        if order.parents is None or order.depths is None:
            q, k, v = gdn_qkv(mixed, self.mixer.k_heads, self.mixer.state)
            out = self._chain_gdn(q, k, v, decay, beta, order, state)
        else:
            query, key, value = regions.gdn_tree_qkv(mixed, self.mixer.k_heads, self.mixer.state)
            inputs = gdn_inputs(conv_in, key, value, decay, beta.float())
            out = tree_delta_rule(query, inputs, order.parents, order.depths, state, order.max_depth, fused)
            cache.pending[slot] = (delta_step, inputs, commit_delta if fused else None)
            cache.pending_steps = order.max_depth + 1
        result: torch.Tensor = regions.gdn_rest(layer, x, out, z)
        return result

    def _chain_gdn(
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
            real = _real(order.lengths, q.shape[1])
            decay, beta = decay * real, beta * real
        out, final = self._chunk_rule(
            q, k, v, g=decay, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        state.copy_(final)
        result: torch.Tensor = out
        return result

    def _mamba2(
        self,
        layer: Any,
        slot: int,
        hidden: torch.Tensor,
        cache: HybridCache,
        order: TokenOrder,
        regions: Any,
        fused: bool,
    ) -> torch.Tensor:
        """A Mamba2 layer (`hidden` its input `[batch, n, hidden]`); over a tree, `fused` runs its steps and
        commit as Triton kernels (`attention` triton)."""
        batch, n, _ = hidden.shape
        mixer, (heads, head_dim, size) = layer.mamba, self.mixer.state
        inner, groups = mixer.intermediate_size, mixer.n_groups
        gate, conv_in, dt = regions.mamba2_in(layer, hidden, self.mixer.channels)  # dt [batch, n, heads]
        mixed = self._convolve(conv_in, mixer.conv1d, slot, cache, order)
        x, b, c = torch.split(mixed, [inner, groups * size, groups * size], dim=-1)
        x = x.reshape(batch, n, heads, head_dim)
        b = b.reshape(batch, n, groups, size).repeat_interleave(heads // groups, dim=2)
        c = c.reshape(batch, n, groups, size).repeat_interleave(heads // groups, dim=2)
        a = -torch.exp(mixer.A_log.float())
        state = cache.recurrent[slot]
        if order.parents is None or order.depths is None:
            out = self._chain_mamba2(mixer, x, dt, a, b, c, order, state)
        else:
            inputs = NodeInputs(conv_in, (x, b, dt))
            tree = (order.parents, order.depths, order.max_depth)
            out = tree_ssm(inputs, c, a, mixer.D, tree, state, fused).to(hidden.dtype)
            cache.pending[slot] = (ssm_step(a), inputs, ssm_commit(a) if fused else None)
            cache.pending_steps = order.max_depth + 1
        result: torch.Tensor = regions.mamba2_rest(layer, hidden, out, gate)
        return result

    def _chain_mamba2(
        self,
        mixer: Any,
        x: torch.Tensor,
        dt: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        order: TokenOrder,
        state: torch.Tensor,
    ) -> torch.Tensor:
        """transformers' chunked scan over a chain, with the time steps already made (bias, softplus, limits);
        a padding step has dt = 0 (no decay, no write), so the state it leaves is the real tokens'."""
        if order.lengths is not None:
            dt = dt * _real(order.lengths, x.shape[1])
        out, final = self._chunk_rule(
            x, dt, a, b, c, mixer.chunk_size, D=mixer.D, initial_states=state, return_final_states=True
        )
        state.copy_(final)
        result: torch.Tensor = out
        return result


def _real(lengths: torch.Tensor, n: int) -> torch.Tensor:
    """[batch, n, 1] True for each request's first `lengths` tokens, False for its padding."""
    return (torch.arange(n, device=lengths.device)[None, :] < lengths[:, None])[..., None]


def make_target(model: nn.Module, feature_layers: tuple[int, ...] = ()) -> Target:
    """Our layer loop for `model`: `HybridTarget` for the hybrid model types, `Target` for the dense ones."""
    hybrid = getattr(model.config, "model_type", None) in HYBRID_MODEL_TYPES
    return (HybridTarget if hybrid else Target)(model, feature_layers)
