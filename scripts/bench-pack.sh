#!/usr/bin/env bash
# Benchmarks of the bundle tool chain on one machine: synth -> convert -> verify -> open, for a
# small and a DeepSeek-V2-Lite-shaped (multi-GB) checkpoint, plus the CPU reference's decode speed.
#
#   scripts/bench-pack.sh build            # here: release binaries into .carry/bench
#   bash scripts/bench-pack.sh run [LAYERS] # there: run from the repository root (default 27 layers)
#
# Work files go to $BENCH_DIR (default /dev/shm/specter-bench, a RAM disk where there is one);
# logs to $OUT when set. Prints a table last.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

build() {
    cd "$ROOT"
    cargo build --release -p specter-pack -p specter-run
    mkdir -p .carry/bench
    cp target/release/specter-pack target/release/specter-run .carry/bench/
    ls -l .carry/bench
}

median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

run() {
    cd "$ROOT"
    local layers="${1:-27}"
    local bin=.carry/bench dir="${BENCH_DIR:-/dev/shm/specter-bench}" out="${OUT:-$(mktemp -d)}"
    rm -rf "$dir"; mkdir -p "$dir" "$out"
    echo "== machine"; nproc; free -g | head -2; git rev-parse --short HEAD 2>/dev/null || true
    "$bin/specter-run" doctor --work-dir "$dir" | tee "$out/doctor.txt"

    echo "== small: fixture deepseek_v2 (committed, made by transformers)"
    "$bin/specter-pack" convert tests/fixtures/deepseek_v2 -o "$dir/small.specter" | tee "$out/small-convert.txt"
    for i in $(seq 9); do "$bin/specter-pack" inspect "$dir/small.specter" | awk '/opened in/ {print $3}'; done | median > "$dir/small-open"
    "$bin/specter-pack" verify "$dir/small.specter"

    echo "== large: deepseek-v2-lite preset, $layers layers, random weights"
    "$bin/specter-pack" synth --preset deepseek-v2-lite --layers "$layers" -o "$dir/hf" | tee "$out/synth.txt"
    local timer=""; [ -x /usr/bin/time ] && timer="/usr/bin/time -v"
    $timer "$bin/specter-pack" convert "$dir/hf" -o "$dir/large.specter" 2> "$out/convert-time.txt" | tee "$out/large-convert.txt"
    grep -E "Maximum resident|Elapsed" "$out/convert-time.txt" || true
    rm -rf "$dir/hf"   # the RAM disk holds one of the two at a time comfortably
    for i in $(seq 9); do "$bin/specter-pack" inspect "$dir/large.specter" | awk '/opened in/ {print $3}'; done | median > "$dir/large-open"
    for i in 1 2 3; do "$bin/specter-pack" verify "$dir/large.specter" | tee -a "$out/verify.txt"; done
    "$bin/specter-pack" inspect "$dir/large.specter" > "$out/large-inspect.txt"

    echo "== CPU reference decode (fixtures, target-only and speculative, 64 tokens)"
    : > "$out/cpu-decode.txt"
    for f in deepseek_v2 qwen2_moe phimoe mixtral olmoe qwen3_moe; do
        "$bin/specter-pack" convert "tests/fixtures/$f" -o "$dir/$f.specter" > /dev/null
        for mode in target specter; do
            "$bin/specter-run" generate "$dir/$f.specter" --prompt-ids 5,6,7,8,9,10,11,12 --max-new-tokens 64 \
                --mode "$mode" --depth 4 --ignore-eos --json \
                | python3 -c "import json,sys; d=json.load(sys.stdin); s=d['stats']; print('$f', '$mode', round(s['tpot_ms'],3), round(s['acceptance_rate'],3))" \
                | tee -a "$out/cpu-decode.txt"
        done
    done

    echo "== summary"
    echo "small bundle open (median of 9): $(cat "$dir/small-open") us"
    echo "large bundle open (median of 9): $(cat "$dir/large-open") us"
    grep -h "wrote" "$out/synth.txt" "$out/large-convert.txt"
    grep -h "ok," "$out/verify.txt"
    rm -rf "$dir"
}

case "${1:-}" in
    build) build ;;
    run) run "${2:-27}" ;;
    *) echo "usage: $0 build | run [LAYERS]" >&2; exit 2 ;;
esac
