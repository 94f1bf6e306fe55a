"""What a hybrid target's recurrent states cost a request slot, at real shapes (transformers' default configs:
Qwen3.5-9B style, Qwen3-Next-80B-A3B style, and Bamba-9B's with its attention at layers 9, 18 and 27), in
bfloat16 with the shipped drafter's block of 16:

    python benchmarks/hybrid_memory.py [TOKENS]

Per method and budget: the committed states (every recurrent layer's convolution inputs and float32
state), what a step's tree nodes hold until the commit, and the KV cache of the attention layers for
TOKENS tokens (default 4096), all per slot; from `ddtree.engine.capacity`, the numbers the engine checks
against free memory before it allocates."""

from __future__ import annotations

import sys

import torch
from transformers import BambaConfig, Qwen3_5TextConfig, Qwen3NextConfig

from ddtree.engine.capacity import ModelDims, plan_session, recurrent_bytes, session_bytes
from ddtree.methods import get_method

SHAPES = {
    "Qwen3.5-9B style": Qwen3_5TextConfig(),
    "Qwen3-Next-80B-A3B style": Qwen3NextConfig(),
    "Bamba-9B style": BambaConfig(attn_layer_indices=[9, 18, 27]),
}
RUNS = (("ar", 1), ("dflash", 1), ("ddtree", 16), ("ddtree", 32), ("ddtree", 64))
DEPTH = 15  # the shipped drafter's block of 16


def main(tokens: int) -> None:
    print(f"| target | method | committed states | tree nodes' states | KV cache ({tokens} tokens) | per slot |")
    print("|---|---|---|---|---|---|")
    for name, config in SHAPES.items():
        dims = ModelDims.of(config, torch.bfloat16)
        assert dims.recurrent is not None
        committed = dims.recurrent.committed_bytes(dims.dtype_bytes)
        for method, budget in RUNS:
            plan = plan_session(dims, get_method(method).shape(budget, None, DEPTH), 1, tokens)
            states = recurrent_bytes(dims, plan)
            kv, _ = session_bytes(dims, plan)
            cells = (committed, states - committed, kv, states + kv)
            print(f"| {name} | {plan.label} | " + " | ".join(f"{c / 2**20:.0f} MiB" for c in cells) + " |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
