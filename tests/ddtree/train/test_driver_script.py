"""`scripts/train_default_drafter.sh`'s multi-session verbs on the CLI's tiny pair: pack a trained drafter's
state and data, unpack them elsewhere, resume there. Slower than the others (several processes, ~15 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ddtree.cli.main import main
from ddtree.train.data import TrainingSequence, pack_sequences

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "train_default_drafter.sh"


def _script(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full, timeout=300)


def test_usage_names_every_verb() -> None:
    done = _script()
    assert done.returncode == 2
    for verb in ("prepare GGUF WORK", "resume WORK MINUTES", "pack WORK OUT [PART]", "unpack CARRY WORK"):
        assert verb in done.stderr


def test_pack_unpack_and_resume_continue_the_training(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    target, _ = tiny_dirs
    first, second, carry = tmp_path / "first", tmp_path / "second", tmp_path / "carry"
    for work in (first, second):
        work.mkdir()
        (work / "target").symlink_to(target)
    seqs = [TrainingSequence([(7 * i + j) % 250 for j in range(30)], 5) for i in range(16)]
    pack_sequences(seqs, first / "data")
    argv = ["drafter", "train", "--target", str(target), "--data", str(first / "data"), "--out", str(first / "drafter")]
    assert (
        main([*argv, "--steps", "2", "--batch-size", "4", "--anchors", "4", "--block-size", "5", "--device", "cpu"])
        == 0
    )

    packed = _script("pack", str(first), str(carry))
    assert packed.returncode == 0, packed.stderr
    assert "part 1 of 1:" in packed.stdout and (first / "state" / "state.json").is_file()
    assert sorted(p.name for p in carry.iterdir()) == sorted(
        ["state.json", "state-00001-of-00001.safetensors", "data.json", "data-00001-of-00001.safetensors"]
    )
    unpacked = _script("unpack", str(carry), str(second))
    assert unpacked.returncode == 0, unpacked.stderr
    assert "state: complete" in unpacked.stdout and "imported the trainer state at step 2" in unpacked.stdout

    resumed = _script("resume", str(second), "0.01", TOTAL_MINUTES="0.5", TRAIN_BATCH="4")
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert report["start_step"] == 2 and report["steps"] > 2 and report["stopped"] == "run time"
    assert report["config"]["total_seconds"] == 30.0 and report["sequences"] == 16
    runs = json.loads((second / "drafter" / "runs.json").read_text())
    assert [(r["run"], r["start_step"]) for r in runs] == [(1, 0), (2, 2)]
    assert _script("resume", str(first / "nothing"), "1", TOTAL_MINUTES="1").returncode == 1
