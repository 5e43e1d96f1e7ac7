#!/usr/bin/env bash
# The GPU checks and benchmarks, built here and run on a CUDA machine in one call.
#
#   scripts/gpu-check.sh build                 # here: release binaries and GPU test binaries into .carry/gpu
#   bash scripts/gpu-check.sh run [WHAT...]    # there, from the repository root
#
# WHAT (default: device ops fixtures bench):
#   device    device opening, kernel loading, pinned and registered copies, doctor (tests/cuda_device.rs,
#             tests/cuda_doctor.rs)
#   ops       every CUDA op against the CPU reference on random inputs (tests/cuda_ops.rs)
#   int4      the INT4 draft expert kernels against the CPU reference (tests/cuda_moe_int4.rs)
#   fixtures  every fixture model: GPU greedy tokens equal the CPU's, in every residency
#   lossless  every fixture model: speculative decoding on the GPU equals target-only
#   bench     a DeepSeek-V2-Lite-shaped random model (27 layers; $LAYERS to change): target-only
#             TPOT all resident, and offloaded with 16 of 64 experts per layer (lru, ondemand)
#   w4a16     the INT4 kernel's bandwidth (examples/bench_w4a16.rs)
#   kprofile  per-kernel GPU time of all-resident decode steps (Nsight Compute) on the bench model
#   cases     on the bench model: the paper's ds_high and ds_low cases through `specter-run bench`
#             ($MODES, default lru,ondemand,specter,auto; $PROMPTS prompts, default 2), and the
#             lossless check on 10 prompts (specter against target-only, all resident)
#   trained   trains a DeepSeek-V2-Lite-width MoE (scripts/train_routed_moe.py, $TRAIN_MINUTES),
#             converts it and runs both cases on it, with text prompts
#
# bench: $ONLY (a regular expression) picks variants by name, $REPEATS sets the repeats (3).
# Work files go to $BENCH_DIR (default /dev/shm/specter-gpu); logs to $OUT when set.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CARRY=.carry/gpu

