"""Load a running `ddtree serve` with concurrent streaming clients; report throughput and latency.

    python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --clients 8 --requests 32 --max-tokens 32
    python benchmarks/bench_serve.py --spawn MODEL DRAFTER --method ar --method ddtree --clients 8 --requests 32
    python benchmarks/bench_serve.py --spawn MODEL DRAFTER --serve "ar=--method ar" --serve "B=16=--budget 16" \
        --serve "auto=--budget auto" --clients 1,4,16,64 --requests-per-client 4 --max-tokens 128 --out serve.json

`--clients` asyncio clients (aiohttp, each chunk read with msgspec) share `--requests` streamed
`/v1/completions` requests (temperature 0 unless told, prompts cycling through a fixed set); `--processes N`
spreads them over N load processes, so that the load generator is not what caps the server (its own ceiling:
`benchmarks/stub_server.py`, a server that streams at once, and the README's numbers). Reported: requests/s
and output tokens/s over the wall time, TTFT (request sent to first text chunk), ITL (gaps between text
chunks; a ddtree step can carry several tokens in one chunk) and TPOT ((last chunk - first chunk) / (tokens -
1)), as p50/p99. Tokens are the server's `usage`. With the server's `/metrics`, also its own mean TTFT
(handler start to first token), queue time (submitted to joined a slot) and prefill time (joined to the first
token handed over) over the load: what of a client's TTFT the server spent, and where (TTFT less queue and
prefill: the API process and the transport).
`--spawn` starts `ddtree serve` itself for each `--method` or `--serve LABEL=ARGS` (on a free port), waits
for /health, runs each load of `--clients` (a comma-separated list: one load after the other on the same
server, whose slots are the largest load's), then stops it with SIGTERM. With several servers each load's
line gives its tokens/s over the first server's (`vs`), and the budgets its steps ran (from the responses'
`ddtree` blocks: `step_budgets` under `--budget auto`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import multiprocessing
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import msgspec

from telemetry import semconv as sc

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


class Choice(msgspec.Struct):
    text: str | None = None
    delta: dict[str, Any] | None = None


class Chunk(msgspec.Struct):
    """What the load generator reads of a stream's chunk (the rest of it is skipped unread)."""

    choices: list[Choice] = []
    usage: dict[str, Any] | None = None
    ddtree: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


_CHUNK = msgspec.json.Decoder(Chunk)
_JSON = msgspec.json.Encoder()
JSON_HEAD = {"Content-Type": "application/json"}


@dataclass
class Sample:
    ttft: float
    gaps: list[float] = field(default_factory=list)
    tpot: float | None = None
    tokens: int = 0
    budgets: list[int] = field(default_factory=list)  # each step's budget, from the `ddtree` block


async def one_request(session: aiohttp.ClientSession, url: str, prompt: str, args: argparse.Namespace) -> Sample:
    body: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    endpoint = "chat/completions" if args.chat else "completions"
    if args.chat:  # as `ddtree bench` encodes prompts: the chat template, the assistant's turn opened
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.model_name:
        body["model"] = args.model_name
    sent = time.perf_counter()
    times: list[float] = []
    tokens = 0
    budgets: list[int] = []
    async with session.post(f"{url}/v1/{endpoint}", data=_JSON.encode(body), headers=JSON_HEAD) as response:
        response.raise_for_status()
        async for line in response.content:  # one SSE line at a time
            if not line.startswith(b"data: {"):
                continue  # blank separators and [DONE]
            chunk = _CHUNK.decode(line[6:])
            if chunk.error is not None:
                raise RuntimeError(chunk.error.get("message"))
            if any(c.text or (c.delta or {}).get("content") for c in chunk.choices):
                times.append(time.perf_counter())
            if chunk.usage:
                tokens = int(chunk.usage["completion_tokens"])
            if chunk.ddtree:
                block = chunk.ddtree
                budgets = block.get("step_budgets") or [block["budget"]] * block["steps"]
    if not times:
        times = [time.perf_counter()]
    sample = Sample(ttft=times[0] - sent, gaps=[b - a for a, b in itertools.pairwise(times)], tokens=tokens)
    sample.budgets = budgets
    if tokens > 1:
        sample.tpot = (times[-1] - times[0]) / (tokens - 1)
    return sample


