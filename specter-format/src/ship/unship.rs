//! Unshipping: reading a shipped file in order, a batch of chunks at a time, checking and
//! decompressing each batch in parallel, and writing a verified bundle.

use super::*;

/// The shipped file being read in order, knowing where it is.
pub(super) struct Input {
    pub(super) reader: BufReader<File>,
    pub(super) pos: u64,
    pub(super) path: PathBuf,
}

impl Input {
    /// Fills `buf` as far as the file allows; returns how many bytes were read.
    pub(super) fn read_up_to(&mut self, buf: &mut [u8]) -> Result<usize> {
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
    pub(super) fn read_exact(&mut self, buf: &mut [u8], where_: &str, inside: &str) -> Result<()> {
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
pub(super) struct ReadChunk {
    pub(super) header: ChunkHeader,
    /// Where its header starts in the shipped file.
    pub(super) at: u64,
    pub(super) payload: Vec<u8>,
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
pub(super) type ReadBatch = (Vec<ReadChunk>, Option<FormatError>, bool);

/// Reads, checks and writes every chunk, then checks the trailer and that nothing follows it.
pub(super) fn unpack_chunks(
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
pub(super) fn read_chunk(
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
pub(super) fn check_chunk(c: &ReadChunk, count: u64) -> Result<Vec<u8>> {
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
