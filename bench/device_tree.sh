# DDTree on the H200 (issue #3): GPU tests of the tree ops (the sm_120 compile check runs on CPUs, not here), then
# the full bench_tree sweep (budgets 8..512, blocks 8 and 16, host path beside, config sweeps at block 8,
# Triton == torch checks in the JSON). Usage (device): bash bench/device_tree.sh [tests-s] [bench-s]; under $OUT.
source bench/device_env.sh
mkdir -p "$OUT/tree"
timeout "${1:-65}" python -m pytest -q -rf --tb=short -p no:cacheprovider --durations=5 -k "not sm120" \
  tests/test_tree_ops.py tests/test_lossless_sampling.py >"$OUT/tree_gpu_tests.log" 2>&1
echo "pytest exit $? at ${SECONDS}s"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tree_gpu_tests.log" | tail -12
timeout "${2:-160}" python bench/bench_tree.py --out "$OUT/tree" --sweep 2>&1 | grep -v "^{'budget'" | tail -40
echo "bench exit $? at ${SECONDS}s"
