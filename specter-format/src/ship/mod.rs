//! Shipped bundles: a bundle streamed into independently zstd-compressed, checksummed chunks for
//! copying between machines, and streamed back into a verified bundle. docs/FORMAT.md ("Shipped
//! bundles") is the specification.
//!
//! Neither direction holds the bundle in memory: `ship` reads it through its read-only mapping
//! and `unship` reads the shipped file in order, a batch of chunks at a time, compressing or
//! decompressing each batch in parallel and writing it in order.

use std::fs::{File, OpenOptions};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use rayon::prelude::*;
use sha2::{Digest, Sha256};

use crate::header::HEADER_LEN;
use crate::reader::{dtype_of, section_kind_of};
use crate::writer::sync_parent_dir;
use crate::{sha256_hex, Bundle, DType, FormatError, Result, SectionKind};

/// First bytes of a shipped bundle.
pub const SHIP_MAGIC: [u8; 8] = *b"SPECSHP\0";
/// The shipped-bundle format version this crate writes; readers refuse a newer major.
pub const SHIP_MAJOR: u16 = 1;
pub const SHIP_MINOR: u16 = 0;
/// Size of the shipped file's header.
pub const SHIP_HEADER_LEN: usize = 128;
/// Size of the header in front of every chunk's payload.
pub const CHUNK_HEADER_LEN: usize = 104;
/// Size of the trailer that ends a shipped file.
pub const TRAILER_LEN: usize = 96;
/// Uncompressed bytes per chunk unless asked otherwise: large enough that per-chunk overhead
/// (104 bytes, a zstd frame, two hashes) is nothing, small enough for many chunks per core.
pub const DEFAULT_CHUNK_SIZE: u64 = 8 << 20;
/// Bounds on the chunk size: below, overhead grows; above, a batch of chunks in flight takes
/// too much memory.
pub const MIN_CHUNK_SIZE: u64 = 64 << 10;
pub const MAX_CHUNK_SIZE: u64 = 256 << 20;
/// zstd level unless asked otherwise: random-weight FP16 gains little from higher levels.
pub const DEFAULT_LEVEL: i32 = 3;

pub(super) const CHUNK_MAGIC: [u8; 4] = *b"CHNK";
pub(super) const TRAILER_MAGIC: [u8; 8] = *b"SPECEND\0";
/// Chunk flag: the payload is the byte-shuffled chunk (low bytes, then high bytes).
pub(super) const FLAG_SHUFFLED: u32 = 1;
/// Bytes of chunks kept in flight per batch, at most.
pub(super) const BATCH_BYTES: u64 = 1 << 30;
pub(super) const IO_BUFFER: usize = 4 << 20;
/// Header bytes covered by the header checksum (which follows them).
pub(super) const SHIP_HEADER_SUMMED: usize = SHIP_HEADER_LEN - 32;
pub(super) const TRAILER_SUMMED: usize = TRAILER_LEN - 32;

/// How to ship.
#[derive(Debug, Clone)]
pub struct ShipOptions {
    /// Uncompressed bytes per chunk, at most (chunks also end where a section ends).
    pub chunk_size: u64,
    /// zstd compression level.
    pub level: i32,
    /// Byte-shuffle the chunks of sections that mostly hold 2-byte floats.
    pub shuffle: bool,
    /// Check every section's sha256 before shipping, refusing a corrupt bundle.
    pub verify: bool,
    /// Replace an existing output file.
    pub force: bool,
}

impl Default for ShipOptions {
    fn default() -> Self {
        ShipOptions {
            chunk_size: DEFAULT_CHUNK_SIZE,
            level: DEFAULT_LEVEL,
            shuffle: true,
            verify: true,
            force: false,
        }
    }
}

/// How to unship.
#[derive(Debug, Clone, Default)]
pub struct UnshipOptions {
    /// Replace an existing output file.
    pub force: bool,
}

/// Told how shipping or unshipping goes. Every method has a default that does nothing.
pub trait ShipProgress: Sync {
    /// A new stage of `total` bytes begins; the count of bytes done restarts at zero.
    fn stage(&self, _message: &str, _total: u64) {}
    /// `bytes` more bytes of the current stage are done.
    fn advance(&self, _bytes: u64) {}
}

/// Progress that goes nowhere.
pub struct NoProgress;
impl ShipProgress for NoProgress {}

/// Compression of one kind of region of the bundle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KindStats {
    /// `header`, `shared`, `experts`, `draft`, `tokenizer`, `config`, `other` or `manifest`.
    pub kind: &'static str,
    /// Bundle bytes of this kind (a section's trailing padding counts with it).
    pub bytes: u64,
    /// Their compressed payload bytes (chunk headers not counted).
    pub compressed: u64,
    pub chunks: u64,
    /// Chunks stored byte-shuffled.
    pub shuffled: u64,
}

