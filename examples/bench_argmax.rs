//! Greedy argmax over one vocabulary-sized row of logits, the host's work between two device
//! steps of greedy decoding: `specter::decode::argmax` against the in-order scan that defines it.
//!
//!     cargo run --release --example bench_argmax -- [VOCAB]
//!
//! VOCAB defaults to DeepSeek-V2-Lite's 102,400. Reports the fastest of 200 timed calls of each
//! (a warm row in cache, as the decode loop has it right after the copy) and checks that both
//! give the same index.

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specter::decode::{argmax, argmax_scan};

fn fastest(f: fn(&[f32]) -> u32, row: &[f32]) -> (f64, u32) {
    let mut best = f64::MAX;
    let mut index = 0;
    for _ in 0..200 {
        let start = Instant::now();
        index = f(std::hint::black_box(row));
        best = best.min(start.elapsed().as_secs_f64());
    }
    (best * 1e6, index)
}

fn main() -> anyhow::Result<()> {
    let vocab: usize = match std::env::args().nth(1) {
        Some(v) => v
            .parse()
            .map_err(|_| anyhow::anyhow!("VOCAB must be a number of logits, got {v:?}"))?,
        None => 102_400,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let row: Vec<f32> = (0..vocab).map(|_| rng.random_range(-10.0..10.0)).collect();
    let (scan_us, scan_index) = fastest(argmax_scan, &row);
    let (fast_us, fast_index) = fastest(argmax, &row);
    anyhow::ensure!(
        scan_index == fast_index,
        "argmax gave {fast_index}, the scan {scan_index}"
    );
    println!("vocabulary {vocab}: argmax {fast_us:.1} us, in-order scan {scan_us:.1} us");
    Ok(())
}
