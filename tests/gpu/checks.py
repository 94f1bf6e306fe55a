"""Checks that need a CUDA GPU, in one run: greedy losslessness on the real pair (eager and graphed), seeded
sampling graphed against eager, the decode loop with telemetry on under
`torch.cuda.set_sync_debug_mode("error")`, and the telemetry overhead ratio.

    python tests/gpu/checks.py TARGET_DIR [DRAFTER_DIR [DEVICE [CHECKS]]]

DEVICE defaults to cuda; `cpu` runs the same steps (without the sync check) as a smoke test. CHECKS is a
comma-separated subset of lossless,sync,overhead (default: all three).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from ddtree.bench.rows import PairSpec, telemetry_overhead
from ddtree.data import heldout_prompts
from ddtree.engine.engine import Engine
from ddtree.models.chat import chat_ids, eos_ids
from ddtree.models.default import default_drafter
from ddtree.models.pair import load_models
from ddtree.schedule import BudgetSchedule, Choice
from ddtree.settings import GenerationConfig
from telemetry import start_telemetry
from telemetry.config import TelemetryConfig

TELEMETRY_ON = TelemetryConfig(
    enabled=True,
    otlp_endpoint="http://127.0.0.1:9",  # nobody listens: exports fail in the background, as with a dead collector
    otlp_protocol="http/protobuf",
    prometheus_port=0,
    log_file="/dev/null",
)


def main(target_dir: str, drafter_dir: str, device: str = "cuda", checks: str = "lossless,sync,overhead") -> None:
    count = 16 if device == "cuda" else 2
    on_gpu = tuple(os.environ.get("GPU_CHECK_DTYPES", "float32,bfloat16").split(","))
    dtypes = on_gpu if device == "cuda" else ("float32",)
    every_dtype = "lossless" in checks or "adaptive" in checks
    for dtype in dtypes if every_dtype else dtypes[-1:]:  # the last one serves the other checks
        target, drafter, tokenizer = load_models(target_dir, drafter_dir, device, dtype)
        prompts = [chat_ids(tokenizer, p) for p in heldout_prompts()[:count]]
        eos = eos_ids(tokenizer, target)
        if "adaptive" in checks:
            _adaptive(Engine(target, drafter, cuda_graphs="off"), Engine(target, drafter), prompts, eos, dtype)
        if "lossless" not in checks:
            continue
        eager = Engine(target, drafter, cuda_graphs="off")
        engine = Engine(target, drafter)  # CUDA graphs on a GPU, the Triton tree build and attention where they run
        torch_tree = Engine(target, drafter, tree_kernel="torch")
        sdpa = Engine(target, drafter, attention="sdpa")
        ar_cfg = GenerationConfig(method="ar", max_new_tokens=64, eos_token_ids=eos)
        ar = eager.generate(prompts, ar_cfg).outputs
        for method, budget in (("ar", 1), ("dflash", 1), ("ddtree", 8), ("ddtree", 32)):  # B=8 < depth 15
            cfg = GenerationConfig(method=method, budget=budget, max_new_tokens=64, eos_token_ids=eos)
            runners = [("eager", eager), ("graphed", engine), ("graphed torch-tree", torch_tree)]
            for name, runner in [*runners, ("graphed sdpa", sdpa)] if method != "ar" else [("graphed", engine)]:
                out = runner.generate(prompts, cfg).outputs
                same = sum(a.token_ids == b.token_ids for a, b in zip(ar, out, strict=True))
                print(
                    f"lossless {dtype} {name} {method} B={budget}: {same}/{len(prompts)} prompts identical to eager ar"
                )
        hot = GenerationConfig(
            method="ddtree", budget=32, temperature=0.8, seed=5, max_new_tokens=64, eos_token_ids=eos
        )
        pairs = zip(eager.generate(prompts, hot).outputs, engine.generate(prompts, hot).outputs, strict=True)
        same = sum(a.token_ids == b.token_ids for a, b in pairs)
        print(f"sampled {dtype} ddtree B=32 T=0.8: graphed equals eager on {same}/{len(prompts)} prompts")
        _filtered_and_scored(eager, engine, prompts, eos, dtype)
        _switching(eager, engine, prompts, eos, dtype, ar)

    cfg = GenerationConfig(method="ddtree", budget=32, max_new_tokens=32, eos_token_ids=eos)
    if device == "cuda" and "sync" in checks:
        telemetry = start_telemetry(TELEMETRY_ON, device_type="cuda")
        engine = Engine(target, drafter, observer=telemetry.observer)
        engine.generate(prompts[:4], cfg)  # warm-up
        torch.cuda.set_sync_debug_mode("error")
        try:
            engine.generate(prompts[:4], cfg)
            print("sync debug mode 'error' with telemetry on: no implicit sync")
        except RuntimeError as exc:
            print(f"sync debug mode 'error' with telemetry on: FAILED: {exc}")
        finally:
            torch.cuda.set_sync_debug_mode(0)
            telemetry.shutdown()

    for batch in (1, count) if "overhead" in checks else ():
        pair = PairSpec(target_dir, drafter_dir, device, "bfloat16" if device == "cuda" else "float32")
        off, on = telemetry_overhead(pair, prompts, cfg, batch, 4, TELEMETRY_ON)
        print(
            f"telemetry overhead, ddtree B=32, batch {batch}: "
            f"off {off:.1f} tok/s, on {on:.1f} tok/s, on/off {on / off:.4f}"
        )


def _filtered_and_scored(
    eager: Engine, engine: Engine, prompts: list[list[int]], eos: tuple[int, ...], dtype: str
) -> None:
    """top-p and top-k sampling, and logprobs, graphed against eager: the same draws, the same values."""
    for extra in ({"top_p": 0.8}, {"top_k": 5}):
        cfg = GenerationConfig(
            method="ddtree",
            budget=32,
            temperature=0.8,
            seed=7,
            max_new_tokens=48,
            eos_token_ids=eos,
            logprobs=3,
            **extra,
        )
        pairs = list(zip(eager.generate(prompts, cfg).outputs, engine.generate(prompts, cfg).outputs, strict=True))
        same = sum(a.token_ids == b.token_ids for a, b in pairs)
        close = sum(
            a.token_ids == b.token_ids and all(abs(x - y) < 1e-3 for x, y in zip(a.logprobs, b.logprobs, strict=True))
            for a, b in pairs
        )
        print(
            f"filtered {dtype} ddtree B=32 T=0.8 {extra}: graphed equals eager on {same}/{len(prompts)} prompts, "
            f"logprobs within 1e-3 on {close}"
        )


def _switching(
    eager: Engine, engine: Engine, prompts: list[list[int]], eos: tuple[int, ...], dtype: str, ar: list[Any]
) -> None:
    """A budget that follows the load, graphed and streamed through 8 slots: greedy output is ar's."""
    schedule = BudgetSchedule(
        (Choice(1, "ddtree", 64), Choice(2, "ar"), Choice(4, "ddtree", 16), Choice(8, "ddtree", 4))
    )
    cfg = GenerationConfig(method="ddtree", schedule=schedule, max_new_tokens=64, eos_token_ids=eos)
    out = engine.stream(prompts, cfg, slots=8).outputs
    same = sum(a.token_ids == b.token_ids for a, b in zip(ar, out, strict=True))
    budgets = sorted({b for o in out for b in o.budgets})
    print(f"lossless {dtype} graphed auto (steps at budgets {budgets}): {same}/{len(prompts)} identical to eager ar")


