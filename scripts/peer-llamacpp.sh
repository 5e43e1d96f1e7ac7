#!/usr/bin/env bash
# llama.cpp, the engine people run offloaded MoE models with, against Specter on the same weights
# in one GPU-machine call.
#
#   bash scripts/peer-llamacpp.sh pack DEST LLAMA_SRC    # here: release binaries, this script, its
#                                                        # helpers and the llama.cpp source into DEST
#                                                        # (PEER_FEATURES: cargo features to build with)
#   bash DEST/peer-llamacpp.sh run [PRESET]              # there (PRESET: deepseek-v2-lite, the
#                                                        # default, or qwen1.5-moe-a2.7b)
#
# LLAMA_SRC is a llama.cpp source tree packed as .tar.xz (or .tar.gz) with CMakeLists.txt,
# convert_hf_to_gguf.py, conversion/ and gguf-py/ at its top; it is never part of this repository.
#
# `run` builds llama.cpp (CUDA, static, llama-bench and llama-completion only) in the background
# while it synthesizes the checkpoint (`specter-pack synth --preset PRESET`, seed 0, the model the
# GPU benchmarks use), converts it to a Specter bundle and, with llama.cpp's own converter, to an
# F16 GGUF. Then, on those weights:
#   1. llama.cpp all on the GPU (-ngl 99) against Specter all resident (target-only);
#   2. llama.cpp with every routed expert on the CPU (-ot exps=CPU) against Specter's smallest
#      residency (1 expert slot per MoE layer, lru);
#   3. llama.cpp --n-cpu-moe N against Specter's best mode at the high and low cases' budgets
#      (SPECTER_HIGH, SPECTER_LOW), N picked so llama.cpp's VRAM is nearest Specter's peak;
#   4. llama.cpp's greedy tokens (-ngl 99, llama-completion) against Specter's target-only ones
#      on the same prompt ids: the length of the prefix they agree on.
# llama.cpp is timed with llama-bench (tg, PEER_NEW_TOKENS tokens, PEER_THREADS threads), Specter
# with `specter-run generate` (TPOT over PEER_NEW_TOKENS greedy tokens). VRAM is what nvidia-smi
# logs while each step runs. The markdown table comes last; $OUT gets table.md, the record files
# and every log packed in logs.tar.gz. On the H200 machine (16 cores) the DeepSeek-V2-Lite run
# takes about 7.5 minutes: synth 85 s, both conversions 140 s, the llama.cpp build about 5 min
# alongside them, then about 3 minutes of measurements.
#
# Environment (defaults in brackets):
#   PEER_WORK [/dev/shm/specter-peer]  checkpoint and GGUF (about 31 GB each for DeepSeek-V2-Lite)
#   PEER_DISK  the Specter bundle (about 39 GB; default: the first of /var/tmp/specter-peer,
#       .peer-bundle beside this folder and ~/specter-peer with 39 GiB free)
#   PEER_KEEP [0]  1 keeps the GGUF and the bundle afterwards
#   LLAMA_DIR [/tmp/specter-peer-llama.cpp]  where llama.cpp is unpacked and built; a finished
#       build of the same source there (an earlier call's, on a machine still held) is reused
#   PEER_THREADS [16]  PEER_NEW_TOKENS [128]  PEER_BENCH_REPS [2]  (llama-bench -r)
#   PEER_PROMPT [ABCDEFGHIJKLMNOP]  prompt text; the synthesized tokenizer gives one id a byte
#   PEER_TIME_S [540]  the whole run's time; steps that would not fit are skipped and said so
#   PEER_ROWS [all]  `gpu` measures row 1 and the greedy check only (both engines all on the GPU:
#       the decode step's comparison, about 6 minutes, most of it llama.cpp's build)
#   PEER_PREFILL  prompt lengths, comma separated (e.g. 512,2048,8192): prefill all on the GPU,
#       llama-bench pp at each against `specter-run bench --prompt-tokens` (all resident, one
#       random prompt a length, PEER_BENCH_REPS runs; median TTFT), in a table of its own
#   SPECTER_MIN  generate arguments of Specter's run at the smallest residency (default: target-only
#       lru with 1 expert slot per MoE layer; "--host-experts auto" adds the host path). The
#       defaults wait for the expert sections' registration before the first token
#       (--wait-registration), as llama-bench times after its model load and warm-up: a short run
#       would otherwise copy through pinned staging for most of its tokens
#   (a Specter run with --host-experts auto waits for the end of llama.cpp's build and quantizer:
#   the host path would compete with them for the CPU)
#   SPECTER_HIGH, SPECTER_LOW  generate arguments of Specter's best mode at each budget (default:
#       target-only lru at the case's matched residency, the mode `bench --modes auto` chose on
#       these weights in every earlier run)
#   PEER_TARGET [fp16]  the precision compared: fp16 (llama.cpp's F16 GGUF against Specter's FP16
#       target), int8 (llama-quantize's Q8_0 against `convert --target int8`) or int4 (Q4_K_M
#       against `--target int4`). Under int8 and int4 Specter's defaults change: the smallest
#       residency is 1 slot a layer, and the high and low budgets are --vram-budget 17.7 and
#       12.9 GB (about 16.5 and 12 GiB) instead of a slot count, the host path on in all three. The checkpoint is
#       converted with RTN (speed does not depend on the quantizer).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"

