from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from ddtree.cli.main import main
from ddtree.train.bundle import copy_part, gather, load_bundle, plan_parts, read_manifest, save_bundle, split_tensors

SAFE = re.compile(r"[A-Za-z0-9._-]+")
KIB = 1024


def _bundle(
    directory: Path, name: str, seed: int, sizes: list[int], shard_bytes: int = 4 * KIB
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {f"t{i:02d}": torch.randn(n, generator=gen) for i, n in enumerate(sizes)}
    save_bundle(directory, name, split_tensors(tensors, shard_bytes), {"seed": seed}, shard_bytes)
    return tensors


def test_parts_stay_within_the_limits_and_gather_back_in_any_order(tmp_path: Path) -> None:
    state = _bundle(tmp_path / "state", "state", 0, [300, 700, 200, 900, 100, 500])
    data = _bundle(tmp_path / "data", "data", 1, [800, 400])
    limit_files, limit_bytes = 3, 8 * KIB
    count = len(
        plan_parts(
            [read_manifest(tmp_path / "data" / "data.json"), read_manifest(tmp_path / "state" / "state.json")],
            limit_files,
            limit_bytes,
        )
    )
    assert count > 2
    for part in range(1, count + 1):
        names, total = copy_part(
            [tmp_path / "data", tmp_path / "state"], tmp_path / f"out{part}", part, limit_files, limit_bytes
        )
        assert total == count and sorted(names) == sorted(p.name for p in (tmp_path / f"out{part}").iterdir())
        sizes = [(tmp_path / f"out{part}" / n).stat().st_size for n in names]
        assert len(names) <= limit_files and sum(sizes) <= limit_bytes and all(SAFE.fullmatch(n) for n in names)
    root = tmp_path / "root"
    latest: dict[str, list[str]] = {}
    for part in reversed(range(1, count + 1)):
        latest.update(gather(tmp_path / f"out{part}", root))
        complete = latest.keys() == {"data", "state"} and not any(latest.values())
        assert complete == (part == 1)  # complete once every part is in, not before
    for name, tensors in (("state", state), ("data", data)):
        shards, meta = load_bundle(root / name, name)
        merged = {k: v for shard in shards for k, v in shard.items()}
        assert merged.keys() == tensors.keys() and all(torch.equal(merged[k], tensors[k]) for k in tensors)
        assert meta == {"seed": 0 if name == "state" else 1}


def test_gather_reports_what_is_still_missing(tmp_path: Path) -> None:
    _bundle(tmp_path / "b", "state", 0, [900] * 6)
    manifest = read_manifest(tmp_path / "b" / "state.json")
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(manifest.path, partial)
    shutil.copy(tmp_path / "b" / manifest.files[0].name, partial)
    missing = gather(partial, tmp_path / "root")
    assert missing == {"state": [f.name for f in manifest.files[1:]]}
    with pytest.raises(ValueError, match="incomplete: 1 of"):
        load_bundle(tmp_path / "root" / "state", "state")


def test_gather_refuses_another_export_and_damaged_copies(tmp_path: Path) -> None:
    _bundle(tmp_path / "a", "state", 0, [500, 500])
    _bundle(tmp_path / "b", "state", 1, [500, 500])
    gather(tmp_path / "a", tmp_path / "root")
    with pytest.raises(ValueError, match="holds another 'state' bundle"):
        gather(tmp_path / "b", tmp_path / "root")
    shard = tmp_path / "b" / read_manifest(tmp_path / "b" / "state.json").files[0].name
    shard.write_bytes(shard.read_bytes()[:-4] + b"abcd")
    with pytest.raises(ValueError, match="does not match its manifest"):
        gather(tmp_path / "b", tmp_path / "root2")


def test_a_shard_too_large_for_a_part_is_refused(tmp_path: Path) -> None:
    _bundle(tmp_path / "b", "state", 0, [2000], shard_bytes=16 * KIB)
    manifest = read_manifest(tmp_path / "b" / "state.json")
    with pytest.raises(ValueError, match="does not fit a part of 7 files and 4096 bytes"):
        plan_parts([manifest], 7, 4 * KIB)
    with pytest.raises(ValueError, match="over the limit of 4096 bytes"):
        _bundle(tmp_path / "c", "state", 0, [2000], shard_bytes=4 * KIB)


def test_part_and_gather_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _bundle(tmp_path / "state", "state", 0, [700] * 6)
    argv = ["drafter", "part", str(tmp_path / "state"), "--dest", str(tmp_path / "out"), "--max-files", "3"]
    assert main([*argv, "--max-mib", "0.01", "--part", "1"]) == 0
    shown = capsys.readouterr().out
    count = int(re.search(r"part 1 of (\d+):", shown).group(1))  # type: ignore[union-attr]
    assert count > 1
    assert main(["drafter", "gather", str(tmp_path / "out"), str(tmp_path / "root")]) == 0
    assert "state: still missing" in capsys.readouterr().out
    assert main([*argv, "--max-mib", "0.01", "--part", str(count + 1)]) == 2
    assert f"there are {count} parts" in capsys.readouterr().err
    assert main(["drafter", "gather", str(tmp_path / "nothing"), str(tmp_path / "root")]) == 2
    assert "no bundle manifest" in capsys.readouterr().err
