#!/usr/bin/env bash
# The router's call: its GPU tests (bf16), then bench_glue.py's router rows at 1-129 rows (the default two launches
# and the logits kernel alone; extra arguments go to bench_glue.py, e.g. --tiles 16x256,32x256 to time logits tiles
# or --ops absorb_query,router). Results: $OUT/glue.{md,json}, $OUT/gpu_tests_glue.log.
# Usage (device): bash bench/device_glue.sh [tests-s] [bench-s] [bench_glue.py arguments]
source bench/device_env.sh
timeout "${1:-60}" python -m pytest -q -n 8 -p no:cacheprovider tests/test_glue_kernels.py -k "router" \
  >"$OUT/gpu_tests_glue.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests_glue.log" | tail -6
timeout "${2:-90}" python bench/bench_glue.py --out "$OUT" --ops router --tiles "" "${@:3}" 2>&1 | grep -v -i warn \
  | tail -24
