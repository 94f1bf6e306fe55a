from __future__ import annotations

import json
import random
import re
import string
from collections import Counter
from importlib import resources
from pathlib import Path

import pytest

from ddtree.cli.main import main
from ddtree.data import heldout_prompts
from ddtree.errors import UserError
from ddtree.train import prompts
from ddtree.train.prompts import (
    FIRST,
    FOLLOW_UPS,
    TOPIC_TEMPLATES,
    WORD_LISTS,
    add_follow_ups,
    read_prompt_file,
    training_prompts,
    write_prompt_file,
)
from tests import tools

TEMPLATE_SETS = {
    name: getattr(prompts, name)
    for name in (
        "TEMPLATES",
        "TOPIC_TEMPLATES",
        "PROSE_TEMPLATES",
        "MORE_CODE_TEMPLATES",
        "CODE_PAIR_TEMPLATES",
        "MORE_TOPIC_TEMPLATES",
        "WORD_PAIR_TEMPLATES",
        "MORE_PROSE_TEMPLATES",
        "MATH_TEMPLATES",
    )
}


def _pattern(template: str) -> re.Pattern[str]:
    """A regular expression for the prompts a template makes: its text, any text in place of each field."""
    parts = string.Formatter().parse(template)
    return re.compile("".join(re.escape(text) + ("(.+?)" if field else "") for text, field, _, _ in parts), re.S)


PATTERNS = {name: [_pattern(t) for t in templates] for name, templates in TEMPLATE_SETS.items()}


@pytest.fixture
def small_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[str]]:
    """A word list of 3,000 made-up words and a fortunes file of 400 sayings in place of Debian's."""
    rng = random.Random(0)
    words = sorted({"".join(rng.choices(string.ascii_lowercase, k=rng.randint(5, 9))) for _ in range(3000)})
    sayings = [f"Saying {i}: the {rng.choice(words)} is never where you left it." for i in range(400)]
    (tmp_path / "words").write_text("\n".join(words) + "\n")
    (tmp_path / "fortunes").mkdir()
    (tmp_path / "fortunes" / "made-up").write_text("\n%\n".join(sayings) + "\n")
    monkeypatch.setattr(prompts, "WORD_LISTS", (tmp_path / "words",))
    monkeypatch.setattr(prompts, "FORTUNE_DIRS", (tmp_path / "fortunes",))
    return words, sayings


