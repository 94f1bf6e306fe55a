"""The trainer state in a form that travels: a bundle named `state` (`ddtree.train.bundle`).

`export_state` turns the `trainer_state.pt` of a drafter directory (float32 weights and AdamW moments:
about 12 bytes per parameter) into
- tensors, in safetensors shards of at most 15 MiB: the drafter's weights in float32 (`drafter.<name>`), the
  optimizer's moments in bfloat16 (`optimizer.<index>.exp_avg`, `...exp_avg_sq`), torch's RNG state
  (`torch_rng`) and the step history, one column per field (`history.step`, `history.loss`, ...);
- metadata, in the manifest `state.json`: the step, the training seconds of all runs so far, the scheduler's
  state, Python's RNG state, the optimizer's parameter groups and per-parameter step counts, the drafter's
  `config.json` and the run records of `runs.json`.
That is 8 bytes per parameter: 70 MB for the 8.7 M parameters of the default drafter, 5 shards.

`import_state` writes a drafter directory back from a complete bundle: `config.json`, `model.safetensors`
(bfloat16, as the trainer writes it), `runs.json` and `trainer_state.pt`, from which `drafter train --resume`
continues: the same step, schedule position, RNG streams (the same batches) and history.

The one approximation: the moments. bfloat16 keeps 8 significant bits, so each moment comes back within a
relative 2^-9 (0.2%) of its value, and the first updates after an import differ from an uninterrupted run's
by about that much of their size (at most the learning rate per weight). The moments are averages that
AdamW renews at the rate of its betas (0.9 and 0.95: about 10 and 20 steps), so the difference does not
compound; weights, step, schedule, RNG and history come back exactly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from ddtree.train.bundle import SHARD_BYTES, Manifest, load_bundle, save_bundle, split_tensors
from ddtree.train.runs import read_runs, write_runs

STATE_FILE = "trainer_state.pt"  # the trainer's own checkpoint (torch.save), in the drafter directory
STATE_BUNDLE = "state"
MOMENTS_DTYPE = torch.bfloat16
CONFIG_FILE = "config.json"


def export_state(drafter_dir: Path, bundle_dir: Path, shard_bytes: int = SHARD_BYTES) -> Manifest:
    """Write the compact state of `drafter_dir`'s trainer state as the bundle `state` in `bundle_dir`."""
    path = drafter_dir / STATE_FILE
    if not path.is_file() or not (drafter_dir / CONFIG_FILE).is_file():
        raise ValueError(f"no trainer state in {str(drafter_dir)!r} ({STATE_FILE} and {CONFIG_FILE}): train first")
    state = torch.load(path, map_location="cpu", weights_only=False)
    tensors, meta = compact_state(state)
    meta["drafter_config"] = json.loads((drafter_dir / CONFIG_FILE).read_text())
    meta["runs"] = read_runs(drafter_dir)
    shards = split_tensors(dict(sorted(tensors.items())), shard_bytes)
    return save_bundle(bundle_dir, STATE_BUNDLE, shards, meta, shard_bytes)


def import_state(bundle_dir: Path, drafter_dir: Path) -> dict[str, Any]:
    """Write `drafter_dir` back from the complete bundle `state` in `bundle_dir`; returns the state's
    step and training seconds."""
    from transformers import Qwen3Config

    from ddtree.models.dflash import DFlashDrafter, save_drafter

    shards, meta = load_bundle(bundle_dir, STATE_BUNDLE)
    state = full_state({key: value for shard in shards for key, value in shard.items()}, meta)
    drafter_dir.mkdir(parents=True, exist_ok=True)
    (drafter_dir / CONFIG_FILE).write_text(json.dumps(meta["drafter_config"], indent=2))
    drafter = DFlashDrafter(Qwen3Config.from_pretrained(drafter_dir))
    drafter.load_state_dict(state["drafter"])
    save_drafter(drafter, drafter_dir, dtype=torch.bfloat16)
    write_runs(drafter_dir, list(meta["runs"]))
    tmp = drafter_dir / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    tmp.replace(drafter_dir / STATE_FILE)
    return {"step": state["step"], "elapsed": state["elapsed"]}


def compact_state(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A trainer state -> (tensors, JSON metadata), the moments in bfloat16."""
    tensors = {f"drafter.{key}": value.float() for key, value in state["drafter"].items()}
    tensors["torch_rng"] = state["torch_rng"].cpu()
    optimizer, optimizer_meta = _compact_optimizer(state["optimizer"])
    history, history_keys = _history_columns(state["history"])
    version, internal, gauss = state["rng"]
    meta = {
        "step": int(state["step"]),
        "elapsed": float(state["elapsed"]),
        "scheduler": state["scheduler"],
        "rng": [version, list(internal), gauss],
        "optimizer": optimizer_meta,
        "history_keys": history_keys,
        "moments_dtype": str(MOMENTS_DTYPE).removeprefix("torch."),
    }
    return {**tensors, **optimizer, **history}, meta


def full_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """(tensors, metadata) of `compact_state` -> a trainer state, the moments back in float32."""
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, index, name = key.split(".", 2)
            per_param.setdefault(int(index), {})[name] = value.float()
    for index, step in meta["optimizer"]["steps"].items():
        per_param.setdefault(int(index), {})["step"] = torch.tensor(step, dtype=torch.float32)
    groups = [{**group, "betas": tuple(group["betas"])} for group in meta["optimizer"]["param_groups"]]
    version, internal, gauss = meta["rng"]
    return {
        "drafter": {k.removeprefix("drafter."): v for k, v in tensors.items() if k.startswith("drafter.")},
        "optimizer": {"state": dict(sorted(per_param.items())), "param_groups": groups},
        "scheduler": meta["scheduler"],
        "rng": (version, tuple(internal), gauss),
        "torch_rng": tensors["torch_rng"],
        "step": int(meta["step"]),
        "elapsed": float(meta["elapsed"]),
        "history": _history_rows(tensors, meta["history_keys"]),
    }


def _compact_optimizer(optimizer: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors, steps = {}, {}
    for index, entry in optimizer["state"].items():
        for name, value in entry.items():
            if name == "step":
                steps[str(index)] = float(value)
            else:
                tensors[f"optimizer.{index}.{name}"] = value.to(MOMENTS_DTYPE)
    return tensors, {"param_groups": optimizer["param_groups"], "steps": steps}


def _history_columns(history: list[dict[str, float]]) -> tuple[dict[str, torch.Tensor], list[str]]:
    keys = list(dict.fromkeys(key for h in history for key in h))  # every field, in the order first seen
    columns = {
        f"history.{key}": torch.tensor(
            [h.get(key, math.nan) for h in history], dtype=torch.int64 if key == "step" else torch.float64
        )
        for key in keys
    }
    return columns, keys


def _history_rows(tensors: dict[str, torch.Tensor], keys: list[str]) -> list[dict[str, float]]:
    columns = {key: tensors[f"history.{key}"].tolist() for key in keys}
    count = len(columns[keys[0]]) if keys else 0
    return [{key: columns[key][i] for key in keys} for i in range(count)]
