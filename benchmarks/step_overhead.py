"""Where `Engine.generate`'s wall time goes at batch 1 on CUDA, beyond the steady-state step: prefill (join),
steps, the drain and any graph captured during the timed run, per method.

    python benchmarks/step_overhead.py TARGET_DIR [TREE_KERNEL]
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from ddtree.data import heldout_prompts
from ddtree.engine.engine import Engine
from ddtree.models.chat import chat_ids, eos_ids
from ddtree.models.default import default_drafter
from ddtree.models.pair import load_models
from ddtree.settings import GenerationConfig


def timed(fn: Callable[..., Any], totals: dict[str, float], counts: dict[str, int], name: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        totals[name] += time.perf_counter() - started
        counts[name] += 1
        return out

    return wrapper


def run(engine: Engine, prompts: list[list[int]], method: str, budget: int, eos: tuple[int, ...]) -> None:
    config = GenerationConfig(method=method, budget=budget, max_new_tokens=128, eos_token_ids=eos)
    for p in prompts:  # warm-up: every shape once
        engine.generate([p], config)
    plain = 0.0
    for p in prompts:
        torch.cuda.synchronize()
        started = time.perf_counter()
        result = engine.generate([p], config)
        torch.cuda.synchronize()
        plain += time.perf_counter() - started
    session = next(reversed(engine.sessions.values()))
    captured = len(session.runner.captured)
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for name in ("join", "step", "drain", "leave"):
        setattr(session, name, timed(getattr(session, name), totals, counts, name))
    steps = tokens = 0
    for p in prompts:
        result = engine.generate([p], config)
        steps += result.steps
        tokens += result.new_tokens
    for name in ("join", "step", "drain", "leave"):
        delattr(session, name)
    print(
        f"{method} B={budget}: plain {plain * 1000 / steps:.3f} ms/step ({tokens / plain:.1f} tok/s), {steps} steps;"
        f" synced: "
        + ", ".join(f"{k} {v * 1000:.1f} ms / {counts[k]}" for k, v in totals.items())
        + f"; graphs {captured} -> {len(session.runner.captured)}; keys {sorted(session.runner.captured)[:12]}"
    )


def main(target_dir: str, tree_kernel: str = "triton") -> None:
    target, drafter, tokenizer = load_models(target_dir, str(default_drafter()), "cuda", "bfloat16")
    engine = Engine(target, drafter, cuda_graphs="on", tree_kernel=tree_kernel)
    prompts = [chat_ids(tokenizer, p) for p in heldout_prompts()[:8]]
    eos = eos_ids(tokenizer, target)
    for method, budget in (("ar", 1), ("dflash", 1), ("ddtree", 16)):
        run(engine, prompts, method, budget, eos)


if __name__ == "__main__":
    main(*sys.argv[1:3])