def test_heldout_set_mixes_kinds_and_is_not_trained_on() -> None:
    path = resources.files("ddtree.data").joinpath("heldout_prompts.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) >= 60
    assert Counter(r["kind"] for r in records).keys() == {"code", "prose", "question"}
    held = set(heldout_prompts())
    assert len(held) == len(records)
    assert not held & set(training_prompts(100_000, exclude=held))
    assert not held & set(training_prompts(100_000)), "the builder's templates never produce a held-out prompt"


def test_training_prompts_are_distinct_deterministic_and_mixed() -> None:
    a, b, c = training_prompts(3000, seed=1), training_prompts(3000, seed=1), training_prompts(3000, seed=2)
    assert a == b and a != c
    assert len(set(a)) == len(a) == 3000
    assert sum("`" in p for p in a) > 500, "code prompts from the standard library"


@tools.WORD_LIST
def test_training_prompts_draw_topics_from_the_word_list() -> None:
    assert any(p.is_file() for p in WORD_LISTS)
    stems = [t.split("{word}")[0] for t in TOPIC_TEMPLATES]
    assert sum(p.startswith(tuple(stems)) for p in training_prompts(3000, seed=1)) > 500


def test_there_are_120k_distinct_prompts_and_the_first_recipes_come_first() -> None:
    held = set(heldout_prompts())
    many = training_prompts(120_000, seed=3, exclude=held)
    assert len(many) == len(set(many)) == 120_000
    assert not held & set(many)
    assert many[:FIRST] == training_prompts(FIRST, seed=3, exclude=held), "a longer list starts with a shorter"
    assert many[:1000] != training_prompts(1000, seed=4, exclude=held)


def test_every_template_appears_and_no_stream_crowds_out_the_others(small_sources: tuple[list[str], list[str]]) -> None:
    words, sayings = small_sources
    made = training_prompts(30_000, seed=5)
    assert made == training_prompts(30_000, seed=5) and len(set(made)) == len(made) == 30_000
    for name, patterns in PATTERNS.items():
        for pattern in patterns:
            assert any(pattern.fullmatch(p) for p in made), f"{name}: {pattern.pattern!r} never used"
    everything = "\n".join(made)
    assert all(w in everything for w in words) and all(s in everything for s in sayings), "every word and saying"
    kinds = Counter(
        next(n for n, patterns in PATTERNS.items() if any(r.fullmatch(p) for r in patterns)) for p in made[-7000:]
    )
    assert max(kinds.values()) < 0.5 * sum(kinds.values()), kinds


def test_follow_ups_are_drawn_per_conversation() -> None:
    firsts = [[f"question {i}"] for i in range(4000)]
    mixed = add_follow_ups([*firsts, ["a", "b"]], 0.25, seed=1)
    two = [c for c in mixed[:-1] if len(c) == 2]
    assert 0.2 < len(two) / len(firsts) < 0.3
    assert all(c[1] in FOLLOW_UPS for c in two) and {c[1] for c in two} == set(FOLLOW_UPS)
    assert [c[0] for c in mixed[:-1]] == [c[0] for c in firsts] and mixed[-1] == ["a", "b"]
    assert add_follow_ups(firsts[:1000], 0.25, seed=1) == mixed[:1000], "a longer list starts the same"
    assert add_follow_ups(firsts, 0.25, seed=2) != mixed[:-1]
    assert add_follow_ups(firsts, 0.0) == firsts
    with pytest.raises(ValueError, match=re.escape("between 0 and 1, got 1.5")):
        add_follow_ups(firsts, 1.5)


def test_a_prompt_file_holds_one_turn_or_several(tmp_path: Path) -> None:
    conversations = [["one turn"], ["first", "second"], ["a", "b", "c"]]
    write_prompt_file(tmp_path / "p.jsonl", conversations)
    lines = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert lines[0] == {"prompt": "one turn"} and lines[1] == {"messages": ["first", "second"]}
    assert read_prompt_file(tmp_path / "p.jsonl") == conversations
    (tmp_path / "heldout.jsonl").write_text('{"kind": "code", "prompt": "x"}\n\n')
    assert read_prompt_file(tmp_path / "heldout.jsonl") == [["x"]], "other keys and blank lines are ignored"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"messages": []}', "at least one"),
        ('{"messages": ["a", 3]}', "non-empty strings"),
        ('{"prompt": "a", "messages": ["b"]}', "not both"),
        ('["a"]', '"prompt" or "messages"'),
        ("{not json", "line 2"),
    ],
)
def test_a_bad_prompt_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    (tmp_path / "p.jsonl").write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(UserError, match=re.escape(message)):
        read_prompt_file(tmp_path / "p.jsonl")


def test_drafter_data_writes_the_prompts_it_would_use(tmp_path: Path) -> None:
    out = tmp_path / "prompts.jsonl"
    argv = ["drafter", "data", "--write-prompts", "--num-prompts", "500", "--multi-turn", "0.3", "--seed", "2"]
    assert main([*argv, "--out", str(out)]) == 0
    texts = training_prompts(500, seed=2, exclude=set(heldout_prompts()))
    assert read_prompt_file(out) == add_follow_ups([[t] for t in texts], 0.3, seed=2)
    again = tmp_path / "again.jsonl"
    assert main(["drafter", "data", "--write-prompts", "--prompts", str(out), "--out", str(again)]) == 0
    assert again.read_text() == out.read_text()
    assert main([*argv[:-4], "--multi-turn", "2", "--out", str(out)]) == 2


def test_drafter_data_can_leave_out_the_prompts_of_earlier_files(tmp_path: Path) -> None:
    first, fresh = tmp_path / "first.jsonl", tmp_path / "fresh.jsonl"
    argv = ["drafter", "data", "--write-prompts", "--num-prompts", "300"]
    assert main([*argv, "--multi-turn", "0.5", "--out", str(first)]) == 0
    assert main([*argv, "--exclude-prompts", str(first), "--out", str(fresh)]) == 0
    used = {turns[0] for turns in read_prompt_file(first)}
    new = [turns[0] for turns in read_prompt_file(fresh)]
    assert len(new) == 300 and not used & set(new)
    assert main([*argv, "--exclude-prompts", str(tmp_path / "absent.jsonl"), "--out", str(fresh)]) == 2
