#!/usr/bin/env bash
# A/B of the TP8-rank step in one device call: the GPU tests of the prefetch and the graphs, then
# bench_step.py once per variant (4k and 32k, budgets 0 and 32, 5 iterations), each under its own timeout.
# Usage (device): bash bench/device_step_ab.sh SECONDS "flags of variant 1" "flags of variant 2" ...
# Results: $OUT/ab.tar (one directory per variant, and the tests' log).
source bench/device_env.sh
R="$OUT/r"; mkdir -p "$R"
seconds=$1; shift
timeout 100 python -m pytest -q -n 8 -rf --tb=short -p no:cacheprovider tests/test_prefetch.py tests/test_graphs.py \
  -k "not sm120 and not sm90" >"$R/gpu_tests.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$R/gpu_tests.log" | tail -6
i=0
for flags in "$@"; do
  i=$((i + 1)); echo "== variant $i: $flags"
  # shellcheck disable=SC2086
  timeout "$seconds" python bench/bench_step.py --out "$R/v$i" --contexts 4096,32768 --buckets 0,32 --iters 5 \
    $flags 2>&1 | grep -E '^\{' | python -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r['context'], r['budget'], 'verify %.3f ms (%.2fx)' % (r['verify_graph_ms'], r['verify_graph_over_floor']),
          'step %.3f' % (r.get('step_ms') or r.get('ar_step_ms') or 0))"
done
tar -C "$R" -cf "$OUT/ab.tar" . && rm -rf "$R"
