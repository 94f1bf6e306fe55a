#!/usr/bin/env bash
# The recipe behind the shipped default drafter (ddtree/models/smollm2_dflash), for one CUDA GPU.
#   examples/train_default_drafter.sh prompts OUT           # the training prompts as JSONL, written where
#                                                           # Debian's wamerican and fortunes are installed
#   examples/train_default_drafter.sh prepare GGUF WORK     # convert the target, write training data
#   examples/train_default_drafter.sh train WORK MINUTES    # train the drafter in WORK/drafter
#   examples/train_default_drafter.sh train-bg WORK MINUTES # the same in the background (WORK/train.pid)
#   examples/train_default_drafter.sh wait WORK             # until the background job has ended
#   examples/train_default_drafter.sh bench WORK            # tau and speed on the held-out prompts
#   examples/train_default_drafter.sh all-bg GGUF WORK MINUTES  # prepare, train, bench in the background,
#                                                           # training for what is left of MINUTES
# PROMPTS (a JSONL file of {"prompt": ...}) overrides the built-in training prompts; NUM_PROMPTS,
# MAX_NEW_TOKENS and DATA_BATCH size the data; TRAIN_BATCH sizes a training step and INIT names a drafter
# to start from. The shipped drafter's model card gives the values it was trained with.
set -euo pipefail
PY=${PYTHON:-python3}
cmd=$1
case "$cmd" in
  prompts)
    $PY -c "import json, sys; from ddtree.bench import heldout_prompts; from ddtree.train.prompts import \
training_prompts; open(sys.argv[1], 'w').writelines(json.dumps({'prompt': p}) + '\n' for p in \
training_prompts(int(sys.argv[2]), exclude=set(heldout_prompts())))" "$2" "${NUM_PROMPTS:-32000}"
    ;;
  prepare)
    gguf=$2 work=$3
    mkdir -p "$work"
    [ -f "$work/target/config.json" ] || $PY -c "import sys; from pathlib import Path; from ddtree.models.pull import convert_gguf; \
convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]), '<|im_end|>')" "$gguf" "$work/target"
    $PY -m ddtree.cli drafter data --target "$work/target" --out "$work/data.jsonl" \
      --num-prompts "${NUM_PROMPTS:-32000}" ${PROMPTS:+--prompts "$PROMPTS"} \
      --max-new-tokens "${MAX_NEW_TOKENS:-160}" --batch-size "${DATA_BATCH:-2048}" --dtype bfloat16
    ;;
  train)
    work=$2 minutes=$3
    $PY -m ddtree.cli drafter train --target "$work/target" --data "$work/data.jsonl" --out "$work/drafter" \
      --num-layers 2 --num-features 3 --block-size 16 --steps 100000 --batch-size "${TRAIN_BATCH:-64}" \
      --anchors 32 --lr 6e-4 --max-minutes "$minutes" --checkpoint-every 500 ${INIT:+--init "$INIT"}
    ;;
  train-bg)
    work=$2 minutes=$3
    setsid nohup "$0" train "$work" "$minutes" > "$work/train.log" 2>&1 < /dev/null &
    echo $! > "$work/train.pid"
    ;;
  all)
    gguf=$2 work=$3 minutes=$4
    start=$(date +%s)
    "$0" prepare "$gguf" "$work"
    left=$(( minutes * 60 - ($(date +%s) - start) - ${BENCH_RESERVE_S:-120} ))
    [ "$left" -gt 60 ] || { echo "no time left to train" >&2; exit 1; }
    "$0" train "$work" "$(awk "BEGIN { print $left / 60 }")"
    "$0" bench "$work"
    ;;
  all-bg)
    mkdir -p "$3"
    setsid nohup "$0" all "$2" "$3" "$4" > "$3/train.log" 2>&1 < /dev/null &
    echo $! > "$3/train.pid"
    ;;
  wait)
    work=$2
    pid=$(cat "$work/train.pid")
    while kill -0 "$pid" 2> /dev/null; do sleep 5; done
    cat "$work/drafter/training.json" 2> /dev/null || tail -n 20 "$work/train.log"
    ;;
  bench)
    work=$2
    $PY -m ddtree.cli bench --model "$work/target" --drafter "$work/drafter" --batch-size 64 \
      --max-new-tokens 128 --json "$work/bench.json"
    ;;
  *)
    echo "usage: $0 prompts OUT | prepare GGUF WORK | train WORK MINUTES | train-bg WORK MINUTES | wait WORK | bench WORK" \
      "| all GGUF WORK MINUTES | all-bg GGUF WORK MINUTES" >&2
    exit 2
    ;;
esac
