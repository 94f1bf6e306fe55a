"""Draft trees: the B most probable prefixes of a DFlash block.

Glossary
- depth L: the number of drafted positions; depth d in 1..L.
- prefix: a sequence of tokens (t1..td), one per depth. Its log-probability is the sum of the per-depth
  log-softmax values (the drafter's per-depth distributions are treated as independent, DDTree Prop. 1).
- budget B: the number of draft nodes. The tree is the set of the B most probable prefixes; it is closed
  under taking parents, since a parent is never less probable than its child.
- transition (optional, a Markov head's): each depth's candidates re-weighted by the token drafted at the
  depth above (`Transition.condition`); a prefix's log-probability is then the sum of its conditioned steps,
  and the tree is still exactly the B most probable prefixes, of the conditioned distribution.

Node 0 is the root (the bonus token, unknown until verify time). Nodes 1..B are drafts in order of
decreasing probability, so a parent always has a smaller index than its children. Verify runs every node in
one target forward under `ancestor_mask`: node i sees the KV prefix, its ancestors and itself, at position
`start + depth[i]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees. Unused slots past `num_nodes` are padding (token -1, parent -1, depth 0)."""

    tokens: torch.Tensor  # [batch, 1+budget] int64; root slot and padding are -1
    parents: torch.Tensor  # [batch, 1+budget] int64; -1 for the root and padding
    depths: torch.Tensor  # [batch, 1+budget] int64; 0 for the root and padding
    log_probs: torch.Tensor  # [batch, 1+budget] float32; 0 for the root, -inf for padding
    num_nodes: torch.Tensor  # [batch] int64; draft nodes per request, root excluded

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def width(self) -> int:
        """Slots per request, root included (1 + budget)."""
        return int(self.tokens.shape[1])

    @property
    def valid(self) -> torch.Tensor:
        """[batch, 1+budget] bool: the root and the real draft nodes."""
        slots = torch.arange(self.width, device=self.tokens.device)
        return slots[None, :] <= self.num_nodes[:, None]

    def first(self, budget: int) -> DraftTree:
        """The tree of the first `budget` draft nodes: the `budget` most probable prefixes, since nodes come in
        order of decreasing probability and a parent before its children (views of this tree's tensors)."""
        end = 1 + budget
        return DraftTree(
            tokens=self.tokens[:, :end],
            parents=self.parents[:, :end],
            depths=self.depths[:, :end],
            log_probs=self.log_probs[:, :end],
            num_nodes=self.num_nodes.clamp(max=budget),
        )


