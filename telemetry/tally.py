"""Speculative-decoding counts over request steps: drafts by budget, draft nodes, accepted drafts and drafts
accepted at each depth. The one derivation of the per-depth counts, which the server's `/metrics` and
telemetry's step metrics both read; free of torch and numpy.

A request step is one request's tree in one decode step: `accepted` drafts out of a tree of `budget` nodes
(0 for an `ar` step). Depth d (1 = the root's children) is reached by the steps that accepted d or more.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


def reached_per_depth(accepted: Iterable[int], depth: int | None = None) -> list[int]:
    """Index d-1: how many of `accepted` (accepted drafts per request step) reached depth d, for d = 1 to
    `depth` (default: the deepest reached; deeper steps count up to `depth` only)."""
    accepted = list(accepted)
    deepest = max(accepted, default=0) if depth is None else depth
    counts = [0] * deepest
    for n in accepted:
        for d in range(min(n, deepest)):
            counts[d] += 1
    return counts


@dataclass
class SpecTally:
    """Counts over request steps, added to as they come and read (then cleared) by whoever exports them."""

    drafts: collections.Counter[int] = field(default_factory=collections.Counter)  # budget -> request steps
    draft_tokens: int = 0  # the steps' budgets summed: draft nodes verified
    accepted: int = 0  # drafts accepted, the bonus token excluded
    per_depth: list[int] = field(default_factory=list)  # index d-1: request steps that reached depth d

    def add(self, accepted: Sequence[int], budgets: Sequence[int]) -> None:
        """Request steps: each one's accepted drafts and budget."""
        if len(accepted) != len(budgets):
            raise ValueError(f"{len(accepted)} accepted counts but {len(budgets)} budgets")
        self.drafts.update(budgets)
        self.draft_tokens += sum(budgets)
        self.accepted += sum(accepted)
        reached = reached_per_depth(accepted)
        if len(reached) > len(self.per_depth):
            self.per_depth += [0] * (len(reached) - len(self.per_depth))
        for d, n in enumerate(reached):
            self.per_depth[d] += n

    def __bool__(self) -> bool:
        return bool(self.drafts)
