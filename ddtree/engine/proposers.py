"""What each method drafts. The decode session only sees the `Proposer` protocol.

- `ar`: no drafts; the tree is the root alone.
- `dflash`: the drafter's top-1 token at each depth, a chain (a tree with budget=depth, topk=1).
- `ddtree`: the `budget` most probable prefixes of the drafter's block.
- `ar` steps of a session that drafts at other loads (`ddtree.schedule`): no drafts, but the drafter's cache
  takes the context as it comes (`ContextOnly`), so a later tree step drafts from all of it.

Proposers hold no per-request state: the session owns the drafter's cache and passes it in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from ddtree.kv_cache import KVCache
from ddtree.methods import TreeShape
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.target import Target
from ddtree.tree import DraftTree, Transition, ancestor_mask, build_tree, reachable_depth, root_only_tree

TREE_KERNELS = ("auto", "torch", "triton")


class Proposer(Protocol):
    width: int  # tree slots per request, root included
    block: int  # positions one draft writes past the committed prefix (1 without a drafter)

    def new_cache(self, slots: int, capacity: int) -> KVCache | None:
        """The drafter's cache for `slots` requests, or None."""

    def append_context(self, context: torch.Tensor | None, counts: torch.Tensor, cache: KVCache | None) -> None:
        """Commit the first `counts[b]` rows of `context` `[batch, n, features]` to the drafter's cache."""

    def draft(
        self,
        root: torch.Tensor,
        context: torch.Tensor | None,
        counts: torch.Tensor,
        cache: KVCache | None,
        span: int,
        fused: bool,
        attention: str = "sdpa",
    ) -> torch.Tensor | None:
        """Per-depth draft logits `[batch, depth, vocab]` for a block rooted at `root` (`[batch]`), for the depths
        the tree can reach (`ddtree.tree.reachable_depth`); `fused`: use the drafter's compiled regions
        (`compile_layers`); `attention`: `sdpa` or `triton`."""

    def build(self, logits: torch.Tensor | None, batch: int) -> DraftTree:
        """The tree to verify."""

    def ancestors(self, tree: DraftTree) -> torch.Tensor:
        """`ddtree.tree.ancestor_mask(tree)`, `[batch, nodes, nodes]` bool."""


class NoDraft:
    """Plain autoregressive decoding."""

    width = 1
    block = 1

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_cache(self, slots: int, capacity: int) -> KVCache | None:
        return None

    def append_context(self, context: torch.Tensor | None, counts: torch.Tensor, cache: KVCache | None) -> None:
        pass

    def draft(
        self,
        root: torch.Tensor,
        context: torch.Tensor | None,
        counts: torch.Tensor,
        cache: KVCache | None,
        span: int,
        fused: bool,
        attention: str = "sdpa",
    ) -> torch.Tensor | None:
        return None

    def build(self, logits: torch.Tensor | None, batch: int) -> DraftTree:
        return root_only_tree(batch, self.device)

    def ancestors(self, tree: DraftTree) -> torch.Tensor:
        return ancestor_mask(tree)


class ContextOnly(NoDraft):
    """An `ar` step in a session that drafts in its other steps: the tree is the root alone, and the draft stage
    commits the last step's accepted features to the drafter's cache, as a draft would before its block."""

    def __init__(self, drafter: DFlashDrafter, target: Target) -> None:
        super().__init__(target.device)
        self.drafter = drafter
        self.target = target

    def new_cache(self, slots: int, capacity: int) -> KVCache | None:
        return self.drafter.new_cache(slots, capacity, self.target.dtype, self.target.device)

    def draft(
        self,
        root: torch.Tensor,
        context: torch.Tensor | None,
        counts: torch.Tensor,
        cache: KVCache | None,
        span: int,
        fused: bool,
        attention: str = "sdpa",
    ) -> torch.Tensor | None:
        assert cache is not None and context is not None, "the target must emit features for the drafter"
        self.drafter.append_context(context, counts, cache, fused)
        return None


