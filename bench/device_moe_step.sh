#!/usr/bin/env bash
# The step's own MoE calls (issue #7): GPU tests of the named test files, bench/probe_moe_step.py (each MoE layer's
# recorded call replayed under other configs), then a same-call A/B of the step at 4k between the defaults and
# bench_step.py flags. Results: $OUT/gpu_tests.log, $OUT/moe_step.json, $OUT/step_{base,ab}.json.
# Usage (device): bash bench/device_moe_step.sh TESTS-S "TEST FILES" PROBE-S "PROBE ARGS" AB-S "AB FLAGS" [BUCKETS]
source bench/device_env.sh
part() { [ "$1" -gt 0 ] && timeout "$@"; }
# shellcheck disable=SC2086
part "$1" python -m pytest -q -n 8 -rf --tb=short -p no:cacheprovider $2 -k "not sm120 and not sm90 and not \
two_gloo and not torchrun" >"$OUT/gpu_tests.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -8
# shellcheck disable=SC2086
(cd bench && part "$3" python probe_moe_step.py --out "$OUT" $4 2>&1 | grep -v -i warn | tail -12)
for tag in base ab; do
  flags=""; [ "$tag" = ab ] && flags=$6
  # shellcheck disable=SC2086
  part "$5" python bench/bench_step.py --out "$OUT/$tag" --contexts 4096 --buckets "${7:-8,32}" --iters 10 $flags \
    2>&1 | grep -E "^\{" | cut -c1-260
  [ -f "$OUT/$tag/step.json" ] && mv "$OUT/$tag/step.json" "$OUT/step_$tag.json"; rm -rf "${OUT:?}/$tag"
done
