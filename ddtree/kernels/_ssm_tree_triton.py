"""The Triton kernels of `ddtree.kernels.ssm_tree`, which explains them and launches them.

Imported lazily, on the first call (the core install may lack triton).
"""

from __future__ import annotations

import triton.language as tl

from ddtree.kernels._jit import jit as _jit


@_jit
def _ssm_step(
    h: tl.tensor,
    node: tl.tensor,
    x_ptr: tl.tensor,
    b_ptr: tl.tensor,
    dt_ptr: tl.tensor,
    a: tl.tensor,
    row: tl.tensor,
    head: tl.tensor,
    offs_p: tl.tensor,
    offs_s: tl.tensor,
    p_ok: tl.tensor,
    s_ok: tl.tensor,
    n: tl.tensor,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STATE: tl.constexpr,
) -> tl.tensor:
    """`ddtree.models.mamba2.ssm_step` of one node on the state tile h [BLOCK_P, BLOCK_S]: decayed by
    exp(dt * a) (computed in float32, as the torch step does), plus dt * x (outer) B, in h's dtype. Inputs are
    contiguous: x [batch, n, HEADS, HEAD_DIM], b [batch, n, HEADS, STATE], dt [batch, n, HEADS]."""
    base = (row * n + node) * HEADS + head
    x = tl.load(x_ptr + base * HEAD_DIM + offs_p, mask=p_ok, other=0.0).to(h.dtype)
    b = tl.load(b_ptr + base * STATE + offs_s, mask=s_ok, other=0.0).to(h.dtype)
    dt = tl.load(dt_ptr + base)
    decay = tl.exp(dt.to(tl.float32) * a).to(h.dtype)
    return h * decay + (dt.to(h.dtype) * x)[:, None] * b[None, :]


@_jit
def tree_ssm_kernel(
    x_ptr: tl.tensor,
    b_ptr: tl.tensor,
    c_ptr: tl.tensor,
    dt_ptr: tl.tensor,
    a_ptr: tl.tensor,
    d_ptr: tl.tensor,
    parents_ptr: tl.tensor,
    keep_ptr: tl.tensor,
    state_ptr: tl.tensor,
    out_ptr: tl.tensor,
    scratch_ptr: tl.tensor,
    n: tl.tensor,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STATE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_S: tl.constexpr,
) -> None:
    """One program per (request, head, block of head_dim rows): the nodes in order, each from its parent's
    state (in registers when the parent is the node before, else from `scratch`, where every node that `keep`
    marks leaves its state), its output read along its C plus the skip D times its x."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_s = tl.arange(0, BLOCK_S)
    p_ok, s_ok = offs_p < HEAD_DIM, offs_s < STATE
    tile = offs_p[:, None] * STATE + offs_s[None, :]
    tile_ok = p_ok[:, None] & s_ok[None, :]
    size = HEAD_DIM * STATE
    root = tl.load(state_ptr + (row * HEADS + head) * size + tile, mask=tile_ok, other=0.0)
    a = tl.load(a_ptr + head)
    skip = tl.load(d_ptr + head).to(root.dtype)
    scratch = scratch_ptr + (row * n * HEADS + head) * size
    h = root
    held = -1  # the node whose state h holds
    for node in range(n):
        parent = tl.load(parents_ptr + row * n + node)
        if parent != held:
            if parent < 0:
                h = root
            else:
                tl.debug_barrier()  # the parent's tile was stored by other threads of this program
                h = tl.load(scratch + parent * HEADS * size + tile, mask=tile_ok, other=0.0)
        h = _ssm_step(
            h, node, x_ptr, b_ptr, dt_ptr, a, row, head, offs_p, offs_s, p_ok, s_ok, n, HEADS, HEAD_DIM, STATE
        )  # fmt: skip
        base = (row * n + node) * HEADS + head
        c = tl.load(c_ptr + base * STATE + offs_s, mask=s_ok, other=0.0).to(h.dtype)
        x = tl.load(x_ptr + base * HEAD_DIM + offs_p, mask=p_ok, other=0.0).to(h.dtype)
        out = tl.sum(h * c[None, :], axis=1) + skip * x
        tl.store(out_ptr + base * HEAD_DIM + offs_p, out, mask=p_ok)
        if tl.load(keep_ptr + row * n + node) != 0:
            tl.store(scratch + node * HEADS * size + tile, h, mask=tile_ok)
        held = node


@_jit
def commit_ssm_kernel(
    x_ptr: tl.tensor,
    b_ptr: tl.tensor,
    dt_ptr: tl.tensor,
    a_ptr: tl.tensor,
    path_ptr: tl.tensor,
    advance_ptr: tl.tensor,
    state_ptr: tl.tensor,
    n: tl.tensor,
    p: tl.tensor,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STATE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_S: tl.constexpr,
) -> None:
    """One program per (request, head, block of head_dim rows): the committed state advanced, in place, by
    the request's first `advance` nodes of its path."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_s = tl.arange(0, BLOCK_S)
    p_ok, s_ok = offs_p < HEAD_DIM, offs_s < STATE
    tile = offs_p[:, None] * STATE + offs_s[None, :]
    tile_ok = p_ok[:, None] & s_ok[None, :]
    state = state_ptr + (row * HEADS + head) * HEAD_DIM * STATE + tile
    h = tl.load(state, mask=tile_ok, other=0.0)
    a = tl.load(a_ptr + head)
    advance = tl.load(advance_ptr + row)
    for j in range(p):
        if j < advance:
            node = tl.load(path_ptr + row * p + j)
            h = _ssm_step(
                h, node, x_ptr, b_ptr, dt_ptr, a, row, head, offs_p, offs_s, p_ok, s_ok, n, HEADS, HEAD_DIM, STATE
            )  # fmt: skip
    tl.store(state, h, mask=tile_ok)
