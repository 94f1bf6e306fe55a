"""Token choice from logits without host syncs: argmax at T=0, a seeded inverse-CDF sample at T>0.

Each request has its own temperature and seed. A sample's uniform number is a hash of the request's seed,
its draw counter (one draw per decode step) and the node's index, so a request's tokens depend on nothing
else in the batch, the same draws come back on any device, and the whole thing runs inside a CUDA graph
with no generator state to carry.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def choose_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, draw: torch.Tensor, sampled: bool = True
) -> torch.Tensor:
    """Return `[batch, nodes]` token ids from `logits` `[batch, nodes, vocab]`.

    `temperature` `[batch]` float: 0 means greedy (argmax). `seed` and `draw` `[batch]` int64 key the uniform
    numbers of the requests that sample. With `sampled=False` every request is greedy and no sampling work
    is done.
    """
    greedy = logits.argmax(dim=-1)  # [batch, nodes]
    if not sampled:
        return greedy
    hot = temperature > 0  # [batch]
    scale = torch.where(hot, temperature, 1.0).float()[:, None, None]
    probs = torch.softmax(logits.float() / scale, dim=-1)  # [batch, nodes, vocab]
    cdf = probs.cumsum(dim=-1)
    u = counter_uniform(seed, draw, logits.shape[1])  # [batch, nodes]
    # The first token whose cumulative probability exceeds u * total: zero-probability tokens are never chosen.
    index = torch.searchsorted(cdf, (u * cdf[..., -1])[..., None], right=True).squeeze(-1)
    drawn = index.clamp(max=logits.shape[-1] - 1)
    return torch.where(hot[:, None], drawn, greedy)


def counter_uniform(seed: torch.Tensor, draw: torch.Tensor, nodes: int) -> torch.Tensor:
    """`[batch, nodes]` float32 numbers in (0, 1), a hash of (seed, draw, node): stateless and batch-free."""
    key = _mix32(_mix32(seed & _MASK32) ^ ((seed >> 32) & _MASK32))  # [batch]
    key = _mix32(key ^ (draw & _MASK32))
    node = torch.arange(nodes, device=seed.device, dtype=torch.int64)  # [nodes]
    bits = _mix32(key[:, None] ^ _mix32(node + 0x9E3779B9)[None, :])  # [batch, nodes]
    return (((bits >> 8).double() + 0.5) / float(1 << 24)).float()


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """`(x * c) mod 2**32` without int64 overflow: c is split into 16-bit halves."""
    low, high = c & 0xFFFF, c >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32
