#!/usr/bin/env bash
# Attention on the H200 (issues #6, #7): the GPU tests of tests/test_attention_kernel.py under xdist while the
# bench's kernel variants compile, then `bench_attention.py --defaults` (the committed defaults at 32k/128k and the
# verify step's shapes, 4k T 1-129 included). Everything comes back as one tarball, $OUT/attention.tar.
# Usage (device): bash bench/device_attention.sh [total-s]
source bench/device_env.sh
total=${1:-150}
R="$OUT/r"; mkdir -p "$R"
timeout 80 python -m pytest -x -q -n 8 -rf --tb=short -p no:cacheprovider --durations=5 -k "not sm120 and not sm90" \
  tests/test_attention_kernel.py >"$R/attention_gpu_tests.log" 2>&1 &
tests=$!
(cd bench && timeout 75 python -c "import bench_attention as ba; print('precompiled', ba.precompile(ba.HEADS, \
ba.TREE_SIZES, False, 8, prefill=False, table=ba.FOCUS))")
wait $tests; echo "pytest exit $? at ${SECONDS}s"; grep -E "^(FAILED|ERROR)|passed|failed" "$R/attention_gpu_tests.log" | tail -8
timeout $((total - SECONDS)) python bench/bench_attention.py --out "$R" --defaults --contexts 32768 131072 \
  --workers 12 2>&1 | tee "$R/attention_bench.log" | grep -v "^{\|^ceil\|[Ww]arn"
echo "bench exit $? at ${SECONDS}s"
tar -C "$R" -cf "$OUT/attention.tar" . && rm -rf "$R"
