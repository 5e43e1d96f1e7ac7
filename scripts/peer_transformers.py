#!/usr/bin/env python3
"""Peer measurement: Hugging Face transformers decoding the same checkpoint the project benchmarks.

Run it in the same device call as the project's benchmark, on the same Hugging Face checkpoint
directory the bundle was converted from (`specter-pack synth --preset deepseek-v2-lite -o DIR`, or
the one scripts/train_routed_moe.py writes), so the two are measured side by side. It measures:

1. eager, every weight in VRAM: from_pretrained time, the first (cold) call's time to first token,
   then over --repeats runs TTFT and TPOT for the prompt ids and --new-tokens greedy tokens, peak
   VRAM, and the generated token ids (compare them with `specter-run generate --json`'s tokens);
2. accelerate's CPU offload (device_map="auto" with max_memory {0: --offload-budget-gib, "cpu": ...}):
   from_pretrained time, TTFT and TPOT over --offload-tokens tokens, peak VRAM. Give it the GPU
   budget the project's run measured as its peak VRAM, so both have the same memory.

Decoding is a manual greedy loop over transformers' forward with a DynamicCache, synchronising the
device after every token: generate() would stop at the end-of-sequence token (the project's
benchmark uses --ignore-eos) and adds per-step overhead that is not the model's. Timing follows the
paper's protocol: TTFT from the call to the first token, TPOT = (last token's time - first token's
time) / (N - 1), median over repeats. Attention and experts use transformers' defaults for the
installed version (both are recorded).

How to run on the GPU machine (after the project's run on the same DIR):

  python3 scripts/peer_transformers.py DIR --offload-budget-gib 10 --json $OUT/peer.json

Wall time on one H200 for the 27-layer DeepSeek-V2-Lite shape (31 GB): loading about 6 s, eager
decode about 11 s per 128-token run, offloaded load tens of seconds plus about 2 s per token. The
offloaded copy needs the checkpoint's size minus the budget in host RAM.

CPU smoke test: peer_transformers.py tests/fixtures/deepseek_v2 --device cpu --skip-offload
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

DEFAULT_PROMPT = ",".join(str(i) for i in range(5, 21))  # the ids scripts/gpu-check.sh's bench uses


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="Hugging Face checkpoint directory (config.json, *.safetensors)")
    p.add_argument("--prompt-ids", default=DEFAULT_PROMPT, help=f"comma-separated prompt ids (default {DEFAULT_PROMPT})")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens to generate (default 128)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs, after one warm-up (default 3)")
    p.add_argument("--skip-offload", action="store_true", help="measure only the all-in-VRAM case")
    p.add_argument("--offload-budget-gib", type=float,
                   help="GPU memory for accelerate's offload, in GiB: the project's measured peak VRAM")
    p.add_argument("--offload-cpu-gib", type=float,
                   help="host memory accelerate may use (default: 85%% of the machine's RAM)")
    p.add_argument("--offload-tokens", type=int, default=8, help="greedy tokens when offloaded (default 8)")
    p.add_argument("--offload-repeats", type=int, default=1, help="timed offloaded runs (default 1)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu for smoke tests")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"],
                   help="weights' dtype (default float16 on cuda, float32 on cpu)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    args.dtype = args.dtype or ("float16" if args.device.startswith("cuda") else "float32")
    if args.new_tokens < 2 or args.offload_tokens < 2:
        p.error("--new-tokens and --offload-tokens must be at least 2 (TPOT needs two tokens)")
    if not args.skip_offload and args.offload_budget_gib is None:
        p.error("give --offload-budget-gib (the project's peak VRAM in GiB, so both get the same memory) "
                "or --skip-offload")
    return args


def have_accelerate():
    try:
        import accelerate  # noqa: F401
        return True
    except ImportError:
        return False


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def decode(model, prompt, n_new, device):
    """Greedy decode with per-token timestamps taken after the device finished that token."""
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config)
    sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1)
    sync(device)
    stamps = [time.perf_counter()]
    tokens = [nxt]
    for _ in range(n_new - 1):
        out = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1)
        sync(device)
        stamps.append(time.perf_counter())
        tokens.append(nxt)
    tokens = [int(t) for t in torch.cat(tokens).tolist()]
    return {
        "ttft_ms": (stamps[0] - t0) * 1e3,
        "tpot_ms": (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3,
        "e2e_ms_per_token": (stamps[-1] - t0) / len(stamps) * 1e3,
        "tokens": tokens,
    }


def load(args, device, dtype, **kw):
    sync(device)
    t = time.perf_counter()
    if kw:
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype, **kw)
        how = "device_map=" + str(kw.get("device_map"))
    elif device.type != "cpu" and have_accelerate():
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype, device_map=device.type)
        how = f"device_map={device.type}"
    else:
        # Without accelerate transformers takes no device_map: load on the host, then move.
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype).to(device)
        how = "host then .to(device)"
    model.eval()
    sync(device)
    return model, time.perf_counter() - t, how


def impl_names(model):
    cfg = model.config
    return {"attention": getattr(cfg, "_attn_implementation", None),
            "experts": getattr(cfg, "_experts_implementation", None)}


def summarize(runs):
    return {
        "ttft_ms": round(statistics.median(r["ttft_ms"] for r in runs), 3),
        "tpot_ms": round(statistics.median(r["tpot_ms"] for r in runs), 3),
        "e2e_ms_per_token": round(statistics.median(r["e2e_ms_per_token"] for r in runs), 3),
        "tpot_ms_runs": [round(r["tpot_ms"], 3) for r in runs],
        "ttft_ms_runs": [round(r["ttft_ms"], 3) for r in runs],
        "tokens_same_every_run": all(r["tokens"] == runs[0]["tokens"] for r in runs),
        "tokens": runs[0]["tokens"],
    }


def measure_resident(args, device, dtype, prompt):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, load_s, how = load(args, device, dtype)
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    print(f"eager: loaded in {load_s:.2f} s ({how}); {impl_names(model)}", flush=True)
    # The first call pays for kernel selection and allocator growth: reported, not in the median.
    cold = decode(model, prompt, 2, device)
    runs = [decode(model, prompt, args.new_tokens, device) for _ in range(args.repeats)]
    res = {"load_s": round(load_s, 3), "load": how, "first_call_ttft_ms": round(cold["ttft_ms"], 3),
           "implementations": impl_names(model), **summarize(runs)}
    if device.type == "cuda":
        res["weights_vram_bytes"] = weights
        res["peak_vram_bytes"] = torch.cuda.max_memory_allocated(device)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def measure_offload(args, device, dtype, prompt):
    if not have_accelerate():
        return {"skipped": "accelerate is not installed"}
    if device.type != "cuda":
        return {"skipped": "offload needs a CUDA device"}
    cpu_gib = args.offload_cpu_gib
    if cpu_gib is None:
        cpu_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 * 0.85
    max_memory = {device.index or 0: f"{args.offload_budget_gib}GiB", "cpu": f"{cpu_gib:.0f}GiB"}
    torch.cuda.reset_peak_memory_stats(device)
    model, load_s, how = load(args, device, dtype, device_map="auto", max_memory=max_memory)
    placement = {}
    for dev in getattr(model, "hf_device_map", {}).values():
        placement[str(dev)] = placement.get(str(dev), 0) + 1
    print(f"offload: loaded in {load_s:.2f} s under {max_memory}; modules per device {placement}", flush=True)
    cold = decode(model, prompt, 2, device)
    runs = [decode(model, prompt, args.offload_tokens, device) for _ in range(args.offload_repeats)]
    res = {"load_s": round(load_s, 3), "max_memory": max_memory, "modules_per_device": placement,
           "first_call_ttft_ms": round(cold["ttft_ms"], 3), "implementations": impl_names(model),
           **summarize(runs), "peak_vram_bytes": torch.cuda.max_memory_allocated(device)}
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main():
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("CUDA is not available; pass --device cpu --skip-offload for a smoke test")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype)
    prompt = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    with open(os.path.join(args.checkpoint, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    if not prompt or max(prompt) >= vocab or min(prompt) < 0:
        raise SystemExit(f"prompt ids must be in [0, {vocab})")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {name}, {args.dtype}; "
          f"prompt {len(prompt)} ids, {args.new_tokens} new tokens, {args.repeats} repeats", flush=True)

    result = {
        "checkpoint": os.path.basename(os.path.normpath(args.checkpoint)),
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "python": sys.version.split()[0], "accelerate": have_accelerate()},
        "device": name,
        "dtype": args.dtype,
        "prompt_ids": prompt,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "resident": measure_resident(args, device, dtype, prompt),
    }
    if args.skip_offload:
        result["offload"] = {"skipped": "--skip-offload"}
    else:
        result["offload"] = measure_offload(args, device, dtype, prompt)
        off = result["offload"]
        if "tokens" in off:
            # Offload changes where weights live, not the arithmetic: its tokens should be a prefix.
            off["tokens_match_resident"] = off["tokens"] == result["resident"]["tokens"][: len(off["tokens"])]

    def gb(x):
        return f"{x / 1e9:.2f}" if isinstance(x, int) else "-"

    print()
    print(f"{'mode':<28} {'load s':>7} {'TTFT ms':>9} {'TPOT ms':>9} {'e2e ms/tok':>10} {'peak VRAM GB':>12} {'tokens':>6}")
    rows = [("eager, all in VRAM", result["resident"])]
    if "tokens" in result["offload"]:
        rows.append((f"accelerate offload {args.offload_budget_gib:g} GiB", result["offload"]))
    for label, r in rows:
        print(f"{label:<28} {r['load_s']:>7.2f} {r['ttft_ms']:>9.2f} {r['tpot_ms']:>9.2f} "
              f"{r['e2e_ms_per_token']:>10.2f} {gb(r.get('peak_vram_bytes')):>12} {len(r['tokens']):>6}")
    if "skipped" in result["offload"]:
        print(f"offload skipped: {result['offload']['skipped']}")
    toks = result["resident"]["tokens"]
    print(f"greedy tokens ({len(toks)}): {','.join(map(str, toks))}")
    if not result["resident"]["tokens_same_every_run"]:
        print("warning: the repeats did not all give the same tokens")
    if result["offload"].get("tokens_match_resident") is False:
        print("warning: offloaded tokens differ from the all-in-VRAM tokens")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
