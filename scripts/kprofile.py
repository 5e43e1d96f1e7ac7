"""Summaries for scripts/gpu-check.sh kprofile.

  kprofile.py gen GEN.json   TPOT and the host issue/wait split of a `generate --json` record
  kprofile.py ncu NCU.csv    per-kernel time per decode step from `ncu --csv` (gpu__time_duration)
"""
import collections
import csv
import json
import sys


def gen(path):
    d = json.load(open(path))
    s, t = d["stats"], d["gpu"].get("host_timing", {})
    print("tpot_ms", round(s["tpot_ms"], 3), "host_timing", t)


def ncu(path):
    rows = list(csv.reader(line for line in open(path) if line.startswith('"')))
    head = rows[0]
    ki, vi, ui = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    total, count = collections.defaultdict(float), collections.Counter()
    for r in rows[1:]:
        name = r[ki].split("(")[0]
        total[name] += float(r[vi].replace(",", "")) * scale[r[ui]]
        count[name] += 1
    steps = count.get("embedding", 0) or 1
    print(f"{sum(count.values())} kernels over {steps} steps (embedding launches)")
    print(f"{'kernel':32} {'launches/step':>13} {'us/step':>9} {'us/launch':>9}")
    for k in sorted(total, key=lambda k: -total[k]):
        print(f"{k:32} {count[k] / steps:13.1f} {total[k] / steps:9.1f} {total[k] / count[k]:9.2f}")
    print(f"{'total':32} {sum(count.values()) / steps:13.1f} {sum(total.values()) / steps:9.1f}")


if __name__ == "__main__":
    {"gen": gen, "ncu": ncu}[sys.argv[1]](sys.argv[2])
