"""Time one layer's tree attention on the GPU: the Triton kernel against sdpa given the dense mask (the mask's
construction included, as the target builds it once per forward and the 30 layers share it).

    python benchmarks/attention_device.py [--json OUT]

Shapes are the default target's (9 heads, 3 KV heads, head size 64, bfloat16); each case is captured as a
CUDA graph of 20 calls and replayed, so launch costs are those of a graphed step.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from torch.nn import functional as F

from ddtree.kernels.tree_attention import tree_attention
from ddtree.models.target import tree_attention_mask

CASES = [(b, n, p) for b in (1, 16, 64) for n in (1, 17, 33, 65) for p in (256, 768)]


def timed(call: Callable[[], torch.Tensor], reps: int = 20, rounds: int = 10) -> float:
    """Microseconds per call, from a graph of `reps` calls replayed `rounds` times."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) * 1000 / (reps * rounds)


def case(batch: int, n: int, prefix: int) -> dict[str, float]:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    capacity = prefix + 128
    q = torch.randn((batch, 9, n, 64), device=dev, dtype=dtype)
    keys = torch.randn((batch, 3, capacity, 64), device=dev, dtype=dtype)
    values = torch.randn_like(keys)
    lengths = torch.full((batch,), prefix, device=dev)
    visible = torch.tril(torch.ones((n, n), dtype=torch.bool, device=dev)).expand(batch, -1, -1).contiguous()
    span = prefix + 64 * (-(-n // 64))

    def dense() -> torch.Tensor:
        mask = tree_attention_mask(lengths, visible, span)
        k, v = keys[:, :, :span], values[:, :, :span]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)

    def kernel() -> torch.Tensor:
        return tree_attention(q, keys, values, lengths, visible, 0.125)

    err = (kernel().float() - dense().float()).abs().max().item()
    return {"batch": batch, "n": n, "prefix": prefix, "sdpa_us": timed(dense), "triton_us": timed(kernel), "err": err}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = [case(*c) for c in CASES]
    print(f"{'batch':>5} {'n':>3} {'prefix':>6} {'sdpa+mask us':>12} {'triton us':>9} {'ratio':>6} {'max err':>8}")
    for r in rows:
        ratio = r["sdpa_us"] / r["triton_us"]
        print(
            f"{r['batch']:>5} {r['n']:>3} {r['prefix']:>6} {r['sdpa_us']:>12.1f} {r['triton_us']:>9.1f} "
            f"{ratio:>6.2f} {r['err']:>8.4f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
