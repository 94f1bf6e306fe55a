"""Timing of the tree build: the torch reference against the fused Triton path, on random logits."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ddtree.kernels.tree_build import build_tree_fused, triton_available
from ddtree.tree import build_tree


def _median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of `fn` in milliseconds over `repeats` calls, after two warm-up calls (compiles)."""
    for _ in range(2):
        fn()
    samples: list[float] = []
    for _ in range(max(1, repeats)):
        if device.type == "cuda":
            start: Any = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end: Any = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def time_tree_build(device: str, batch: int, depth: int, vocab: int, budget: int, repeats: int) -> dict[str, float]:
    """Median milliseconds of one tree build on random float32 logits [batch, depth, vocab].

    Returns {"torch_ms": ...} for `ddtree.tree.build_tree`, plus {"fused_ms": ...} for `build_tree_fused` when
    `device` is a CUDA device and Triton is importable (never on CPU: the Triton interpreter is a correctness
    tool, not a speed one). CUDA timings use events around each call, after two warm-up calls.
    """
    dev = torch.device(device)
    generator = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn((batch, depth, vocab), generator=generator, device=dev) * 3  # [batch, depth, vocab]
    result = {"torch_ms": _median_ms(lambda: build_tree(logits, budget), dev, repeats)}
    if dev.type == "cuda" and triton_available():
        result["fused_ms"] = _median_ms(lambda: build_tree_fused(logits, budget), dev, repeats)
    return result
