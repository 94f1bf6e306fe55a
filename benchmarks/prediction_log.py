"""A telemetry log of the held-out prompts decoded with one ddtree budget, for `ddtree analyze` (the drafter's
prediction against the target, its calibration) and `ddtree advise --cost-curve` (the adaptive width replayed).

    python benchmarks/prediction_log.py TARGET OUT.jsonl [--drafter DIR] [--budget 64] [--slots 16]
        [--num-prompts 64] [--max-new-tokens 128] [--device auto] [--dtype auto]

Decodes the prompts (chat template) by continuous batching in `--slots` slots with `DDTREE_DEBUG_METRICS`'s
step and request lines going to OUT (no exporter is reached: traces and metrics go nowhere), at T=0. Replay
needs the largest width to consider: the default budget is 64.
"""

from __future__ import annotations

import argparse
import sys

from ddtree.data import heldout_prompts
from ddtree.engine.engine import Engine
from ddtree.models.chat import chat_ids, eos_ids
from ddtree.models.default import default_drafter
from ddtree.models.pair import load_models
from ddtree.settings import GenerationConfig
from telemetry import start_telemetry
from telemetry.config import TelemetryConfig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target")
    parser.add_argument("out")
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    target, drafter, tokenizer = load_models(args.target, args.drafter or default_drafter(), args.device, args.dtype)
    config = TelemetryConfig(
        enabled=True,
        otlp_endpoint="http://127.0.0.1:9",  # nobody listens: the spans are dropped, counted
        otlp_protocol="http/protobuf",
        prometheus_port=0,
        log_file=args.out,
        nvml_interval_ms=0,
    )
    telemetry = start_telemetry(config, target.device.type, "target")
    prompts = [chat_ids(tokenizer, p) for p in heldout_prompts()[: args.num_prompts]]
    engine = Engine(target, drafter, observer=telemetry.observer)
    eos = eos_ids(tokenizer, target)
    tokens = args.max_new_tokens
    generation = GenerationConfig(method="ddtree", budget=args.budget, max_new_tokens=tokens, eos_token_ids=eos)
    result = engine.stream(prompts, generation, args.slots)
    telemetry.shutdown()
    tokens = sum(len(o.token_ids) for o in result.outputs)
    print(f"prediction_log: {len(prompts)} prompts, {tokens} tokens in {result.steps} steps -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
