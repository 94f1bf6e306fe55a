"""A slot's bookkeeping: the limit and end-of-sequence rules, the unread first token, the row bucket."""

from __future__ import annotations

from typing import Any

from ddtree.engine.requests import FirstTokens, Request, RequestOutput, Slot, emit, group_sizes, row_bucket, row_counts


def _slot(new: int, eos: tuple[int, ...] = (), first: tuple[FirstTokens, int] | None = None) -> Slot:
    return Slot(Request([1], new, eos_token_ids=eos), RequestOutput(), 1, first)


def test_emit_stops_at_the_limit_or_the_first_end_of_sequence_token() -> None:
    limited = _slot(3)
    emit(limited, [4, 5])
    assert not limited.output.finished
    emit(limited, [6, 7, 8])
    assert limited.output.token_ids == [4, 5, 6] and limited.output.finish_reason == "length"
    stopped = _slot(10, eos=(9,))
    emit(stopped, [4, 9, 5])
    assert stopped.output.token_ids == [4, 9] and stopped.output.finish_reason == "stop"


def test_the_first_token_is_read_once_for_the_whole_group_and_given_once() -> None:
    waits: list[Any] = []

    def wait(ticket: Any) -> list[int]:
        waits.append(ticket)
        return [11, 12]

    group = FirstTokens("ticket", wait)
    a, b = _slot(5, first=(group, 0)), _slot(1, first=(group, 1))
    assert waits == [], "nothing is read before it is needed"
    assert a.take_first() is False and b.take_first() is True, "b's limit is one token"
    assert a.output.token_ids == [11] and b.output.token_ids == [12] and waits == ["ticket"]
    assert a.take_first() is False and a.output.token_ids == [11], "given once"


def test_the_row_bucket_is_a_power_of_two_past_the_last_slot_decoding() -> None:
    done = _slot(1)
    emit(done, [3])
    pending = _slot(4, first=(FirstTokens(None, lambda t: [0]), 0))
    assert row_bucket([None, None, None], 8) == 1
    assert row_bucket([_slot(2), None, pending, done, None], 8) == 4, "an unread first token still decodes"
    assert row_bucket([None] * 5 + [_slot(2)], 6) == 6, "at most the session's slots"


def test_a_join_splits_into_the_largest_row_counts_that_fit() -> None:
    assert group_sizes(47, row_counts(64)) == [32, 8, 4, 2, 1]
    assert group_sizes(48, row_counts(48)) == [48]
    assert group_sizes(47, row_counts(48)) == [32, 8, 4, 2, 1]
    assert all(sum(group_sizes(n, row_counts(12))) == n for n in range(13))
