#!/usr/bin/env bash
# One device call for issue 7: GPU tests of the model glue, graphs and engine, then the TP8-rank step bench.
# Usage (device): bash bench/device_step.sh [test-seconds] [bench-seconds] [bench_step.py args...]
source bench/device_env.sh
tests_s=${1:-150}; bench_s=${2:-200}; shift 2 || true
timeout "$tests_s" python -m pytest -q -p no:cacheprovider --durations=8 tests/test_glue_kernels.py \
  tests/test_graphs.py tests/test_engine.py tests/test_kernel_swap.py >"$OUT/pytest_step.log" 2>&1
echo "pytest exit $?"; tail -12 "$OUT/pytest_step.log"
timeout "$bench_s" python bench/bench_step.py --out "$OUT" "$@" 2>&1 | tee "$OUT/step.log" | grep -v Warn
