"""One DDTree verify step in the shapes SGLang's speculative workers use. Pure torch: no SGLang import.

Glossary (SGLang's words on the left)
- block: the DFlash drafter's window `[bonus, mask x (block-1)]`; depth L = block - 1 drafted positions.
- draft_token_num N: the tree's width, root included (1 + budget). The verify forward runs N tokens per request.
- FULL mask: SGLang's custom attention mask for TARGET_VERIFY, bool, True = may attend. Per request a
  row-major `[N, prefix + N]` block (every node sees the whole prefix, then its ancestors and itself); the
  requests' blocks are concatenated flat.
- retrieve_next_token / retrieve_next_sibling: the tree as linked lists (first child, next sibling; -1 for
  none), the layout SGLang's tree kernels walk.
- commit: what the scheduler takes per request: `[d1..d_acc, bonus]` in a row of `stride` slots, and its
  length `acc + 1`.

The accept walk is `ddtree.accept.accept`, the same one our engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.accept import AcceptResult, accept
from ddtree.tree import DraftTree, ancestor_mask, build_tree


@dataclass(frozen=True)
class TreeVerify:
    """What the target verifies this step, per request."""

    tree: DraftTree
    tokens: torch.Tensor  # [bs, N] int64; the root is the bonus, padding repeats it
    positions: torch.Tensor  # [bs, N] int64; prefix + depth
    ancestors: torch.Tensor  # [bs, N, N] bool; (i, j): node j is node i or one of its ancestors
    next_token: torch.Tensor  # [bs, N] int64; first child, -1 for a leaf
    next_sibling: torch.Tensor  # [bs, N] int64; next sibling, -1 for the last one

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])


@dataclass(frozen=True)
class Commit:
    """What the scheduler receives for one step."""

    out_tokens: torch.Tensor  # [bs, stride] int64; accepted drafts then the bonus, zero padded
    commit_lens: torch.Tensor  # [bs] int32; accepted drafts + 1
    bonus: torch.Tensor  # [bs] int64
    path: torch.Tensor  # [bs, N] node indices from the root, the last one repeated


def draft_tree(draft_logits: torch.Tensor, budget: int, topk: int | None) -> DraftTree:
    """The tree of the `budget` most probable prefixes of `draft_logits` `[bs, depth, vocab]`."""
    return build_tree(draft_logits, budget, topk)


def tree_verify(tree: DraftTree, bonus: torch.Tensor, prefix_lens: torch.Tensor) -> TreeVerify:
    """The verify inputs for `tree` rooted at `bonus` `[bs]`, after `prefix_lens` `[bs]` committed tokens."""
    tokens = torch.where(tree.valid, tree.tokens, bonus[:, None])  # [bs, N]
    tokens[:, 0] = bonus
    positions = prefix_lens.to(torch.int64)[:, None] + tree.depths  # [bs, N]
    next_token, next_sibling = tree_links(tree.parents)
    return TreeVerify(tree, tokens, positions, ancestor_mask(tree), next_token, next_sibling)


def tree_links(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First child and next sibling of every node (-1 where none) from `parents` `[bs, N]` (-1: root, padding).

    Node indices grow with depth and, among siblings, with rank, so the first child is the child of smallest
    index and the next sibling is the next larger index with the same parent.
    """
    _, n = parents.shape
    idx = torch.arange(n, device=parents.device)
    none = torch.full((), n, device=parents.device, dtype=torch.long)
    # is_child[b, i, j]: node j's parent is node i
    is_child = parents[:, None, :] == idx[None, :, None]
    first = torch.where(is_child, idx[None, None, :], none).min(dim=-1).values  # [bs, N]
    # later_sibling[b, i, j]: j > i, same real parent
    same = (parents[:, :, None] == parents[:, None, :]) & (parents[:, :, None] >= 0)
    later = same & (idx[None, None, :] > idx[None, :, None])
    sibling = torch.where(later, idx[None, None, :], none).min(dim=-1).values  # [bs, N]
    return torch.where(first == n, -1, first), torch.where(sibling == n, -1, sibling)


