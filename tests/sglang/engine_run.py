"""Run SGLang's Engine once on the default pair (CPU mode, float32) and print one JSON line per request.

Usage: python engine_run.py '{"algorithm": "DDTREE"|"DFLASH"|"NONE", "prompts": [[ids]], "max_new_tokens": n}'
DDTREE's budget and top-k come from SGLANG_DDTREE_BUDGET / SGLANG_DDTREE_TOPK in the environment.
A script, not a test: SGLang starts its scheduler with multiprocessing's spawn, which re-imports `__main__`.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def engine_args(algorithm: str) -> dict[str, Any]:
    from ddtree.models.default import default_drafter, default_target

    args: dict[str, Any] = {
        "model_path": str(default_target(quiet=True)),
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
        args.update(speculative_algorithm=algorithm, speculative_draft_model_path=str(default_drafter()))
    return args


def main() -> None:
    import sglang

    request = json.loads(sys.argv[1])
    engine = sglang.Engine(**engine_args(request["algorithm"]))
    try:
        outputs = engine.generate(
            input_ids=request["prompts"],
            sampling_params={"temperature": 0, "max_new_tokens": request["max_new_tokens"]},
        )
    finally:
        engine.shutdown()
    for out in outputs:
        meta = out["meta_info"]
        record = {
            "output_ids": out["output_ids"],
            "spec_verify_ct": meta.get("spec_verify_ct", 0),
            "histogram": meta.get("spec_correct_drafts_histogram", []),
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
