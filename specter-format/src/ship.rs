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

const CHUNK_MAGIC: [u8; 4] = *b"CHNK";
const TRAILER_MAGIC: [u8; 8] = *b"SPECEND\0";
/// Chunk flag: the payload is the byte-shuffled chunk (low bytes, then high bytes).
const FLAG_SHUFFLED: u32 = 1;
/// Bytes of chunks kept in flight per batch, at most.
const BATCH_BYTES: u64 = 1 << 30;
const IO_BUFFER: usize = 4 << 20;
/// Header bytes covered by the header checksum (which follows them).
const SHIP_HEADER_SUMMED: usize = SHIP_HEADER_LEN - 32;
const TRAILER_SUMMED: usize = TRAILER_LEN - 32;

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

/// The decoded header of a shipped file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShipHeader {
    pub major: u16,
    pub minor: u16,
    /// Length of the bundle.
    pub original_len: u64,
    /// Most uncompressed bytes in one chunk.
    pub chunk_size: u64,
    pub chunk_count: u64,
    /// sha256 of the bundle's header page, which names the manifest's sha256, which names every
    /// section's: the identity of the whole bundle.
    pub bundle_header_sha256: [u8; 32],
}

impl ShipHeader {
    pub fn encode(&self) -> [u8; SHIP_HEADER_LEN] {
        let mut b = [0u8; SHIP_HEADER_LEN];
        b[0..8].copy_from_slice(&SHIP_MAGIC);
        b[8..10].copy_from_slice(&self.major.to_le_bytes());
        b[10..12].copy_from_slice(&self.minor.to_le_bytes());
        b[12..16].copy_from_slice(&(SHIP_HEADER_LEN as u32).to_le_bytes());
        // 16..24: flags, none defined.
        b[24..32].copy_from_slice(&self.original_len.to_le_bytes());
        b[32..40].copy_from_slice(&self.chunk_size.to_le_bytes());
        b[40..48].copy_from_slice(&self.chunk_count.to_le_bytes());
        b[48..80].copy_from_slice(&self.bundle_header_sha256);
        let sum: [u8; 32] = Sha256::digest(&b[..SHIP_HEADER_SUMMED]).into();
        b[SHIP_HEADER_SUMMED..].copy_from_slice(&sum);
        b
    }

    /// Decodes and checks a shipped file's first bytes (all of them if the file is shorter than
    /// a header, so that a short file is reported as truncated rather than foreign).
    pub fn decode(bytes: &[u8]) -> Result<ShipHeader> {
        if bytes.len() < SHIP_MAGIC.len() {
            if SHIP_MAGIC.starts_with(bytes) {
                return Err(truncated_header(bytes.len()));
            }
            return Err(FormatError::NotShipped {
                found: bytes.to_vec(),
            });
        }
        if bytes[..8] != SHIP_MAGIC {
            return Err(FormatError::NotShipped {
                found: bytes[..8].to_vec(),
            });
        }
        let Some(b) = bytes.get(..SHIP_HEADER_LEN) else {
            return Err(truncated_header(bytes.len()));
        };
        // A newer major may have moved everything, the checksum included: check it first.
        let major = u16_at(b, 8);
        if major > SHIP_MAJOR {
            return Err(FormatError::ShippedNewerMajor {
                found: major,
                supported: SHIP_MAJOR,
            });
        }
        let sum: [u8; 32] = Sha256::digest(&b[..SHIP_HEADER_SUMMED]).into();
        if sum[..] != b[SHIP_HEADER_SUMMED..] {
            return Err(FormatError::ShippedHeaderCorrupt(
                "its sha256 does not match its bytes".into(),
            ));
        }
        let bad = |what: String| Err(FormatError::ShippedHeaderCorrupt(what));
        if major == 0 {
            return bad("it says format version 0, which does not exist".into());
        }
        let header_len = u32::from_le_bytes(b[12..16].try_into().expect("4 bytes"));
        if header_len as usize != SHIP_HEADER_LEN {
            return bad(format!(
                "it says it is {header_len} bytes long, but version {major}.x headers are \
                 {SHIP_HEADER_LEN}"
            ));
        }
        let flags = u64_at(b, 16);
        if flags != 0 {
            return bad(format!("it has flags {flags:#x}, and none are defined"));
        }
        let header = ShipHeader {
            major,
            minor: u16_at(b, 10),
            original_len: u64_at(b, 24),
            chunk_size: u64_at(b, 32),
            chunk_count: u64_at(b, 40),
            bundle_header_sha256: b[48..80].try_into().expect("32 bytes"),
        };
        if !(MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&header.chunk_size) {
            return bad(format!(
                "its chunk size {} is outside {MIN_CHUNK_SIZE}..={MAX_CHUNK_SIZE}",
                header.chunk_size
            ));
        }
        if header.original_len < HEADER_LEN as u64 {
            return bad(format!(
                "it says the bundle is {} bytes, shorter than a bundle header",
                header.original_len
            ));
        }
        // Chunks hold 1..=chunk_size bytes each and cover the bundle exactly.
        let fewest = header.original_len.div_ceil(header.chunk_size);
        if header.chunk_count < fewest || header.chunk_count > header.original_len {
            return bad(format!(
                "{} chunks cannot hold a {}-byte bundle in chunks of at most {} bytes",
                header.chunk_count, header.original_len, header.chunk_size
            ));
        }
        Ok(header)
    }
}

