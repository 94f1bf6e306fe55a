"""The accepted path's ranks, end to end: computed on the device, read back with the tokens, counted per depth
against the tree's chain (`telemetry.chain`), written to the step log and the metrics."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ddtree.engine.engine import Engine
from ddtree.observer import GenerateInfo, RequestResult
from ddtree.settings import GenerationConfig
from telemetry import semconv as sc
from telemetry.chain import ChainCounts, chain_length, off_chain_parent_nodes, sibling_ranks
from telemetry.paths import accepted_path
from telemetry.stats import StepStats
from tests.helpers import random_prompts, tiny_pair
from tests.telemetry.helpers import Captured, captured_telemetry

# A hand-made tree: node: parent (sibling rank). 1: 0 (0), 2: 0 (1), 3: 1 (0), 4: 2 (0), 5: 1 (1), 6: 4 (0),
# then padding. Off the chain: 2 (rank 1), 4 and 6 (below 2), 5 (rank 1). Parent off the chain: 4, 6.
PARENTS = np.array([[-1, 0, 0, 1, 2, 1, 4, -1]])
DEPTHS = np.array([[0, 1, 1, 2, 2, 2, 3, 0]])


def test_sibling_ranks_and_the_nodes_whose_parent_is_off_the_chain() -> None:
    assert sibling_ranks(PARENTS).tolist() == [[0, 0, 1, 0, 0, 1, 0, 0]]
    assert off_chain_parent_nodes(PARENTS, DEPTHS) == [0, 0, 1, 1]
    chain = np.array([[-1, 0, 1, 2, -1]])  # dflash's tree: a chain, nothing off it
    assert sibling_ranks(chain).tolist() == [[0] * 5]
    assert off_chain_parent_nodes(chain, np.array([[0, 1, 2, 3, 0]])) == [0, 0, 0, 0]
    assert off_chain_parent_nodes(np.array([[-1]]), np.array([[0]])) == [0], "a root alone (ar)"


def test_chain_counts_of_hand_made_paths() -> None:
    """Paths [0, 0, 2, 0], [1, 0], [0], [] (ar-like); tree-added counts from the first rank > 0 down."""
    counts = ChainCounts.of([[0, 0, 2, 0], [1, 0], [0], []], [0, 0, 3, 1])
    assert [chain_length(p) for p in ([0, 0, 2, 0], [1, 0], [])] == [2, 0, 0]
    assert counts.request_steps == 4 and counts.depth == 4
    assert counts.accepted == [0, 3, 2, 1, 1]
    assert counts.off_chain == [0, 1, 0, 1, 0]
    assert counts.tree_added == [0, 1, 1, 1, 1]
    assert counts.off_parent == [0, 0, 1, 0, 1]
    assert [counts.on_chain(d) for d in range(1, 5)] == [2, 1, 0, 0]
    assert counts.tree_tau == pytest.approx(1 + 7 / 4) and counts.chain_tau == pytest.approx(1 + 3 / 4)


class _Keep:
    """A sink that keeps every step's stats and every request's result."""

    def __init__(self) -> None:
        self.steps: list[StepStats] = []
        self.results: dict[str, RequestResult] = {}

    def start_requests(self, info: GenerateInfo) -> None:
        pass

    def step(self, stats: StepStats) -> None:
        self.steps.append(stats)

    def end_requests(self, info: GenerateInfo, results: list[RequestResult]) -> None:
        self.results.update((r.request_id, r) for r in results)


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[Captured, _Keep]]:
    """One small batch per method on a tiny random pair (a small vocabulary, so that trees get accepted)."""
    out = {}
    for method in ("ddtree", "dflash", "ar"):
        captured, keep = captured_telemetry(), _Keep()
        captured.collector.sinks.append(keep)
        target, drafter = tiny_pair(0, vocab=6, block_size=5)
        config = GenerationConfig(method=method, budget=12, seed=3, max_new_tokens=24)
        Engine(target, drafter, observer=captured.collector).generate(random_prompts(1, 3, vocab=6), config)
        out[method] = (captured, keep)
    return out


def _reference(keep: _Keep) -> list[list[list[int] | None]]:
    """Per step, per row: the ranks found on the host from the logged tree and the request's output tokens; None
    for a row whose tokens the request's end cut short (its last step)."""
    offsets = dict.fromkeys(keep.results, 1)  # the first output token comes from the prefill
    steps: list[list[list[int] | None]] = []
    for s in keep.steps:
        assert s.tokens is not None and s.parents is not None
        rows: list[list[int] | None] = []
        for row, (rid, n, emitted) in enumerate(zip(s.row_ids, s.accepted, s.emitted, strict=True)):
            assert rid is not None
            output, start = keep.results[rid].output_tokens, offsets[rid]
            offsets[rid] += emitted
            if emitted < n + 1:
                rows.append(None)
                continue
            parents = s.parents[row].tolist()
            path = accepted_path(s.tokens[row].tolist(), parents, output[start : start + n])
            assert len(path) == n
            rows.append([sum(parents[j] == parents[node] for j in range(1, node)) for node in path])
        steps.append(rows)
    return steps


