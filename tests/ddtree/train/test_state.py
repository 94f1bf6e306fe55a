from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ddtree.train.bundle import MIB
from ddtree.train.data import TrainingSequence
from ddtree.train.state import STATE_FILE, export_state, import_state
from ddtree.train.trainer import TrainConfig, train

Fresh = Callable[[], tuple[torch.nn.Module, Any]]
BF16_RELATIVE = 2.0**-9  # bfloat16's rounding error: 8 significant bits


def _state(directory: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(directory / STATE_FILE, weights_only=False)
    return state


def test_the_compact_state_resumes_where_the_run_stopped(
    tmp_path: Path, tiny_data: list[TrainingSequence], fresh: Fresh
) -> None:
    """Train 16 steps in one run, or 8, export, import elsewhere and resume to 16: the same steps, schedule,
    batches and history; weights within what the bfloat16 moments explain."""
    cfg = TrainConfig(steps=16, batch_size=4, anchors=4, lr=3e-3, warmup=2, checkpoint_every=4, seed=3)
    model, drafter = fresh()
    train(drafter, model, tiny_data, tmp_path / "whole", cfg, quiet=True)
    model, drafter = fresh()
    train(drafter, model, tiny_data, tmp_path / "first", cfg, quiet=True, stop_at=8)
    shard = 16 * 1024
    manifest = export_state(tmp_path / "first", tmp_path / "bundle", shard_bytes=shard)
    assert len(manifest.files) > 1 and all(
        (tmp_path / "bundle" / f.name).stat().st_size <= shard for f in manifest.files
    )
    import_state(tmp_path / "bundle", tmp_path / "second")
    model, drafter = fresh()
    report = train(drafter, model, tiny_data, tmp_path / "second", cfg, resume=True, quiet=True)

    whole, first, resumed = _state(tmp_path / "whole"), _state(tmp_path / "first"), _state(tmp_path / "second")
    assert report["start_step"] == 8 and resumed["step"] == whole["step"] == 16
    assert resumed["scheduler"]["last_epoch"] == whole["scheduler"]["last_epoch"] == 16
    assert [h["lr"] for h in resumed["history"]] == [h["lr"] for h in whole["history"]]
    assert resumed["history"][:8] == first["history"] == whole["history"][:8]
    assert resumed["elapsed"] >= first["elapsed"]
    for a, b in zip(resumed["history"][8:], whole["history"][8:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
    # Each of the 8 resumed updates moves a weight by at most about lr, off by the moments' rounding (about
    # 1.5 x 2^-9 of it: m's error plus half of v's, through the square root); allow four times that.
    tolerance = 8 * cfg.lr * 4 * 1.5 * BF16_RELATIVE
    for key, value in whole["drafter"].items():
        moved = (value - first["drafter"][key]).abs().max()
        diff = (resumed["drafter"][key] - value).abs().max()
        assert diff <= tolerance, (key, float(diff), tolerance)
        assert moved > 10 * tolerance, (key, float(moved))  # the weights moved far more than the tolerance


def test_export_is_deterministic_and_import_writes_a_loadable_drafter(
    tmp_path: Path, tiny_data: list[TrainingSequence], fresh: Fresh
) -> None:
    model, drafter = fresh()
    cfg = TrainConfig(steps=3, batch_size=4, anchors=4, warmup=1, seed=1)
    train(drafter, model, tiny_data, tmp_path / "d", cfg, quiet=True)
    a = export_state(tmp_path / "d", tmp_path / "a")
    b = export_state(tmp_path / "d", tmp_path / "b")
    assert a.content() == b.content()  # parts of two exports of one state fit together
    assert a.meta["moments_dtype"] == "bfloat16" and a.meta["step"] == 3
    tensors = torch.load(tmp_path / "d" / STATE_FILE, weights_only=False)
    assert len(a.files) == 1 and sum(f.bytes for f in a.files) < 0.75 * (tmp_path / "d" / STATE_FILE).stat().st_size
    import_state(tmp_path / "a", tmp_path / "back")
    back = torch.load(tmp_path / "back" / STATE_FILE, weights_only=False)
    for key, value in tensors["drafter"].items():
        assert torch.equal(back["drafter"][key], value), key
    saved = json.loads((tmp_path / "back" / "runs.json").read_text())
    assert saved == json.loads((tmp_path / "d" / "runs.json").read_text())
    from ddtree.models.dflash import load_drafter

    loaded = load_drafter(tmp_path / "back", torch.device("cpu"), torch.float32)
    assert torch.equal(loaded.fc.weight, tensors["drafter"]["fc.weight"].bfloat16().float())


def test_an_incomplete_bundle_names_its_missing_shards(
    tmp_path: Path, tiny_data: list[TrainingSequence], fresh: Fresh
) -> None:
    model, drafter = fresh()
    train(drafter, model, tiny_data, tmp_path / "d", TrainConfig(steps=2, batch_size=4, anchors=4), quiet=True)
    manifest = export_state(tmp_path / "d", tmp_path / "bundle", shard_bytes=16 * 1024)
    gone = manifest.files[1].name
    (tmp_path / "bundle" / gone).unlink()
    with pytest.raises(ValueError, match=gone):
        import_state(tmp_path / "bundle", tmp_path / "back")
    assert not (tmp_path / "back" / STATE_FILE).exists()
    with pytest.raises(ValueError, match="train first"):
        export_state(tmp_path / "nothing", tmp_path / "b2")


def test_the_schedule_spans_the_total_time_of_all_runs(
    tmp_path: Path, tiny_data: list[TrainingSequence], fresh: Fresh, fake_clock: Any
) -> None:
    """With a clock of one second per step: 12 s in one run, or three runs of at most 5 s each, give the same
    learning rates and weights; each run's record continues the last."""
    base = {"steps": 10_000, "batch_size": 4, "anchors": 4, "warmup": 2, "checkpoint_every": 100, "seed": 3}
    model, drafter = fresh()
    one = train(
        drafter,
        model,
        tiny_data,
        tmp_path / "one",
        TrainConfig(**base, total_seconds=12),
        quiet=True,
        clock=fake_clock(),
    )
    assert (one["steps"], one["stopped"], one["complete"]) == (12, "total time", True)
    split = TrainConfig(**base, total_seconds=12, max_seconds=5)
    reports = []
    for run in range(3):
        model, drafter = fresh()
        reports.append(
            train(drafter, model, tiny_data, tmp_path / "split", split, resume=run > 0, quiet=True, clock=fake_clock())
        )
    assert [(r["steps"], r["stopped"]) for r in reports] == [(5, "run time"), (10, "run time"), (12, "total time")]
    assert [r["wall_seconds"] for r in reports] == [5, 10, 12]
    whole, parts = _state(tmp_path / "one"), _state(tmp_path / "split")
    rates = [h["lr"] for h in whole["history"]]
    assert [h["lr"] for h in parts["history"]] == rates
    assert rates[-1] < 0.2 * split.lr < rates[2]  # the cosine ran its course over the 12 s, not over 5 s
    for key, value in whole["drafter"].items():
        assert torch.equal(parts["drafter"][key], value), key
    runs = json.loads((tmp_path / "split" / "runs.json").read_text())
    assert [(r["run"], r["start_step"], r["end_step"]) for r in runs] == [(1, 0, 5), (2, 5, 10), (3, 10, 12)]
    assert [(r["wall_seconds"], r["cumulative_seconds"]) for r in runs] == [(5, 5), (5, 10), (2, 12)]


def test_max_minutes_alone_still_budgets_one_run(
    tmp_path: Path, tiny_data: list[TrainingSequence], fresh: Fresh, fake_clock: Any
) -> None:
    model, drafter = fresh()
    cfg = TrainConfig(steps=10_000, batch_size=4, anchors=4, warmup=2, max_seconds=5)
    report = train(drafter, model, tiny_data, tmp_path / "d", cfg, quiet=True, clock=fake_clock())
    assert (report["steps"], report["stopped"], report["complete"]) == (5, "total time", True)
    # Step 5's rate was set after step 4, with 4 of the 5 seconds used.
    expected = cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 5)))
    assert _state(tmp_path / "d")["history"][-1]["lr"] == pytest.approx(expected)