impl KindStats {
    /// Uncompressed over compressed size.
    pub fn ratio(&self) -> f64 {
        self.bytes as f64 / (self.compressed as f64).max(1.0)
    }
}

/// What [`ship`] did.
#[derive(Debug, Clone)]
pub struct ShipReport {
    pub output: PathBuf,
    pub original_len: u64,
    pub shipped_len: u64,
    pub chunks: u64,
    /// Per kind of region, in file order of first appearance.
    pub kinds: Vec<KindStats>,
    /// Whether every section's sha256 was checked before shipping.
    pub verified: bool,
    pub verify_secs: f64,
    pub compress_secs: f64,
}

impl ShipReport {
    pub fn ratio(&self) -> f64 {
        self.original_len as f64 / (self.shipped_len as f64).max(1.0)
    }
}

/// What [`unship`] did.
#[derive(Debug, Clone)]
pub struct UnshipReport {
    pub output: PathBuf,
    pub original_len: u64,
    pub shipped_len: u64,
    pub chunks: u64,
    /// Sections whose sha256 was checked in the rebuilt bundle.
    pub sections_verified: usize,
    pub decompress_secs: f64,
    pub verify_secs: f64,
}

/// One planned chunk of the bundle.
pub(super) struct ChunkPlan {
    pub(super) start: u64,
    pub(super) end: u64,
    /// Index into the report's kinds.
    pub(super) kind: usize,
    pub(super) shuffle: bool,
}

pub(super) fn kind_label(kind: &SectionKind) -> &'static str {
    match kind {
        SectionKind::Shared => "shared",
        SectionKind::Experts { .. } => "experts",
        SectionKind::Draft { .. } => "draft",
        SectionKind::Tokenizer => "tokenizer",
        SectionKind::Config => "config",
        SectionKind::Other => "other",
    }
}

/// Splits the bundle into chunks that never straddle two regions (the header page, each section
/// with its trailing padding, the manifest), so that each chunk has one kind and one shuffle
/// decision.
pub(super) fn plan(bundle: &Bundle, opts: &ShipOptions) -> (Vec<KindStats>, Vec<ChunkPlan>) {
    let manifest = bundle.manifest();
    // Bytes of 2-byte floats per section, to decide where shuffling pays.
    let mut half_bytes = vec![0u64; manifest.sections.len()];
    for t in manifest.tensors.iter() {
        if matches!(dtype_of(&t.dtype), DType::F16 | DType::BF16) {
            if let Some(b) = half_bytes.get_mut(t.section.to_native() as usize) {
                *b += t.length.to_native();
            }
        }
    }
    // (start, length, label, shuffle) of every region but the header.
    let mut regions: Vec<(u64, u64, &'static str, bool)> = manifest
        .sections
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let length = s.length.to_native();
            let shuffle = opts.shuffle && half_bytes[i] > 0 && half_bytes[i] * 2 >= length;
            (
                s.offset.to_native(),
                length,
                kind_label(&section_kind_of(&s.kind)),
                shuffle,
            )
        })
        .collect();
    let header = bundle.header();
    regions.push((
        header.manifest_offset,
        header.manifest_len,
        "manifest",
        false,
    ));
    regions.sort_unstable_by_key(|r| (r.0, r.1));

    let mut kinds: Vec<KindStats> = Vec::new();
    let mut kind_index = |label: &'static str| match kinds.iter().position(|k| k.kind == label) {
        Some(i) => i,
        None => {
            kinds.push(KindStats {
                kind: label,
                bytes: 0,
                compressed: 0,
                chunks: 0,
                shuffled: 0,
            });
            kinds.len() - 1
        }
    };
    let file_len = bundle.file_len();
    let mut bounds: Vec<(u64, &'static str, bool)> = vec![(0, "header", false)];
    bounds.extend(
        regions
            .iter()
            .map(|&(start, _, label, shuffle)| (start, label, shuffle)),
    );
    let mut chunks = Vec::new();
    for (i, &(start, label, shuffle)) in bounds.iter().enumerate() {
        let end = bounds.get(i + 1).map_or(file_len, |b| b.0);
        let kind = kind_index(label);
        let mut at = start;
        while at < end {
            let stop = end.min(at + opts.chunk_size);
            chunks.push(ChunkPlan {
                start: at,
                end: stop,
                kind,
                shuffle,
            });
            at = stop;
        }
    }
    (kinds, chunks)
}

