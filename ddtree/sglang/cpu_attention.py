"""Target-verify attention in torch for SGLang's torch_native backend (CPU mode only).

A verify batch holds `n` query tokens per request (`spec_info.num_tokens_per_req`), written to the KV slots
just past the request's committed prefix (`forward_batch.seq_lens`). Each query sees:
- every key of the prefix and of the window, for a non-causal layer (the DFlash drafter's ENCODER_ONLY
  attention);
- the prefix and its row of `spec_info.custom_mask` (SGLang's FULL layout: per request `[n, prefix + n]`,
  flat, requests concatenated), for a tree;
- the prefix and the window's tokens up to itself otherwise (DFlash's chain).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention


def verify_mask(n: int, prefix: int, causal: bool, custom: torch.Tensor | None) -> torch.Tensor | None:
    """`[n, prefix + n]` bool (True = may attend) for one request, or None for full attention.

    `custom` is that request's slice of the FULL mask (`n * (prefix + n)` values) when there is one.
    """
    if custom is not None:
        return custom.view(n, prefix + n)
    if not causal:
        return None
    return torch.ones((n, prefix + n), dtype=torch.bool).tril(diagonal=prefix)


def target_verify(
    backend: Any, q: torch.Tensor, k: Any, v: Any, layer: Any, forward_batch: Any, save_kv_cache: bool = True
) -> torch.Tensor:
    """Write the window's KV, then attend request by request (see the module docstring)."""
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    pool = backend.token_to_kv_pool
    if save_kv_cache and k is not None and v is not None:
        pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v)
    n = int(forward_batch.spec_info.num_tokens_per_req)
    queries = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)  # [bs * n, heads, dim]
    out = q.new_empty((queries.shape[0], layer.tp_q_head_num, layer.v_head_dim))
    keys, values = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    causal = layer.attn_type != AttentionType.ENCODER_ONLY
    mask = getattr(forward_batch.spec_info, "custom_mask", None) if causal else None
    offset = 0
    for b, prefix in enumerate(forward_batch.seq_lens.tolist()):
        span = prefix + n
        custom = mask[offset : offset + n * span] if mask is not None else None
        offset += n * span
        slots = req_to_token[forward_batch.req_pool_indices[b], :span]
        rows = slice(b * n, (b + 1) * n)
        out[rows] = _attend(queries[rows], keys[slots], values[slots], verify_mask(n, prefix, causal, custom), layer)
    return out.view(q.shape[0], -1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, layer: Any) -> torch.Tensor:
    """SDPA of `q` `[n, heads, dim]` over `k`, `v` `[span, kv_heads, dim]`; returns `[n, heads, v_dim]`."""
    out = scaled_dot_product_attention(
        q.movedim(0, 1)[None],
        k.to(q.dtype).movedim(0, 1)[None],
        v.to(q.dtype).movedim(0, 1)[None],
        attn_mask=None if mask is None else mask.to(q.device)[None, None],
        scale=layer.scaling,
        enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
    )
    return out[0].movedim(0, 1)
