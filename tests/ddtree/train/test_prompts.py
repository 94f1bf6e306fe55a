from __future__ import annotations

import json
from collections import Counter
from importlib import resources

from ddtree.bench import heldout_prompts
from ddtree.train.prompts import TOPIC_TEMPLATES, WORD_LISTS, training_prompts
from tests import tools


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
