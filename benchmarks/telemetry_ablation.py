"""Which part of telemetry costs decode speed: the off/on ratio with parts of telemetry turned off.

    python benchmarks/telemetry_ablation.py TARGET_DIR [DRAFTER_DIR [DEVICE [BATCH [ROUNDS [PROMPTS [VARIANTS]]]]]]

VARIANTS is a comma-separated list of the names below (default: all but `off-control`, which runs both sides
with telemetry off to show the noise floor). Each variant is one
`ddtree.bench.telemetry_overhead` run: off and on engines in one process, batches interleaved. PROMPTS is a count
of held-out prompts, or `random:N` for N random token-id prompts (for a target without a chat template, such
as `ddtree models init-tiny --hidden-size 64 --num-layers 30`).
"""

from __future__ import annotations

import dataclasses
import random
import sys
from typing import Any

from gpu_checks import TELEMETRY_ON

from ddtree.bench.rows import PairSpec, telemetry_overhead
from ddtree.data import heldout_prompts
from ddtree.models.chat import chat_ids, eos_ids
from ddtree.models.default import default_drafter
from ddtree.models.pair import load_models
from ddtree.settings import GenerationConfig

VARIANTS: dict[str, dict[str, Any]] = {
    "off-control": {"enabled": False},  # both sides off: the noise floor of the comparison
    "all-on": {},
    "no-traces": {"traces_exporter": "none"},
    "no-nvml": {"nvml_interval_ms": 0},
    "no-metrics-exporter": {"metrics_exporter": "none"},
    "logs-only": {"traces_exporter": "none", "metrics_exporter": "none", "nvml_interval_ms": 0},
}


def main(target_dir: str, drafter_dir: str, device: str, batch: int, rounds: int, count: str, names: list[str]) -> None:
    target, _, tokenizer = load_models(target_dir, None, "cpu", "float32")  # the tokenizer and end tokens only
    if count.startswith("random:"):
        rng = random.Random(0)
        prompts = [[rng.randrange(5, 250) for _ in range(rng.randrange(20, 60))] for _ in range(int(count[7:]))]
    else:
        prompts = [chat_ids(tokenizer, p) for p in heldout_prompts()[: int(count)]]
    eos = () if count.startswith("random:") else eos_ids(tokenizer, target)  # random models: always 64 tokens
    cfg = GenerationConfig(method="ddtree", budget=32, max_new_tokens=64, eos_token_ids=eos)
    pair = PairSpec(target_dir, drafter_dir, device)
    for name in names:
        config = dataclasses.replace(TELEMETRY_ON, **VARIANTS[name])
        off, on = telemetry_overhead(pair, prompts, cfg, batch, rounds, config)
        print(f"batch {batch}, {name:<20} off {off:8.1f} tok/s, on {on:8.1f} tok/s, on/off {on / off:.4f}", flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(
        a[0],
        (a[1] if len(a) > 1 else "") or str(default_drafter()),
        a[2] if len(a) > 2 else "cuda",
        int(a[3]) if len(a) > 3 else 16,
        int(a[4]) if len(a) > 4 else 3,
        a[5] if len(a) > 5 else "64",
        a[6].split(",") if len(a) > 6 else [v for v in VARIANTS if v != "off-control"],
    )
