#!/usr/bin/env bash
# Session 6's MoE device call (issue #5): the GPU tests of tests/test_moe_kernel.py, then TP8 timings of the
# entries beside the session-6 variants (moe_configs.VARIANTS): M = 1, 2, 4 with a small unrelated kernel before
# each call (as the model runs it; its time alone subtracted) against gate/up asking L2 for down's weights
# (pf_lines, pf_last, pf_bulk); the verify step's expert counts at M = 129, 65 (--routing step) and uniform
# routing at M = 64, 128, 256 against BM 16 blocks (bm16_pre, bm16_split, bm16_ahead). Logs and markdown under
# $OUT, the JSON in $OUT/moe_s6.tar. As run at 31179bd (H200 13:41 UTC, bench/results/moe_variants_h200_s6.md); the
# prefetch variants and bm16_pre were then removed, bm16_split / bm16_ahead became the entries from M = 65 on, so
# rerun it with names from moe_configs.VARIANTS.
# Usage (device): bash bench/moe_s6_device.sh [tests-s] [gap-s] [step-s] [uniform-s]
source bench/device_env.sh
timeout "${1:-40}" python -m pytest -q -n 8 -rf -p no:cacheprovider tests/test_moe_kernel.py -k gpu \
  >"$OUT/moe_gpu_tests.log" 2>&1
echo "pytest exit $? at ${SECONDS}s"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/moe_gpu_tests.log" | tail -8
run() {  # seconds, then bench_moe.py --variants arguments
  local s=$1; shift
  timeout "$s" python bench/bench_moe.py --out "$OUT/v" --variants --budget "$(( s - 3 ))" "$@" 2>&1 \
    | grep -v -i warn | grep "M=" ; echo "exit $? at ${SECONDS}s"
}
run "${2:-45}" --gap --ms 1,2,4,1 --names pf_lines,pf_last,pf_bulk --tag _gap
run "${3:-50}" --routing step --ms 129,65 --names bm16_pre,bm16_split,bm16_ahead --tag _step
run "${4:-35}" --ms 64,128,256 --names bm16_pre,bm16_split,bm16_ahead --tag _uniform
cat "$OUT"/v/*.md >"$OUT/moe_variants.md"; tar -C "$OUT/v" -cf "$OUT/moe_s6.tar" . && rm -rf "$OUT/v"
