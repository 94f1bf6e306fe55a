"""Accepted paths from logged trees: which node indices a step's accepted tokens walked, and each node's rank.

Used beside decoding (the exporter's step log writes each step's path once its request ends) and by the
offline replay (`telemetry.analysis.replay`).

Glossary
- path: the accepted draft nodes' indices (1-based, root excluded), from depth 1 down.
- ranks: per draft node 1..n, the largest 0-based sibling rank on its path (its "path rank").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ddtree.observer import RequestResult
from telemetry.chain import path_max_ranks
from telemetry.stats import StepStats


def accepted_path(tokens: Sequence[int], parents: Sequence[int], path_tokens: Sequence[int]) -> list[int]:
    """Node indices of the path that `path_tokens` (the accepted drafts, in order) walks down the tree.
    Siblings carry distinct tokens, so the walk is unique; it stops at the first token with no such child."""
    children = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens, strict=True)) if i > 0 and p >= 0}
    path: list[int] = []
    node = 0
    for token in path_tokens:
        child = children.get((node, token))
        if child is None:
            break
        path.append(child)
        node = child
    return path


def path_ranks(parents: Sequence[int]) -> list[int]:
    """Per draft node 1..n: the largest sibling rank (0 = its parent's most probable child) on its path.
    Nodes come in order of decreasing probability, so a node's rank is the number of siblings before it."""
    count = next((i for i in range(1, len(parents)) if parents[i] < 0), len(parents)) - 1  # padding: past n
    ranks = path_max_ranks(np.asarray([parents], dtype=np.int64))  # [1, nodes]
    return [int(r) for r in ranks[0, 1 : count + 1]]


@dataclass
class _RequestSteps:
    steps: list[int] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    parents: list[list[int]] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)


class PathTracker:
    """Finds each step's accepted path once its request ends (in the exporter process, off the decode loop).

    A step's accepted drafts are the request's output tokens that the step emitted, so the trees' tokens and
    parents, kept until then, give the node indices with no copy of the engine's path from the device."""

    def __init__(self) -> None:
        self.requests: dict[str, _RequestSteps] = {}

    def add(self, stats: StepStats) -> None:
        if stats.tokens is None or stats.parents is None or stats.tokens.shape[1] <= 1:
            return
        for row, rid in enumerate(stats.row_ids):
            if rid is None:
                continue
            entry = self.requests.setdefault(rid, _RequestSteps())
            entry.steps.append(stats.step)
            entry.tokens.append(stats.tokens[row].tolist())
            entry.parents.append(stats.parents[row].tolist())
            entry.emitted.append(stats.emitted[row])

    def finish(self, result: RequestResult) -> tuple[list[int], list[list[int]]] | None:
        """(steps, accepted paths) of a request that ended; None when steps of it were not all seen."""
        entry = self.requests.pop(result.request_id, None)
        if entry is None or len(entry.steps) != len(result.acceptance_lengths):
            return None
        offset = 1  # the first output token comes from the prefill
        paths = []
        for tokens, parents, length, emitted in zip(
            entry.tokens, entry.parents, result.acceptance_lengths, entry.emitted, strict=True
        ):
            paths.append(accepted_path(tokens, parents, result.output_tokens[offset : offset + length - 1]))
            offset += emitted
        return entry.steps, paths