fn truncated_header(len: usize) -> FormatError {
    FormatError::ShippedTruncated {
        at: len as u64,
        what: format!("inside its {SHIP_HEADER_LEN}-byte header"),
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// The fixed-size header in front of one chunk's payload.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ChunkHeader {
    flags: u32,
    index: u64,
    /// Where the chunk's bytes go in the bundle.
    offset: u64,
    len: u64,
    compressed_len: u64,
    /// sha256 of the chunk's bundle bytes (before any shuffle).
    sha256: [u8; 32],
    /// sha256 of the payload as stored.
    compressed_sha256: [u8; 32],
}

impl ChunkHeader {
    fn encode(&self) -> [u8; CHUNK_HEADER_LEN] {
        let mut b = [0u8; CHUNK_HEADER_LEN];
        b[0..4].copy_from_slice(&CHUNK_MAGIC);
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.index.to_le_bytes());
        b[16..24].copy_from_slice(&self.offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..40].copy_from_slice(&self.compressed_len.to_le_bytes());
        b[40..72].copy_from_slice(&self.sha256);
        b[72..104].copy_from_slice(&self.compressed_sha256);
        b
    }

    fn decode(b: &[u8; CHUNK_HEADER_LEN]) -> std::result::Result<ChunkHeader, String> {
        if b[0..4] != CHUNK_MAGIC {
            return Err(format!(
                "its header starts with {:02x?}, not \"CHNK\"",
                &b[0..4]
            ));
        }
        Ok(ChunkHeader {
            flags: u32_at(b, 4),
            index: u64_at(b, 8),
            offset: u64_at(b, 16),
            len: u64_at(b, 24),
            compressed_len: u64_at(b, 32),
            sha256: b[40..72].try_into().expect("32 bytes"),
            compressed_sha256: b[72..104].try_into().expect("32 bytes"),
        })
    }
}

/// The trailer that ends a shipped file: without it the file is known to be cut short.
struct Trailer {
    chunk_count: u64,
    original_len: u64,
    /// Where the trailer starts in the shipped file.
    offset: u64,
    /// sha256 of every chunk header, in order.
    chunk_headers_sha256: [u8; 32],
}

impl Trailer {
    fn encode(&self) -> [u8; TRAILER_LEN] {
        let mut b = [0u8; TRAILER_LEN];
        b[0..8].copy_from_slice(&TRAILER_MAGIC);
        b[8..16].copy_from_slice(&self.chunk_count.to_le_bytes());
        b[16..24].copy_from_slice(&self.original_len.to_le_bytes());
        b[24..32].copy_from_slice(&self.offset.to_le_bytes());
        b[32..64].copy_from_slice(&self.chunk_headers_sha256);
        let sum: [u8; 32] = Sha256::digest(&b[..TRAILER_SUMMED]).into();
        b[TRAILER_SUMMED..].copy_from_slice(&sum);
        b
    }

    fn decode(b: &[u8; TRAILER_LEN]) -> std::result::Result<Trailer, String> {
        if b[0..8] != TRAILER_MAGIC {
            return Err(format!(
                "it starts with {:02x?}, not \"SPECEND\\0\"",
                &b[0..8]
            ));
        }
        let sum: [u8; 32] = Sha256::digest(&b[..TRAILER_SUMMED]).into();
        if sum[..] != b[TRAILER_SUMMED..] {
            return Err("its sha256 does not match its bytes".into());
        }
        Ok(Trailer {
            chunk_count: u64_at(b, 8),
            original_len: u64_at(b, 16),
            offset: u64_at(b, 24),
            chunk_headers_sha256: b[32..64].try_into().expect("32 bytes"),
        })
    }
}

