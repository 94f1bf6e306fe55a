"""`ddtree drafter eval`: teacher-forced held-out tau beside the decoded one, as a table or JSON; bad values
are one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree.cli.main import main


def _argv(tiny_dirs: tuple[Path, Path], *extra: str) -> list[str]:
    target, drafter = tiny_dirs
    return ["drafter", "eval", str(drafter), "--model", str(target), "--device", "cpu", "--num-prompts", "3", *extra]


def test_eval_prints_both_measures_and_they_agree(
    tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_argv(tiny_dirs, "--max-new-tokens", "6", "--budgets", "4,16", "--decoded", "--json")) == 0
    result = json.loads(capsys.readouterr().out)
    ours, decoded = result["teacher-forced"], result["decoded"]
    assert ours["measure"] == "teacher-forced" and decoded["measure"] == "decoded"
    assert set(ours["tau"]) == {"dflash", "ddtree B=4", "ddtree B=16"} == set(decoded["tau"])
    assert ours["prompts"] == 3 and ours["max_new_tokens"] == 6
    for label, tau in ours["tau"].items():
        assert tau == pytest.approx(decoded["tau"][label], rel=1e-9), label
    assert main(_argv(tiny_dirs, "--max-new-tokens", "6", "--decoded")) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("3 held-out prompts, 6 new tokens, greedy")
    assert table[1].split() == ["method", "teacher-forced", "decoded", "apart"]
    assert [line.split()[0] for line in table[2:]] == ["dflash", "ddtree"] and table[2].endswith("+0.0%")


def test_per_depth_rates_agree_with_each_other_and_print(
    tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The chain's rate at depth 1 is the share of positions whose first token is the drafter's top 1."""
    assert main(_argv(tiny_dirs, "--max-new-tokens", "8", "--per-depth", "--json")) == 0
    depth = json.loads(capsys.readouterr().out)["per-depth"]
    rates, top = depth["conditional"], depth["first_in_top"]
    assert len(top) == 4 and top == sorted(top) and all(0 <= r <= 1 for r in rates + top)
    assert rates[0] == top[0] and len(rates) > 1
    assert main(_argv(tiny_dirs, "--max-new-tokens", "8", "--per-depth")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("chain, each depth's") and lines[-1].split()[-4:] == [f"{v:.3f}" for v in top]


@pytest.mark.parametrize(("extra", "message"), [(["--budgets", "0"], "--budgets"), (["--num-prompts", "0"], "prompts")])
def test_bad_eval_flags_exit_2_with_one_line(
    tiny_dirs: tuple[Path, Path], extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_argv(tiny_dirs, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ddtree: error: ") and message in err and len(err.splitlines()) == 1
