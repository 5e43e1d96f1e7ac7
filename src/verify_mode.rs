//! How much of a bundle is checked before a model runs from it.
//!
//! `Manifest` is what opening a bundle always did: header, manifest and every range, no tensor
//! bytes read. `Full` adds every section's sha256, hashed on another thread while the model loads
//! so that it costs little extra time. `None` drops the two integrity-only checksums (header and
//! manifest sha256); what memory safety needs (bytecheck validation and range checks of the
//! manifest) is never skipped.

use std::path::Path;

use specter_format::Bundle;

use crate::{Error, Result};

/// How much of a bundle to check before running it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VerifyMode {
    /// Every section's sha256 as well, in parallel with loading; any mismatch is an error.
    Full,
    /// Header and manifest checksums, manifest structure and ranges; no tensor bytes read.
    #[default]
    Manifest,
    /// Manifest structure and ranges only: no checksum at all.
    None,
}

/// Opens `path` with the checks `mode` asks of opening.
pub fn open_bundle(path: &Path, mode: VerifyMode) -> Result<Bundle> {
    Ok(match mode {
        VerifyMode::None => Bundle::open_skipping_checksums(path)?,
        VerifyMode::Full | VerifyMode::Manifest => Bundle::open(path)?,
    })
}

/// Runs `load` on this thread. In `Full` mode, every section of `bundle` is verified on another
/// thread meanwhile, and a mismatch is the error returned (whatever `load` gave: its result came
/// from bytes known to be corrupt).
pub fn while_verifying<T>(
    bundle: &Bundle,
    path: &Path,
    mode: VerifyMode,
    load: impl FnOnce() -> Result<T>,
) -> Result<T> {
    if mode != VerifyMode::Full {
        return load();
    }
    std::thread::scope(|scope| {
        let verifier = scope.spawn(|| bundle.verify());
        let loaded = load();
        let report = verifier.join().map_err(|_| {
            Error::Model(format!(
                "{}: verifying the bundle's sections failed unexpectedly",
                path.display()
            ))
        })?;
        report
            .into_result()
            .map_err(|e| Error::Format(e.in_file(path)))?;
        loaded
    })
}