@dataclass(frozen=True)
class Transition:
    """A first-order correction of each depth's candidates by the token drafted at the depth above (a Markov
    head's low-rank bigram): the log-potential of child token c under parent token t is
    `parent[t] . child[c]`. Depth 1 follows the root, which the drafter's block already holds: no correction."""

    parent: torch.Tensor  # [vocab, rank] float32
    child: torch.Tensor  # [vocab, rank] float32

    def condition(self, log_probs: torch.Tensor, ids: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """A depth's candidates, `log_probs` and `ids` `[batch, k]` (marginal log-probabilities and token ids),
        under each of `parents` `[batch, n]` (the tokens drafted above; -1 padding) -> `[batch, n, k]`: each
        candidate's log-probability given its parent's token. The candidates keep their marginal mass
        (logsumexp of `log_probs`, at most 1), shared as the correction says, so a zero correction gives the
        marginals back and a child is never more probable than its parent."""
        u = self.parent[parents.clamp(min=0)].float()  # [batch, n, rank]
        v = self.child[ids].float()  # [batch, k, rank]
        score = log_probs[:, None, :] + u @ v.transpose(1, 2)  # [batch, n, k]
        mass = torch.logsumexp(log_probs, dim=-1)[:, None, None]  # [batch, 1, 1]
        return (score - torch.logsumexp(score, dim=-1, keepdim=True) + mass).clamp(max=0.0)


def ancestor_mask(tree: DraftTree) -> torch.Tensor:
    """[batch, nodes, nodes] bool: entry (i, j) is true when node j is node i or one of its ancestors.

    Reachability by repeated squaring of the parent relation: log2(nodes) batched matmuls, no loop per node.
    """
    batch, width = tree.parents.shape
    device = tree.parents.device
    reach = torch.eye(width, device=device).expand(batch, -1, -1).clone()  # [batch, nodes, nodes]
    has_parent = tree.parents >= 0
    reach.scatter_add_(2, tree.parents.clamp(min=0)[:, :, None], has_parent[:, :, None].float())
    reach = (reach > 0).float()
    hops = 1
    while hops < width:
        reach = ((reach + reach @ reach) > 0).float()
        hops *= 2
    return reach > 0


def positions(tree: DraftTree, start: torch.Tensor) -> torch.Tensor:
    """[batch, nodes] position of each node: `start + depth`. `start` is `[batch]`."""
    return start[:, None] + tree.depths


def reachable_depth(budget: int, depth: int) -> int:
    """How many of `depth` drafted positions a tree of `budget` nodes can reach. A node at depth d brings its
    d - 1 ancestors into the tree, so no node lies deeper than `budget`: logits past it never matter."""
    return min(budget, depth)


def root_only_tree(batch: int, device: torch.device) -> DraftTree:
    """The tree of plain autoregressive decoding: a root and no drafts."""
    minus_one = torch.full((batch, 1), -1, dtype=torch.long, device=device)
    return DraftTree(
        tokens=minus_one,
        parents=minus_one.clone(),
        depths=torch.zeros((batch, 1), dtype=torch.long, device=device),
        log_probs=torch.zeros((batch, 1), dtype=torch.float32, device=device),
        num_nodes=torch.zeros((batch,), dtype=torch.long, device=device),
    )


def tree_shape(draft_logits: torch.Tensor, budget: int, topk: int | None) -> tuple[int, int, int, int]:
    """A tree build's dimensions: (batch, depth, vocab, candidates per depth). The budget and top-k were
    checked where the settings were (`ddtree.settings.check_generation`, against this vocabulary)."""
    if draft_logits.dim() != 3:
        raise ValueError(f"draft_logits must be [batch, depth, vocab], got shape {tuple(draft_logits.shape)}")
    batch, depth, vocab = draft_logits.shape
    return batch, depth, vocab, min(budget, vocab) if topk is None else topk


def build_tree(
    draft_logits: torch.Tensor, budget: int, topk: int | None = None, transition: Transition | None = None
) -> DraftTree:
    """Return the `budget` most probable prefixes of `draft_logits` as a tree.

    `draft_logits` is `[batch, depth, vocab]`. At each depth only the `topk` most probable tokens are
    candidates (default `min(budget, vocab)`). The search is depth-wise: keep the best `budget` prefixes of
    each depth, extend them by the `topk` tokens of the next depth, then take the global best `budget` over
    all depths. A prefix in the global top-B has at most B-1 better prefixes at its depth and its parent is
    in the global top-B too, so the depth-wise pruning never drops it. With a `transition`, each extension
    is the candidate's log-probability given the beam prefix's last token (`Transition.condition`), and the
    same argument holds. All of it is batched tensor work: no Python loop per node and no host sync.
    """
    batch, depth, _, k = tree_shape(draft_logits, budget, topk)
    device = draft_logits.device

    log_probs = torch.log_softmax(draft_logits.float(), dim=-1)  # [batch, depth, vocab]
    top_lp, top_ids = torch.topk(log_probs, k, dim=-1)  # [batch, depth, k]

    # Depth-wise beam of width `budget`; slots beyond the real prefixes hold -inf.
    level_lp = _pad_to(top_lp[:, 0, :], budget, float("-inf"))  # [batch, budget]
    level_tok = _pad_to(top_ids[:, 0, :], budget, -1)  # [batch, budget]
    level_lp, order = torch.topk(level_lp, budget, dim=-1)
    level_tok = level_tok.gather(1, order)
    level_parent = torch.full_like(level_tok, -1)  # slot of the parent in the previous level
    all_lp, all_tok, all_parent = [level_lp], [level_tok], [level_parent]
    for d in range(1, depth):
        step = top_lp[:, d, None, :]  # [batch, 1, k]
        if transition is not None:
            step = transition.condition(top_lp[:, d], top_ids[:, d], level_tok)  # [batch, budget, k]
        cand = level_lp[:, :, None] + step  # [batch, budget, k]
        level_lp, flat = torch.topk(cand.reshape(batch, budget * k), budget, dim=-1)
        level_parent = torch.div(flat, k, rounding_mode="floor")
        level_tok = top_ids[:, d, :].gather(1, flat % k)
        all_lp.append(level_lp)
        all_tok.append(level_tok)
        all_parent.append(level_parent)

    cand_lp = torch.stack(all_lp, dim=1).reshape(batch, depth * budget)  # depth-major: shallower first
    cand_tok = torch.stack(all_tok, dim=1).reshape(batch, depth * budget)
    cand_parent = torch.stack(all_parent, dim=1).reshape(batch, depth * budget)
    cand_depth = torch.arange(1, depth + 1, device=device).repeat_interleave(budget).expand(batch, -1)

    # A stable sort keeps a parent ahead of an equally probable child, so the chosen set stays closed.
    sorted_lp, order = torch.sort(cand_lp, dim=-1, descending=True, stable=True)
    chosen = order[:, :budget]  # [batch, budget] candidate index
    chosen_lp = sorted_lp[:, :budget]
    real = torch.isfinite(chosen_lp)
    num_nodes = real.sum(dim=-1)

    # Map each chosen candidate to its node index, then parents from candidate slots to node indices.
    node_of_cand = torch.zeros((batch, depth * budget), dtype=torch.long, device=device)
    node_ids = torch.arange(1, budget + 1, device=device).expand(batch, -1)
    node_of_cand.scatter_(1, chosen, torch.where(real, node_ids, 0))
    chosen_depth = cand_depth.gather(1, chosen)  # [batch, budget]
    parent_slot = cand_parent.gather(1, chosen)
    parent_cand = (chosen_depth - 2) * budget + parent_slot  # index of the parent among the candidates
    parent_node = node_of_cand.gather(1, parent_cand.clamp(min=0))
    parent_node = torch.where(chosen_depth == 1, 0, parent_node)

    minus_one = torch.full((batch, 1), -1, dtype=torch.long, device=device)
    return DraftTree(
        tokens=torch.cat([minus_one, torch.where(real, cand_tok.gather(1, chosen), -1)], dim=1),
        parents=torch.cat([minus_one, torch.where(real, parent_node, -1)], dim=1),
        depths=torch.cat([torch.zeros_like(minus_one), torch.where(real, chosen_depth, 0)], dim=1),
        log_probs=torch.cat([torch.zeros((batch, 1), device=device), chosen_lp], dim=1),
        num_nodes=num_nodes,
    )


def _pad_to(x: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """Pad or keep the last dim of `x` ([batch, n]) to at least `width` columns."""
    missing = width - x.shape[-1]
    if missing <= 0:
        return x
    pad = torch.full((x.shape[0], missing), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=-1)
