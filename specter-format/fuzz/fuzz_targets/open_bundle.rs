//! Any bytes given to the reader must produce a bundle or an error, never a panic, hang or
//! out-of-bounds access; a bundle that opens must verify and serve every tensor without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};
use specter_format::{Bundle, Header, HEADER_LEN};

fn exercise(bytes: &[u8]) {
    let Ok(bundle) = Bundle::from_slice(bytes) else {
        return;
    };
    let _ = bundle.verify();
    let _ = bundle.to_manifest();
    let names: Vec<String> = bundle.tensor_names().map(str::to_string).collect();
    for name in names {
        if let Ok(view) = bundle.tensor(&name) {
            let _ = (view.as_f16(), view.as_u32(), view.as_f32());
        }
    }
    for index in 0..bundle.section_count() {
        let _ = bundle.section_bytes(index);
    }
    let manifest = bundle.manifest();
    for expert in manifest.experts.iter() {
        let _ = bundle.expert_blob(expert.layer.to_native(), expert.expert.to_native());
    }
}

/// Rewrites the header to match the input (length, manifest range and hash, header checksum), so
/// that mutations reach the manifest validator and range checks instead of stopping at a checksum.
fn resealed(data: &[u8]) -> Option<Vec<u8>> {
    if data.len() < HEADER_LEN {
        return None;
    }
    let mut bytes = data.to_vec();
    let len = bytes.len() as u64;
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&bytes[32..40]);
    let manifest_offset = u64::from_le_bytes(raw).min(len);
    let manifest = &bytes[manifest_offset as usize..];
    let header = Header::new(
        len,
        manifest_offset,
        len - manifest_offset,
        Sha256::digest(manifest).into(),
    );
    bytes[..HEADER_LEN].copy_from_slice(&header.encode());
    Some(bytes)
}

fuzz_target!(|data: &[u8]| {
    exercise(data);
    if let Some(bytes) = resealed(data) {
        exercise(&bytes);
    }
});
