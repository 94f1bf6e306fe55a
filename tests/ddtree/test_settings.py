"""A decode's settings are checked in one place, with one error type that names the setting; the CLI and the
server translate it into a flag and a request field; the tree shapes are resolved once, from the settings."""

from __future__ import annotations

import pytest

from ddtree.cli.common import flag_of
from ddtree.errors import SettingsError
from ddtree.methods import check_tree
from ddtree.schedule import BudgetSchedule, Choice
from ddtree.server.errors import settings_error
from ddtree.settings import (
    SEED_LIMIT,
    GenerationConfig,
    check_generation,
    check_prompt,
    check_request_settings,
    tree_shapes,
)


@pytest.mark.parametrize(
    ("method", "budget", "topk", "setting", "problem"),
    [
        ("ddtree", 0, None, "budget", "must be >= 1, got 0"),
        ("ar", 0, None, "budget", "must be >= 1, got 0"),
        ("ddtree", None, None, "budget", "must be >= 1 for ddtree, got none"),
        ("ddtree", 4, 0, "topk", "must be in 1..20 (the vocabulary size), got 0"),
        ("ddtree", 4, 21, "topk", "must be in 1..20 (the vocabulary size), got 21"),
        ("beam", 4, None, "method", "must be one of ar, dflash, ddtree, got 'beam'"),
    ],
)
def test_a_tree_is_checked_in_one_place(
    method: str, budget: int | None, topk: int | None, setting: str, problem: str
) -> None:
    with pytest.raises(SettingsError) as raised:
        check_tree(method, budget, topk, vocab_size=20)
    assert (raised.value.setting, raised.value.problem) == (setting, problem)
    assert str(raised.value) == f"{setting} {problem}"


def test_settings_that_fit_pass_and_ar_needs_no_budget() -> None:
    assert check_tree("ar", None, None).name == "ar"
    assert check_tree("ddtree", 8, 20, vocab_size=20).name == "ddtree"
    check_generation(GenerationConfig(temperature=0.7, top_p=0.9, top_k=5, logprobs=3), vocab_size=20, prompts=4)


@pytest.mark.parametrize(
    ("config", "setting"),
    [
        (GenerationConfig(max_new_tokens=0), "max_new_tokens"),
        (GenerationConfig(seed=SEED_LIMIT - 1), "seed"),  # two prompts: the second's seed is past an int64
        (GenerationConfig(seed=-1), "seed"),
        (GenerationConfig(temperature=float("inf")), "temperature"),
        (GenerationConfig(top_p=0.0), "top_p"),
        (GenerationConfig(top_k=-1), "top_k"),
        (GenerationConfig(logprobs=21), "logprobs"),
        (GenerationConfig(method="dflash", schedule=BudgetSchedule((Choice(1, "ar"),))), "schedule"),
    ],
)
def test_generation_settings_name_the_setting(config: GenerationConfig, setting: str) -> None:
    with pytest.raises(SettingsError) as raised:
        check_generation(config, prompts=2)
    assert raised.value.setting == setting and str(raised.value).startswith(setting + " ")


def test_the_cli_and_the_server_translate_the_one_error() -> None:
    with pytest.raises(SettingsError) as raised:
        check_generation(GenerationConfig(max_new_tokens=0))
    assert raised.value.named(flag_of(raised.value.setting)) == "--max-new-tokens must be >= 1, got 0"
    assert flag_of("schedule") == "--budget-schedule" and flag_of("topk") == "--topk"
    error = settings_error(raised.value)
    assert (error.status, error.param, error.message) == (400, "max_tokens", "max_tokens must be >= 1, got 0")
    with pytest.raises(SettingsError) as sampled:
        check_request_settings(8, 0.5, 1.5, 0, None)
    assert settings_error(sampled.value).param == "top_p"


def test_the_trees_are_resolved_once_from_the_settings() -> None:
    depth = 6
    assert tree_shapes(GenerationConfig(method="ar"), depth).widest.budget == 0
    chain = tree_shapes(GenerationConfig(method="dflash", budget=99), depth).widest
    assert (chain.budget, chain.topk) == (depth, 1)  # a chain: budget = depth whatever was asked
    schedule = BudgetSchedule((Choice(1, "ddtree", 12), Choice(4, "ar"), Choice(8, "ddtree", 3, 2)))
    shapes = tree_shapes(GenerationConfig(schedule=schedule), depth)
    assert [(s.method, s.budget, s.topk) for s in shapes.shapes] == [
        ("ddtree", 12, None),
        ("ar", 0, None),
        ("ddtree", 3, 2),
    ]
    assert shapes.widest.budget == 12 and shapes.shape_for(4).method == "ar"


def test_a_prompt_needs_tokens_within_the_vocabulary() -> None:
    check_prompt([0, 257], 258)
    check_prompt([10**9])  # no vocabulary given: only the count
    with pytest.raises(SettingsError, match="prompt has no tokens") as empty:
        check_prompt([], 258)
    assert empty.value.setting == "prompt"
    with pytest.raises(SettingsError, match=r"outside the vocabulary \[0, 258\): -1 at index 0, 258 at index 2$"):
        check_prompt([-1, 5, 258], 258)
    with pytest.raises(SettingsError, match=r"10000000000000000000\.\.\. at index 0, .* and 1 more$"):
        check_prompt([10**40, 300, 301, 302, 303, 304], 258)
