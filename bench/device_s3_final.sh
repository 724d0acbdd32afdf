#!/usr/bin/env bash
# Session 3's closing device call: the GPU tests of every kernel and of the engine, the TP8-rank step bench
# (4k and 32k), the two draft top-k methods, the attention defaults at 32k/128k and the step's shapes, and the
# step at 4k with the shared expert on the main stream (A/B of the overlap).
# Usage (device): bash bench/device_s3_final.sh [tests-s] [step-s] [topk-s] [attention-s] [ab-s]
source bench/device_env.sh
mkdir -p "$OUT/step" "$OUT/step_no_overlap" "$OUT/attention" "$OUT/topk"
timeout "${1:-150}" python -m pytest -q -n 8 -rf --tb=short -p no:cacheprovider tests/test_glue_kernels.py \
  tests/test_graphs.py tests/test_kernel_swap.py tests/test_tree_ops.py tests/test_attention_kernel.py \
  tests/test_moe_kernel.py tests/test_engine.py \
  -k "(gpu or on_triton or not engine) and not sm120 and not sm90" >"$OUT/pytest_final.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_final.log" | tail -12
timeout "${2:-170}" python bench/bench_step.py --out "$OUT/step" --contexts 4096,32768 --buckets 0,8,32,64,128 \
  --long-buckets 0,32 --iters 10 2>&1 | grep -v Warn | tail -32
timeout "${3:-88}" python bench/bench_tree.py --out "$OUT/topk" --topk-methods 2>&1 | tail -34
timeout "${4:-80}" python bench/bench_attention.py --out "$OUT/attention" --defaults --workers 14 2>&1 \
  | grep -v Warn | tail -8
timeout "${5:-60}" python bench/bench_step.py --out "$OUT/step_no_overlap" --quick --no-overlap 2>&1 \
  | grep -v Warn | tail -6
rm -f "$OUT/step_no_overlap/step.md"  # its table is in the log; at most 8 files come back
