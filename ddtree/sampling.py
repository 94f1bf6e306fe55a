"""Token choice from logits without host syncs: argmax at T=0, a seeded inverse-CDF sample at T>0.

Each request has its own temperature, seed, top-p and top-k. A sample's uniform number is a hash of the
request's seed, its draw counter (one draw per decode step) and the node's index, so a request's tokens depend
on nothing else in the batch, the same draws come back on any device, and the whole thing runs inside a CUDA
graph with no generator state to carry.

Top-k and top-p (nucleus) filter the temperature-scaled distribution of the rows that sample, as vLLM does:
top-k keeps the k most probable tokens, then top-p keeps the smallest set of those whose probability (within
them) reaches p, at least one token. The cut falls on a probability value, so tokens tied with the least one
kept are kept too: the set depends on the values alone, never on the order a sort leaves ties in. Greedy rows
(T = 0) take the argmax, unfiltered (the argmax survives every filter anyway).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_MASK32 = 0xFFFFFFFF


def choose_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    draw: torch.Tensor,
    sampled: bool = True,
    top_p: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return `[batch, nodes]` token ids from `logits` `[batch, nodes, vocab]`.

    `temperature` `[batch]` float: 0 means greedy (argmax). `seed` and `draw` `[batch]` int64 key the uniform
    numbers of the requests that sample. With `sampled=False` every request is greedy and no sampling work
    is done. `top_p` `[batch]` float in (0, 1] (1: off) and `top_k` `[batch]` int64 (0: off) filter the rows
    that sample; None leaves that filter out for every row, so a batch in which no row filters does no
    filtering work (the caller knows that at launch).
    """
    greedy = logits.argmax(dim=-1)  # [batch, nodes]
    if not sampled:
        return greedy
    hot = temperature > 0  # [batch]
    scale = torch.where(hot, temperature, 1.0).float()[:, None, None]
    probs = torch.softmax(logits.float() / scale, dim=-1)  # [batch, nodes, vocab]
    if top_p is not None or top_k is not None:
        probs = torch.where(keep_mask(probs, top_p, top_k), probs, 0.0)  # [batch, nodes, vocab], not renormalised
    cdf = probs.cumsum(dim=-1)
    u = counter_uniform(seed, draw, logits.shape[1])  # [batch, nodes]
    # The first token whose cumulative probability exceeds u * total: zero-probability tokens are never chosen.
    index = torch.searchsorted(cdf, (u * cdf[..., -1])[..., None], right=True).squeeze(-1)
    drawn = index.clamp(max=logits.shape[-1] - 1)
    return torch.where(hot[:, None], drawn, greedy)


def keep_mask(probs: torch.Tensor, top_p: torch.Tensor | None, top_k: torch.Tensor | None) -> torch.Tensor:
    """`[batch, nodes, vocab]` bool: the tokens that top-k (`[batch]` int64, 0: off), then top-p (`[batch]`
    float, 1: off) keep of `probs` `[batch, nodes, vocab]`. Ties with the least probability kept are kept.

    Kept in rank order, the set is a prefix of the tokens sorted by probability; its last probability is the
    floor, and every token at or above the floor is kept. Static shapes, no host reads.
    """
    vocab = probs.shape[-1]
    ranked = probs.sort(dim=-1, descending=True).values  # [batch, nodes, vocab]
    keep = torch.ones_like(ranked, dtype=torch.bool)  # [batch, nodes, vocab], in rank order
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [batch]
        kth = ranked.gather(-1, (k - 1)[:, None, None].expand(*ranked.shape[:2], 1))  # [batch, nodes, 1]
        keep = ranked >= kth
    if top_p is not None:
        mass = torch.where(keep, ranked, 0.0)  # [batch, nodes, vocab] what top-k left
        cum = mass.cumsum(dim=-1)
        before = F.pad(cum[..., :-1], (1, 0))  # [batch, nodes, vocab] the mass ranked above each token
        p = top_p.float()[:, None, None]  # [batch, 1, 1]
        keep = keep & ((before < p * cum[..., -1:]) | (p >= 1))  # the first token always: 0 < p * total
    kept = keep.sum(dim=-1, keepdim=True)  # [batch, nodes, 1] >= 1
    floor = ranked.gather(-1, kept - 1)  # [batch, nodes, 1] the least probability kept
    return probs >= floor


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
