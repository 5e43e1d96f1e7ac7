//! Arbitrary damage to a valid bundle gives an error or a bundle, never a panic: a quick in-tree
//! complement to the cargo-fuzz target in fuzz/.

mod common;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specter_format::{Bundle, FormatError, Header, HEADER_LEN};

#[test]
fn random_mutations_never_panic() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("seed.specter");
    common::write_fixture(&path, 41);
    let valid = std::fs::read(&path).unwrap();
    let header = Header::decode(&valid).unwrap();
    let manifest = header.manifest_offset as usize..valid.len();
    let mut rng = ChaCha8Rng::seed_from_u64(4242);
    let (mut opened, mut refused, mut reached_manifest_checks) = (0, 0, 0);
    for round in 0..3000 {
        let mut bytes = valid.clone();
        let edits = rng.random_range(1..8);
        for _ in 0..edits {
            // Aim most damage at the parts open() reads; damage elsewhere only verify() can see.
            let at = match rng.random_range(0..4) {
                0 => rng.random_range(0..HEADER_LEN),
                1 | 2 => rng.random_range(manifest.clone()),
                _ => rng.random_range(0..bytes.len()),
            };
            // An earlier edit may have cut the file short.
            let at = at.min(bytes.len() - 1);
            match rng.random_range(0..4) {
                0 => bytes[at] ^= 1 << rng.random_range(0..8),
                1 => bytes[at] = rng.random(),
                2 => bytes.truncate(at.max(1)),
                _ => bytes.insert(at, rng.random()),
            }
        }
        // Re-seal some of them so the damage reaches the manifest validator and range checks.
        if round % 2 == 0 && bytes.len() >= HEADER_LEN {
            let _ = reseal(&mut bytes);
        }
        match Bundle::from_bytes(bytes) {
            Ok(bundle) => {
                opened += 1;
                let _ = bundle.verify();
                for name in bundle
                    .tensor_names()
                    .map(str::to_string)
                    .collect::<Vec<_>>()
                {
                    let view = bundle.tensor(&name).unwrap();
                    let _ = (view.as_f16(), view.as_u32());
                }
            }
            Err(e) => {
                refused += 1;
                let deep = matches!(
                    e.root(),
                    FormatError::ManifestInvalid(_)
                        | FormatError::RangeOutOfFile { .. }
                        | FormatError::RangeOutOfSection { .. }
                        | FormatError::TensorLength { .. }
                );
                reached_manifest_checks += usize::from(deep);
                assert!(!e.to_string().is_empty());
            }
        }
    }
    assert!(
        refused > 0 && opened + refused == 3000,
        "opened {opened}, refused {refused}"
    );
    // The re-sealed cases must get past the header and manifest checksums, or this test would
    // only ever exercise the first few checks.
    assert!(
        reached_manifest_checks > 100,
        "only {reached_manifest_checks} reached the manifest checks"
    );
}

/// Makes the header consistent with whatever manifest bytes the file now ends with.
fn reseal(bytes: &mut [u8]) -> Option<()> {
    use sha2::{Digest, Sha256};
    let mut header = Header::decode(bytes).ok()?;
    let end = bytes.len() as u64;
    let start = header.manifest_offset.min(end);
    header.file_len = end;
    header.manifest_len = end - start;
    header.manifest_sha256 = Sha256::digest(&bytes[start as usize..]).into();
    bytes[..HEADER_LEN].copy_from_slice(&header.encode());
    Some(())
}
