#!/bin/bash
# A same-call A/B of the verify step: GPU tests of the named test files, then `bench_step.py` at 4k run four times,
# interleaved, as the defaults and with FLAGS (base, flags, base2, flags2), each run's raw json to $OUT.
# Usage (device): bash bench/device_step_ab.sh "FLAGS" [BUCKETS] [TEST FILES...]
source bench/device_env.sh
FLAGS=$1; BUCKETS=${2:-0,8,32,128}; shift $(($# < 2 ? $# : 2))  # what is left: the test files
if [ $# -gt 0 ]; then
  python -m pytest -q -rf --tb=short -p no:cacheprovider "$@" >"$OUT/gpu_tests.log" 2>&1
  echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -8
fi
for run in base flags base2 flags2; do
  args=""; [[ $run == flags* ]] && args=$FLAGS
  # shellcheck disable=SC2086
  python bench/bench_step.py --out "/tmp/step_$run" --contexts 4096 --buckets "$BUCKETS" --iters 5 $args \
    >> "$OUT/step_ab.log" 2>&1 || { echo "$run failed"; tail -20 "$OUT/step_ab.log"; }
  cp "/tmp/step_$run/step.json" "$OUT/step_$run.json"
  python bench/step_summary.py "$OUT/step_$run.json" --match gemv,norm
done
