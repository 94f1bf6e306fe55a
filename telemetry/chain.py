"""The tree against its chain: which accepted drafts the drafter's chain in the same tree would have accepted.

Torch-free: the exporter's sinks (`telemetry.stats`) and the offline analysis (`telemetry.analysis.chain`)
count with it, from the accepted path's ranks that ride a step's one readback (`ddtree.accept.accepted_ranks`)
and the tree's parents that ride with them.

Glossary
- rank: a draft node's rank among its siblings in the tree's order (decreasing probability): 0 is its parent's
  most probable child, which is the drafter's top-1 token at that depth, since a block drafter's distribution
  at a depth does not depend on the parent; r is its (r+1)-th candidate (ties broken by the tree's order).
- accepted ranks: per request and step, the rank of each accepted draft, depth 1 first (`ar`: none; `dflash`:
  all 0, its tree is a chain).
- chain: the tree's nodes with rank 0 at every depth of their path: what `dflash` would verify with the same
  drafter. A node is off the chain when its path (itself included) has a rank > 0; its parent is off the
  chain when that rank lies above it.
- off-chain accepted at depth d: accepted drafts at depth d whose own rank is > 0 (not the drafter's top-1 at
  d): where the accepted path branched off the chain.
- tree-added at depth d: accepted drafts at depth d at or below the first rank > 0 of their path. The chain in
  the same tree stops above them, so over request-steps, tau(tree) - tau(chain prefix) = sum over d of
  tree-added[d] / request-steps. It is a per-step counterfactual on the same context (a `dflash` run would go
  on from other contexts), and the chain is the tree's own (a `dflash` chain may reach deeper than the part of
  it that the tree kept).
- off-chain-parent accepted at depth d: accepted drafts at depth d whose parent is off the chain (tree-added at
  d less the branch points at d); offered: the tree's nodes at depth d whose parent is off the chain, so
  accepted / offered is the acceptance of such a node, to set beside the acceptance per node at the depth
  (`accepted_per_depth / nodes_per_depth`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt


def chain_length(ranks: Sequence[int]) -> int:
    """How many of a path's accepted drafts lie on the chain: those before its first rank > 0."""
    return next((i for i, r in enumerate(ranks) if r > 0), len(ranks))


