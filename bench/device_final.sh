#!/usr/bin/env bash
# The session's closing device call: GPU tests of what changed, the DDTree step bench, the TP8-rank step bench
# (4k and 32k), and the step again with the Triton skinny GEMM for the dense projections (linear=triton).
# Usage (device): bash bench/device_final.sh [tests-s] [tree-s] [step-s] [linear-s]
source bench/device_env.sh
mkdir -p "$OUT/step" "$OUT/tree" "$OUT/step_linear"
timeout "${1:-90}" python -m pytest -q -rf --tb=short -p no:cacheprovider tests/test_glue_kernels.py \
  tests/test_graphs.py tests/test_kernel_swap.py tests/test_tree_ops.py >"$OUT/pytest_final.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_final.log" | tail -12
timeout "${2:-110}" python bench/bench_tree.py --out "$OUT/tree" --quick 2>&1 | tail -22
timeout "${3:-190}" python bench/bench_step.py --out "$OUT/step" --contexts 4096,32768 --buckets 0,8,32,64,128 \
  --long-buckets 0,32 --iters 10 2>&1 | grep -v Warn | tail -32
SPEC_KERNELS=linear=triton timeout "${4:-60}" python bench/bench_step.py --out "$OUT/step_linear" --contexts 4096 \
  --buckets 0,8 --iters 10 2>&1 | grep -v Warn | tail -8
