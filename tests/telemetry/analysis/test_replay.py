"""The counterfactual replay: smaller trees are prefixes of the logged one, and replayed acceptance matches real
runs at those budgets and caps (exactly on each request's first step; over whole requests, closely)."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pytest
import torch

from ddtree.engine.engine import Engine
from ddtree.settings import GenerationConfig
from ddtree.tree import build_tree
from telemetry import semconv as sc
from telemetry.analysis.replay import ReplayTable, replay_accepted, replay_is_exact
from telemetry.collector import Collector
from telemetry.config import TelemetryConfig
from telemetry.logging import LogSink, make_logger
from telemetry.paths import accepted_path, path_ranks
from tests.helpers import random_prompts, tiny_pair

BUDGET = 32
SMALLER = (1, 2, 3, 5, 8, 13, 21)
CAPS = (1, 2, 4)


def _prefixes(tokens: list[int], parents: list[int], nodes: list[int]) -> list[tuple[int, ...]]:
    def prefix(i: int) -> tuple[int, ...]:
        return () if i == 0 else (*prefix(parents[i]), tokens[i])

    return [prefix(i) for i in nodes]


@pytest.mark.parametrize("seed", range(6))
def test_a_smaller_tree_is_the_logged_trees_first_nodes_under_the_cap(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn((2, 5, 9), generator=gen, dtype=torch.float64) * 2  # [batch, depth, vocab]
    big = build_tree(logits, BUDGET)
    for b in range(2):
        tokens, parents = big.tokens[b].tolist(), big.parents[b].tolist()
        ranks = path_ranks(parents)
        for budget in SMALLER:
            for topk in (None, *CAPS):
                small = build_tree(logits, budget, topk)
                n = int(small.num_nodes[b])
                kept = [i for i in range(1, len(ranks) + 1) if topk is None or ranks[i - 1] < topk][:budget]
                if len(kept) < budget and len(ranks) == BUDGET:
                    continue  # the cap keeps fewer logged nodes than B': the replay is a lower bound there
                got = _prefixes(tokens, parents, kept)
                want = _prefixes(small.tokens[b].tolist(), small.parents[b].tolist(), list(range(1, n + 1)))
                assert got == want, (budget, topk)


def test_the_walk_finds_the_path_by_tokens_and_stops_off_the_tree() -> None:
    # root 0 -> 1 (token 5), 2 (token 7); 1 -> 3 (token 7); 3 -> 4 (token 1)
    tokens, parents = [-1, 5, 7, 7, 1, -1], [-1, 0, 0, 1, 3, -1]
    assert accepted_path(tokens, parents, [5, 7, 1]) == [1, 3, 4]
    assert accepted_path(tokens, parents, [7, 7]) == [2]
    assert path_ranks(parents) == [0, 1, 0, 0]
    assert replay_accepted([1, 3, 4], 3) == 2
    assert replay_accepted([1, 3, 4], 4, path_ranks(parents), topk=1) == 3
    assert replay_accepted([2], 4, path_ranks(parents), topk=1) == 0
    with pytest.raises(ValueError, match="ranks"):
        replay_accepted([1], 2, None, topk=1)


def _logged_run(prompts: list[list[int]], engine_pair: Any, tokens: int) -> tuple[list[dict[str, Any]], list[str]]:
    log = io.StringIO()
    sink = LogSink(make_logger(TelemetryConfig(), log), tree_share=1.0)
    engine = Engine(*engine_pair, observer=Collector([sink], "cpu"))
    ids = [f"r{i}" for i in range(len(prompts))]
    engine.generate(prompts, GenerationConfig(budget=BUDGET, max_new_tokens=tokens), request_ids=ids)
    return [json.loads(line) for line in log.getvalue().splitlines()], ids


def test_replay_matches_real_runs_at_smaller_budgets_and_caps(capsys: pytest.CaptureFixture[str]) -> None:
    pair = tiny_pair(5, vocab=10, block_size=6)
    prompts = random_prompts(5, 6, vocab=10)
    lines, ids = _logged_run(prompts, pair, 24)
    requests = {r[sc.FIELD_REQUEST_ID]: r for r in lines if r["event"] == sc.EVENT_REQUEST}
    ranks: dict[tuple[str, int], list[int]] = {}
    for s in (line for line in lines if line["event"] == sc.EVENT_STEP):
        for rid, r in zip(s[sc.FIELD_REQUEST_IDS], s[sc.FIELD_NODE_RANKS], strict=True):
            ranks[rid, s[sc.FIELD_STEP]] = r
    table = ReplayTable(BUDGET, CAPS)
    for rid in ids:
        for step, path in zip(requests[rid][sc.FIELD_PATH_STEPS], requests[rid][sc.FIELD_ACCEPTED_PATHS], strict=True):
            table.add(path, ranks[rid, step])
    assert table.steps == sum(requests[rid][sc.FIELD_STEPS] for rid in ids)
    assert table.tau(BUDGET) == pytest.approx(
        sum(r[sc.FIELD_MEAN_ACCEPTANCE] * r[sc.FIELD_STEPS] for r in requests.values()) / table.steps, abs=1e-3
    )

    engine = Engine(*pair)
    gaps, exact = [], 0
    for budget in SMALLER:
        for topk in (None, *CAPS):
            out = engine.generate(prompts, GenerationConfig(budget=budget, topk=topk, max_new_tokens=24))
            for rid, o in zip(ids, out.outputs, strict=True):
                step = requests[rid][sc.FIELD_PATH_STEPS][0]
                replayed = replay_accepted(requests[rid][sc.FIELD_ACCEPTED_PATHS][0], budget, ranks[rid, step], topk)
                if replay_is_exact(ranks[rid, step], BUDGET, budget, topk):
                    exact += 1
                    assert replayed == o.acceptance_lengths[0] - 1, (rid, budget, topk)
                else:
                    assert replayed <= o.acceptance_lengths[0] - 1, (rid, budget, topk)
            real = [a for o in out.outputs for a in o.acceptance_lengths]
            tau = table.tau(budget, topk)
            assert tau is not None
            gaps.append((budget, topk, tau, sum(real) / len(real), table.exact_share(budget, topk)))
    assert exact >= 2 * len(ids) * len(SMALLER)  # every uncapped replay, and as many capped ones
    close = [abs(t - r) / r for _, _, t, r, share in gaps if share > 0.95]
    with capsys.disabled():
        print(
            f"\nwhole requests: replayed tau vs real, {len(close)} configurations with exact replays: "
            f"mean gap {sum(close) / len(close):.1%}, largest {max(close):.1%}"
        )
    assert len(close) >= len(gaps) // 2
    assert max(close) < 0.15 and sum(close) / len(close) < 0.06


def _synthetic_requests(n: int, seed: int) -> list[list[list[int]]]:
    """n requests of 5-15 steps; each request has its own acceptance rate, so requests differ more than steps."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(n):
        rate = rng.beta(2, 3)
        lengths = np.minimum(rng.geometric(1 - rate, size=rng.integers(5, 16)) - 1, 5)
        requests.append([[1, 3, 6, 10, 13][:a] for a in lengths])
    return requests


