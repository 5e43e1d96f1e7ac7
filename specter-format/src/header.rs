//! The fixed header: the first 4096-byte page of every bundle, encoded field by field in
//! little-endian (docs/FORMAT.md has the byte table).

use sha2::{Digest, Sha256};

use crate::{FormatError, Result, FORMAT_MAJOR, FORMAT_MINOR, PAGE};

/// The first eight bytes of every bundle.
pub const MAGIC: [u8; 8] = *b"SPECTER\0";

/// Bytes the header occupies: all of the first page.
pub const HEADER_LEN: usize = PAGE as usize;

/// Where the header's own sha256 sits: the last 32 bytes of the page. It covers every byte before
/// it, so fields a later minor version adds in the reserved bytes are covered too.
pub const HEADER_CHECKSUM_OFFSET: usize = HEADER_LEN - 32;

const OFF_MAJOR: usize = 8;
const OFF_MINOR: usize = 10;
const OFF_HEADER_LEN: usize = 12;
const OFF_FLAGS: usize = 16;
const OFF_FILE_LEN: usize = 24;
const OFF_MANIFEST_OFFSET: usize = 32;
const OFF_MANIFEST_LEN: usize = 40;
const OFF_MANIFEST_SHA: usize = 48;
/// First byte after the fields version 1.0 defines; the rest up to the checksum is reserved.
const END_OF_FIELDS: usize = 80;

/// The decoded header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub major: u16,
    pub minor: u16,
    /// No flags are defined in version 1.0; writers store 0 and readers ignore bits they do not
    /// know (a change that readers must understand bumps the major version instead).
    pub flags: u64,
    /// The whole file's length in bytes; a file of any other length is refused.
    pub file_len: u64,
    pub manifest_offset: u64,
    pub manifest_len: u64,
    pub manifest_sha256: [u8; 32],
}

impl Header {
    /// A header of the current format version.
    pub fn new(
        file_len: u64,
        manifest_offset: u64,
        manifest_len: u64,
        manifest_sha256: [u8; 32],
    ) -> Header {
        Header {
            major: FORMAT_MAJOR,
            minor: FORMAT_MINOR,
            flags: 0,
            file_len,
            manifest_offset,
            manifest_len,
            manifest_sha256,
        }
    }

    /// The header page: the fields, zeros, and the checksum over everything before it.
    pub fn encode(&self) -> Vec<u8> {
        let mut page = vec![0u8; HEADER_LEN];
        page[..8].copy_from_slice(&MAGIC);
        page[OFF_MAJOR..OFF_MAJOR + 2].copy_from_slice(&self.major.to_le_bytes());
        page[OFF_MINOR..OFF_MINOR + 2].copy_from_slice(&self.minor.to_le_bytes());
        page[OFF_HEADER_LEN..OFF_HEADER_LEN + 4]
            .copy_from_slice(&(HEADER_LEN as u32).to_le_bytes());
        page[OFF_FLAGS..OFF_FLAGS + 8].copy_from_slice(&self.flags.to_le_bytes());
        page[OFF_FILE_LEN..OFF_FILE_LEN + 8].copy_from_slice(&self.file_len.to_le_bytes());
        page[OFF_MANIFEST_OFFSET..OFF_MANIFEST_OFFSET + 8]
            .copy_from_slice(&self.manifest_offset.to_le_bytes());
        page[OFF_MANIFEST_LEN..OFF_MANIFEST_LEN + 8]
            .copy_from_slice(&self.manifest_len.to_le_bytes());
        page[OFF_MANIFEST_SHA..OFF_MANIFEST_SHA + 32].copy_from_slice(&self.manifest_sha256);
        const { assert!(OFF_MANIFEST_SHA + 32 == END_OF_FIELDS) };
        let checksum = header_checksum(&page);
        page[HEADER_CHECKSUM_OFFSET..].copy_from_slice(&checksum);
        page
    }

    /// Decodes and checks the header at the start of `bytes`: magic, then version (a newer major
    /// may have moved everything else, so it is checked before the checksum), then the checksum.
    /// Does not compare `file_len` with the file; the reader does that.
    pub fn decode(bytes: &[u8]) -> Result<Header> {
        Header::decode_with(bytes, true)
    }

