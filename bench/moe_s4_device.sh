#!/usr/bin/env bash
# Session 4's MoE device call (issue #5, M = 1): the decode path (two launches, sums zeroed again by the kernels)
# against the previous entry (k_swap8_pre) at M = 1, 4, 2, 8 (TP8, per-kernel times of both at M = 1), then the
# verdict table: the entries at every M at the TP8 and EP8 shapes beside the torch dequantise-then-matmul path and
# the bf16 grouped baseline, then the GPU-only tests of tests/test_moe_kernel.py (bf16 at the K2.6 shapes, the
# entries and variants replayed in CUDA graphs). At most 8 files come back under $OUT.
# Usage (device): bash bench/moe_s4_device.sh [variants-s] [verdict-s] [tests-s] [variant names]
# (the 08:40 UTC run, at 1f19e1a, named k_swap8_pre,decode_swap8,decode_swap8_dn4,decode_swap8_w2,decode_pdl_swap8;
# bench/results/moe_h200.md)
source bench/device_env.sh
timeout "${1:-60}" python bench/bench_moe.py --out "$OUT" --variants --budget "$(( ${1:-60} - 2 ))" \
  --ms 1,4,2,8 --names "${4:-k_swap8_pre}" \
  --breakdown k_swap8_pre,default 2>&1 | grep -v -i warn | tail -14
timeout "${2:-70}" python bench/bench_moe.py --out "$OUT" --no-sweep --no-tests \
  --sweep-budget "$(( ${2:-70} - 12 ))" 2>&1 | grep -v -i warn | tail -24
timeout "${3:-40}" python -m pytest -q -n 8 -rf -p no:cacheprovider tests/test_moe_kernel.py -k gpu \
  >"$OUT/moe_gpu_tests.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/moe_gpu_tests.log" | tail -8
