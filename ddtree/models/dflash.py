"""DFlash block drafter in the z-lab checkpoint layout.

A checkpoint directory holds `config.json` (Qwen3 fields plus `block_size`, `num_target_layers` and
`dflash_config = {target_layer_ids, mask_token_id}`) and `model.safetensors` with the keys
`layers.N.self_attn.{q,k,v,o}_proj`, `layers.N.self_attn.{q,k}_norm`, `layers.N.mlp.*`,
`layers.N.{input,post_attention}_layernorm`, `norm`, `fc` and `hidden_norm`. The drafter has no embedding
and no head of its own: it shares the target's.

One forward sees a block `[bonus, mask, ..., mask]` and, as extra keys and values in every layer, the
target's features for the whole context (cached, appended as tokens are committed). Attention is
non-causal inside the block, so all `block_size - 1` draft distributions come from one forward.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F
from transformers import Qwen3Config
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from ddtree.errors import UserError
from ddtree.kernels.tree_attention import tree_attention
from ddtree.kv_cache import KVCache
from ddtree.models.layers import merge_heads, residual_mlp
from ddtree.tree import Transition

WEIGHTS_NAME = "model.safetensors"


class DFlashAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.head_dim = int(config.head_dim)
        bias = bool(config.attention_bias)
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[batch, n, hidden] -> keys, values `[batch, kv_heads, n, head_dim]` (keys normed and rotated)."""
        batch, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(batch, n, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, n, -1, self.head_dim).transpose(1, 2)
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        return k, v

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[batch, n, hidden] -> queries `[batch, heads, n, head_dim]`, normed and rotated."""
        batch, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, n, -1, self.head_dim)).transpose(1, 2)
        rotated: torch.Tensor = apply_rotary_pos_emb(q, q, cos, sin)[0]
        return rotated

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        q = self.project_q(x, cos, sin)
        k, v = self.project_kv(x, cos, sin)
        result: torch.Tensor = self.o_proj(merge_heads(attend(q, k, v, context_kv, mask)))
        return result


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_kv: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor
) -> torch.Tensor:
    """Block queries over the context's and the block's own keys; `[batch, heads, n, head_dim]`."""
    keys = torch.cat([context_kv[0], k], dim=2)
    values = torch.cat([context_kv[1], v], dim=2)
    out: torch.Tensor = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    return out


class DFlashLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)  # type: ignore[no-untyped-call]
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DFlashDrafter(nn.Module):
    """The drafter network. `draft()` runs one block; the caller supplies the target's embeddings and head."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        dflash: dict[str, Any] = config.dflash_config
        self.target_layer_ids: tuple[int, ...] = tuple(int(i) for i in dflash["target_layer_ids"])
        self.mask_token_id = int(dflash["mask_token_id"])
        self.block_size = int(config.block_size)
        self.transition: Transition | None = None  # a Markov head's correction of its tree (`ddtree.models.markov`)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary: nn.Module = Qwen3RotaryEmbedding(config)
        self._context_kv: Any = self._eager_context_kv  # compiled versions after compile_layers()
        self._block_qkv: Any = _block_qkv
        self._residual_mlp: Any = residual_mlp

    @property
    def depth(self) -> int:
        """Draft positions per block (the bonus slot excluded)."""
        return self.block_size - 1

    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        c = self.config
        return KVCache(len(self.layers), batch, c.num_key_value_heads, c.head_dim, capacity, dtype, device)

    def append_context(self, context: torch.Tensor, counts: torch.Tensor, cache: KVCache, fused: bool = True) -> None:
        """Write the keys and values of new target features into every layer's cache and commit them.

        `context` `[batch, n, features]` sits at slots `cache.lengths + 0..n-1`; the first `counts[b]` rows are
        real and become committed (`counts` `[batch]`); the rest are scratch past the committed prefix.
        `fused=False` runs eagerly even after `compile_layers` (prefill: one-off shapes).
        """
        n = context.shape[1]
        slots = cache.lengths[:, None] + torch.arange(n, device=context.device)[None, :]  # [batch, n]
        project = self._context_kv if fused else self._eager_context_kv
        for i, (k, v) in enumerate(project(context, slots)):
            cache.write(i, slots, k, v)
        cache.lengths += counts

    def forward(
        self,
        block_embeds: torch.Tensor,
        context: torch.Tensor,
        context_counts: torch.Tensor,
        cache: KVCache,
        key_span: int,
        fused: bool = True,
        attention: str = "sdpa",
    ) -> torch.Tensor:
        """Append context features to the cache, then run one block. Returns normed hidden states.

        `block_embeds` `[batch, block, hidden]` are the target's embeddings of `[bonus, mask, ...]`;
        `context` `[batch, n, features]` are new target features, of which the first `context_counts[b]`
        are real. The block sits right after the context. `key_span` bounds the committed lengths after the
        append; slots past a request's length are masked. `fused=False` runs eagerly even after
        `compile_layers`. `attention` is `sdpa` (the cached context and the block's keys concatenated, under
        a mask) or `triton` (`ddtree.kernels.tree_attention`: the block's keys go into the cache's scratch
        slots after the context, and one kernel reads both in place).
        """
        self.append_context(context, context_counts, cache, fused)
        batch, block = block_embeds.shape[:2]
        lengths = cache.lengths
        if attention == "triton":
            slots = lengths[:, None] + torch.arange(block, device=lengths.device)[None, :]  # [batch, block]
            everything = torch.ones((batch, block, block), dtype=torch.bool, device=lengths.device)

            def in_place(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                cache.write(i, slots, k, v)  # scratch: the next context append overwrites these slots
                return tree_attention(q, cache.keys[i], cache.values[i], lengths, everything)

            return self._run_block(block_embeds, lengths, in_place, fused)
        context_kv = [cache.read(i, key_span) for i in range(len(self.layers))]
        visible = torch.arange(key_span, device=lengths.device)[None, :] < lengths[:, None]  # [batch, span]
        ones = torch.ones((batch, block), dtype=torch.bool, device=lengths.device)
        mask = torch.cat([visible, ones], dim=1)[:, None, None, :]  # [batch, 1, 1, span + block]

        def concatenated(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attend(q, k, v, context_kv[i], mask)

        return self._run_block(block_embeds, lengths, concatenated, fused)

    def compile_layers(self) -> None:
        """Fuse the work around attention with `torch.compile` (inference only): the context projection and,
        per layer, the block's projections and its output projection and MLP. Attention, whose key span
        changes as requests grow, and the cache writes stay eager."""
        self._context_kv = torch.compile(self._eager_context_kv, dynamic=False)
        self._block_qkv = torch.compile(_block_qkv, dynamic=False)
        self._residual_mlp = torch.compile(residual_mlp, dynamic=False)

    def _eager_context_kv(self, context: torch.Tensor, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, keys and values `[batch, kv_heads, n, head_dim]` of `context` at `slots` `[batch, n]`."""
        ctx = self.hidden_norm(self.fc(context))
        cos, sin = self.rotary(ctx, slots)
        attentions: list[DFlashAttention] = [layer.self_attn for layer in self.layers]  # type: ignore[misc]
        return [attn.project_kv(ctx, cos, sin) for attn in attentions]

    def _run_block(
        self,
        block_embeds: torch.Tensor,
        lengths: torch.Tensor,
        attend_layer: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        fused: bool,
    ) -> torch.Tensor:
        """The block right after each request's `lengths` committed tokens. `attend_layer(i, q, k, v)` is layer
        i's attention of the block's queries over the cached context and the block's own keys and values
        (each `[batch, heads or kv_heads, block, head_dim]`)."""
        block = block_embeds.shape[1]
        block_pos = lengths[:, None] + torch.arange(block, device=block_embeds.device)[None, :]  # [batch, block]
        cos, sin = self.rotary(block_embeds, block_pos)
        x = block_embeds
        qkv, rest = (self._block_qkv, self._residual_mlp) if fused else (_block_qkv, residual_mlp)
        layer: Any
        for i, layer in enumerate(self.layers):
            q, k, v = qkv(layer, x, cos, sin)
            x = rest(layer, x, attend_layer(i, q, k, v))
        out: torch.Tensor = self.norm(x)
        return out

    def forward_blocks(
        self,
        block_embeds: torch.Tensor,
        block_pos: torch.Tensor,
        context: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Training forward: many blocks at once over a whole sequence of context features.

        `block_embeds` `[batch, q, hidden]` at `block_pos` `[batch, q]`; `context` `[batch, s, features]` at
        positions `0..s-1`; `mask` `[batch, 1, q, s + q]` says which context and block keys each query sees.
        """
        ctx = self.hidden_norm(self.fc(context))
        ctx_pos = torch.arange(context.shape[1], device=context.device).expand(context.shape[0], -1)
        ctx_cos, ctx_sin = self.rotary(ctx, ctx_pos)
        cos, sin = self.rotary(block_embeds, block_pos)

        def context_kv(i: int, attn: DFlashAttention) -> tuple[torch.Tensor, torch.Tensor]:
            return attn.project_kv(ctx, ctx_cos, ctx_sin)

        return self._stack(block_embeds, cos, sin, mask, context_kv)

    def _stack(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        context_kv: Callable[[int, DFlashAttention], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        layer: Any
        for i, layer in enumerate(self.layers):
            attn: DFlashAttention = layer.self_attn
            x = x + attn(layer.input_layernorm(x), cos, sin, context_kv(i, attn), mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        out: torch.Tensor = self.norm(x)
        return out


def _block_qkv(
    layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's queries, keys and values of the block `x` `[batch, n, hidden]`."""
    attn: DFlashAttention = layer.self_attn
    h = layer.input_layernorm(x)
    k, v = attn.project_kv(h, cos, sin)
    return attn.project_q(h, cos, sin), k, v


def default_feature_layers(num_target_layers: int, count: int) -> list[int]:
    """`count` target layers spread evenly from the second to the fourth-last (all layers for tiny targets)."""
    low = 1 if num_target_layers > 3 else 0
    high = max(low, num_target_layers - 3)
    if count == 1:
        return [(low + high) // 2]
    return [round(low + i * (high - low) / (count - 1)) for i in range(count)]


def drafter_config(
    target_config: Any,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    feature_layers: list[int] | None = None,
) -> Any:
    """A drafter config sized to the target: same hidden size, heads, vocabulary and rotary settings."""
    head_dim = (
        getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
    )
    layers = feature_layers or default_feature_layers(target_config.num_hidden_layers, num_layers)
    rope = getattr(target_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    fields: dict[str, Any] = dict(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=target_config.num_key_value_heads,
        head_dim=head_dim,
        hidden_act=getattr(target_config, "hidden_act", "silu"),
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_parameters=dict(rope),
        tie_word_embeddings=False,
        architectures=["DFlashDraftModel"],
        block_size=block_size,
        num_target_layers=target_config.num_hidden_layers,
        dflash_config={"target_layer_ids": layers, "mask_token_id": mask_token_id},
    )
    return Qwen3Config(**fields)


def save_drafter(drafter: DFlashDrafter, out: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write `config.json` and `model.safetensors` (in `dtype`, default the drafter's own)."""
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    drafter.config.save_pretrained(directory)
    state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})


def read_drafter_config(path: str | Path) -> Any:
    """A drafter directory's config, checked, without its weights; UserError naming the file otherwise."""
    directory = Path(path)
    config_file, weights = directory / "config.json", directory / WEIGHTS_NAME
    if not config_file.is_file() or not weights.is_file():
        raise UserError(f"drafter directory {str(path)!r} is missing config.json or {WEIGHTS_NAME}")
    try:
        raw = json.loads(config_file.read_text())
        dflash = raw["dflash_config"]
        _ = raw["block_size"], dflash["target_layer_ids"], dflash["mask_token_id"]
        config = Qwen3Config.from_pretrained(directory)
        sizes = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads)
        if not all(isinstance(n, int) and n >= 1 for n in (*sizes, config.head_dim, config.vocab_size)):
            raise ValueError("its sizes (hidden, layers, heads, head_dim, vocab) must be integers >= 1")
        layers = [int(i) for i in dflash["target_layer_ids"]]
        if not layers:
            raise ValueError("target_layer_ids is empty")
        int(dflash["mask_token_id"])
        block = int(config.block_size)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"drafter config {str(config_file)!r} is not a DFlash config: {exc}") from exc
    if block < 2:
        raise UserError(f"drafter block_size must be >= 2, got {config.block_size}")
    return config


def load_drafter(path: str | Path, device: torch.device, dtype: torch.dtype) -> DFlashDrafter:
    """Load a drafter directory, with a clear error when it is missing or malformed."""
    directory = Path(path)
    config = read_drafter_config(directory)
    weights = directory / WEIGHTS_NAME
    drafter = DFlashDrafter(config)
    try:
        drafter.load_state_dict(load_file(str(weights)))
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise UserError(f"cannot load drafter weights {str(weights)!r}: {exc}") from exc
    return drafter.to(device=device, dtype=dtype).eval()


def check_pair(drafter: DFlashDrafter, target_config: Any) -> None:
    """The drafter must share the target's hidden size and vocabulary, and read layers it has."""
    c = drafter.config
    if c.hidden_size != target_config.hidden_size:
        raise UserError(f"drafter hidden size {c.hidden_size} does not match the target's {target_config.hidden_size}")
    if c.vocab_size != target_config.vocab_size:
        raise UserError(f"drafter vocabulary {c.vocab_size} does not match the target's {target_config.vocab_size}")
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < target_config.num_hidden_layers]
    if bad:
        raise UserError(f"drafter reads target layers {bad}, but the target has {target_config.num_hidden_layers}")
    if not 0 <= drafter.mask_token_id < target_config.vocab_size:
        raise UserError(f"drafter mask_token_id {drafter.mask_token_id} is outside the target vocabulary")
