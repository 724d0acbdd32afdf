#!/usr/bin/env bash
# A session's closing device call on one GPU: each kernel's re-measure (MoE entries, DDTree step at budgets 8 and
# 64, attention defaults at 32k/128k and the 4k step shapes), the TP8-rank step bench at 4k and 32k, then every GPU
# test of the kernels, model, drafter and engine (the CPU-only ahead-of-time compile checks and the multi-process
# tests are left to CI and bench/device_x2.sh). Everything comes back as one tarball, $OUT/closing.tar.
# Then, with ab-s > 0, an A/B of the step in the same call: `bench_step.py --quick` with and without ab-flags.
# Usage (device): bash bench/device_closing.sh [moe-s] [tree-s] [attention-s] [step-s] [tests-s] [ab-s] [ab-flags]
# (0 skips a part)
source bench/device_env.sh
R="$OUT/r"; mkdir -p "$R/moe" "$R/tree" "$R/attn" "$R/step"
part() { [ "$1" -gt 0 ] && timeout "$@"; }
OUT="$R/moe" part "${1:-60}" bash bench/moe_closing.sh
part "${2:-50}" python bench/bench_tree.py --out "$R/tree" --cases 8:8,64:8 2>&1 | grep -v -i warn | tail -6
part "${3:-70}" python bench/bench_attention.py --out "$R/attn" --defaults --contexts 32768 131072 --workers 14 \
  2>&1 | grep -v -i warn | tail -4
part "${4:-230}" python bench/bench_step.py --out "$R/step" --contexts 4096,32768 --buckets 0,8,16,32,64,128 \
  --long-buckets 0,32 --iters 10 2>&1 | grep -v Warn | tail -12
part "${5:-210}" python -m pytest -q -n 8 -rf --tb=short -p no:cacheprovider tests \
  -k "not sm120 and not sm90 and not two_gloo and not torchrun" >"$R/gpu_tests.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$R/gpu_tests.log" | tail -12
for flags in "" "${7:---no-pdl}"; do
  # shellcheck disable=SC2086
  part "${6:-0}" python bench/bench_step.py --out "$R/ab${flags// /}" --quick $flags 2>&1 | grep -E "^\{" \
    | cut -c1-220
done
tar -C "$R" -cf "$OUT/closing.tar" . && rm -rf "$R"
