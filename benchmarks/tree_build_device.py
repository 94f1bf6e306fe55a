"""GPU check of the fused Triton tree build against the torch reference: exactness, then speed.

    python benchmarks/tree_build_device.py [--json OUT] [--trials N] [--quick]
    ncu --clock-control none -k regex:"vocab|beam" python benchmarks/tree_build_device.py --profile-goal

Run from the repository root on a CUDA machine with triton. Part 1 builds both trees from fresh random logits
for many shapes and dtypes and counts, per shape: `exact` (same tokens, parents, depths, num_nodes; log_probs
allclose), `tie_equiv` (not exact, but the fused tree is a valid tree of equally probable prefixes: same sorted
log-probs, parents before children, each node's log-prob = its parent's + its token's), and `bad` (anything
else: a real bug). It also counts rows whose vocab top-k ids differ from torch's (`topk_id_rows`). Part 2 times
both paths with triton.testing.do_bench (median) and as CUDA graph replays. Each variant catches and prints its
own exception, so one failure does not hide the rest. Part 1 runs three times: with the module's knobs, with
every threshold search at 4 bits a round (`RADIX_KNOBS`), and with the vocab stage as the row kernel
(`_VOCAB_ROWS`). `--knobs` also times the tuning knobs of `ddtree.kernels.tree_build` (vocab chunk, bitonic
selection, radix bits of each kernel's threshold search, the row kernel).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from ddtree.kernels import tree_build
from ddtree.kernels.tree_build import beam_tree, build_tree_fused, triton_available, vocab_topk
from ddtree.tree import DraftTree, build_tree

FIELDS = ("tokens", "parents", "depths", "num_nodes")
RADIX_KNOBS = ("_RADIX_BITS_VOCAB", "_RADIX_BITS_MERGE", "_RADIX_BITS_BEAM")
# (batch, depth, vocab, budget, topk, dtype, logit scale)
SHAPES: list[tuple[int, int, int, int, int | None, str, float]] = [
    (32, 15, 49152, 256, None, "float32", 3.0),
    (32, 15, 49152, 256, None, "bfloat16", 3.0),
    (32, 15, 49152, 256, None, "float32", 1.0),
    (1, 15, 49152, 256, None, "float32", 3.0),
    (32, 15, 49152, 32, None, "bfloat16", 3.0),
    (8, 15, 49152, 64, 8, "float16", 3.0),
    (4, 8, 152064, 256, None, "bfloat16", 3.0),
    (4, 16, 32000, 1024, None, "float32", 3.0),
    (16, 6, 1000, 512, None, "float32", 2.0),
    (8, 3, 5, 200, None, "float32", 1.0),  # budget > the 5 + 25 + 125 possible prefixes
    (8, 15, 49152, 256, 1, "float32", 3.0),
    (8, 15, 49152, 1, None, "bfloat16", 3.0),
    (8, 5, 50257, 128, 300, "float32", 3.0),  # topk > budget
]


def tree_equivalent(fused: DraftTree, ref: DraftTree, logits: torch.Tensor) -> bool:
    """Whether `fused` is a valid tree of the same prefix probabilities as `ref` (ties may reorder them)."""
    if not torch.equal(fused.num_nodes, ref.num_nodes):
        return False
    if not torch.allclose(fused.log_probs, ref.log_probs, rtol=1e-5, atol=1e-5):  # both sorted descending
        return False
    token_lp = torch.log_softmax(logits.float(), dim=-1)  # [batch, depth, vocab]
    for b in range(fused.batch_size):
        n = int(fused.num_nodes[b])
        nodes = torch.arange(1, n + 1, device=logits.device)
        par, dep, tok = fused.parents[b, 1 : n + 1], fused.depths[b, 1 : n + 1], fused.tokens[b, 1 : n + 1]
        if bool((par >= nodes).any()) or bool((dep != fused.depths[b][par] + 1).any()):
            return False
        expect = fused.log_probs[b][par] + token_lp[b, dep - 1, tok]
        if not torch.allclose(fused.log_probs[b, 1 : n + 1], expect, rtol=1e-5, atol=1e-4):
            return False
        if len(set(zip(par.tolist(), tok.tolist(), strict=True))) != n:  # distinct children = distinct prefixes
            return False
    return True


def check_shape(shape: tuple[int, int, int, int, int | None, str, float], trials: int) -> dict[str, Any]:
    batch, depth, vocab, budget, topk, dtype, scale = shape
    counts = {"exact": 0, "tie_equiv": 0, "bad": 0, "topk_id_rows": 0, "lp_max_abs_diff": 0.0}
    for trial in range(trials):
        gen = torch.Generator(device="cuda").manual_seed(1000 * trial + 7)
        logits = (torch.randn((batch, depth, vocab), generator=gen, device="cuda") * scale).to(getattr(torch, dtype))
        ref, fused = build_tree(logits, budget, topk), build_tree_fused(logits, budget, topk)
        k = min(budget, vocab if topk is None else topk)
        _, ref_ids = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
        _, top_ids = vocab_topk(logits, k)
        counts["topk_id_rows"] += int((top_ids != ref_ids).any(dim=-1).sum())
        diff = (fused.log_probs - ref.log_probs).nan_to_num(0.0, 0.0, 0.0).abs().max()
        counts["lp_max_abs_diff"] = max(counts["lp_max_abs_diff"], float(diff))
        exact = all(torch.equal(getattr(fused, f), getattr(ref, f)) for f in FIELDS)
        exact = exact and torch.allclose(fused.log_probs, ref.log_probs, rtol=1e-5, atol=1e-5)
        if exact:
            counts["exact"] += 1
        elif tree_equivalent(fused, ref, logits):
            counts["tie_equiv"] += 1
        else:
            counts["bad"] += 1
    return counts


def graph_ms(fn: Callable[[], object], replays: int = 200) -> float:
    """Milliseconds per replay of `fn` captured in a CUDA graph (after warm-up on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def time_variant(batch: int, budget: int, dtype: str) -> dict[str, Any]:
    import triton.testing

    logits = (torch.randn((batch, 15, 49152), device="cuda") * 3).to(getattr(torch, dtype))
    k = min(budget, 49152)
    top_lp, top_ids = vocab_topk(logits, k)
    fns: dict[str, Callable[[], object]] = {
        "torch": lambda: build_tree(logits, budget),
        "fused": lambda: build_tree_fused(logits, budget),
        "fused_vocab": lambda: vocab_topk(logits, k),
        "fused_beam": lambda: beam_tree(top_lp, top_ids, budget),
    }
    row: dict[str, Any] = {"batch": batch, "budget": budget, "dtype": dtype}
    for name, fn in fns.items():
        for how, timer in (("bench", lambda f=fn: triton.testing.do_bench(f, return_mode="median")), ("graph", None)):
            key = f"{name}_{how}_us"
            try:
                ms = timer() if timer is not None else graph_ms(fn)
                row[key] = round(1000 * float(ms), 1)
            except Exception as exc:  # one failing variant must not hide the others
                row[key] = None
                print(f"  {key} batch={batch} B={budget} {dtype}: {type(exc).__name__}: {exc}")
    return row


def _knob_row(fn: Callable[[], object], **labels: Any) -> dict[str, Any]:
    import triton.testing

    row: dict[str, Any] = dict(labels)
    try:
        row["us"] = round(1000 * float(triton.testing.do_bench(fn, return_mode="median")), 1)
    except Exception as exc:  # one failing variant must not hide the others
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row


@contextlib.contextmanager
def knobs(**values: Any) -> Iterator[None]:
    """Set module knobs of `ddtree.kernels.tree_build` (`_CHUNK=2048`, ...) inside the block, then restore them."""
    saved = {name: getattr(tree_build, name) for name in values}
    try:
        for name, value in values.items():
            setattr(tree_build, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(tree_build, name, value)


def time_knobs() -> list[dict[str, Any]]:
    """Microseconds of the two fused stages under the module's tuning knobs (depth 15, vocab 49152), each row
    labelled with the knobs it sets: the vocab stage (batch 32) by chunk, bitonic merge and the radix bits of the
    partial and merge searches; the beam (batch 1 and 32, budgets 32 to 256) by bitonic selection and radix bits."""
    rows: list[dict[str, Any]] = []
    names = ("_CHUNK", "_BITONIC_MERGE", "_RADIX_BITS_VOCAB", "_RADIX_BITS_MERGE", "_VOCAB_ROWS")
    vocab_variants = [(4096, False, 1, 1, False), (4096, True, 1, 1, False), (2048, False, 1, 1, False)]
    vocab_variants += [(8192, False, 1, 1, False), (4096, False, 4, 1, False), (4096, False, 1, 4, False)]
    vocab_variants += [(4096, False, 4, 4, False), (4096, False, 1, 1, True), (4096, False, 1, 4, True)]
    for dtype in ("float32", "bfloat16"):
        logits = (torch.randn((32, 15, 49152), device="cuda") * 3).to(getattr(torch, dtype))
        for k in (32, 256):
            fn = functools.partial(vocab_topk, logits, k)
            for values in vocab_variants:
                settings = dict(zip(names, values, strict=True))
                with knobs(**settings):
                    rows.append(_knob_row(fn, stage=f"vocab k={k}", dtype=dtype, **settings))
    for batch in (1, 32):
        logits = torch.randn((batch, 15, 49152), device="cuda") * 3
        for budget in (32, 64, 256):
            top_lp, top_ids = vocab_topk(logits, budget)
            fn = functools.partial(beam_tree, top_lp, top_ids, budget)
            for bitonic, radix in ((False, 1), (False, 4), (True, 1)):  # radix bits act only without bitonic
                settings = dict(_BITONIC_BEAM=bitonic, _RADIX_BITS_BEAM=radix)
                with knobs(**settings):
                    rows.append(_knob_row(fn, stage=f"beam B={budget}", batch=batch, dtype="float32", **settings))
    return rows


def profile_goal() -> int:
    """The issue's goal shape (batch 32, depth 15, vocab 49152, budget 256): three builds per dtype, so that a
    profiler attached from outside sees warm kernels."""
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(32, 15, 49152, device="cuda") * 3.0).to(dtype)
        for _ in range(3):
            build_tree_fused(logits, 256)
    torch.cuda.synchronize()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--trials", type=int, default=10, help="random inputs per shape (default 10)")
    parser.add_argument("--quick", action="store_true", help="first 3 shapes and fewer timings")
    parser.add_argument("--knobs", action="store_true", help="also time the tuning knobs of ddtree.kernels.tree_build")
    parser.add_argument(
        "--profile-goal", action="store_true", help="only build the goal shape's tree 3 times, f32 then bf16 (for ncu)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available() or not triton_available():
        print("needs a CUDA device and triton")
        return 2
    if args.profile_goal:
        return profile_goal()
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}")
    results: dict[str, Any] = {"exactness": [], "timing": []}
    runs: list[dict[str, Any]] = [{}, dict.fromkeys(RADIX_KNOBS, 4), {"_VOCAB_ROWS": True}]
    for settings in runs:  # the module's knobs, every threshold search at 4 bits a round, the row kernel
        print(f"== exactness: fused vs torch, fresh random logits per trial; knobs {settings or 'as set'}")
        for shape in SHAPES[:3] if args.quick else SHAPES:
            try:
                with knobs(**settings):
                    counts = check_shape(shape, args.trials)
            except Exception as exc:
                traceback.print_exc()
                counts = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"  {shape}: {counts}")
            results["exactness"].append({"shape": list(shape), "knobs": settings, **counts})
    print("== timing (microseconds; depth 15, vocab 49152)")
    variants = [(b, B, dt) for dt in ("float32", "bfloat16") for B in (32, 256) for b in (1, 32)]
    for batch, budget, dtype in variants[:2] if args.quick else variants:
        try:
            results["timing"].append(time_variant(batch, budget, dtype))
        except Exception as exc:
            traceback.print_exc()
            results["timing"].append({"batch": batch, "budget": budget, "dtype": dtype, "error": str(exc)})
    cols = [f"{n}_{h}_us" for n in ("torch", "fused", "fused_vocab", "fused_beam") for h in ("bench", "graph")]
    print(f"{'batch':>5} {'B':>4} {'dtype':>8} " + " ".join(f"{c[:-3]:>17}" for c in cols))
    for row in results["timing"]:
        cells = " ".join(f"{row.get(c, 'err')!s:>17}" for c in cols)
        print(f"{row['batch']:>5} {row['budget']:>4} {row['dtype']:>8} {cells}")
    if args.knobs:
        print("== tuning knobs (microseconds, do_bench median)")
        results["knobs"] = time_knobs()
        for row in results["knobs"]:
            print("  " + " ".join(f"{key}={value}" for key, value in row.items()))
    bad = sum(int(r.get("bad", 0)) + ("error" in r) for r in results["exactness"])
    print(f"mismatches (bad trees or errors): {bad}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