async def _clients(url: str, args: argparse.Namespace, first: int) -> tuple[list[Sample], list[str], float, float]:
    """`args.clients` asyncio clients sharing `args.requests` requests (numbered from `first`, which picks the
    prompts): the samples, the errors, and the perf_counter times of the start and the end."""
    samples: list[Sample] = []
    errors: list[str] = []
    counter = iter(range(first, first + args.requests))
    prompts = _prompts(args)

    async def client_loop(session: aiohttp.ClientSession) -> None:
        for index in counter:
            try:
                samples.append(await one_request(session, url, prompts[index % len(prompts)], args))
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")

    # aiohttp sets TCP_NODELAY (without it a request's body would wait 40 ms for the ACK of its head).
    connector = aiohttp.TCPConnector(limit=args.clients)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(session) for _ in range(args.clients)))
        ended = time.perf_counter()
    return samples, errors, started, ended


def _process_load(url: str, args: argparse.Namespace, first: int, go: Any, results: Any) -> None:
    """One load process: wait for the others, run its clients, send back what it saw."""
    go.wait()
    results.put(asyncio.run(_clients(url, args, first)))


def _prompts(args: argparse.Namespace) -> list[str]:
    if not args.heldout:
        return PROMPTS
    from ddtree.data import heldout_prompts

    return heldout_prompts()


