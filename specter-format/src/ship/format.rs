//! The shipped file's fixed-size records: its header, each chunk's header and the trailer,
//! with their checksums, and the byte shuffle applied to f16 data before compression.

use super::*;

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

pub(super) fn truncated_header(len: usize) -> FormatError {
    FormatError::ShippedTruncated {
        at: len as u64,
        what: format!("inside its {SHIP_HEADER_LEN}-byte header"),
    }
}

pub(super) fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}

pub(super) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

pub(super) fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// The fixed-size header in front of one chunk's payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ChunkHeader {
    pub(super) flags: u32,
    pub(super) index: u64,
    /// Where the chunk's bytes go in the bundle.
    pub(super) offset: u64,
    pub(super) len: u64,
    pub(super) compressed_len: u64,
    /// sha256 of the chunk's bundle bytes (before any shuffle).
    pub(super) sha256: [u8; 32],
    /// sha256 of the payload as stored.
    pub(super) compressed_sha256: [u8; 32],
}

impl ChunkHeader {
    pub(super) fn encode(&self) -> [u8; CHUNK_HEADER_LEN] {
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

    pub(super) fn decode(b: &[u8; CHUNK_HEADER_LEN]) -> std::result::Result<ChunkHeader, String> {
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
pub(super) struct Trailer {
    pub(super) chunk_count: u64,
    pub(super) original_len: u64,
    /// Where the trailer starts in the shipped file.
    pub(super) offset: u64,
    /// sha256 of every chunk header, in order.
    pub(super) chunk_headers_sha256: [u8; 32],
}

impl Trailer {
    pub(super) fn encode(&self) -> [u8; TRAILER_LEN] {
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

    pub(super) fn decode(b: &[u8; TRAILER_LEN]) -> std::result::Result<Trailer, String> {
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
