#!/usr/bin/env bash
# One device call: every GPU test, then the MoE and attention sweeps, all results under $OUT.
# Usage (device): bash bench/gpu_check.sh [pytest-seconds] [moe-seconds] [attention-seconds]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
python -m pip install --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1
if ! python -c "import ops, model, spec, triton_kernels" 2>>"$OUT/pip.log"; then
  echo "the editable install does not import (see pip.log); importing from the tree instead"
  export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout "${1:-240}" python -m pytest -q tests -p no:cacheprovider --durations=10 >"$OUT/pytest_gpu.log" 2>&1
echo "pytest exit $?"; tail -25 "$OUT/pytest_gpu.log"
timeout "${2:-170}" python bench/bench_moe.py --out "$OUT" --budget "$(( ${2:-170} - 15 ))" --sweep-budget 90 --no-sweep \
  | tail -30
timeout "${3:-120}" python bench/bench_attention.py --out "$OUT" --quick | tail -30
