#!/usr/bin/env python3
"""Helpers for scripts/peer-llamacpp.sh: read what the two engines wrote and print the comparison.

    peer_llamacpp_report.py session-tokens FILE
        token ids saved in a llama.cpp session file (llama-completion --prompt-cache-all), comma separated
    peer_llamacpp_report.py prompt-ids TOKENIZER_JSON TEXT
        the ids a byte-level tokenizer with no merges (specter-pack synth's) gives TEXT, comma separated
    peer_llamacpp_report.py vram-peak GPU_LOG STEPS STEP
        the highest GPU memory use (MiB) that nvidia-smi logged while STEP ran
    peer_llamacpp_report.py choose-ncmoe --all MIB --none MIB --target MIB --layers N --first-moe K
        the --n-cpu-moe values whose estimated VRAM brackets the target, nearest first
    peer_llamacpp_report.py table DIR
        the markdown comparison from what the script wrote in DIR (see table())

GPU_LOG is `nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms N`;
STEPS has one line per step: NAME<TAB>START<TAB>END, times in nvidia-smi's timestamp format.
"""

import argparse
import datetime as dt
import json
import math
import os
import struct
import sys

SESSION_MAGIC = 0x6767736E  # 'ggsn', llama.cpp's session files
TIME_FORMAT = "%Y/%m/%d %H:%M:%S.%f"


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(1)


def session_tokens(path: str) -> list[int]:
    """The token ids at the head of a llama.cpp session file: magic, version, count, ids (u32/i32 LE)."""
    with open(path, "rb") as f:
        head = f.read(12)
        if len(head) < 12:
            fail(f"{path}: too short for a llama.cpp session file")
        magic, version, count = struct.unpack("<III", head)
        if magic != SESSION_MAGIC:
            fail(f"{path}: not a llama.cpp session file (magic {magic:#x})")
        if count > 1 << 24:
            fail(f"{path}: implausible token count {count} (session version {version})")
        body = f.read(4 * count)
        if len(body) != 4 * count:
            fail(f"{path}: {count} tokens announced, file ends early")
    return list(struct.unpack(f"<{count}i", body))


