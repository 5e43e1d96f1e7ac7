//! Damaged copies of a good bundle, each with one kind of damage.
#![allow(dead_code)]

use sha2::{Digest, Sha256};
use specter_format::{Bundle, Header, Manifest, FORMAT_MAJOR, HEADER_LEN};

/// The bundle's manifest, decoded.
pub fn manifest(bytes: &[u8]) -> Manifest {
    Bundle::from_slice(bytes).unwrap().to_manifest().unwrap()
}

/// `bytes` with bit `bit` of byte `at` flipped.
pub fn flip(bytes: &[u8], at: u64, bit: u32) -> Vec<u8> {
    let mut out = bytes.to_vec();
    out[at as usize] ^= 1 << bit;
    out
}

/// The first `len` bytes.
pub fn truncated(bytes: &[u8], len: usize) -> Vec<u8> {
    bytes[..len].to_vec()
}

/// The magic replaced by another format's.
pub fn wrong_magic(bytes: &[u8]) -> Vec<u8> {
    let mut out = bytes.to_vec();
    out[..8].copy_from_slice(b"GGUF\x03\x00\x00\x00");
    out
}

/// The header rewritten after `edit`, with its checksum sealed again, so that only the edited
/// field can be objected to.
pub fn edit_header(bytes: &[u8], edit: impl FnOnce(&mut Header)) -> Vec<u8> {
    let mut header = Header::decode(bytes).unwrap();
    edit(&mut header);
    let mut out = bytes.to_vec();
    out[..HEADER_LEN].copy_from_slice(&header.encode());
    out
}

/// A bundle of the next major format version (header otherwise valid).
pub fn newer_major(bytes: &[u8]) -> Vec<u8> {
    edit_header(bytes, |h| h.major = FORMAT_MAJOR + 1)
}

/// `bytes` with the manifest replaced by `manifest` (at the old manifest's offset) and a header
/// that matches it, so that only the checks of the manifest's contents can object.
pub fn with_manifest(bytes: &[u8], manifest: &Manifest) -> Vec<u8> {
    let old = Header::decode(bytes).unwrap();
    let encoded = rkyv::to_bytes::<rkyv::rancor::Error>(manifest).unwrap();
    let mut out = bytes[..old.manifest_offset as usize].to_vec();
    out.extend_from_slice(&encoded);
    let header = Header::new(
        out.len() as u64,
        old.manifest_offset,
        encoded.len() as u64,
        Sha256::digest(&encoded).into(),
    );
    out[..HEADER_LEN].copy_from_slice(&header.encode());
    out
}

/// A bundle whose manifest places section `section` (by name) past the end of the file.
pub fn section_outside_file(bytes: &[u8], section: &str) -> Vec<u8> {
    let mut m = manifest(bytes);
    let entry = m
        .sections
        .iter_mut()
        .find(|s| s.name == section)
        .unwrap_or_else(|| panic!("no section {section}"));
    entry.length = bytes.len() as u64 * 3;
    let out = with_manifest(bytes, &m);
    // The edit must not have changed the file's length, or the error could be a length mismatch.
    assert_eq!(out.len(), bytes.len());
    out
}

/// A bundle whose manifest places tensor `tensor` past the end of the file.
pub fn tensor_outside_file(bytes: &[u8], tensor: &str) -> Vec<u8> {
    let mut m = manifest(bytes);
    let entry = m
        .tensors
        .iter_mut()
        .find(|t| t.name == tensor)
        .unwrap_or_else(|| panic!("no tensor {tensor}"));
    entry.offset = bytes.len() as u64 + 4096;
    let out = with_manifest(bytes, &m);
    assert_eq!(out.len(), bytes.len());
    out
}
