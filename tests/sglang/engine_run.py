"""Run SGLang's Engine once on a pair (CPU mode, float32) and print one JSON line per request.

Usage: python engine_run.py '{"algorithm": "DDTREE"|"DFLASH"|"NONE", "prompts": [[ids]], "max_new_tokens": n}'
The pair is the default one unless the request names "target" and "drafter" directories; "engine" adds
Engine arguments (e.g. {"disable_radix_cache": true}) and "sampling" sampling parameters (greedy unless it names a
temperature).
DDTREE's budget and top-k come from SGLANG_DDTREE_BUDGET / SGLANG_DDTREE_TOPK in the environment. With
DDTREE_DEBUG_METRICS=1 and DDTREE_LOG_FILE set, it waits for the log's request lines before shutting down.
A script, not a test: SGLang starts its scheduler with multiprocessing's spawn, which re-imports `__main__`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def engine_args(algorithm: str, target: str | None = None, drafter: str | None = None) -> dict[str, Any]:
    from ddtree.models.default import default_drafter, default_target

    args: dict[str, Any] = {
        "model_path": target or str(default_target(quiet=True)),
        "device": "cpu",
        "dtype": "float32",
        "attention_backend": "torch_native",
        "max_total_tokens": 4096,
        "context_length": 1024,
        "max_running_requests": 8,
        "disable_cuda_graph": True,
        "log_level": "warning",
    }
    if algorithm != "NONE":
        args.update(speculative_algorithm=algorithm, speculative_draft_model_path=drafter or str(default_drafter()))
    return args


def main() -> None:
    import sglang

    request = json.loads(sys.argv[1])
    args = engine_args(request["algorithm"], request.get("target"), request.get("drafter"))
    engine = sglang.Engine(**args | request.get("engine", {}))
    sampling = {"temperature": 0, "max_new_tokens": request["max_new_tokens"]} | request.get("sampling", {})
    try:
        outputs = engine.generate(input_ids=request["prompts"], sampling_params=sampling)
        _wait_for_request_lines(len(outputs))
    finally:
        engine.shutdown()
    for out in outputs:
        meta = out["meta_info"]
        record = {
            "output_ids": out["output_ids"],
            "spec_verify_ct": meta.get("spec_verify_ct", 0),
            "histogram": meta.get("spec_correct_drafts_histogram", []),
            "rid": meta.get("id"),
            "completion_tokens": meta.get("completion_tokens"),
        }
        print(json.dumps(record), flush=True)


def _wait_for_request_lines(n: int, timeout_s: float = 60.0) -> None:
    """The scheduler's telemetry exporter writes the log; the engine's shutdown would stop it mid-way."""
    path = os.environ.get("DDTREE_LOG_FILE")
    if os.environ.get("DDTREE_DEBUG_METRICS") != "1" or not path:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                if sum('"ddtree.request"' in line for line in f) >= n:
                    return
        time.sleep(0.2)


if __name__ == "__main__":
    main()
