"""Where a graphed decode step spends its time, on a CUDA GPU: wall time per step, GPU kernels per step and
their total time (torch profiler), and time per stage (the GPU clock stamps of the observed step's graph, or,
without Triton, per-stage graphs with CUDA events between them).

    python benchmarks/profile_step.py TARGET_DIR [OUT_DIR] [BATCH] [TREE_KERNEL]

TREE_KERNEL is torch or triton (default: triton where it is available).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from ddtree.data import heldout_prompts
from ddtree.engine.requests import Request
from ddtree.engine.session import DecodeSession
from ddtree.kernels.tree_build import triton_available
from ddtree.methods import get_method
from ddtree.models.chat import chat_ids
from ddtree.models.default import default_drafter
from ddtree.models.pair import load_models
from ddtree.observer import NoopObserver, StepProbe
from telemetry.semconv import STAGES


class StageEvents(NoopObserver):
    """CUDA events at stage boundaries (read after a synchronize at the end), or the device's stamps of a step
    replayed from a stamped graph, which gets no stage hooks."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, Any, Any]] = []
        self.open: tuple[str, Any] | None = None

    def on_stage_start(self, stage: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.open = (stage, event)

    def on_stage_end(self, stage: str) -> None:
        assert self.open is not None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.marks.append((stage, self.open[1], event))

    def on_probe(self, step: int, probe: StepProbe) -> None:
        stamps = probe.stamps_ns
        if stamps is not None:  # GPU clock ns at the step's start and after each stage
            self.marks.extend((stage, stamps[i], stamps[i + 1]) for i, stage in enumerate(STAGES))

    def means(self) -> dict[str, float]:
        torch.cuda.synchronize()
        sums: dict[str, list[float]] = {}
        for stage, start, end in self.marks:
            ms = (end - start) / 1e6 if isinstance(start, int) else start.elapsed_time(end)
            sums.setdefault(stage, []).append(ms)
        return {s: sum(v) / len(v) for s, v in sums.items()}


def steady_ms(session: DecodeSession, steps: int) -> float:
    """Wall milliseconds per step over `steps` steps that met no new step shape (a key span that grows past a
    bucket captures a graph: such a run is measured again, up to three times)."""
    wall_ms = float("nan")
    for _ in range(3):
        captured = len(session.runner.captured)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(steps):
            session.step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - started) * 1000 / steps
        if len(session.runner.captured) == captured:
            break
    return wall_ms


def measure(
    target: Any, drafter: Any, prompts: list[list[int]], method: str, budget: int, tree_kernel: str
) -> dict[str, Any]:
    batch = len(prompts)
    options: dict[str, Any] = {"slots": batch, "capacity": 2048, "cuda_graphs": True, "tree_kernel": tree_kernel}
    shape = get_method(method).shape(budget, None, drafter.depth)
    session = DecodeSession(target, drafter, shape, **options)
    session.join([Request(p, 1500) for p in prompts])
    for _ in range(3):
        session.step()  # the first step of a shape runs eagerly and captures
    wall_ms = steady_ms(session, 30)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            session.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.device_time for e in kernels) / 1000 / 10
    top = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]
    timer = StageEvents()
    staged = DecodeSession(target, drafter, shape, observer=timer, **options)
    staged.join([Request(p, 1500) for p in prompts])
    for _ in range(3):
        staged.step()
    for _ in range(3):  # again if a step of the timed ones met a new shape (its capture would count)
        timer.marks.clear()
        captured = len(staged.runner.captured)
        for _ in range(20):
            staged.step()
        if len(staged.runner.captured) == captured:
            break
    return {
        "method": method,
        "budget": budget,
        "batch": batch,
        "tree_kernel": tree_kernel,
        "wall_ms_per_step": round(wall_ms, 3),
        "kernels_per_step": len(kernels) / 10,
        "gpu_ms_per_step": round(gpu_ms, 3),
        "stage_ms": {k: round(v, 3) for k, v in timer.means().items()},
        "top_kernels": [(e.key[:60], e.count // 10, round(e.device_time_total / 10 / 1000, 3)) for e in top],
    }


def main(target_dir: str, out_dir: str = ".", batch: str = "1", tree_kernel: str = "") -> None:
    tree_kernel = tree_kernel or ("triton" if triton_available() else "torch")
    target, drafter, tokenizer = load_models(target_dir, str(default_drafter()), "cuda", "bfloat16")
    target.compile_layers()
    drafter.compile_layers()
    prompts = [chat_ids(tokenizer, p) for p in heldout_prompts()[: int(batch)]]
    configs = (("ar", 1), ("dflash", 1), ("ddtree", 16), ("ddtree", 64))
    rows = [measure(target, drafter, prompts, m, b, tree_kernel) for m, b in configs]
    Path(out_dir, f"profile_b{batch}.json").write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(
            f"{r['method']:<7} B={r['budget']:<3} batch {r['batch']}: wall {r['wall_ms_per_step']} ms/step, "
            f"{r['kernels_per_step']:.0f} kernels, GPU {r['gpu_ms_per_step']} ms; stages {r['stage_ms']}"
        )
        for name, count, ms in r["top_kernels"]:
            print(f"    {ms:>8.3f} ms  x{count:<4} {name}")


if __name__ == "__main__":
    main(*sys.argv[1:5])
