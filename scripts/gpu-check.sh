#!/usr/bin/env bash
# The GPU checks and benchmarks, built here and run on a CUDA machine in one call.
#
#   scripts/gpu-check.sh build                 # here: release binaries and GPU test binaries into .carry/gpu
#   bash scripts/gpu-check.sh run [WHAT...]    # there, from the repository root
#
# WHAT (default: device ops fixtures bench):
#   device    device opening, kernel loading, pinned and registered copies, doctor (tests/cuda_device.rs,
#             specter-run/tests/cuda_doctor.rs)
#   ops       every CUDA op against the CPU reference on random inputs, one test per op family
#             (tests/cuda_ops.rs, tests/cuda_ops_fused.rs)
#   int4      the quantized expert kernels against the CPU reference: INT4 (tests/cuda_moe_int4.rs),
#             and the row layout at 8, 4, 3 and 2 bits with its weight read rate
#             (tests/cuda_moe_rows.rs)
#   fixtures  every fixture model: GPU greedy tokens equal the CPU's, in every residency; the same
#             logits with the shared experts fused into the routed launches as without; and every
#             load I/O method gives the per-tensor upload's weights (tests/cuda_load.rs)
#   lossless  every fixture model: speculative decoding on the GPU equals target-only, and greedy
#             passes chained on the device give the CPU's choices
#   placement every fixture and a 3-layer model of DeepSeek-V2-Lite's widths: the target's logits
#             at every position bitwise equal, and the greedy tokens equal, across residencies,
#             policies, the host path, pinned staging, modes and every same-bits switch
#             (tests/cuda_placement.rs)
#   bench     a DeepSeek-V2-Lite-shaped random model (27 layers; $LAYERS to change): target-only
#             TPOT all resident, and offloaded with 16 of 64 experts per layer (lru, ondemand)
#   compare   old against new binaries ($OLD_CARRY): TPOT all resident and lru16 on the bench model
#             ($CMP_VARIANTS: "name|generate args" items separated by ';' instead)
#   precision FP16, INT8 and INT4 targets of the bench model: target-only TPOT all resident, with
#             1 expert slot and at two VRAM budgets, peak VRAM and host RSS, tokens unchanged by residency
#             (see precision() below)
#   residency target-only greedy tokens equal to all-resident's at every residency, lru, ondemand,
#             the host path, pinned staging (see residency() below)
#   hostexp   the host expert kernel: same bits as the GPU kernel, and its bandwidth against the
#             host's read bandwidth (tests/cuda_host_experts.rs, examples/bench_host_experts.rs)
#   hybrid    on the bench model: target-only TPOT copying every miss (lru) against the host path
#             (--host-experts auto), both after the expert sections' registration
#             (--wait-registration), at $SLOTS resident experts (default 1,16,32), with $HYBRID_ARGS
#             added to both (e.g. "--link-gbps 25") and $HOST_ARGS to the host path's runs (e.g.
#             "--host-threads 8"); tokens must agree; with $OLD_CARRY the earlier binaries' host
#             path too, $REPEATS rounds taking turns; $HYBRID_BUSY processes spinning at nice 19
#             meanwhile make the host a busy one
#   w4a16     the INT4 kernel's bandwidth (examples/bench_w4a16.rs)
#   stream    how fast chains of dependent one-row matrix products in the decode step's shapes
#             stream their weights, per design (examples/bench_stream.rs)
#   pace      link pacing: copies held to 25 GB/s measure 25 GB/s and change no token
#             (tests/cuda_pace.rs)
#   peer      transformers on the bench model's checkpoint: eager in VRAM and accelerate offload
#   autoprofile  `specter-run profile` (depths and plain decoding without the draft) at 16
#             resident experts, then `generate --auto-depth --profile` using it
#   kprofile  per-kernel GPU time of all-resident decode steps on the bench model: Nsight Systems
#             (kernel time and the gaps between kernels per step) and Nsight Compute (time and
#             DRAM bytes per kernel); KMODE=draft for the draft's steps
#   wprofile  per-kernel GPU time and DRAM bytes of a verification window of $WROWS rows (17 by
#             default), all resident, on the bench model: Nsight Compute over bench_step
#             --windows-only (launches serialised: each kernel's time alone, its bandwidth)
#   steps     the target's and the draft's one-row steps and 17- and 4-row verification windows
#             (examples/bench_step.rs), and 128-token TPOT of --mode target and draft, all resident,
#             with the target run's host time and device wait per token;
#             with $OLD_CARRY, old and new binaries taking turns; with $NEW_ENV (variables for
#             the new binaries, runs separated by ';', e.g. "SPECTER_LOAD_THREADS=4;A=0 B=0";
#             a value may hold spaces: "NAME=a b c"),
#             also the new binaries under each (newenv0, newenv1, ...); with $BUILDS (directories
#             of other builds' specter-run and bench_step, separated by spaces), those too (build0,
#             build1, ...)
#   peersteps the decode step's comparison in one call: llama.cpp all on the GPU against Specter
#             all resident (scripts/peer-llamacpp.sh with PEER_ROWS=gpu, from $PEER_DIR, a folder
#             its `pack` made; its bundle kept in $PEER_DISK, default /var/tmp/specter-peer), then
#             `steps` on that bundle ($OLD_CARRY, $NEW_ENV, $REPEATS as there): about 8 minutes,
#             most of it llama.cpp's build
#   incost    what kernels cost inside a recorded step: the one-row target and draft steps with
#             each set of launches left out (bench_step --skip-launches; a measurement, the
#             outputs are meaningless) against none left out, $REPEATS runs (default 2); sets in
#             $INCOST_SETS separated by ';' (default: attention, MLA's latent step, kv_b and
#             cache append (one launch for one row), the MoE combine, add + RMSNorm with the
#             router's product, add + RMSNorm with attention's q/kv_a products, the MoE down)
#   cases     on the bench model: the paper's ds_high and ds_low cases through `specter-run bench`
#             ($MODES, default lru,ondemand,specter,auto; $PROMPTS prompts, default 2), and the
#             lossless check on 10 prompts (specter against target-only, all resident; LOSSLESS=0
#             skips it); $CASE_ARGS go to both benches (e.g. "--link-gbps 25 --host-threads 8"),
#             $CASE_TAG names their files (random)
#   trained   trains a DeepSeek-V2-Lite-width MoE (scripts/train_routed_moe.py, $TRAIN_MINUTES),
#             converts it and runs both cases on it, with text prompts
#   ttft      time to first token from process start, page cache warm and cold, all resident and
#             with 16 resident experts (lru), beside transformers' from_pretrained + first token on
#             the same checkpoint (scripts/peer_ttft.py); also the load I/O methods compared
#
# bench: $ONLY (a regular expression) picks variants by name, $REPEATS sets the repeats (3).
# Work files go to $BENCH_DIR (default /dev/shm/specter-gpu); logs to $OUT when set.
# ttft: work files go to $TTFT_DIR (default .ttft in the repository; on disk, not tmpfs, for the
# cold runs); $TTFT_REPEATS (3) warm repeats; TTFT_SKIP_COLD=1 / TTFT_SKIP_PEER=1 skip parts.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CARRY=${CARRY:-.carry/gpu}

