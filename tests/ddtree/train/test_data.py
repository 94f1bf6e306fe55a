from __future__ import annotations

import random
from pathlib import Path

import pytest
from safetensors import safe_open

from ddtree.cli import main
from ddtree.errors import UserError
from ddtree.train.bundle import read_manifest
from ddtree.train.data import TrainingSequence, pack_sequences, read_sequences, unpack_sequences, write_sequences


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
