"""The Triton kernel of `ddtree.kernels.tree_attention`, which explains it and launches it.

Imported lazily, on the first call (the core install may lack triton).
"""

from __future__ import annotations

import triton.language as tl

from ddtree.kernels._jit import jit as _jit

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@_jit
def _dot(a: tl.tensor, b: tl.tensor, IEEE: tl.constexpr) -> tl.tensor:
    """a @ b accumulated in float32; IEEE keeps float32 inputs exact (no TF32 rounding)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@_jit
def _update(
    q: tl.tensor,
    k_ptrs: tl.tensor,
    v_ptrs: tl.tensor,
    kv_ok: tl.tensor,
    d_ok: tl.tensor,
    allowed: tl.tensor,
    m_i: tl.tensor,
    l_i: tl.tensor,
    acc: tl.tensor,
    qk_scale: tl.tensor,
    IEEE: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """One block of keys into the online softmax. k_ptrs [BLOCK_D, BLOCK_N], v_ptrs [BLOCK_N, BLOCK_D],
    kv_ok [BLOCK_N] (keys that exist), d_ok [BLOCK_D] (head dims that exist), allowed [BLOCK_M, BLOCK_N];
    m_i, l_i [BLOCK_M]; acc [BLOCK_M, BLOCK_D]."""
    keys = tl.load(k_ptrs, mask=d_ok[:, None] & kv_ok[None, :], other=0.0)
    scores = _dot(q, keys, IEEE) * qk_scale  # [BLOCK_M, BLOCK_N], in log2 units
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    values = tl.load(v_ptrs, mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(values.dtype), values, IEEE)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@_jit
def tree_attention_kernel(
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    out_ptr: tl.tensor,
    lengths_ptr: tl.tensor,
    visible_ptr: tl.tensor,
    n: tl.tensor,
    scale: tl.tensor,
    sq_b: tl.tensor,
    sq_h: tl.tensor,
    sq_n: tl.tensor,
    sk_b: tl.tensor,
    sk_h: tl.tensor,
    sk_s: tl.tensor,
    sv_b: tl.tensor,
    sv_h: tl.tensor,
    sv_s: tl.tensor,
    so_b: tl.tensor,
    so_h: tl.tensor,
    so_n: tl.tensor,
    svis_b: tl.tensor,
    svis_i: tl.tensor,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
) -> None:
    """Grid (batch, kv_heads, row blocks). A program's rows are (node, query head of this KV head) pairs,
    node-major, so the GROUP query heads that share a KV head read its keys once."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    node = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = node < n
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_ptrs = q_ptr + b * sq_b + head[:, None] * sq_h + node[:, None] * sq_n + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    length = tl.load(lengths_ptr + b).to(tl.int32)
    k_base = k_ptr + b * sk_b + kvh * sk_h
    v_base = v_ptr + b * sv_b + kvh * sv_h
    qk_scale = scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for start in range(0, length, BLOCK_N):  # the committed prefix: every row sees all of it
        slot = start + cols
        kv_ok = slot < length
        k_ptrs = k_base + slot[None, :] * sk_s + d[:, None]
        v_ptrs = v_base + slot[:, None] * sv_s + d[None, :]
        allowed = row_ok[:, None] & kv_ok[None, :]
        m_i, l_i, acc = _update(q, k_ptrs, v_ptrs, kv_ok, d_ok, allowed, m_i, l_i, acc, qk_scale, IEEE)
    for start in range(0, n, BLOCK_N):  # this forward's tokens, in slots length + j: row i sees j if visible
        j = start + cols
        j_ok = j < n
        k_ptrs = k_base + (length + j)[None, :] * sk_s + d[:, None]
        v_ptrs = v_base + (length + j)[:, None] * sv_s + d[None, :]
        vis_ptrs = visible_ptr + b * svis_b + node[:, None] * svis_i + j[None, :]
        allowed = tl.load(vis_ptrs, mask=row_ok[:, None] & j_ok[None, :], other=0) != 0
        m_i, l_i, acc = _update(q, k_ptrs, v_ptrs, j_ok, d_ok, allowed, m_i, l_i, acc, qk_scale, IEEE)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_ptrs = out_ptr + b * so_b + head[:, None] * so_h + node[:, None] * so_n + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
