//! Bulk weight upload at load time.
//!
//! Uploading tensor by tensor (a page-faulting copy out of the mapping, then one synchronous
//! pageable copy each) runs at a few GB/s. Instead, while a model loads, the backend allocates
//! each weight and records where its bytes lie in the bundle file; [`upload`] then reads the
//! file in large chunks on several threads into pinned staging buffers (two per thread, so one
//! fills while the other's copy is in flight) and copies each chunk's pieces to their weights
//! asynchronously, one stream per thread.
//!
//! How chunks are read is a [`LoadIo`]: `read` (`pread` calls, the default), `mmap` (copies out
//! of a mapping of the file: page faults), `direct` (`pread` on an O_DIRECT descriptor: no page
//! cache, so only for a cold cache), or `per-tensor` (no batching: the old path, kept to
//! measure against).

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::{sys, CudaContext};

use crate::backend::cuda::runtime::driver::guarded;
use crate::backend::cuda::runtime::host::PinnedBuffer;
use crate::{Error, Result};

/// Bytes read per chunk (a multiple of the page size): pinned copies this large run at the
/// link's full speed.
pub const CHUNK_BYTES: usize = 32 << 20;
/// Unused bytes between two pieces that are still read as part of one chunk rather than starting
/// another (tensor alignment padding).
const MAX_GAP: u64 = 64 << 10;
const PAGE: u64 = 4096;

/// How the load path reads tensor bytes from the bundle file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LoadIo {
    /// Large `pread` calls into pinned buffers.
    #[default]
    Read,
    /// `memcpy` from a mapping of the file into pinned buffers (page faults).
    Mmap,
    /// `pread` with O_DIRECT (bypasses the page cache; falls back to `Read` where refused).
    Direct,
    /// One synchronous pageable copy per tensor, as uploads were before batching.
    PerTensor,
}

impl LoadIo {
    pub fn name(self) -> &'static str {
        match self {
            LoadIo::Read => "read",
            LoadIo::Mmap => "mmap",
            LoadIo::Direct => "direct",
            LoadIo::PerTensor => "per-tensor",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "read" => LoadIo::Read,
            "mmap" => LoadIo::Mmap,
            "direct" => LoadIo::Direct,
            "per-tensor" => LoadIo::PerTensor,
            _ => {
                return Err(Error::Request(format!(
                    "unknown load I/O method {s:?}: use read, mmap, direct or per-tensor"
                )))
            }
        })
    }
}

/// Bytes at `off..off + len` of the file go to device address `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub off: u64,
    pub len: usize,
    pub dst: u64,
}

/// A file range read at once, and the pieces (indices into the sorted piece list) inside it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub start: u64,
    pub end: u64,
    pub pieces: Range<usize>,
}

/// Splits pieces longer than `chunk` bytes, sorts them by file offset, and groups neighbours into
/// chunks of at most `chunk` bytes, skipping gaps longer than `max_gap`.
pub fn plan_chunks(pieces: &mut Vec<Piece>, chunk: usize, max_gap: u64) -> Vec<Chunk> {
    let mut split = Vec::with_capacity(pieces.len());
    for p in pieces.iter() {
        let mut done = 0;
        while done < p.len {
            let len = (p.len - done).min(chunk);
            split.push(Piece {
                off: p.off + done as u64,
                len,
                dst: p.dst + done as u64,
            });
            done += len;
        }
    }
    split.sort_by_key(|p| (p.off, p.dst));
    *pieces = split;
    let mut chunks: Vec<Chunk> = Vec::new();
    for (i, p) in pieces.iter().enumerate() {
        let end = p.off + p.len as u64;
        if let Some(c) = chunks.last_mut() {
            let joined_end = c.end.max(end);
            if p.off <= c.end + max_gap && joined_end - c.start <= chunk as u64 {
                c.end = joined_end;
                c.pieces.end = i + 1;
                continue;
            }
        }
        chunks.push(Chunk {
            start: p.off,
            end,
            pieces: i..i + 1,
        });
    }
    chunks
}

/// Uploads deferred since `begin_load`: the bundle file and the pieces to copy.
pub struct PendingLoad {
    /// Address and length of the store's bytes (to turn a borrowed slice into a file offset).
    base: usize,
    len: usize,
    file: File,
    path: PathBuf,
    pieces: Vec<Piece>,
}

impl PendingLoad {
    pub fn new(bytes: &[u8], file: &File, path: &std::path::Path) -> Result<Self> {
        let file = file.try_clone().map_err(|e| {
            Error::Backend(format!(
                "cannot duplicate the handle of {}: {e}",
                path.display()
            ))
        })?;
        Ok(PendingLoad {
            base: bytes.as_ptr() as usize,
            len: bytes.len(),
            file,
            path: path.to_path_buf(),
            pieces: Vec::new(),
        })
    }