def sibling_ranks(parents: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """[rows, nodes]: each node's rank among its siblings (those with the same parent before it); 0 for the root
    and padding. `parents` is `[rows, nodes]`, -1 for the root and padding, parents before their children."""
    rows, nodes = parents.shape
    order = np.argsort(parents, axis=1, kind="stable")  # [rows, nodes]: by parent, in node order within one
    grouped = np.take_along_axis(parents, order, axis=1)  # [rows, nodes]
    slots = np.broadcast_to(np.arange(nodes), (rows, nodes))
    starts = np.ones((rows, nodes), dtype=bool)
    starts[:, 1:] = grouped[:, 1:] != grouped[:, :-1]
    first = np.maximum.accumulate(np.where(starts, slots, 0), axis=1)  # [rows, nodes] slot of the group's first
    ranks = np.empty((rows, nodes), dtype=np.int64)
    np.put_along_axis(ranks, order, slots - first, axis=1)
    return np.where(parents >= 0, ranks, 0)


def path_max_ranks(parents: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """[rows, nodes]: each node's path rank, the largest sibling rank on its path, itself included (0: the node
    is on the chain); 0 for the root and padding. `parents` as for `sibling_ranks`."""
    has_parent = parents >= 0
    up = np.where(has_parent, parents, 0)  # [rows, nodes]
    best = sibling_ranks(parents)  # [rows, nodes]
    while True:  # a pass per depth: parents come before their children
        deeper = np.maximum(best, np.where(has_parent, np.take_along_axis(best, up, axis=1), 0))
        if np.array_equal(deeper, best):
            return best
        best = deeper


def off_chain_parent_nodes(parents: npt.NDArray[np.int64], depths: npt.NDArray[np.int64]) -> list[int]:
    """Index d: the tree's nodes at depth d whose parent is off the chain, over all rows (index 0 unused)."""
    rows, nodes = parents.shape
    if not rows or nodes <= 1:
        return [0]
    has_parent = parents >= 0
    off = path_max_ranks(parents) > 0  # [rows, nodes]
    parent_off = np.take_along_axis(off, np.where(has_parent, parents, 0), axis=1) & has_parent  # [rows, nodes]
    counts = np.bincount(depths[parent_off], minlength=int(depths.max()) + 1)
    return [0, *(int(n) for n in counts[1:])]


@dataclass
class ChainCounts:
    """Per-depth sums over request-steps whose accepted ranks are known; index d is depth d (index 0 unused)."""

    request_steps: int = 0
    accepted: list[int] = field(default_factory=lambda: [0])  # accepted drafts
    off_chain: list[int] = field(default_factory=lambda: [0])  # of which rank > 0
    tree_added: list[int] = field(default_factory=lambda: [0])  # of which at or below the path's first rank > 0
    off_parent: list[int] = field(default_factory=lambda: [0])  # of which the parent is off the chain
    off_parent_nodes: list[int] = field(default_factory=lambda: [0])  # tree nodes whose parent is off the chain

    @classmethod
    def of(cls, paths: Iterable[Sequence[int]], off_parent_nodes: Sequence[int] = (0,)) -> ChainCounts:
        counts = cls()
        counts.add_paths(paths)
        add_into(counts.off_parent_nodes, off_parent_nodes)
        return counts

    def add_paths(self, paths: Iterable[Sequence[int]]) -> None:
        """Request-steps, each given by its accepted ranks."""
        for ranks in paths:
            self.request_steps += 1
            chain = chain_length(ranks)
            _grow(len(ranks), self.accepted, self.off_chain, self.tree_added, self.off_parent)
            for d, rank in enumerate(ranks, start=1):
                self.accepted[d] += 1
                self.off_chain[d] += rank > 0
                self.tree_added[d] += d > chain
                self.off_parent[d] += d > chain + 1

    def merge(self, other: ChainCounts) -> None:
        self.request_steps += other.request_steps
        for mine, theirs in (
            (self.accepted, other.accepted),
            (self.off_chain, other.off_chain),
            (self.tree_added, other.tree_added),
            (self.off_parent, other.off_parent),
            (self.off_parent_nodes, other.off_parent_nodes),
        ):
            add_into(mine, theirs)

    @property
    def depth(self) -> int:
        """The deepest depth with an accepted draft or an offered off-chain-parent node."""
        last = [d for d in range(1, max(len(self.accepted), len(self.off_parent_nodes))) if self.at(d)]
        return max(last, default=0)

    def at(self, d: int) -> bool:
        return count_at(self.accepted, d) > 0 or count_at(self.off_parent_nodes, d) > 0

    def on_chain(self, d: int) -> int:
        """Accepted drafts at depth d that the chain would have accepted too."""
        return count_at(self.accepted, d) - count_at(self.tree_added, d)

    @property
    def tree_tau(self) -> float | None:
        """Mean accepted drafts + 1 over the request-steps counted."""
        return 1 + sum(self.accepted) / self.request_steps if self.request_steps else None

    @property
    def chain_tau(self) -> float | None:
        """The same, counting only each path's chain prefix."""
        return 1 + (sum(self.accepted) - sum(self.tree_added)) / self.request_steps if self.request_steps else None


def per_depth(values: Sequence[int], depth: int) -> list[int]:
    """Depths 1..depth of an index-d list (zeros past its end)."""
    return [count_at(values, d) for d in range(1, depth + 1)]


def count_at(values: Sequence[int], d: int) -> int:
    """values[d] of an index-d list, 0 past its end."""
    return values[d] if d < len(values) else 0


def _grow(length: int, *lists: list[int]) -> None:
    for values in lists:
        values.extend([0] * (length + 1 - len(values)))


def add_into(total: list[int], values: Sequence[int]) -> None:
    """Add `values` into `total` elementwise, `total` grown with zeros to their length."""
    _grow(len(values) - 1, total)
    for i, v in enumerate(values):
        total[i] += v
