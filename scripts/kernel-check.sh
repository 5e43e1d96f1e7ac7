#!/usr/bin/env bash
# Compiles every kernel file with NVRTC on a machine without a GPU or the CUDA toolkit, from
# NVIDIA's pip wheels (tests/requirements-kernels.txt), so a kernel edit is checked here before
# it reaches the GPU machine.
#
#   scripts/kernel-check.sh env             # installs the wheels; prints the exports that find them
#   scripts/kernel-check.sh test            # tests/kernels_compile.rs with NVRTC required (CI)
#
# scripts/kernel-report.sh (registers and spills per kernel) runs after `eval "$(bash
# scripts/kernel-check.sh env)"` with ptxas from the nvidia-cuda-nvcc wheel of the same version.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

# The directory of the CUDA 13 wheels (lib/ and include/), after installing them.
cuda_dir() {
    python3 -m pip install -q -r "$ROOT/tests/requirements-kernels.txt" >&2
    python3 - <<'PY'
import os, sys
import nvidia
for base in nvidia.__path__:
    d = os.path.join(base, "cu13")
    if os.path.exists(os.path.join(d, "lib", "libnvrtc.so.13")):
        print(d)
        sys.exit(0)
sys.exit("libnvrtc.so.13 not found under the nvidia wheels' directories: " + ", ".join(nvidia.__path__))
PY
}

case "${1:-}" in
    env)
        dir=$(cuda_dir)
        echo "export LD_LIBRARY_PATH=$dir/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
        echo "export CUDA_INCLUDE=$dir/include" ;;
    test)
        dir=$(cuda_dir)
        cd "$ROOT"
        LD_LIBRARY_PATH="$dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_INCLUDE="$dir/include" \
            SPECTER_REQUIRE_NVRTC=1 cargo test --test kernels_compile ;;
    *) echo "usage: $0 env | test" >&2; exit 2 ;;
esac