/// An output file being written under a temporary name next to its destination; removed on drop
/// unless committed, so that no error leaves a partial file behind.
pub(super) struct TempOutput {
    pub(super) dest: PathBuf,
    pub(super) temp: PathBuf,
    pub(super) out: Option<BufWriter<File>>,
    pub(super) pos: u64,
    pub(super) committed: bool,
}

impl TempOutput {
    /// Checks the destination (refusing the input itself, and an existing file unless `force`)
    /// and creates `<dir>/.<name>.tmp-<pid>`.
    fn create(dest: &Path, input: &Path, force: bool) -> Result<TempOutput> {
        let bad_path = |reason: String| FormatError::BadOutputPath {
            path: dest.to_path_buf(),
            reason,
        };
        let file_name = dest
            .file_name()
            .ok_or_else(|| bad_path("it does not name a file".into()))?;
        if dest.is_dir() {
            return Err(bad_path("it is a directory".into()));
        }
        let dir = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if !dir.is_dir() {
            return Err(bad_path(format!(
                "its directory {} does not exist",
                dir.display()
            )));
        }
        if dest.symlink_metadata().is_ok() {
            let same = match (dest.canonicalize(), input.canonicalize()) {
                (Ok(a), Ok(b)) => a == b,
                _ => false,
            };
            if same {
                return Err(FormatError::OutputIsInput {
                    path: dest.to_path_buf(),
                });
            }
            if !force {
                return Err(FormatError::OutputExists {
                    path: dest.to_path_buf(),
                });
            }
        }
        let mut temp_name = std::ffi::OsString::from(".");
        temp_name.push(file_name);
        temp_name.push(format!(".tmp-{}", std::process::id()));
        let temp = dir.join(temp_name);
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&temp)
            .map_err(|e| bad_path(format!("cannot create {}: {e}", temp.display())))?;
        Ok(TempOutput {
            dest: dest.to_path_buf(),
            temp,
            out: Some(BufWriter::with_capacity(IO_BUFFER, file)),
            pos: 0,
            committed: false,
        })
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let out = self
            .out
            .as_mut()
            .ok_or_else(|| FormatError::WriterMisuse("write after the output was closed".into()))?;
        out.write_all(bytes)
            .map_err(|e| FormatError::io(format!("writing {}", self.temp.display()), e))?;
        self.pos += bytes.len() as u64;
        Ok(())
    }

    /// Flushes and fsyncs the temporary file; no more writes after this.
    fn close(&mut self) -> Result<()> {
        let temp = self.temp.display().to_string();
        if let Some(out) = self.out.take() {
            let file = out
                .into_inner()
                .map_err(|e| FormatError::io(format!("writing {temp}"), e.into_error()))?;
            file.sync_all()
                .map_err(|e| FormatError::io(format!("syncing {temp} to disk"), e))?;
        }
        Ok(())
    }

    /// Renames the finished file to its destination and makes the rename durable.
    fn commit(mut self, force: bool) -> Result<()> {
        self.close()?;
        // Checked again: the destination may have appeared during the long work.
        if !force && self.dest.symlink_metadata().is_ok() {
            return Err(FormatError::OutputExists {
                path: self.dest.clone(),
            });
        }
        std::fs::rename(&self.temp, &self.dest).map_err(|e| {
            FormatError::io(
                format!(
                    "renaming {} to {}",
                    self.temp.display(),
                    self.dest.display()
                ),
                e,
            )
        })?;
        self.committed = true;
        sync_parent_dir(&self.dest)
    }
}

