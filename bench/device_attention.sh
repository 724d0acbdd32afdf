#!/usr/bin/env bash
# Attention on the H200 (issue #6): the GPU tests of tests/test_attention_kernel.py under xdist while the bench's
# kernel variants compile, then `bench_attention.py --defaults --step --tma` (the committed defaults at 32k/128k
# and the step shapes; split counts and the other tile load path at the 4k step shapes, and at 32k), then
# the warp-specialisation probe (bench/probe_ws_attention.py). Usage (device): bash bench/device_attention.sh
# [total-s]; results under $OUT.
source bench/device_env.sh
total=${1:-210}
timeout 120 python -m pytest -q -n 6 -rf --tb=short -p no:cacheprovider --durations=5 -k "not sm120 and not sm90" \
  tests/test_attention_kernel.py >"$OUT/attention_gpu_tests.log" 2>&1 &
tests=$!
(cd bench && timeout 110 python -c "import bench_attention as ba; print('precompiled', ba.precompile(ba.HEADS, \
ba.TREE_SIZES, False, 10, prefill=False, table=ba.FOCUS, extra=ba.step_jobs(132)))")
wait $tests; echo "pytest exit $? at ${SECONDS}s"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/attention_gpu_tests.log" | tail -8
timeout $((total - 40 - SECONDS)) python bench/bench_attention.py --out "$OUT" --defaults --step --tma --workers 12 2>&1 \
  | tee "$OUT/attention_bench.log" | grep -v "^{\|^step\|^ceil"
echo "bench exit $? at ${SECONDS}s"
timeout $((total - SECONDS)) python bench/probe_ws_attention.py --out "$OUT" 2>&1 | tee "$OUT/ws_probe.log"
echo "probe exit $? at ${SECONDS}s"
