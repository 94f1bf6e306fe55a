"""A deeper or wider drafter that starts as the drafter it grows from.

`grow_drafter(drafter, num_layers)` keeps every weight of `drafter` and appends layers whose attention output
projection and MLP down projection are zero. Each layer adds its attention and MLP outputs to the residual
stream, so a new layer adds nothing: the grown drafter drafts exactly what the old one drafts, and training
starts from its acceptance instead of from scratch. The zeroed projections still get gradients (their inputs
are not zero), so the new layers learn from the first step; their other weights keep a fresh initialisation.

`feature_layers` widens the drafter's view of the target the same way: the drafter reads those target layers
(a superset of its own), and the context projection `fc` keeps each old layer's columns and gives each new
layer zero columns, so the new features add nothing until training moves them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ddtree.models.dflash import DFlashDrafter


def grow_drafter(
    drafter: DFlashDrafter, num_layers: int, seed: int = 0, feature_layers: list[int] | None = None
) -> DFlashDrafter:
    """A copy of `drafter` with `num_layers` layers (at least its own) reading `feature_layers` (a superset of
    its own target layers; default: its own), the new layers and features adding nothing yet."""
    old = len(drafter.layers)
    if num_layers < old:
        raise ValueError(f"a drafter grows to at least its own {old} layers, got {num_layers}")
    features = _checked_features(drafter, feature_layers)
    config = copy.deepcopy(drafter.config)
    config.num_hidden_layers = num_layers
    config.dflash_config = {**config.dflash_config, "target_layer_ids": features}
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[0]] * num_layers
    reference = next(drafter.parameters())
    torch.manual_seed(seed)
    grown = DFlashDrafter(config).to(device=reference.device, dtype=reference.dtype)
    source = drafter.state_dict()
    if feature_layers is not None:
        source["fc.weight"] = _widened_fc(source["fc.weight"], drafter.target_layer_ids, features)
    missing, unexpected = grown.load_state_dict(source, strict=False)
    assert not unexpected, unexpected
    assert all(key.startswith("layers.") and int(key.split(".")[1]) >= old for key in missing), missing
    layer: Any
    with torch.no_grad():
        for layer in grown.layers[old:]:
            layer.self_attn.o_proj.weight.zero_()
            if layer.self_attn.o_proj.bias is not None:
                layer.self_attn.o_proj.bias.zero_()
            layer.mlp.down_proj.weight.zero_()
    return grown.eval()


def _checked_features(drafter: DFlashDrafter, feature_layers: list[int] | None) -> list[int]:
    """`feature_layers`, checked: distinct target layers that include every layer `drafter` reads."""
    own = list(drafter.target_layer_ids)
    if feature_layers is None:
        return own
    targets = int(drafter.config.num_target_layers)
    if len(set(feature_layers)) != len(feature_layers):
        raise ValueError(f"the feature layers must be distinct, got {feature_layers}")
    if not all(0 <= i < targets for i in feature_layers):
        raise ValueError(f"the feature layers must be target layers 0 to {targets - 1}, got {feature_layers}")
    lost = [i for i in own if i not in feature_layers]
    if lost:
        raise ValueError(f"a drafter grows to read at least its own target layers {own}; {lost} are missing")
    return list(feature_layers)


def _widened_fc(weight: torch.Tensor, old: tuple[int, ...], new: list[int]) -> torch.Tensor:
    """fc's weight [hidden, len(new) * hidden] from weight [hidden, len(old) * hidden]: each old layer's columns
    where that layer now sits (summed where `old` reads a layer twice), zeros for the new layers."""
    hidden = weight.shape[0]
    wide = weight.new_zeros((hidden, len(new) * hidden))
    for i, layer in enumerate(old):
        j = new.index(layer)
        wide[:, j * hidden : (j + 1) * hidden] += weight[:, i * hidden : (i + 1) * hidden]
    return wide
