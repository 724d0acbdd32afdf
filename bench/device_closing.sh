#!/usr/bin/env bash
# A session's closing device call on one GPU: the MoE's small-M entries beside a candidate variant, the DDTree step
# at budgets 8 and 64, the TP8-rank step bench at 4k and 32k, then every GPU test of the kernels, model, drafter and
# engine (bf16 cases included; the CPU-only ahead-of-time compile checks and the multi-process tests are left to
# CI and bench/device_x2.sh). At most 7 files come back under $OUT.
# Usage (device): bash bench/device_closing.sh [moe-s] [tree-s] [step-s] [tests-s] [moe variant names]
source bench/device_env.sh
mkdir -p "$OUT/moe" "$OUT/tree" "$OUT/step"
timeout "${1:-55}" python bench/bench_moe.py --out "$OUT/moe" --variants --budget "$(( ${1:-55} - 3 ))" \
  --ms 1,4,2,8 --names "${5:-k_swap8_pre}" --breakdown default 2>&1 | grep -v -i warn | tail -14
timeout "${2:-50}" python bench/bench_tree.py --out "$OUT/tree" --budgets 8,64 --blocks 8 2>&1 | grep -v -i warn \
  | tail -8
timeout "${3:-200}" python bench/bench_step.py --out "$OUT/step" --contexts 4096,32768 --buckets 0,8,32,64,128 \
  --long-buckets 0,32 --iters 10 2>&1 | grep -v Warn | tail -32
timeout "${4:-210}" python -m pytest -q -n 8 -rf --tb=short -p no:cacheprovider tests \
  -k "not sm120 and not sm90 and not two_gloo and not torchrun" >"$OUT/gpu_tests.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -12
