#!/usr/bin/env bash
# The recipe behind the shipped default drafter (ddtree/models/smollm2_dflash), for one CUDA GPU.
#   scripts/train_default_drafter.sh prompts OUT           # the training prompts as JSONL, written where
#                                                           # Debian's wamerican and fortunes are installed
#   scripts/train_default_drafter.sh target GGUF WORK      # convert the target into WORK/target (once)
#   scripts/train_default_drafter.sh prepare GGUF WORK     # the target, then training data
#                                                           # (WORK/data.jsonl, packed into WORK/data)
#   scripts/train_default_drafter.sh train WORK MINUTES    # train the drafter in WORK/drafter
#   scripts/train_default_drafter.sh train-bg WORK MINUTES # the same in the background (WORK/train.pid)
#   scripts/train_default_drafter.sh wait WORK             # until the background job has ended
#   scripts/train_default_drafter.sh bench WORK            # tau and speed on the held-out prompts
#   scripts/train_default_drafter.sh all GGUF WORK MINUTES     # prepare, train, bench, training for what
#   scripts/train_default_drafter.sh all-bg GGUF WORK MINUTES  # is left of MINUTES (all-bg: in the background)
# Training over several sessions (docs/drafter-training.md); set TOTAL_MINUTES, the training time of all
# runs together that the learning-rate schedule spans, for every train and resume:
#   scripts/train_default_drafter.sh resume WORK MINUTES   # continue WORK/drafter's training for at most
#                                                           # MINUTES, within TOTAL_MINUTES
#   scripts/train_default_drafter.sh pack WORK OUT [PART]  # copy part PART (default 1) of the trainer state
#                                                           # and the packed data into OUT; says how many parts
#   scripts/train_default_drafter.sh unpack CARRY WORK     # gather one part's files from CARRY into WORK;
#                                                           # once the state is complete, import it
# PROMPTS (a JSONL file of {"prompt": ...}) overrides the built-in training prompts; NUM_PROMPTS,
# MAX_NEW_TOKENS and DATA_BATCH size the data; TRAIN_BATCH sizes a training step and INIT names a drafter
# to start from. NUM_LAYERS and NUM_FEATURES shape a new drafter (default 2 and 3; DFlash's recipe is 5 and
# 5), ANCHORS sets the blocks per sequence (default 32). DISTILL=kl distils the target's distributions
# instead of its tokens (ce+kl: both), GAMMA sets the loss decay over block positions, EVAL_HELDOUT=1
# measures tau on held-out prompts after each run and EVAL_EVERY=MINUTES within it (teacher-forced).
# PACK names what pack ships: "state data" (the default), "state" or "data"; MAX_FILES and MAX_MIB bound a
# part (default 7 files and 44 MiB). The shipped drafter's model card gives the values it was trained with.
set -euo pipefail
PY=${PYTHON:-python3}
DDTREE="$PY -m ddtree.cli"
cmd=${1:-}

# The packed data where there is some, else the JSONL file.
data_of() { if [ -f "$1/data/data.json" ]; then echo "$1/data"; else echo "$1/data.jsonl"; fi; }

train_drafter() {  # WORK MINUTES [--resume]
  local work=$1 minutes=$2
  shift 2
  $DDTREE drafter train --model "$work/target" --data "$(data_of "$work")" --out "$work/drafter" \
    --num-layers "${NUM_LAYERS:-2}" --num-features "${NUM_FEATURES:-3}" --block-size 16 --steps 100000 \
    --batch-size "${TRAIN_BATCH:-64}" --anchors "${ANCHORS:-32}" --lr 6e-4 --max-minutes "$minutes" \
    --checkpoint-every 500 ${INIT:+--init "$INIT"} ${TOTAL_MINUTES:+--total-minutes "$TOTAL_MINUTES"} \
    --distill "${DISTILL:-ce}" --gamma "${GAMMA:-7}" ${EVAL_EVERY:+--eval-every "$EVAL_EVERY"} \
    $([ "${EVAL_HELDOUT:-0}" = 1 ] && echo --eval-heldout) "$@"
}

case "$cmd" in
  prompts)
    $PY -c "import json, sys; from ddtree.data import heldout_prompts; from ddtree.train.prompts import \
training_prompts; open(sys.argv[1], 'w').writelines(json.dumps({'prompt': p}) + '\n' for p in \
training_prompts(int(sys.argv[2]), exclude=set(heldout_prompts())))" "$2" "${NUM_PROMPTS:-32000}"
    ;;
  target)
    gguf=$2 work=$3
    mkdir -p "$work"
    [ -f "$work/target/config.json" ] || $PY -c "import sys; from pathlib import Path; from ddtree.models.pull import convert_gguf; \
convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]), '<|im_end|>')" "$gguf" "$work/target"
    ;;
  prepare)
    gguf=$2 work=$3
    "$0" target "$gguf" "$work"
    $DDTREE drafter data --model "$work/target" --out "$work/data.jsonl" \
      --num-prompts "${NUM_PROMPTS:-32000}" ${PROMPTS:+--prompts "$PROMPTS"} \
      --max-new-tokens "${MAX_NEW_TOKENS:-160}" --batch-size "${DATA_BATCH:-1024}" --dtype bfloat16
    $DDTREE drafter pack-data "$work/data.jsonl" "$work/data"
    ;;
  train)
    train_drafter "$2" "$3"
    ;;
  resume)
    work=$2 minutes=$3
    : "${TOTAL_MINUTES:?set TOTAL_MINUTES: the training time of all runs that the schedule spans}"
    [ -f "$work/drafter/trainer_state.pt" ] || { echo "no trainer state in $work/drafter: unpack it first" >&2; exit 1; }
    train_drafter "$work" "$minutes" --resume
    ;;
  pack)
    work=$2 out=$3 part=${4:-1}
    bundles=()
    for what in ${PACK:-state data}; do
      case "$what" in
        state)
          # The same trainer state exports to the same files: parts from separate calls fit together.
          [ "$work/state/state.json" -nt "$work/drafter/trainer_state.pt" ] \
            || $DDTREE drafter state export "$work/drafter" "$work/state"
          bundles+=("$work/state") ;;
        data)
          [ -f "$work/data/data.json" ] || $DDTREE drafter pack-data "$work/data.jsonl" "$work/data"
          bundles+=("$work/data") ;;
        *) echo "PACK takes state and data, got $what" >&2; exit 2 ;;
      esac
    done
    $DDTREE drafter part "${bundles[@]}" --out "$out" --part "$part" \
      --max-files "${MAX_FILES:-7}" --max-mib "${MAX_MIB:-44}"
    ;;
  unpack)
    carry=$2 work=$3
    report=$($DDTREE drafter gather "$carry" "$work")
    echo "$report"
    if grep -q "^state: complete" <<< "$report"; then
      if [ -f "$work/drafter/trainer_state.pt" ]; then
        echo "$work/drafter already has a trainer state: not imported (remove it to import this one)" >&2
      else
        $DDTREE drafter state import "$work/state" "$work/drafter"
      fi
    fi
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
    $DDTREE bench --model "$work/target" --drafter "$work/drafter" --batch-size 64 \
      --max-new-tokens 128 --json "$work/bench.json"
    ;;
  *)
    echo "usage: $0 prompts OUT | target GGUF WORK | prepare GGUF WORK | train WORK MINUTES | train-bg WORK MINUTES | wait WORK" \
      "| bench WORK | all GGUF WORK MINUTES | all-bg GGUF WORK MINUTES | resume WORK MINUTES" \
      "| pack WORK OUT [PART] | unpack CARRY WORK" >&2
    exit 2
    ;;
esac
