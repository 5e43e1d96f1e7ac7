#!/usr/bin/env bash
# Compiles every kernel file with NVRTC for sm_90 and prints ptxas's resource report (registers,
# shared memory, spills) per kernel, without a GPU. Needs libnvrtc on the loader path, the CUDA
# headers in $CUDA_INCLUDE (`eval "$(bash scripts/kernel-check.sh env)"` sets both from pip wheels)
# and ptxas on PATH (for example from the nvidia-cuda-nvcc wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/kernel-ptx}
SPECTER_NO_NVCC=1 cargo run -q --example kernel_ptx -- "$out" sm_90
for ptx in "$out"/*.ptx; do
    ptxas -arch=sm_90 -v "$ptx" -o /dev/null 2>&1 | grep -E "Compiling entry|registers|spill" |
        sed -e "s/ptxas info *: //"
done