def byte_level_alphabet() -> list[str]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table)."""
    printable = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def prompt_ids(tokenizer_path: str, text: str) -> list[int]:
    with open(tokenizer_path) as f:
        tok = json.load(f)
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or model.get("merges"):
        fail(f"{tokenizer_path}: not a byte-level BPE without merges; its ids cannot be derived byte by byte")
    vocab = model.get("vocab") or {}
    alphabet = byte_level_alphabet()
    ids = []
    for b in text.encode("utf-8"):
        if alphabet[b] not in vocab:
            fail(f"{tokenizer_path}: byte {b:#04x} has no token")
        ids.append(vocab[alphabet[b]])
    return ids


def parse_time(text: str) -> dt.datetime:
    return dt.datetime.strptime(text.strip(), TIME_FORMAT)


def read_gpu_log(path: str) -> list[tuple[dt.datetime, float]]:
    samples = []
    with open(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 2:
                continue
            try:
                samples.append((parse_time(parts[0]), float(parts[1])))
            except ValueError:
                continue  # a header or a torn last line
    return samples


def read_steps(path: str) -> dict[str, tuple[dt.datetime, dt.datetime]]:
    steps = {}
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) == 3:
                steps[parts[0]] = (parse_time(parts[1]), parse_time(parts[2]))
    return steps


def vram_peak_mib(samples, window) -> float | None:
    start, end = window
    inside = [mib for t, mib in samples if start <= t <= end]
    return max(inside) if inside else None


def choose_ncmoe(all_mib: float, none_mib: float, target_mib: float, layers: int, first_moe: int) -> list[int]:
    """--n-cpu-moe N keeps the routed experts of blocks 0..N-1 on the CPU; blocks before first_moe
    have none. VRAM is taken to fall linearly from all_mib (every expert on the GPU) to none_mib (no
    expert on the GPU) as MoE blocks leave, which is what per-block expert tensors of equal size give."""
    moe_blocks = layers - first_moe
    if moe_blocks <= 0:
        fail("the model has no MoE blocks")
    per_block = (all_mib - none_mib) / moe_blocks
    if per_block <= 0:
        fail(f"VRAM with every expert on the GPU ({all_mib} MiB) is not above VRAM with none ({none_mib} MiB)")
    on_gpu = (target_mib - none_mib) / per_block
    candidates = {min(moe_blocks, max(0, math.floor(on_gpu))), min(moe_blocks, max(0, math.ceil(on_gpu)))}
    # N = first_moe + blocks on the CPU; N = 0 would mean no override at all.
    ns = sorted(
        (first_moe + moe_blocks - g for g in candidates),
        key=lambda n: abs(none_mib + (moe_blocks - (n - first_moe)) * per_block - target_mib),
    )
    return [max(n, 1) for n in ns]


def load_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        return {"error": f"{path}: {e}"}


def llama_bench_record(path: str) -> dict | None:
    data = load_json(path)
    if isinstance(data, list) and data:
        return data[-1]
    return None


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def verdict(ratio: float | None) -> str:
    if ratio is None:
        return "-"
    return f"{ratio:.2f}x" + (" (llama.cpp faster)" if ratio < 1 else "")


def fmt(x, digits=2, unit=""):
    return "-" if x is None else f"{x:.{digits}f}{unit}"


def read_kv(path: str) -> dict[str, str]:
    kv = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                key, _, value = line.rstrip("\n").partition("\t")
                if key:
                    kv[key] = value
    return kv


def prefill_table(directory: str) -> None:
    """The prefill rows, where the run made them: llama-prefill.out (llama-bench JSON, one record
    a prompt length) and specter-prefill.json (`specter-run bench --prompt-tokens`)."""
    l_path = os.path.join(directory, "llama-prefill.out")
    s_path = os.path.join(directory, "specter-prefill.json")
    if not os.path.exists(l_path) and not os.path.exists(s_path):
        return
    llama = load_json(l_path) if os.path.exists(l_path) else []
    llama = {r.get("n_prompt"): r for r in llama if isinstance(r, dict)} if isinstance(llama, list) else {}
    specter = load_json(s_path) if os.path.exists(s_path) else {}
    ours = {r.get("prompt_tokens"): r for r in (specter.get("rows") or []) if r.get("mode") == "resident"}
    print()
    print("Prefill, all on the GPU (llama-bench pp, its mean; Specter's prefill protocol, the median "
          "time to first token of its runs on a random prompt of that length):")
    print()
    print("| prompt tokens | llama.cpp tokens/s | Specter TTFT ms | Specter tokens/s | Specter / llama.cpp |")
    print("|---|---|---|---|---|")
    for n in sorted(set(llama) | set(ours), key=lambda v: v or 0):
        l_ts = (llama.get(n) or {}).get("avg_ts")
        row = ours.get(n) or {}
        s_ts = row.get("prefill_tokens_per_s")
        ratio = s_ts / l_ts if s_ts and l_ts else None
        print(f"| {n} | {fmt(l_ts, 0)} | {fmt(row.get('median_ttft_ms'), 1)} | {fmt(s_ts, 0)} | {fmt(ratio)} |")


def table(directory: str) -> None:
    """Markdown from DIR: meta.tsv (KEY<TAB>VALUE), rows.tsv (one comparison a line: name, llama.cpp
    arguments, llama-bench JSON, llama.cpp step, Specter label, Specter JSON, Specter step; files
    relative to DIR, empty where that side did not run), agreement.tsv (KEY<TAB>VALUE) and notes.txt."""
    meta = read_kv(os.path.join(directory, "meta.tsv"))
    samples = read_gpu_log(os.path.join(directory, "gpu-mem.csv"))
    steps = read_steps(os.path.join(directory, "steps.tsv"))

    def peak_gb(step):
        if not step or step not in steps:
            return None
        mib = vram_peak_mib(samples, steps[step])
        return None if mib is None else mib * 2**20 / 1e9

    def in_dir(name):
        return os.path.join(directory, name) if name else None

    print(f"### llama.cpp and Specter on the same weights in one call: {meta.get('preset', '?')}, "
          f"{meta.get('layers', '?')} layers, {meta.get('new_tokens', '?')} new tokens, "
          f"{meta.get('threads', '?')} CPU threads")
    print()
    print(f"llama.cpp: ggml {meta.get('ggml_version', '?')}, built from a source tree with sha256 "
          f"{meta.get('llama_source_sha256', '?')[:16]}...; GPU: {meta.get('gpu', '?')}")
    print()
    print(
        "| row | llama.cpp | llama.cpp ms/token (tok/s) | llama.cpp VRAM GB | Specter | Specter TPOT ms "
        "| Specter VRAM GB (own) | llama.cpp ms / Specter ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows_path = os.path.join(directory, "rows.tsv")
    host_lines = []
    rows = []
    if os.path.exists(rows_path):
        with open(rows_path) as f:
            rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    for row in rows:
        if len(row) != 7:
            fail(f"{rows_path}: a row has {len(row)} fields, not 7: {row}")
        name, l_args, l_json, l_step, s_label, s_json, s_step = row
        lrec = llama_bench_record(in_dir(l_json)) if l_json else None
        sj = load_json(in_dir(s_json)) if s_json else {}
        l_ms = l_ts = None
        if lrec and lrec.get("avg_ns"):
            l_ts = lrec.get("avg_ts")
            l_ms = lrec["avg_ns"] / 1e6 / max(1, lrec.get("n_gen", 1))
        s_ms = (sj.get("stats") or {}).get("tpot_ms")
        own = ((sj.get("gpu") or {}).get("vram_peak_bytes") or 0) / 1e9 or None
        ratio = l_ms / s_ms if l_ms and s_ms else None
        host = sj.get("host_memory") or {}
        if host.get("peak_rss_bytes"):
            host_lines.append(
                f"{name}: peak {fmt(host['peak_rss_bytes'] / 1e9)} GB"
                f" (at the end {fmt((host.get('rss_file_bytes') or 0) / 1e9)} GB of it the bundle's mapped"
                f" pages, {fmt((host.get('rss_anon_bytes') or 0) / 1e9)} GB the process's own)"
            )
        print(
            f"| {name} | `{l_args}` | {fmt(l_ms)} ({fmt(l_ts, 1)}) | {fmt(peak_gb(l_step))} "
            f"| {s_label} | {fmt(s_ms)} | {fmt(peak_gb(s_step))} ({fmt(own)}) | {verdict(ratio)} |"
        )
    print()
    print(
        "VRAM: the GPU's memory in use as nvidia-smi logged it (every 100 ms) at its highest during that "
        "step, CUDA context included; (own): Specter's peak of its own allocations. A ratio above 1 means "
        "Specter is faster."
    )
    if host_lines:
        print()
        print("Specter's host memory (its resident set, as /proc/self/status gave it after the run): "
              + "; ".join(host_lines) + ".")
    agree = read_kv(os.path.join(directory, "agreement.tsv"))
    if agree.get("llama_tokens") and agree.get("specter_json"):
        with open(in_dir(agree["llama_tokens"])) as f:
            session = [int(t) for t in f.read().strip().split(",") if t]
        n_prompt = int(agree["n_prompt"])
        l_prompt, l_gen = session[:n_prompt], session[n_prompt:]
        sj = load_json(in_dir(agree["specter_json"]))
        s_prompt, s_gen = sj.get("prompt_tokens") or [], sj.get("tokens") or []
        n = min(len(l_gen), len(s_gen))
        print()
        if l_prompt != s_prompt:
            print(f"Greedy check: the prompts differ (llama.cpp {l_prompt}, Specter {s_prompt}); no comparison.")
        else:
            print(
                f"Greedy check on prompt ids {','.join(map(str, l_prompt))}: llama.cpp "
                f"(`{agree.get('llama_args', '')}`) and Specter ({agree.get('specter_label', '')}) agree on the "
                f"first {agreeing_prefix(l_gen, s_gen)} of {n} new tokens, and at "
                f"{sum(a == b for a, b in zip(l_gen, s_gen))} of {n} positions."
            )
            print(f"First tokens: llama.cpp {l_gen[:8]}, Specter {s_gen[:8]}.")
    prefill_table(directory)
    notes = os.path.join(directory, "notes.txt")
    if os.path.exists(notes):
        with open(notes) as f:
            text = f.read().strip()
        if text:
            print()
            print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description="helpers for scripts/peer-llamacpp.sh")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("session-tokens")
    p.add_argument("file")
    p = sub.add_parser("prompt-ids")
    p.add_argument("tokenizer")
    p.add_argument("text")
    p = sub.add_parser("vram-peak")
    p.add_argument("gpu_log")
    p.add_argument("steps")
    p.add_argument("step")
    p = sub.add_parser("choose-ncmoe")
    p.add_argument("--all", type=float, required=True, dest="all_mib")
    p.add_argument("--none", type=float, required=True, dest="none_mib")
    p.add_argument("--target", type=float, required=True, dest="target_mib")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--first-moe", type=int, required=True)
    p = sub.add_parser("table")
    p.add_argument("dir")
    args = ap.parse_args()

    if args.cmd == "session-tokens":
        print(",".join(map(str, session_tokens(args.file))))
    elif args.cmd == "prompt-ids":
        print(",".join(map(str, prompt_ids(args.tokenizer, args.text))))
    elif args.cmd == "vram-peak":
        steps = read_steps(args.steps)
        if args.step not in steps:
            fail(f"no step {args.step!r} in {args.steps}")
        mib = vram_peak_mib(read_gpu_log(args.gpu_log), steps[args.step])
        if mib is None:
            fail(f"no GPU memory sample while {args.step} ran")
        print(f"{mib:.0f}")
    elif args.cmd == "choose-ncmoe":
        ns = choose_ncmoe(args.all_mib, args.none_mib, args.target_mib, args.layers, args.first_moe)
        print(" ".join(map(str, ns)))
    else:
        table(args.dir)


if __name__ == "__main__":
    main()
