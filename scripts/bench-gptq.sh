#!/usr/bin/env bash
# Time GPTQ conversion (calibration forward on the CPU reference + per-expert GPTQ) of a
# DeepSeek-V2-Lite-shaped random-weight checkpoint, next to RTN on the same weights.
#
#   scripts/bench-pack.sh build               # here: release binaries into .carry/bench
#   bash scripts/bench-gptq.sh [LAYERS] [CALIB_TOKENS]   # there, from the repository root
#   (RTN=1 also times an RTN conversion first; GPTQ_ARGS adds convert flags, e.g.
#   "--min-rows-per-feature 0" to run GPTQ on every matrix whatever its calibration rows)
#
# The source checkpoint goes to $BENCH_DIR (default /dev/shm/specter-gptq), bundles to $OUT_DIR
# (default /tmp/specter-gptq, on disk: the CPU reference keeps an f32 copy of the model in RAM).
# Calibration text: the Python sources found on the machine (plain text, as users would pass).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
layers="${1:-27}" tokens="${2:-2048}"
bin=.carry/bench src="${BENCH_DIR:-/dev/shm/specter-gptq}" dst="${OUT_DIR:-/tmp/specter-gptq}" out="${OUT:-$(mktemp -d)}"
rm -rf "$src" "$dst"; mkdir -p "$src" "$dst" "$out"
timer=""; [ -x /usr/bin/time ] && timer="/usr/bin/time -v"

find / -xdev -name '*.py' -size +4k -path '*site-packages*' 2>/dev/null | sort | head -400 | xargs cat > "$dst/calib.txt" 2>/dev/null || true
echo "calibration text: $(wc -c < "$dst/calib.txt") bytes"
"$bin/specter-pack" synth --preset deepseek-v2-lite --layers "$layers" -o "$src/hf" | tee "$out/synth.txt"
if [ "${RTN:-0}" = 1 ]; then
    $timer "$bin/specter-pack" convert "$src/hf" -o "$dst/rtn.specter" --quant rtn 2> "$out/rtn-time.txt" | tee "$out/rtn.txt"
    rm -f "$dst/rtn.specter"
fi
$timer "$bin/specter-pack" convert "$src/hf" -o "$dst/gptq.specter" --quant gptq --calib "$dst/calib.txt" \
    --calib-tokens "$tokens" ${GPTQ_ARGS:-} 2> "$out/gptq-time.txt" | tee "$out/gptq.txt"
"$bin/specter-pack" inspect "$dst/gptq.specter" | head -12 | tee "$out/gptq-inspect.txt"
echo "== summary"
grep -hE "Elapsed|Maximum resident" "$out"/*-time.txt || true
grep -hE "^\[ *[0-9.]+s\]" "$out/gptq-time.txt" | tail -12 || true
rm -rf "$src" "$dst"
