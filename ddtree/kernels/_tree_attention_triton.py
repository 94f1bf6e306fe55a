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
    part_ptr: tl.tensor,  # [programs, SPLITS, BLOCK_M, BLOCK_D + 2] float32: each split's acc, m and l
    count_ptr: tl.tensor,  # [programs] int32, zero between calls: splits done per (request, KV head, row block)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    SPLITS: tl.constexpr,
) -> None:
    """Grid (batch, kv_heads, row blocks * SPLITS). A program's rows are (node, query head of this KV head)
    pairs, node-major, so the GROUP query heads that share a KV head read its keys once. With SPLITS > 1 the
    committed prefix is cut into SPLITS runs of whole key blocks, one per program (the last one also takes the
    tree's slots); each stores its partial softmax, and the last of them to finish merges them all."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2) % SPLITS
    rows = (tl.program_id(2) // SPLITS) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
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
    per = tl.cdiv(tl.cdiv(length, BLOCK_N), SPLITS) * BLOCK_N  # prefix keys per split, whole blocks
    first = split * per
    last = tl.minimum(length, first + per)
    for start in range(first, last, BLOCK_N):  # this split's run of the committed prefix: every row sees it all
        slot = start + cols
        kv_ok = slot < last
        k_ptrs = k_base + slot[None, :] * sk_s + d[:, None]
        v_ptrs = v_base + slot[:, None] * sv_s + d[None, :]
        allowed = row_ok[:, None] & kv_ok[None, :]
        m_i, l_i, acc = _update(q, k_ptrs, v_ptrs, kv_ok, d_ok, allowed, m_i, l_i, acc, qk_scale, IEEE)
    tree = tl.where(split == SPLITS - 1, n, 0)
    for start in range(0, tree, BLOCK_N):  # this forward's tokens, in slots length + j: row i sees j if visible
        j = start + cols
        j_ok = j < n
        k_ptrs = k_base + (length + j)[None, :] * sk_s + d[:, None]
        v_ptrs = v_base + (length + j)[:, None] * sv_s + d[None, :]
        vis_ptrs = visible_ptr + b * svis_b + node[:, None] * svis_i + j[None, :]
        allowed = tl.load(vis_ptrs, mask=row_ok[:, None] & j_ok[None, :], other=0) != 0
        m_i, l_i, acc = _update(q, k_ptrs, v_ptrs, j_ok, d_ok, allowed, m_i, l_i, acc, qk_scale, IEEE)
    out_ptrs = out_ptr + b * so_b + head[:, None] * so_h + node[:, None] * so_n + d[None, :]
    if SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        owner = (b * tl.num_programs(1) + kvh) * (tl.num_programs(2) // SPLITS) + tl.program_id(2) // SPLITS
        r = tl.arange(0, BLOCK_M)
        part = part_ptr + (owner * SPLITS).to(tl.int64) * BLOCK_M * (BLOCK_D + 2)  # this owner's splits
        mine = part + split * BLOCK_M * (BLOCK_D + 2) + r * (BLOCK_D + 2)  # [BLOCK_M] row starts
        tl.store(mine[:, None] + d[None, :], acc)
        tl.store(mine + BLOCK_D, m_i)
        tl.store(mine + BLOCK_D + 1, l_i)
        if tl.atomic_add(count_ptr + owner, 1) == SPLITS - 1:  # acq_rel: the other splits' stores are visible
            out = _merge_splits(part, r, d, BLOCK_M, BLOCK_D, SPLITS)
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
            tl.store(count_ptr + owner, 0)  # ready for the next call


@_jit
def _merge_splits(
    part: tl.tensor, r: tl.tensor, d: tl.tensor, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr
) -> tl.tensor:
    """The normalised output [BLOCK_M, BLOCK_D] of SPLITS partial softmaxes (acc, m, l per row; m in log2 units)."""
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(SPLITS):
        row = part + j * BLOCK_M * (BLOCK_D + 2) + r * (BLOCK_D + 2)  # [BLOCK_M]
        m_j = tl.load(row + BLOCK_D, cache_modifier=".cg")
        l_j = tl.load(row + BLOCK_D + 1, cache_modifier=".cg")
        acc_j = tl.load(row[:, None] + d[None, :], cache_modifier=".cg")
        m_new = tl.maximum(m, m_j)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha, beta = tl.exp2(m - m_safe), tl.exp2(m_j - m_safe)
        acc = acc * alpha[:, None] + acc_j * beta[:, None]
        l_sum = l_sum * alpha + l_j * beta
        m = m_new
    return acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
