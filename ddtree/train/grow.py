"""A deeper drafter that starts as the drafter it grows from.

`grow_drafter(drafter, num_layers)` keeps every weight of `drafter` and appends layers whose attention output
projection and MLP down projection are zero. Each layer adds its attention and MLP outputs to the residual
stream, so a new layer adds nothing: the grown drafter drafts exactly what the old one drafts, and training
starts from its acceptance instead of from scratch. The zeroed projections still get gradients (their inputs
are not zero), so the new layers learn from the first step; their other weights keep a fresh initialisation.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ddtree.models.dflash import DFlashDrafter


def grow_drafter(drafter: DFlashDrafter, num_layers: int, seed: int = 0) -> DFlashDrafter:
    """A copy of `drafter` with `num_layers` layers (at least its own), the new ones adding nothing yet."""
    old = len(drafter.layers)
    if num_layers < old:
        raise ValueError(f"a drafter grows to at least its own {old} layers, got {num_layers}")
    config = copy.deepcopy(drafter.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[0]] * num_layers
    torch.manual_seed(seed)
    grown = DFlashDrafter(config)
    missing, unexpected = grown.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected, unexpected
    assert all(key.startswith("layers.") and int(key.split(".")[1]) >= old for key in missing), missing
    layer: Any
    with torch.no_grad():
        for layer in grown.layers[old:]:
            layer.self_attn.o_proj.weight.zero_()
            if layer.self_attn.o_proj.bias is not None:
                layer.self_attn.o_proj.bias.zero_()
            layer.mlp.down_proj.weight.zero_()
    reference = next(drafter.parameters())
    return grown.to(device=reference.device, dtype=reference.dtype).eval()
