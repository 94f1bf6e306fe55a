"""`ddtree analyze`'s table of what the tree added over its chain, on a hand-made log with exact numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from matplotlib.figure import Figure

from ddtree.cli.main import main
from telemetry import semconv as sc
from telemetry.analysis.chain import NO_RANKS, chain_table, plot_chain
from telemetry.analysis.digest import Digest


def _line(method: str, budget: int, accepted: list[int], ranks: list[list[int]] | None, offered: list[int]) -> str:
    line: dict[str, Any] = {
        "event": sc.EVENT_STEP,
        sc.FIELD_STEP: 0,
        sc.FIELD_METHOD: method,
        sc.FIELD_BUDGET: budget,
        sc.FIELD_TOPK: None,
        sc.FIELD_ACCEPTED_DRAFTS: accepted,
        sc.FIELD_NODES_PER_DEPTH: [budget],
        sc.FIELD_ACCEPTED_PER_DEPTH: [1],
        sc.FIELD_EMITTED: [a + 1 for a in accepted],
        sc.FIELD_STAGE_MS: dict.fromkeys(sc.STAGES, 0.1),
    }
    if ranks is not None:
        line[sc.FIELD_ACCEPTED_RANKS] = ranks
        line[sc.FIELD_OFF_CHAIN_PARENT_NODES_PER_DEPTH] = offered
    return json.dumps(line)


# Three request-steps of ddtree B=8 with ranks: [0, 2, 0] (chain 1: depths 2 and 3 added, 3's parent off chain),
# [0] (all on the chain) and [1, 0] (chain 0: depths 1 and 2 added, 2's parent off chain); dflash lines from an
# older log without ranks.
LOG = [
    _line("ddtree", 8, [3, 1], [[0, 2, 0], [0]], [0, 2, 1]),
    _line("ddtree", 8, [2], [[1, 0]], [0, 3]),
    _line("dflash", 4, [1], None, []),
]


def test_the_tree_added_counts_are_exact() -> None:
    config = Digest.of(LOG).summary()["configs"]
    chain = {c["label"]: c["chain"] for c in config}
    assert chain["dflash"] is None, "a log without ranks says so"
    got = chain["ddtree B=8"]
    assert got["request_steps"] == 3
    assert got["accepted_per_depth"] == [3, 2, 1]
    assert got["on_chain_per_depth"] == [2, 0, 0]
    assert got["tree_added_per_depth"] == [1, 2, 1]
    assert got["off_chain_per_depth"] == [1, 1, 0]
    assert got["off_chain_parent_accepted_per_depth"] == [0, 1, 1]
    assert got["off_chain_parent_nodes_per_depth"] == [0, 5, 1]
    assert got["tree_tau"] == pytest.approx(3.0) and got["chain_tau"] == pytest.approx(5 / 3)
    assert got["tree_tau"] - got["chain_tau"] == pytest.approx(sum(got["tree_added_per_depth"]) / 3)


def test_analyze_prints_the_table_and_says_when_a_log_has_no_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "run.jsonl"
    log.write_text("\n".join(LOG) + "\n")
    assert main(["analyze", str(log)]) == 0
    out = capsys.readouterr().out
    assert "ddtree B=8: 3 request-steps with ranks; tau 3.000 (tree) against 1.667 (its chain prefix)" in out
    assert "the tree added +1.333" in out
    rows = out[out.index("what the tree added") :].splitlines()
    assert rows[3].split()[:5] == ["1", "1.000", "0.667", "0.333", "0.333"]
    assert rows[4].split() == ["2", "0.667", "0.000", "0.667", "0.333", "1", "/", "5", "=", "0.200"]
    old = tmp_path / "old.jsonl"
    old.write_text(LOG[-1] + "\n")
    assert main(["analyze", str(old)]) == 0
    assert NO_RANKS in capsys.readouterr().out


def test_the_plot_draws_the_tree_and_its_chain_or_says_there_are_no_ranks() -> None:
    digest = Digest.of(LOG)
    items = [(g.label, g.chain) for g in digest.sorted_configs()]
    ax = Figure().add_subplot()
    plot_chain(ax, items)
    assert [line.get_label() for line in ax.get_lines()] == [
        "ddtree B=8 tree (tau +1.33 over its chain)",
        "ddtree B=8 its chain",
    ]
    assert list(ax.get_lines()[0].get_ydata()) == pytest.approx([1.0, 2 / 3, 1 / 3])
    empty = Figure().add_subplot()
    plot_chain(empty, items[1:])  # dflash alone: no ranks
    assert not empty.get_lines() and empty.texts[0].get_text() == "no accepted ranks in the log"
    assert chain_table(items[1:]) == [NO_RANKS]