/// The 2-byte elements of `data` as two planes: every low byte, then every high byte (an odd last
/// byte stays last). The high bytes of FP16 weights (sign and exponent) take few values, so as a
/// plane of their own they compress far better than interleaved with the near-random low bytes.
pub fn shuffle_bytes(data: &[u8]) -> Vec<u8> {
    let pairs = data.len() / 2;
    let mut out = vec![0u8; data.len()];
    let (low, rest) = out.split_at_mut(pairs);
    let (high, tail) = rest.split_at_mut(pairs);
    for (i, pair) in data.chunks_exact(2).enumerate() {
        low[i] = pair[0];
        high[i] = pair[1];
    }
    tail.copy_from_slice(&data[pairs * 2..]);
    out
}

/// The inverse of [`shuffle_bytes`].
pub fn unshuffle_bytes(data: &[u8]) -> Vec<u8> {
    let pairs = data.len() / 2;
    let mut out = vec![0u8; data.len()];
    let (low, high) = data.split_at(pairs);
    for (i, pair) in out.chunks_exact_mut(2).enumerate() {
        pair[0] = low[i];
        pair[1] = high[i];
    }
    out[pairs * 2..].copy_from_slice(&high[pairs..]);
    out
}

/// One planned chunk of the bundle.
struct ChunkPlan {
    start: u64,
    end: u64,
    /// Index into the report's kinds.
    kind: usize,
    shuffle: bool,
}

