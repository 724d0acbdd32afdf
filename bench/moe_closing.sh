#!/usr/bin/env bash
# The MoE entries (issue #5) in under 60 s, for a closing device call: TP8, M = 1, 2, 4 with a small unrelated
# kernel before each call (as the model runs it), the entries alone; then M = 65, 129, 9, 33 with the verify step's
# expert counts (bench_moe.py --routing step), the entries and `device_split` (in the entries up to M = 33, so
# timed beside them at 65 and 129). Results as bench/moe_device.sh leaves them.
# Usage (device): bash bench/moe_closing.sh
exec bash bench/moe_device.sh 0 "22 --gap --ms 1,2,4 --names none --tag _gap" \
  "32 --routing step --ms 65,129,9,33 --names device_split --tag _step"