die() {
    echo "peer-llamacpp: $*" >&2
    exit 1
}

pack() {
    local dest=${1:-} src=${2:-}
    [ -n "$dest" ] && [ -n "$src" ] || die "usage: $0 pack DEST LLAMA_SRC_TARBALL"
    [ -f "$src" ] || die "llama.cpp source $src not found"
    case "$src" in *.tar.xz | *.tar.gz) ;; *) die "llama.cpp source $src is not a .tar.xz or .tar.gz" ;; esac
    local root
    root="$(cd "$HERE/.." && pwd)"
    # PEER_FEATURES (e.g. specter/prompt-tensor-cores) builds Specter with those cargo features.
    (cd "$root" && cargo build --release -p specter-pack -p specter-run \
        ${PEER_FEATURES:+--features "$PEER_FEATURES"})
    local target=${CARGO_TARGET_DIR:-$root/target}
    mkdir -p "$dest"
    cp "$target/release/specter-pack" "$target/release/specter-run" "$dest/"
    strip "$dest/specter-pack" "$dest/specter-run" 2>/dev/null || true
    cp "$HERE/peer-llamacpp.sh" "$HERE/peer_llamacpp_convert.py" "$HERE/peer_llamacpp_report.py" "$dest/"
    rm -f "$dest"/llama.cpp-src.tar.*
    cp "$src" "$dest/llama.cpp-src.tar.${src##*.}"
    ls -l "$dest"
    du -sh "$dest"
}

# ---- run ---------------------------------------------------------------------------------------

T0=$SECONDS
LOG=""
GPU_LOGGER=""
BUILD_PID=""
FAILED=0
CLEANUP=()

left() { echo $((PEER_TIME_S - (SECONDS - T0))); }

stamp() { date '+%Y/%m/%d %H:%M:%S.%3N'; }

# step NAME TIMEOUT_S COMMAND...: runs COMMAND under a timeout, stdout to $LOG/NAME.out, stderr to
# $LOG/NAME.err, and records its start and end for the VRAM log.
step() {
    local name=$1 limit=$2
    shift 2
    local start status=0 room
    # Never past the run's own time (plus a margin for the record), whatever the step's limit.
    room=$(($(left) + 20))
    [ "$room" -ge 10 ] || room=10
    [ "$limit" -le "$room" ] || limit=$room
    start=$(stamp)
    echo "[$((SECONDS - T0)) s] $name"
    echo "$name: $*" >> "$LOG/commands.txt"
    timeout "$limit" "$@" > "$LOG/$name.out" 2> "$LOG/$name.err" || status=$?
    printf '%s\t%s\t%s\n' "$name" "$start" "$(stamp)" >> "$LOG/steps.tsv"
    if [ "$status" -ne 0 ]; then
        [ "$status" -eq 124 ] && echo "  $name: timed out after $limit s" >&2
        echo "  $name failed (exit $status); last lines of its stderr:" >&2
        tail -5 "$LOG/$name.err" >&2 || true
    fi
    return "$status"
}

