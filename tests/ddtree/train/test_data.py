from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from ddtree.cli.main import main
from ddtree.errors import UserError
from ddtree.models.chat import eos_ids
from ddtree.models.pair import load_models
from ddtree.models.target import Target
from ddtree.train.bundle import read_manifest
from ddtree.train.data import (
    TrainingSequence,
    _continued,
    chat_ids,
    generate_conversations,
    generate_responses,
    next_turn_ids,
    pack_sequences,
    read_sequences,
    unpack_sequences,
    write_sequences,
)
from ddtree.train.prompts import FOLLOW_UPS, write_prompt_file

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
USER_ONLY = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
CONVERSATIONS = [["Name a colour.", "And another one?"], ["Count to three."], ["Hi", "Why?", "Really?"]]


def _sequences(seed: int, count: int, top: int) -> list[TrainingSequence]:
    rng = random.Random(seed)
    seqs = []
    for _ in range(count):
        prompt = rng.randint(1, 8)
        response = rng.choice([0, 1, rng.randint(2, 60)])  # some too short to train on
        seqs.append(TrainingSequence([rng.randrange(top) for _ in range(prompt + response)], prompt))
    return seqs


def test_packed_data_reads_back_as_the_jsonl_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seqs = _sequences(0, 200, top=49152)
    write_sequences(tmp_path / "data.jsonl", seqs)
    argv = ["drafter", "pack-data", str(tmp_path / "data.jsonl"), str(tmp_path / "packed"), "--shard-mib", "0.002"]
    assert main(argv) == 0
    assert "packed 200 sequences" in capsys.readouterr().out
    manifest = read_manifest(tmp_path / "packed" / "data.json")
    assert len(manifest.files) > 1 and all(f.bytes <= 0.002 * 2**20 for f in manifest.files)
    assert unpack_sequences(tmp_path / "packed") == seqs  # all of them, in order
    assert read_sequences(tmp_path / "packed") == read_sequences(tmp_path / "data.jsonl")
    with safe_open(str(tmp_path / "packed" / manifest.files[0].name), "pt") as f:
        assert str(f.get_slice("ids").get_dtype()) == "U16"
    jsonl = (tmp_path / "data.jsonl").stat().st_size
    assert sum(f.bytes for f in manifest.files) < 0.5 * jsonl


def test_pack_data_merges_jsonl_files_and_packed_directories_in_order(tmp_path: Path) -> None:
    first, second = _sequences(3, 40, top=500), _sequences(4, 25, top=500)
    pack_sequences(first, tmp_path / "old")
    write_sequences(tmp_path / "new.jsonl", second)
    argv = ["drafter", "pack-data", str(tmp_path / "old"), str(tmp_path / "new.jsonl"), str(tmp_path / "both")]
    assert main(argv) == 0
    assert unpack_sequences(tmp_path / "both") == first + second


def test_ids_beyond_uint16_pack_as_int32(tmp_path: Path) -> None:
    seqs = _sequences(1, 30, top=200_000)
    meta = pack_sequences(seqs, tmp_path)
    assert meta["ids_dtype"] == "int32" and meta["sequences"] == 30
    assert meta["tokens"] == sum(len(s.ids) for s in seqs)
    assert unpack_sequences(tmp_path) == seqs


def test_a_missing_or_damaged_shard_is_named(tmp_path: Path) -> None:
    pack_sequences(_sequences(2, 100, top=300), tmp_path, shard_bytes=2048)
    manifest = read_manifest(tmp_path / "data.json")
    damaged, gone = manifest.files[0].name, manifest.files[-1].name
    (tmp_path / gone).unlink()
    raw = (tmp_path / damaged).read_bytes()
    (tmp_path / damaged).write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))
    with pytest.raises(UserError, match=f"{damaged}, {gone}"):
        read_sequences(tmp_path)


def test_a_sequence_larger_than_a_shard_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sequence 0 alone needs 2008 bytes"):
        pack_sequences([TrainingSequence(list(range(1000)), 1)], tmp_path, shard_bytes=1024)


@pytest.fixture(scope="module")
def tiny_target(tiny_dirs: tuple[Path, Path]) -> tuple[Target, Any]:
    """The tiny target on disk and its byte tokenizer (no chat template), in float32 on the CPU."""
    target, _, tokenizer = load_models(str(tiny_dirs[0]), None, "cpu", "float32")
    return target, tokenizer


