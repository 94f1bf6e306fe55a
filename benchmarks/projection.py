"""A projection for bigger targets: graphed step times of randomly initialised Llama-shaped targets (1B and 8B
parameters, bfloat16) with our drafter's shape scaled to them, combined with the acceptance (tau) the real
pair reached at each budget. A timing-only run: the weights are random, so the acceptance is not theirs.

    python benchmarks/projection.py BENCH_JSON [SIZES] [DEVICE]

BENCH_JSON is a `ddtree bench --json` file of the real pair (its tau per method and budget). SIZES is a
comma-separated subset of 1b,8b (default both), or `tiny` for a CPU smoke test. Projected tokens/s at batch 1
= tau / (measured ms per step).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ddtree.engine.requests import Request
from ddtree.engine.session import DecodeSession
from ddtree.kernels.tree_build import triton_available
from ddtree.methods import get_method
from ddtree.models.dflash import DFlashDrafter, drafter_config
from ddtree.models.target import Target

SHAPES = {  # Llama 3.2 1B and Llama 3.1 8B
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192, "num_attention_heads": 32},
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128, "num_attention_heads": 4},
}


def random_pair(size: str, device: torch.device) -> tuple[Target, DFlashDrafter]:
    vocab = 128256 if size != "tiny" else 512
    kv_heads = 8 if size != "tiny" else 2
    config = LlamaConfig(vocab_size=vocab, num_key_value_heads=kv_heads, max_position_embeddings=8192, **SHAPES[size])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()  # type: ignore[no-untyped-call]
    features = [round(1 + i * (config.num_hidden_layers - 4) / 2) for i in range(3)]
    drafter = DFlashDrafter(drafter_config(config, 2, 16, vocab - 1, feature_layers=features))
    return Target(model, feature_layers=tuple(features)), drafter.to(device=device, dtype=dtype).eval()


def step_ms(target: Target, drafter: DFlashDrafter, method: str, budget: int, graphs: bool) -> float:
    kernel = "triton" if graphs and triton_available() else "torch"
    shape = get_method(method).shape(budget, None, drafter.depth)
    session = DecodeSession(target, drafter, shape, slots=1, capacity=1536, cuda_graphs=graphs, tree_kernel=kernel)
    session.join([Request(list(range(1, 129)), 700)])
    for _ in range(3):
        session.step()
    if graphs:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(20):
        session.step()
    if graphs:
        torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1000 / 20


def main(bench_json: str, sizes: str = "1b,8b", device_name: str = "cuda") -> None:
    rows: list[dict[str, Any]] = json.loads(Path(bench_json).read_text())
    taus = {(r["method"], r["budget"]): r["tau"] for r in rows if r.get("tau")}
    device = torch.device(device_name)
    graphs = device.type == "cuda"
    print("projection (random weights, real pair's tau), batch 1: method, tau, ms/step, projected tok/s, vs ar")
    for size in sizes.split(","):
        target, drafter = random_pair(size, device)
        if graphs:
            target.compile_layers()
            drafter.compile_layers()
        ar_tps = None
        for (method, budget), tau in sorted(taus.items(), key=lambda kv: (kv[0][0] != "ar", kv[0][1] or 0)):
            ms = step_ms(target, drafter, method, budget or 1, graphs)
            tps = tau / ms * 1000
            ar_tps = tps if method == "ar" else ar_tps
            ratio = f"{tps / ar_tps:.2f}x" if ar_tps else "-"
            label = method if budget is None else f"{method} B={budget}"
            print(f"{size:>5} {label:<12} {tau:5.2f} {ms:8.2f} {tps:9.1f} {ratio:>7}")
        del target, drafter
        if graphs:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:4])
