# Session 3's attention device call (issue #6): the round-2 sweep (lazy rescale, all split counts, bf16 partials,
# small and dv256 configs, programmatic dependent launch, the whole-wave split rule, the verify step's padded shapes),
# then the GPU attention tests. Usage (device): bash bench/device_attention_s3.sh [sweep-budget-s] [sweep-s] [tests-s]
source bench/device_env.sh
mkdir -p "$OUT/attention"
timeout "${2:-160}" python bench/bench_attention.py --out "$OUT/attention" --round2 --budget "${1:-125}" --workers 14 \
  >"$OUT/attention/sweep.log" 2>&1
echo "sweep exit $?"; grep -v -i warn "$OUT/attention/sweep.log" | grep -v "^{" | tail -40
timeout "${3:-60}" python -m pytest -q -n 14 -p no:cacheprovider -k "not sm120 and not sm90" \
  tests/test_attention_kernel.py >"$OUT/attention/tests.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/attention/tests.log" | tail -8
