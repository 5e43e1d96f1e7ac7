//! The host's work between two device steps when choosing a token from one vocabulary-sized row
//! of logits: greedy argmax, and the sampled distribution (softmax at a temperature, the top-p
//! nucleus), each beside the plain form that defines it (`argmax_scan`,
//! `distribution_by_sort`), which gives the same bits.
//!
//!     cargo run --release --example bench_sampling -- [VOCAB]
//!
//! VOCAB defaults to DeepSeek-V2-Lite's 102,400. Rows: uniform logits in [-10, 10) ("flat": a
//! top-p nucleus of most tokens) and the same with every 97th logit raised by 20 ("peaked": a
//! nucleus of about a thousand tokens). Reports the fastest of repeated calls of each (a warm row
//! in cache, as the decode loop has it right after the copy), and checks both forms agree.

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specter::decode::{argmax, argmax_scan, distribution, distribution_by_sort};

/// Microseconds of the fastest of `repeats` calls, and the last call's result.
fn fastest<T>(repeats: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut best = f64::MAX;
    let mut out = f();
    for _ in 0..repeats {
        let start = Instant::now();
        out = std::hint::black_box(f());
        best = best.min(start.elapsed().as_secs_f64());
    }
    (best * 1e6, out)
}

fn main() -> anyhow::Result<()> {
    let vocab: usize = match std::env::args().nth(1) {
        Some(v) => v
            .parse()
            .map_err(|_| anyhow::anyhow!("VOCAB must be a number of logits, got {v:?}"))?,
        None => 102_400,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let flat: Vec<f32> = (0..vocab).map(|_| rng.random_range(-10.0..10.0)).collect();
    let peaked: Vec<f32> = flat
        .iter()
        .enumerate()
        .map(|(i, &v)| if i % 97 == 0 { v + 20.0 } else { v })
        .collect();
    println!("vocabulary {vocab}; microseconds, fastest call");
    println!("| row | what | fast form | plain form |\n|---|---|---|---|");
    let (fast, a) = fastest(200, || argmax(std::hint::black_box(&flat)));
    let (plain, b) = fastest(200, || argmax_scan(std::hint::black_box(&flat)));
    anyhow::ensure!(a == b, "argmax gave {a}, the scan {b}");
    println!("| flat | greedy argmax | {fast:.1} | {plain:.1} |");
    for (name, row) in [("flat", &flat), ("peaked", &peaked)] {
        for top_p in [1.0f32, 0.9] {
            let (fast, a) = fastest(10, || distribution(row, 0.8, top_p));
            let (plain, b) = fastest(10, || distribution_by_sort(row, 0.8, top_p));
            let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
            anyhow::ensure!(same, "the two distributions differ ({name}, top-p {top_p})");
            println!("| {name} | distribution, temperature 0.8, top-p {top_p} | {fast:.1} | {plain:.1} |");
        }
    }
    Ok(())
}
