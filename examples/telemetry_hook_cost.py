"""Wall time that telemetry spends on the decode thread, per step, hook by hook and sink by sink.

    python examples/telemetry_hook_cost.py [TARGET_DIR [DRAFTER_DIR [DEVICE]]]

Defaults: the default pair on CPU. Spans go to an OTLP endpoint that is down, metrics to Prometheus, logs to
/dev/null, as in `ddtree bench --telemetry-overhead`.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from gpu_checks import TELEMETRY_ON  # the same set-up: OTLP endpoint down, Prometheus, logs to /dev/null

from ddtree.bench import heldout_prompts
from ddtree.engine.decode import Engine, GenerationConfig
from ddtree.models.default import default_drafter, default_target
from ddtree.runtime import eos_ids, load_pair
from ddtree.train.data import chat_ids
from telemetry import start_telemetry


def timed(fn: Callable[..., Any], name: str, spent: defaultdict[str, float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start

    return wrapper


def main(target_dir: str, drafter_dir: str, device: str) -> None:
    target, drafter, tokenizer = load_pair(target_dir, drafter_dir, device, "auto")
    prompts = [chat_ids(tokenizer, p) for p in heldout_prompts()[:8]]
    telemetry = start_telemetry(TELEMETRY_ON, device_type=target.device.type)
    observer: Any = telemetry.observer
    spent: defaultdict[str, float] = defaultdict(float)
    hooks = [name for name in dir(observer) if name.startswith("on_")]
    for name in hooks:
        setattr(observer, name, timed(getattr(observer, name), name, spent))
    for sink in observer.sinks:
        sink.step = timed(sink.step, f"  {type(sink).__name__}.step", spent)
    config = GenerationConfig(method="ddtree", budget=32, max_new_tokens=48, eos_token_ids=eos_ids(tokenizer, target))
    engine = Engine(target, drafter, observer=observer)
    engine.generate(prompts[:1], config)  # warm-up
    try:
        for batch in (1, 8):
            spent.clear()
            results = [engine.generate(prompts[i : i + batch], config) for i in range(0, len(prompts), batch)]
            steps = sum(r.steps for r in results)
            seconds = sum(r.seconds for r in results)
            hook_total = sum(v for k, v in spent.items() if k in hooks)
            print(f"batch {batch}: {steps} steps, {seconds / steps * 1e3:.1f} ms per step, telemetry hooks")
            print(f"  {hook_total / steps * 1e6:.0f} us per step ({hook_total / seconds:.2%} of the time)")
            for name, value in sorted(spent.items(), key=lambda kv: -kv[1]):
                print(f"  {name:<28}{value / steps * 1e6:>8.0f} us per step")
    finally:
        telemetry.shutdown()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        args[0] if args else str(default_target()),
        args[1] if len(args) > 1 else str(default_drafter()),
        args[2] if len(args) > 2 else "cpu",
    )
