#!/usr/bin/env bash
# The router's call: its GPU tests (bf16, the CUDA-graph replay of the one launch among them), then bench_glue.py's
# router rows (one launch against two at 1 and 9 rows, both launches and the logits kernel alone at 1-129 rows).
# Results: $OUT/glue.{md,json}, $OUT/gpu_tests_glue.log. `bench_glue.py` without --ops also times absorb_query.
# Usage (device): bash bench/device_glue.sh [tests-s] [bench-s]
source bench/device_env.sh
timeout "${1:-60}" python -m pytest -q -n 8 -p no:cacheprovider tests/test_glue_kernels.py -k "router" \
  >"$OUT/gpu_tests_glue.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests_glue.log" | tail -6
timeout "${2:-90}" python bench/bench_glue.py --out "$OUT" --ops router 2>&1 | grep -v -i warn | tail -24
