"""Tiny random pairs built in memory, in float64 so that greedy comparisons are exact.

`DDTREE_TEST_DEVICE=cuda` runs the same tests on a GPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ddtree.methods import TreeShape, get_method
from ddtree.models.dflash import DFlashDrafter, drafter_config
from ddtree.models.hybrid import make_target
from ddtree.models.target import Target
from ddtree.models.tiny import random_hybrid, random_llama, tiny_hybrid_config, tiny_llama_config


def tiny_pair(
    seed: int,
    vocab: int = 32,
    hidden: int = 32,
    layers: int = 2,
    block_size: int = 6,
    drafter_layers: int = 1,
    dtype: torch.dtype = torch.float64,
) -> tuple[Target, DFlashDrafter]:
    """A random Llama target and a random DFlash drafter sized to it."""
    config = tiny_llama_config(vocab, hidden_size=hidden, num_layers=layers, heads=4, kv_heads=2)
    return _with_drafter(config, random_llama(config, seed), seed, block_size, drafter_layers, dtype)


def tiny_hybrid_pair(
    kind: str,
    seed: int,
    vocab: int = 32,
    hidden: int = 32,
    layers: int = 4,
    block_size: int = 6,
    dtype: torch.dtype = torch.float64,
) -> tuple[Target, DFlashDrafter]:
    """A random hybrid target (`tiny_hybrid_config`'s `kind`) and a random DFlash drafter sized to it."""
    config = tiny_hybrid_config(kind, vocab, hidden_size=hidden, num_layers=layers, heads=4, kv_heads=2)
    return _with_drafter(config, random_hybrid(config, seed), seed, block_size, 1, dtype)


def _with_drafter(
    config: Any, model: Any, seed: int, block_size: int, drafter_layers: int, dtype: torch.dtype
) -> tuple[Target, DFlashDrafter]:
    """`model` as our target and a random drafter sized to it, both in `dtype` on the test device."""
    model = model.to(dtype)
    torch.manual_seed(seed + 1000)
    drafter = DFlashDrafter(drafter_config(config, drafter_layers, block_size, mask_token_id=config.vocab_size - 1))
    # Larger drafter weights make its distributions peaked, so trees and chains differ in shape.
    for p in drafter.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.3)
    device = torch.device(os.environ.get("DDTREE_TEST_DEVICE", "cpu"))
    drafter = drafter.to(device=device, dtype=dtype).eval()
    return make_target(model.to(device), feature_layers=drafter.target_layer_ids), drafter


def random_prompts(seed: int, batch: int, vocab: int, low: int = 1, high: int = 12) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (batch,), generator=gen).tolist()
    return [torch.randint(0, vocab - 1, (n,), generator=gen).tolist() for n in lengths]


def shape_of(method: str, budget: int, topk: int | None, drafter: Any) -> TreeShape:
    """The tree shape a session verifies for `method` with `budget` and `topk` on `drafter` (None for ar)."""
    return get_method(method).shape(budget, topk, drafter.depth if drafter is not None else 0)
