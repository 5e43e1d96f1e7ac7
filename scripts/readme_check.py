#!/usr/bin/env python3
"""Runs the README's command blocks as a new user would, read from README.md so they cannot drift.

    python3 scripts/readme_check.py quickstart   # "Set up" and "Run it", verbatim, in the repository
    python3 scripts/readme_check.py commands     # every other command block, on a small model

quickstart runs the two blocks with bash exactly as written and fails unless the demo's output
ends with its lossless check. commands runs, in a scratch folder with target/release on PATH,
every fenced block under "Your own model" and its subsections in order, after writing a small
random DeepSeek-V2 checkpoint where the README names ./DeepSeek-V2-Lite (64 experts, as the
commands' expert counts need, at a fixture's widths) and a calibration text. A command that needs
a GPU (--backend cuda) or keeps running (serve) runs as `<binary> <command> --help` instead, and a
curl line against that server is left out; every other line runs as written. Any failure exits
non-zero, naming the command.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# The demo's last step when speculative decoding gave target-only's tokens.
LOSSLESS = re.compile(r"^\d+\. lossless check: speculative tokens equal target-only tokens$", re.M)


def blocks():
    """(heading path, block text) for every fenced block of README.md."""
    path, out, fence = [], [], None
    for line in README.read_text().splitlines():
        if fence is not None:
            if line.startswith("```"):
                out.append((tuple(path), "\n".join(fence)))
                fence = None
            else:
                fence.append(line)
            continue
        if line.startswith("```"):
            fence = []
            continue
        m = re.match(r"^(#+) (.*)", line)
        if m:
            depth = len(m.group(1))
            path = path[: depth - 1] + [m.group(2).strip()]
    return out


def block_under(heading):
    found = [text for path, text in blocks() if path and path[-1] == heading]
    if len(found) != 1:
        sys.exit(f"README.md: expected one block under '{heading}', found {len(found)}")
    return found[0]


def run_bash(script, cwd, env=None):
    t0 = time.time()
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p.returncode, p.stdout, time.time() - t0


def quickstart():
    for heading in ["Set up", "Run it"]:
        script = block_under(heading)
        print(f"== README '{heading}': {script.strip()}", flush=True)
        rc, out, secs = run_bash(script, ROOT)
        tail = "\n".join(out.rstrip().splitlines()[-15:])
        print(f"{tail}\n-- exit {rc} in {secs:.1f} s", flush=True)
        if rc != 0:
            sys.exit(f"README '{heading}' failed (exit {rc}): {script.strip()}")
        if heading == "Run it" and not LOSSLESS.search(out):
            sys.exit("the demo did not end with its lossless check (speculative tokens equal "
                     "target-only tokens)")


def commands_of(text):
    """The block's command lines, continuation lines joined, comments kept for the record."""
    lines, cur = [], ""
    for raw in text.splitlines():
        if raw.rstrip().endswith("\\"):
            cur += raw.rstrip()[:-1] + " "
            continue
        cur += raw
        if cur.strip():
            lines.append(cur.strip())
        cur = ""
    return lines


def as_help(line):
    """`binary command --help` for a line that needs a GPU or keeps running."""
    words = shlex.split(line, comments=True)
    return f"{words[0]} {words[1]} --help"


def small_model(work):
    """A DeepSeek-V2 checkpoint of a fixture's widths with 64 experts (top 6) at ./DeepSeek-V2-Lite."""
    cfg = json.loads((ROOT / "tests/fixtures/deepseek_v2/config.json").read_text())
    cfg.update({"n_routed_experts": 64, "num_experts_per_tok": 6})
    (work / "small-config.json").write_text(json.dumps(cfg, indent=2))
    rc, out, _ = run_bash("specter-pack synth --config small-config.json -o DeepSeek-V2-Lite", work,
                          env=path_env())
    if rc != 0:
        sys.exit(f"writing the small model failed:\n{out}")
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    (work / "some-text.txt").write_text(text * 40)


def path_env():
    env = dict(os.environ)
    env["PATH"] = f"{ROOT / 'target' / 'release'}:{env.get('PATH', '')}"
    return env


def commands():
    for b in ["specter-pack", "specter-run"]:
        if not (ROOT / "target" / "release" / b).exists():
            sys.exit(f"target/release/{b} is missing: run the README's 'Set up' first")
    todo = [(path, text) for path, text in blocks()
            if len(path) >= 2 and path[1] == "Your own model"]
    if not todo:
        sys.exit("README.md has no command blocks under 'Your own model'")
    rows = []
    with tempfile.TemporaryDirectory(prefix="specter-readme-") as tmp:
        work = Path(tmp)
        small_model(work)
        server_started = False
        for path, text in todo:
            for line in commands_of(text):
                words = shlex.split(line, comments=True)
                if not words:
                    continue
                if words[0] == "curl":
                    if not server_started:
                        rows.append((line, "left out (no server: serve ran as --help)", 0.0))
                        continue
                run, how = line, "as written"
                if "--backend cuda" in line or words[:2] == ["specter-run", "serve"]:
                    run, how = as_help(line), "--help (needs a GPU or keeps running)"
                print(f"== {' / '.join(path)}: {run}", flush=True)
                rc, out, secs = run_bash(run, work, env=path_env())
                print("\n".join(out.rstrip().splitlines()[-6:]), flush=True)
                if rc != 0:
                    print(out)
                    sys.exit(f"README command failed (exit {rc}): {run}")
                rows.append((line, how, secs))
    print("\n| README command | run | seconds |\n|---|---|---|")
    for line, how, secs in rows:
        print(f"| `{line}` | {how} | {secs:.1f} |")


if __name__ == "__main__":
    what = sys.argv[1:] or ["quickstart", "commands"]
    for w in what:
        {"quickstart": quickstart, "commands": commands}[w]()
