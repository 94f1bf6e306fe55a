from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ddtree.cli.main import main
from ddtree.models.dflash import WEIGHTS_NAME, DFlashDrafter, load_drafter, save_drafter
from ddtree.train.grow import grow_drafter
from tests.helpers import tiny_pair


def _block(drafter: DFlashDrafter, seed: int, layers: tuple[int, ...] | None = None) -> torch.Tensor:
    """The drafter's hidden states for a random context and block (fresh cache, eager, sdpa). The context holds
    random features of target `layers` (default: those the drafter reads); the drafter gets its own."""
    gen = torch.Generator().manual_seed(seed)
    layers = layers or drafter.target_layer_ids
    hidden = drafter.config.hidden_size
    every = torch.randn((2, 6, len(layers), hidden), generator=gen, dtype=torch.float64)
    context = every[:, :, [layers.index(i) for i in drafter.target_layer_ids]].flatten(2)
    counts = torch.tensor([6, 3])
    block = torch.randn((2, drafter.block_size, drafter.config.hidden_size), generator=gen, dtype=torch.float64)
    cache = drafter.new_cache(2, 32, torch.float64, torch.device("cpu"))
    with torch.no_grad():
        out: torch.Tensor = drafter(block, context, counts, cache, 16, fused=False)
    return out


def test_a_grown_drafter_drafts_what_its_source_drafts() -> None:
    _, drafter = tiny_pair(5, block_size=5, drafter_layers=2)
    grown = grow_drafter(drafter, 4)
    assert len(grown.layers) == 4 and grown.config.num_hidden_layers == 4
    assert len(grown.config.layer_types) == 4
    torch.testing.assert_close(_block(grown, 1), _block(drafter, 1), rtol=0, atol=1e-12)
    source = drafter.state_dict()
    for key, value in grown.state_dict().items():
        if key in source:
            assert torch.equal(value, source[key]), key
    new = grown.layers[3]
    assert not new.self_attn.o_proj.weight.any() and not new.mlp.down_proj.weight.any()
    assert new.self_attn.q_proj.weight.abs().sum() > 0  # the rest is freshly initialised, not zero


def test_the_new_layers_learn_from_the_first_step() -> None:
    _, drafter = tiny_pair(6, block_size=5, drafter_layers=1)
    grown = grow_drafter(drafter, 2)
    grown.train()
    with torch.enable_grad():
        gen = torch.Generator().manual_seed(2)
        features = len(grown.target_layer_ids) * grown.config.hidden_size
        context = torch.randn((2, 6, features), generator=gen, dtype=torch.float64)
        block = torch.randn((2, grown.block_size, grown.config.hidden_size), generator=gen, dtype=torch.float64)
        cache = grown.new_cache(2, 32, torch.float64, torch.device("cpu"))
        grown(block, context, torch.tensor([6, 4]), cache, 16, fused=False).square().sum().backward()
    layer = grown.layers[1]
    assert layer.self_attn.o_proj.weight.grad is not None and layer.self_attn.o_proj.weight.grad.abs().sum() > 0
    assert layer.mlp.down_proj.weight.grad is not None and layer.mlp.down_proj.weight.grad.abs().sum() > 0


def test_grow_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, drafter = tiny_pair(7, block_size=5, drafter_layers=2)
    save_drafter(drafter, tmp_path / "two", torch.bfloat16)
    assert main(["drafter", "grow", str(tmp_path / "two"), "--num-layers", "3", "--out", str(tmp_path / "three")]) == 0
    assert "3-layer drafter reading target layers 0,0, grown from 2 layers" in capsys.readouterr().out
    grown = load_drafter(tmp_path / "three", torch.device("cpu"), torch.float32)
    assert len(grown.layers) == 3
    with safe_open(str(tmp_path / "three" / WEIGHTS_NAME), "pt") as f:
        names = f.keys()
        assert all(f.get_tensor(name).dtype == torch.bfloat16 for name in names)
    assert main(["drafter", "grow", str(tmp_path / "two"), "--num-layers", "1", "--out", str(tmp_path / "x")]) == 2
    assert "grows to at least its own 2 layers, got 1" in capsys.readouterr().err


def test_a_wider_drafter_drafts_what_its_source_drafts() -> None:
    _, drafter = tiny_pair(8, block_size=5, drafter_layers=2, layers=6)
    assert drafter.target_layer_ids == (1, 3)
    wide = grow_drafter(drafter, 3, feature_layers=[0, 3, 1, 5, 2])
    assert wide.target_layer_ids == (0, 3, 1, 5, 2)
    assert wide.config.dflash_config["target_layer_ids"] == [0, 3, 1, 5, 2]
    everything = (0, 1, 2, 3, 4, 5)
    torch.testing.assert_close(_block(wide, 3, everything), _block(drafter, 3, everything), rtol=0, atol=1e-12)
    hidden = drafter.config.hidden_size
    columns = wide.fc.weight.reshape(hidden, 5, hidden)
    assert not columns[:, [0, 3, 4]].any()  # target layers 0, 5 and 2: new, so zero
    old = drafter.fc.weight.reshape(hidden, 2, hidden)
    assert torch.equal(columns[:, [2, 1]], old)  # layers 1 and 3 kept, where they now sit


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ([1, 3, 3], "must be distinct"),
        ([1, 3, 6], "target layers 0 to 5"),
        ([1, 4], "[3] are missing"),
    ],
)
def test_bad_feature_layers_are_refused(layers: list[int], message: str) -> None:
    _, drafter = tiny_pair(8, block_size=5, drafter_layers=2, layers=6)
    with pytest.raises(ValueError, match=re.escape(message)):
        grow_drafter(drafter, 2, feature_layers=layers)


def test_widen_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, drafter = tiny_pair(9, block_size=5, drafter_layers=2, layers=6)
    save_drafter(drafter, tmp_path / "narrow", torch.float32)
    args = ["drafter", "grow", str(tmp_path / "narrow"), "--feature-layers", "1,2,3,4", "--out", str(tmp_path / "w")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "2-layer drafter reading target layers 1,2,3,4, grown from 2 layers reading 1,3" in out
    assert load_drafter(tmp_path / "w", torch.device("cpu"), torch.float32).target_layer_ids == (1, 2, 3, 4)
    args[4] = "2,3,4"
    assert main(args) == 2
    assert "its own target layers [1, 3]; [1] are missing" in capsys.readouterr().err


def test_a_target_layer_read_twice_becomes_one_wider_column() -> None:
    _, drafter = tiny_pair(10, block_size=5, drafter_layers=2)
    assert drafter.target_layer_ids == (0, 0)  # a 2-layer target: the spread repeats its layer
    wide = grow_drafter(drafter, 2, feature_layers=[0, 1])
    torch.testing.assert_close(_block(wide, 4, (0, 1)), _block(drafter, 4, (0, 1)), rtol=0, atol=1e-12)