def _shares(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


DEFAULT_REQUESTS = 32
SERVER_TIMES = {  # the server's own histograms (their means over a load): where a client's TTFT goes
    "server_ttft_mean_ms": sc.PROM_TIME_TO_FIRST_TOKEN_SECONDS,  # handler start to first token
    "server_queue_mean_ms": sc.PROM_REQUEST_QUEUE_TIME_SECONDS,  # engine: submitted to joined a slot
    "server_prefill_mean_ms": sc.PROM_REQUEST_PREFILL_TIME_SECONDS,  # engine: joined to the first token handed over
}


def server_times(url: str) -> dict[str, tuple[float, float]]:
    """The (sum, count) of each of `SERVER_TIMES`' histograms in the server's /metrics (summed over labels);
    empty where the server has no /metrics (the stub)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, list[float]] = {name: [0.0, 0.0] for name in SERVER_TIMES.values()}
    try:
        response = httpx.get(f"{url}/metrics", timeout=10)
        for family in text_string_to_metric_families(response.text) if response.is_success else []:
            for sample in family.samples if family.name in totals else []:
                if sample.name.endswith("_sum"):
                    totals[family.name][0] += sample.value
                elif sample.name.endswith("_count"):
                    totals[family.name][1] += sample.value
    except (httpx.HTTPError, ValueError):  # no server, or no Prometheus text (the stub streams anything)
        return {}
    return {name: (total[0], total[1]) for name, total in totals.items()}


def run_load(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The load, with the server's own mean TTFT and queue time over it where it has /metrics."""
    before = server_times(url)
    stats = _run_load(url, args)
    after = server_times(url)
    for key, name in SERVER_TIMES.items():
        if name in before and name in after:
            total, count = (a - b for a, b in zip(after[name], before[name], strict=True))
            stats[key] = 1e3 * total / count if count else float("nan")
    return stats


def _run_load(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The load: in this process, or split over `args.processes` processes (clients and requests shared out
    evenly, started together; the wall time runs from the first start to the last end)."""
    processes = max(1, min(args.processes, args.clients))
    if processes == 1:
        samples, errors, started, ended = asyncio.run(_clients(url, args, 0))
    else:
        context = multiprocessing.get_context("fork")
        go, results = context.Event(), context.Queue()
        workers, first = [], 0
        for clients, requests in zip(_shares(args.clients, processes), _shares(args.requests, processes), strict=True):
            share = argparse.Namespace(**{**vars(args), "clients": clients, "requests": requests})
            workers.append(context.Process(target=_process_load, args=(url, share, first, go, results)))
            first += requests
        for worker in workers:
            worker.start()
        go.set()
        parts = [results.get() for _ in workers]
        for worker in workers:
            worker.join()
        samples = [s for part in parts for s in part[0]]
        errors = [e for part in parts for e in part[1]]
        started, ended = min(p[2] for p in parts), max(p[3] for p in parts)
    wall = ended - started
    if errors:
        print(f"  {len(errors)} failed requests, e.g. {errors[0]}", file=sys.stderr)
    tokens = sum(s.tokens for s in samples)
    gaps = [g for s in samples for g in s.gaps]
    tpots = [s.tpot for s in samples if s.tpot is not None]
    budgets = collections.Counter(b for s in samples for b in s.budgets)
    return {
        "clients": args.clients,
        "step_budgets": {str(b): n for b, n in sorted(budgets.items())},
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


def report(label: str, stats: dict[str, Any], baseline: dict[str, Any] | None = None) -> None:
    """A load's line (after its untimed run's, where `--warm-load` made one)."""
    if "cold" in stats:
        report(f"{label} (untimed, cold)", stats["cold"])
    versus = f" ({stats['out_tok_per_s'] / baseline['out_tok_per_s']:.2f}x)" if baseline else ""
    steps = sum(stats["step_budgets"].values()) or 1
    budgets = ", ".join(f"B={b} {n / steps:.0%}" for b, n in stats["step_budgets"].items())
    server = ""
    if "server_ttft_mean_ms" in stats:
        ttft, queue = stats["server_ttft_mean_ms"], stats["server_queue_mean_ms"]
        prefill = stats.get("server_prefill_mean_ms", float("nan"))
        server = f" | server: TTFT mean {ttft:.1f} ms, queue {queue:.1f} ms, prefill {prefill:.1f} ms"
    print(
        f"{label}, {stats['clients']} clients{versus}: {stats['requests']:.0f} requests ({stats['failed']:.0f} "
        f"failed), {stats['tokens']:.0f} output "
        f"tokens in {stats['wall_s']:.2f} s | {stats['req_per_s']:.2f} req/s, {stats['out_tok_per_s']:.1f} out tok/s"
        f" | TTFT p50 {stats['ttft_p50_ms']:.1f} ms p99 {stats['ttft_p99_ms']:.1f} ms"
        f" | ITL p50 {stats['itl_p50_ms']:.1f} ms p99 {stats['itl_p99_ms']:.1f} ms"
        f" | TPOT p50 {stats['tpot_p50_ms']:.1f} ms p99 {stats['tpot_p99_ms']:.1f} ms | steps: {budgets or '-'}"
        + server,
        flush=True,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_and_run(
    model: str, drafter: str, label: str, serve_args: list[str], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One server with `serve_args`, each load of `args.clients` in turn on it: a result per load."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    slots = args.max_batch_size or max(args.clients)
    argv = [sys.executable, "-m", "ddtree.cli", "serve", "--model", model, "--drafter", drafter]
    argv += ["--port", str(port), "--max-batch-size", str(slots), *serve_args]
    argv += ["--max-queue", str(max(64, *(_requests(args, c) for c in args.clients))), *args.serve_arg]
    log = Path(args.log_dir) / f"serve-{re.sub(r'[^A-Za-z0-9_.-]', '_', label)}.log"
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
            return [_measured(url, _load(args, c)) for c in args.clients]
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _measured(url: str, load: argparse.Namespace) -> dict[str, Any]:
    """The load, run once untimed first with `--warm-load` (its figures kept under `cold`)."""
    if not load.warm_load:
        return run_load(url, load)
    cold = run_load(url, load)
    return {**run_load(url, load), "cold": cold}


def _server_spec(spec: str) -> tuple[str, list[str]]:
    """`LABEL=ARGS` as (label, args); the label may hold `=` itself (`B=16=--budget 16`): the args begin at
    the first `=` followed by a flag."""
    match = re.match(r"(.+?)=(-.*)$", spec)
    if not match:
        raise SystemExit(f"bench_serve: --serve wants LABEL=ARGS with ARGS starting at a flag, got {spec!r}")
    return match.group(1), shlex.split(match.group(2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--spawn", nargs=2, metavar=("MODEL", "DRAFTER"), help="start `ddtree serve` on this pair")
    parser.add_argument(
        "--method", action="append", help="with --spawn: a method to serve (repeatable; default ddtree)"
    )
    parser.add_argument(
        "--serve", action="append", default=[], metavar="LABEL=ARGS", help="with --spawn: a server, its `serve` flags"
    )
    parser.add_argument("--clients", type=_counts, default=[8], help="concurrent clients; a list: loads in turn")
    parser.add_argument("--requests", type=int, default=None, help=f"requests in all (default: {DEFAULT_REQUESTS})")
    parser.add_argument(
        "--processes", type=int, default=1, help="load processes the clients are spread over (asyncio in each)"
    )
    parser.add_argument("--requests-per-client", type=int, default=None, help="at least clients x this requests")
    parser.add_argument("--out", default=None, help="write every load's figures here as JSON")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--heldout", action="store_true", help="the held-out prompts, which `ddtree bench` runs (default: a few)"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="chat requests (the template, as `ddtree bench` applies it where there is one)",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--model-name", default=None, help="the request's `model` (default: none)")
    parser.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    parser.add_argument("--warmup", type=int, default=2, help="with --spawn: requests before measuring")
    parser.add_argument(
        "--warm-load",
        action="store_true",
        help="run each load once untimed before the timed run, as `ddtree bench` does on CUDA (a fresh server "
        "captures a prefill graph per new shape of joining prompts); the untimed run's figures are kept as `cold`",
    )
    parser.add_argument("--max-batch-size", type=int, default=None, help="with --spawn (default: --clients)")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--log-dir", default="/tmp", help="with --spawn: where the server logs go")
    parser.add_argument("--serve-arg", action="append", default=[], help="with --spawn: extra `serve` argument")
    args = parser.parse_args()
    results: list[dict[str, Any]] = []
    if args.url:
        for clients in args.clients:
            results.append({"server": args.url, **_measured(args.url.rstrip("/"), _load(args, clients))})
            report(args.url, results[-1])
    else:
        model, drafter = args.spawn
        servers = [(m, ["--method", m]) for m in args.method or []]
        servers += [_server_spec(s) for s in args.serve]
        first: list[dict[str, Any]] = []
        for label, flags in servers or [("ddtree", ["--method", "ddtree"])]:
            loads = spawn_and_run(model, drafter, label, flags, args)
            first = first or loads
            for load, base in zip(loads, first, strict=True):
                results.append({"server": label, **load})
                report(label, load, base if first is not loads else None)
            if args.out:  # after each server: what was measured survives a run cut short
                Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _counts(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _load(args: argparse.Namespace, clients: int) -> argparse.Namespace:
    """The arguments of one load: `clients` clients and their requests."""
    return argparse.Namespace(**{**vars(args), "clients": clients, "requests": _requests(args, clients)})


def _requests(args: argparse.Namespace, clients: int) -> int:
    """`--requests`, or `--requests-per-client` times the clients where that is more."""
    if args.requests is None and args.requests_per_client is None:
        return DEFAULT_REQUESTS
    return max(args.requests or 0, clients * (args.requests_per_client or 0))


if __name__ == "__main__":
    sys.exit(main())
