#!/usr/bin/env bash
# Fuzzes the bundle reader (Bundle::from_slice + verify) for a bounded time.
#
#   scripts/fuzz.sh [SECONDS]        default 60
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`). libFuzzer needs nightly compiler flags; with a
# stable toolchain RUSTC_BOOTSTRAP=1 unlocks them. The corpus is seeded with a small valid bundle
# so the fuzzer starts from real structure instead of random bytes.
set -euo pipefail

seconds="${1:-60}"
root="$(cd "$(dirname "$0")/.." && pwd)"
fuzz_dir="$root/specter-format/fuzz"
corpus="$fuzz_dir/corpus/open_bundle"
mkdir -p "$corpus"

if ! ls "$corpus"/seed-*.specter >/dev/null 2>&1; then
    for seed in 1 2; do
        cargo run --quiet --manifest-path "$root/Cargo.toml" -p specter-format \
            --example write_sample -- "$corpus/seed-$seed.specter" "$seed"
    done
fi

cd "$fuzz_dir"
# The sample bundles are ~20 KB; let inputs grow a little beyond them.
RUSTC_BOOTSTRAP=1 cargo fuzz run -O open_bundle "$corpus" -- \
    -max_total_time="$seconds" -max_len=65536 -print_final_stats=1
