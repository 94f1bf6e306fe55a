"""The `ddtree` command: generate, bench, serve, models (pull, init-tiny); analyze, advise and drafter beside it."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from ddtree.cli import analysis as cli_analysis
from ddtree.cli import drafter as cli_drafter
from ddtree.cli.drafter import POSITIVE, SEED, float_flag, int_flag
from ddtree.errors import CapacityError, UserError
from ddtree.kernels import ATTENTION_CHOICES
from ddtree.methods import METHOD_NAMES
from telemetry.config import TelemetryConfigError

if TYPE_CHECKING:
    from ddtree.runtime import EngineOptions
    from ddtree.server.model import ServerSettings

EXIT_USAGE = 2
EXIT_MISMATCH = 1  # `models verify` found files that do not match the cache's manifest


class _Parser(argparse.ArgumentParser):
    """argparse whose errors reach `main` as a UserError of one line: `--budget must be >= 1, got 0`."""

    def error(self, message: str) -> NoReturn:
        bad_value = re.fullmatch(r"argument (\S+): (must .*)", message)
        raise UserError(f"{bad_value[1]} {bad_value[2]}" if bad_value else message)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        result: int = args.func(args)
        return result
    except (UserError, CapacityError, TelemetryConfigError) as exc:
        print(f"ddtree: error: {' '.join(str(exc).split())}", file=sys.stderr)  # one line
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader went away (`| head`): end quietly, without a second error when Python flushes stdout.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("ddtree: interrupted", file=sys.stderr)
        return 130


def _ints(text: str) -> list[int]:
    """`1,2,3` -> [1, 2, 3]; ValueError with a readable reason otherwise."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"comma-separated integers expected, got {text!r}") from None
    if not values:
        raise ValueError("at least one integer expected")
    return values


def _budget_list(text: str) -> list[int]:
    try:
        values = _ints(text)
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1, got {text!r}")
    return values


def _tiny_hidden(text: str) -> int:
    value = int_flag(8, 4096)(text)
    if value % 8:
        raise argparse.ArgumentTypeError(f"must be a multiple of 8 (4 heads, even head size), got {value}")
    return value


def _device_args(parser: argparse.ArgumentParser, graphs: bool = False) -> None:
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16", "float64"), default="auto")
    if graphs:
        parser.add_argument(
            "--cuda-graphs", choices=("auto", "on", "off"), default="auto", help="replay decode steps (auto: on CUDA)"
        )
        parser.add_argument(
            "--tree-kernel",
            choices=("auto", "torch", "triton"),
            default="auto",
            help="tree build: torch ops or fused Triton (auto: Triton on CUDA where it imports)",
        )
        parser.add_argument(
            "--attention",
            choices=ATTENTION_CHOICES,
            default="auto",
            help="attention (target, drafter): sdpa with a dense mask or the Triton tree kernel (auto: Triton on CUDA)",
        )


