#!/usr/bin/env bash
# Everything GPU-side in one command, on a bare CUDA machine (PyTorch, transformers, accelerate, peft, safetensors
# and their own requirements; no package index). What else it needs travels beside the tree as wheels
# (bench/device_wheels.txt, fetched by bench/wheel_set.py; 64 MiB with the tree):
#   bash bench/device_check.sh            # from the repository root
#   bash bench/device_check.sh --plan     # say what would run, run nothing (any machine)
#   bash bench/device_check.sh --dry      # the same steps on CPU, tiny shapes (bench/bare_box.sh runs it)
# 1. installs the wheels copied beside the tree (wheels/, or $LLMOPS_WHEELS), offline, when there are any;
# 2. runs each throughput bench shape in its own process (one crash loses only its own figures);
# 3. runs the smoke trainings on one GPU: DeepSpeed ZeRO-2 and ZeRO-3, FSDP2 + LoRA (merged), QLoRA (NOT RUN without
#    bitsandbytes, whose wheel is too big to travel with the others: never a failure of the check);
# 4. prints each step's JSON line as it ends, then one summary table last.
# Each step runs under bench/run_step.py with its own limit: at the limit its whole process tree is killed (launched
# workers included) and its line says how far it got, with "timed_out": true. The limits add up to less than the
# budget, and the budget leaves a device call (600 s at most) room for the start and the wheels. A step that would
# not fit in what is left is reported NOT RUN, never estimated. Without CUDA every GPU step is NOT RUN (--dry aside).
# Exit status: 0 when every step passed, 1 when one failed, 2 when one was not run (QLoRA without bitsandbytes aside).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-}
case "$MODE" in ""|--plan|--dry) ;; *) echo "usage: bash bench/device_check.sh [--plan|--dry]" >&2; exit 2 ;; esac
CALL_LIMIT=600  # seconds a device call may run
if [ "$MODE" = --dry ]; then
  BUDGET=${LLMOPS_CHECK_BUDGET:-900}; SHAPE_LIMITS=(180 180); SMOKE_LIMITS=(120 120 120 120)
else
  # llama1b, gpt2; zero2, zero3, fsdp2, qlora: 455 s of a 470 s budget (under 8 minutes), which leaves 130 s of the
  # call for the start and the wheels
  BUDGET=${LLMOPS_CHECK_BUDGET:-470}; SHAPE_LIMITS=(140 110); SMOKE_LIMITS=(50 55 55 45)
fi
SHAPES=(llama1b gpt2); SMOKES=(zero2 zero3 fsdp2 qlora)
WHEELS=${LLMOPS_WHEELS:-wheels}
PY=${PYTHON:-python3}
OUT=$(mktemp -d)
START=$(date +%s)
ROWS=()
FAILED=0; MISSED=0
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

total=0; for limit in "${SHAPE_LIMITS[@]}" "${SMOKE_LIMITS[@]}"; do total=$((total + limit)); done
if [ "$total" -ge "$BUDGET" ]; then
  echo "the steps' limits add up to ${total}s, not under the ${BUDGET}s budget: lower them or raise the budget" >&2
  exit 2
fi

row() { ROWS+=("$(printf '%-14s %-8s %s' "$1" "$2" "$3")"); }

gpu() { "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

# step NAME LIMIT COMMAND...: runs it under its limit; bench/run_step.py prints its one JSON line
step() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - $(date +%s) + START))
  if [ "$MODE" = --plan ]; then row "$name" "plan" "timeout ${limit}s: $*"; return; fi
  if [ -z "$HAVE_GPU" ] && [ "$MODE" != --dry ]; then row "$name" "NOT RUN" "no CUDA device"; MISSED=1; return; fi
  if [ "$left" -lt "$limit" ]; then
    row "$name" "NOT RUN" "time budget: ${left}s left, the step may take ${limit}s"; MISSED=1; return
  fi
  local line code
  line=$("$PY" bench/run_step.py "$name" "$limit" --logs "$OUT" -- "$@")
  code=$?
  echo "$line"
  case "$code" in
    0) row "$name" "ok" "$line" ;;
    3) row "$name" "NOT RUN" "$line" ;;  # it could not run here and said why (QLoRA without bitsandbytes)
    124) row "$name" "FAILED" "over its ${limit}s limit: $line"; FAILED=1 ;;
    *) row "$name" "FAILED" "$line"; FAILED=1 ;;
  esac
}

if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  if [ "$MODE" = --plan ]; then row wheels plan "pip install --no-index --find-links $WHEELS $WHEELS/*.whl"
  elif "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "$WHEELS"/*.whl >"$OUT/wheels.err" 2>&1; then
    row wheels ok "$(ls "$WHEELS"/*.whl | wc -l) wheels installed offline"
  else row wheels FAILED "$(grep -v '^WARNING' "$OUT/wheels.err" | tail -n 1)"; FAILED=1; fi
else row wheels skipped "no $WHEELS/*.whl beside the tree: using what is installed"; fi

HAVE_GPU=""; if [ "$MODE" != --plan ] && gpu; then HAVE_GPU=1; fi
DRY=(); [ "$MODE" = --dry ] && DRY=(--dry)
for i in "${!SHAPES[@]}"; do
  step "bench-${SHAPES[$i]}" "${SHAPE_LIMITS[$i]}" "$PY" bench/gpu_train_bench.py --shape "${SHAPES[$i]}" "${DRY[@]}"
done
for i in "${!SMOKES[@]}"; do
  step "smoke-${SMOKES[$i]}" "${SMOKE_LIMITS[$i]}" "$PY" bench/smoke_train.py "${SMOKES[$i]}" "${DRY[@]}"
done

echo "logs: $OUT"
if [ -n "$HAVE_GPU" ]; then echo "device: $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')"
elif [ "$MODE" = --dry ]; then echo "device: cpu (dry: tiny shapes, one plain process per smoke training)"
elif [ "$MODE" != --plan ]; then echo "device: none (no CUDA device: every GPU step NOT RUN)"; fi
echo "seconds: $(( $(date +%s) - START )) (budget ${BUDGET}s; the steps' limits add up to ${total}s)"
printf '%-14s %-8s %s\n' step status figures
for line in "${ROWS[@]}"; do echo "$line"; done
[ "$MODE" = --plan ] && exit 0
[ "$FAILED" = 1 ] && exit 1
[ "$MISSED" = 1 ] && exit 2
exit 0