note() { echo "$*" | tee -a "$LOG/notes.txt"; }

vram_mib() { python3 "$HERE/peer_llamacpp_report.py" vram-peak "$LOG/gpu-mem.csv" "$LOG/steps.tsv" "$1"; }

finish() {
    local status=$?
    [ -n "$GPU_LOGGER" ] && kill "$GPU_LOGGER" 2>/dev/null || true
    if [ -n "$BUILD_PID" ] && kill -0 "$BUILD_PID" 2>/dev/null; then
        kill -- "-$BUILD_PID" 2>/dev/null || kill "$BUILD_PID" 2>/dev/null || true
    fi
    if [ "${PEER_KEEP:-0}" != 1 ] && [ ${#CLEANUP[@]} -gt 0 ]; then
        rm -rf "${CLEANUP[@]}"
    fi
    if [ -n "$LOG" ] && [ -d "$LOG" ]; then
        python3 "$HERE/peer_llamacpp_report.py" table "$LOG" > "$LOG/table.md" 2> "$LOG/table.err" ||
            cat "$LOG/table.err" >&2
        if [ -n "${OUT:-}" ] && [ "$OUT" != "$LOG" ]; then
            mkdir -p "$OUT"
            cp "$LOG/table.md" "$OUT/" 2>/dev/null || true
            tar -czf "$OUT/logs.tar.gz" -C "$LOG" . 2>/dev/null || true
        fi
        echo
        echo "total $((SECONDS - T0)) s; logs in ${OUT:-$LOG}"
        echo
        cat "$LOG/table.md" 2>/dev/null || true
    fi
    exit "$status"
}

build_llama() {
    local src=$1 build=$2
    if ! command -v nvcc > /dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
        export PATH="$PATH:/usr/local/cuda/bin"
    fi
    cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_OPENSSL=OFF
    cmake --build "$build" -j "$(nproc)" --target llama-bench llama-completion llama-quantize
}

run() {
    local preset=${1:-deepseek-v2-lite}
    local layers high low
    case "$preset" in
        deepseek-v2-lite) layers=27 high=32 low=20 ;;  # the ds_high / ds_low cases' matched residency
        qwen1.5-moe-a2.7b) layers=24 high=30 low=23 ;; # qwen_high / qwen_low
        *) die "unknown preset $preset (deepseek-v2-lite or qwen1.5-moe-a2.7b)" ;;
    esac
    : "${PEER_TIME_S:=540}" "${PEER_THREADS:=16}" "${PEER_NEW_TOKENS:=128}" "${PEER_BENCH_REPS:=2}"
    local precision=${PEER_TARGET:-fp16} ltype
    case "$precision" in
        fp16) ltype=F16 ;;
        int8) ltype=Q8_0 ;;
        int4) ltype=Q4_K_M ;;
        *) die "PEER_TARGET=$precision: expected fp16, int8 or int4" ;;
    esac
    local work=${PEER_WORK:-/dev/shm/specter-peer} disk=${PEER_DISK:-}
    local lsrc=${LLAMA_DIR:-/tmp/specter-peer-llama.cpp}
    local pack_bin="$HERE/specter-pack" run_bin="$HERE/specter-run"
    local tarball
    tarball=$(find "$HERE" -maxdepth 1 -name 'llama.cpp-src.tar.*' | head -1)
    for f in "$pack_bin" "$run_bin" "$HERE/peer_llamacpp_convert.py" "$HERE/peer_llamacpp_report.py"; do
        [ -f "$f" ] || die "$f missing: make this folder with '$0 pack DEST LLAMA_SRC' first"
    done
    [ -n "$tarball" ] || die "no llama.cpp-src.tar.* beside $0 (see '$0 pack')"
    command -v nvidia-smi > /dev/null || die "nvidia-smi not found: run this on the GPU machine"
    if ! command -v cmake > /dev/null || ! command -v ninja > /dev/null; then
        die "cmake and ninja are needed to build llama.cpp"
    fi

    LOG=$(mktemp -d /tmp/specter-peer-log.XXXXXX)
    trap finish EXIT
    : > "$LOG/steps.tsv"
    : > "$LOG/rows.tsv"
    rm -rf "$work"
    mkdir -p "$work"
    local shm_free disk_free=0 d
    shm_free=$(df -B1G --output=avail "$work" | tail -1 | tr -d ' ')
    # The bundle goes on a disk (tmpfs holds the checkpoint and the GGUF): the first of these with room.
    for d in ${disk:-/var/tmp/specter-peer "$HERE/../.peer-bundle" "$HOME/specter-peer"}; do
        mkdir -p "$d" 2>/dev/null || continue
        rm -f "$d/model.specter"
        disk_free=$(df -B1G --output=avail "$d" | tail -1 | tr -d ' ')
        disk=$d
        [ "$disk_free" -lt 39 ] || break
    done
    CLEANUP=("$work" "$disk/model.specter")
    echo "work $work: ${shm_free} GiB free; bundle $disk: ${disk_free} GiB free; $(nproc) cores"
    # DeepSeek-V2-Lite: checkpoint and GGUF 29.3 GiB each, bundle 36.2 GiB.
    [ "$shm_free" -ge 60 ] || die "$work has ${shm_free} GiB free; the checkpoint and its GGUF need about 60"
    [ "$disk_free" -ge 39 ] || die "$disk has ${disk_free} GiB free; the bundle needs about 37"

    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOG/gpu.txt"
    nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 100 > "$LOG/gpu-mem.csv" &
    GPU_LOGGER=$!

    local src_sha
    src_sha=$(sha256sum "$tarball" | cut -d' ' -f1)
    {
        printf 'preset\t%s\nlayers\t%s\nnew_tokens\t%s\nthreads\t%s\n' "$preset" "$layers" "$PEER_NEW_TOKENS" "$PEER_THREADS"
        printf 'specter_target\t%s\nllama_type\t%s\n' "$precision" "$ltype"
        printf 'llama_source_sha256\t%s\n' "$src_sha"
        printf 'gpu\t%s\n' "$(head -1 "$LOG/gpu.txt")"
    } > "$LOG/meta.tsv"

    # llama.cpp: unpack, then build in the background (its own process group, so it can be ended).
    # A finished build of the same source, left in $lsrc by an earlier run on this machine (the
    # next call while the machine is still held), is used as it is: about 5 minutes saved.
    local b reuse=1
    for b in llama-bench llama-completion llama-quantize; do
        [ -x "$lsrc/build/bin/$b" ] || reuse=0
    done
    [ "$(cat "$lsrc/specter-source.sha256" 2>/dev/null)" = "$src_sha" ] || reuse=0
    if [ "$reuse" = 1 ] && [ -f "$lsrc/specter-build.log" ]; then
        cp "$lsrc/specter-build.log" "$LOG/llama-build.log"
        note "llama.cpp: the build an earlier run left in $lsrc (same source) was used."
    else
        rm -rf "$lsrc"
        mkdir -p "$lsrc"
        tar -xf "$tarball" -C "$lsrc"
        [ -f "$lsrc/CMakeLists.txt" ] || die "$tarball does not hold a llama.cpp tree at its top"
        set -m
        build_llama "$lsrc" "$lsrc/build" > "$LOG/llama-build.log" 2>&1 &
        BUILD_PID=$!
        set +m
        echo "[$((SECONDS - T0)) s] llama.cpp build started (pid $BUILD_PID)"
    fi

    # The checkpoint, then both conversions of it side by side.
    step synth 180 "$pack_bin" synth --preset "$preset" --layers "$layers" -o "$work/hf" ||
        die "synth failed"
    local first_moe
    first_moe=$(python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); print(c.get("first_k_dense_replace", 0))' "$work/hf/config.json")
    local prompt_text=${PEER_PROMPT:-ABCDEFGHIJKLMNOP} prompt
    prompt=$(python3 "$HERE/peer_llamacpp_report.py" prompt-ids "$work/hf/tokenizer.json" "$prompt_text") ||
        die "cannot derive the prompt ids"
    echo "prompt '$prompt_text' = ids $prompt"
    step gguf 420 python3 "$HERE/peer_llamacpp_convert.py" "$lsrc" "$work/hf" "$work/model.gguf" &
    local gguf_pid=$!
    step convert 420 "$pack_bin" convert "$work/hf" -o "$disk/model.specter" --target "$precision" ||
        die "specter-pack convert failed"
    wait "$gguf_pid" || die "GGUF conversion failed (see gguf.err in the logs)"
    rm -rf "$work/hf"
    du -b "$work/model.gguf" "$disk/model.specter" | tee -a "$LOG/files.txt"

    # Specter's runs. The GPU is free while llama.cpp builds, so they run first, with the build's
    # compiler jobs at the lowest CPU priority; when time is left at the end they run again on an
    # otherwise idle machine and the table takes those.
    local gen=(generate "$disk/model.specter" --backend cuda --prompt-ids "$prompt"
        --max-new-tokens "$PEER_NEW_TOKENS" --ignore-eos --json)
    local wait="--policy lru --wait-registration" host=""
    [ "$precision" != fp16 ] && host=" --host-experts auto"
    local d_min="--mode target --resident-experts 1 $wait$host"
    local d_high="--mode target --resident-experts $high $wait" d_low="--mode target --resident-experts $low $wait"
    if [ "$precision" != fp16 ]; then
        d_high="--mode target --vram-budget 17.7 $wait$host"
        d_low="--mode target --vram-budget 12.9 $wait$host"
    fi
    local -A s_args=(
        [resident]="--mode target"
        [min]="${SPECTER_MIN:-$d_min}"
        [high]="${SPECTER_HIGH:-$d_high}"
        [low]="${SPECTER_LOW:-$d_low}"
    )
    local -A s_label=(
        [resident]="all resident, target-only"
        [min]="\`${s_args[min]}\`"
        [high]="\`${s_args[high]}\`"
        [low]="\`${s_args[low]}\`"
    )
    specter_run() { # NAME SUFFIX
        # shellcheck disable=SC2086
        step "specter-$1$2" 180 "$run_bin" "${gen[@]}" ${s_args[$1]} &&
            cp "$LOG/specter-$1$2.out" "$LOG/specter-$1$2.json"
    }
    kill -0 "$BUILD_PID" 2>/dev/null && renice -n 19 -g "$BUILD_PID" > /dev/null 2>&1 || true
    local s runs=(resident min high low)
    [ "${PEER_ROWS:-all}" = gpu ] && runs=(resident)
    for s in "${runs[@]}"; do
        # A host-path run would share the CPU with the build: it runs once the build is done.
        case "${s_args[$s]}" in *--host-experts\ auto*) continue ;; esac
        specter_run "$s" "" || FAILED=1
    done
    [ -f "$LOG/specter-resident.json" ] || die "Specter's all-resident run failed"
    if kill -0 "$BUILD_PID" 2>/dev/null; then
        note "The llama.cpp build (at nice 19) was still running when Specter's first runs ended."
    fi

    # llama.cpp's build.
    echo "[$((SECONDS - T0)) s] waiting for the llama.cpp build ($(left) s left)"
    local waited=0
    while kill -0 "$BUILD_PID" 2>/dev/null; do
        if [ $((SECONDS - T0 + 90)) -ge "$PEER_TIME_S" ]; then
            tail -5 "$LOG/llama-build.log" >&2
            die "the llama.cpp build did not finish in time"
        fi
        sleep 2
        waited=$((waited + 2))
    done
    if [ -n "$BUILD_PID" ]; then
        wait "$BUILD_PID" || { tail -20 "$LOG/llama-build.log" >&2; die "the llama.cpp build failed"; }
        BUILD_PID=""
        # Marks the build finished, for a later run on this machine.
        cp "$LOG/llama-build.log" "$lsrc/specter-build.log"
        echo "$src_sha" > "$lsrc/specter-source.sha256"
    fi
    echo "[$((SECONDS - T0)) s] llama.cpp built (waited $waited s for it)"
    local ggml_version
    ggml_version=$(grep -m1 -o 'ggml version: *[0-9.]*' "$LOG/llama-build.log" | grep -o '[0-9.]*$' || true)
    printf 'ggml_version\t%s\n' "${ggml_version:-unknown}" >> "$LOG/meta.tsv"
    local lbench="$lsrc/build/bin/llama-bench" lcomp="$lsrc/build/bin/llama-completion"
    local gguf="$work/model.gguf"
    if [ "$ltype" != F16 ]; then
        # llama.cpp's own quantizer, from the F16 GGUF its converter wrote.
        step llama-quantize 240 "$lsrc/build/bin/llama-quantize" "$gguf" "$work/model-$ltype.gguf" \
            "$ltype" "$PEER_THREADS" || die "llama-quantize $ltype failed"
        rm -f "$gguf"
        gguf="$work/model-$ltype.gguf"
        du -b "$gguf" | tee -a "$LOG/files.txt"
    fi
    local lb=(-m "$gguf" -p 0 -n "$PEER_NEW_TOKENS" -r "$PEER_BENCH_REPS" -t "$PEER_THREADS" -o json)

    # The host-path runs left for an idle machine.
    for s in "${runs[@]}"; do
        [ -f "$LOG/specter-$s.json" ] || specter_run "$s" "" || FAILED=1
    done

    # Greedy tokens, all on the GPU. The session file keeps every token llama.cpp evaluated (the
    # prompt as it tokenized it, then what it generated); one extra token makes that 128 new ones.
    # Quantized, the two engines' weights differ (each its own quantizer): no check.
    if [ "$ltype" != F16 ]; then
        note "No greedy agreement check: llama.cpp's $ltype and Specter's $precision weights come from different quantizers."
    elif step llama-completion 180 "$lcomp" -m "$gguf" -ngl 99 -t "$PEER_THREADS" -c 512 \
        -n $((PEER_NEW_TOKENS + 1)) --temp 0 --top-k 1 --ignore-eos -no-cnv --verbose-prompt \
        --prompt-cache "$LOG/llama-session.bin" --prompt-cache-all -p "$prompt_text" < /dev/null; then
        agreement "$prompt" "$disk/model.specter" "$run_bin"
    else
        FAILED=1
    fi

    # Rows: NAME, llama.cpp arguments, llama.cpp step, Specter run.
    local rows=()
    step llama-gpu 180 "$lbench" "${lb[@]}" -ngl 99 || FAILED=1
    rows+=("all on the GPU|-ngl 99|llama-gpu|resident")
    local budgets=(high low)
    if [ "${PEER_ROWS:-all}" = gpu ]; then
        budgets=()
        note "PEER_ROWS=gpu: only the all-on-the-GPU row was measured."
    else
        step llama-cpu-experts 240 "$lbench" "${lb[@]}" -ngl 99 -ot "exps=CPU" || FAILED=1
        rows+=("routed experts on the CPU / smallest residency|-ngl 99 -ot exps=CPU|llama-cpu-experts|min")
    fi

    # --n-cpu-moe: N estimated from the two ends, then the nearest one or two values measured.
    local v_all v_none
    v_all=$(vram_mib llama-gpu 2>/dev/null || true)
    v_none=$(vram_mib llama-cpu-experts 2>/dev/null || true)
    local budget
    for budget in "${budgets[@]}"; do
        if [ ! -f "$LOG/specter-$budget.json" ] || [ -z "$v_all" ] || [ -z "$v_none" ]; then
            note "$budget budget: not compared (a run it depends on failed)."
            FAILED=1
            continue
        fi
        local target ns
        target=$(vram_mib "specter-$budget")
        ns=$(python3 "$HERE/peer_llamacpp_report.py" choose-ncmoe --all "$v_all" --none "$v_none" \
            --target "$target" --layers "$layers" --first-moe "$first_moe")
        echo "$budget budget: Specter peaked at $target MiB; llama.cpp -ngl 99 $v_all MiB, experts on the CPU $v_none MiB ($((layers - first_moe)) MoE layers); --n-cpu-moe candidates: $ns"
        local best="" best_gap="" n v gap
        for n in $ns; do
            if [ "$(left)" -lt 40 ] || { [ -n "$best" ] && [ "$(left)" -lt 60 ]; }; then
                note "$budget budget: --n-cpu-moe $n not measured (out of time)."
                break
            fi
            step "llama-ncmoe-$n" 180 "$lbench" "${lb[@]}" -ngl 99 -ncmoe "$n" || continue
            v=$(vram_mib "llama-ncmoe-$n" 2>/dev/null || echo "")
            [ -n "$v" ] || continue
            gap=$((v > target ? v - target : target - v))
            if [ -z "$best" ] || [ "$gap" -lt "$best_gap" ]; then best=$n best_gap=$gap; fi
        done
        if [ -z "$best" ]; then
            note "$budget budget: no --n-cpu-moe run succeeded."
            FAILED=1
            continue
        fi
        rows+=("$budget budget|-ngl 99 --n-cpu-moe $best|llama-ncmoe-$best|$budget")
        for n in $ns; do
            [ "$n" != "$best" ] && [ -s "$LOG/llama-ncmoe-$n.out" ] &&
                rows+=("$budget budget (also measured)|-ngl 99 --n-cpu-moe $n|llama-ncmoe-$n|$budget")
        done
    done

    # Prefill, all on the GPU, when asked: llama-bench pp at each length against Specter's
    # prefill protocol (bench --prompt-tokens) on random prompts of the same lengths.
    if [ -n "${PEER_PREFILL:-}" ]; then
        if [ "$(left)" -ge 120 ]; then
            step llama-prefill 240 "$lbench" -m "$gguf" -p "$PEER_PREFILL" -n 0 -r "$PEER_BENCH_REPS" \
                -t "$PEER_THREADS" -ngl 99 -o json || FAILED=1
            step specter-prefill 300 "$run_bin" bench "$disk/model.specter" --backend cuda \
                --case ds_high --modes resident --prompt-tokens "$PEER_PREFILL" --num-prompts 1 \
                --repeats "$PEER_BENCH_REPS" --json "$LOG/specter-prefill.json" || FAILED=1
        else
            note "PEER_PREFILL=$PEER_PREFILL: no time was left for the prefill rows."
            FAILED=1
        fi
    fi

    # Specter again on an idle machine, as far as time allows (most CPU-sensitive first: the
    # smallest residency computes the most experts on the host).
    local quiet=()
    local again=(min low high resident)
    [ "${PEER_ROWS:-all}" = gpu ] && again=(resident)
    for s in "${again[@]}"; do
        local need=50
        [ "$s" = min ] && need=70
        if [ "$(left)" -ge "$need" ] && specter_run "$s" -quiet; then quiet+=("$s"); fi
    done
    if [ ${#quiet[@]} -gt 0 ]; then
        note "Specter figures are from runs after llama.cpp's, on an idle machine, for: ${quiet[*]}; any other Specter figure is from its first runs (above: whether the llama.cpp build still ran then)."
    else
        note "Specter figures are from its first runs (above: whether the llama.cpp build still ran then); no time was left to repeat them."
    fi

    local row name l_args l_step key s_run
    for row in "${rows[@]}"; do
        IFS='|' read -r name l_args l_step key <<< "$row"
        s_run=specter-$key
        [ -f "$LOG/$s_run-quiet.json" ] && s_run=$s_run-quiet
        [ -f "$LOG/$s_run.json" ] || s_run=""
        printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$l_args" "$([ -s "$LOG/$l_step.out" ] && echo "$l_step.out")" \
            "$l_step" "${s_label[$key]}" "${s_run:+$s_run.json}" "$s_run" >> "$LOG/rows.tsv"
    done
    note "llama.cpp: llama-bench tg$PEER_NEW_TOKENS (no prompt), $PEER_BENCH_REPS repeats after its warm-up, -t $PEER_THREADS, on the $ltype GGUF from llama.cpp's converter (and llama-quantize unless F16). Specter ($precision target): one \`specter-run generate\` of $PEER_NEW_TOKENS greedy tokens on prompt ids $prompt; TPOT excludes the first token."
    [ "$FAILED" = 0 ] || die "some measurements failed (see above and the logs)"
}

# The greedy check: llama.cpp's tokens (from its session file) against Specter's target-only ones.
agreement() {
    local prompt=$1 bundle=$2 run_bin=$3
    local n_prompt
    n_prompt=$(grep -ho 'number of tokens in prompt = [0-9]*' "$LOG/llama-completion.err" "$LOG/llama-completion.out" |
        head -1 | grep -o '[0-9]*$' || true)
    if [ -z "$n_prompt" ] || [ ! -s "$LOG/llama-session.bin" ]; then
        note "llama-completion ran but its prompt length or session file is missing; no greedy check."
        FAILED=1
        return 0
    fi
    local l_prompt s_json=specter-resident.json
    # The ids alone: the session file also holds the KV cache, too large to bring back.
    python3 "$HERE/peer_llamacpp_report.py" session-tokens "$LOG/llama-session.bin" > "$LOG/llama-tokens.txt" || {
        FAILED=1
        return 0
    }
    rm -f "$LOG/llama-session.bin"
    l_prompt=$(cut -d, -f1-"$n_prompt" "$LOG/llama-tokens.txt")
    if [ "$l_prompt" != "$prompt" ]; then
        # llama.cpp added tokens (a BOS, say): give Specter the very same ids for the check.
        note "llama.cpp tokenized the prompt as $l_prompt (Specter's timed runs used $prompt); the greedy check reruns Specter on llama.cpp's ids."
        if step specter-agreement 120 "$run_bin" generate "$bundle" --backend cuda --prompt-ids "$l_prompt" \
            --max-new-tokens "$PEER_NEW_TOKENS" --ignore-eos --json --mode target; then
            cp "$LOG/specter-agreement.out" "$LOG/specter-agreement.json"
            s_json=specter-agreement.json
        else
            FAILED=1
            return 0
        fi
    fi
    printf 'llama_tokens\tllama-tokens.txt\nn_prompt\t%s\nllama_args\t%s\nspecter_json\t%s\nspecter_label\t%s\n' \
        "$n_prompt" "llama-completion -ngl 99 --temp 0 --top-k 1 --ignore-eos" "$s_json" "target-only, all resident" \
        > "$LOG/agreement.tsv"
    local eval_line
    eval_line=$(grep -h " eval time" "$LOG/llama-completion.err" "$LOG/llama-completion.out" 2>/dev/null |
        grep -v "prompt eval" | head -1 | sed 's/^[^:]*: *//' || true)
    [ -z "$eval_line" ] || note "llama-completion (-ngl 99, greedy, prompt of $n_prompt tokens): $eval_line"
}

case "${1:-}" in
    pack) shift; pack "$@" ;;
    run) shift; run "$@" ;;
    *) die "usage: $0 pack DEST LLAMA_SRC_TARBALL | run [deepseek-v2-lite|qwen1.5-moe-a2.7b]" ;;
esac