def _engine_options(args: argparse.Namespace) -> EngineOptions:
    from ddtree.runtime import EngineOptions

    return EngineOptions(args.device, args.dtype, args.cuda_graphs, args.tree_kernel, args.attention)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ddtree", description="DDTree speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with ar, dflash or ddtree decoding")
    gen.add_argument("--model", help="target model directory (HF layout); default: the default pair")
    gen.add_argument("--drafter", help="DFlash drafter directory (needed by dflash and ddtree)")
    gen.add_argument("--method", choices=METHOD_NAMES, default="ddtree")
    gen.add_argument("--budget", type=POSITIVE, default=32, help="draft tree nodes per step (ddtree)")
    gen.add_argument("--topk", type=POSITIVE, default=None, help="candidates per depth (default min(budget, vocab))")
    gen.add_argument("--temperature", type=float_flag(0), default=0.0)
    gen.add_argument("--seed", type=SEED, default=0)
    gen.add_argument("--max-new-tokens", type=POSITIVE, default=128)
    _device_args(gen, graphs=True)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="prompt text; repeat for a batch")
    prompt.add_argument("--prompt-ids", action="append", help="comma-separated token ids; repeat for a batch")
    gen.add_argument("--chat", action="store_true", help="wrap text prompts in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="tau and speed of ar, dflash and ddtree on a prompt set, in one run")
    bench.add_argument("--model", help="target directory; default: the default pair")
    bench.add_argument("--drafter", help="drafter directory; default: the default pair's")
    bench.add_argument("--prompts", help="JSONL file of {'prompt': ...}; default: the held-out set")
    bench.add_argument("--methods", default="ar,dflash,ddtree")
    bench.add_argument("--budgets", type=_budget_list, default=[4, 8, 16, 32, 64])
    bench.add_argument("--max-new-tokens", type=POSITIVE, default=128)
    bench.add_argument("--batch-size", type=POSITIVE, default=1)
    bench.add_argument("--limit", type=POSITIVE, default=None, help="use the first N prompts")
    bench.add_argument("--baseline", choices=("hf",), action="append", default=[], help="add HF generate's row")
    bench.add_argument(
        "--continuous",
        action="store_true",
        help="our rows stream the prompts through --batch-size slots (continuous batching, as the server runs)",
    )
    _device_args(bench, graphs=True)
    bench.add_argument("--json", dest="json_out", help="also write the rows to this JSON file")
    bench.add_argument(
        "--telemetry-overhead",
        action="store_true",
        help="instead: tokens/s of the first method and budget with telemetry off and on, interleaved",
    )
    bench.add_argument(
        "--rounds",
        type=POSITIVE,
        default=None,
        help="timed rounds of the interleaved rows (default 1), or off/on rounds for --telemetry-overhead (default 4)",
    )
    bench.add_argument("--tree-build", action="store_true", help="instead: time the tree build alone (torch, triton)")
    bench.add_argument(
        "--cost-curve", help="also write ddtree's ms per step by budget here (for `ddtree advise --cost`)"
    )
    bench.set_defaults(func=_bench)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat) on the decode session")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    serve.add_argument("--port", type=int_flag(0, 65535), default=8000)
    serve.add_argument("--model", help="target model directory (HF layout); default: the default pair")
    serve.add_argument("--drafter", help="DFlash drafter directory; default: the default pair's")
    serve.add_argument("--method", choices=METHOD_NAMES, default="ddtree")
    serve.add_argument("--budget", type=POSITIVE, default=32, help="draft tree nodes per step (ddtree)")
    serve.add_argument("--topk", type=POSITIVE, default=None, help="candidates per depth (default min(budget, vocab))")
    serve.add_argument("--max-batch-size", type=POSITIVE, default=8, help="requests decoded together (session slots)")
    serve.add_argument("--max-queue", type=POSITIVE, default=64, help="requests waiting for a slot; more get 429")
    serve.add_argument(
        "--max-model-len",
        type=int_flag(2),
        default=None,
        help="prompt + new tokens (default 2048, or the model's limit)",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("DDTREE_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on /v1 (default: $DDTREE_API_KEY; /health, /metrics stay open)",
    )
    serve.add_argument("--max-body-bytes", type=POSITIVE, default=1 << 20, help="larger request bodies get 413")
    serve.add_argument(
        "--shutdown-timeout",
        type=float_flag(0),
        default=30.0,
        help="seconds requests in flight get on SIGTERM (default 30)",
    )
    _connection_args(serve)
    _device_args(serve, graphs=True)
    serve.set_defaults(func=_serve)

    cli_analysis.add_parsers(sub)  # analyze, advise

    models = sub.add_parser("models", help="model tools").add_subparsers(dest="models_command", required=True)
    pull = models.add_parser("pull", help="fetch and convert the default target (SmolLM2-135M-Instruct)")
    pull.add_argument("name", nargs="?", default="smollm2-135m")
    pull.set_defaults(func=_models_pull)
    verify = models.add_parser("verify", help="hash every cached file against the cache's manifest (exit 1: damage)")
    verify.add_argument("name", nargs="?", default=None, help="one cached model (default: every one)")
    verify.set_defaults(func=_models_verify)
    tiny = models.add_parser("init-tiny", help="write a random tiny Llama target with a byte tokenizer")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=SEED, default=0)
    tiny.add_argument("--hidden-size", type=_tiny_hidden, default=64)
    tiny.add_argument("--num-layers", type=int_flag(1, 64), default=4)
    tiny.set_defaults(func=_models_init_tiny)

    cli_drafter.add_parsers(sub)  # drafter init, data, train, pack-data, state, part, gather
    return parser


def _generate(args: argparse.Namespace) -> int:
    from ddtree.engine.engine import GenerationConfig
    from ddtree.methods import mean_acceptance_length
    from ddtree.runtime import GenerateRequest, run_generate

    generation = GenerationConfig(
        method=args.method,
        budget=args.budget,
        topk=args.topk,
        temperature=args.temperature,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
    )
    request = GenerateRequest(
        model=args.model,
        drafter=args.drafter,
        generation=generation,
        options=_engine_options(args),
        prompts=args.prompt,
        prompt_ids=[_parse_ids(text) for text in args.prompt_ids] if args.prompt_ids else None,
        chat=args.chat or (args.model is None and args.prompt is not None),
    )
    for record in run_generate(request):
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(record["text"], flush=True)
            tau = mean_acceptance_length(record["acceptance_lengths"])
            shown = f"{tau:.2f}" if tau is not None else "-"
            print(
                f"[{record['steps']} steps, tau {shown}, {record['tokens_per_second']:.1f} tokens/s]", file=sys.stderr
            )
    return 0


