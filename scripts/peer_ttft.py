#!/usr/bin/env python3
"""Peer measurement: Hugging Face transformers' time to first token from process start.

One run = one process: import torch and transformers, from_pretrained(dtype=float16,
device_map="cuda") on the checkpoint directory, then one forward pass over the prompt ids and the
greedy first token, synchronised. Prints one JSON line with seconds from process start (read from
/proc, 10 ms resolution) to each stage, and from the script's first line.

Used by scripts/gpu-check.sh's ttft step, beside `specter-run generate --json`'s startup object:

  python3 scripts/peer_ttft.py DIR [--prompt-ids 5,6,...] [--device cuda]

CPU smoke test: python3 scripts/peer_ttft.py tests/fixtures/deepseek_v2 --device cpu
"""

import os
import time

T_SCRIPT = time.perf_counter()


def process_age_s():
    """Seconds since this process was created (exec), from /proc; None where unavailable."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5); two fields precede ")" split
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


AGE_AT_SCRIPT = process_age_s()

import argparse  # noqa: E402
import json  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--prompt-ids", default=",".join(str(i) for i in range(5, 21)))
    p.add_argument("--device", default="cuda")
    args = p.parse_args()

    def since_start():
        t = time.perf_counter() - T_SCRIPT
        return t + (AGE_AT_SCRIPT or 0.0)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    imported = since_start()
    device = torch.device(args.device)
    kw = {"device_map": args.device} if device.type == "cuda" else {}
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float16, **kw)
    if not kw:
        model = model.to(device)
    model.eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    loaded = since_start()
    prompt = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    with torch.no_grad():
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        token = int(out.logits[:, -1].argmax(-1).item())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first = since_start()
    print(json.dumps({
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "exec_to_script_s": AGE_AT_SCRIPT,
        "imported_s": imported,
        "from_pretrained_s": loaded - imported,
        "loaded_s": loaded,
        "first_token_s": first,
        "first_token_after_import_s": first - imported,
        "token": token,
    }))


if __name__ == "__main__":
    main()