def test_shard_sizes_follow_the_limit(tmp_path: Path, tiny_data: list[TrainingSequence], fresh: Fresh) -> None:
    model, drafter = fresh()
    train(drafter, model, tiny_data, tmp_path / "d", TrainConfig(steps=1, batch_size=2, anchors=2), quiet=True)
    for limit in (12 * 1024, 40 * 1024, 15 * MIB):
        manifest = export_state(tmp_path / "d", tmp_path / f"b{limit}", shard_bytes=limit)
        assert all(f.bytes <= limit for f in manifest.files)
        assert sorted(p.name for p in (tmp_path / f"b{limit}").iterdir()) == sorted(
            [f.name for f in manifest.files] + ["state.json"]
        )


def test_state_commands_report_bad_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ddtree.cli.main import main

    assert main(["drafter", "state", "export", str(tmp_path / "none"), str(tmp_path / "b")]) == 2
    assert "no trainer state in" in capsys.readouterr().err
    assert main(["drafter", "state", "import", str(tmp_path / "none"), str(tmp_path / "d")]) == 2
    assert "no bundle manifest 'state.json'" in capsys.readouterr().err
    assert main(["drafter", "state", "export", str(tmp_path), str(tmp_path / "b"), "--shard-mib", "0"]) == 2
    assert "--shard-mib must be in (0, 1024], got 0.0" in capsys.readouterr().err
