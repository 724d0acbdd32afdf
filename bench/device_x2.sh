#!/usr/bin/env bash
# A device call on two GPUs (nvidia-h200-x2): every GPU test on GPU 0 (8 workers; the CPU-only ahead-of-time
# compile checks are left to CI), then the multi-process tests (spec.decode under torchrun with two NCCL ranks,
# graphs against eager; the gloo tests), then optionally the TP8-rank step bench on GPU 0.
# Usage (device): bash bench/device_x2.sh [tests-s] [multi-s] [bench-s] [bench_step.py args...] (0 skips a part)
source bench/device_env.sh
tests_s=${1:-210}; multi_s=${2:-120}; bench_s=${3:-0}; shift 3 || true
part() { [ "$1" -gt 0 ] && timeout "$@"; }
CUDA_VISIBLE_DEVICES=0 part "$tests_s" python -m pytest -q -n 8 -rf --tb=short -p no:cacheprovider tests \
  -k "not sm120 and not sm90 and not two_gloo and not torchrun" >"$OUT/gpu_tests.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -12
part "$multi_s" python -m pytest -q -rfs -p no:cacheprovider tests -k "torchrun or two_gloo" \
  >"$OUT/gpu_tests_x2.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/gpu_tests_x2.log" | tail -8
CUDA_VISIBLE_DEVICES=0 part "$bench_s" python bench/bench_step.py --out "$OUT" "$@" 2>&1 | tee "$OUT/step.log" \
  | grep -v Warn | tail -30