@pytest.mark.parametrize("template", [None, TEMPLATE])
def test_a_later_turn_follows_the_targets_own_reply(
    tiny_target: tuple[Target, Any], template: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, tokenizer = tiny_target
    monkeypatch.setattr(tokenizer, "chat_template", template)
    eos = eos_ids(tokenizer, target)
    seqs = generate_conversations(target, tokenizer, CONVERSATIONS, 10, eos, batch_size=2, quiet=True)
    for turns, seq in zip(CONVERSATIONS, seqs, strict=True):
        context = chat_ids(tokenizer, turns[0])
        for turn in turns[1:]:
            (alone,) = generate_responses(target, [context], 10, eos, quiet=True)  # the reply, asked alone
            assert seq.ids[: len(alone.ids)] == alone.ids
            context = alone.ids + next_turn_ids(tokenizer, turn)
        assert seq.ids[: seq.prompt_len] == context, "the prompt is everything before the last reply"
        assert generate_responses(target, [context], 10, eos, quiet=True) == [seq]
        text = tokenizer.decode(seq.ids)
        assert all(turn in text for turn in turns)


def test_the_turns_between_replies_are_the_chat_templates(
    tiny_target: tuple[Target, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, tokenizer = tiny_target
    assert tokenizer.decode(next_turn_ids(tokenizer, "Why?")) == "\n\nWhy?"
    monkeypatch.setattr(tokenizer, "chat_template", TEMPLATE)
    assert tokenizer.decode(next_turn_ids(tokenizer, "Why?")) == "\n<user>Why?\n<assistant>"
    monkeypatch.setattr(tokenizer, "chat_template", USER_ONLY)
    with pytest.raises(ValueError, match="rewrites an earlier turn"):
        next_turn_ids(tokenizer, "Why?")


def test_an_end_of_sequence_token_stands_for_the_templates_end_of_turn() -> None:
    eos = (7, 9)
    assert _continued([1, 2, 7], [7, 3, 4], eos) == [1, 2, 7, 3, 4], "the reply ended with the turn's end"
    assert _continued([1, 2, 9], [7, 3, 4], eos) == [1, 2, 9, 7, 3, 4], "another end: the template's follows"
    assert _continued([1, 2, 3], [3, 4], eos) == [1, 2, 3, 3, 4], "a reply cut at the length limit"


def test_drafter_data_takes_conversations(
    tiny_dirs: tuple[Path, Path], tiny_target: tuple[Target, Any], tmp_path: Path
) -> None:
    write_prompt_file(tmp_path / "prompts.jsonl", CONVERSATIONS)
    argv = ["drafter", "data", "--target", str(tiny_dirs[0]), "--prompts", str(tmp_path / "prompts.jsonl")]
    argv += ["--max-new-tokens", "6", "--device", "cpu", "--dtype", "float32", "--multi-turn", "1"]
    assert main([*argv, "--out", str(tmp_path / "data.jsonl")]) == 0
    records = [json.loads(line) for line in (tmp_path / "data.jsonl").read_text().splitlines()]
    texts = [tiny_target[1].decode(r["ids"][: r["prompt_len"]]) for r in records]
    assert len(texts) == len(CONVERSATIONS)
    assert all(turn in text for text, turns in zip(texts, CONVERSATIONS, strict=True) for turn in turns)
    assert any(f in texts[1] for f in FOLLOW_UPS), "--multi-turn 1: a follow-up for the one-turn prompt"
    (tmp_path / "empty.jsonl").write_text("")
    assert main([*argv[:4], "--prompts", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "x.jsonl")]) == 2


def test_a_batch_out_of_device_memory_is_retried_smaller(
    tiny_data: list[TrainingSequence], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The responses are the same when every batch over 3 prompts runs out of memory: the
    size halves until a batch fits, each retry on a fresh engine, and the rest keep that size."""
    from ddtree.engine.engine import Engine
    from tests.ddtree.train.conftest import VOCAB
    from tests.helpers import random_prompts, tiny_pair

    target, _ = tiny_pair(1, vocab=VOCAB)
    prompts = random_prompts(1, 24, vocab=VOCAB, low=2, high=6)  # the `tiny_data` fixture's prompts
    real = Engine.generate
    sizes: list[int] = []

    engines: list[int] = []

    def small_memory(self: Engine, batch: list[list[int]], config: Any) -> Any:
        sizes.append(len(batch))
        engines.append(id(self))
        if len(batch) > 3:
            raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")
        return real(self, batch, config)

    monkeypatch.setattr(Engine, "generate", small_memory)
    seqs = generate_responses(target, prompts, max_new_tokens=24, eos_token_ids=(), batch_size=8)
    assert seqs == tiny_data
    assert sizes[:3] == [8, 4, 2] and set(sizes[3:]) == {2}
    # each retry runs on a fresh engine (the failed size's caches dropped), which then serves the rest
    assert len(set(engines[:3])) == 3 and set(engines[3:]) == {engines[2]}
    assert "going on with 4" in capsys.readouterr().err


def test_out_of_memory_at_one_prompt_a_batch_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddtree.engine.engine import Engine
    from tests.helpers import tiny_pair

    def no_memory(self: Engine, batch: list[list[int]], config: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")

    monkeypatch.setattr(Engine, "generate", no_memory)
    target, _ = tiny_pair(1, vocab=16)
    with pytest.raises(torch.OutOfMemoryError):
        generate_responses(target, [[1, 2], [3, 4]], max_new_tokens=4, eos_token_ids=(), batch_size=2, quiet=True)
