#!/usr/bin/env bash
# The glue kernels' call: their GPU tests (bf16), then bench_glue.py (absorb_query tokens a program, the router's
# logits tiles at 1-129 rows). Results: $OUT/glue.{md,json}, $OUT/gpu_tests_glue.log.
# Usage (device): bash bench/device_glue.sh [tests-s] [bench-s]
source bench/device_env.sh
timeout "${1:-60}" python -m pytest -q -n 8 -p no:cacheprovider tests/test_glue_kernels.py -k "not sm120" \
  >"$OUT/gpu_tests_glue.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests_glue.log" | tail -6
timeout "${2:-90}" python bench/bench_glue.py --out "$OUT" 2>&1 | grep -v -i warn | tail -24
