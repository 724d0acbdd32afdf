#!/usr/bin/env bash
# The MoE entries (issue #5) in under 60 s, for a closing device call: TP8, M = 1, 2, 4 with a small unrelated
# kernel before each call (as the model runs it), the entries alone; then M = 65, 129, 9, 33 with the verify step's
# expert counts (bench_moe.py --routing step), the entries and `device_split` (in the entries up to M = 128, so
# timed beside them at 129 only). Results under $OUT (moe_variants_tp8_{gap,step}.{md,json}).
# Usage (device): bash bench/moe_closing.sh
source bench/device_env.sh
for run in "22 --gap --ms 1,2,4 --names none --tag _gap" \
           "32 --routing step --ms 65,129,9,33 --names device_split --tag _step"; do  # seconds, then arguments
  # shellcheck disable=SC2086
  set -- $run; s=$1; shift
  timeout "$s" python bench/bench_moe.py --out "$OUT" --variants --budget "$(( s - 2 ))" "$@" 2>&1 | grep "M="
done
