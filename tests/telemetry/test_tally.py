"""The one derivation of drafts accepted per depth, which `/metrics` and the step metrics both read."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from telemetry.tally import SpecTally, reached_per_depth


def test_a_step_reaches_every_depth_up_to_its_accepted_drafts() -> None:
    assert reached_per_depth([0, 3, 1]) == [2, 1, 1]
    assert reached_per_depth([0, 3, 1], depth=2) == [2, 1]  # deeper steps count up to the depth asked
    assert reached_per_depth([2], depth=4) == [1, 1, 0, 0]
    assert reached_per_depth([]) == []


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 64)), max_size=12), st.integers(1, 4))
def test_a_tally_in_parts_equals_the_tally_at_once(steps: list[tuple[int, int]], parts: int) -> None:
    whole, pieces = SpecTally(), SpecTally()
    whole.add([a for a, _ in steps], [b for _, b in steps])
    for i in range(parts):
        part = steps[i::parts]
        pieces.add([a for a, _ in part], [b for _, b in part])
    assert whole == pieces
    assert whole.accepted == sum(a for a, _ in steps) == sum(whole.per_depth)
    assert whole.draft_tokens == sum(b for _, b in steps)
    assert sum(whole.drafts.values()) == len(steps)
    assert bool(whole) == bool(steps)


def test_a_tally_refuses_counts_that_do_not_pair_up() -> None:
    with pytest.raises(ValueError, match="2 accepted counts but 1 budgets"):
        SpecTally().add([1, 2], [8])
