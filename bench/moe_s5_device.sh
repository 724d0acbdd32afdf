#!/usr/bin/env bash
# Session 5's MoE device call (issue #5): the GPU tests of tests/test_moe_kernel.py (the device-split gate/up,
# eager and in CUDA graphs), then TP8 timings: the verify step's expert counts (--routing step) and uniform routing
# at every M, the entries beside `device_split`; M = 1, 2, 4 with a small unrelated kernel before each call (as the
# model runs it; its time alone subtracted), the entries; then the entries at the EP8 shape. (As run at 7e6ffb4 it
# also timed the one-launch decode path `fused` and `persistent_down`, since removed:
# bench/results/moe_variants_h200_s5.md.) At most 8 files come back under $OUT.
# Usage (device): bash bench/moe_s5_device.sh [tests-s] [step-s] [uniform-s] [gap-s] [ep8-s]
source bench/device_env.sh
timeout "${1:-40}" python -m pytest -q -n 8 -rf -p no:cacheprovider tests/test_moe_kernel.py -k gpu \
  >"$OUT/moe_gpu_tests.log" 2>&1
echo "pytest exit $? at ${SECONDS}s"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/moe_gpu_tests.log" | tail -8
run() {  # seconds, then bench_moe.py --variants arguments
  local s=$1; shift
  timeout "$s" python bench/bench_moe.py --out "$OUT/v" --variants --budget "$(( s - 3 ))" "$@" 2>&1 \
    | grep -v -i warn | grep "M=" ; echo "exit $? at ${SECONDS}s"
}
run "${2:-40}" --routing step --ms 9,33,65,129,16 --names device_split --tag _step
run "${3:-42}" --ms 8,32,64,128,256,512,1,2,4 --names device_split --tag _uniform
run "${4:-35}" --gap --ms 1,2,4,1 --names none --tag _gap
run "${5:-28}" --shape ep8 --names none --tag _ep8
cat "$OUT"/v/*.md >"$OUT/moe_variants.md"; mv "$OUT"/v/*.json "$OUT/"; rm -rf "$OUT/v"
