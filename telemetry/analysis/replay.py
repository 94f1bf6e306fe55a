"""Counterfactual acceptance: what smaller budgets and top-k caps would have accepted, from one logged run.

Why it is exact at T=0 (DDTree's tree is the B most probable prefixes):
- nodes are numbered by decreasing probability, so the tree of a budget B' <= B is nodes 1..B' of the
  logged tree, and the target's token at a node depends only on the node's prefix. Budget B' would have
  accepted the accepted-path nodes with index <= B' (path indices grow with depth, so they are a prefix);
- a node's rank at its depth (its place among its siblings, which are the better tokens of the drafter's
  distribution at that depth) tells whether a top-k cap k' keeps it: the (B', k') tree is the first B' nodes
  among those whose ranks on the whole path are all below k'. When fewer than B' logged nodes pass the cap
  and the logged tree was full, the replay is a lower bound (the rest of that tree was never built).

The same holds for the first step of a request only as far as the steps are the same: after a different
acceptance the contexts differ, so over whole requests the replay is an estimate (the tests say how close).

How sure a replayed tau is: `ReplayTable.bootstrap` resamples requests (not steps: a request's steps share a
prompt and are not independent) with replacement, `BOOTSTRAP_RESAMPLES` times from a seeded generator, and
takes the central `BOOTSTRAP_LEVEL` of the resampled taus. The requests come from a reservoir of at most
`MAX_SAMPLED_REQUESTS` (uniform, seeded); past that the resampled spread is narrowed by sqrt(sample / all).

Glossary
- path: the accepted draft nodes' indices (1-based, root excluded), from depth 1 down.
- ranks: per draft node 1..n, the largest 0-based sibling rank on its path (its "path rank").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

MAX_SAMPLED_REQUESTS = 2048  # requests kept for the bootstrap (a reservoir)
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_LEVEL = 0.95
BOOTSTRAP_SEED = 0


def replay_accepted(
    path: Sequence[int], budget: int, ranks: Sequence[int] | None = None, topk: int | None = None
) -> int:
    """Accepted drafts of one step had the tree been built with `budget` (<= the logged one) and `topk`."""
    if topk is None:
        return sum(1 for node in path if node <= budget)
    if ranks is None:
        raise ValueError("a top-k replay needs the nodes' ranks")
    accepted, kept = 0, 0
    position = {}
    for node in range(1, (max(path) if path else 0) + 1):
        if ranks[node - 1] < topk:
            kept += 1
            position[node] = kept
    for node in path:
        if position.get(node, budget + 1) > budget:
            break
        accepted += 1
    return accepted


def replay_is_exact(ranks: Sequence[int], logged_budget: int, budget: int, topk: int | None) -> bool:
    """Whether `replay_accepted` is exact for this step, not a lower bound: the logged tree holds every prefix
    (fewer nodes than its budget), or the cap keeps at least `budget` of its nodes."""
    if topk is None or topk >= budget or len(ranks) < logged_budget:
        return True
    return sum(1 for r in ranks if r < topk) >= budget


def topk_grid(budget: int) -> tuple[int, ...]:
    """The caps replayed for a logged budget: 1, 2, 4, ... below it."""
    return tuple(1 << i for i in range(max(budget - 1, 0).bit_length()) if 1 << i < budget)


@dataclass(frozen=True)
class _RequestSample:
    """One request's replay data, for the bootstrap."""

    steps: int
    ranked_steps: int
    nodes: npt.NDArray[np.int32]  # [path nodes over its steps]: each accepted node's index
    places: npt.NDArray[np.int32]  # [caps, path nodes over its ranked steps]: place under the cap, budget+1: cut


