"""Triton kernels of the fused tree build; `ddtree.kernels.tree_build` explains the algorithm and launches them.

This module imports triton at import time, so it is only imported lazily, on the first fused call. Keys: a
float32 value becomes a uint32 `ukey` whose unsigned order is the float order; an int64 `packed` key holds the
ukey (as a signed number) in its high half and `0x7FFFFFFF - position` in its low half, so a descending sort of
packed keys orders by value, then by earlier position. Positions are below 2**31.
"""

from __future__ import annotations

import triton.language as tl
from triton.language.extra import libdevice

from ddtree.kernels._jit import jit as _jit

INT64_MIN: tl.constexpr = tl.constexpr(-(2**63))


@_jit
def _exp(x: tl.tensor, ACCURATE: tl.constexpr) -> tl.tensor:
    """exp; ACCURATE uses libdevice's expf (what torch's CUDA kernels use), else tl.exp (the interpreter's)."""
    return libdevice.exp(x) if ACCURATE else tl.exp(x)


@_jit
def _log(x: tl.tensor, ACCURATE: tl.constexpr) -> tl.tensor:
    return libdevice.log(x) if ACCURATE else tl.log(x)


@_jit
def _ordered_key(x: tl.tensor) -> tl.tensor:
    """float32 [n] -> uint32 [n], monotone: larger float, larger key (-0.0 sits just below +0.0)."""
    bits = x.to(tl.uint32, bitcast=True)
    return bits ^ (((bits >> 31) * 0x7FFFFFFF) | 0x80000000)


@_jit
def _pack(ukey: tl.tensor, pos: tl.tensor) -> tl.tensor:
    """uint32 [n], int [n] -> int64 [n]: value first, then earlier position first, under a descending sort."""
    signed = (ukey ^ 0x80000000).to(tl.int32, bitcast=True).to(tl.int64)
    return (signed << 32) | (0x7FFFFFFF - pos.to(tl.int64))


@_jit
def _unpack_value(packed: tl.tensor) -> tl.tensor:
    """int64 [n] -> the float32 [n] whose key is in the high half."""
    ukey = (packed >> 32).to(tl.int32).to(tl.uint32, bitcast=True) ^ 0x80000000
    flip = ((1 - (ukey >> 31)) * 0x7FFFFFFF) | 0x80000000
    return (ukey ^ flip).to(tl.float32, bitcast=True)


@_jit
def _unpack_pos(packed: tl.tensor) -> tl.tensor:
    """int64 [n] -> int32 [n] position stored in the low half."""
    return (0x7FFFFFFF - (packed & 0x7FFFFFFF)).to(tl.int32)