impl Drop for TempOutput {
    fn drop(&mut self) {
        if !self.committed {
            self.out = None;
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

pub(super) fn check_options(opts: &ShipOptions) -> Result<()> {
    if !(MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&opts.chunk_size) {
        return Err(FormatError::InvalidOption(format!(
            "the chunk size must be between {} KiB and {} MiB, not {} bytes",
            MIN_CHUNK_SIZE >> 10,
            MAX_CHUNK_SIZE >> 20,
            opts.chunk_size
        )));
    }
    let levels = zstd::compression_level_range();
    if !levels.contains(&opts.level) {
        return Err(FormatError::InvalidOption(format!(
            "the zstd level must be between {} and {}, not {}",
            levels.start(),
            levels.end(),
            opts.level
        )));
    }
    Ok(())
}

/// Chunks per batch: enough to keep every thread busy, few enough to bound memory.
pub(super) fn batch_len(chunk_size: u64) -> usize {
    let by_memory = (BATCH_BYTES / chunk_size).max(1) as usize;
    (rayon::current_num_threads() * 2).clamp(1, by_memory)
}

/// Writes `bundle_path` as a shipped file at `out_path` (see docs/FORMAT.md, "Shipped bundles").
///
/// The bundle must open (header and manifest checked); with `opts.verify` every section's sha256
/// is checked first and a corrupt bundle is refused. The output appears only when complete.
pub fn ship(
    bundle_path: &Path,
    out_path: &Path,
    opts: &ShipOptions,
    progress: &dyn ShipProgress,
) -> Result<ShipReport> {
    check_options(opts)?;
    let bundle = Bundle::open(bundle_path)?;
    let mut out = TempOutput::create(out_path, bundle_path, opts.force)?;

    let t0 = Instant::now();
    if opts.verify {
        progress.stage("verifying the bundle", bundle.file_len());
        let reported = AtomicU64::new(0);
        let report = bundle.verify_with_progress(&|total| {
            let before = reported.fetch_max(total, Ordering::Relaxed);
            if total > before {
                progress.advance(total - before);
            }
        });
        report.into_result().map_err(|e| e.in_file(bundle_path))?;
    }
    let verify_secs = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let (mut kinds, chunks) = plan(&bundle, opts);
    let bytes = bundle.as_bytes();
    let header = ShipHeader {
        major: SHIP_MAJOR,
        minor: SHIP_MINOR,
        original_len: bundle.file_len(),
        chunk_size: opts.chunk_size,
        chunk_count: chunks.len() as u64,
        bundle_header_sha256: Sha256::digest(&bytes[..HEADER_LEN]).into(),
    };
    out.write(&header.encode())?;
    progress.stage("compressing chunks", bundle.file_len());
    let mut headers_digest = Sha256::new();
    let compress_batch = |first: u64, batch: &[ChunkPlan]| -> Vec<Result<(ChunkHeader, Vec<u8>)>> {
        batch
            .par_iter()
            .enumerate()
            .map(|(i, c)| {
                let data = &bytes[c.start as usize..c.end as usize];
                let chunk_index = first + i as u64;
                let payload = if c.shuffle {
                    zstd::bulk::compress(&shuffle_bytes(data), opts.level)
                } else {
                    zstd::bulk::compress(data, opts.level)
                }
                .map_err(|e| FormatError::Compress {
                    index: chunk_index,
                    start: c.start,
                    end: c.end,
                    reason: e.to_string(),
                })?;
                let chunk = ChunkHeader {
                    flags: if c.shuffle { FLAG_SHUFFLED } else { 0 },
                    index: chunk_index,
                    offset: c.start,
                    len: c.end - c.start,
                    compressed_len: payload.len() as u64,
                    sha256: Sha256::digest(data).into(),
                    compressed_sha256: Sha256::digest(&payload).into(),
                };
                progress.advance(c.end - c.start);
                Ok((chunk, payload))
            })
            .collect()
    };
    let mut write_batch =
        |batch: &[ChunkPlan], compressed: Vec<Result<(ChunkHeader, Vec<u8>)>>| -> Result<()> {
            for (plan, result) in batch.iter().zip(compressed) {
                let (chunk, payload) = result?;
                let encoded = chunk.encode();
                headers_digest.update(encoded);
                out.write(&encoded)?;
                out.write(&payload)?;
                let stats = &mut kinds[plan.kind];
                stats.bytes += chunk.len;
                stats.compressed += chunk.compressed_len;
                stats.chunks += 1;
                stats.shuffled += u64::from(plan.shuffle);
            }
            Ok(())
        };
    // Each batch is written while the next one is compressed, so that disk writes overlap the
    // compression instead of leaving the cores idle.
    let mut pending: Option<(&[ChunkPlan], Vec<_>)> = None;
    let mut index = 0u64;
    for batch in chunks.chunks(batch_len(opts.chunk_size)) {
        let (written, compressed) = rayon::join(
            || match pending.take() {
                Some((done, results)) => write_batch(done, results),
                None => Ok(()),
            },
            || compress_batch(index, batch),
        );
        written?;
        pending = Some((batch, compressed));
        index += batch.len() as u64;
    }
    if let Some((done, results)) = pending.take() {
        write_batch(done, results)?;
    }
    let trailer = Trailer {
        chunk_count: header.chunk_count,
        original_len: header.original_len,
        offset: out.pos,
        chunk_headers_sha256: headers_digest.finalize().into(),
    };
    out.write(&trailer.encode())?;
    let shipped_len = out.pos;
    out.commit(opts.force)?;
    // A zero-length section at the offset of another yields a kind without chunks.
    kinds.retain(|k| k.chunks > 0);
    Ok(ShipReport {
        output: out_path.to_path_buf(),
        original_len: header.original_len,
        shipped_len,
        chunks: header.chunk_count,
        kinds,
        verified: opts.verify,
        verify_secs,
        compress_secs: t1.elapsed().as_secs_f64(),
    })
}

mod format;
mod unship;
pub use format::*;
pub use unship::*;

#[cfg(test)]
mod tests;