@dataclass
class ReplayTable:
    """Streaming replay of one logged configuration: histograms only, so memory does not grow with steps.

    `hist[j]`: accepted-path nodes with index j; `capped[c, j]`: path nodes at place j among the nodes that
    cap `topks[c]` keeps (steps with ranks only); `kept[c, m]`: ranked steps with a full tree (as many nodes
    as the budget) where the cap kept m nodes. `samples`: a reservoir of whole requests (`add_request`)."""

    budget: int
    topks: tuple[int, ...]
    steps: int = 0
    ranked_steps: int = 0
    partial_trees: int = 0  # ranked steps whose tree had fewer nodes than the budget: every prefix was in it
    requests: int = 0  # requests added through `add_request`
    hist: npt.NDArray[np.int64] = field(init=False)
    capped: npt.NDArray[np.int64] = field(init=False)
    kept: npt.NDArray[np.int64] = field(init=False)
    samples: list[_RequestSample] = field(init=False, default_factory=list)
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.hist = np.zeros(self.budget + 1, dtype=np.int64)
        self.capped = np.zeros((len(self.topks), self.budget + 1), dtype=np.int64)
        self.kept = np.zeros((len(self.topks), self.budget + 1), dtype=np.int64)
        self.rng = np.random.default_rng(BOOTSTRAP_SEED)

    def add(self, path: Sequence[int], ranks: Sequence[int] | None = None) -> None:
        """One request-step."""
        self._add(path, ranks)

    def add_request(self, paths: Sequence[Sequence[int]], ranks: Sequence[Sequence[int] | None]) -> None:
        """A whole request's steps (paths[i] with ranks[i]), kept for the bootstrap too."""
        nodes, places = [], []
        for path, r in zip(paths, ranks, strict=True):
            step_nodes, step_places = self._add(path, r)
            nodes.append(step_nodes)
            if step_places is not None:
                places.append(step_places)
        sample = _RequestSample(
            len(nodes),
            len(places),
            np.concatenate([np.zeros(0, dtype=np.int32), *nodes]).astype(np.int32),
            np.concatenate([np.zeros((len(self.topks), 0), dtype=np.int32), *places], axis=1).astype(np.int32),
        )
        self.requests += 1
        if len(self.samples) < MAX_SAMPLED_REQUESTS:
            self.samples.append(sample)
        else:  # reservoir: each request seen so far stays with the same chance
            slot = int(self.rng.integers(self.requests))
            if slot < MAX_SAMPLED_REQUESTS:
                self.samples[slot] = sample

    def _add(
        self, path: Sequence[int], ranks: Sequence[int] | None
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64] | None]:
        """Count one request-step; return its path nodes and (ranked steps) their places under each cap."""
        nodes = np.minimum(np.asarray(path, dtype=np.int64), self.budget)  # [path length]
        np.add.at(self.hist, nodes, 1)
        self.steps += 1
        if ranks is None or not self.topks:
            return nodes, None
        self.ranked_steps += 1
        rank = np.asarray(ranks, dtype=np.int64)[: self.budget]  # [n]
        keep = rank[None, :] < np.asarray(self.topks)[:, None]  # [caps, n]
        place = np.cumsum(keep, axis=1)  # [caps, n]
        if len(rank) < self.budget:
            self.partial_trees += 1
        else:
            self.kept[np.arange(len(self.topks)), place[:, -1]] += 1
        if not len(nodes):
            return nodes, np.zeros((len(self.topks), 0), dtype=np.int64)
        on = keep[:, nodes - 1]  # [caps, path length]; path ranks only grow along a path: a prefix is kept
        cap_rows, cols = np.nonzero(on)
        np.add.at(self.capped, (cap_rows, place[cap_rows, nodes[cols] - 1]), 1)
        return nodes, np.where(on, place[:, nodes - 1], self.budget + 1)

    def tau(self, budget: int, topk: int | None = None) -> float | None:
        """Mean accepted drafts + 1 per request-step under (`budget`, `topk`); None without the data."""
        if topk is None or topk >= budget:  # a cap of at least B' keeps every node of a B'-node tree
            return 1 + float(self.hist[1 : budget + 1].sum()) / self.steps if self.steps else None
        if not self.ranked_steps or topk not in self.topks:
            return None
        row = self.capped[self.topks.index(topk)]
        return 1 + float(row[1 : budget + 1].sum()) / self.ranked_steps

    def exact_share(self, budget: int, topk: int | None = None) -> float:
        """Share of the replayed steps that are exact (not a lower bound) under (`budget`, `topk`)."""
        if topk is None or topk >= budget:
            return 1.0
        if not self.ranked_steps or topk not in self.topks:
            return 0.0
        short = int(self.kept[self.topks.index(topk), :budget].sum())  # full trees with fewer than B' kept
        return 1.0 - short / self.ranked_steps

    def bootstrap(
        self,
        configs: Sequence[tuple[int, int | None]],
        resamples: int = BOOTSTRAP_RESAMPLES,
        level: float = BOOTSTRAP_LEVEL,
        seed: int = BOOTSTRAP_SEED,
    ) -> list[tuple[float, float] | None]:
        """Per (budget, topk): the interval of its replayed tau over requests resampled with replacement; None
        with fewer than two requests behind it (see the module docstring)."""
        n = len(self.samples)
        if n < 2:
            return [None] * len(configs)
        counts, steps = self._per_request(configs)  # [requests, configs] each
        weights = np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=resamples)  # [resamples, n]
        with np.errstate(invalid="ignore", divide="ignore"):
            taus = 1 + (weights @ counts) / (weights @ steps)  # [resamples, configs]
            centres = 1 + counts.sum(axis=0) / steps.sum(axis=0)  # [configs]
        scale = float(np.sqrt(n / self.requests)) if self.requests > n else 1.0
        out: list[tuple[float, float] | None] = []
        for j, (budget, topk) in enumerate(configs):
            tau, column = self.tau(budget, topk), taus[:, j][np.isfinite(taus[:, j])]
            if tau is None or np.count_nonzero(steps[:, j]) < 2 or not len(column):
                out.append(None)
                continue
            low, high = np.quantile(column, [(1 - level) / 2, (1 + level) / 2])
            out.append((tau + (low - centres[j]) * scale, tau + (high - centres[j]) * scale))
        return out

    def _per_request(
        self, configs: Sequence[tuple[int, int | None]]
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Per sampled request and (budget, topk): accepted drafts under it, and the request-steps they are over."""
        width = self.budget + 2  # places run 1..budget+1 (the cut)
        uncapped = np.stack([np.bincount(s.nodes, minlength=width)[:width].cumsum() for s in self.samples])
        caps = [
            np.stack([np.bincount(s.places[c], minlength=width)[:width].cumsum() for s in self.samples])
            for c in range(len(self.topks))
        ]  # caps x [requests, width]
        all_steps = np.asarray([s.steps for s in self.samples], dtype=np.float64)  # [requests]
        ranked = np.asarray([s.ranked_steps for s in self.samples], dtype=np.float64)
        counts = np.zeros((len(self.samples), len(configs)))
        steps = np.zeros_like(counts)
        for j, (budget, topk) in enumerate(configs):
            if topk is None or topk >= budget:
                counts[:, j], steps[:, j] = uncapped[:, budget], all_steps
            elif topk in self.topks:
                counts[:, j], steps[:, j] = caps[self.topks.index(topk)][:, budget], ranked
        return counts, steps
