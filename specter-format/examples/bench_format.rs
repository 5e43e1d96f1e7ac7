//! Measures the bundle's costs: write throughput and CPU time (in all, and on the writing thread,
//! which is what more cores cannot shorten), open time (median of 20) for a small and a large
//! bundle, and verify throughput (median of 3).
//!
//! Usage: cargo run --release -p specter-format --example bench_format -- \
//!            --dir DIR [--gib 4] [--small-mib 8] [--keep]
//!
//! The large bundle is made of FP16 expert blobs shaped like a mid-sized MoE's (3 x 1408 x 2048
//! halves each), filled from a pool of pseudo-random bytes so that the data is not all zeros.
//! Note: verify right after writing usually reads from the page cache, so it measures hashing,
//! not the disk.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use specter_format::{Bundle, BundleWriter, DType, Provenance, QuantInfo, Result, SectionKind};

const HIDDEN: u64 = 2048;
const INTER: u64 = 1408;
const POOL_BYTES: usize = 64 << 20;

struct Args {
    dir: PathBuf,
    gib: f64,
    small_mib: f64,
    keep: bool,
}

fn parse_args() -> Args {
    let mut args = Args {
        dir: std::env::temp_dir(),
        gib: 4.0,
        small_mib: 8.0,
        keep: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |what: &str| {
            it.next().unwrap_or_else(|| {
                eprintln!("{flag} needs {what}");
                std::process::exit(2)
            })
        };
        let number = |s: String| {
            s.parse::<f64>().unwrap_or_else(|_| {
                eprintln!("not a number: {s}");
                std::process::exit(2)
            })
        };
        match flag.as_str() {
            "--dir" => args.dir = PathBuf::from(value("a directory")),
            "--gib" => args.gib = number(value("a size in GiB")),
            "--small-mib" => args.small_mib = number(value("a size in MiB")),
            "--keep" => args.keep = true,
            _ => {
                eprintln!("usage: bench_format --dir DIR [--gib 4] [--small-mib 8] [--keep]");
                std::process::exit(2)
            }
        }
    }
    args
}