build() {
    cd "$ROOT"
    # $BUILD_FEATURES (e.g. specter/prompt-tensor-cores): cargo features of the release binaries.
    cargo build --release -p specter-pack -p specter-run ${BUILD_FEATURES:+--features "$BUILD_FEATURES"}
    mkdir -p "$CARRY"
    cp target/release/specter-pack target/release/specter-run "$CARRY/"
    # By name across the workspace: most are the root crate's (tests/), cuda_doctor specter-run's.
    local tests=(cuda_device cuda_doctor cuda_ops cuda_ops_fused cuda_fixtures cuda_placement cuda_load cuda_host_experts cuda_pace)
    [ -f tests/cuda_moe_int4.rs ] && tests+=(cuda_moe_int4)
    [ -f tests/cuda_moe_rows.rs ] && tests+=(cuda_moe_rows)
    local args=()
    for t in "${tests[@]}"; do args+=(--test "$t"); done
    # The `measure` feature: cuda_ops_fused checks which launches the fused ops make by leaving
    # them out; `prompt-tensor-cores`: prompt passes' products on tensor cores, checked by
    # cuda_ops and cuda_placement (the production binaries above are built without either).
    cargo test --release --no-run --workspace --features specter/measure,specter/prompt-tensor-cores "${args[@]}" --message-format=json 2>/dev/null |
        python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        shutil.copy(m["executable"], sys.argv[1] + "/test-" + m["target"]["name"])
' "$CARRY"
    cargo build --release --features measure --example bench_host_experts --example bench_step
    cp target/release/examples/bench_host_experts target/release/examples/bench_step "$CARRY/"
    if [ -f examples/bench_w4a16.rs ]; then
        cargo build --release --example bench_w4a16
        cp target/release/examples/bench_w4a16 "$CARRY/"
    fi
    cargo build --release --example bench_stream
    cp target/release/examples/bench_stream "$CARRY/"
    strip "$CARRY"/* 2>/dev/null || true
    ls -l "$CARRY"
}

# The GPU tests of tests/NAME.rs or a crate's CRATE/tests/NAME.rs (ignored elsewhere:
# tests/common/gpu.rs), filtered by ARGS.
run_test() {
    local name=$1 log=$2
    shift 2
    SPECTER_ROOT="$ROOT" "$CARRY/test-$name" --ignored --nocapture --test-threads 1 "$@" 2>&1 | tee "$log"
}

# The DeepSeek-V2-Lite-shaped random model ($LAYERS layers) as $dir/dsv2.specter, made once.
# With KEEP_HF=1 the Hugging Face checkpoint stays in ${HF_DIR:-$dir/hf} (for the transformers
# peer; HF_DIR on disk keeps it out of /dev/shm, which the bundle and the peer's offload share).
bench_model() {
    local dir=$1 out=$2 layers=${LAYERS:-27} hf=${HF_DIR:-$1/hf}
    local pack="${PACK:-$CARRY/specter-pack}"
    if [ ! -f "$dir/dsv2.specter" ]; then
        "$pack" synth --preset deepseek-v2-lite --layers "$layers" -o "$hf" > "$out/synth.txt"
        "$pack" convert "$hf" -o "$dir/dsv2.specter" > "$out/convert.txt"
        [ "${KEEP_HF:-0}" = 1 ] || rm -rf "$hf"
    fi
}

# `specter-run profile` at 16 resident experts (with the plain candidate: no draft, its memory as
# slots), then `generate --auto-depth --profile` using it. PROFILE_BUNDLE: another bundle.
autoprofile() {
    local dir=$1 out=$2
    local run="$CARRY/specter-run" bundle=${PROFILE_BUNDLE:-$1/dsv2.specter}
    [ -n "${PROFILE_BUNDLE:-}" ] || bench_model "$dir" "$out"
    "$run" profile "$bundle" --backend cuda --resident-experts "${PROFILE_RESIDENT:-16}" \
        --depths 0,4,16 --new-tokens 32 --repeats 1 -o "$out/profile.json" 2> "$out/profile.err" ||
        { tail -3 "$out/profile.err"; return 1; }
    "$run" generate "$bundle" --backend cuda --resident-experts "${PROFILE_RESIDENT:-16}" \
        --mode specter --depth 16 --auto-depth --profile "$out/profile.json" \
        --prompt-ids 5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20 --max-new-tokens 128 --ignore-eos \
        --json > "$out/autoprofile-gen.json" 2> "$out/autoprofile-gen.err" ||
        { tail -3 "$out/autoprofile-gen.err"; return 1; }
    python3 - "$out/autoprofile-gen.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print("generate --auto-depth --profile:", d["gpu"]["residency"], "| mode", d["mode"], "| auto_plain",
      d.get("auto_plain"), "| auto_depth", (d.get("auto_depth") or {}).get("chosen"),
      "| tpot_ms", round(d["stats"]["tpot_ms"], 3))
EOF
}

# Hugging Face transformers decoding the checkpoint the bundle was converted from (KEEP_HF=1
# bench_model): eager with every weight in VRAM, and accelerate's CPU offload with the GPU
# budget PEER_BUDGET_GIB (default: Specter's peak VRAM in the ds_high case, 17.4 GB = 16.2 GiB).
peer() {
    local dir=$1 out=$2 hf=${HF_DIR:-$1/hf}
    # synth's default seed and these shapes give the weights bench_model's bundle holds.
    [ -f "$hf/config.json" ] || "$CARRY/specter-pack" synth --preset deepseek-v2-lite \
        --layers "${LAYERS:-27}" -o "$hf" > "$out/synth-peer.txt"
    python3 "$ROOT/scripts/peer_transformers.py" "$hf" --repeats "${PEER_REPEATS:-3}" \
        --offload-budget-gib "${PEER_BUDGET_GIB:-16.2}" --offload-tokens "${PEER_OFFLOAD_TOKENS:-8}" \
        --json "$out/peer.json" 2> "$out/peer.err" || { tail -5 "$out/peer.err"; return 1; }
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

# Per-kernel durations of all-resident decode steps. Nsight Systems, when there, traces the
# recorded passes node by node as they really run: per kernel its launches and time per step,
# and the step's idle gaps between kernels. Nsight Compute serialises launches (only the split
# means anything there) and adds each kernel's DRAM bytes, so its achieved bandwidth. Steps are
# counted by embedding launches (one per forward pass; Nsight Compute's table takes the whole
# steps between the window's first and last one). KMODE=draft profiles the draft's steps.
kprofile() {
    local dir=$1 out=$2
    local run="$CARRY/specter-run"
    bench_model "$dir" "$out"
    local gen=(generate "$dir/dsv2.specter" --prompt-ids 5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20
        --ignore-eos --json --backend cuda --mode "${KMODE:-target}")
    "$run" "${gen[@]}" --max-new-tokens 64 > "$out/kprofile-gen.json"
    python3 "$ROOT/scripts/kprofile.py" gen "$out/kprofile-gen.json"
    local nsys
    nsys=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1 || true)
    if [ -n "$nsys" ]; then
        "$nsys" profile --trace=cuda --cuda-graph-trace=node --force-overwrite true -o "$out/nsys" \
            "$run" "${gen[@]}" --max-new-tokens 40 > "$out/nsys-gen.json" 2> "$out/nsys.err" ||
            { tail -5 "$out/nsys.err"; return 1; }
        "$nsys" stats --force-export true --report cuda_gpu_trace --format csv -o "$out/nsys" \
            "$out/nsys.nsys-rep" > /dev/null 2>> "$out/nsys.err" || { tail -5 "$out/nsys.err"; return 1; }
        python3 "$ROOT/scripts/kprofile.py" nsys "$out/nsys_cuda_gpu_trace.csv"
        rm -f "$out/nsys.nsys-rep" "$out/nsys.sqlite"
    else
        echo "no nsys: no gap figures"
    fi
    [ -n "${KSKIP_NCU:-}" ] && return 0
    ncu --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv \
        --launch-skip "${KSKIP:-3000}" --launch-count "${KCOUNT:-3000}" "$run" "${gen[@]}" --max-new-tokens 40 \
        > "$out/ncu.csv" 2> "$out/ncu.err" || { tail -5 "$out/ncu.err"; return 1; }
    python3 "$ROOT/scripts/kprofile.py" ncu "$out/ncu.csv"
}

# Per-kernel time and DRAM bytes of a recorded verification window ($WROWS rows): two windows
# after the prefill, the window's first run, its capture and one replay (KSKIP, KCOUNT launches).
wprofile() {
    local dir=$1 out=$2 rows=${WROWS:-17}
    bench_model "$dir" "$out"
    ncu --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv \
        --launch-skip "${KSKIP:-1392}" --launch-count "${KCOUNT:-696}" \
        "$CARRY/bench_step" "$dir/dsv2.specter" --windows-only --window "$rows" --steps 4 \
        > "$out/wncu-$rows.csv" 2> "$out/wncu-$rows.err" || { tail -5 "$out/wncu-$rows.err"; return 1; }
    echo "== verification window of $rows rows"
    python3 "$ROOT/scripts/kprofile.py" ncu "$out/wncu-$rows.csv"
}

# Step times: the target's one-row step, the draft's, and verification windows of 17 and 4 rows
# (examples/bench_step.rs), then 128-token TPOT of --mode target and --mode draft, all resident,
# for the binaries in $CARRY (new) and, when $OLD_CARRY is set, the earlier ones (old) taking
# turns, $REPEATS rounds.
# The assignments of one $NEW_ENV variant into VARIANT_ENV: each word that starts NAME= begins
# one, and a word that does not continues the value before it, so a value may hold spaces
# (NAME=a b c).
variant_env() {
    VARIANT_ENV=()
    local w
    set -f
    for w in $1; do
        if [[ $w =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || [ ${#VARIANT_ENV[@]} -eq 0 ]; then
            VARIANT_ENV+=("$w")
        else
            VARIANT_ENV[-1]+=" $w"
        fi
    done
    set +f
}

steps() {
    local dir=$1 out=$2
    PACK="${OLD_CARRY:-$CARRY}/specter-pack" bench_model "$dir" "$out"
    local prompt=5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20 sides=(new)
    [ -n "${OLD_CARRY:-}" ] && sides=(old new)
    local variants=()
    [ -n "${NEW_ENV:-}" ] && IFS=';' read -ra variants <<< "$NEW_ENV"
    for i in "${!variants[@]}"; do sides+=("newenv$i"); done
    local builds=()
    read -ra builds <<< "${BUILDS:-}"
    for i in "${!builds[@]}"; do sides+=("build$i"); done
    : > "$out/steps.tsv"
    for rep in $(seq "${REPEATS:-3}"); do
        for side in "${sides[@]}"; do
            local bin="$CARRY" envs=()
            [ "$side" = old ] && bin="$OLD_CARRY"
            [[ "$side" == newenv* ]] && variant_env "${variants[${side#newenv}]}" && envs=("${VARIANT_ENV[@]}")
            [[ "$side" == build* ]] && bin="${builds[${side#build}]}"
            env "${envs[@]}" "$bin/bench_step" "$dir/dsv2.specter" --window 17 --window 4 \
                --json "$out/step-$side-$rep.json" \
                > /dev/null 2> "$out/step-$side-$rep.err" || { tail -3 "$out/step-$side-$rep.err"; return 1; }
            for mode in target draft specter; do
                env "${envs[@]}" "$bin/specter-run" generate "$dir/dsv2.specter" --prompt-ids "$prompt" \
                    --max-new-tokens 128 --depth "${STEPS_DEPTH:-4}" \
                    --ignore-eos --json --backend cuda --mode "$mode" > "$out/gen-$side-$mode-$rep.json"
            done
            python3 - "$out" "$side" "$rep" >> "$out/steps.tsv" <<'EOF'
import json, sys
out, side, rep = sys.argv[1:4]
s = json.load(open(f"{out}/step-{side}-{rep}.json"))
t = json.load(open(f"{out}/gen-{side}-target-{rep}.json"))
d = json.load(open(f"{out}/gen-{side}-draft-{rep}.json"))
p = json.load(open(f"{out}/gen-{side}-specter-{rep}.json"))
# Chained greedy steps (bench_step; nan for builds whose bench_step has none).
chain = lambda k: round(s.get(k, float("nan")), 4)
# The target run's host timing per synchronisation (one a token): host time between waits
# (the logits' copy, sampling, the next step's issue) and the wait for the device.
h = t["gpu"]["host_timing"]
per = lambda k: round(h[k] / max(h["synchronisations"], 1) * 1e3, 4)
print("\t".join(str(x) for x in [side, rep, round(s["target_step_ms"], 4), round(s["draft_step_ms"], 4),
      round(s["verify_17_rows_ms"], 4), round(s["verify_4_rows_ms"], 4), round(t["stats"]["tpot_ms"], 4),
      round(d["stats"]["tpot_ms"], 4), ",".join(map(str, t["tokens"][:4])) + ".." + ",".join(map(str, t["tokens"][-3:])),
      ",".join(map(str, d["tokens"][-3:])), per("issue_seconds"), per("wait_seconds"),
      chain("target_chain_step_ms"), chain("draft_chain_step_ms"), round(p["stats"]["tpot_ms"], 4),
      round(p["stats"]["acceptance_rate"], 3), "same" if p["tokens"] == t["tokens"] else "DIFFER"]))
EOF
        done
    done
    echo "== all resident, ${LAYERS:-27} layers (ms; tpot over 128 tokens)"
    echo "side rep target_step draft_step verify17 verify4 tpot_target tpot_draft target_tokens draft_last host_ms device_wait_ms target_chain draft_chain tpot_specter acceptance specter_tokens"
    cat "$out/steps.tsv"
    steps_medians "$out/steps.tsv"
}

# The medians per side of a steps.tsv, and whether every round of every side gave the same
# tokens.
steps_medians() {
    python3 - "$1" <<'EOF'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
names = ["target_step", "draft_step", "verify17", "verify4", "tpot_target", "tpot_draft"]
# Columns 10 and 11 (host time and device wait per token of the target run), and 12-15 (chained
# steps, --mode specter's TPOT and acceptance), where recorded.
cols = list(range(2, 8)) + ([10, 11] if all(len(r) >= 12 for r in rows) else [])
cols += [12, 13, 14, 15] if all(len(r) >= 17 for r in rows) else []
names += ["host/token", "wait/token", "chain_tgt", "chain_draft", "tpot_spec", "accept"][: len(cols) - len(names)]
print("== medians (ms)")
print("side".ljust(10) + "".join(n.rjust(13) for n in names) + "  rounds")
for side in dict.fromkeys(r[0] for r in rows):
    mine = [r for r in rows if r[0] == side]
    meds = [statistics.median(float(r[c]) for r in mine) for c in cols]
    print(side.ljust(10) + "".join(f"{m:13.3f}" for m in meds) + f"  {len(mine)}")
same = len({r[8] for r in rows}) == 1 and len({r[9] for r in rows}) == 1
same = same and all(r[16] == "same" for r in rows if len(r) >= 17)
print("tokens: " + ("the same in every round of every side (specter's equal target's)" if same else "DIFFER between rounds or sides"))
EOF
}

# The step time each set of launches adds inside a recorded pass (see incost above).
incost() {
    local dir=$1 out=$2 sets=()
    bench_model "$dir" "$out"
    IFS=';' read -ra sets <<< "${INCOST_SETS:-attention;mla_kv_append;moe combine;add_rms_norm_linear@8;add_rms_norm_linear@456;moe down}"
    sets=("" "${sets[@]}")
    : > "$out/incost.tsv"
    for rep in $(seq "${REPEATS:-2}"); do
        for i in "${!sets[@]}"; do
            local skip=()
            [ -n "${sets[$i]}" ] && skip=(--skip-launches "${sets[$i]}")
            "$CARRY/bench_step" "$dir/dsv2.specter" --window 4 "${skip[@]}" --json "$out/incost-$i-$rep.json" \
                > /dev/null 2> "$out/incost-$i-$rep.err" || { tail -3 "$out/incost-$i-$rep.err"; return 1; }
            printf '%s\t%s\t%s\n' "$i" "$rep" "${sets[$i]:-(none)}" >> "$out/incost.tsv"
        done
    done
    python3 - "$out" <<'EOF'
import json, statistics, sys
out = sys.argv[1]
rows = [l.rstrip("\n").split("\t") for l in open(f"{out}/incost.tsv") if l.strip()]
by = {}
for i, rep, name in rows:
    s = json.load(open(f"{out}/incost-{i}-{rep}.json"))
    by.setdefault((int(i), name), []).append((s["target_step_ms"], s["draft_step_ms"]))
base = by[min(by)]
bt, bd = (statistics.mean(v[k] for v in base) for k in (0, 1))
print("== what each set of launches adds to a one-row step (ms; mean of runs)")
print("left out".ljust(40) + "target step".rjust(12) + "saved".rjust(9) + "draft step".rjust(12) + "saved".rjust(9))
for (i, name), v in sorted(by.items()):
    t, d = (statistics.mean(x[k] for x in v) for k in (0, 1))
    print(name.ljust(40) + f"{t:12.3f}{bt - t:9.3f}{d:12.3f}{bd - d:9.3f}")
EOF
}

# llama.cpp all on the GPU, then the steps on the bundle the peer run converted (the same
# synthesized model as bench_model's: deepseek-v2-lite, 27 layers, seed 0), all in one call.
peersteps() {
    local dir=$1 out=$2 peer=${PEER_DIR:?set PEER_DIR to a folder made by peer-llamacpp.sh pack}
    local disk=${PEER_DISK:-/var/tmp/specter-peer}
    PEER_ROWS=gpu PEER_KEEP=1 PEER_DISK="$disk" PEER_TIME_S="${PEER_TIME_S:-470}" OUT="$out/peer" \
        bash "$peer/peer-llamacpp.sh" run deepseek-v2-lite > "$out/peer.log" 2>&1 ||
        { tail -20 "$out/peer.log"; return 1; }
    grep -v '^\[ *[0-9.]*s\] layer' "$out/peer.log" | tail -25
    # The GGUF (31 GB of tmpfs) is not needed by the steps.
    rm -f "${PEER_WORK:-/dev/shm/specter-peer}/model.gguf"
    [ -f "$disk/model.specter" ] || { echo "peersteps: no bundle at $disk/model.specter"; return 1; }
    mkdir -p "$dir"
    rm -f "$dir/dsv2.specter"
    ln -s "$disk/model.specter" "$dir/dsv2.specter"
    LAYERS=27 steps "$dir" "$out"
}

# Old against new: target-only TPOT all resident and with 16 resident experts (lru) on the bench
# model, the binaries in $OLD_CARRY (an earlier commit's release build) and in $CARRY taking
# turns, $REPEATS rounds; the bundle is made by the old specter-pack, so the new one reads it too.
compare() {
    local dir=$1 out=$2 old=${OLD_CARRY:?set OLD_CARRY to the earlier binaries}
    PACK="$old/specter-pack" bench_model "$dir" "$out"
    local prompt=5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20
    : > "$out/compare.tsv"
    for rep in $(seq "${REPEATS:-3}"); do
        for side in old new; do
            local bin="$CARRY/specter-run"
            [ "$side" = old ] && bin="$old/specter-run"
            local variants=("resident|" "lru16|--resident-experts 16 --policy lru")
            [ -n "${CMP_VARIANTS:-}" ] && IFS=';' read -r -a variants <<< "$CMP_VARIANTS"
            for v in "${variants[@]}"; do
                local name=${v%%|*} args=${v#*|}
                # shellcheck disable=SC2086
                "$bin" generate "$dir/dsv2.specter" --prompt-ids "$prompt" --max-new-tokens 128 \
                    --ignore-eos --json --backend cuda --mode target $args > "$out/cmp-$side-$name-$rep.json"
                python3 - "$out/cmp-$side-$name-$rep.json" "$side" "$name" >> "$out/compare.tsv" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print("\t".join([sys.argv[2], sys.argv[3], str(d["stats"]["tpot_ms"]), ",".join(map(str, d["tokens"]))]))
EOF
            done
        done
    done
    python3 - "$out/compare.tsv" <<'EOF'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
print("| variant | old TPOT ms (median; runs) | new TPOT ms (median; runs) | new/old | tokens equal |")
print("|---|---|---|---|---|")
for name in dict.fromkeys(r[1] for r in rows):
    t = {s: [float(r[2]) for r in rows if r[0] == s and r[1] == name] for s in ("old", "new")}
    toks = {r[3] for r in rows if r[1] == name}
    mo, mn = statistics.median(t["old"]), statistics.median(t["new"])
    fmt = lambda v: ", ".join(f"{x:.3f}" for x in v)
    print(f"| {name} | {mo:.3f} ({fmt(t['old'])}) | {mn:.3f} ({fmt(t['new'])}) | {mn / mo:.3f} | {len(toks) == 1} |")
EOF
}

# Target-only greedy tokens at every residency on the bench model: `specter-run bench` with
# all-resident target-only as its reference, lru, ondemand and the host path (hybrid) at each of
# $RESIDENCY_SLOTS (default "63 48 32 8"; an item N=MODES runs those bench modes at N) experts
# per layer, $RESIDENCY_PROMPTS prompts (12) of
# $RESIDENCY_TOKENS new tokens (128); then pinned staging and waiting for registration through
# `generate` on $RESIDENCY_GEN_PROMPTS prompts (3) at 32 slots. The bench fails on any token that differs. With
# $OLD_CARRY, the earlier binaries' bench too (its agreement column: runs equal to resident), at
# the slot counts in $OLD_SLOTS (default: all).
residency() {
    local dir=$1 out=$2
    bench_model "$dir" "$out"
    local sides=(new)
    [ -n "${OLD_CARRY:-}" ] && sides+=(old)
    local status=0
    for item in ${RESIDENCY_SLOTS:-63 48 32 8}; do
        # N or N=MODES (a comma-separated list for that slot count).
        local n=${item%%=*} modes=resident,lru,ondemand,hybrid
        [ "$item" != "$n" ] && modes=${item#*=}
        for side in "${sides[@]}"; do
            local bin="$CARRY/specter-run"
            if [ "$side" = old ]; then
                [[ " ${OLD_SLOTS:-$n} " == *" $n "* ]] || continue
                bin="$OLD_CARRY/specter-run"
            fi
            "$bin" bench "$dir/dsv2.specter" --backend cuda --case custom --depth 4 \
                --resident-experts "$n" --matched-experts "$n" --modes "$modes" \
                --num-prompts "${RESIDENCY_PROMPTS:-12}" --new-tokens "${RESIDENCY_TOKENS:-128}" \
                --repeats 1 --json "$out/residency-$side-$n.json" > "$out/residency-$side-$n.md" \
                2> "$out/residency-$side-$n.err" || { echo "bench $side $n: $(tail -1 "$out/residency-$side-$n.err")"; status=1; }
        done
    done
    local want=""
    for i in $(seq 0 $(( ${RESIDENCY_GEN_PROMPTS:-3} - 1 ))); do
        local prompt
        prompt=$(python3 -c "import random; r = random.Random($i); print(','.join(str(r.randrange(3, 102400)) for _ in range(16)))")
        for v in "resident|" "pinned32|--resident-experts 32 --pinned-staging" "registered32|--resident-experts 32 --wait-registration"; do
            local name=${v%%|*} args=${v#*|}
            # shellcheck disable=SC2086
            "$CARRY/specter-run" generate "$dir/dsv2.specter" --backend cuda --mode target --prompt-ids "$prompt" \
                --max-new-tokens "${RESIDENCY_TOKENS:-128}" --ignore-eos --json $args > "$out/gen-$name-$i.json"
            local toks
            toks=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['tokens'])" "$out/gen-$name-$i.json")
            [ "$name" = resident ] && want=$toks
            if [ "$toks" = "$want" ]; then echo "prompt $i $name: tokens equal resident"; else echo "prompt $i $name: TOKENS DIFFER"; status=1; fi
        done
    done
    python3 - "$out" <<'EOF2'
import glob, json, os, sys
print("| binaries | experts/layer | mode | runs equal to all-resident target-only | mean TPOT ms |")
print("|---|---|---|---|---|")
for f in sorted(glob.glob(os.path.join(sys.argv[1], "residency-*.json"))):
    side, n = os.path.basename(f)[len("residency-"):-len(".json")].split("-")
    d = json.load(open(f))
    for m in d["modes"]:
        runs = [r for r in d["runs"] if r["mode"] == m["mode"]]
        eq = sum(r["agrees"] for r in runs)
        print(f"| {side} | {n} | {m['mode']} | {eq} of {len(runs)} | {m['mean_tpot_ms']:.2f} |")
EOF2
    return $status
}

# Plain decoding on the bench model, copying every miss against the host path, per slot count;
# with $OLD_CARRY also the earlier binaries' host path; $REPEATS rounds taking turns (default 1).
hybrid() {
    local dir=$1 out=$2
    bench_model "$dir" "$out"
    local prompt=5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20
    # shellcheck disable=SC2206
    local extra=(${HYBRID_ARGS:-})
    local tag=${HYBRID_TAG:-hybrid}
    local variants=(lru hybrid)
    [ -n "${OLD_CARRY:-}" ] && variants=(lru old-hybrid hybrid)
    # HYBRID_VARIANTS=old-lru,lru,old-hybrid,hybrid: any of these (old-*: $OLD_CARRY's binary).
    # shellcheck disable=SC2206
    [ -n "${HYBRID_VARIANTS:-}" ] && variants=(${HYBRID_VARIANTS//,/ })
    # A busy host: $HYBRID_BUSY processes spinning at nice 19 on the cores while every run goes.
    local busy=()
    for _ in $(seq 1 "${HYBRID_BUSY:-0}"); do
        nice -n 19 sh -c 'while :; do :; done' &
        busy+=($!)
    done
    for slots in ${SLOTS//,/ }; do
        for round in $(seq 1 "${REPEATS:-1}"); do
            for variant in "${variants[@]}"; do
                local host=() run="$CARRY/specter-run"
                # shellcheck disable=SC2206
                case $variant in *hybrid*) host=(--host-experts auto ${HOST_ARGS:-}) ;; esac
                case $variant in old-*) run="$OLD_CARRY/specter-run" ;; esac
                local f="$out/$tag-$variant-$slots-$round"
                "$run" generate "$dir/dsv2.specter" --prompt-ids "$prompt" --max-new-tokens 128 --ignore-eos \
                    --json --backend cuda --mode target --resident-experts "$slots" --policy lru \
                    --wait-registration "${host[@]}" "${extra[@]}" > "$f.json" 2> "$f.err" ||
                    { tail -3 "$f.err"; [ ${#busy[@]} -eq 0 ] || kill "${busy[@]}"; return 1; }
            done
        done
    done
    [ ${#busy[@]} -eq 0 ] || kill "${busy[@]}"
    python3 - "$out" "$tag" "${SLOTS//,/ }" "${variants[*]}" "${extra[*]} ${HOST_ARGS:-}" <<'PY'
import glob, json, statistics, sys
out, tag, slots, variants, args = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4].split(), sys.argv[5]
print(f"args: {args.strip() or '-'}; TPOT ms, median of rounds (the rounds); telemetry ms per token, "
      "median round; 'other' is TPOT less route wait, dispatch, host wall and finish")
print("| slots | variant | TPOT ms | over lru | host experts/token (split) | host GB/s | link GB/s | "
      "host busy / stall | link busy | route wait | dispatch | finish | other | same tokens |")
print("|" + "---|" * 14)
for s in slots:
    runs = {v: [json.load(open(p)) for p in sorted(glob.glob(f"{out}/{tag}-{v}-{s}-*.json"))] for v in variants}
    lru = statistics.median(r["stats"]["tpot_ms"] for r in runs["lru"])
    tokens = runs["lru"][0]["tokens"]
    for v in variants:
        rs = sorted(runs[v], key=lambda r: r["stats"]["tpot_ms"])
        mid = rs[len(rs) // 2]
        tpot = statistics.median(r["stats"]["tpot_ms"] for r in rs)
        o = mid["gpu"]["offload"] or {}
        n = max(len(mid["tokens"]) - 1, 1)
        ms = lambda k: o.get(k, 0) / n * 1e3
        gbps = o.get("host_bytes", 0) / o["host_seconds"] / 1e9 if o.get("host_seconds") else 0.0
        other = mid["stats"]["tpot_ms"] - sum(ms(k) for k in ("route_wait_seconds", "dispatch_seconds", "host_seconds", "finish_seconds"))
        same = all(r["tokens"] == tokens for r in rs)
        each = ", ".join(f"{r['stats']['tpot_ms']:.2f}" for r in runs[v])
        print(f"| {s} | {v} | {tpot:.2f} ({each}) | {lru / tpot:.2f}x | "
              f"{o.get('host_experts', 0) / n:.1f} ({o.get('split_experts', 0) / n:.1f}) | {gbps:.1f} | "
              f"{o.get('copy_gbps', 0):.1f} | {ms('host_seconds'):.2f} / {ms('host_stall_seconds'):.2f} | "
              f"{ms('copy_seconds'):.2f} | {ms('route_wait_seconds'):.2f} | {ms('dispatch_seconds'):.2f} | "
              f"{ms('finish_seconds'):.2f} | {other:.2f} | {same} |")
PY
}

# The host expert kernel: bit equality with the GPU kernel, then its bandwidth against the
# host's read bandwidth ($HOST_THREADS, $HOST_ROWS).
hostexp() {
    local out=$1
    run_test cuda_host_experts "$out/hostexp.log" || return 1
    "$CARRY/bench_host_experts" "${HOST_THREADS:-1,8,16}" "${HOST_ROWS:-1,4,16}" 2>&1 | tee "$out/hostexp-bench.log"
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
    if [ "${LOSSLESS:-1}" = 1 ]; then
        echo "== lossless: specter (depth 16) against target-only, all resident, 10 prompts"
        "$run" bench "$dir/dsv2.specter" --case custom --depth 16 --resident-experts 64 \
            --matched-experts 64 --modes resident,specter --num-prompts 10 --repeats 1 \
            --json "$out/lossless10.json" 2> "$out/lossless10.err" | tail -4
    fi
    # shellcheck disable=SC2086
    bench_cases "$dir/dsv2.specter" "$out" "${CASE_TAG:-random}" --num-prompts "${PROMPTS:-2}" ${CASE_ARGS:-}
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
    # shellcheck disable=SC2086
    bench_cases "$dir/routed.specter" "$out" "${CASE_TAG:-trained}" --prompts "$out/prompts.txt" ${CASE_ARGS:-}
}

# Evicts FILES... from the page cache: drop_caches when /proc/sys allows it (root, not a
# read-only /proc), else posix_fadvise(DONTNEED) on every file. Prints what worked; where
# util-linux's fincore exists, stderr says how much stayed cached.
evict() {
    sync
    local how
    if (echo 3 > /proc/sys/vm/drop_caches) 2>/dev/null; then
        how=drop_caches
    else
        how=$(python3 - "$@" <<'PY'
import os, sys
for top in sys.argv[1:]:
    paths = [top] if os.path.isfile(top) else [os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError:
            pass
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
print("posix_fadvise-DONTNEED")
PY
)
    fi
    if command -v fincore > /dev/null; then
        local cached
        cached=$(find "$@" -type f -print0 | xargs -0 fincore -b -n -o RES 2>/dev/null | awk '{s += $1} END {print s + 0}')
        how="$how,$((cached / 1000000))MB-still-cached"
    fi
    echo "$how"
}

# One specter-run process, target-only, one new token: its JSON into $1, its wall ms into $1.wall_ms.
ttft_specter() {
    local json=$1
    shift
    local t0 t1
    t0=$(date +%s%N)
    "$CARRY/specter-run" generate "$TTFT_BUNDLE" --prompt-ids 5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20 \
        --max-new-tokens 1 --ignore-eos --json --backend cuda --mode target "$@" > "$json"
    t1=$(date +%s%N)
    echo "$(( (t1 - t0) / 1000000 ))" > "$json.wall_ms"
}

ttft() {
    local out=$1 layers=${LAYERS:-27} reps=${TTFT_REPEATS:-3}
    local pack="$CARRY/specter-pack"
    local dir="${TTFT_DIR:-$ROOT/.ttft}" shm=/dev/shm/specter-ttft-hf
    mkdir -p "$dir"
    echo "ttft: work dir $dir ($(stat -f -c %T "$dir"), $(df -B1G --output=avail "$dir" | tail -1 | tr -d ' ') GB free)"
    TTFT_BUNDLE="$dir/dsv2.specter"
    # The 31 GB checkpoint and the ~37 GB bundle may not both fit on the disk: then the checkpoint
    # waits in /dev/shm until the bundle's runs are done, and replaces the bundle on disk for the
    # peer's runs (cold runs need files on disk: tmpfs pages cannot be evicted).
    local hf="$dir/hf"
    [ -d "$shm" ] && hf="$shm"
    if [ ! -f "$TTFT_BUNDLE" ] || [ ! -f "$hf/config.json" ]; then
        rm -rf "$dir/hf" "$shm" "$TTFT_BUNDLE"
        local free
        free=$(df -B1G --output=avail "$dir" | tail -1 | tr -d ' ')
        if [ "$free" -ge 75 ]; then hf="$dir/hf"; else hf="$shm"; fi
        local t0=$SECONDS
        "$pack" synth --preset deepseek-v2-lite --layers "$layers" -o "$hf" > "$out/ttft-synth.txt"
        "$pack" convert "$hf" -o "$TTFT_BUNDLE" > "$out/ttft-convert.txt"
        echo "ttft: synth + convert $((SECONDS - t0)) s; checkpoint in $hf, bundle $TTFT_BUNDLE"
    fi
    : > "$out/ttft.tsv"
    # Warm: one untimed run fills the page cache (and the PTX and driver caches), then $reps runs
    # each (the median is reported).
    # lru16-registered waits for the expert sections' registration before the first token (the
    # default copies through pinned staging until the background registration finishes).
    local variants=("resident|" "lru16|--resident-experts 16 --policy lru"
        "lru16-registered|--resident-experts 16 --policy lru --wait-registration"
        "resident-mmap|--load-io mmap" "resident-per-tensor|--load-io per-tensor")
    ttft_specter "$out/ttft-prime.json" || return 1
    for v in "${variants[@]}"; do
        local name=${v%%|*} args=${v#*|}
        [[ "$name" =~ ${ONLY:-.} ]] || continue
        local n=$reps
        # The comparisons of I/O methods run once each, to keep the step well inside 10 minutes.
        [[ "$name" =~ ^resident-(per-tensor|mmap)$ ]] && n=1
        for rep in $(seq "$n"); do
            # shellcheck disable=SC2086
            ttft_specter "$out/ttft-$name-warm-$rep.json" $args || return 1
            echo -e "specter\t$name\twarm\t$out/ttft-$name-warm-$rep.json" >> "$out/ttft.tsv"
        done
    done
    if [ -z "${TTFT_SKIP_COLD:-}" ]; then
        for v in "resident|" "resident-direct|--load-io direct" "lru16|--resident-experts 16 --policy lru" \
            "lru16-registered|--resident-experts 16 --policy lru --wait-registration"; do
            local name=${v%%|*} args=${v#*|}
            [[ "$name" =~ ${ONLY:-.} ]] || continue
            local how
            how=$(evict "$TTFT_BUNDLE")
            # shellcheck disable=SC2086
            ttft_specter "$out/ttft-$name-cold.json" $args || return 1
            echo -e "specter\t$name\tcold:$how\t$out/ttft-$name-cold.json" >> "$out/ttft.tsv"
        done
    fi
    if [ -z "${TTFT_SKIP_PEER:-}" ]; then
        if [ "$hf" = "$shm" ]; then
            rm -f "$TTFT_BUNDLE"
            local t0=$SECONDS
            rm -rf "$dir/hf" && cp -r "$shm" "$dir/hf" && rm -rf "$shm"
            hf="$dir/hf"
            echo "ttft: bundle removed, checkpoint moved to $hf for the peer ($((SECONDS - t0)) s)"
        fi
        # The first run warms the page cache (and torch's own caches); the second is reported.
        for rep in 0 1; do
            python3 "$ROOT/scripts/peer_ttft.py" "$hf" > "$out/ttft-peer-warm-$rep.json" 2> "$out/ttft-peer-warm-$rep.err" ||
                { tail -5 "$out/ttft-peer-warm-$rep.err"; return 1; }
        done
        echo -e "transformers\tfrom_pretrained\twarm\t$out/ttft-peer-warm-1.json" >> "$out/ttft.tsv"
        if [ -z "${TTFT_SKIP_COLD:-}" ]; then
            local how
            how=$(evict "$hf")
            python3 "$ROOT/scripts/peer_ttft.py" "$hf" > "$out/ttft-peer-cold.json" 2> "$out/ttft-peer-cold.err" ||
                { tail -5 "$out/ttft-peer-cold.err"; return 1; }
            echo -e "transformers\tfrom_pretrained\tcold:$how\t$out/ttft-peer-cold.json" >> "$out/ttft.tsv"
        fi
    fi
    python3 "$ROOT/scripts/ttft_table.py" "$out/ttft.tsv" | tee "$out/ttft-table.txt"
}

# Target precision on the bench model: FP16, INT8 (4-bit draft) and INT4 (3-bit draft) bundles
# converted from one checkpoint (round to nearest: speed does not depend on the quantizer);
# target-only TPOT all resident, with 1 expert slot a layer (lru) and at each VRAM budget of
# $PRECISION_BUDGETS (GB, default "12.9 17.7": about 12 and 16.5 GiB), $REPEATS runs (2), and
# peak VRAM. Each bundle's tokens must not change with residency.
precision() {
    local dir=$1 out=$2 hf=${HF_DIR:-$1/hf}
    KEEP_HF=1 bench_model "$dir" "$out"
    local pack="${PACK:-$CARRY/specter-pack}" prompt=5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20
    for t in int8 int4; do
        if [ ! -f "$dir/dsv2-$t.specter" ]; then
            [ -d "$hf" ] || { echo "precision: no checkpoint at $hf (KEEP_HF=1 when making the bench model)"; return 1; }
            "$pack" convert "$hf" -o "$dir/dsv2-$t.specter" --target "$t" --quant rtn > "$out/convert-$t.txt" 2>&1 ||
                { tail -3 "$out/convert-$t.txt"; return 1; }
        fi
    done
    : > "$out/precision.tsv"
    for rep in $(seq "${REPEATS:-2}"); do
        for t in fp16 int8 int4; do
            local bundle="$dir/dsv2-$t.specter"
            [ "$t" = fp16 ] && bundle="$dir/dsv2.specter"
            local variants=("resident|" "1 slot|--resident-experts 1")
            for b in ${PRECISION_BUDGETS:-12.9 17.7}; do variants+=("${b} GB|--vram-budget $b"); done
            for v in "${variants[@]}"; do
                local name=${v%%|*} args=${v#*|} f="$out/prec-$t-${v%%|*}-$rep.json"
                f=${f// /_}
                # shellcheck disable=SC2086
                "$CARRY/specter-run" generate "$bundle" --prompt-ids "$prompt" --max-new-tokens 128 \
                    --ignore-eos --json --backend cuda --mode target $args > "$f" 2> "${f%.json}.err" ||
                    { echo "precision $t $name: $(tail -1 "${f%.json}.err")"; continue; }
                python3 - "$f" "$t" "$name" >> "$out/precision.tsv" <<'EOF2'
import json, sys
d = json.load(open(sys.argv[1]))
g = d.get("gpu") or {}
print("\t".join([sys.argv[2], sys.argv[3], str(d["stats"]["tpot_ms"]), str(g.get("vram_peak_bytes", 0)),
                str(g.get("residency", "")), ",".join(map(str, d["tokens"])),
                str((d.get("host_memory") or {}).get("peak_rss_bytes") or 0)]))
EOF2
            done
        done
    done
    python3 - "$out/precision.tsv" <<'EOF2'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
print("| target | VRAM | TPOT ms (median; runs) | peak VRAM GiB | host peak RSS GB | residency | tokens equal all resident |")
print("|---|---|---|---|---|---|---|")
status = 0
for t in dict.fromkeys(r[0] for r in rows):
    ref = {r[5] for r in rows if r[0] == t and r[1] == "resident"}
    for name in dict.fromkeys(r[1] for r in rows if r[0] == t):
        rs = [r for r in rows if r[0] == t and r[1] == name]
        ts = [float(r[2]) for r in rs]
        same = {r[5] for r in rs} == ref and len(ref) == 1
        status |= not same
        print(f"| {t} | {name} | {statistics.median(ts):.3f} ({', '.join(f'{x:.3f}' for x in ts)}) | "
              f"{max(int(r[3]) for r in rs) / 2**30:.2f} | {max(int(r[6]) for r in rs) / 1e9:.2f} | "
              f"{rs[0][4]} | {same} |")
sys.exit(status)
EOF2
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
                # Both files' tests: those that run anywhere and the GPU ones (ignored elsewhere).
                for t in cuda_device cuda_doctor; do
                    SPECTER_ROOT="$ROOT" "$CARRY/test-$t" --include-ignored --nocapture --test-threads 1 2>&1 | tee "$out/$t.log" || status=1
                done ;;
            ops) run_test cuda_ops "$out/ops.log" || status=1
                run_test cuda_ops_fused "$out/ops-fused.log" || status=1 ;;
            int4) run_test cuda_moe_int4 "$out/int4.log" || status=1
                run_test cuda_moe_rows "$out/rows.log" || status=1 ;;
            fixtures) run_test cuda_fixtures "$out/fixtures.log" gpu_target_tokens || status=1
                run_test cuda_fixtures "$out/fused.log" gpu_logits || status=1
                run_test cuda_load "$out/load.log" || status=1 ;;
            lossless) run_test cuda_fixtures "$out/lossless.log" gpu_speculative || status=1
                run_test cuda_fixtures "$out/chained.log" gpu_chained || status=1 ;;
            errors) run_test cuda_fixtures "$out/errors.log" impossible_residency || status=1 ;;
            placement) run_test cuda_placement "$out/placement.log" || status=1 ;;
            bench) bench "$dir" "$out" || status=1 ;;
            compare) compare "$dir" "$out" 2>&1 | tee "$out/compare.log" || status=1 ;;
            residency) residency "$dir" "$out" 2>&1 | tee "$out/residency.log" || status=1 ;;
            precision) precision "$dir" "$out" 2>&1 | tee "$out/precision.log" || status=1 ;;
            hostexp) hostexp "$out" || status=1 ;;
            hybrid) SLOTS=${SLOTS:-1,16,32} hybrid "$dir" "$out" 2>&1 | tee -a "$out/hybrid.log" || status=1 ;;
            pace) run_test cuda_pace "$out/pace.log" || status=1 ;;
            w4a16) "$CARRY/bench_w4a16" 2>&1 | tee "$out/w4a16.log" || status=1 ;;
            stream) "$CARRY/bench_stream" "${LAYERS:-27}" 2>&1 | tee "$out/stream.log" || status=1 ;;
            kprofile) kprofile "$dir" "$out" 2>&1 | tee "$out/kprofile.log" || status=1 ;;
            wprofile) wprofile "$dir" "$out" 2>&1 | tee "$out/wprofile-${WROWS:-17}.log" || status=1 ;;
            incost) incost "$dir" "$out" 2>&1 | tee "$out/incost.log" || status=1 ;;
            steps) steps "$dir" "$out" 2>&1 | tee "$out/steps.log" || status=1 ;;
            cases) cases "$dir" "$out" 2>&1 | tee "$out/cases.log" || status=1 ;;
            trained) trained "$dir" "$out" 2>&1 | tee "$out/trained.log" || status=1 ;;
            ttft) ttft "$out" 2>&1 | tee "$out/ttft.log" || status=1 ;;
            peer) peer "$dir" "$out" 2>&1 | tee "$out/peer.log" || status=1 ;;
            peersteps) peersteps "$dir" "$out" 2>&1 | tee "$out/peersteps.log" || status=1 ;;
            autoprofile) autoprofile "$dir" "$out" 2>&1 | tee "$out/autoprofile.log" || status=1 ;;
            *) echo "unknown check $w" >&2; status=2 ;;
        esac
    done
    grep -h "rel err\|test result\|panicked" "$out"/*.log 2>/dev/null | sort | uniq -c | sort -rn | head -5 || true
    return $status
}

case "${1:-}" in
    build) build ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 build | run [ops|int4|precision|compare|hostexp|hybrid|fixtures|lossless|errors|bench|w4a16|kprofile|incost|steps|peersteps|cases|trained|ttft|peer|autoprofile]..." >&2; exit 2 ;;
esac
