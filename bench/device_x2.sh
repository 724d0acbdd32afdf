#!/usr/bin/env bash
# A device call on two GPUs (nvidia-h200-x2): the model/engine GPU tests on GPU 0, spec.decode under torchrun
# with two NCCL ranks (graphs vs eager), then the TP8-rank step bench on GPU 0.
# Usage (device): bash bench/device_x2.sh [tests-s] [bench-s] [bench_step.py args...]
source bench/device_env.sh
tests_s=${1:-150}; bench_s=${2:-150}; shift 2 || true
timeout "$tests_s" python -m pytest -q -rfs -p no:cacheprovider --durations=8 tests/test_glue_kernels.py \
  tests/test_graphs.py tests/test_engine.py tests/test_decode_cli.py -k "gpu or router or torchrun or glue or on_triton" \
  >"$OUT/pytest_x2.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/pytest_x2.log" | tail -14
CUDA_VISIBLE_DEVICES=0 timeout "$bench_s" python bench/bench_step.py --out "$OUT" "$@" 2>&1 | tee "$OUT/step.log" \
  | grep -v Warn | tail -30
