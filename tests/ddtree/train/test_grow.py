from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ddtree.cli.main import main
from ddtree.models.dflash import WEIGHTS_NAME, DFlashDrafter, load_drafter, save_drafter
from ddtree.train.grow import grow_drafter
from tests.helpers import tiny_pair


def _block(drafter: DFlashDrafter, seed: int) -> torch.Tensor:
    """The drafter's hidden states for a random context and block (fresh cache, eager, sdpa)."""
    gen = torch.Generator().manual_seed(seed)
    features = len(drafter.target_layer_ids) * drafter.config.hidden_size
    context = torch.randn((2, 6, features), generator=gen, dtype=torch.float64)
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
    assert "3-layer drafter grown from 2 layers" in capsys.readouterr().out
    grown = load_drafter(tmp_path / "three", torch.device("cpu"), torch.float32)
    assert len(grown.layers) == 3
    with safe_open(str(tmp_path / "three" / WEIGHTS_NAME), "pt") as f:
        names = f.keys()
        assert all(f.get_tensor(name).dtype == torch.bfloat16 for name in names)
    assert main(["drafter", "grow", str(tmp_path / "two"), "--num-layers", "1", "--out", str(tmp_path / "x")]) == 2
    assert "grows to at least its own 2 layers, got 1" in capsys.readouterr().err