def _step_lines(captured: Captured) -> list[dict[str, Any]]:
    return [line for line in captured.log_lines() if line["event"] == sc.EVENT_STEP]


def _check_against_reference(lines: list[dict[str, Any]], keep: _Keep) -> None:
    reference = _reference(keep)
    assert len(lines) == len(reference)
    checked = 0
    for line, expected in zip(lines, reference, strict=True):
        for got, want in zip(line[sc.FIELD_ACCEPTED_RANKS], expected, strict=True):
            if want is not None:
                assert got == want
                checked += 1
    assert checked > len(reference), "most rows were checked"


def test_the_logged_ranks_are_the_accepted_nodes_sibling_ranks(runs: dict[str, tuple[Captured, _Keep]]) -> None:
    captured, keep = runs["ddtree"]
    lines = _step_lines(captured)
    _check_against_reference(lines, keep)
    ranks = [r for line in lines for row in line[sc.FIELD_ACCEPTED_RANKS] for r in row]
    assert any(r > 0 for r in ranks), "some accepted draft was not the drafter's top-1"
    total = ChainCounts()
    for s in keep.steps:
        assert s.chain is not None and s.parents is not None and s.depths is not None
        total.merge(s.chain)
    off = sum(1 for r in ranks if r > 0)
    assert captured.counter(sc.METRIC_OFF_CHAIN_ACCEPTED_PER_DEPTH) == off == sum(total.off_chain)
    assert captured.counter(sc.METRIC_TREE_ADDED_PER_DEPTH) == sum(total.tree_added) >= off
    assert captured.counter(sc.METRIC_OFF_CHAIN_PARENT_ACCEPTED_PER_DEPTH) == sum(total.off_parent)
    offered = sum(sum(line[sc.FIELD_OFF_CHAIN_PARENT_NODES_PER_DEPTH]) for line in lines)
    assert captured.counter(sc.METRIC_OFF_CHAIN_PARENT_NODES_PER_DEPTH) == offered > 0


def test_dflash_ranks_are_all_zero_and_ar_has_none(runs: dict[str, tuple[Captured, _Keep]]) -> None:
    captured, keep = runs["dflash"]
    lines = _step_lines(captured)
    _check_against_reference(lines, keep)
    assert [len(row) for line in lines for row in line[sc.FIELD_ACCEPTED_RANKS]] == [
        n for line in lines for n in line[sc.FIELD_ACCEPTED_DRAFTS]
    ]
    assert any(line[sc.FIELD_ACCEPTED_RANKS] != [[]] * len(line[sc.FIELD_ACCEPTED_RANKS]) for line in lines)
    assert all(r == 0 for line in lines for row in line[sc.FIELD_ACCEPTED_RANKS] for r in row)
    assert captured.counter(sc.METRIC_TREE_ADDED_PER_DEPTH) == 0
    assert captured.counter(sc.METRIC_OFF_CHAIN_PARENT_NODES_PER_DEPTH) == 0
    ar_lines = _step_lines(runs["ar"][0])
    assert ar_lines and all(row == [] for line in ar_lines for row in line[sc.FIELD_ACCEPTED_RANKS])
