# Sourced first by the device scripts: install the project (or fall back to the source tree on the path), strict
# mode, unbuffered Python, $OUT, and a line naming the GPU, driver, clocks and versions for the results files.
python -m pip install --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || export PYTHONPATH="$PWD/src:$PWD"
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
