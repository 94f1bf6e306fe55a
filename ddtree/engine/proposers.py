"""What each method drafts. The decode loop only sees the `Proposer` protocol.

- `ar`: no drafts; the tree is the root alone.
- `dflash`: the drafter's top-1 token at each depth, a chain (a tree with budget=depth, topk=1).
- `ddtree`: the `budget` most probable prefixes of the drafter's block.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ddtree.engine.kv_cache import KVCache
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.target import Target
from ddtree.tree import DraftTree, build_tree, root_only_tree

METHODS = ("ar", "dflash", "ddtree")


class Proposer(Protocol):
    width: int  # tree slots per request, root included

    def start(self, batch: int, capacity: int) -> None:
        """Allocate per-generation state."""

    def draft(
        self, root: torch.Tensor, context: torch.Tensor | None, counts: torch.Tensor, key_span: int
    ) -> torch.Tensor | None:
        """Per-depth draft logits `[batch, depth, vocab]` for a block rooted at `root` (`[batch]`)."""

    def build(self, logits: torch.Tensor | None, batch: int) -> DraftTree:
        """The tree to verify."""


class NoDraft:
    """Plain autoregressive decoding."""

    width = 1

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self, batch: int, capacity: int) -> None:
        pass

    def draft(
        self, root: torch.Tensor, context: torch.Tensor | None, counts: torch.Tensor, key_span: int
    ) -> torch.Tensor | None:
        return None

    def build(self, logits: torch.Tensor | None, batch: int) -> DraftTree:
        return root_only_tree(batch, self.device)


class DrafterProposer:
    """A DFlash drafter and a tree shape: a chain (`dflash`) or the top-`budget` prefixes (`ddtree`)."""

    def __init__(self, drafter: DFlashDrafter, target: Target, budget: int, topk: int | None) -> None:
        self.drafter = drafter
        self.target = target
        self.budget = budget
        self.topk = topk
        self.width = 1 + budget
        self.cache: KVCache | None = None

    def start(self, batch: int, capacity: int) -> None:
        self.cache = self.drafter.new_cache(batch, capacity, self.target.dtype, self.target.device)

    def draft(
        self, root: torch.Tensor, context: torch.Tensor | None, counts: torch.Tensor, key_span: int
    ) -> torch.Tensor | None:
        assert self.cache is not None and context is not None, "start() first; the target must emit features"
        block = torch.full((root.shape[0], self.drafter.block_size), self.drafter.mask_token_id, device=root.device)
        block[:, 0] = root
        hidden = self.drafter(self.target.embed(block), context, counts, self.cache, key_span)
        return self.target.head(hidden[:, 1:])  # [batch, depth, vocab]

    def build(self, logits: torch.Tensor | None, batch: int) -> DraftTree:
        assert logits is not None
        return build_tree(logits, self.budget, self.topk)


def make_proposer(
    method: str, target: Target, drafter: DFlashDrafter | None, budget: int, topk: int | None
) -> Proposer:
    if method == "ar":
        return NoDraft(target.device)
    if drafter is None:
        raise ValueError(f"method {method!r} needs a drafter")
    if method == "dflash":
        return DrafterProposer(drafter, target, budget=drafter.depth, topk=1)
    if method == "ddtree":
        return DrafterProposer(drafter, target, budget=budget, topk=topk)
    raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
