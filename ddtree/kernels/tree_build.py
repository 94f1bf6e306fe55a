"""The draft tree of `ddtree.tree.build_tree`, built by three Triton kernels instead of a dozen torch ops.

`build_tree_fused(draft_logits, budget, topk)` returns the same `DraftTree` as `build_tree`, the exact torch
reference. With K = min(topk, budget) (ranks past `budget` can never be chosen, since the first `budget` tokens
of a depth all beat them), it runs:

1. `vocab_partial_kernel`, grid (batch * depth, vocab chunks): each program loads its chunk of logits once
   (CHUNK of them, in registers), takes the chunk max and sum of exp(logit - max) (the split-K half of an online
   logsumexp), and selects the chunk's K largest logits exactly: a bitwise binary search for the K-th largest
   order-preserving uint32 key (about 20 count-and-reduce rounds on float32 data: it stops once exactly K keys
   are above the threshold; 16-bit logits search only their high bits), then a prefix-sum compaction. The
   vocabulary is read once, and no kernel sorts it.
2. `vocab_merge_kernel`, grid (batch * depth): merges the partials into logsumexp, turns the candidates into
   log-probs exactly as torch's CUDA log_softmax does, `(logit - max) - log(sum)`, and keeps the top K by
   (log-prob descending, vocab id ascending): top_lp [batch, depth, K] float32, top_ids [batch, depth, K] int64.
3. `beam_tree_kernel`, grid (batch): the depth-wise beam and the tree. Level d's candidates are level d-1's
   slots i (sorted) plus depth d's tokens j (sorted); (i, j) is beaten by every (i', j') <= (i, j), so only the
   pairs with (i+1)(j+1) <= budget can be in the top `budget` (about budget * ln(budget) of them: 1.5k instead of
   65k at budget 256). A threshold search keeps the best `budget`, a bitonic sort of those orders the new level.
   Then the global top `budget` over all levels (same selection), node numbering and parent lookup.

Steps 1 and 2 have an alternative, `vocab_row_kernel` (`_VOCAB_ROWS`; the default for 16-bit logits), one
program per row that reads it twice: first the online logsumexp and the maximum of every stretch of
`_ROW_GROUP` logits; the k-th largest of those maxima is a floor under the row's k-th largest logit (k stretches
reach it), so the logits at or above it (1.5 to 2.5 times k on the default drafter's rows at k = 16 to 256, at
most 793 for k = 256; 1.2 times k on random rows) are the only candidates, compacted in vocab id order and
selected as in step 2. A row with more than `_ROW_CAP` candidates (near-flat logits) finds its exact k-th
largest logit by a bitwise search over the whole row instead. The same top k, with the threshold search over a
few hundred candidates, not the vocabulary.

Steps 2 and 3 select as step 1 does, then sort the survivors (`_BITONIC_MERGE` / `_BITONIC_BEAM` switch them to
one tl.topk over all candidates instead). `_RADIX_BITS_VOCAB` / `_MERGE` / `_BEAM` set the bits each round of a
threshold search decides: 1, the binary search; 4, a radix search counting 16 thresholds in one reduction, 8
rounds instead of up to 32 (fewer serial block reductions, more work in each; the same selection). Every
selection orders by (value descending, position ascending), positions being the vocab id, the flat candidate
index i * k + j of the beam step, and depth-major (depth, slot) of the global step; the last one is the
reference's stable sort, so a parent precedes an equally probable child.

Ties. Without ties the tree equals the torch path's exactly (tokens, parents, depths, num_nodes; log_probs
agree to float32 rounding: the vocab logsumexp is summed in a different order, so its last bit can differ).
Among equal log-probs the fused path always prefers the smaller vocab id, then the smaller flat beam index,
then the shallower depth and smaller slot. torch.topk promises no order among ties (on an H200 it gave ties in
index order for k >= 100 but not for k <= 32), so on tied inputs (bfloat16 logits tie often) the two trees may
list equally probable prefixes in another order, or pick another of several equal prefixes at the `budget`
boundary; the fused tree is still a set of `budget` most probable prefixes, parents before children. One more
case can differ from the reference: distinct logits that round to the same log-prob, straddling the K-th place
of one vocabulary chunk (the chunk ranks them by logit, the reference by vocab id), which takes two logits
within a float32 ulp of the log-prob at that boundary. NaN logits are not supported.

Limits: blocks of at most 16384 entries (budget 1024 at depth 16, budget 256 at depth 64, vocab chunks of up to
16384); `build_tree_fused` falls back to `build_tree` beyond them and for empty inputs. The pair table of the
beam is built on the host once per (budget, K, device) and cached, so call once before CUDA graph capture.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from types import ModuleType

import torch

from ddtree.tree import DraftTree, Transition, build_tree, tree_shape

MAX_BLOCK = 16384  # entries of the largest block one program holds in registers
_CHUNK = 4096  # preferred vocab chunk per program in the first kernel
_BITONIC_MERGE = False  # vocab merge: one tl.topk (True) or a threshold search + compaction + sort (False)
_BITONIC_BEAM = False  # beam and global selection: likewise
# Bits a round of the threshold searches (1: binary search; 4: 16 thresholds counted per reduction, 8 rounds
# instead of up to 32). Timed on the H200 (`benchmarks/tree_build_device.py --knobs`): 4 bits made the vocab
# pass 2.7x slower and the merge no faster at k=256, and made the beam 1.7x faster at budget 64 (batch 1) and
# 2.5x at budget 32 (batch 32) but 1.2x slower at budget 256. None: the beam picks by budget (`_beam_radix`).
_RADIX_BITS_VOCAB = 1
_RADIX_BITS_MERGE = 1
_RADIX_BITS_BEAM: int | None = None
_RADIX_BEAM_MAX_BUDGET = 64  # the beam's radix search up to this (padded) budget, the binary one beyond
_LOW_BITS = {torch.bfloat16: 16, torch.float16: 13}  # constant low bits of float32 keys of 16-bit logits
# The vocab stage as one program per row (`vocab_row_kernel`: two passes over the row, a floor from the maxima
# of stretches of _ROW_GROUP logits, candidates at or above it) instead of the partial and merge kernels: True,
# False, or None for 16-bit logits only. On the H200 (`benchmarks/tree_build_device.py --knobs`, batch 32, depth 15)
# bfloat16 rows took 226 us against 265 at k = 256 and the same at k = 32; float32 rows took 251 against 214 at
# k = 32. The whole step at batch 64, B = 16 (bfloat16) fell from 3.49 to 3.31 ms.
_VOCAB_ROWS: bool | None = None
_ROW_TILE = 2048  # logits a loop step of the row kernel loads
_ROW_GROUP = 64  # logits per stretch whose maximum samples the floor
_ROW_CAP = 2048  # candidates a row holds at most (at least 4 * K_PAD); past it the row takes the exact slow path


def triton_available() -> bool:
    """Whether the fused path can run here: triton importable, and a CUDA device or TRITON_INTERPRET=1."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "") == "1"


