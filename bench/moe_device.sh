#!/usr/bin/env bash
# A MoE device call (issue #5): the GPU tests of tests/test_moe_kernel.py (skipped with tests-s 0), then
# `bench_moe.py --variants` runs, each given as one argument "SECONDS ARGS...". The runs' markdown is concatenated
# into $OUT/moe_variants.md, their JSON comes back in $OUT/moe.tar (a few files, under the device's file limit).
# Usage (device): bash bench/moe_device.sh TESTS-S "SECONDS ARGS..." ...
# e.g. session 5's call: bash bench/moe_device.sh 45 "40 --routing step --ms 9,33,65,129,16 --names device_split
#   --tag _step" "42 --ms 8,32,64,128,256,512,1,2,4 --names device_split --tag _uniform" "35 --gap --ms 1,2,4,1
#   --names none --tag _gap" "28 --shape ep8 --names none --tag _ep8"
source bench/device_env.sh
tests_s=$1; shift
if [ "$tests_s" -gt 0 ]; then
  timeout "$tests_s" python -m pytest -q -n 8 -rf -p no:cacheprovider tests/test_moe_kernel.py -k gpu \
    >"$OUT/moe_gpu_tests.log" 2>&1
  echo "pytest exit $? at ${SECONDS}s"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/moe_gpu_tests.log" | tail -8
fi
for run in "$@"; do
  # shellcheck disable=SC2086
  set -- $run; s=$1; shift
  timeout "$s" python bench/bench_moe.py --out "$OUT/v" --variants --budget "$(( s - 3 ))" "$@" 2>&1 \
    | grep -v -i warn | grep "M=" ; echo "exit $? at ${SECONDS}s"
done
cat "$OUT"/v/*.md >"$OUT/moe_variants.md"; tar -C "$OUT/v" -cf "$OUT/moe.tar" . && rm -rf "$OUT/v"
