#!/usr/bin/env bash
# Everything GPU-side in one command, on a bare CUDA machine (PyTorch, transformers, accelerate, peft, safetensors,
# tokenizers, pyarrow, pytest; no package index):
#   bash bench/device_check.sh            # from the repository root
#   bash bench/device_check.sh --plan     # say what would run, run nothing (any machine)
# 1. installs the wheels copied beside the tree (wheels/, or $LLMOPS_WHEELS), offline, when there are any;
# 2. runs each throughput bench shape in its own process (one crash loses only its own figures);
# 3. runs the smoke trainings on one GPU: DeepSpeed ZeRO-2 and ZeRO-3, FSDP2 + LoRA (merged), QLoRA;
# 4. prints one summary table last. Each step has its own time limit and the whole stays under 8 minutes: a step
#    that would not fit in what is left is reported NOT RUN, never estimated. Without CUDA every GPU step is NOT RUN.
# Exit status: 0 when every step passed, 1 when one failed, 2 when one was not run.
set -uo pipefail
cd "$(dirname "$0")/.."
PLAN=0; [ "${1:-}" = "--plan" ] && PLAN=1
BUDGET=${LLMOPS_CHECK_BUDGET:-450}  # seconds for all steps; a step overruns by 10 s at most: under 8 minutes in all
SHAPE_LIMIT=${LLMOPS_SHAPE_LIMIT:-150}
SMOKE_LIMIT=${LLMOPS_SMOKE_LIMIT:-50}
WHEELS=${LLMOPS_WHEELS:-wheels}
PY=${PYTHON:-python3}
OUT=$(mktemp -d)
START=$(date +%s)
ROWS=()
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

row() { ROWS+=("$(printf '%-14s %-8s %s' "$1" "$2" "$3")"); }

gpu() { "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

# step NAME LIMIT COMMAND...: runs it with its limit, its last JSON line is its figures
step() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - $(date +%s) + START))
  if [ "$PLAN" = 1 ]; then row "$name" "plan" "timeout ${limit}s: $*"; return; fi
  if [ -z "$HAVE_GPU" ]; then row "$name" "NOT RUN" "no CUDA device"; return; fi
  if [ "$left" -lt "$limit" ]; then row "$name" "NOT RUN" "time budget: ${left}s left, the step may take ${limit}s"; return; fi
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
  local code=$?
  local figures; figures=$(grep '^{' "$OUT/$name.out" | tail -n 1)
  if [ "$code" = 124 ] || [ "$code" = 137 ]; then row "$name" "FAILED" "over its ${limit}s limit ${figures}"
  elif [ "$code" != 0 ]; then row "$name" "FAILED" "exit $code: ${figures:-$(tail -n 1 "$OUT/$name.err")}"
  else row "$name" "ok" "$figures"; fi
}

if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  if [ "$PLAN" = 1 ]; then row wheels plan "pip install --no-index --find-links $WHEELS $WHEELS/*.whl"
  elif "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "$WHEELS"/*.whl >"$OUT/wheels.err" 2>&1; then
    row wheels ok "$(ls "$WHEELS"/*.whl | wc -l) wheels installed offline"
  else row wheels FAILED "$(tail -n 1 "$OUT/wheels.err")"; fi
else row wheels skipped "no $WHEELS/*.whl beside the tree: using what is installed"; fi

HAVE_GPU=""; if [ "$PLAN" = 0 ] && gpu; then HAVE_GPU=1; fi
for shape in llama1b gpt2; do
  step "bench-$shape" "$SHAPE_LIMIT" "$PY" bench/gpu_train_bench.py --shape "$shape" --steps 30
done
for check in zero2 zero3 fsdp2 qlora; do
  step "smoke-$check" "$SMOKE_LIMIT" "$PY" bench/smoke_train.py "$check"
done

echo "logs: $OUT"
[ -n "$HAVE_GPU" ] && echo "device: $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')"
[ -z "$HAVE_GPU" ] && [ "$PLAN" = 0 ] && echo "device: none (no CUDA device: every GPU step NOT RUN)"
echo "seconds: $(( $(date +%s) - START ))"
printf '%-14s %-8s %s\n' step status figures
for line in "${ROWS[@]}"; do echo "$line"; done
[ "$PLAN" = 1 ] && exit 0
printf '%s\n' "${ROWS[@]}" | grep -q ' FAILED ' && exit 1
printf '%s\n' "${ROWS[@]}" | grep -q ' NOT RUN ' && exit 2
exit 0
