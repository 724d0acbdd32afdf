#!/usr/bin/env bash
# One device call: bash bench/device.sh PART[:SECONDS] ...   (parts run in the order given, each bounded)
#   tests:360     every GPU test (12 xdist workers, the 25 slowest listed; the CPU-only compile checks and
#                 multi-process tests are CI's: TEST_FILTER overrides the -k expression). The suite takes about
#                 300 s on an H100 (bench/results/gpu_tests_h100.log). The server's tests need its wheels: a call
#                 that carries .whl/ (wheels of fastapi, uvicorn, openai and what they need, for the GPU
#                 image's Python) has them installed first
#   warm:90       each sweep case once in 8 processes, no timing: fills Triton's cache for the timed run
#   sweeps:210    the four sweeps (`pytest bench --benchmark-json`), rendered; or one alone: moe:90, attention:90,
#                 tree:60, dense:60
#   step:150      the step benchmark (python -m bench.bench_step $STEP_ARGS)
#   old:230       the benchmarks of the old tree in .old/ (aa1fe5d's bench_moe/attention/tree/linear/glue) on this GPU
#   old-step:150  the old tree's bench_step.py with the same $STEP_ARGS
#   old-step120:150  the same on the sm_120 proxy (beside step120 for an A/B of the two trees on that path)
#   tune:400      python -m bench.tune on $TUNE_ARCH (default sm_120: the proxy on a Hopper GPU), ops $TUNE_OPS
#                 (default all four, the seconds shared), resuming the package's tuned file for that arch
#                 (TUNE_FRESH=1: its buckets of those ops measured again); the result is results/tuned_<arch>.json
#                 in the tarball (copy it to triton_kernels/tuned/<arch>.json)
#   tests120:200  the GPU tests of the kernels, graphs and engine on the sm_120 proxy (SPEC_ARCH=sm_120)
#   step120:150   the step benchmark on the sm_120 proxy: results/step_sm120_proxy_<gpu>.json; both take the
#                 file of an earlier tune part in the same call, where there is one (else the shipped one)
#   compare       new against old, case by case (python -m bench.compare; also run last whenever both exist)
#   all           tests warm sweeps step
# Everything is written under $OUT/bench and comes back as $OUT/bench.tar.gz (logs; new/ and old/ raw JSON;
# results/ in bench/results' naming), with $OUT/summary.md (test outcome and the comparison) beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
R="$OUT/bench"
mkdir -p "$R/new" "$R/old" "$R/results"
TEST_FILTER=${TEST_FILTER:-"not sm120 and not sm90 and not two_gloo and not torchrun"}
STEP_ARGS=${STEP_ARGS:-"--contexts 4096 --buckets 0,8,16,32,64,128 --iters 10"}
python -m pip install --no-deps --no-build-isolation -e . >"$R/pip.log" 2>&1 || export PYTHONPATH="$PWD/src:$PWD"
if compgen -G ".whl/*.whl" >/dev/null; then  # the server's wheels (fastapi, uvicorn, openai: not in the GPU image)
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >>"$R/pip.log" 2>&1 &&
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$R/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$R/gpu.txt"
GPU=$(python -c "import torch; from bench.render import gpu_slug; print(gpu_slug(torch.cuda.get_device_name()))")

outcome() {  # NAME LOG EXIT: one line for the summary, the failures after it
  echo "$1: exit $3, $(grep -E "passed|failed|skipped|error" "$2" | tail -1)" | tee -a "$R/summary.md"
  grep -E "^(FAILED|ERROR)" "$2" | head -20 | tee -a "$R/summary.md"
}

tests() {
  timeout -s INT "$1" python -m pytest -q -n 12 -rf --tb=short --durations=25 -p no:cacheprovider tests \
    -k "$TEST_FILTER" >"$R/gpu_tests_$GPU.log" 2>&1
  outcome tests "$R/gpu_tests_$GPU.log" $?
  cp "$R/gpu_tests_$GPU.log" "$R/results/"
}

