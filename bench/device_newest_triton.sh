#!/bin/bash
# The stack on the newest Triton against the device's own (3.6), in one call: every GPU test under the newest, then
# `bench_step.py` at 4k once per RUN (with PROBE_MOE=CONFIGS set: `probe_moe_step.py`, the step's own MoE calls
# under those configs), in order, each run's raw json to $OUT. A RUN is `device` or `newest` (which
# Triton), optionally followed by `:NAME=VALUE` settings for that run alone (a run with settings compiles into a
# cache of its own, since an environment switch is not part of Triton's cache key; STEP_ARGS=--flag=value passes
# bench_step.py a flag). Runs stop being started once LIMIT seconds have passed. The newest Triton travels as a
# stripped bundle (bench/make_triton_bundle.sh: the wheel is 285 MB, over the device's 64 MiB transfer) and runs with
# the device's own ptxas.
# Usage (device): bash bench/device_newest_triton.sh BUNDLE BUCKETS TEST_SECONDS LIMIT RUN...
# (TEST_ARGS: pytest's options, -q by default; TEST_WORKERS: xdist processes, 8 by default; PROBES: python commands
# run under the newest Triton after the tests, `;`-separated, each with `--out $OUT`).
# Example: ... .whl/triton-3.9.0.tar.xz 0,8,32,128 200 470 device newest
source bench/device_env.sh
BUNDLE=$1; BUCKETS=$2; TEST_SECONDS=$3; LIMIT=$4; shift 4
NEW=/tmp/triton_new
mkdir -p "$NEW" && tar -xJf "$BUNDLE" -C "$NEW" || { echo "bundle did not unpack"; exit 1; }
PTXAS=$(command -v ptxas || ls /usr/local/cuda*/bin/ptxas 2>/dev/null | head -1)
newest() { PYTHONPATH="$NEW${PYTHONPATH:+:$PYTHONPATH}" TRITON_PTXAS_PATH=$PTXAS TRITON_PTXAS_BLACKWELL_PATH=$PTXAS \
  TRITON_DEFAULT_FP_FUSION=1 "$@"; }
device() { "$@"; }
export NEW PTXAS; export -f newest device
newest python -c "import triton; print('newest triton', triton.__version__, triton.__file__, 'ptxas', '$PTXAS')" ||
  exit 1

if [ "$TEST_SECONDS" -gt 0 ]; then
  newest timeout "$TEST_SECONDS" python -m pytest ${TEST_ARGS:--q} -n ${TEST_WORKERS:-8} -rf --tb=short -p no:cacheprovider tests \
    >"$OUT/gpu_tests_newest.log" 2>&1
  echo "pytest exit $? at ${SECONDS}s"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests_newest.log" | tail -12
fi
IFS=';' read -ra probes <<< "${PROBES:-}"
for probe in "${probes[@]}"; do
  newest timeout 300 python $probe --out "$OUT" >> "$OUT/probes.log" 2>&1; echo "probe exit $? at ${SECONDS}s: $probe"
done
i=0
for run in "$@"; do
  [ "$SECONDS" -lt "$LIMIT" ] || { echo "not started (${SECONDS}s): $run"; continue; }
  i=$((i + 1)); triton=${run%%:*}; settings=(); name="$i-$triton"
  if [[ $run == *:* ]]; then
    IFS=: read -ra settings <<< "${run#*:}"; name="$name-${settings[*]//[^A-Za-z0-9]/_}"
    settings+=("TRITON_CACHE_DIR=/tmp/triton_cache_$i")
  fi
  if [ -n "${PROBE_MOE:-}" ]; then
    env "${settings[@]}" bash -c "$triton python bench/probe_moe_step.py --out /tmp/moe_$i --budgets $BUCKETS \
      --configs $PROBE_MOE" >> "$OUT/moe_runs.log" 2>&1 || { echo "$name failed"; tail -20 "$OUT/moe_runs.log"; }
    cp "/tmp/moe_$i/moe_step.json" "$OUT/moe_step_$name.json" && python - "$OUT/moe_step_$name.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:  # us a layer, per config
    print(sys.argv[1].split("/")[-1], r["budget"], r["M"], r["us"])
PY
    continue
  fi
  env "${settings[@]}" bash -c "$triton python bench/bench_step.py --out /tmp/step_$i --contexts 4096 \
    --buckets $BUCKETS --iters 5 \$STEP_ARGS" >> "$OUT/step_runs.log" 2>&1 ||
    { echo "$name failed"; tail -20 "$OUT/step_runs.log"; continue; }
  cp "/tmp/step_$i/step.json" "$OUT/step_$name.json"
  python bench/step_summary.py "$OUT/step_$name.json" --tag "${SECONDS}s"
done
