"""Summaries for scripts/gpu-check.sh kprofile.

  kprofile.py gen GEN.json     TPOT and the host issue/wait split of a `generate --json` record
  kprofile.py nsys TRACE.csv   per kernel, launches and time per decode step, and the idle gaps
                               between kernels, from `nsys stats --report cuda_gpu_trace`
  kprofile.py ncu NCU.csv      per kernel, time and DRAM bytes per decode step from `ncu --csv`
"""
import collections
import csv
import json
import statistics
import sys


def gen(path):
    d = json.load(open(path))
    s, t = d["stats"], d["gpu"].get("host_timing", {})
    print("tpot_ms", round(s["tpot_ms"], 3), "host_timing", t)


def short(name):
    return name.split("(")[0].split("<")[0].strip()


def nsys(path, last=16):
    """The last `last` one-row steps (those whose embedding launch has one block)."""
    rows = list(csv.DictReader(open(path)))
    kernels = []
    for r in rows:
        name = r.get("Name", "")
        if name.startswith("[CUDA") or not r.get("GrdX"):
            continue
        start, dur = int(r["Start (ns)"]), int(r["Duration (ns)"])
        kernels.append((start, start + dur, short(name), int(r["GrdX"])))
    kernels.sort()
    steps, cur = [], None
    for k in kernels:
        if k[2] == "embedding":
            cur = [] if k[3] == 1 else None
            if cur is not None:
                steps.append(cur)
        if cur is not None:
            cur.append(k)
    steps = steps[-last - 1:-1] if len(steps) > last else steps[:-1]
    if not steps:
        print("no one-row steps found")
        return
    walls, busys, gaps = [], [], []
    total, count = collections.defaultdict(float), collections.Counter()
    for st in steps:
        walls.append((st[-1][1] - st[0][0]) / 1e3)
        busy = 0.0
        end = st[0][0]
        for s, e, name, _ in st:
            if s > end:
                gaps.append((s - end) / 1e3)
            busy += (max(e, end) - max(s, end)) / 1e3
            end = max(end, e)
            total[name] += (e - s) / 1e3
            count[name] += 1
        busys.append(busy)
    n = len(steps)
    print(f"nsys: {n} one-row steps, {sum(count.values()) / n:.0f} kernels per step")
    print(f"  step wall (first kernel start to last kernel end) {statistics.median(walls):.1f} us, "
          f"kernels busy {statistics.median(busys):.1f} us, idle {statistics.median(walls) - statistics.median(busys):.1f} us, "
          f"median gap {statistics.median(gaps) if gaps else 0:.2f} us over {len(gaps) / n:.0f} gaps per step")
    print(f"{'kernel':32} {'launches/step':>13} {'us/step':>9} {'us/launch':>9}")
    for k in sorted(total, key=lambda k: -total[k]):
        print(f"{k:32} {count[k] / n:13.1f} {total[k] / n:9.1f} {total[k] / count[k]:9.2f}")


def ncu(path):
    rows = list(csv.reader(line for line in open(path) if line.startswith('"')))
    head = rows[0]
    ki, ii = head.index("Kernel Name"), head.index("ID")
    mi, vi, ui = head.index("Metric Name"), head.index("Metric Value"), head.index("Metric Unit")
    time_scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    byte_scale = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    launches = {}
    for r in rows[1:]:
        l = launches.setdefault(r[ii], {"name": short(r[ki]), "us": 0.0, "bytes": 0.0})
        v = float(r[vi].replace(",", ""))
        if r[mi] == "gpu__time_duration.sum":
            l["us"] += v * time_scale[r[ui]]
        elif r[mi].startswith("dram__bytes"):
            l["bytes"] += v * byte_scale.get(r[ui], 1.0)
    # Whole steps only: from the first embedding launch (a step's first) up to the last one, so a
    # window that does not start or end at a step's boundary still counts launches per step.
    order = sorted(launches, key=int)
    starts = [i for i, key in enumerate(order) if launches[key]["name"] == "embedding"]
    if len(starts) >= 2:
        order, steps = order[starts[0]:starts[-1]], len(starts) - 1
        what = f"{steps} whole steps (from the first embedding launch to the last)"
    else:
        steps = 1
        what = "the whole window as one step (fewer than two embedding launches)"
    total, count, nbytes = collections.defaultdict(float), collections.Counter(), collections.defaultdict(float)
    for key in order:
        l = launches[key]
        total[l["name"]] += l["us"]
        count[l["name"]] += 1
        nbytes[l["name"]] += l["bytes"]
    print(f"ncu: {sum(count.values())} kernels over {what}")
    print(f"{'kernel':32} {'launches/step':>13} {'us/step':>9} {'us/launch':>9} {'MB/step':>9} {'GB/s':>7}")
    for k in sorted(total, key=lambda k: -total[k]):
        gbs = nbytes[k] / (total[k] * 1e3) if total[k] else 0.0
        print(f"{k:32} {count[k] / steps:13.1f} {total[k] / steps:9.1f} {total[k] / count[k]:9.2f} "
              f"{nbytes[k] / steps / 1e6:9.2f} {gbs:7.0f}")
    t, b = sum(total.values()), sum(nbytes.values())
    print(f"{'total':32} {sum(count.values()) / steps:13.1f} {t / steps:9.1f} {'':9} {b / steps / 1e6:9.2f} "
          f"{b / (t * 1e3) if t else 0:7.0f}")


if __name__ == "__main__":
    {"gen": gen, "ncu": ncu, "nsys": nsys}[sys.argv[1]](sys.argv[2])
