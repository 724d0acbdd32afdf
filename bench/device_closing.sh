#!/usr/bin/env bash
# A session's closing device call on one GPU: every GPU test of the kernels, model, drafter and engine (bf16 cases
# included; the CPU-only ahead-of-time compile checks are left to CI), the TP8-rank step bench at 4k and 32k, and
# the attention defaults at 32k/128k and the step's shapes. At most 8 files come back under $OUT.
# Usage (device): bash bench/device_closing.sh [tests-s] [step-s] [attention-s]
source bench/device_env.sh
mkdir -p "$OUT/step" "$OUT/attention"
timeout "${1:-200}" python -m pytest -q -n 8 -rf --tb=short -p no:cacheprovider tests \
  -k "not sm120 and not sm90 and not two_gloo and not torchrun" >"$OUT/gpu_tests.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -12
timeout "${2:-190}" python bench/bench_step.py --out "$OUT/step" --contexts 4096,32768 --buckets 0,8,32,64,128 \
  --long-buckets 0,32 --iters 10 2>&1 | grep -v Warn | tail -32
timeout "${3:-80}" python bench/bench_attention.py --out "$OUT/attention" --defaults --workers 14 2>&1 \
  | grep -v Warn | tail -8