build() {
    cd "$ROOT"
    cargo build --release -p specter-pack -p specter-run
    mkdir -p "$CARRY"
    cp target/release/specter-pack target/release/specter-run "$CARRY/"
    local tests=(cuda_device cuda_doctor cuda_ops cuda_fixtures)
    [ -f tests/cuda_moe_int4.rs ] && tests+=(cuda_moe_int4)
    local args=()
    for t in "${tests[@]}"; do args+=(--test "$t"); done
    cargo test --release --no-run "${args[@]}" --message-format=json 2>/dev/null |
        python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        shutil.copy(m["executable"], sys.argv[1] + "/test-" + m["target"]["name"])
' "$CARRY"
    if [ -f examples/bench_w4a16.rs ]; then
        cargo build --release --example bench_w4a16
        cp target/release/examples/bench_w4a16 "$CARRY/"
    fi
    strip "$CARRY"/* 2>/dev/null || true
    ls -l "$CARRY"
}

run_test() {
    local name=$1 log=$2
    shift 2
    SPECTER_ROOT="$ROOT" "$CARRY/test-$name" --ignored --nocapture --test-threads 1 "$@" 2>&1 | tee "$log"
}

# The DeepSeek-V2-Lite-shaped random model ($LAYERS layers) as $dir/dsv2.specter, made once.
# With KEEP_HF=1 the Hugging Face checkpoint stays in $dir/hf (for the transformers peer).
bench_model() {
    local dir=$1 out=$2 layers=${LAYERS:-27}
    local pack="$CARRY/specter-pack"
    if [ ! -f "$dir/dsv2.specter" ]; then
        "$pack" synth --preset deepseek-v2-lite --layers "$layers" -o "$dir/hf" > "$out/synth.txt"
        "$pack" convert "$dir/hf" -o "$dir/dsv2.specter" > "$out/convert.txt"
        [ "${KEEP_HF:-0}" = 1 ] || rm -rf "$dir/hf"
    fi
}

bench() {
    local dir=$1 out=$2 layers=${LAYERS:-27}
    local run="$CARRY/specter-run"
    bench_model "$dir" "$out"
    local prompt=5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20
    local common=(generate "$dir/dsv2.specter" --prompt-ids "$prompt" --max-new-tokens 128 --ignore-eos --json --backend cuda)
    : > "$out/bench.tsv"
    local variants=(
        "resident|--mode target"
        "lru16|--mode target --resident-experts 16 --policy lru"
        "ondemand16|--mode target --resident-experts 16 --policy ondemand"
        "specter-resident-k4|--mode specter --depth 4"
        "ds_high-specter-k16|--mode specter --depth 16 --resident-experts 16 --policy lru"
        "ds_high-specter-k4|--mode specter --depth 4 --resident-experts 16 --policy lru"
        "lru32-matched-high|--mode target --resident-experts 32 --policy lru"
        "ds_low-specter-k16|--mode specter --depth 16 --resident-experts 4 --policy lru"
        "ds_low-specter-k4|--mode specter --depth 4 --resident-experts 4 --policy lru"
        "lru4|--mode target --resident-experts 4 --policy lru"
        "ondemand4|--mode target --resident-experts 4 --policy ondemand"
        "lru20-matched-low|--mode target --resident-experts 20 --policy lru"
        ${BENCH_VARIANTS:-}
    )
    for v in "${variants[@]}"; do
        local name=${v%%|*} args=${v#*|}
        [[ "$name" =~ ${ONLY:-.} ]] || continue
        for rep in $(seq "${REPEATS:-3}"); do
            # shellcheck disable=SC2086
            "$run" "${common[@]}" $args > "$out/gen-$name-$rep.json"
            python3 - "$out/gen-$name-$rep.json" "$name" "$rep" >> "$out/bench.tsv" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1])); s = d["stats"]; g = d["gpu"]; o = g.get("offload") or {}
print("\t".join(str(x) for x in [sys.argv[2], sys.argv[3], round(s["tpot_ms"], 3), round(s["ttft_ms"], 1),
      round(o.get("hit_rate", 1.0), 3), round(o.get("copy_gbps", 0.0), 1), round(g["vram_peak_bytes"] / 1e9, 2),
      round(s["acceptance_rate"], 3), round(o.get("prefetch_precision", 0.0), 3),
      round(o.get("prefetch_recall", 0.0), 3), round(o.get("prefetch_copy_seconds", 0.0), 3),
      round(o.get("copy_seconds", 0.0), 3), ",".join(map(str, d["tokens"][:6])), ",".join(map(str, d["tokens"][-3:]))]))
EOF
        done
    done
    echo "== DeepSeek-V2-Lite shape, $layers layers, 128 tokens"
    echo "variant rep tpot_ms ttft_ms hit_rate copy_GB/s vram_peak_GB acceptance pf_precision pf_recall pf_copy_s copy_s first_tokens last_tokens"
    cat "$out/bench.tsv"
}

# Per-kernel durations of all-resident decode steps under Nsight Compute (it serialises launches,
# so only the per-kernel split means anything there), and the host issue/wait split without it.
# Steps are counted by embedding launches (one per forward pass).
kprofile() {
    local dir=$1 out=$2
    local run="$CARRY/specter-run"
    bench_model "$dir" "$out"
    local gen=(generate "$dir/dsv2.specter" --prompt-ids 5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20
        --ignore-eos --json --backend cuda --mode target)
    "$run" "${gen[@]}" --max-new-tokens 64 > "$out/kprofile-gen.json"
    python3 "$ROOT/scripts/kprofile.py" gen "$out/kprofile-gen.json"
    ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-skip "${KSKIP:-3000}" \
        --launch-count "${KCOUNT:-3000}" "$run" "${gen[@]}" --max-new-tokens 40 \
        > "$out/ncu.csv" 2> "$out/ncu.err" || { tail -5 "$out/ncu.err"; return 1; }
    python3 "$ROOT/scripts/kprofile.py" ncu "$out/ncu.csv"
}

# `specter-run bench` for ds_high and ds_low on one bundle; JSON, markdown and SVG to $out.
bench_cases() {
    local bundle=$1 out=$2 tag=$3
    shift 3
    local run="$CARRY/specter-run"
    for c in ds_high ds_low; do
        "$run" bench "$bundle" --case "$c" --modes "${MODES:-lru,ondemand,specter,auto}" "$@" \
            --repeats 1 --json "$out/$tag-$c.json" --markdown "$out/$tag-$c.md" \
            --plot "$out/$tag-$c.svg" 2> "$out/$tag-$c.err" || { tail -3 "$out/$tag-$c.err"; return 1; }
        cat "$out/$tag-$c.md"
    done
}

cases() {
    local dir=$1 out=$2
    local run="$CARRY/specter-run"
    bench_model "$dir" "$out"
    echo "== lossless: specter (depth 16) against target-only, all resident, 10 prompts"
    "$run" bench "$dir/dsv2.specter" --case custom --depth 16 --resident-experts 64 \
        --matched-experts 64 --modes resident,specter --num-prompts 10 --repeats 1 \
        --json "$out/lossless10.json" 2> "$out/lossless10.err" | tail -4
    bench_cases "$dir/dsv2.specter" "$out" random --num-prompts "${PROMPTS:-2}"
}

trained() {
    local dir=$1 out=$2
    local pack="$CARRY/specter-pack"
    if [ ! -f "$dir/routed.specter" ]; then
        python3 "$ROOT/scripts/train_routed_moe.py" --out "$dir/routed" \
            --minutes "${TRAIN_MINUTES:-4.5}" > "$out/train.log" 2>&1 || { tail -5 "$out/train.log"; return 1; }
        tail -25 "$out/train.log"
        cp "$dir/routed/train_report.json" "$out/" 2>/dev/null || true
        "$pack" convert "$dir/routed" -o "$dir/routed.specter" > "$out/convert-routed.txt"
    fi
    # Prompts: the first lines of standard-library modules (Python source, as the training text;
    # the training corpus is the installed packages' sources, not the standard library).
    python3 - "$out/prompts.txt" <<'PY'
import json, os, sys, sysconfig
stdlib = sysconfig.get_paths()["stdlib"]
lines = []
for name in ["json/decoder.py", "csv.py", "argparse.py", "textwrap.py", "heapq.py", "fractions.py"]:
    with open(os.path.join(stdlib, name)) as f:
        text = " ".join(l.strip() for l in f.read().splitlines()[20:60] if l.strip())
    lines.append(text[:400])
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
PY
    bench_cases "$dir/routed.specter" "$out" trained --prompts "$out/prompts.txt"
}

run() {
    cd "$ROOT"
    local dir="${BENCH_DIR:-/dev/shm/specter-gpu}" out="${OUT:-$(mktemp -d)}"
    mkdir -p "$dir" "$out"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    local what=("$@")
    [ ${#what[@]} -eq 0 ] && what=(device ops fixtures bench)
    local status=0
    for w in "${what[@]}"; do
        echo "== $w"
        case "$w" in
            device)
                for t in cuda_device cuda_doctor; do
                    SPECTER_ROOT="$ROOT" "$CARRY/test-$t" --nocapture --test-threads 1 2>&1 | tee "$out/$t.log" || status=1
                done ;;
            ops) run_test cuda_ops "$out/ops.log" || status=1 ;;
            int4) SPECTER_ROOT="$ROOT" "$CARRY/test-cuda_moe_int4" --nocapture --test-threads 1 2>&1 | tee "$out/int4.log" || status=1 ;;
            fixtures) run_test cuda_fixtures "$out/fixtures.log" gpu_target_tokens || status=1 ;;
            lossless) run_test cuda_fixtures "$out/lossless.log" gpu_speculative || status=1 ;;
            errors) run_test cuda_fixtures "$out/errors.log" impossible_residency || status=1 ;;
            bench) bench "$dir" "$out" || status=1 ;;
            w4a16) "$CARRY/bench_w4a16" 2>&1 | tee "$out/w4a16.log" || status=1 ;;
            kprofile) kprofile "$dir" "$out" 2>&1 | tee "$out/kprofile.log" || status=1 ;;
            cases) cases "$dir" "$out" 2>&1 | tee "$out/cases.log" || status=1 ;;
            trained) trained "$dir" "$out" 2>&1 | tee "$out/trained.log" || status=1 ;;
            *) echo "unknown check $w" >&2; status=2 ;;
        esac
    done
    grep -h "rel err\|test result\|panicked" "$out"/*.log 2>/dev/null | sort | uniq -c | sort -rn | head -5 || true
    return $status
}

case "${1:-}" in
    build) build ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 build | run [ops|int4|fixtures|lossless|errors|bench|w4a16]..." >&2; exit 2 ;;
esac
