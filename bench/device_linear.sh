#!/usr/bin/env bash
# The dense-projection call: the skinny GEMM's GPU tests (bf16, CUDA-graph replay, pdl; skipped when tests-s is 0),
# then every Triton candidate against cuBLAS at one TP8 rank's projection shapes (and the drafter's), cold L2, CUDA
# graphs; one MoE layer's projections as a chain; with --step-ab the TP8 verify at 4k (budgets 0, 32) captured with
# cuBLAS, the current table and the proposed one. At most 4 files come back under $OUT.
# Usage (device): bash bench/device_linear.sh [tests-s] [bench-timeout-s] [bench-budget-s] [bench_linear.py args...]
# e.g. session 7's M = 1 sweep: bash bench/device_linear.sh 45 150 100 --ms 1
source bench/device_env.sh
tests_s=${1:-45}; bench_s=${2:-150}; budget_s=${3:-85}; shift 3 || true
if [ "$tests_s" != 0 ]; then
  timeout "$tests_s" python -m pytest -q -n 8 -x -p no:cacheprovider tests/test_linear_kernel.py -k "not sm120" \
    >"$OUT/pytest_linear.log" 2>&1
  echo "pytest exit $? at ${SECONDS}s"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_linear.log" | tail -6
fi
timeout "$bench_s" python bench/bench_linear.py --out "$OUT" --budget "$budget_s" "$@" 2>&1 | grep -v Warn \
  | tee "$OUT/bench_linear.log" | tail -80
echo "bench exit $? at ${SECONDS}s"