/// Pseudo-random bytes (xorshift64*), generated once and sliced at shifting offsets.
fn random_pool() -> Vec<u8> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut pool = Vec::with_capacity(POOL_BYTES);
    while pool.len() < POOL_BYTES {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        pool.extend_from_slice(&state.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    pool
}

/// Writes a bundle of about `bytes` bytes of expert blobs (at least one expert), spread over MoE
/// layers of 64 experts; returns the file length and the time taken.
fn write_bundle(path: &Path, bytes: u64, pool: &[u8]) -> Result<(u64, Duration)> {
    let start = Instant::now();
    let tensor_bytes = (HIDDEN * INTER * 2) as usize;
    let expert_bytes = 3 * tensor_bytes as u64;
    let experts = (bytes / expert_bytes).max(1);
    let mut w = BundleWriter::create(path)?;
    w.begin_section("shared", SectionKind::Shared)?;
    w.write_tensor(
        "model.norm.weight",
        DType::F16,
        &[HIDDEN],
        &pool[..HIDDEN as usize * 2],
    )?;
    w.end_section()?;
    let mut cursor = 0usize;
    let mut next_slice = || {
        cursor = (cursor + 4_099_999) % (pool.len() - tensor_bytes);
        &pool[cursor..cursor + tensor_bytes]
    };
    let mut written = 0u64;
    let mut layer = 0u32;
    while written < experts {
        w.begin_section(&format!("experts.{layer}"), SectionKind::Experts { layer })?;
        for e in 0..64u32 {
            if written == experts {
                break;
            }
            w.begin_expert(layer, e)?;
            for (proj, shape) in [
                ("gate_proj", [INTER, HIDDEN]),
                ("up_proj", [INTER, HIDDEN]),
                ("down_proj", [HIDDEN, INTER]),
            ] {
                let name = format!("model.layers.{layer}.mlp.experts.{e}.{proj}.weight");
                w.write_tensor(&name, DType::F16, &shape, next_slice())?;
            }
            w.end_expert()?;
            written += 1;
        }
        w.end_section()?;
        layer += 1;
    }
    let provenance = Provenance {
        tool: "bench_format".into(),
        tool_version: env!("CARGO_PKG_VERSION").into(),
        sources: Vec::new(),
        quant: QuantInfo::unquantized(),
        notes: Vec::new(),
    };
    let len = w.finish("bench", "{}", provenance)?;
    Ok((len, start.elapsed()))
}

/// CPU time used by this process so far (all threads), from /proc/self/stat, where available: on
/// a shared machine it shows what the work costs independently of how much CPU it was given.
fn process_cpu_seconds() -> Option<f64> {
    cpu_seconds_from("/proc/self/stat")
}

/// CPU time used so far by the calling thread alone: for the writer, the serial part that more
/// cores cannot shorten.
fn thread_cpu_seconds() -> Option<f64> {
    cpu_seconds_from("/proc/thread-self/stat")
}

fn cpu_seconds_from(stat_path: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(stat_path).ok()?;
    // Fields after the parenthesized command name; utime and stime are fields 14 and 15 overall.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // USER_HZ is 100 on every mainstream Linux configuration.
    Some(ticks / 100.0)
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn main() -> Result<()> {
    let args = parse_args();
    let pool = random_pool();
    let gib = (1u64 << 30) as f64;
    let cases = [
        ("small", (args.small_mib * (1 << 20) as f64) as u64),
        ("large", (args.gib * gib) as u64),
    ];
    for (label, target) in cases {
        let path = args.dir.join(format!("bench-{label}.specter"));
        let cpu_before_write = process_cpu_seconds().zip(thread_cpu_seconds());
        let (len, write_time) = write_bundle(&path, target, &pool)?;
        let write_cpu = cpu_before_write
            .zip(process_cpu_seconds().zip(thread_cpu_seconds()))
            .map(|((all0, own0), (all1, own1))| (all1 - all0, own1 - own0));
        println!(
            "{label}: wrote {:.3} GiB in {:.2} s ({:.2} GB/s, including sha256 and fsync){}",
            len as f64 / gib,
            write_time.as_secs_f64(),
            len as f64 / write_time.as_secs_f64() / 1e9,
            write_cpu.map_or(String::new(), |(all, own)| format!(
                "; CPU {all:.2} s in all, {own:.2} s on the writing thread"
            ))
        );
        let opens: Vec<Duration> = (0..20)
            .map(|_| {
                let start = Instant::now();
                let bundle = Bundle::open(&path)?;
                let elapsed = start.elapsed();
                drop(bundle);
                Ok(elapsed)
            })
            .collect::<Result<_>>()?;
        let bundle = Bundle::open(&path)?;
        println!(
            "{label}: open median of 20: {:.1} us ({} tensors, {} sections)",
            median(opens).as_secs_f64() * 1e6,
            bundle.tensor_names().count(),
            bundle.section_count()
        );
        let mut hashed = 0;
        let cpu_before = process_cpu_seconds();
        let verifies: Vec<Duration> = (0..3)
            .map(|_| {
                let start = Instant::now();
                let report = bundle.verify();
                let elapsed = start.elapsed();
                assert!(
                    report.is_ok(),
                    "freshly written bundle failed verify: {report:?}"
                );
                hashed = report.bytes;
                elapsed
            })
            .collect();
        let cpu = cpu_before.zip(process_cpu_seconds()).map(|(a, b)| b - a);
        let t = median(verifies);
        println!(
            "{label}: verify median of 3: {:.3} s, {:.2} GB/s over {} threads",
            t.as_secs_f64(),
            hashed as f64 / t.as_secs_f64() / 1e9,
            rayon::current_num_threads()
        );
        if let Some(cpu) = cpu.filter(|&c| c > 0.0) {
            println!(
                "{label}: verify CPU cost: {:.2} GB per CPU-second ({:.2} CPU-s for 3 runs)",
                3.0 * hashed as f64 / cpu / 1e9,
                cpu
            );
        }
        drop(bundle);
        if !args.keep {
            std::fs::remove_file(&path).map_err(|e| {
                specter_format::FormatError::Io(format!("removing {}: {e}", path.display()))
            })?;
        }
    }
    Ok(())
}
