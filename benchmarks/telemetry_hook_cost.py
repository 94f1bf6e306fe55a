"""Where telemetry's cost goes, per decode step: step time with telemetry off (before it is started) and on,
the wall time inside each hook and sink, and the time the garbage collector takes, in one process.

    python benchmarks/telemetry_hook_cost.py [TARGET_DIR [DRAFTER_DIR [DEVICE [FIELD=VALUE ...]]]]

Defaults: the default pair on CPU. Spans go to an OTLP endpoint that is down, metrics to Prometheus, logs to
/dev/null, as in `ddtree bench --telemetry-overhead`; FIELD=VALUE changes a `TelemetryConfig` string field
(e.g. traces_exporter=none). If the step grows by more than the hooks take, the rest is spent outside them
(telemetry's threads, the collector's garbage, the device).
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from gpu_checks import TELEMETRY_ON  # the same set-up: OTLP endpoint down, Prometheus, logs to /dev/null

import ddtree.engine.session as session_module
from ddtree.data import heldout_prompts
from ddtree.engine.engine import Engine
from ddtree.models.chat import chat_ids, eos_ids
from ddtree.models.default import default_drafter, default_target
from ddtree.models.pair import load_models
from ddtree.settings import GenerationConfig
from telemetry import start_telemetry


def timed(fn: Callable[..., Any], name: str, spent: defaultdict[str, float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start

    return wrapper


def gc_clock(spent: defaultdict[str, float]) -> Callable[[str, dict[str, Any]], None]:
    started = [0.0]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            spent["(garbage collector)"] += time.perf_counter() - started[0]

    return callback


def run(engine: Engine, prompts: list[list[int]], config: GenerationConfig, batch: int) -> tuple[int, float]:
    results = [engine.generate(prompts[i : i + batch], config) for i in range(0, len(prompts), batch)]
    return sum(r.steps for r in results), sum(r.seconds for r in results)


def main(target_dir: str, drafter_dir: str, device: str) -> None:
    target, drafter, tokenizer = load_models(target_dir, drafter_dir, device, "auto")
    prompts = [chat_ids(tokenizer, p) for p in heldout_prompts()[:8]]
    config = GenerationConfig(method="ddtree", budget=32, max_new_tokens=48, eos_token_ids=eos_ids(tokenizer, target))
    spent: defaultdict[str, float] = defaultdict(float)
    gc.callbacks.append(gc_clock(spent))
    off = Engine(target, drafter)
    for batch in (1, 8):  # warm-up: every shape (graphs, compiled regions) once
        run(off, prompts, config, batch)
    baseline = {}
    for batch in (1, 8):
        spent.clear()
        steps, seconds = run(off, prompts, config, batch)
        baseline[batch] = (seconds / steps, spent["(garbage collector)"] / steps)

    telemetry = start_telemetry(
        dataclasses.replace(TELEMETRY_ON, **dict(kv.split("=", 1) for kv in sys.argv[4:])),  # type: ignore[arg-type]
        device_type=target.device.type,
    )
    observer: Any = telemetry.observer
    hooks = [name for name in dir(observer) if name.startswith("on_")]
    for name in hooks:
        setattr(observer, name, timed(getattr(observer, name), name, spent))
    for name in ("split_rows",):  # the probe's host side runs in the session, outside the hooks: counted with them
        setattr(session_module, name, timed(getattr(session_module, name), f"{name} (session)", spent))
        hooks.append(f"{name} (session)")
    where = " (hand-off thread)" if observer.handoff is not None else ""  # not the decode thread's time
    for sink in observer.sinks:
        sink.step = timed(sink.step, f"  {type(sink).__name__}.step{where}", spent)
    observer._resolve = timed(observer._resolve, f"  Collector._resolve{where}", spent)
    for name in ("mark", "ready", "to_wall_ns", "release"):
        setattr(observer.clock, name, timed(getattr(observer.clock, name), f"  clock.{name}", spent))
    engine = Engine(target, drafter, observer=observer)
    for batch in (1, 8):
        run(engine, prompts, config, batch)
    try:
        for batch in (1, 8):
            spent.clear()
            steps, seconds = run(engine, prompts, config, batch)
            on_spent = dict(spent)
            hook_total = sum(v for k, v in on_spent.items() if k in hooks)
            off_steps, off_seconds = run(off, prompts, config, batch)  # again, after: the first may be cold
            off_ms, gc_us = baseline[batch][0] * 1e3, baseline[batch][1] * 1e6
            print(f"batch {batch}: {steps} steps; per step: off {off_ms:.3f} ms (gc {gc_us:.0f} us),", end="")
            print(f" on {seconds / steps * 1e3:.3f} ms, off again {off_seconds / off_steps * 1e3:.3f} ms;", end="")
            print(f" hooks {hook_total / steps * 1e6:.0f} us")
            for name, value in sorted(on_spent.items(), key=lambda kv: -kv[1]):
                print(f"  {name:<28}{value / steps * 1e6:>8.0f} us per step")
    finally:
        telemetry.shutdown()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        args[0] if args else str(default_target()),
        (args[1] if len(args) > 1 else "") or str(default_drafter()),
        args[2] if len(args) > 2 else "cpu",
    )
