"""Attention of a tree (or a prompt) over a preallocated KV cache, without a materialised mask.

`tree_attention(q, keys, values, lengths, visible, scale)` gives what `F.scaled_dot_product_attention` gives
with the mask of `ddtree.models.target.tree_attention_mask`: request b's query i sees the committed slots
`0..lengths[b]-1` and the slots `lengths[b] + j` of this forward's tokens with `visible[b, i, j]`.

The dense path builds a `[batch, 1, n, key_span]` boolean mask per forward, and the fused attention kernels
that take an arbitrary mask are the slow ones (on an H200, at batch 64 with a 17-node tree, cuDNN's took 8x
the time of decoding's attention). Here one Triton program per (request, KV head, block of query rows) runs a
flash-attention loop in two phases: the committed prefix, up to the request's own length (no mask; no key
past it is read, so short requests cost less than long ones), then the n tree slots, masked by `visible`
rows loaded as they are needed. A program's rows are (node, query head) pairs of one KV head, so grouped
query heads share each key load. Softmax is online, in float32, in base 2; float32 inputs use IEEE dots
(no TF32), so float32 results agree with the dense path to rounding.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

from ddtree.kernels import ATTENTION_CHOICES

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK_M = 64  # query rows (node, head pairs) per program
_BLOCK_N = 64  # keys per loop step
_WIDE_ROW_BYTES = 512  # rows this wide (head size 256 in bfloat16, 128 in float32) get blocks of 32


def block_sizes(block_d: int, element_size: int) -> tuple[int, int]:
    """(query rows, keys) per block for rows of `block_d` elements of `element_size` bytes. The q, key and value
    tiles live in shared memory (227 KiB per block on Hopper): 64 x 64 tiles of 256 bfloat16 need 232 KiB, of
    256 float32 336 KiB (measured on the H200)."""
    if block_d * element_size >= _WIDE_ROW_BYTES:
        return _BLOCK_M // 2, _BLOCK_N // 2
    return _BLOCK_M, _BLOCK_N


def triton_attention_available(device: torch.device) -> bool:
    """Whether the kernel can run for tensors on `device`: triton importable, and CUDA or TRITON_INTERPRET=1."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "") == "1")


def resolve_attention(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto` -> `triton` for a supported dtype on a CUDA device where triton imports, else `sdpa`; other
    choices are checked."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"unknown attention {choice!r}; choose one of {', '.join(ATTENTION_CHOICES)}")
    if choice == "auto":
        usable = device.type == "cuda" and dtype in KERNEL_DTYPES and triton_attention_available(device)
        return "triton" if usable else "sdpa"
    if choice == "triton" and not triton_attention_available(device):
        raise ValueError(f"the triton attention needs triton and a CUDA device (or TRITON_INTERPRET=1), not {device}")
    if choice == "triton" and dtype not in KERNEL_DTYPES:
        raise ValueError(f"the triton attention takes float32, bfloat16 or float16, not {dtype}")
    return choice


def _kernels() -> ModuleType:
    return importlib.import_module("ddtree.kernels._tree_attention_triton")


def tree_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    visible: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention output `[batch, heads, n, head_dim]` (a view of a `[batch, n, heads, head_dim]` buffer).

    q `[batch, heads, n, head_dim]`; keys, values `[batch, kv_heads, capacity, head_dim]` (the whole cache
    layer, with this forward's tokens already written at `lengths + j`); lengths `[batch]` committed slots;
    visible `[batch, n, n]` bool. heads must be a multiple of kv_heads, and `lengths + n <= capacity`.
    """
    batch, heads, n, dim = q.shape
    kv_heads = keys.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads")
    for name, t in (("q", q), ("keys", keys), ("values", values)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension, got strides {t.stride()}")
    group = heads // kv_heads
    out = torch.empty((batch, n, heads, dim), dtype=q.dtype, device=q.device).transpose(1, 2)
    mask = visible.contiguous().view(torch.uint8)  # [batch, n, n]
    block_d = max(16, 1 << (dim - 1).bit_length())
    block_m, block_n = block_sizes(block_d, q.element_size())
    grid = (batch, kv_heads, -(-n * group // block_m))
    _kernels().tree_attention_kernel[grid](
        q,
        keys,
        values,
        out,
        lengths,
        mask,
        n,
        float(dim**-0.5 if scale is None else scale),
        *q.stride()[:3],
        *keys.stride()[:3],
        *values.stride()[:3],
        *out.stride()[:3],
        *mask.stride()[:2],
        GROUP=group,
        HEAD_DIM=dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32,
    )
    return out