def _parse_ids(text: str) -> list[int]:
    try:
        return _ints(text)
    except ValueError as exc:
        raise UserError(f"--prompt-ids: {exc}") from None


def _bench(args: argparse.Namespace) -> int:
    from ddtree.bench.rows import format_rows, rows_json, run_bench
    from ddtree.data import heldout_prompts
    from ddtree.models.chat import chat_ids, eos_ids
    from ddtree.runtime import resolve_paths

    if args.tree_build:
        return _tree_build_bench(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHOD_NAMES]
    if bad or not methods:
        raise UserError(f"--methods takes {', '.join(METHOD_NAMES)}, got {args.methods!r}")
    options = _engine_options(args)
    options.check()
    prompts = heldout_prompts(args.prompts)[: args.limit]
    if not prompts:
        raise UserError(f"no prompts in {args.prompts!r}")
    model, drafter_dir = resolve_paths(args.model, args.drafter, "ddtree" if methods != ["ar"] else "ar")
    target, drafter, tokenizer = options.load_models(model, drafter_dir)
    if tokenizer is None:
        raise UserError("bench needs a model with a tokenizer")
    if args.telemetry_overhead:
        return _overhead(args, (model, drafter_dir), target, tokenizer, prompts, methods[0])
    eos = eos_ids(tokenizer, target)
    encoded = [chat_ids(tokenizer, p) for p in prompts]
    engine = options.engine(target, drafter)
    rounds, baseline = args.rounds or 1, bool(args.baseline)
    rows = run_bench(
        engine,
        encoded,
        args.budgets,
        args.max_new_tokens,
        args.batch_size,
        methods,
        eos,
        rounds,
        baseline,
        args.continuous,
    )
    graphs = "CUDA graphs" if engine.cuda_graphs else "eager"
    batching = f"continuous batching in {args.batch_size} slots" if args.continuous else f"batch {args.batch_size}"
    print(
        f"{len(prompts)} prompts, {args.max_new_tokens} new tokens max, {batching}, "
        f"device {target.device}, {str(target.dtype).removeprefix('torch.')}, {graphs}, "
        f"rows interleaved per batch, {rounds} round{'s' if rounds > 1 else ''}"
    )
    print(format_rows(rows))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows_json(rows), indent=2))
    if args.cost_curve:
        from telemetry.analysis.advise import write_cost

        curve = [(r.budget, r.ms_per_step) for r in rows if r.method == "ddtree" and r.budget]
        write_cost(Path(args.cost_curve), curve, args.batch_size)
    return 0


def _tree_build_bench(args: argparse.Namespace) -> int:
    """`bench --tree-build`: the tree build alone on random logits, torch ops against the fused kernels."""
    from ddtree.bench.tree_build import time_tree_build
    from ddtree.models.pair import resolve_device

    device = str(resolve_device(args.device))
    print(f"tree build on {device}, depth 15, vocab 49152, random float32 logits; median ms")
    print(f"{'batch':>6}{'budget':>8}{'torch':>10}{'triton':>10}")
    for batch in (1, 32):
        for budget in (32, 256):
            times = time_tree_build(device, batch, 15, 49152, budget, repeats=20)
            fused = f"{times['fused_ms']:.3f}" if "fused_ms" in times else "-"
            print(f"{batch:>6}{budget:>8}{times['torch_ms']:>10.3f}{fused:>10}")
    return 0