def _adaptive(eager: Engine, engine: Engine, prompts: list[list[int]], eos: tuple[int, ...], dtype: str) -> None:
    """Each step's width chosen by its own tree (`--budget adaptive`), eager and graphed in a batch, and graphed
    streamed through 8 slots (where a row count commits, its steps run the width's fixed step): greedy output
    is ar's.
    (Sampled tokens follow the widths chosen, which follow measured times: sampling's exactness is tested in
    distribution, on the CPU.)"""
    ar = eager.generate(prompts, GenerationConfig(method="ar", max_new_tokens=64, eos_token_ids=eos)).outputs
    cfg = GenerationConfig(method="ddtree", budget=64, adaptive=True, max_new_tokens=64, eos_token_ids=eos)
    for name, out in (
        ("eager", eager.generate(prompts, cfg).outputs),
        ("graphed", engine.generate(prompts, cfg).outputs),
        ("graphed 8 slots", engine.stream(prompts, cfg, slots=8).outputs),
    ):
        same = sum(a.token_ids == b.token_ids for a, b in zip(ar, out, strict=True))
        widths = sorted({b for o in out for b in o.budgets})
        print(f"lossless {dtype} {name} adaptive<=64 (steps at widths {widths}): {same}/{len(prompts)} identical to ar")


if __name__ == "__main__":
    main(sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "") or str(default_drafter()), *sys.argv[3:5])
