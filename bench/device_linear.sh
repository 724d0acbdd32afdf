#!/usr/bin/env bash
# Session 4's dense-projection call: the skinny GEMM's GPU tests (bf16, CUDA-graph replay, pdl), then every Triton
# candidate against cuBLAS at one TP8 rank's projection shapes (and the drafter's), M in {1, 2, 4, 9, 17, 33, 65},
# cold L2, CUDA graphs; one MoE layer's projections as a chain; the TP8 verify at 4k (budgets 0, 32) captured with
# cuBLAS and with the proposed table. At most 4 files come back under $OUT.
# Usage (device): bash bench/device_linear.sh [tests-s] [bench-timeout-s] [bench-budget-s]
source bench/device_env.sh
timeout "${1:-45}" python -m pytest -q -n 8 -x -p no:cacheprovider tests/test_linear_kernel.py -k "not sm120" \
  >"$OUT/pytest_linear.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_linear.log" | tail -6
timeout "${2:-150}" python bench/bench_linear.py --out "$OUT" --budget "${3:-85}" --step-ab 2>&1 | grep -v Warn \
  | tee "$OUT/bench_linear.log" | tail -80