    /// The file offset of `data` when it lies inside the store's bytes.
    pub fn offset_of<T>(&self, data: &[T]) -> Option<u64> {
        let p = data.as_ptr() as usize;
        let n = std::mem::size_of_val(data);
        (p >= self.base && p + n <= self.base + self.len).then(|| (p - self.base) as u64)
    }

    pub fn push(&mut self, off: u64, len: usize, dst: u64) {
        if len > 0 {
            self.pieces.push(Piece { off, len, dst });
        }
    }

    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }
}

/// What one batched upload did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct LoadReport {
    pub io: String,
    pub threads: usize,
    pub bytes: u64,
    pub chunks: usize,
    pub seconds: f64,
}

/// Where a worker reads chunks from.
enum Source<'a> {
    Read(&'a File),
    Direct(&'a File),
    Mapped(&'a [u8]),
}

impl Source<'_> {
    /// Reads the file's bytes `start..end` into `buf` and returns where they begin in it (O_DIRECT
    /// reads from the page below `start`).
    fn fill(&self, start: u64, end: u64, buf: &mut [u8]) -> Result<usize> {
        let need = (end - start) as usize;
        match self {
            Source::Mapped(bytes) => {
                let src = bytes.get(start as usize..end as usize).ok_or_else(|| {
                    Error::Backend(format!(
                        "bundle bytes {start}..{end} lie past the file's end"
                    ))
                })?;
                buf[..need].copy_from_slice(src);
                Ok(0)
            }
            Source::Read(file) => {
                read_full(file, start, &mut buf[..need], need)?;
                Ok(0)
            }
            Source::Direct(file) => {
                let a_start = start & !(PAGE - 1);
                let skip = (start - a_start) as usize;
                let a_len = (skip + need).div_ceil(PAGE as usize) * PAGE as usize;
                read_full(file, a_start, &mut buf[..a_len], skip + need)?;
                Ok(skip)
            }
        }
    }
}

/// Reads at `off` into `buf` until at least `need` bytes arrived (or `buf` is full).
fn read_full(file: &File, off: u64, buf: &mut [u8], need: usize) -> Result<()> {
    let mut got = 0;
    while got < need {
        match file.read_at(&mut buf[got..], off + got as u64) {
            Ok(0) => {
                return Err(Error::Backend(format!(
                    "the bundle file ended at byte {} while reading tensor bytes",
                    off + got as u64
                )))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(Error::Backend(format!(
                    "reading tensor bytes at offset {}: {e}",
                    off + got as u64
                )))
            }
        }
    }
    Ok(())
}

/// Worker threads: `threads` when given, else the cores, at most 8 (copies from the page cache
/// saturate memory bandwidth before that; each thread pins two chunk buffers).
fn worker_count(threads: Option<usize>) -> usize {
    threads
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(4)
                .min(8)
        })
        .max(1)
}

/// Reads and copies every pending piece; returns when all copies have completed. Device memory
/// the pieces point to must be allocated (its allocation complete) and stay alive meanwhile.
pub fn upload(
    ctx: &Arc<CudaContext>,
    mut pending: PendingLoad,
    io: LoadIo,
    threads: Option<usize>,
) -> Result<LoadReport> {
    let started = Instant::now();
    let chunks = plan_chunks(&mut pending.pieces, CHUNK_BYTES, MAX_GAP);
    let bytes: u64 = pending.pieces.iter().map(|p| p.len as u64).sum();
    let mut io = io;
    let direct = if io == LoadIo::Direct {
        match open_direct(&pending.path) {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::warn!("{e}; reading with plain pread instead");
                io = LoadIo::Read;
                None
            }
        }
    } else {
        None
    };
    let map = if io == LoadIo::Mmap {
        // SAFETY: a read-only mapping of the bundle file, which is never modified in place (the
        // same contract as the bundle's own mapping); it lives until this function returns.
        Some(
            unsafe { memmap2::Mmap::map(&pending.file) }
                .map_err(|e| Error::Backend(format!("mapping {}: {e}", pending.path.display())))?,
        )
    } else {
        None
    };
    let source = match (&direct, &map) {
        (Some(f), _) => Source::Direct(f),
        (None, Some(m)) => Source::Mapped(m),
        (None, None) => Source::Read(&pending.file),
    };
    let threads = worker_count(threads).min(chunks.len()).max(1);
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    let pieces = &pending.pieces;
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                let result = worker(ctx, &source, &chunks, pieces, &next, &failed);
                if let Err(e) = result {
                    failed.store(true, Ordering::Relaxed);
                    if let Ok(mut slot) = first_error.lock() {
                        slot.get_or_insert(e);
                    }
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().ok().flatten() {
        return Err(e);
    }
    Ok(LoadReport {
        io: io.name().to_string(),
        threads,
        bytes,
        chunks: chunks.len(),
        seconds: started.elapsed().as_secs_f64(),
    })
}

fn open_direct(path: &std::path::Path) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| Error::Backend(format!("opening {} with O_DIRECT: {e}", path.display())))
}

