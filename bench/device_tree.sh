# DDTree on the H200 (issue #3): bench_tree at budgets 8, 64, 512 (block 8) and 64 (block 16) with the host path
# beside, the config variants at budget 64 and the top-k per distribution (--sweep; Triton == torch checks; each
# kernel compiles once per shape), then the GPU tests of the tree ops under xdist (the sm_120 compile check runs on
# CPUs, not here). Usage (device): bash bench/device_tree.sh [bench-s] [tests-s]; results under $OUT.
source bench/device_env.sh
mkdir -p "$OUT/tree"
timeout "${1:-135}" python bench/bench_tree.py --out "$OUT/tree" --cases 8:8,64:8,512:8,64:16 --sweep 2>&1 \
  | tee "$OUT/tree_bench.log" | grep -v "^{\|^ {\|^normal\|^realistic\|^clustered\|^ties" | tail -60
echo "bench exit $? at ${SECONDS}s"
timeout "${2:-60}" python -m pytest -q -n 8 -rf --tb=short -p no:cacheprovider --durations=5 -k "not sm120" \
  tests/test_tree_ops.py tests/test_lossless_sampling.py >"$OUT/tree_gpu_tests.log" 2>&1
echo "pytest exit $? at ${SECONDS}s"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tree_gpu_tests.log" | tail -12