def _overhead(
    args: argparse.Namespace,
    paths: tuple[str, str | None],
    target: Any,
    tokenizer: Any,
    prompts: list[str],
    method: str,
) -> int:
    """Telemetry as users turn it on: spans to an OTLP endpoint, Prometheus metrics, JSON step logs."""
    from ddtree.bench.rows import PairSpec, telemetry_overhead
    from ddtree.engine.engine import GenerationConfig
    from ddtree.methods import method_label
    from ddtree.models.chat import chat_ids, eos_ids
    from telemetry.config import TelemetryConfig

    config = GenerationConfig(
        method=method,
        budget=args.budgets[0],
        max_new_tokens=args.max_new_tokens,
        eos_token_ids=eos_ids(tokenizer, target),
    )
    env = TelemetryConfig.from_env()
    on = TelemetryConfig(
        enabled=True,
        traces_exporter=env.traces_exporter,
        metrics_exporter="prometheus",
        otlp_endpoint=env.otlp_endpoint,
        otlp_protocol=env.otlp_protocol,
        prometheus_port=0,
        log_file=env.log_file or os.devnull,
    )
    encoded = [chat_ids(tokenizer, p) for p in prompts]
    pair = PairSpec(paths[0], paths[1], args.device, args.dtype)
    off_tps, on_tps = telemetry_overhead(pair, encoded, config, args.batch_size, args.rounds or 4, on)
    label = method_label(method, args.budgets[0])
    print(f"{label}: telemetry off {off_tps:.1f} tok/s, on {on_tps:.1f} tok/s, on/off {on_tps / off_tps:.3f}")
    return 0


def _connection_args(serve: argparse.ArgumentParser) -> None:
    """What a client may hold: the server's timeouts and limits against slow or hostile connections."""
    seconds = float_flag(0, above=True)
    serve.add_argument("--header-timeout", type=seconds, default=10.0, help="seconds to send a request's headers")
    serve.add_argument("--body-timeout", type=seconds, default=30.0, help="seconds to send a body (else 408)")
    serve.add_argument(
        "--max-connections", type=POSITIVE, default=None, help="connections open at once (default: from ulimit -n)"
    )
    serve.add_argument("--backlog", type=POSITIVE, default=None, help="pending connections (default: with the cap)")
    serve.add_argument("--keep-alive-timeout", type=POSITIVE, default=5, help="seconds an idle connection stays open")
    serve.add_argument("--max-header-bytes", type=POSITIVE, default=16384, help="larger request heads get 400")


def _serve(args: argparse.Namespace) -> int:
    from ddtree.server.model import ServerSettings, check_settings

    settings = ServerSettings(
        model=args.model,
        drafter=args.drafter,
        method=args.method,
        budget=args.budget,
        topk=args.topk,
        max_batch_size=args.max_batch_size,
        max_queue=args.max_queue,
        max_model_len=args.max_model_len,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        max_connections=args.max_connections,
        backlog=args.backlog,
        keep_alive_timeout=args.keep_alive_timeout,
        max_header_bytes=args.max_header_bytes,
        options=_engine_options(args),
    )
    check_settings(settings)  # before the default pair is pulled or anything loads
    _check_serve_capacity(settings)  # before the server starts and reports healthy

    from ddtree.server.run import serve

    serve(settings, args.host, args.port)  # returns once a signal's graceful shutdown is done
    return 0


def _check_serve_capacity(settings: ServerSettings) -> None:
    """The session the server will make (its slots, each for `--max-model-len` tokens), checked from the
    configs against the model's context length and the device's memory."""
    from ddtree.engine.engine import GenerationConfig
    from ddtree.models.target import read_target_config
    from ddtree.runtime import check_capacity, resolve_paths
    from ddtree.server.model import DEFAULT_MAX_MODEL_LEN

    model, drafter = resolve_paths(settings.model, settings.drafter, settings.method)
    limit = getattr(read_target_config(model), "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
    tokens = min(settings.max_model_len or DEFAULT_MAX_MODEL_LEN, int(limit))  # over the limit: load_model says so
    generation = GenerationConfig(method=settings.method, budget=settings.budget, topk=settings.topk)
    check_capacity(model, drafter, generation, settings.max_batch_size, tokens, settings.options)


def _models_verify(args: argparse.Namespace) -> int:
    from ddtree.models.cache import ddtree_home
    from ddtree.models.pull import verify_models

    results = verify_models(args.name)
    for path, problem in results:
        print(f"ok   {path}" if problem is None else f"BAD  {path}: {problem}")
    bad = sum(problem is not None for _, problem in results)
    if not results:
        print(f"no cached models under {ddtree_home() / 'models'}")
    elif bad:
        print(f"ddtree: {bad} of {len(results)} cached files do not match; `models pull` rebuilds", file=sys.stderr)
    return EXIT_MISMATCH if bad else 0


def _models_pull(args: argparse.Namespace) -> int:
    from ddtree.models.pull import pull

    print(pull(args.name))
    return 0


def _models_init_tiny(args: argparse.Namespace) -> int:
    from ddtree.models.tiny import write_tiny_target

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UserError(f"--out {args.out!r} is a file, not a directory")
    out = write_tiny_target(Path(args.out), seed=args.seed, hidden_size=args.hidden_size, num_layers=args.num_layers)
    print(f"wrote a random tiny Llama target to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
