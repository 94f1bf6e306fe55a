"""Load a running `ddtree serve` with concurrent streaming clients; report throughput and latency.

    python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --clients 8 --requests 32 --max-tokens 32
    python benchmarks/bench_serve.py --spawn MODEL DRAFTER --method ar --method ddtree --clients 8 --requests 32

`--clients` threads share `--requests` streamed `/v1/completions` requests (temperature 0 unless told, prompts
cycling through a fixed set). Reported: requests/s and output tokens/s over the wall time, TTFT (request
sent to first text chunk), ITL (gaps between text chunks; a ddtree step can carry several tokens in one
chunk) and TPOT ((last chunk - first chunk) / (tokens - 1)), as p50/p99. Tokens are the server's `usage`.
`--spawn` starts `ddtree serve` itself for each `--method` (on a free port), waits for /health, runs the
load, then stops it with SIGTERM.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
    "Write a short poem about the autumn rain.",
    "In 1969, the first humans",
    "A list of prime numbers: 2, 3, 5, 7,",
    "Explain why the sky is blue in simple words:",
]


@dataclass
class Sample:
    ttft: float
    gaps: list[float] = field(default_factory=list)
    tpot: float | None = None
    tokens: int = 0


def one_request(client: httpx.Client, url: str, prompt: str, args: argparse.Namespace) -> Sample:
    body = {
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.model_name:
        body["model"] = args.model_name
    sent = time.perf_counter()
    times: list[float] = []
    tokens = 0
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            data = line.removeprefix("data: ")
            if not line or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if any(c.get("text") for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    if not times:
        times = [time.perf_counter()]
    sample = Sample(ttft=times[0] - sent, gaps=[b - a for a, b in itertools.pairwise(times)], tokens=tokens)
    if tokens > 1:
        sample.tpot = (times[-1] - times[0]) / (tokens - 1)
    return sample


def run_load(url: str, args: argparse.Namespace) -> dict[str, float]:
    samples: list[Sample] = []
    errors: list[str] = []
    lock = threading.Lock()
    counter = iter(range(args.requests))

    def client_loop() -> None:
        with httpx.Client(timeout=args.timeout) as client:
            while True:
                with lock:
                    index = next(counter, None)
                if index is None:
                    return
                try:
                    sample = one_request(client, url, PROMPTS[index % len(PROMPTS)], args)
                except Exception as exc:
                    with lock:
                        errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                with lock:
                    samples.append(sample)

    started = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if errors:
        print(f"  {len(errors)} failed requests, e.g. {errors[0]}", file=sys.stderr)
    tokens = sum(s.tokens for s in samples)
    gaps = [g for s in samples for g in s.gaps]
    tpots = [s.tpot for s in samples if s.tpot is not None]
    return {
        "requests": len(samples),
        "failed": len(errors),
        "wall_s": wall,
        "req_per_s": len(samples) / wall,
        "out_tok_per_s": tokens / wall,
        "tokens": tokens,
        "ttft_p50_ms": 1e3 * pct([s.ttft for s in samples], 50),
        "ttft_p99_ms": 1e3 * pct([s.ttft for s in samples], 99),
        "itl_p50_ms": 1e3 * pct(gaps, 50),
        "itl_p99_ms": 1e3 * pct(gaps, 99),
        "tpot_p50_ms": 1e3 * pct(tpots, 50),
        "tpot_p99_ms": 1e3 * pct(tpots, 99),
    }


def pct(values: list[float], q: float) -> float:
    """The q-th percentile, linear between closest ranks; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def report(label: str, stats: dict[str, float]) -> None:
    print(
        f"{label}: {stats['requests']:.0f} requests ({stats['failed']:.0f} failed), {stats['tokens']:.0f} output "
        f"tokens in {stats['wall_s']:.2f} s | {stats['req_per_s']:.2f} req/s, {stats['out_tok_per_s']:.1f} out tok/s"
        f" | TTFT p50 {stats['ttft_p50_ms']:.1f} ms p99 {stats['ttft_p99_ms']:.1f} ms"
        f" | ITL p50 {stats['itl_p50_ms']:.1f} ms p99 {stats['itl_p99_ms']:.1f} ms"
        f" | TPOT p50 {stats['tpot_p50_ms']:.1f} ms p99 {stats['tpot_p99_ms']:.1f} ms",
        flush=True,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_and_run(model: str, drafter: str, method: str, args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "ddtree.cli", "serve", "--model", model, "--drafter", drafter]
    argv += ["--method", method, "--port", str(port), "--max-batch-size", str(args.max_batch_size or args.clients)]
    argv += ["--max-queue", str(max(64, args.requests)), *args.serve_arg]
    log = Path(args.log_dir) / f"serve-{method}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            deadline = time.monotonic() + args.startup_timeout
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"ddtree serve exited with {proc.returncode}; see {log}")
                if time.monotonic() > deadline:
                    raise SystemExit(f"ddtree serve did not come up in {args.startup_timeout} s; see {log}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
            if args.warmup:
                warm = argparse.Namespace(**{**vars(args), "requests": args.warmup, "clients": 1})
                run_load(url, warm)
            return run_load(url, args)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--spawn", nargs=2, metavar=("MODEL", "DRAFTER"), help="start `ddtree serve` on this pair")
    parser.add_argument(
        "--method", action="append", help="with --spawn: a method to serve (repeatable; default ddtree)"
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--model-name", default=None, help="the request's `model` (default: none)")
    parser.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    parser.add_argument("--warmup", type=int, default=2, help="with --spawn: requests before measuring")
    parser.add_argument("--max-batch-size", type=int, default=None, help="with --spawn (default: --clients)")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--log-dir", default="/tmp", help="with --spawn: where the server logs go")
    parser.add_argument("--serve-arg", action="append", default=[], help="with --spawn: extra `serve` argument")
    args = parser.parse_args()
    if args.url:
        report(args.url, run_load(args.url.rstrip("/"), args))
        return 0
    model, drafter = args.spawn
    for method in args.method or ["ddtree"]:
        report(method, spawn_and_run(model, drafter, method, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
