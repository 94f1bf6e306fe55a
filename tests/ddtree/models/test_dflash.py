from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddtree.errors import UserError
from ddtree.models.dflash import default_feature_layers, load_drafter, save_drafter
from tests.helpers import tiny_pair


def test_checkpoint_layout_and_round_trip(tmp_path: Path) -> None:
    _, drafter = tiny_pair(0, block_size=7)
    save_drafter(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["block_size"] == 7
    assert set(config["dflash_config"]) == {"target_layer_ids", "mask_token_id"}
    loaded = load_drafter(tmp_path, torch.device("cpu"), torch.float64)
    keys = set(loaded.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= keys
    assert not any("embed" in k or "lm_head" in k for k in keys), "embeddings and head are the target's"
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k])


def test_corrupt_drafter_is_a_user_error(tmp_path: Path) -> None:
    _, drafter = tiny_pair(0)
    save_drafter(drafter, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(UserError, match="cannot load drafter weights"):
        load_drafter(tmp_path, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(("layers", "count"), [(30, 1), (30, 5), (4, 2), (2, 3), (1, 1)])
def test_default_feature_layers_are_valid(layers: int, count: int) -> None:
    ids = default_feature_layers(layers, count)
    assert len(ids) == count and all(0 <= i < layers for i in ids) and ids == sorted(ids)
