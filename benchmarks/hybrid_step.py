"""Step times of a randomly initialised Qwen3.5-style hybrid target at a real shape, and its losslessness.

    python benchmarks/hybrid_step.py OUT_DIR [--size 2b|tiny] [--batch 1] [--skip-lossless]

The target has the shape of a small Qwen3.5 text model (`--size 2b`: hidden 2048, 24 layers, three
gated-delta-net layers to one of full attention, Qwen3.5's head sizes and vocabulary, tied embeddings;
about 1.9 B parameters), random weights, and a random 2-layer DFlash drafter with the shipped drafter's
block of 16. Random weights make no sense as text, but a step's time does not depend on what it says.

1. Lossless (float32, unless `--skip-lossless`): greedy `dflash` and ddtree B=16 and B=64, graphed (on
   CUDA), equal eager `ar`, token for token, on 4 random prompts of 32 new tokens.
2. Step times (bfloat16, graphed on CUDA): ms per step of `ar`, `dflash`, ddtree B=16 and B=64 at `--batch`
   rows, with the torch profiler's top kernels of each, and a projection to tokens/s with the default
   pair's measured tau (labelled as such: the random pair accepts nothing).

`--size tiny` runs the same on a tiny shape, on the CPU too (eager), as a smoke test. Writes
OUT_DIR/hybrid_step_b{batch}.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from ddtree.engine.engine import Engine
from ddtree.engine.requests import Request
from ddtree.engine.session import DecodeSession
from ddtree.methods import get_method
from ddtree.models.dflash import DFlashDrafter, drafter_config
from ddtree.models.hybrid import make_target
from ddtree.models.target import Target
from ddtree.settings import GenerationConfig

RUNS = (("ar", 0), ("dflash", 0), ("ddtree", 16), ("ddtree", 64))
# The default pair's tau with the shipped drafter (v3) on the H100 at batch 1, bfloat16, 8 held-out prompts of 128
# tokens (benchmarks/results/h100-smollm2-bf16-v3-b1.json): what a trained drafter of this block size reaches; the
# projection is step time and this tau, not a measurement.
PAIR_TAU = {"ar": 1.0, "dflash": 2.37, "ddtree B=16": 2.77, "ddtree B=64": 3.56}


def qwen35_config(size: str) -> Any:
    from transformers import Qwen3_5TextConfig

    if size == "tiny":
        shape: dict[str, Any] = dict(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4
        )
        shape.update(num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
        shape.update(linear_key_head_dim=16, linear_value_head_dim=16)
    elif size == "2b":
        shape = dict(vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24)
        shape.update(num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16)
        shape.update(linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128)
    else:
        raise SystemExit(f"hybrid_step: --size must be tiny or 2b, got {size!r}")
    layers = shape["num_hidden_layers"]
    types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    return Qwen3_5TextConfig(**shape, layer_types=types, linear_conv_kernel_dim=4, tie_word_embeddings=True)


def random_pair(config: Any, device: torch.device, dtype: torch.dtype, seed: int = 0) -> tuple[Target, DFlashDrafter]:
    """The random target (HF's initialisation, the head's weights larger so that its argmax is clear of ties)
    and a random 2-layer drafter, both in `dtype` on `device`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with device:
        model: Any = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
        torch.nn.init.normal_(model.get_input_embeddings().weight, std=0.05)
        drafter = DFlashDrafter(drafter_config(config, 2, 16, mask_token_id=0)).to(dtype)
    return make_target(model.eval(), feature_layers=drafter.target_layer_ids), drafter.eval()


def lossless(size: str, device: torch.device) -> dict[str, Any]:
    """Greedy dflash and ddtree B=16/64 (graphed on CUDA) against eager ar, in float32."""
    target, drafter = random_pair(qwen35_config(size), device, torch.float32)
    vocab = target.model.config.vocab_size
    prompts = [torch.randint(1, vocab, (n,)).tolist() for n in (5, 17, 9, 30)]
    reference = Engine(target, drafter, cuda_graphs="off").generate(prompts, GenerationConfig("ar", max_new_tokens=32))
    graphs = "on" if device.type == "cuda" else "off"
    engine = Engine(target, drafter, cuda_graphs=graphs)
    results = {}
    for method, budget in RUNS[1:]:
        out = engine.generate(prompts, GenerationConfig(method, budget or 32, max_new_tokens=32))
        same = sum(a.token_ids == b.token_ids for a, b in zip(out.outputs, reference.outputs, strict=True))
        results[get_method(method).label(budget or None)] = f"{same}/{len(prompts)}"
    del target, drafter, engine
    return {"dtype": "float32", "graphs": graphs, "identical_to_eager_ar": results}


def step_times(size: str, device: torch.device, batch: int) -> list[dict[str, Any]]:
    """ms per step, graphed on CUDA, in bfloat16 there (float32 elsewhere), and each run's top kernels."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, drafter = random_pair(qwen35_config(size), device, dtype)
    if device.type == "cuda":  # as the engine does with CUDA graphs: the layers' compiled regions
        target.compile_layers()
        drafter.compile_layers()
    vocab = target.model.config.vocab_size
    prompts = [torch.randint(1, vocab, (64,)).tolist() for _ in range(batch)]
    rows = []
    for method, budget in RUNS:
        shape = get_method(method).shape(budget, None, drafter.depth)
        session = DecodeSession(target, drafter, shape, slots=batch, capacity=1200, cuda_graphs=device.type == "cuda")
        session.join([Request(p, 900) for p in prompts])
        for _ in range(3):
            session.step()  # the first steps of a shape run eagerly and capture
        rows.append({"label": shape.label, "batch": batch, **_timed(session, device)})
    return rows


def _timed(session: DecodeSession, device: torch.device, steps: int = 30) -> dict[str, Any]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    for _ in range(steps):
        session.step()
    sync()
    ms = (time.perf_counter() - started) * 1000 / steps
    if device.type != "cuda":
        return {"ms_per_step": round(ms, 3)}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            session.step()
        sync()
    top = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:10]
    kernels = [(e.key[:70], e.count // 10, round(e.device_time_total / 10 / 1000, 3)) for e in top]
    return {"ms_per_step": round(ms, 3), "top_kernels": kernels}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="directory for hybrid_step_b{batch}.json")
    parser.add_argument("--size", default="2b", help="2b (a real shape) or tiny (a smoke test)")
    parser.add_argument("--batch", type=int, default=1, help="rows per step")
    parser.add_argument("--skip-lossless", action="store_true", help="only the step times")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result: dict[str, Any] = {
        "size": args.size,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    if not args.skip_lossless:
        result["lossless"] = lossless(args.size, device)
        print(f"lossless: {result['lossless']}", flush=True)
    rows = step_times(args.size, device, args.batch)
    for row in rows:
        tau = PAIR_TAU[row["label"]]
        row["projected_tokens_per_second"] = round(tau * args.batch * 1000 / row["ms_per_step"], 1)
        print(
            f"{row['label']:<12} batch {args.batch}: {row['ms_per_step']} ms/step, projected "
            f"{row['projected_tokens_per_second']} tok/s at the default pair's tau {tau}",
            flush=True,
        )
    result["steps"] = rows
    result["projection"] = f"tokens/s = the default pair's tau x rows / step time (tau {PAIR_TAU})"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"hybrid_step_b{args.batch}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
