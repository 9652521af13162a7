#!/usr/bin/env bash
# The GPU machine as it is, on CPU: a fresh virtual environment holding only what that machine has (PyTorch,
# transformers 5.17, accelerate 1.15, peft, safetensors and their own requirements), then the device check's wheels
# installed with no index, then the device check in its dry mode (CPU, tiny shapes).
#   bash bench/bare_box.sh DIR        # from anywhere; DIR is emptied first
# PyTorch: the machine's 2.11, CPU build, from PyTorch's CPU index when it answers; else the CPU build of
# $BARE_BOX_TORCH (torch==2.13.0+cpu, from the local wheel folder), the closest CPU build where PyPI alone is reachable
# (PyPI's own Linux wheels of 2.11 are the CUDA build, several GB).
# Wheels: those in wheels/ (or $LLMOPS_WHEELS); when there are none, bench/wheel_set.py downloads them for this
# Python first (that needs a package index). Prints what the box holds, the wheel set's size, each step's JSON line
# and the summary table. Exit status: the device check's: 0 only when every step passed.
set -uo pipefail
[ $# -eq 1 ] || { echo "usage: bash bench/bare_box.sh DIR" >&2; exit 2; }
DIR=$1
cd "$(dirname "$0")/.."
WHEELS=${LLMOPS_WHEELS:-wheels}
TORCH_FALLBACK=${BARE_BOX_TORCH:-torch==2.13.0+cpu}
unset VIRTUAL_ENV PYTHONPATH PYTHONHOME
BASE=${BARE_BOX_PYTHON:-python3}

"$BASE" -m venv --clear "$DIR" || exit 2
PIP=("$DIR/bin/python" -m pip --quiet --disable-pip-version-check)
echo "== the box: PyTorch (CPU), transformers, accelerate, peft, safetensors"
if ! "${PIP[@]}" install --retries 0 --timeout 20 torch==2.11.0 --index-url https://download.pytorch.org/whl/cpu \
    2>/dev/null; then
  echo "PyTorch's CPU index does not answer here: $TORCH_FALLBACK instead of 2.11.0"
  "${PIP[@]}" install "$TORCH_FALLBACK" 2>&1 | grep -v '^WARNING: Location' || true
fi
"${PIP[@]}" install "transformers==5.17.*" "accelerate==1.15.*" peft safetensors 2>&1 | grep -v '^WARNING: Location'
"$DIR/bin/python" - <<'EOF' || exit 2
import importlib.metadata as m
print("box:", ", ".join(f"{name} {m.version(name)}" for name in
                        ("torch", "transformers", "accelerate", "peft", "safetensors", "tokenizers", "huggingface-hub")))
for absent in ("datasets", "trl", "pyarrow", "deepspeed", "prefect", "mlflow"):
    try:
        m.version(absent)
    except m.PackageNotFoundError:
        continue
    raise SystemExit(f"{absent} is on the box already: it would not be a bare one")
EOF

echo "== the wheels"
if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  "$DIR/bin/python" bench/wheel_set.py download "$WHEELS" 2>&1 | grep -v '^WARNING: Location' || exit 2
fi
"$DIR/bin/python" bench/wheel_set.py check "$WHEELS" || exit 1
"${PIP[@]}" install --no-index --find-links "$WHEELS" "$WHEELS"/*.whl 2>&1 | grep -v '^WARNING: Location'
[ "${PIPESTATUS[0]}" = 0 ] || { echo "the wheels do not install with no index" >&2; exit 1; }

echo "== the device check, dry"
PYTHON="$DIR/bin/python" LLMOPS_WHEELS="$WHEELS" bash bench/device_check.sh --dry
