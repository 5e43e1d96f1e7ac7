//! How fast this host's threads read memory: the ceiling of the host expert kernel, which reads
//! each expert weight once per pass. `doctor` reports it; the host-expert benchmark divides by it.

use std::time::Instant;

use serde::Serialize;

/// One host read-bandwidth figure.
#[derive(Clone, Debug, Serialize)]
pub struct HostReadBandwidth {
    pub threads: usize,
    pub bytes: usize,
    /// Median over the repeats, bytes per second.
    pub bytes_per_s: f64,
    pub repeats: usize,
}

/// Reads a `bytes`-long buffer (filled first, so every page is real) with `threads` threads, each
/// a contiguous share, `repeats` times; the median rate. The buffer should be well past the
/// last-level cache for the figure to be memory's.
pub fn measure(threads: usize, bytes: usize, repeats: usize) -> HostReadBandwidth {
    let threads = threads.max(1);
    let words = (bytes / 8).max(threads * 512);
    let data: Vec<u64> = (0..words as u64)
        .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect();
    let share = words.div_ceil(threads);
    let mut rates = Vec::with_capacity(repeats.max(1));
    let mut sink = 0u64;
    for _ in 0..repeats.max(1) {
        let start = Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = data
                .chunks(share)
                .map(|part| s.spawn(move || sum_words(part)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0u64, u64::wrapping_add)
        });
        let seconds = start.elapsed().as_secs_f64();
        sink = sink.wrapping_add(total);
        rates.push((words * 8) as f64 / seconds.max(1e-9));
    }
    std::hint::black_box(sink);
    rates.sort_by(f64::total_cmp);
    HostReadBandwidth {
        threads,
        bytes: words * 8,
        bytes_per_s: rates[rates.len() / 2],
        repeats: rates.len(),
    }
}

/// A sum with eight independent chains, which compilers turn into wide loads.
fn sum_words(words: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut chunks = words.chunks_exact(8);
    for c in &mut chunks {
        for (a, w) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(*w);
        }
    }
    let tail: u64 = chunks.remainder().iter().fold(0, |a, w| a.wrapping_add(*w));
    acc.iter().fold(tail, |a, w| a.wrapping_add(*w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sum_reads_every_word() {
        let words: Vec<u64> = (1..=1001).collect();
        assert_eq!(sum_words(&words), 1001 * 1002 / 2);
        let bw = measure(2, 1 << 20, 3);
        assert!(bw.bytes_per_s > 0.0 && bw.bytes >= 1 << 20 && bw.repeats == 3);
    }
}
