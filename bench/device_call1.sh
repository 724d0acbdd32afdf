#!/usr/bin/env bash
# Session-2 first device call: the K2.6 TP8 step bench (graphs), ncu profiles of the MoE and attention kernels,
# the GPU test suite, and the MoE variants. Usage (device): bash bench/device_call1.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python -m pip install --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || export PYTHONPATH="$PWD/src:$PWD"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "== step"; timeout 170 python bench/bench_step.py --out "$OUT" --quick 2>&1 | tail -25
echo "== ncu"
timeout 45 ncu --clock-control none --set full -k regex:'_gate_up_kernel|_down_kernel' --launch-count 8 \
  python bench/profile_kernels.py --attn >"$OUT/ncu_moe.txt" 2>&1; echo "ncu moe $?"
timeout 45 ncu --clock-control none --set full -k regex:'_mla_split_kernel' --launch-count 4 \
  python bench/profile_kernels.py --moe-m >"$OUT/ncu_attn.txt" 2>&1; echo "ncu attn $?"
echo "== pytest"; timeout 190 python -m pytest -q tests -p no:cacheprovider --durations=10 >"$OUT/pytest_gpu.log" 2>&1
echo "pytest exit $?"; tail -15 "$OUT/pytest_gpu.log"
echo "== moe variants"; timeout 100 python bench/bench_moe.py --out "$OUT" --variants --budget 90 | tail -20