class DrafterProposer:
    """A DFlash drafter and a tree shape: a chain (`dflash`) or the top-`budget` prefixes (`ddtree`)."""

    def __init__(
        self, drafter: DFlashDrafter, target: Target, budget: int, topk: int | None, tree_kernel: str = "auto"
    ) -> None:
        self.build_tree, self.ancestor_mask = _tree_builder(tree_kernel, target.device)
        self.drafter = drafter
        self.target = target
        self.budget = budget
        self.topk = topk
        self.width = 1 + budget
        self.block = drafter.block_size
        self.depth = reachable_depth(budget, drafter.depth)  # positions whose logits the tree can use
        self.transition = drafter.transition  # a Markov head's: the tree is built from conditioned steps

    def new_cache(self, slots: int, capacity: int) -> KVCache | None:
        return self.drafter.new_cache(slots, capacity, self.target.dtype, self.target.device)

    def append_context(self, context: torch.Tensor | None, counts: torch.Tensor, cache: KVCache | None) -> None:
        assert context is not None and cache is not None, "the target must emit features for the drafter"
        self.drafter.append_context(context, counts, cache, fused=False)  # prefill only: one-off shapes

    def draft(
        self,
        root: torch.Tensor,
        context: torch.Tensor | None,
        counts: torch.Tensor,
        cache: KVCache | None,
        span: int,
        fused: bool,
        attention: str = "sdpa",
    ) -> torch.Tensor | None:
        assert cache is not None and context is not None, "the target must emit features for the drafter"
        block = torch.full((root.shape[0], self.drafter.block_size), self.drafter.mask_token_id, device=root.device)
        block[:, 0] = root
        hidden = self.drafter(self.target.embed(block), context, counts, cache, span, fused, attention)
        return self.target.head(hidden[:, 1 : 1 + self.depth])  # [batch, depth, vocab]

    def build(self, logits: torch.Tensor | None, batch: int) -> DraftTree:
        assert logits is not None
        return self.build_tree(logits, self.budget, self.topk, self.transition)

    def ancestors(self, tree: DraftTree) -> torch.Tensor:
        return self.ancestor_mask(tree)


def _tree_builder(
    kernel: str, device: torch.device
) -> tuple[
    Callable[[torch.Tensor, int, int | None, Transition | None], DraftTree], Callable[[DraftTree], torch.Tensor]
]:
    """The tree build and its ancestor matrix. `torch`: `ddtree.tree.build_tree` and
    `ddtree.tree.ancestor_mask`; `triton`: the fused kernels, which give the same tree and matrix; `auto`:
    triton on CUDA where it imports, else torch."""
    if kernel == "auto":
        from ddtree.kernels.tree_build import default_tree_kernel

        kernel = default_tree_kernel(device)
    if kernel == "torch":
        return build_tree, ancestor_mask
    if kernel == "triton":
        from ddtree.kernels.ancestors import ancestor_mask_fused
        from ddtree.kernels.tree_build import build_tree_fused, triton_available

        if not triton_available():
            raise ValueError("the triton tree kernel needs triton and a CUDA device")
        return build_tree_fused, ancestor_mask_fused
    raise ValueError(f"tree kernel must be one of {', '.join(TREE_KERNELS)}, got {kernel!r}")


def make_proposer(
    shape: TreeShape,
    target: Target,
    drafter: DFlashDrafter | None,
    tree_kernel: str = "auto",
    feeds_drafter: bool = False,
) -> Proposer:
    """What proposes `shape`'s trees: nothing for `ar` (but the context, with `feeds_drafter`: a session that
    drafts in other steps), else the drafter with the shape's budget and top-k."""
    if not shape.drafting and not feeds_drafter:
        return NoDraft(target.device)
    if drafter is None:
        raise ValueError(f"method {shape.method!r} needs a drafter")
    if not shape.drafting:
        return ContextOnly(drafter, target)
    return DrafterProposer(drafter, target, budget=shape.budget, topk=shape.topk, tree_kernel=tree_kernel)