    /// As [`Header::decode`], checking the header checksum only if `checksum`: the fields are
    /// still validated, and the reader checks every range against the file either way.
    pub(crate) fn decode_with(bytes: &[u8], checksum: bool) -> Result<Header> {
        let magic = bytes.get(..8);
        if magic != Some(&MAGIC[..]) {
            return Err(FormatError::BadMagic {
                found: bytes[..bytes.len().min(8)].to_vec(),
            });
        }
        if bytes.len() < OFF_MINOR + 2 {
            return Err(FormatError::Truncated {
                expected: HEADER_LEN as u64,
                actual: bytes.len() as u64,
            });
        }
        let major = u16::from_le_bytes([bytes[OFF_MAJOR], bytes[OFF_MAJOR + 1]]);
        let minor = u16::from_le_bytes([bytes[OFF_MINOR], bytes[OFF_MINOR + 1]]);
        if major > FORMAT_MAJOR {
            return Err(FormatError::NewerMajor {
                found: major,
                supported: FORMAT_MAJOR,
            });
        }
        if major == 0 {
            return Err(FormatError::InvalidMajor { found: major });
        }
        let Some(page) = bytes.get(..HEADER_LEN) else {
            return Err(FormatError::Truncated {
                expected: HEADER_LEN as u64,
                actual: bytes.len() as u64,
            });
        };
        if checksum && header_checksum(page) != page[HEADER_CHECKSUM_OFFSET..] {
            return Err(FormatError::HeaderChecksum);
        }
        let header_len = read_u32(page, OFF_HEADER_LEN);
        if header_len as usize != HEADER_LEN {
            return Err(FormatError::HeaderInvalid(format!(
                "it says it is {header_len} bytes long, but format {major}.x headers are {HEADER_LEN}"
            )));
        }
        let mut manifest_sha256 = [0u8; 32];
        manifest_sha256.copy_from_slice(&page[OFF_MANIFEST_SHA..OFF_MANIFEST_SHA + 32]);
        Ok(Header {
            major,
            minor,
            flags: read_u64(page, OFF_FLAGS),
            file_len: read_u64(page, OFF_FILE_LEN),
            manifest_offset: read_u64(page, OFF_MANIFEST_OFFSET),
            manifest_len: read_u64(page, OFF_MANIFEST_LEN),
            manifest_sha256,
        })
    }
}

/// sha256 over the header page's bytes before the checksum field.
fn header_checksum(page: &[u8]) -> [u8; 32] {
    Sha256::digest(&page[..HEADER_CHECKSUM_OFFSET]).into()
}

fn read_u32(page: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&page[at..at + 4]);
    u32::from_le_bytes(b)
}

fn read_u64(page: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&page[at..at + 8]);
    u64::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Header {
        let mut sha = [0u8; 32];
        for (i, b) in sha.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37).wrapping_add(11);
        }
        Header::new(3 * PAGE + 517, 3 * PAGE, 517, sha)
    }

    #[test]
    fn encode_decode_round_trip() {
        let header = sample();
        let page = header.encode();
        assert_eq!(page.len(), HEADER_LEN);
        assert_eq!(&page[..8], b"SPECTER\0");
        assert_eq!(Header::decode(&page).unwrap(), header);
    }

    #[test]
    fn every_bit_of_the_header_page_is_checked() {
        let page = sample().encode();
        // A flip anywhere (fields, reserved bytes or the checksum itself) must be refused; flips in
        // the magic or the major give their own errors, the rest a checksum error.
        for byte in (0..HEADER_LEN).step_by(7) {
            let mut bad = page.clone();
            bad[byte] ^= 0x10;
            let err = Header::decode(&bad).unwrap_err();
            match byte {
                0..=7 => assert!(matches!(err, FormatError::BadMagic { .. }), "{byte}: {err}"),
                8..=9 => assert!(
                    matches!(
                        err,
                        FormatError::NewerMajor { .. } | FormatError::HeaderChecksum
                    ),
                    "{byte}: {err}"
                ),
                _ => assert!(matches!(err, FormatError::HeaderChecksum), "{byte}: {err}"),
            }
        }
    }

    #[test]
    fn a_wrong_header_length_is_refused_even_with_a_valid_checksum() {
        let mut page = sample().encode();
        page[OFF_HEADER_LEN..OFF_HEADER_LEN + 4].copy_from_slice(&8192u32.to_le_bytes());
        let checksum = header_checksum(&page);
        page[HEADER_CHECKSUM_OFFSET..].copy_from_slice(&checksum);
        let err = Header::decode(&page).unwrap_err();
        assert!(matches!(err, FormatError::HeaderInvalid(_)), "{err}");
        assert!(err.to_string().contains("8192"), "{err}");
    }

    #[test]
    fn short_inputs_are_errors_not_panics() {
        let page = sample().encode();
        for len in 0..64 {
            assert!(Header::decode(&page[..len]).is_err());
        }
        assert!(matches!(
            Header::decode(&page[..HEADER_LEN - 1]),
            Err(FormatError::Truncated { .. })
        ));
    }
}