warm() {
  timeout "$1" python -m pytest -q -n 8 -p no:cacheprovider --benchmark-disable bench >"$R/warm.log" 2>&1
  outcome warm "$R/warm.log" $?
}

sweep() {  # NAME SECONDS FILES...: cases not started 30 s before the end are skipped, so the JSON is written
  local name=$1 s=$2; shift 2
  timeout "$s" python -m pytest -q -p no:cacheprovider --bench-seconds $((s > 60 ? s - 30 : s / 2)) "$@" \
    --benchmark-json "$R/new/$name.json" --benchmark-columns=median,rounds >"$R/$name.log" 2>&1
  outcome "$name" "$R/$name.log" $?
  [ -f "$R/new/$name.json" ] && python -m bench.render "$R/new/$name.json" --out "$R/results"
}

tune() {
  local key=${TUNE_ARCH:-sm_120} ops=${TUNE_OPS:-moe,linear,attention,tree}
  local n; n=$(tr ',' '\n' <<<"$ops" | wc -l)
  local out="$R/results/tuned_$key.json"
  [ -f "triton_kernels/tuned/$key.json" ] && cp "triton_kernels/tuned/$key.json" "$out"
  # shellcheck disable=SC2046
  SPEC_ARCH=$key timeout -s INT "$1" python -m bench.tune --ops "$ops" --budget-s $(($1 / n - 15)) --out "$out" \
    $([ "${TUNE_FRESH:-0}" = 1 ] && echo --fresh) >"$R/tune.log" 2>&1
  echo "tune: exit $?" | tee -a "$R/summary.md"
  tr '\r' '\n' <"$R/tune.log" | grep -a -E "^(op |moe |linear |attention |tree )" | tee -a "$R/summary.md"
}

step() {  # SECONDS [NAME]: NAME (default "step") names the run's folder, log and results file
  local name=${2:-step}
  # shellcheck disable=SC2086
  timeout "$1" python -m bench.bench_step --out "$R/new/$name" $STEP_ARGS >"$R/$name.log" 2>&1
  echo "$name: exit $?" | tee -a "$R/summary.md"
  for f in json md; do [ -f "$R/new/$name/step.$f" ] && cp "$R/new/$name/step.$f" "$R/results/${name}_$GPU.$f"; done
  tail -12 "$R/$name.log"
}

proxy() {  # COMMAND...: on the sm_120 proxy, with the tune part's file where this call made one
  local tuned="$R/results/tuned_sm_120.json"
  if [ -f "$tuned" ]; then SPEC_ARCH=sm_120 SPEC_KERNEL_CONFIGS="$tuned" "$@"; else SPEC_ARCH=sm_120 "$@"; fi
}

tests120() {
  local files="tests/test_moe_kernel.py tests/test_linear_kernel.py tests/test_attention_kernel.py
               tests/test_glue_kernels.py tests/test_tree_ops.py tests/test_graphs.py tests/test_engine.py"
  # shellcheck disable=SC2086
  proxy timeout -s INT "$1" python -m pytest -q -n 12 -rf --tb=short -p no:cacheprovider $files -k "$TEST_FILTER" \
    >"$R/gpu_tests_sm120_proxy_$GPU.log" 2>&1
  outcome tests120 "$R/gpu_tests_sm120_proxy_$GPU.log" $?
  cp "$R/gpu_tests_sm120_proxy_$GPU.log" "$R/results/"
}

old_tree() {  # SECONDS COMMAND...: a command of the old tree (.old/, its own imports first), bounded
  local s=$1; shift
  (cd .old && PYTHONPATH="$PWD/src:$PWD" timeout "$s" "$@")
}

