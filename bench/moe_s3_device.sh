# Session 3's MoE device call (issue #5 round 3): the round-3 variants beside the default over the TP8 sweep (per-kernel
# device times of three of them at M = 1, 16, 256), the default and `k_stack_pre` at the EP8 shape, then the GPU tests of
# tests/test_moe_kernel.py. Usage (device): bash bench/moe_s3_device.sh [tp8-budget-s] [ep8-s] [tests-s]
source bench/device_env.sh
timeout $(( ${1:-125} + ${2:-30} + 20 )) python bench/bench_moe.py --out "$OUT" --variants --budget "${1:-125}" --ms 1,16,256,4,64,512,8,128,2,32 \
  --ep8-seconds "${2:-30}" --ep8-names k_stack_pre --breakdown default,k_stack_pre,decode_pdl_k_stack_pre \
  --names ahead_dn4,k_ahead,k_pre_ahead,k_stack_pre,k_swap8_pre,pdl_k_stack_pre,decode_pdl_k_stack_pre \
  2>&1 | grep -v -i warn | tail -40
timeout "${3:-35}" python -m pytest -q -n 8 -p no:cacheprovider tests/test_moe_kernel.py >"$OUT/moe_gpu_tests.log" 2>&1
echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/moe_gpu_tests.log" | tail -8