def default_tree_kernel(device: torch.device) -> str:
    """What the tree kernel `auto` stands for: `triton` on a CUDA device where triton imports, else `torch`."""
    return "triton" if device.type == "cuda" and triton_available() else "torch"


def _kernels() -> ModuleType:
    """The Triton kernels, imported on first use (the core install may lack triton)."""
    return importlib.import_module("ddtree.kernels._tree_build_triton")


def _interpreting() -> bool:
    """Whether the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 when first imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_kernels().vocab_partial_kernel, InterpretedFunction)


def _pow2(n: int) -> int:
    """The power of two >= n, at least 2 (tl.topk cannot return a single entry)."""
    return max(2, 1 << max(0, n - 1).bit_length())


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _chunk_plan(vocab: int, k_pad: int) -> tuple[int, int]:
    """(CHUNK, number of chunks) for the vocab pass: a chunk holds at least k_pad entries, the merge at most
    MAX_BLOCK candidates."""
    chunk = max(k_pad, min(_CHUNK, _pow2(vocab)))
    while _pow2(-(-vocab // chunk)) * k_pad > MAX_BLOCK and chunk < MAX_BLOCK:
        chunk *= 2
    return chunk, -(-vocab // chunk)


@functools.lru_cache(maxsize=64)
def _pair_table(budget: int, k: int, device: str) -> torch.Tensor:
    """[2, M_PAD] int32: the beam pairs (slot i, token rank j) with (i+1)(j+1) <= budget, j < k, ordered by
    i * k + j; padding has i = -1."""
    pairs = [(i, j) for i in range(budget) for j in range(min(k, budget // (i + 1)))]
    table = torch.zeros((2, _pow2(len(pairs))), dtype=torch.int32)  # [2, M_PAD]
    table[0].fill_(-1)
    table[:, : len(pairs)] = torch.tensor(pairs, dtype=torch.int32).T
    return table.to(device)


@functools.lru_cache(maxsize=256)
def _pair_count(budget: int, k: int) -> int:
    """Rows of `_pair_table(budget, k, ...)` before padding."""
    return sum(min(k, budget // (i + 1)) for i in range(budget))


def fused_supported(depth: int, vocab: int, budget: int, k: int) -> bool:
    """Whether the kernels' blocks fit (else `build_tree_fused` uses `build_tree`); k is the effective topk."""
    k_eff = min(k, budget)
    chunk, n_split = _chunk_plan(vocab, _pow2(k_eff))
    m_pad = _pow2(_pair_count(budget, k_eff))
    return max(chunk, _pow2(n_split) * _pow2(k_eff), m_pad, _pow2(depth) * _pow2(budget)) <= MAX_BLOCK