old() {  # the shares of SECONDS: MoE 30%, attention 30%, tree 12%, dense projections 18%, glue 8%
  local s=$1 O="$R/old"
  has_old_tree || return
  {
    old_tree $((s * 16 / 100)) python bench/bench_moe.py --out "$O/moe" --variants --names none --gap \
      --budget $((s * 16 / 100 - 3)) --tag _uniform
    old_tree $((s * 8 / 100)) python bench/bench_moe.py --out "$O/moe" --variants --names none --gap --shape ep8 \
      --budget $((s * 8 / 100 - 3)) --tag _ep8
    old_tree $((s * 6 / 100)) python bench/bench_moe.py --out "$O/moe" --variants --names none --gap \
      --routing step --ms 9,33,65,129 --budget $((s * 6 / 100 - 3)) --tag _step
    old_tree $((s * 30 / 100)) python bench/bench_attention.py --out "$O/attention" --defaults \
      --contexts 32768 131072 --workers 14
    old_tree $((s * 12 / 100)) python bench/bench_tree.py --out "$O/tree" --cases 8:8,64:8,512:8,64:16
    old_tree $((s * 18 / 100)) python bench/bench_linear.py --out "$O/linear" --defaults --budget $((s * 12 / 100))
    old_tree $((s * 8 / 100)) python bench/bench_glue.py --out "$O/glue" --ops absorb_query,absorb_output,router \
      --tiles "" --output-tiles ""
  } >"$R/old.log" 2>&1
  echo "old: done, $(find "$O" -name '*.json' | wc -l) JSON files" | tee -a "$R/summary.md"
}

old_step() {  # SECONDS [NAME]: NAME (default "step") names the run's folder and log, as step's
  has_old_tree || return
  local name=${2:-step}
  # shellcheck disable=SC2086
  old_tree "$1" python bench/bench_step.py --out "$R/old/$name" $STEP_ARGS >"$R/old_$name.log" 2>&1
  echo "old-$name: exit $?" | tee -a "$R/summary.md"
}

compare() {
  python -m bench.compare "$R/old" "$R/new" >"$R/compare.md" 2>&1
  tee -a "$R/summary.md" <"$R/compare.md"
}

has_old_tree() {
  [ -d .old/bench ] && return
  echo "no .old/ tree: mkdir -p .old && git archive aa1fe5d src triton_kernels model spec bench | tar -x -C .old" \
    | tee -a "$R/summary.md"
  return 1
}

declare -A SECONDS_OF=([tests]=360 [warm]=90 [sweeps]=210 [moe]=90 [attention]=90 [tree]=60 [dense]=60
                       [step]=150 [old]=230 [old-step]=150 [tune]=400 [compare]=60 [tests120]=200
                       [step120]=150 [old-step120]=150)
[[ " $* " == *" all "* ]] && set -- tests warm sweeps step
for arg in "$@"; do
  if [ -z "${SECONDS_OF[${arg%%:*}]+x}" ]; then
    echo "error: unknown part '${arg%%:*}' (${!SECONDS_OF[*]} all)"
    exit 2
  fi
done
compared=0
for arg in "$@"; do
  part=${arg%%:*}; s=${arg#*:}; [ "$s" = "$arg" ] && s=${SECONDS_OF[$part]}
  echo "== $part (${s}s) at ${SECONDS}s" | tee -a "$R/summary.md"
  case $part in
    tests) tests "$s" ;;
    warm) warm "$s" ;;
    sweeps) sweep sweeps "$s" bench ;;
    moe|attention|tree|dense) sweep "$part" "$s" "bench/test_$part.py" ;;
    step) step "$s" ;;
    step120) proxy step "$s" step_sm120_proxy ;;
    tests120) tests120 "$s" ;;
    tune) tune "$s" ;;
    old) old "$s" ;;
    old-step) old_step "$s" ;;
    old-step120) proxy old_step "$s" step_sm120_proxy ;;
    compare) compare; compared=1 ;;
  esac
done
if [ $compared = 0 ] && [ -n "$(find "$R/old" -name '*.json')" ] && [ -n "$(find "$R/new" -name '*.json')" ]; then
  compare
fi
cp "$R/summary.md" "$OUT/summary.md"
tar -C "$OUT" -czf "$OUT/bench.tar.gz" bench && rm -rf "$R"
echo "done at ${SECONDS}s: $OUT/bench.tar.gz, $OUT/summary.md"