def _delta_half_width(requests: list[list[list[int]]], budget: int) -> float:
    """1.96 standard errors of tau = 1 + sum(accepted) / sum(steps) over requests (the ratio's delta method)."""
    c = np.asarray([sum(sum(1 for node in p if node <= budget) for p in r) for r in requests], dtype=float)
    s = np.asarray([len(r) for r in requests], dtype=float)
    ratio = c.sum() / s.sum()
    n = len(requests)
    return float(1.96 * np.sqrt(n / (n - 1) * ((c - ratio * s) ** 2).sum()) / s.sum())


def test_the_bootstrap_over_requests_is_seeded_and_as_wide_as_the_sampling_error(monkeypatch: Any) -> None:
    requests = _synthetic_requests(400, seed=1)
    table = ReplayTable(16, ())
    for r in requests:
        table.add_request(r, [None] * len(r))
    configs = [(16, None), (6, None), (3, None)]
    intervals = table.bootstrap(configs)
    assert table.bootstrap(configs) == intervals and table.requests == 400
    for (budget, _), interval in zip(configs, intervals, strict=True):
        assert interval is not None
        tau = table.tau(budget)
        assert tau is not None and interval[0] < tau < interval[1]
        assert (interval[1] - interval[0]) / 2 == pytest.approx(_delta_half_width(requests, budget), rel=0.2)

    monkeypatch.setattr("telemetry.analysis.replay.MAX_SAMPLED_REQUESTS", 100)  # a reservoir of a quarter of them
    sampled = ReplayTable(16, ())
    for r in requests:
        sampled.add_request(r, [None] * len(r))
    assert len(sampled.samples) == 100 and sampled.tau(16) == table.tau(16)
    low, high = sampled.bootstrap([(16, None)])[0] or (0.0, 0.0)
    assert (high - low) / 2 == pytest.approx(_delta_half_width(requests, 16), rel=0.35)
    assert ReplayTable(16, ()).bootstrap([(16, None)]) == [None]


def test_the_bootstrap_counts_are_the_tables_own_under_every_cap() -> None:
    """Identical requests: every resample is the whole table, so each interval is its replayed tau exactly."""
    steps = [([1, 2, 4], [0, 1, 0, 2, 1, 3]), ([2, 5], [0, 1, 1, 0, 2, 2]), ([], [0, 0, 1, 1, 2, 2])]
    table = ReplayTable(6, (1, 2, 4))
    for _ in range(5):
        table.add_request([p for p, _ in steps], [r for _, r in steps])
    configs = [(b, k) for k in (None, 1, 2, 4) for b in range(1, 7) if k is None or k < b]
    for (budget, topk), interval in zip(configs, table.bootstrap(configs), strict=True):
        tau = table.tau(budget, topk)
        assert interval is not None and tau is not None
        assert interval == pytest.approx((tau, tau)), (budget, topk)
