"""Run ar, dflash and ddtree on one random tiny pair and show that their greedy outputs agree.

.venv/bin/python scripts/compare_methods.py
"""

from __future__ import annotations

import torch

from ddtree.engine.engine import Engine
from ddtree.models.dflash import DFlashDrafter, drafter_config
from ddtree.models.target import Target
from ddtree.models.tiny import random_llama, tiny_llama_config
from ddtree.settings import GenerationConfig


def main() -> None:
    config = tiny_llama_config(vocab_size=32, hidden_size=64, num_layers=2)
    model = random_llama(config, seed=0)
    torch.manual_seed(1)
    drafter = DFlashDrafter(drafter_config(config, num_layers=1, block_size=8, mask_token_id=31)).eval()
    engine = Engine(Target(model, feature_layers=drafter.target_layer_ids), drafter)
    prompts = [[1, 2, 3, 4], [5, 6]]
    results = {}
    for method in ("ar", "dflash", "ddtree"):
        out = engine.generate(prompts, GenerationConfig(method=method, budget=32, max_new_tokens=24))
        results[method] = [o.token_ids for o in out.outputs]
        lengths = [a for o in out.outputs for a in o.acceptance_lengths]
        print(f"{method:7s} steps={out.steps:3d} mean acceptance={sum(lengths) / len(lengths):.2f}")
    print("lossless:", results["ar"] == results["dflash"] == results["ddtree"])


if __name__ == "__main__":
    main()