fn kind_label(kind: &SectionKind) -> &'static str {
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
fn plan(bundle: &Bundle, opts: &ShipOptions) -> (Vec<KindStats>, Vec<ChunkPlan>) {
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
struct TempOutput {
    dest: PathBuf,
    temp: PathBuf,
    out: Option<BufWriter<File>>,
    pos: u64,
    committed: bool,
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

fn check_options(opts: &ShipOptions) -> Result<()> {
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
fn batch_len(chunk_size: u64) -> usize {
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

/// The shipped file being read in order, knowing where it is.
struct Input {
    reader: BufReader<File>,
    pos: u64,
    path: PathBuf,
}

impl Input {
    /// Fills `buf` as far as the file allows; returns how many bytes were read.
    fn read_up_to(&mut self, buf: &mut [u8]) -> Result<usize> {
        let mut filled = 0;
        while filled < buf.len() {
            match self.reader.read(&mut buf[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(FormatError::io(
                        format!("reading {}", self.path.display()),
                        e,
                    ))
                }
            }
        }
        self.pos += filled as u64;
        Ok(filled)
    }

    /// Fills `buf`, or says the file is truncated: `where_` if it ends before the first byte,
    /// `inside` if it ends part-way.
    fn read_exact(&mut self, buf: &mut [u8], where_: &str, inside: &str) -> Result<()> {
        let n = self.read_up_to(buf)?;
        if n < buf.len() {
            return Err(FormatError::ShippedTruncated {
                at: self.pos,
                what: if n == 0 {
                    where_.to_string()
                } else {
                    inside.to_string()
                },
            });
        }
        Ok(())
    }
}

/// A chunk read from the shipped file, not yet checked beyond its header.
struct ReadChunk {
    header: ChunkHeader,
    /// Where its header starts in the shipped file.
    at: u64,
    payload: Vec<u8>,
}

/// Rebuilds the bundle held in the shipped file `shipped` at `out_path`: every chunk's checksums
/// are checked as it is read, the rebuilt bundle's every section is verified, and only then does
/// it appear under `out_path`. On any error nothing is left behind.
pub fn unship(
    shipped: &Path,
    out_path: &Path,
    opts: &UnshipOptions,
    progress: &dyn ShipProgress,
) -> Result<UnshipReport> {
    let file = File::open(shipped)
        .map_err(|e| FormatError::io(format!("opening {}", shipped.display()), e))?;
    let metadata = file
        .metadata()
        .map_err(|e| FormatError::io(format!("reading the size of {}", shipped.display()), e))?;
    if !metadata.is_file() {
        return Err(FormatError::Io(format!(
            "{} is not a regular file; pass the path of a shipped bundle",
            shipped.display()
        )));
    }
    let mut input = Input {
        reader: BufReader::with_capacity(IO_BUFFER, file),
        pos: 0,
        path: shipped.to_path_buf(),
    };
    let mut head = [0u8; SHIP_HEADER_LEN];
    let n = input.read_up_to(&mut head)?;
    let header = ShipHeader::decode(&head[..n]).map_err(|e| e.in_file(shipped))?;
    let mut out = TempOutput::create(out_path, shipped, opts.force)?;

    let t0 = Instant::now();
    unpack_chunks(&mut input, &header, &mut out, metadata.len(), progress)
        .map_err(|e| e.in_file(shipped))?;
    out.close()?;
    let decompress_secs = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    progress.stage("verifying the rebuilt bundle", header.original_len);
    let rebuilt = |e: FormatError| FormatError::UnshippedInvalid(Box::new(e.into_root()));
    let bundle = Bundle::open(&out.temp).map_err(|e| rebuilt(e).in_file(shipped))?;
    let identity: [u8; 32] = Sha256::digest(&bundle.as_bytes()[..HEADER_LEN]).into();
    if identity != header.bundle_header_sha256 {
        return Err(FormatError::ShippedHeaderCorrupt(format!(
            "it records a bundle whose header hashes to {}, but the chunks rebuild one whose \
             header hashes to {}",
            sha256_hex(&header.bundle_header_sha256),
            sha256_hex(&identity)
        ))
        .in_file(shipped));
    }
    let reported = AtomicU64::new(0);
    let report = bundle.verify_with_progress(&|total| {
        let before = reported.fetch_max(total, Ordering::Relaxed);
        if total > before {
            progress.advance(total - before);
        }
    });
    let sections_verified = report.sections.len();
    report
        .into_result()
        .map_err(|e| rebuilt(e).in_file(shipped))?;
    drop(bundle);
    let verify_secs = t1.elapsed().as_secs_f64();
    out.commit(opts.force)?;
    Ok(UnshipReport {
        output: out_path.to_path_buf(),
        original_len: header.original_len,
        shipped_len: metadata.len(),
        chunks: header.chunk_count,
        sections_verified,
        decompress_secs,
        verify_secs,
    })
}

/// A batch of chunks read: the chunks, the error that stopped reading if any, whether chunks remain.
type ReadBatch = (Vec<ReadChunk>, Option<FormatError>, bool);

/// Reads, checks and writes every chunk, then checks the trailer and that nothing follows it.
fn unpack_chunks(
    input: &mut Input,
    header: &ShipHeader,
    out: &mut TempOutput,
    shipped_len: u64,
    progress: &dyn ShipProgress,
) -> Result<()> {
    let count = header.chunk_count;
    let most_compressed = zstd::zstd_safe::compress_bound(header.chunk_size as usize) as u64;
    progress.stage("decompressing chunks", header.original_len);
    let mut headers_digest = Sha256::new();
    let mut next_offset = 0u64;
    let mut index = 0u64;
    let per_batch = batch_len(header.chunk_size) as u64;
    // Reads the next batch of chunks: the chunks read, the error that stopped reading if any (kept
    // until the chunks before it are checked: a wrong length in one chunk shifts everything after
    // it, so the damaged chunk is the one to name), and whether chunks remain.
    let mut read_batch = |input: &mut Input| -> ReadBatch {
        let mut read = Vec::new();
        let end = count.min(index + per_batch);
        while index < end {
            match read_chunk(input, header, index, next_offset, most_compressed) {
                Ok((raw, chunk)) => {
                    headers_digest.update(raw);
                    next_offset += chunk.header.len;
                    index += 1;
                    read.push(chunk);
                }
                Err(e) => return (read, Some(e), true),
            }
        }
        (read, None, index < count)
    };
    let check = |read: &[ReadChunk]| -> Vec<Result<Vec<u8>>> {
        read.par_iter()
            .map(|c| {
                let data = check_chunk(c, count);
                progress.advance(c.header.len);
                data
            })
            .collect()
    };
    let write = |out: &mut TempOutput, checked: Vec<Result<Vec<u8>>>| -> Result<()> {
        for data in checked {
            out.write(&data?)?;
        }
        Ok(())
    };
    // Each batch is checked while the one before it is written and the one after it read, so that
    // disk reads and writes overlap the decompression. Errors still surface in file order.
    let (mut read, mut read_error, mut more) = read_batch(input);
    let mut checked_before: Option<Vec<Result<Vec<u8>>>> = None;
    loop {
        let fetch = read_error.is_none() && more;
        let (io, checked) = rayon::join(
            || -> Result<Option<ReadBatch>> {
                if let Some(before) = checked_before.take() {
                    write(out, before)?;
                }
                Ok(fetch.then(|| read_batch(input)))
            },
            || check(&read),
        );
        let next = io?;
        if let Some(e) = read_error.take() {
            write(out, checked)?;
            return Err(e);
        }
        checked_before = Some(checked);
        match next {
            Some((r, e, m)) => (read, read_error, more) = (r, e, m),
            None => break,
        }
    }
    if let Some(before) = checked_before {
        write(out, before)?;
    }
    if next_offset != header.original_len {
        return Err(FormatError::ShippedTrailer {
            offset: input.pos,
            reason: format!(
                "the {count} chunks cover {next_offset} bytes of the {}-byte bundle",
                header.original_len
            ),
        });
    }
    let offset = input.pos;
    let mut raw = [0u8; TRAILER_LEN];
    input.read_exact(
        &mut raw,
        "where the trailer should start",
        "inside the trailer",
    )?;
    let bad = |reason: String| FormatError::ShippedTrailer { offset, reason };
    let trailer = Trailer::decode(&raw).map_err(bad)?;
    if trailer.chunk_count != count || trailer.original_len != header.original_len {
        return Err(bad(format!(
            "it says {} chunks of a {}-byte bundle, the header {count} of {}",
            trailer.chunk_count, trailer.original_len, header.original_len
        )));
    }
    if trailer.offset != offset {
        return Err(bad(format!("it says it starts at byte {}", trailer.offset)));
    }
    let digest: [u8; 32] = headers_digest.finalize().into();
    if digest != trailer.chunk_headers_sha256 {
        return Err(bad(
            "the chunk headers read do not hash to the sha256 it records".into(),
        ));
    }
    if shipped_len > input.pos {
        return Err(bad(format!(
            "{} bytes follow it; a shipped file ends with its trailer",
            shipped_len - input.pos
        )));
    }
    Ok(())
}

/// Reads chunk `index`'s header and payload, checking the header against what must come next.
fn read_chunk(
    input: &mut Input,
    header: &ShipHeader,
    index: u64,
    next_offset: u64,
    most_compressed: u64,
) -> Result<([u8; CHUNK_HEADER_LEN], ReadChunk)> {
    let count = header.chunk_count;
    let at = input.pos;
    let corrupt = |reason: String| FormatError::ChunkCorrupt {
        index,
        count,
        offset: at,
        reason,
    };
    let mut raw = [0u8; CHUNK_HEADER_LEN];
    input.read_exact(
        &mut raw,
        &format!("where chunk {index} of {count} should start"),
        &format!("inside the header of chunk {index} of {count}"),
    )?;
    let chunk = ChunkHeader::decode(&raw).map_err(corrupt)?;
    if chunk.flags & !FLAG_SHUFFLED != 0 {
        return Err(corrupt(format!(
            "it has flags {:#x}, of which only {FLAG_SHUFFLED:#x} is defined",
            chunk.flags
        )));
    }
    if chunk.index != index {
        return Err(corrupt(format!(
            "its header says it is chunk {}: chunks are missing, repeated or out of order",
            chunk.index
        )));
    }
    if chunk.offset != next_offset {
        return Err(corrupt(format!(
            "it says it starts at bundle byte {}, but the chunk before it ends at {}",
            chunk.offset, next_offset
        )));
    }
    if chunk.len == 0
        || chunk.len > header.chunk_size
        || chunk.len > header.original_len - chunk.offset
    {
        return Err(corrupt(format!(
            "it says it holds {} bundle bytes from byte {}, which does not fit chunks of \
             at most {} bytes of a {}-byte bundle",
            chunk.len, chunk.offset, header.chunk_size, header.original_len
        )));
    }
    if chunk.compressed_len > most_compressed {
        return Err(corrupt(format!(
            "it says its payload is {} bytes, more than zstd ever needs for {} bytes",
            chunk.compressed_len, header.chunk_size
        )));
    }
    // Bounded above by compress_bound(chunk_size), so this allocation is bounded too.
    let mut payload = vec![0u8; chunk.compressed_len as usize];
    input.read_exact(
        &mut payload,
        &format!("where the payload of chunk {index} of {count} should start"),
        &format!("inside the payload of chunk {index} of {count}"),
    )?;
    Ok((
        raw,
        ReadChunk {
            header: chunk,
            at,
            payload,
        },
    ))
}

/// Checks a chunk's payload against its sha256, decompresses and un-shuffles it, and checks the
/// result against the sha256 of the bundle bytes it stands for.
fn check_chunk(c: &ReadChunk, count: u64) -> Result<Vec<u8>> {
    let h = &c.header;
    let corrupt = |reason: String| FormatError::ChunkCorrupt {
        index: h.index,
        count,
        offset: c.at,
        reason: format!("{reason} (bundle bytes {}..{})", h.offset, h.offset + h.len),
    };
    let compressed_sha: [u8; 32] = Sha256::digest(&c.payload).into();
    if compressed_sha != h.compressed_sha256 {
        return Err(corrupt(
            "its compressed bytes do not match the sha256 its header records".into(),
        ));
    }
    let data = zstd::bulk::decompress(&c.payload, h.len as usize)
        .map_err(|e| corrupt(format!("its payload does not decompress ({e})")))?;
    if data.len() as u64 != h.len {
        return Err(corrupt(format!(
            "it decompresses to {} bytes, but its header says {}",
            data.len(),
            h.len
        )));
    }
    let data = if h.flags & FLAG_SHUFFLED != 0 {
        unshuffle_bytes(&data)
    } else {
        data
    };
    let sha: [u8; 32] = Sha256::digest(&data).into();
    if sha != h.sha256 {
        return Err(corrupt(
            "its decompressed bytes do not match the sha256 its header records".into(),
        ));
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffle_round_trips_even_and_odd_lengths() {
        for len in [0usize, 1, 2, 3, 10, 4097] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 3) as u8).collect();
            let shuffled = shuffle_bytes(&data);
            assert_eq!(shuffled.len(), len);
            assert_eq!(unshuffle_bytes(&shuffled), data, "length {len}");
            if len >= 4 {
                // Low bytes first, then high bytes.
                assert_eq!(shuffled[0], data[0]);
                assert_eq!(shuffled[1], data[2]);
                assert_eq!(shuffled[len / 2], data[1]);
            }
        }
    }

    #[test]
    fn every_bit_of_the_header_is_checked() {
        let header = ShipHeader {
            major: SHIP_MAJOR,
            minor: SHIP_MINOR,
            original_len: 1 << 20,
            chunk_size: DEFAULT_CHUNK_SIZE,
            chunk_count: 1,
            bundle_header_sha256: [7; 32],
        };
        let bytes = header.encode();
        assert_eq!(ShipHeader::decode(&bytes).unwrap(), header);
        for byte in 0..SHIP_HEADER_LEN {
            for bit in 0..8 {
                let mut damaged = bytes;
                damaged[byte] ^= 1 << bit;
                let err = ShipHeader::decode(&damaged).unwrap_err();
                assert!(
                    matches!(
                        err,
                        FormatError::NotShipped { .. }
                            | FormatError::ShippedNewerMajor { .. }
                            | FormatError::ShippedHeaderCorrupt(_)
                    ),
                    "byte {byte} bit {bit}: {err}"
                );
            }
        }
    }

    #[test]
    fn a_short_header_is_truncated_and_a_foreign_one_is_not_shipped() {
        let header = ShipHeader {
            major: SHIP_MAJOR,
            minor: SHIP_MINOR,
            original_len: 1 << 20,
            chunk_size: DEFAULT_CHUNK_SIZE,
            chunk_count: 1,
            bundle_header_sha256: [0; 32],
        }
        .encode();
        for len in [0, 3, 8, 50, SHIP_HEADER_LEN - 1] {
            let err = ShipHeader::decode(&header[..len]).unwrap_err();
            assert!(
                matches!(err, FormatError::ShippedTruncated { at, .. } if at == len as u64),
                "{len}: {err}"
            );
        }
        let err = ShipHeader::decode(b"SPECTER\0 a bundle, not shipped").unwrap_err();
        assert!(matches!(err, FormatError::NotShipped { .. }), "{err}");
    }
}
