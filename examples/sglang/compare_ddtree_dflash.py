"""DDTREE against DFLASH in SGLang 0.5.23 on a GPU: the same prompts through each, outputs and throughput.

    pip install sglang==0.5.23 ddtree        # ddtree registers --speculative-algorithm DDTREE with SGLang
    python examples/sglang/compare_ddtree_dflash.py --model TARGET --drafter DFLASH_DRAFTER \
        [--budget 32] [--topk K] [--prompts FILE.jsonl] [--max-new-tokens 256] [--concurrency 8]

For each algorithm it starts `python -m sglang.launch_server` on 127.0.0.1, waits for /health, sends every prompt
to /generate (greedy) from `--concurrency` threads, and stops the server. It prints tokens/s and SGLang's mean
acceptance length for each, and how many outputs are identical (greedy decoding is lossless, so in float32 all
should be; in bfloat16 a verify of more tokens can round a near-tie the other way). Extra arguments after `--`
go to both servers (e.g. `-- --dtype float32 --attention-backend triton`).

Not run here: this project's CI has no GPU. The CPU path it shares is tested in tests/sglang.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

DEFAULT_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain how a hash map handles collisions.",
    "Summarise the causes of the French Revolution in five sentences.",
    "Write a haiku about speculative decoding.",
]


def main() -> None:
    args, extra = parse_args()
    prompts = load_prompts(args.prompts)
    results = {}
    for algorithm in ("DFLASH", "DDTREE"):
        env = {**os.environ, "SGLANG_DDTREE_BUDGET": str(args.budget)}
        if args.topk is not None:
            env["SGLANG_DDTREE_TOPK"] = str(args.topk)
        with Server(args, algorithm, extra, env) as url:
            results[algorithm] = run_prompts(url, prompts, args.max_new_tokens, args.concurrency)
    report(results)


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--topk", type=int, default=None)
    parser.add_argument("--prompts", default=None, help='JSONL of {"prompt": ...}; default: four built-in prompts')
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--port", type=int, default=30123)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:cut]), argv[cut + 1 :]


def load_prompts(path: str | None) -> list[str]:
    if path is None:
        return DEFAULT_PROMPTS
    return [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line.strip()]


class Server:
    """`python -m sglang.launch_server` for one algorithm, alive inside a `with` block."""

    def __init__(self, args: argparse.Namespace, algorithm: str, extra: list[str], env: dict[str, str]) -> None:
        self.url = f"http://127.0.0.1:{args.port}"
        self.command = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", args.model,
            "--speculative-algorithm", algorithm, "--speculative-draft-model-path", args.drafter,
            "--host", "127.0.0.1", "--port", str(args.port), *extra,
        ]  # fmt: skip
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> str:
        self.proc = subprocess.Popen(self.command, env=self.env)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode}: {' '.join(self.command)}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return self.url
            except OSError:
                time.sleep(2)
        raise SystemExit("the server did not become healthy in 15 minutes")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=120)


def generate(url: str, prompt: str, max_new_tokens: int) -> dict[str, Any]:
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    request = urllib.request.Request(
        f"{url}/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        out: dict[str, Any] = json.loads(response.read())
        return out


def run_prompts(url: str, prompts: list[str], max_new_tokens: int, concurrency: int) -> dict[str, Any]:
    generate(url, prompts[0], 8)  # warm-up: the first request pays for lazy set-up
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outputs = list(pool.map(lambda p: generate(url, p, max_new_tokens), prompts))
    seconds = time.perf_counter() - started
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    accept = [o["meta_info"].get("spec_accept_length") for o in outputs]
    accept_known = [a for a in accept if a is not None]
    return {
        "texts": [o["text"] for o in outputs],
        "tokens_per_second": tokens / seconds,
        "accept_length": sum(accept_known) / len(accept_known) if accept_known else None,
    }


def report(results: dict[str, dict[str, Any]]) -> None:
    for name, r in results.items():
        tau = f"{r['accept_length']:.2f}" if r["accept_length"] is not None else "-"
        print(f"{name:7s} {r['tokens_per_second']:9.1f} tok/s   mean acceptance length {tau}")
    same = sum(a == b for a, b in zip(results["DFLASH"]["texts"], results["DDTREE"]["texts"], strict=True))
    speedup = results["DDTREE"]["tokens_per_second"] / results["DFLASH"]["tokens_per_second"]
    print(f"identical outputs: {same} of {len(results['DDTREE']['texts'])}; DDTREE / DFLASH throughput {speedup:.2f}x")


if __name__ == "__main__":
    main()
