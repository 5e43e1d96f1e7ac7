#!/usr/bin/env python3
"""Prints the time-to-first-token table of scripts/gpu-check.sh's ttft step.

Input: a TSV of (tool, variant, cache state, JSON path) rows, one per run; runs of the same
(tool, variant, cache) are summarised by their median first-token time.
"""

import json
import os
import statistics
import sys


def row_of(tool, path):
    d = json.load(open(path))
    wall = None
    if os.path.exists(path + ".wall_ms"):
        wall = float(open(path + ".wall_ms").read().strip())
    if tool == "specter":
        st = d["startup"]
        gpu = d.get("gpu") or {}
        load = gpu.get("load") or {}
        off = gpu.get("offload") or {}
        gbps = load["bytes"] / load["seconds"] / 1e9 if load.get("seconds") else None
        return {
            "first_token_ms": st["first_token_ms"],
            "weights_ms": st["weights_resident_ms"],
            "device_ms": st["device_ready_ms"],
            "load": f"{load.get('io', '-')} {load.get('bytes', 0) / 1e9:.1f} GB {gbps:.1f} GB/s" if gbps else "-",
            "note": (f"offload via {off.get('path')}" if off else "") ,
            "wall_ms": wall,
            "token": d["tokens"][0] if d.get("tokens") else None,
        }
    return {
        "first_token_ms": d["first_token_s"] * 1e3,
        "weights_ms": d["loaded_s"] * 1e3,
        "device_ms": None,
        "load": f"import {d['imported_s']:.1f} s, from_pretrained {d['from_pretrained_s']:.1f} s",
        "note": f"transformers {d['transformers']}",
        "wall_ms": wall,
        "token": d["token"],
        "after_import_ms": d["first_token_after_import_s"] * 1e3,
    }


def fmt(x):
    return "-" if x is None else f"{x:.0f}"


def main():
    groups = {}
    for line in open(sys.argv[1]):
        parts = line.rstrip("\n").split("\t")
        if len(parts) != 4:
            continue
        tool, variant, cache, path = parts
        groups.setdefault((tool, variant, cache), []).append(row_of(tool, path))
    peer_warm = peer_load = None
    for (tool, _, cache), rows in groups.items():
        if tool == "transformers" and cache == "warm":
            peer_warm = statistics.median(r["first_token_ms"] for r in rows)
            peer_load = statistics.median(r["after_import_ms"] for r in rows)
    print("time to first token from process start (ms; median of n runs); vs_peer: transformers warm "
          "from process start / this, and its from_pretrained + first token alone / this")
    print("tool\tvariant\tcache\tn\tfirst_token\tweights\tdevice\tvs_peer\tvs_peer_load\ttoken\tload\tnote")
    for (tool, variant, cache), rows in groups.items():
        med = statistics.median(r["first_token_ms"] for r in rows)
        mid = min(rows, key=lambda r: abs(r["first_token_ms"] - med))
        ratio = f"{peer_warm / med:.1f}x" if peer_warm else "-"
        ratio_load = f"{peer_load / med:.1f}x" if peer_load else "-"
        print("\t".join(str(x) for x in [tool, variant, cache, len(rows), fmt(med), fmt(mid["weights_ms"]),
                                         fmt(mid["device_ms"]), ratio, ratio_load, mid["token"], mid["load"],
                                         mid["note"]]))


if __name__ == "__main__":
    main()
