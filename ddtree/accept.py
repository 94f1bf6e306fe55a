"""The accept walk: which drafted nodes the target's own tokens confirm.

The target verifies `[root] + nodes` in one forward (node i at position `start + depth[i]`, seeing the KV
prefix, its ancestors and itself: `ddtree.tree.ancestor_mask`). The accept walk then follows the target's own tokens
down the tree: a node is accepted when every draft token on its path equals the token the target chose
at that token's parent. Siblings carry distinct tokens, so the accepted nodes form one path from the root.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.tree import DraftTree


@dataclass(frozen=True)
class AcceptResult:
    """What one verify step keeps, per request."""

    path: torch.Tensor  # [batch, nodes] node indices from the root; padded by repeating the last node
    accepted: torch.Tensor  # [batch] accepted draft tokens (the root excluded)
    bonus: torch.Tensor  # [batch] the target's token after the last accepted node
    path_tokens: torch.Tensor  # [batch, nodes] tokens along the path (the root's is the previous bonus)


def accept(tree: DraftTree, ancestors: torch.Tensor, target_tokens: torch.Tensor, root: torch.Tensor) -> AcceptResult:
    """Walk the target's tokens down the tree, on the device.

    `target_tokens` is `[batch, nodes]`, the target's choice at every node; `root` is `[batch]`, the bonus
    token the tree was rooted at.
    """
    batch, width = tree.tokens.shape
    parent_choice = target_tokens.gather(1, tree.parents.clamp(min=0))  # [batch, nodes]
    match = (tree.tokens == parent_choice) & tree.valid
    match[:, 0] = True
    # A node is accepted when all of its ancestors (and itself) match.
    accepted_nodes = ~(ancestors & ~match[:, None, :]).any(dim=-1)  # [batch, nodes]
    accepted = accepted_nodes.sum(dim=-1) - 1
    depth_span = width  # no path is longer than the tree has slots
    # Place each accepted node at the slot of its depth; one accepted node per depth.
    slot = torch.where(accepted_nodes, tree.depths, depth_span)  # [batch, nodes]
    path = torch.zeros((batch, depth_span + 1), dtype=torch.long, device=tree.tokens.device)
    node_ids = torch.arange(width, device=tree.tokens.device).expand(batch, -1)
    path.scatter_(1, slot, node_ids)
    path = path[:, :depth_span]
    # Repeat the last accepted node past the end of the path.
    steps = torch.arange(depth_span, device=path.device)[None, :]
    last = path.gather(1, accepted[:, None])
    path = torch.where(steps <= accepted[:, None], path, last)
    bonus = target_tokens.gather(1, last).squeeze(1)
    tokens = torch.where(tree.tokens < 0, root[:, None], tree.tokens)
    return AcceptResult(path=path, accepted=accepted, bonus=bonus, path_tokens=tokens.gather(1, path))


def accepted_ranks(tree: DraftTree, path: torch.Tensor, depth: int) -> torch.Tensor:
    """[batch, min(depth, nodes - 1)] int64: the rank of the accepted node at each depth 1..depth, on the device.

    A node's rank is the number of its siblings before it in the tree. Nodes come in order of decreasing
    probability and the drafter's distribution at a depth does not depend on the parent, so rank 0 is the
    drafter's top-1 token at that depth and rank r its (r+1)-th candidate (up to ties, which the tree's order
    breaks): the chain (`dflash`) is the path of rank-0 nodes. `path` is `AcceptResult.path` ([batch, nodes],
    the root first, the last accepted node repeated past the end), so the columns past a row's accepted drafts
    repeat its last rank (0 where it accepted none: the root has no siblings).
    """
    nodes = path[:, 1 : 1 + depth]  # [batch, depth] the accepted node at each depth
    parent = tree.parents.gather(1, nodes)  # [batch, depth]
    slots = torch.arange(tree.width, device=path.device)  # [nodes]
    earlier = slots[None, None, :] < nodes[:, :, None]  # [batch, depth, nodes]
    siblings = tree.parents[:, None, :] == parent[:, :, None]  # [batch, depth, nodes]; the root's match nothing
    return (earlier & siblings).sum(dim=-1)  # [batch, depth]
