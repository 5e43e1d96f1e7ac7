#!/usr/bin/env bash
# The route-fidelity probe on every fixture, RTN draft beside GPTQ draft (data-free calibration),
# over each fixture's golden prompts and greedy continuations. Prints a markdown table.
#
#   scripts/probe-fixtures.sh [BIN_DIR]     # BIN_DIR holds specter-pack and specter-run (default target/release)
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${1:-target/release}"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
echo "| fixture | draft | tokens | token agreement | route recall | route exact match | window recall (16) | held-out error rtn -> gptq |"
echo "|---|---|---|---|---|---|---|---|"
for f in deepseek_v2 deepseek_v2_qlora qwen2_moe phimoe mixtral olmoe qwen3_moe; do
    python3 -c "
import json; g = json.load(open('tests/fixtures/$f/golden.json'))
print(' '.join(str(t) for p, c in zip(g['prompts'], g['greedy']) for t in p + c))" > "$work/$f.ids"
    for q in rtn gptq; do
        "$bin/specter-pack" convert "tests/fixtures/$f" -o "$work/$f-$q.specter" --quant "$q" > "$work/$f-$q.convert" 2>/dev/null
        err=$(grep -o "rtn [0-9.]*, gptq [0-9.]*" "$work/$f-$q.convert" || true)
        "$bin/specter-run" probe "$work/$f-$q.specter" --calib "$work/$f.ids" --depth 16 --json > "$work/$f-$q.json"
        python3 -c "
import json; r = json.load(open('$work/$f-$q.json'))
print('| $f | $q | %d | %.3f | %.3f | %.3f | %.3f | %s |' % (r['tokens'], r['token_agreement'], r['route_recall'], r['route_exact_match'], r['window_recall'], '$err'))"
    done
done
