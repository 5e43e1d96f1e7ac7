//! Full integrity check: every section's sha256 recomputed in parallel, plus the manifest's.

use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;
use sha2::{Digest, Sha256};

use crate::reader::section_kind_of;
use crate::{sha256_hex, Bundle, FormatError, Result, SectionKind};

/// Bytes hashed between progress reports: small enough for a smooth progress bar, large enough
/// that reporting costs nothing.
const PROGRESS_CHUNK: usize = 16 << 20;

/// The outcome of checking one section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SectionCheck {
    pub name: String,
    pub kind: SectionKind,
    pub offset: u64,
    pub length: u64,
    /// The sha256 the manifest records.
    pub expected: [u8; 32],
    /// The sha256 of the bytes as they are now.
    pub actual: [u8; 32],
    pub ok: bool,
}

/// The outcome of [`Bundle::verify`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    /// One entry per section, in manifest order.
    pub sections: Vec<SectionCheck>,
    pub manifest_ok: bool,
    /// The manifest sha256 the header records, and that of the manifest's bytes as they are now.
    pub manifest_expected: [u8; 32],
    pub manifest_actual: [u8; 32],
    /// Bytes hashed (sections and manifest).
    pub bytes: u64,
}

impl VerifyReport {
    pub fn is_ok(&self) -> bool {
        self.manifest_ok && self.sections.iter().all(|s| s.ok)
    }

    pub fn bad_sections(&self) -> Vec<&SectionCheck> {
        self.sections.iter().filter(|s| !s.ok).collect()
    }

    /// `Ok` if everything matched, otherwise the error naming what did not.
    pub fn into_result(self) -> Result<()> {
        if !self.manifest_ok {
            return Err(FormatError::ManifestChecksum {
                expected: sha256_hex(&self.manifest_expected),
                actual: sha256_hex(&self.manifest_actual),
            });
        }
        let names: Vec<String> = self.bad_sections().iter().map(|s| s.name.clone()).collect();
        if names.is_empty() {
            Ok(())
        } else {
            Err(FormatError::SectionChecksum { names })
        }
    }
}

impl Bundle {
    /// Recomputes every section's sha256 (in parallel) and the manifest's, and reports each.
    pub fn verify(&self) -> VerifyReport {
        self.verify_with_progress(&|_| {})
    }

    /// As [`Bundle::verify`], calling `progress` with the total bytes hashed so far as it goes.
    pub fn verify_with_progress(&self, progress: &(dyn Fn(u64) + Sync)) -> VerifyReport {
        let manifest = self.manifest();
        let done = AtomicU64::new(0);
        let hash = |bytes: &[u8]| -> [u8; 32] {
            let mut hasher = Sha256::new();
            for chunk in bytes.chunks(PROGRESS_CHUNK) {
                hasher.update(chunk);
                let total =
                    done.fetch_add(chunk.len() as u64, Ordering::Relaxed) + chunk.len() as u64;
                progress(total);
            }
            hasher.finalize().into()
        };
        // Largest first, so one big section does not start last and leave the other cores idle.
        let mut order: Vec<usize> = (0..manifest.sections.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(manifest.sections[i].length.to_native()));
        let mut checks: Vec<(usize, SectionCheck)> = order
            .into_par_iter()
            .map(|i| {
                let entry = &manifest.sections[i];
                let expected: [u8; 32] = entry.sha256;
                let actual = hash(self.section_bytes(i));
                let check = SectionCheck {
                    name: entry.name.as_str().to_string(),
                    kind: section_kind_of(&entry.kind),
                    offset: entry.offset.to_native(),
                    length: entry.length.to_native(),
                    expected,
                    actual,
                    ok: expected == actual,
                };
                (i, check)
            })
            .collect();
        checks.sort_by_key(|(i, _)| *i);
        let header = self.header();
        let start = header.manifest_offset as usize;
        let manifest_bytes = &self.as_bytes()[start..start + header.manifest_len as usize];
        let manifest_actual = hash(manifest_bytes);
        VerifyReport {
            sections: checks.into_iter().map(|(_, c)| c).collect(),
            manifest_ok: manifest_actual == header.manifest_sha256,
            manifest_expected: header.manifest_sha256,
            manifest_actual,
            bytes: done.load(Ordering::Relaxed),
        }
    }
}