fn worker(
    ctx: &Arc<CudaContext>,
    source: &Source<'_>,
    chunks: &[Chunk],
    pieces: &[Piece],
    next: &AtomicUsize,
    failed: &AtomicBool,
) -> Result<()> {
    guarded("cannot make the CUDA context current", || {
        ctx.bind_to_thread()
    })?;
    let stream = guarded("cannot create a load stream", || ctx.new_stream())?;
    // Room for a chunk plus the page-alignment slack of an O_DIRECT read.
    let buf_len = CHUNK_BYTES + 2 * PAGE as usize;
    let mut bufs = [
        PinnedBuffer::new(ctx, buf_len)?,
        PinnedBuffer::new(ctx, buf_len)?,
    ];
    let mut turn = 0;
    while !failed.load(Ordering::Relaxed) {
        let i = next.fetch_add(1, Ordering::Relaxed);
        let Some(chunk) = chunks.get(i) else { break };
        let buf = &mut bufs[turn % 2];
        turn += 1;
        // Waits for the copies that still read this buffer.
        let skip = source.fill(chunk.start, chunk.end, buf.as_mut_slice()?)?;
        for p in &pieces[chunk.pieces.clone()] {
            let at = skip + (p.off - chunk.start) as usize;
            // SAFETY: `p.dst` addresses `p.len` bytes of a weight allocated before the upload began
            // (the caller synchronised its allocation) and kept alive until `upload` returns,
            // which is after this stream is synchronised below.
            unsafe { buf.copy_to_device_ptr(at..at + p.len, p.dst as sys::CUdeviceptr, &stream)? };
        }
    }
    guarded("cannot finish the weight copies", || stream.synchronize())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(off: u64, len: usize, dst: u64) -> Piece {
        Piece { off, len, dst }
    }

    #[test]
    fn chunks_cover_every_byte_once_and_respect_the_limit() {
        let mut pieces = vec![
            piece(10_000, 100, 5_000),
            piece(0, 4096, 0),
            piece(4096, 300, 9_000),
            piece(1 << 20, 10_000, 20_000),
        ];
        let chunks = plan_chunks(&mut pieces, 8192, 64);
        // The first two are adjacent and fit one chunk; 10_000 is past the gap; the last is split.
        assert_eq!(pieces.len(), 5);
        assert_eq!(chunks.len(), 4);
        assert_eq!((chunks[0].start, chunks[0].end), (0, 4396));
        assert_eq!(chunks[0].pieces, 0..2);
        for c in &chunks {
            assert!(c.end - c.start <= 8192);
            for p in &pieces[c.pieces.clone()] {
                assert!(p.off >= c.start && p.off + p.len as u64 <= c.end);
            }
        }
        let total: usize = pieces.iter().map(|p| p.len).sum();
        assert_eq!(total, 100 + 4096 + 300 + 10_000);
        // The split piece keeps its destination contiguous.
        let big: Vec<_> = pieces.iter().filter(|p| p.off >= 1 << 20).collect();
        assert_eq!(big.len(), 2);
        assert_eq!(big[1].dst - big[0].dst, big[0].len as u64);
        assert_eq!(big[1].off - big[0].off, big[0].len as u64);
    }

    #[test]
    fn every_source_reads_the_same_bytes() {
        let dir = std::env::temp_dir().join(format!("specter-load-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bytes.bin");
        let data: Vec<u8> = (0..3 * PAGE as usize + 123)
            .map(|i| (i * 7 + i / 251) as u8)
            .collect();
        std::fs::write(&path, &data).unwrap();
        let file = File::open(&path).unwrap();
        // SAFETY: a read-only mapping of a file this test wrote and does not change.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let mut sources = vec![
            ("read", Source::Read(&file)),
            ("mmap", Source::Mapped(&map)),
        ];
        // O_DIRECT is refused by some file systems (tmpfs); test it where it opens.
        let direct = open_direct(&path).ok();
        if let Some(d) = &direct {
            sources.push(("direct", Source::Direct(d)));
        }
        for (start, end) in [
            (0u64, 10u64),
            (100, 5000),
            (4096, 8192),
            (5000, data.len() as u64),
        ] {
            for (name, s) in &sources {
                // A page-aligned buffer, as pinned allocations are, for O_DIRECT.
                let mut storage = vec![0u8; (1 << 16) + 3 * PAGE as usize];
                let aligned = storage.as_ptr().align_offset(PAGE as usize);
                let buf = &mut storage[aligned..];
                let skip = s.fill(start, end, buf).unwrap();
                let n = (end - start) as usize;
                assert_eq!(
                    &buf[skip..skip + n],
                    &data[start as usize..end as usize],
                    "{name} {start}..{end}"
                );
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn load_io_names_round_trip() {
        for io in [
            LoadIo::Read,
            LoadIo::Mmap,
            LoadIo::Direct,
            LoadIo::PerTensor,
        ] {
            assert_eq!(LoadIo::parse(io.name()).unwrap(), io);
        }
        assert!(LoadIo::parse("fast").is_err());
    }
}
