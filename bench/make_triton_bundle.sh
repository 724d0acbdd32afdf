#!/bin/bash
# Build .whl/triton-VERSION.tar.xz: Triton's wheel for the device's Python (3.12) without what a CUDA compile on
# sm_90 does not load (the AMD backend's libraries, CUPTI, the profiler and ptxas: the device has its own) and
# with libtriton.so's symbols stripped (500 MB -> 192 MB), so that it fits the device's 64 MiB transfer (about
# 46 MB). Runs here, on the CPU machine (about 3 minutes on 2 cores).
# Usage: bash bench/make_triton_bundle.sh [VERSION]   (then: run with carry [".whl"])
set -euo pipefail
VERSION=${1:-3.9.0}
REPO=$PWD
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$WORK/wheel" "triton==$VERSION"
python3 -m zipfile -e "$WORK"/wheel/triton-*.whl "$WORK/tree"
cd "$WORK/tree/triton"
rm -rf backends/amd/lib backends/amd/include backends/nvidia/lib/cupti* backends/nvidia/bin/ptxas* _C/libproton.so \
  plugins/libTritonPluginsTestLib.so ../triton-*.dist-info/RECORD
strip --strip-unneeded _C/libtriton.so
chmod +x backends/nvidia/bin/*  # zipfile drops the modes: nvdisasm and cuobjdump would not run
cd "$WORK/tree"
mkdir -p "$REPO/.whl"
tar -cf - triton triton-*.dist-info | xz -9 -T0 > "$REPO/.whl/triton-$VERSION.tar.xz"
ls -la "$REPO/.whl/triton-$VERSION.tar.xz"
