#!/usr/bin/env bash
# A bounded load run against `specter-run serve` on the loopback address: starts the server on a
# bundle, sends a fixed number of streamed completion requests a fixed number at a time, and
# reports latency (p50/p99), time to the first streamed token (p50/p99), errors (must be 0),
# throughput and the server's resident memory before and after. Stops the server with SIGTERM
# and checks it exits 0.
#
#   scripts/load-serve.sh BUNDLE [REQUESTS [CONCURRENCY [MAX_TOKENS]]] [-- SERVE OPTIONS...]
#
# Defaults: 200 requests, 16 at a time, 16 tokens each (greedy, end-of-sequence ignored so every
# request generates the same count). The binary is $SPECTER_RUN, else target/release/specter-run
# (build it with `cargo build --release -p specter-run`). Needs python3 (standard library only).
# Example on the GPU: scripts/load-serve.sh model.specter 200 16 32 -- --backend cuda --resident-experts 16
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

if [ $# -lt 1 ]; then
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
bundle="$1"; shift
requests=200; concurrency=16; max_tokens=16
for var in requests concurrency max_tokens; do
    if [ $# -gt 0 ] && [ "$1" != "--" ]; then
        case "$1" in
            ''|*[!0-9]*) echo "error: $var must be a positive integer, not '$1'" >&2; exit 2 ;;
        esac
        printf -v "$var" '%s' "$1"; shift
    fi
done
[ $# -gt 0 ] && [ "$1" = "--" ] && shift
for var in requests concurrency max_tokens; do
    if [ "${!var}" -lt 1 ]; then echo "error: $var must be at least 1" >&2; exit 2; fi
done
[ -f "$bundle" ] || { echo "error: no bundle at $bundle" >&2; exit 2; }
bin="${SPECTER_RUN:-$ROOT/target/release/specter-run}"
[ -x "$bin" ] || { echo "error: no binary at $bin: cargo build --release -p specter-run, or set SPECTER_RUN" >&2; exit 2; }

work="$(mktemp -d)"
server_pid=""
cleanup() {
    if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
        kill -TERM "$server_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

# Requests may wait in the queue while CONCURRENCY are in flight: make room for all of them.
"$bin" serve "$bundle" --host 127.0.0.1 --port 0 --model-name load --queue-depth "$concurrency" "$@" \
    2> "$work/server.log" &
server_pid=$!

addr=""
for _ in $(seq 1200); do   # loading a large bundle may take minutes; at most 10 here
    addr="$(sed -n 's/.*listening on http:\/\/\([0-9.:]*\).*/\1/p' "$work/server.log" | head -1)"
    [ -n "$addr" ] && break
    if ! kill -0 "$server_pid" 2>/dev/null; then
        echo "error: the server exited while starting:" >&2; cat "$work/server.log" >&2; exit 1
    fi
    sleep 0.5
done
[ -n "$addr" ] || { echo "error: the server did not start listening" >&2; cat "$work/server.log" >&2; exit 1; }

rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$server_pid/status"; }
rss_before="$(rss_kib)"

load_status=0
python3 - "$addr" "$requests" "$concurrency" "$max_tokens" > "$work/report.txt" <<'EOF' || load_status=$?
import http.client, json, statistics, sys, time
from concurrent.futures import ThreadPoolExecutor

addr, requests, concurrency, max_tokens = sys.argv[1], *map(int, sys.argv[2:5])
host, port = addr.rsplit(":", 1)

def one(i):
    body = json.dumps({"model": "load", "prompt": f"Request {i}: the quick brown fox",
                       "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True})
    start = time.perf_counter()
    first = None
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return ("error", f"HTTP {resp.status}: {resp.read()[:200]!r}")
        tokens, done = 0, False
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return ("error", chunk["error"]["message"])
            if first is None and chunk["choices"][0].get("text"):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        if not done:
            return ("error", "the stream ended without [DONE]")
        if tokens != max_tokens:
            return ("error", f"{tokens} tokens instead of {max_tokens}")
        return ("ok", time.perf_counter() - start, first, tokens)
    except Exception as e:  # a refused or broken connection counts as an error
        return ("error", repr(e))
    finally:
        conn.close()

began = time.perf_counter()
with ThreadPoolExecutor(concurrency) as pool:
    results = list(pool.map(one, range(requests)))
wall = time.perf_counter() - began
ok = [r for r in results if r[0] == "ok"]
errors = [r[1] for r in results if r[0] == "error"]

def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))] * 1e3 if values else float("nan")

lat = [r[1] for r in ok]
ttft = [r[2] for r in ok if r[2] is not None]
tokens = sum(r[3] for r in ok)
print(f"requests     {requests} ({concurrency} at a time, {max_tokens} tokens each)")
print(f"completed    {len(ok)}")
print(f"errors       {len(errors)}")
for e in errors[:5]:
    print(f"  error: {e}")
print(f"latency      p50 {pct(lat, 50):.1f} ms, p99 {pct(lat, 99):.1f} ms")
print(f"first token  p50 {pct(ttft, 50):.1f} ms, p99 {pct(ttft, 99):.1f} ms (streamed, queueing included)")
print(f"throughput   {len(ok) / wall:.2f} requests/s, {tokens / wall:.1f} tokens/s over {wall:.1f} s")
sys.exit(1 if errors else 0)
EOF
rss_after="$(rss_kib)"

kill -TERM "$server_pid"
server_status=0
wait "$server_pid" || server_status=$?
server_pid=""

echo "== specter-run serve load: $bundle, serve options: ${*:-(defaults)}"
cat "$work/report.txt"
echo "server RSS   before $((rss_before / 1024)) MiB, after $((rss_after / 1024)) MiB"
echo "server exit  $server_status after SIGTERM"
[ "$load_status" -eq 0 ] && [ "$server_status" -eq 0 ]
