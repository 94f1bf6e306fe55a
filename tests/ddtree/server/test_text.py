"""Incremental detokenization and stop strings, on the byte tokenizer (one token per byte)."""

from __future__ import annotations

import random

import pytest

from ddtree.models.tiny import byte_tokenizer
from ddtree.server.text import Detokenizer, StopMatcher, TextStream

TOKENIZER = byte_tokenizer()


def ids(text: str) -> list[int]:
    return [int(i) for i in TOKENIZER.encode(text)]


def full(tokens: list[int]) -> str:
    return str(TOKENIZER.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False))


@pytest.mark.parametrize("text", ["plain ascii", "héllo → 🌳 wörld", "日本語のテキスト", "a\ufffdb"])
def test_pieces_join_to_the_whole_decode_and_never_split_a_character(text: str) -> None:
    detok = Detokenizer(TOKENIZER, ids("ctx"))
    pieces = [detok.push([t]) for t in ids(text)] + [detok.flush()]
    assert "".join(pieces) == text
    if "\ufffd" not in text:  # a character split over tokens comes out whole, never as U+FFFD
        assert all("\ufffd" not in p for p in pieces)


def test_random_bytes_with_end_of_text_decode_as_a_whole() -> None:
    rng = random.Random(0)
    eos = TOKENIZER.eos_token_id
    for _ in range(20):
        tokens = [rng.choice([*range(256), eos]) for _ in range(rng.randint(1, 40))]
        detok = Detokenizer(TOKENIZER, [])
        pieces = [detok.push(tokens[i : i + 3]) for i in range(0, len(tokens), 3)] + [detok.flush()]
        assert "".join(pieces) == full(tokens)


class DecodeOnly:
    """The tokenizer as a slow one looks to the detokenizer: `decode`, no Rust backend."""

    eos_token_id = TOKENIZER.eos_token_id

    def decode(self, tokens: list[int], **kwargs: bool) -> str:
        return str(TOKENIZER.decode(tokens, **kwargs))


def test_the_backend_decode_gives_the_pieces_transformers_decode_gives() -> None:
    assert TOKENIZER.backend_tokenizer is not None
    rng = random.Random(1)
    for _ in range(20):
        tokens = [rng.choice([*range(256), DecodeOnly.eos_token_id]) for _ in range(rng.randint(1, 40))]
        fast, slow = Detokenizer(TOKENIZER, tokens[:2]), Detokenizer(DecodeOnly(), tokens[:2])
        for i in range(2, len(tokens), 2):
            assert fast.push(tokens[i : i + 2]) == slow.push(tokens[i : i + 2])
        assert fast.flush() == slow.flush()


def test_stop_matcher_holds_back_only_what_may_start_a_stop() -> None:
    m = StopMatcher(["abc", "xy"])
    assert m.push("123a") == "123"  # "a" may begin "abc"
    assert m.push("b") == ""
    assert m.push("d") == "abd"  # not a stop after all
    assert m.push("zzx") == "zz"
    assert m.push("y tail") == "" and m.stopped
    assert m.push("more") == "" and m.flush() == ""


def test_stop_matcher_cuts_at_the_earliest_stop_and_flushes_at_the_end() -> None:
    m = StopMatcher(["world", "lo w"])
    assert m.push("hello world") == "hel" and m.stopped
    n = StopMatcher(["END"])
    assert n.push("the EN") == "the " and n.flush() == "EN"
    with pytest.raises(ValueError, match="empty"):
        StopMatcher([""])


def test_text_stream_counts_tokens_to_the_one_completing_the_stop() -> None:
    stream = TextStream(TOKENIZER, ids("p"), ["é!"])
    out = stream.feed(ids("ab"))
    out += stream.feed(ids("cé!de"))  # "é" is two bytes: the stop spans three tokens
    assert out == "abc" and stream.stopped
    assert stream.tokens == len(ids("abcé!"))
    assert stream.finish() == ""


def test_text_stream_without_stops_releases_all() -> None:
    stream = TextStream(TOKENIZER, [], [])
    tokens = [*ids("naïve "), TOKENIZER.eos_token_id]
    assert stream.feed(tokens[:3]) + stream.feed(tokens[3:]) + stream.finish() == "naïve "
    assert stream.tokens == len(tokens) and not stream.stopped
