"""Where continuous batching spends its time, on a CUDA GPU: `Engine.stream` over the held-out prompts, warmed
up on the same prompts (so no graph is captured while timed), then timed once more with each join's host time
and its prefill's GPU time (CUDA events around it) recorded, and once under the torch profiler for the GPU's
busy time. What is neither steps' nor prefills' GPU time is the device waiting for the host.

    python benchmarks/profile_stream.py TARGET_DIR SLOTS [PROMPTS] [METHOD:BUDGET ...]

PROMPTS: how many held-out prompts (repeated past 64); default: four per slot. Default rows: ar, ddtree:16.
Without CUDA it runs on the CPU in float32 (a dry run: no GPU times, 16 new tokens).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from ddtree.data import heldout_prompts
from ddtree.engine.engine import Engine
from ddtree.engine.session import DecodeSession
from ddtree.models.chat import chat_ids, eos_ids
from ddtree.models.default import default_drafter
from ddtree.models.pair import load_models
from ddtree.settings import GenerationConfig


class JoinClock:
    """Wraps a session's `join` and `_prefill`: host seconds per join, CUDA events around each prefill."""

    def __init__(self, session: DecodeSession) -> None:
        self.host: list[float] = []
        self.sizes: list[int] = []
        self.events: list[tuple[Any, Any]] = []
        join, prefill = session.join, session._prefill

        def timed_join(requests: list[Any]) -> list[int]:
            started = time.perf_counter()
            out = join(requests)
            self.host.append(time.perf_counter() - started)
            self.sizes.append(len(requests))
            return out

        def timed_prefill(ids: list[int], requests: list[Any]) -> Any:
            if not torch.cuda.is_available():
                return prefill(ids, requests)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = prefill(ids, requests)
            end.record()
            self.events.append((start, end))
            return out

        session.join = timed_join  # type: ignore[method-assign]
        session._prefill = timed_prefill  # type: ignore[method-assign]

    def prefill_gpu_s(self) -> float:
        _sync()
        return sum(s.elapsed_time(e) for s, e in self.events) / 1000


def gpu_busy_s(prof: Any) -> float:
    """Seconds in which some kernel or copy ran (the union of their intervals)."""
    spans = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy, reach = 0.0, float("-inf")
    for start, end in spans:
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy / 1e6


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def row(engine: Engine, prompts: list[list[int]], slots: int, config: GenerationConfig) -> dict[str, Any]:
    engine.stream(prompts, config, slots)  # warm-up: every shape this run meets is captured here
    session = engine.session(config, slots, max(len(p) for p in prompts) + config.max_new_tokens)
    clock = JoinClock(session)
    _sync()
    result = engine.stream(prompts, config, slots)
    _sync()
    prefill_gpu = clock.prefill_gpu_s()
    del session.join, session._prefill  # back to the methods
    with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
        profiled = engine.stream(prompts, config, slots)
        _sync()
    busy = gpu_busy_s(prof)
    return {
        "row": f"{config.method}:{config.budget}",
        "tok_s": result.new_tokens / result.seconds,
        "wall_s": result.seconds,
        "steps": result.steps,
        "joins": len(clock.sizes),
        "joined": sum(clock.sizes),
        "join_host_s": sum(clock.host),
        "prefill_gpu_s": prefill_gpu,
        "profiled_wall_s": profiled.seconds,
        "gpu_busy_s": busy,
    }


def main(target_dir: str, slots: str, count: str = "", *rows: str) -> None:
    cuda = torch.cuda.is_available()
    target, drafter, tokenizer = load_models(
        target_dir, str(default_drafter()), "cuda" if cuda else "cpu", "bfloat16" if cuda else "float32"
    )
    engine = Engine(target, drafter)
    n = int(count or 4 * int(slots))
    texts = heldout_prompts()
    prompts = [chat_ids(tokenizer, texts[i % len(texts)]) for i in range(n)]
    eos = eos_ids(tokenizer, target)
    for spec in rows or ("ar:1", "ddtree:16"):
        method, budget = spec.split(":")
        new = 128 if cuda else 16
        config = GenerationConfig(method=method, budget=int(budget), max_new_tokens=new, eos_token_ids=eos)
        r = row(engine.sibling(), prompts, int(slots), config)
        step_s = r["wall_s"] - r["join_host_s"]
        print(
            f"{r['row']:<10} {slots} slots, {n} prompts: {r['tok_s']:.1f} tok/s, {r['wall_s'] * 1000:.1f} ms, "
            f"{r['steps']} steps ({step_s / r['steps'] * 1000:.2f} ms each outside joins); {r['joins']} joins of "
            f"{r['joined']} requests: host {r['join_host_s'] * 1000:.1f} ms, prefill GPU "
            f"{r['prefill_gpu_s'] * 1000:.1f} ms; profiled: wall {r['profiled_wall_s'] * 1000:.1f} ms, GPU busy "
            f"{r['gpu_busy_s'] * 1000:.1f} ms"
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
