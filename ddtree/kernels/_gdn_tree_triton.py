"""The Triton kernels of `ddtree.kernels.gdn_tree`, which explains them and launches them.

Imported lazily, on the first call (the core install may lack triton).
"""

from __future__ import annotations

import triton.language as tl

from ddtree.kernels._jit import jit as _jit


@_jit
def _delta_step(
    h: tl.tensor,
    node: tl.tensor,
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    g_ptr: tl.tensor,
    beta_ptr: tl.tensor,
    row: tl.tensor,
    head: tl.tensor,
    offs_k: tl.tensor,
    offs_v: tl.tensor,
    k_ok: tl.tensor,
    v_ok: tl.tensor,
    s_kn: tl.tensor,
    s_vn: tl.tensor,
    s_gn: tl.tensor,
    HEADS: tl.constexpr,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
) -> tl.tensor:
    """`ddtree.models.gdn.delta_step` of one node on the state tile h [BLOCK_K, BLOCK_V]. Inputs are
    contiguous past their node axis: k [.., n, HEADS, K_DIM], v [.., n, HEADS, V_DIM], g and beta [.., n,
    HEADS]; s_*n are the row strides (n times the node stride) and node strides of row `row` are implied."""
    key = tl.load(k_ptr + row * s_kn + (node * HEADS + head) * K_DIM + offs_k, mask=k_ok, other=0.0)
    value = tl.load(v_ptr + row * s_vn + (node * HEADS + head) * V_DIM + offs_v, mask=v_ok, other=0.0)
    decay = tl.load(g_ptr + row * s_gn + node * HEADS + head)
    beta = tl.load(beta_ptr + row * s_gn + node * HEADS + head)
    h = h * tl.exp(decay)
    remembered = tl.sum(h * key[:, None], axis=0)  # [BLOCK_V]
    delta = (value - remembered) * beta
    return h + key[:, None] * delta[None, :]


@_jit
def tree_delta_kernel(
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    g_ptr: tl.tensor,
    beta_ptr: tl.tensor,
    parents_ptr: tl.tensor,
    keep_ptr: tl.tensor,
    state_ptr: tl.tensor,
    out_ptr: tl.tensor,
    scratch_ptr: tl.tensor,
    n: tl.tensor,
    HEADS: tl.constexpr,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
) -> None:
    """One program per (request, head, block of value columns): the nodes in order, each from its parent's
    state (in registers when the parent is the node before, else from `scratch`, where every node that `keep`
    marks leaves its state), its output row read with its query."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = offs_k < K_DIM, offs_v < V_DIM
    tile = offs_k[:, None] * V_DIM + offs_v[None, :]
    tile_ok = k_ok[:, None] & v_ok[None, :]
    root = tl.load(state_ptr + (row * HEADS + head) * K_DIM * V_DIM + tile, mask=tile_ok, other=0.0)
    s_kn, s_vn, s_gn = n * HEADS * K_DIM, n * HEADS * V_DIM, n * HEADS
    scratch = scratch_ptr + (row * n * HEADS + head) * K_DIM * V_DIM
    h = root
    held = -1  # the node whose state h holds
    for node in range(n):
        parent = tl.load(parents_ptr + row * n + node)
        if parent != held:
            if parent < 0:
                h = root
            else:
                tl.debug_barrier()  # the parent's tile was stored by other threads of this program
                h = tl.load(scratch + parent * HEADS * K_DIM * V_DIM + tile, mask=tile_ok, other=0.0)
        h = _delta_step(
            h, node, k_ptr, v_ptr, g_ptr, beta_ptr, row, head, offs_k, offs_v, k_ok, v_ok, s_kn, s_vn, s_gn,
            HEADS, K_DIM, V_DIM,
        )  # fmt: skip
        query = tl.load(q_ptr + row * s_kn + (node * HEADS + head) * K_DIM + offs_k, mask=k_ok, other=0.0)
        out = tl.sum(h * query[:, None], axis=0)
        tl.store(out_ptr + row * s_vn + (node * HEADS + head) * V_DIM + offs_v, out, mask=v_ok)
        if tl.load(keep_ptr + row * n + node) != 0:
            tl.store(scratch + node * HEADS * K_DIM * V_DIM + tile, h, mask=tile_ok)
        held = node


@_jit
def commit_delta_kernel(
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    g_ptr: tl.tensor,
    beta_ptr: tl.tensor,
    path_ptr: tl.tensor,
    advance_ptr: tl.tensor,
    state_ptr: tl.tensor,
    n: tl.tensor,
    p: tl.tensor,
    HEADS: tl.constexpr,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
) -> None:
    """One program per (request, head, block of value columns): the committed state advanced, in place, by
    the request's first `advance` nodes of its path."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = offs_k < K_DIM, offs_v < V_DIM
    tile = offs_k[:, None] * V_DIM + offs_v[None, :]
    tile_ok = k_ok[:, None] & v_ok[None, :]
    state = state_ptr + (row * HEADS + head) * K_DIM * V_DIM + tile
    h = tl.load(state, mask=tile_ok, other=0.0)
    s_kn, s_vn, s_gn = n * HEADS * K_DIM, n * HEADS * V_DIM, n * HEADS
    advance = tl.load(advance_ptr + row)
    for j in range(p):
        if j < advance:
            node = tl.load(path_ptr + row * p + j)
            h = _delta_step(
                h, node, k_ptr, v_ptr, g_ptr, beta_ptr, row, head, offs_k, offs_v, k_ok, v_ok, s_kn, s_vn, s_gn,
                HEADS, K_DIM, V_DIM,
            )  # fmt: skip
    tl.store(state, h, mask=tile_ok)
