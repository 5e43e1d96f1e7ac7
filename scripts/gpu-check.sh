#!/usr/bin/env bash
# Checks the CUDA backend on a GPU machine that has no Rust toolchain.
#
#   scripts/gpu-check.sh build [DEST]
#       (here) build the release doctor example and the CUDA test binaries and copy them, with
#       this script, into DEST (default: .carry/gpu, a folder git ignores). DEST must lie inside
#       the checkout that the device calls send; pass that checkout's .carry/gpu if it is not
#       this one.
#   bash .carry/gpu/gpu-check.sh device
#       (on the GPU machine, from the repository root) run what `build` copied.
#
# The device side is started with the `run` tool, carrying the folder:
#
#   run(command="bash .carry/gpu/gpu-check.sh device", carry=[".carry/gpu"], timeout_s=240)
#
# It prints the doctor report and the test results, and writes doctor.txt, doctor.json and
# tests.txt under $OUT when that is set.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "$0")" && pwd)"

build() {
    cd "$SCRIPT_DIR/.."
    local CARRY="${1:-}"; CARRY="${CARRY:-.carry/gpu}"
    cargo build --release --example doctor
    mkdir -p "$CARRY"
    cp scripts/gpu-check.sh "$CARRY/gpu-check.sh"
    cp target/release/examples/doctor "$CARRY/doctor"
    # Test executables carry a hash in their names; take the paths cargo reports.
    cargo test --release --test cuda_device --test cuda_doctor --no-run --message-format=json \
        | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        msg = json.loads(line)
    except ValueError:
        continue
    if msg.get("reason") == "compiler-artifact" and msg.get("executable") and msg["target"]["kind"] == ["test"]:
        print(msg["target"]["name"], msg["executable"])
' | while read -r name exe; do
        cp "$exe" "$CARRY/$name"
    done
    ls -l "$CARRY"
    du -sh "$CARRY"
}

device() {
    # The binaries lie beside the copy of this script that `build` made.
    local CARRY="$SCRIPT_DIR"
    local out="${OUT:-$(mktemp -d)}"
    [ -x "$CARRY/doctor" ] || { echo "missing $CARRY/doctor: run 'scripts/gpu-check.sh build' here first and carry its folder" >&2; exit 2; }
    echo "== nvidia-smi"
    nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv || true
    local status=0
    echo "== doctor"
    "$CARRY/doctor" 2>&1 | tee "$out/doctor.txt" || status=1
    echo "== doctor --json (second run: kernels now come from the PTX cache)"
    "$CARRY/doctor" --json > "$out/doctor.json" || status=1
    echo "== tests"
    : > "$out/tests.txt"
    for t in cuda_device cuda_doctor; do
        [ -x "$CARRY/$t" ] || { echo "missing $CARRY/$t" | tee -a "$out/tests.txt"; status=1; continue; }
        # The source-file comparison needs the tree at the path it was built in; it ran there.
        "$CARRY/$t" --test-threads=1 --skip embedded_kernels_match_their_sources 2>&1 | tee -a "$out/tests.txt" || status=1
    done
    exit "$status"
}

case "${1:-}" in
    build) build "${2:-}" ;;
    device) device ;;
    *) echo "usage: $0 build|device" >&2; exit 2 ;;
esac