def full_mask(ancestors: torch.Tensor, prefix_lens: list[int]) -> torch.Tensor:
    """SGLang's FULL custom mask, flat bool: per request `[N, prefix + N]` (prefix all True, then ancestors)."""
    n = ancestors.shape[1]
    rows = []
    for b, prefix in enumerate(prefix_lens):
        seen = torch.ones((n, prefix), dtype=torch.bool, device=ancestors.device)
        rows.append(torch.cat([seen, ancestors[b]], dim=1).reshape(-1))
    return torch.cat(rows) if rows else torch.zeros((0,), dtype=torch.bool, device=ancestors.device)


def accept_tree(verify: TreeVerify, target_tokens: torch.Tensor) -> AcceptResult:
    """Walk the target's tokens `[bs, N]` down the tree (`ddtree.accept.accept`)."""
    return accept(verify.tree, verify.ancestors, target_tokens, verify.tokens[:, 0])


def commit(result: AcceptResult, stride: int) -> Commit:
    """The accepted drafts and the bonus in rows of `stride` slots (stride > the longest path's depth)."""
    bs = result.path.shape[0]
    drafts = result.path_tokens[:, 1:stride]  # [bs, <= stride-1], the root excluded
    out = torch.zeros((bs, stride), dtype=torch.long, device=result.path.device)
    out[:, : drafts.shape[1]] = drafts
    out.scatter_(1, result.accepted[:, None], result.bonus[:, None])
    return Commit(out, (result.accepted + 1).to(torch.int32), result.bonus, result.path)


def path_columns(path: torch.Tensor, width: int) -> torch.Tensor:
    """`path` `[bs, N]` cut or padded (with its last node) to `width` columns."""
    if path.shape[1] >= width:
        return path[:, :width]
    pad = path[:, -1:].expand(-1, width - path.shape[1])
    return torch.cat([path, pad], dim=1)


def kv_moves(window: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(target, source) KV slots that put the accepted path at the front of each request's window.

    `window` `[bs, N]` holds the slots the verify wrote, node i at column i; the node at depth d of the path
    (d <= `accepted` `[bs]`) moves to column d. Other columns copy onto themselves, so the pair has a fixed
    size and needs no host sync. Every source is read before any target is written (SGLang's `move_kv_cache`
    gathers first), so a move may read a slot that another move writes.
    """
    depth = torch.arange(path.shape[1], device=path.device)[None, :]
    on_path = depth <= accepted[:, None]  # [bs, N]
    source = torch.where(on_path, window.gather(1, path), window)
    return window.reshape(-1), source.reshape(-1)


def sample_nodes(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The target's token at every node: `logits` `[bs, N, vocab]`; per request `temperature`, `top_k` and
    `top_p` `[bs]`. Temperature 0 or top-k 1 is greedy. Sampling at every node independently keeps the
    output distribution exactly the target's (the drafts are deterministic given the context)."""
    greedy = logits.argmax(dim=-1)  # [bs, N]
    hot = (temperature > 0) & (top_k != 1)
    if not bool(hot.any()):
        return greedy
    scale = torch.where(hot, temperature, 1.0).to(torch.float32)[:, None, None]
    probs = torch.softmax(logits.float() / scale, dim=-1)  # [bs, N, vocab]
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)
    k = torch.where(top_k > 0, top_k, probs.shape[-1])[:, None, None]
    cum = sorted_p.cumsum(dim=-1)
    keep = (rank < k) & (cum - sorted_p < top_p.to(torch.float32)[:, None, None])
    sorted_p = torch.where(keep, sorted_p, 0.0)
    flat = sorted_p.reshape(-1, sorted_p.shape[-1])
    drawn = torch.multinomial(flat, 1, generator=generator).reshape(sorted_p.shape[:2])
    sampled = order.gather(-1, drawn[..., None]).squeeze(-1)
    return torch.where(hot[:, None], sampled, greedy)
