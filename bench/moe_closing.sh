#!/usr/bin/env bash
# The MoE entries (issue #5) in under 60 s, for a closing device call: TP8, M = 1, 2, 4 with a small unrelated
# kernel before each call (as the model runs it), the entries alone; then M = 9, 33, 65 with the verify step's
# expert counts (bench_moe.py --routing step), the entries and `device_split` (the entry up to M = 33, so timed
# beside it at 65 only). Results under $OUT (moe_variants_tp8_{gap,step}.{md,json}).
# Usage (device): bash bench/moe_closing.sh
source bench/device_env.sh
for args in "--gap --ms 1,2,4 --names none --tag _gap" "--routing step --ms 9,33,65 --names device_split --tag _step"; do
  # shellcheck disable=SC2086
  timeout 27 python bench/bench_moe.py --out "$OUT" --variants --budget 25 $args 2>&1 | grep "M="
done