def vocab_topk(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-depth log_softmax + top-k in one read of the logits ([batch, depth, vocab], 1 <= k <= vocab).

    Returns top_lp [batch, depth, k] float32 and top_ids [batch, depth, k] int64, sorted by log-prob
    descending, smaller vocab id first among equal log-probs.
    """
    batch, depth, vocab = draft_logits.shape
    logits = draft_logits.contiguous()  # [batch, depth, vocab]
    if _VOCAB_ROWS or (_VOCAB_ROWS is None and logits.dtype in _LOW_BITS):
        return _vocab_topk_rows(logits, k)
    device = logits.device
    rows, k_pad = batch * depth, _pow2(k)
    chunk, n_split = _chunk_plan(vocab, k_pad)
    kern, accurate = _kernels(), not _interpreting()
    part_key = torch.empty((rows, n_split, k_pad), dtype=torch.int64, device=device)  # [rows, split, K_PAD]
    part_max = torch.empty((rows, n_split), dtype=torch.float32, device=device)  # [rows, split]
    part_sum = torch.empty((rows, n_split), dtype=torch.float32, device=device)  # [rows, split]
    scratch = torch.empty((rows, k_pad), dtype=torch.int64, device=device)  # [rows, K_PAD]
    top_lp = torch.empty((batch, depth, k), dtype=torch.float32, device=device)  # [batch, depth, k]
    top_ids = torch.empty((batch, depth, k), dtype=torch.int64, device=device)  # [batch, depth, k]
    kern.vocab_partial_kernel[(rows, n_split)](
        logits, part_key, part_max, part_sum, vocab, k, n_split,
        CHUNK=chunk, K_PAD=k_pad, LOW_BITS=_LOW_BITS.get(logits.dtype, 0), ACCURATE=accurate,
        RADIX_BITS=_RADIX_BITS_VOCAB, num_warps=_warps(chunk),
    )  # fmt: skip
    kern.vocab_merge_kernel[(rows,)](
        part_key, part_max, part_sum, scratch, top_lp, top_ids, vocab, k, n_split,
        S_PAD=_pow2(n_split), K_PAD=k_pad, ACCURATE=accurate, BITONIC=_BITONIC_MERGE,
        RADIX_BITS=_RADIX_BITS_MERGE, num_warps=_warps(_pow2(n_split) * k_pad),
    )  # fmt: skip
    return top_lp, top_ids


def _row_plan(vocab: int, k_pad: int) -> tuple[int, int, int, int]:
    """(TILE, GROUP, S_PAD, CAP) of the row kernel: at least k_pad stretches (so the floor exists), at most
    MAX_BLOCK of them and of the candidates."""
    group = min(_ROW_GROUP, _pow2(vocab))
    while group > 1 and -(-vocab // group) < k_pad:
        group //= 2
    while _pow2(-(-vocab // group)) > MAX_BLOCK:
        group *= 2
    tile = max(_ROW_TILE, group)
    return tile, group, _pow2(-(-vocab // group)), min(MAX_BLOCK, max(_ROW_CAP, 4 * k_pad))


def _vocab_topk_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`vocab_topk` by `vocab_row_kernel`, one program per (batch, depth) row."""
    batch, depth, vocab = logits.shape
    device, rows, k_pad = logits.device, batch * depth, _pow2(k)
    tile, group, s_pad, cap = _row_plan(vocab, k_pad)
    maxima = torch.empty((rows, s_pad), dtype=torch.float32, device=device)  # [rows, S_PAD]
    cand = torch.empty((rows, cap), dtype=torch.int64, device=device)  # [rows, CAP]
    scratch = torch.empty((rows, k_pad), dtype=torch.int64, device=device)  # [rows, K_PAD]
    top_lp = torch.empty((batch, depth, k), dtype=torch.float32, device=device)  # [batch, depth, k]
    top_ids = torch.empty((batch, depth, k), dtype=torch.int64, device=device)  # [batch, depth, k]
    _kernels().vocab_row_kernel[(rows,)](
        logits, maxima, cand, scratch, top_lp, top_ids, vocab, k,
        TILE=tile, GROUP=group, S_PAD=s_pad, CAP=cap, K_PAD=k_pad, ACCURATE=not _interpreting(),
        RADIX_BITS=_RADIX_BITS_MERGE, num_warps=_warps(max(tile, cap)),
    )  # fmt: skip
    return top_lp, top_ids


def beam_tree(top_lp: torch.Tensor, top_ids: torch.Tensor, budget: int) -> DraftTree:
    """The tree of the `budget` most probable prefixes from per-depth top-k lists ([batch, depth, k], each row
    sorted descending, k <= budget), as `build_tree` builds it from the same lists."""
    batch, depth, k = top_lp.shape
    device = top_lp.device
    pairs = _pair_table(budget, k, str(device))  # [2, M_PAD]
    b_pad = _pow2(budget)
    n_pad = _pow2(depth) * b_pad
    lvl_lp = torch.empty((batch, n_pad), dtype=torch.float32, device=device)  # [batch, depth_pad * B_PAD]
    lvl_tok = torch.empty((batch, n_pad), dtype=torch.int64, device=device)
    lvl_par = torch.empty((batch, n_pad), dtype=torch.int32, device=device)
    node_of = torch.empty((batch, n_pad), dtype=torch.int32, device=device)
    keys = torch.empty((batch, b_pad), dtype=torch.int64, device=device)  # [batch, B_PAD]
    tokens = torch.empty((batch, 1 + budget), dtype=torch.int64, device=device)  # [batch, 1+budget]
    parents = torch.empty_like(tokens)
    depths = torch.empty_like(tokens)
    log_probs = torch.empty((batch, 1 + budget), dtype=torch.float32, device=device)
    num_nodes = torch.empty((batch,), dtype=torch.int64, device=device)  # [batch]
    _kernels().beam_tree_kernel[(batch,)](
        top_lp.contiguous(), top_ids.contiguous(), pairs, lvl_lp, lvl_tok, lvl_par, node_of, keys,
        tokens, parents, depths, log_probs, num_nodes, budget, k,
        DEPTH=depth, M_PAD=pairs.shape[1], B_PAD=b_pad, N_PAD=n_pad, BITONIC=_BITONIC_BEAM,
        RADIX_BITS=_beam_radix(b_pad), num_warps=_warps(max(n_pad, pairs.shape[1])),
    )  # fmt: skip
    return DraftTree(tokens=tokens, parents=parents, depths=depths, log_probs=log_probs, num_nodes=num_nodes)


def _beam_radix(b_pad: int) -> int:
    """Bits a round of the beam's threshold searches for a padded budget."""
    if _RADIX_BITS_BEAM is not None:
        return _RADIX_BITS_BEAM
    return 4 if b_pad <= _RADIX_BEAM_MAX_BUDGET else 1


def build_tree_fused(
    draft_logits: torch.Tensor, budget: int, topk: int | None = None, transition: Transition | None = None
) -> DraftTree:
    """`build_tree` on Triton kernels: the same tree for `draft_logits` [batch, depth, vocab] (see the module
    docstring for ties). Needs `triton_available()`; sizes past the kernels' limits, and a conditioned tree
    (a `transition`: no fused kernel yet), use `build_tree`."""
    batch, depth, vocab, k = tree_shape(draft_logits, budget, topk)
    if not triton_available():
        raise RuntimeError("build_tree_fused needs triton and a CUDA device (or TRITON_INTERPRET=1)")
    k = min(k, budget)  # ranks past `budget` are never chosen
    if batch * depth == 0 or not fused_supported(depth, vocab, budget, k) or transition is not None:
        return build_tree(draft_logits, budget, topk, transition)
    if draft_logits.device.type != "cuda" and not _interpreting():
        raise RuntimeError(f"build_tree_fused needs CUDA tensors outside the interpreter, got {draft_logits.device}")
    with torch.cuda.device(draft_logits.device) if draft_logits.is_cuda else contextlib.nullcontext():
        top_lp, top_ids = vocab_topk(draft_logits, k)
        return beam_tree(top_lp, top_ids, budget)