@_jit
def _kth_largest(ukey: tl.tensor, k: tl.tensor, TOP_BIT: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """Bitwise binary search, from bit TOP_BIT (the highest that can be set) down, for the largest t with
    count(ukey >= t) >= k (ukey: uint32 [n], n >= k). Returns t and that count. It stops once exactly k keys
    are >= t (then t need not be a key); a count above k means t is the k-th largest key and equal keys
    straddle the k-th place. About 20 rounds of count-and-reduce on float32 data."""
    t = tl.zeros((), dtype=tl.uint32)
    count = tl.full((), ukey.shape[0], tl.int32)
    bit = tl.full((), TOP_BIT, tl.int32)
    while (bit >= 0) & (count != k):
        cand = t | (tl.full((), 1, tl.uint32) << bit.to(tl.uint32))
        c = tl.sum((ukey >= cand).to(tl.int32), 0)
        t = tl.where(c >= k, cand, t)
        count = tl.where(c >= k, c, count)
        bit -= 1
    return t, count


@_jit
def _kth_largest_radix(
    ukey: tl.tensor, k: tl.tensor, TOP_BIT: tl.constexpr, RADIX_BITS: tl.constexpr
) -> tuple[tl.tensor, tl.tensor]:
    """`_kth_largest` deciding RADIX_BITS bits a round: the thresholds t | d << lo for every digit d of bits
    lo.. are counted in one reduction over an [n, 2**RADIX_BITS] comparison (8 rounds for 32 bits at 4 bits).
    The top round holds the (TOP_BIT + 1) % RADIX_BITS leftover bits, if any; its larger digits, which would
    pass bit TOP_BIT (or wrap past bit 31), are masked. Same result: it stops once exactly k keys are >= t, else
    t ends as the k-th largest key; only where it stops, hence t in the first case, can differ."""
    d = tl.arange(0, 1 << RADIX_BITS)  # [R] digit
    t = tl.zeros((), dtype=tl.uint32)
    count = tl.full((), ukey.shape[0], tl.int32)
    lo = tl.full((), (TOP_BIT // RADIX_BITS) * RADIX_BITS, tl.int32)  # lowest bit of the round
    while (lo >= 0) & (count != k):
        width = tl.minimum(TOP_BIT + 1 - lo, RADIX_BITS)  # bits of this round, 1..RADIX_BITS
        cand = t | (d.to(tl.uint32) << lo.to(tl.uint32))  # [R]; cand[0] == t
        c = tl.sum((ukey[:, None] >= cand[None, :]).to(tl.int32), 0)  # [R] count(ukey >= cand), non-increasing
        ok = ((d >> width) == 0) & (c >= k)  # [R]; digit 0 always qualifies (c[0] == count >= k)
        t = tl.max(tl.where(ok, cand, 0), 0)  # the largest qualifying digit
        count = tl.min(tl.where(ok, c, count), 0)  # and its count
        lo -= RADIX_BITS
    return t, count


@_jit
def _compact_top(
    ukey: tl.tensor,
    packed: tl.tensor,
    k: tl.tensor,
    dst_ptr: tl.tensor,
    TOP_BIT: tl.constexpr,
    RADIX_BITS: tl.constexpr,
) -> None:
    """Store `packed` of the k largest `ukey` (uint32 [n] below 2**(TOP_BIT+1); among equal keys the earliest
    positions) to dst[0:k], in position order. RADIX_BITS: bits a round of the threshold search (1: binary)."""
    if RADIX_BITS == 1:
        t, count = _kth_largest(ukey, k, TOP_BIT)
    else:
        t, count = _kth_largest_radix(ukey, k, TOP_BIT, RADIX_BITS)
    sel = ukey >= t  # [n]
    if count > k:  # keys equal to t straddle the k-th place: keep the earliest of them
        gt = ukey > t
        eq = ukey == t
        sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= k - tl.sum(gt.to(tl.int32), 0)))
    pos = tl.cumsum(sel.to(tl.int32), 0) - 1  # [n] slot in dst
    tl.store(dst_ptr + pos, packed, mask=sel)


@_jit
def _top_sorted(
    ukey: tl.tensor,
    pos: tl.tensor,
    k: tl.tensor,
    scratch_ptr: tl.tensor,
    K_PAD: tl.constexpr,
    BITONIC: tl.constexpr,
    RADIX_BITS: tl.constexpr,
) -> tl.tensor:
    """The k largest of (ukey [n], earlier pos first) as packed keys, sorted descending: int64 [K_PAD], ranks
    past k are padding. BITONIC: one tl.topk over all n; else a threshold search, a compaction through
    scratch[0:K_PAD] (RADIX_BITS bits a round) and a sort of k entries."""
    packed = _pack(ukey, pos)  # [n]
    if BITONIC:
        top = tl.topk(packed, K_PAD)
    else:
        _compact_top(ukey, packed, k, scratch_ptr, 31, RADIX_BITS)
        tl.debug_barrier()
        top = _sorted_top(scratch_ptr, k, K_PAD)
    return top


@_jit
def _sorted_top(src_ptr: tl.tensor, k: tl.tensor, K_PAD: tl.constexpr) -> tl.tensor:
    """Load the k packed keys at src[0:k] and sort them descending: int64 [K_PAD], padding last."""
    r = tl.arange(0, K_PAD)
    return tl.sort(tl.load(src_ptr + r, mask=r < k, other=INT64_MIN), descending=True)


@_jit
def vocab_partial_kernel(
    logits_ptr: tl.tensor,  # [rows, vocab] float32/bfloat16/float16
    part_key_ptr: tl.tensor,  # [rows, n_split, K_PAD] int64: packed (logit, vocab id), k per chunk, id order
    part_max_ptr: tl.tensor,  # [rows, n_split] float32: chunk max
    part_sum_ptr: tl.tensor,  # [rows, n_split] float32: sum of exp(logit - chunk max)
    vocab: tl.tensor,
    k: tl.tensor,
    n_split: tl.tensor,
    CHUNK: tl.constexpr,
    K_PAD: tl.constexpr,
    LOW_BITS: tl.constexpr,
    ACCURATE: tl.constexpr,
    RADIX_BITS: tl.constexpr,
) -> None:
    """One program per (row, vocab chunk): chunk max and exp-sum, and the chunk's k largest logits."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    idx = split * CHUNK + tl.arange(0, CHUNK)  # [CHUNK] vocab ids
    inside = idx < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * vocab + idx, mask=inside, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    s = tl.sum(_exp(x - tl.where(m == float("-inf"), 0.0, m), ACCURATE), 0)
    out = row * n_split + split
    tl.store(part_max_ptr + out, m)
    tl.store(part_sum_ptr + out, s)
    ukey = tl.where(inside, _ordered_key(x), 0)  # [CHUNK]; ids past the vocabulary rank last
    # 16-bit logits leave the low 16 (bfloat16) or 13 (float16) bits of ukey constant: search the rest.
    dst = part_key_ptr + out.to(tl.int64) * K_PAD
    _compact_top(ukey >> LOW_BITS, _pack(ukey, idx), k, dst, 31 - LOW_BITS, RADIX_BITS)


@_jit
def vocab_merge_kernel(
    part_key_ptr: tl.tensor,  # [rows, n_split, K_PAD] int64
    part_max_ptr: tl.tensor,  # [rows, n_split] float32
    part_sum_ptr: tl.tensor,  # [rows, n_split] float32
    scratch_ptr: tl.tensor,  # [rows, K_PAD] int64
    top_lp_ptr: tl.tensor,  # [rows, k] float32 out
    top_ids_ptr: tl.tensor,  # [rows, k] int64 out
    vocab: tl.tensor,
    k: tl.tensor,
    n_split: tl.tensor,
    S_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    ACCURATE: tl.constexpr,
    BITONIC: tl.constexpr,
    RADIX_BITS: tl.constexpr,
) -> None:
    """One program per row: logsumexp from the chunk partials, then the top k by (log-prob, -vocab id)."""
    row = tl.program_id(0)
    sp = tl.arange(0, S_PAD)
    part_max = tl.load(part_max_ptr + row * n_split + sp, mask=sp < n_split, other=float("-inf"))  # [S_PAD]
    part_sum = tl.load(part_sum_ptr + row * n_split + sp, mask=sp < n_split, other=0.0)  # [S_PAD]
    m = tl.max(part_max, 0)
    total = tl.sum(part_sum * _exp(part_max - tl.where(m == float("-inf"), 0.0, m), ACCURATE), 0)
    log_sum = _log(total, ACCURATE)

    c = tl.arange(0, S_PAD * K_PAD)  # split-major, so valid entries are in vocab id order
    ok = ((c // K_PAD) < n_split) & ((c % K_PAD) < k)
    packed = tl.load(part_key_ptr + row.to(tl.int64) * n_split * K_PAD + c, mask=ok, other=0)
    ids = _unpack_pos(packed)  # [S_PAD * K_PAD]
    ok = ok & (ids < vocab)
    lp = (_unpack_value(packed) - m) - log_sum  # torch's CUDA log_softmax: (x - max) - log(sum)
    ukey = tl.where(ok, _ordered_key(lp), 0)
    top = _top_sorted(ukey, ids, k, scratch_ptr + row * K_PAD, K_PAD, BITONIC, RADIX_BITS)  # [K_PAD]
    r = tl.arange(0, K_PAD)
    tl.store(top_lp_ptr + row * k + r, _unpack_value(top), mask=r < k)
    tl.store(top_ids_ptr + row * k + r, _unpack_pos(top).to(tl.int64), mask=r < k)


@_jit
def beam_tree_kernel(
    top_lp_ptr: tl.tensor,  # [batch, depth, k] float32, descending per row
    top_ids_ptr: tl.tensor,  # [batch, depth, k] int64
    pair_ptr: tl.tensor,  # [2, M_PAD] int32: (prefix slot i, token rank j) with (i+1)(j+1) <= budget; i = -1 pads
    lvl_lp_ptr: tl.tensor,  # [batch, N_PAD] float32 scratch: level d slot r at d * B_PAD + r
    lvl_tok_ptr: tl.tensor,  # [batch, N_PAD] int64 scratch
    lvl_par_ptr: tl.tensor,  # [batch, N_PAD] int32 scratch: parent slot in level d - 1
    node_ptr: tl.tensor,  # [batch, N_PAD] int32 scratch: node index of each chosen candidate
    key_ptr: tl.tensor,  # [batch, B_PAD] int64 scratch
    tokens_ptr: tl.tensor,  # [batch, 1 + budget] int64 out
    parents_ptr: tl.tensor,  # [batch, 1 + budget] int64 out
    depths_ptr: tl.tensor,  # [batch, 1 + budget] int64 out
    log_probs_ptr: tl.tensor,  # [batch, 1 + budget] float32 out
    num_nodes_ptr: tl.tensor,  # [batch] int64 out
    budget: tl.tensor,
    k: tl.tensor,
    DEPTH: tl.constexpr,
    M_PAD: tl.constexpr,
    B_PAD: tl.constexpr,
    N_PAD: tl.constexpr,
    BITONIC: tl.constexpr,
    RADIX_BITS: tl.constexpr,
) -> None:
    """One program per request: the depth-wise beam, then the global top-`budget` and node numbering."""
    b = tl.program_id(0)
    r = tl.arange(0, B_PAD)  # [B_PAD] slot / rank
    in_beam = r < budget
    lvl = b.to(tl.int64) * N_PAD
    row0 = b.to(tl.int64) * DEPTH * k
    keys = key_ptr + b.to(tl.int64) * B_PAD
    first = in_beam & (r < k)
    tl.store(lvl_lp_ptr + lvl + r, tl.load(top_lp_ptr + row0 + r, mask=first, other=float("-inf")), mask=in_beam)
    tl.store(lvl_tok_ptr + lvl + r, tl.load(top_ids_ptr + row0 + r, mask=first, other=-1), mask=in_beam)
    tl.store(lvl_par_ptr + lvl + r, tl.full((B_PAD,), -1, tl.int32), mask=in_beam)
    tl.debug_barrier()

    t = tl.arange(0, M_PAD)  # [M_PAD] pair index = rank of the flat index i * k + j
    pi = tl.load(pair_ptr + t)
    pj = tl.load(pair_ptr + M_PAD + t)
    pair_ok = pi >= 0
    for d in range(1, DEPTH):
        prev = tl.load(lvl_lp_ptr + lvl + (d - 1) * B_PAD + pi, mask=pair_ok, other=float("-inf"))
        cand = prev + tl.load(top_lp_ptr + row0 + d * k + pj, mask=pair_ok, other=float("-inf"))  # [M_PAD]
        ukey = tl.where(pair_ok, _ordered_key(cand), 0)
        top = _top_sorted(ukey, t, budget, keys, B_PAD, BITONIC, RADIX_BITS)  # [B_PAD]
        src = _unpack_pos(top)
        j = tl.load(pair_ptr + M_PAD + src, mask=in_beam, other=0)
        slot = lvl + d * B_PAD + r
        tl.store(lvl_lp_ptr + slot, _unpack_value(top), mask=in_beam)
        tl.store(lvl_tok_ptr + slot, tl.load(top_ids_ptr + row0 + d * k + j, mask=in_beam, other=-1), mask=in_beam)
        tl.store(lvl_par_ptr + slot, tl.load(pair_ptr + src, mask=in_beam, other=0), mask=in_beam)
        tl.debug_barrier()

    # Global top-`budget`; the flat index d * B_PAD + r breaks ties: shallower first, then beam slot.
    f = tl.arange(0, N_PAD)
    f_ok = ((f // B_PAD) < DEPTH) & ((f % B_PAD) < budget)
    val = tl.load(lvl_lp_ptr + lvl + f, mask=f_ok, other=float("-inf"))  # [N_PAD]
    ukey = tl.where(f_ok, _ordered_key(val), 0)
    top = _top_sorted(ukey, f, budget, keys, B_PAD, BITONIC, RADIX_BITS)  # [B_PAD] in node order
    lp = _unpack_value(top)
    src = _unpack_pos(top)
    real = in_beam & (lp > float("-inf"))
    tl.store(node_ptr + lvl + src, r + 1, mask=in_beam)
    tl.debug_barrier()
    d_src = src // B_PAD
    par_slot = tl.load(lvl_par_ptr + lvl + src, mask=in_beam, other=0)
    par_node = tl.load(node_ptr + lvl + (d_src - 1) * B_PAD + par_slot, mask=real & (d_src > 0), other=0)
    tok = tl.load(lvl_tok_ptr + lvl + src, mask=in_beam, other=-1)
    out = b.to(tl.int64) * (budget + 1) + 1 + r
    tl.store(tokens_ptr + out, tl.where(real, tok, -1), mask=in_beam)
    tl.store(parents_ptr + out, tl.where(real, par_node, -1).to(tl.int64), mask=in_beam)
    tl.store(depths_ptr + out, tl.where(real, d_src + 1, 0).to(tl.int64), mask=in_beam)
    tl.store(log_probs_ptr + out, lp, mask=in_beam)
    root = b.to(tl.int64) * (budget + 1)
    tl.store(tokens_ptr + root, -1)
    tl.store(parents_ptr + root, -1)
    tl.store(depths_ptr + root, 0)
    tl.store(log_probs_ptr + root, 0.0)
    tl.store(num_nodes_ptr + b, tl.sum(real.to(tl.int64), 0))


@_jit
def _row_count(base: tl.tensor, vocab: tl.tensor, t: tl.tensor, TILE: tl.constexpr) -> tl.tensor:
    """How many logits of the row at `base` have ukey >= t (one pass over the row)."""
    r = tl.arange(0, TILE)
    count = tl.zeros((), dtype=tl.int32)
    for start in range(0, vocab, TILE):
        idx = start + r
        x = tl.load(base + idx, mask=idx < vocab, other=0.0).to(tl.float32)
        count += tl.sum(((idx < vocab) & (_ordered_key(x) >= t)).to(tl.int32), 0)
    return count


@_jit
def _row_kth_largest(base: tl.tensor, vocab: tl.tensor, k: tl.tensor, TILE: tl.constexpr) -> tl.tensor:
    """`_kth_largest` over a whole row, a pass over it per bit (the slow path, for rows the floor leaves too many
    candidates in): the t with count(ukey >= t) >= k (the count itself is not needed by the caller)."""
    t = tl.zeros((), dtype=tl.uint32)
    count = vocab.to(tl.int32)
    bit = tl.full((), 31, tl.int32)
    while (bit >= 0) & (count != k):
        cand = t | (tl.full((), 1, tl.uint32) << bit.to(tl.uint32))
        c = _row_count(base, vocab, cand, TILE)
        t = tl.where(c >= k, cand, t)
        count = tl.where(c >= k, c, count)
        bit -= 1
    return t


@_jit
def _compact_row(
    base: tl.tensor,
    vocab: tl.tensor,
    t: tl.tensor,
    ties: tl.tensor,
    dst: tl.tensor,
    CAP: tl.constexpr,
    TILE: tl.constexpr,
) -> tl.tensor:
    """Store packed (key, id) of the row's logits with ukey > t, and of the first `ties` with ukey == t, to
    dst[0:CAP] in vocab id order; returns how many were selected (stores past CAP are dropped)."""
    r = tl.arange(0, TILE)
    total = tl.zeros((), dtype=tl.int32)
    equal = tl.zeros((), dtype=tl.int32)  # ukey == t seen so far
    for start in range(0, vocab, TILE):
        idx = start + r
        inside = idx < vocab
        x = tl.load(base + idx, mask=inside, other=0.0).to(tl.float32)
        ukey = _ordered_key(x)
        eq = inside & (ukey == t)
        sel = (inside & (ukey > t)) | (eq & (equal + tl.cumsum(eq.to(tl.int32), 0) <= ties))
        pos = total + tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(dst + pos, _pack(ukey, idx), mask=sel & (pos < CAP))
        total += tl.sum(sel.to(tl.int32), 0)
        equal += tl.sum(eq.to(tl.int32), 0)
    return total


@_jit
def vocab_row_kernel(
    logits_ptr: tl.tensor,  # [rows, vocab] float32/bfloat16/float16
    maxima_ptr: tl.tensor,  # [rows, S_PAD] float32 scratch: the max of each stretch of GROUP logits
    cand_ptr: tl.tensor,  # [rows, CAP] int64 scratch: packed (logit, vocab id) of the candidates, id order
    scratch_ptr: tl.tensor,  # [rows, K_PAD] int64 scratch
    top_lp_ptr: tl.tensor,  # [rows, k] float32 out
    top_ids_ptr: tl.tensor,  # [rows, k] int64 out
    vocab: tl.tensor,
    k: tl.tensor,
    TILE: tl.constexpr,
    GROUP: tl.constexpr,
    S_PAD: tl.constexpr,
    CAP: tl.constexpr,
    K_PAD: tl.constexpr,
    ACCURATE: tl.constexpr,
    RADIX_BITS: tl.constexpr,
) -> None:
    """One program per row, two passes over it: an online logsumexp and the maxima of GROUP-logit stretches;
    then every logit at or above the k-th largest stretch maximum (a floor under the row's k-th largest logit:
    k stretches reach it) is a candidate, and the top k of the candidates by (log-prob, -vocab id) are kept.
    A row with more than CAP candidates (near-flat logits) finds its exact k-th largest logit instead."""
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * vocab
    r = tl.arange(0, TILE)
    g = tl.arange(0, TILE // GROUP)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), dtype=tl.float32)
    for start in range(0, vocab, TILE):
        idx = start + r
        x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * _exp(m - m_safe, ACCURATE) + tl.sum(_exp(x - m_safe, ACCURATE), 0)
        m = m_new
        stretch = start // GROUP + g
        tl.store(
            maxima_ptr + row * S_PAD + stretch, tl.max(tl.reshape(x, (TILE // GROUP, GROUP)), 1), mask=stretch < S_PAD
        )
    tl.debug_barrier()
    sp = tl.arange(0, S_PAD)
    real = sp < (vocab + GROUP - 1) // GROUP
    maxima = tl.load(maxima_ptr + row * S_PAD + sp, mask=real, other=float("-inf"))
    floor, _ = _kth_largest(tl.where(real, _ordered_key(maxima), 0), k, 31)
    dst = cand_ptr + row.to(tl.int64) * CAP
    total = _compact_row(base, vocab, floor, vocab, dst, CAP, TILE)
    if total > CAP:
        t = _row_kth_largest(base, vocab, k, TILE)
        above = _row_count(base, vocab, t + 1, TILE)  # ukey > t; the first (k - above) ties at t join them
        total = _compact_row(base, vocab, t, k - above, dst, CAP, TILE)
    tl.debug_barrier()
    c = tl.arange(0, CAP)
    ok = c < total
    packed = tl.load(dst + c, mask=ok, other=0)
    ids = _unpack_pos(packed)
    lp = (_unpack_value(packed) - m) - _log(s, ACCURATE)  # torch's CUDA log_softmax: (x - max) - log(sum)
    top = _top_sorted(tl.where(ok, _ordered_key(lp), 0), ids, k, scratch_ptr + row * K_PAD, K_PAD, False, RADIX_BITS)
    out = tl.arange(0, K_PAD)
    tl.store(top_lp_ptr + row * k + out, _unpack_value(top), mask=out < k)
    tl.store(top_ids_ptr + row * k + out, _unpack_pos(top).to(tl.int64), mask=out < k)
