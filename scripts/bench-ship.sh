#!/usr/bin/env bash
# Benchmark of shipping: a DeepSeek-V2-Lite-shaped random-weight bundle is shipped (with and
# without FP16 byte shuffling) and unshipped; prints GB/s of bundle bytes and the compression
# ratio per section kind. Run from anywhere:
#
#   scripts/bench-ship.sh [LAYERS] [LEVEL]     # default 27 layers (the whole model), zstd level 3
#
# Needs about twice the bundle's size free under $BENCH_DIR (default target/bench-ship): the
# checkpoint and the bundle while converting, then the bundle or its rebuild and a shipped file.
# Everything there is removed at the end unless KEEP=1.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
layers="${1:-27}"
level="${2:-3}"
dir="${BENCH_DIR:-$ROOT/target/bench-ship}"
bin="$ROOT/target/release/specter-pack"

cargo build --release -p specter-pack
rm -rf "$dir"; mkdir -p "$dir"
cleanup() { [ "${KEEP:-0}" = 1 ] || rm -rf "$dir"; }
trap cleanup EXIT

echo "== machine: $(nproc) cores, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
df -h "$dir" | tail -1

now() { date +%s.%N; }
rate() { awk -v b="$1" -v s="$2" 'BEGIN { printf "%.1f s, %.3f GB/s", s, b / 1e9 / s }'; }

"$bin" synth --preset deepseek-v2-lite --layers "$layers" -o "$dir/hf"
"$bin" convert "$dir/hf" -o "$dir/model.specter"
rm -rf "$dir/hf"
bytes=$(stat -c %s "$dir/model.specter")
echo "bundle: $bytes bytes"

# At most two bundle-sized files exist at once: the rebuilt bundle is compared by sha256 with the
# original, which is removed before unshipping.
echo "== ship, no shuffle (for comparison; sections not re-verified)"
"$bin" ship "$dir/model.specter" -o "$dir/plain.specter.zst" --level "$level" --no-shuffle --no-verify
rm -f "$dir/plain.specter.zst"

echo "== ship, FP16 sections byte-shuffled (the default)"
t0=$(now)
"$bin" ship "$dir/model.specter" -o "$dir/model.specter.zst" --level "$level"
t1=$(now)
ship_s=$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')
original=$(sha256sum < "$dir/model.specter")
rm -f "$dir/model.specter"

echo "== unship"
t0=$(now)
"$bin" unship "$dir/model.specter.zst" -o "$dir/rebuilt.specter"
t1=$(now)
unship_s=$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')
[ "$(sha256sum < "$dir/rebuilt.specter")" = "$original" ] || { echo "rebuilt bundle differs" >&2; exit 1; }

shipped=$(stat -c %s "$dir/model.specter.zst")
echo "== summary ($layers layers, zstd level $level)"
echo "bundle $bytes bytes, shipped $shipped bytes, ratio $(awk -v a="$bytes" -v b="$shipped" 'BEGIN { printf "%.3f", a / b }')"
echo "ship (verify + compress + write, wall): $(rate "$bytes" "$ship_s")"
echo "unship (decompress + check + write + verify, wall): $(rate "$bytes" "$unship_s")"
echo "round trip byte-identical: yes"
