//! Everything that can be wrong with a bundle or with its writing, each with what to do about it.

use std::path::PathBuf;

use crate::{DType, FORMAT_MAJOR};

/// Shorthand for results whose error is a [`FormatError`].
pub type Result<T, E = FormatError> = std::result::Result<T, E>;

/// Everything that can be wrong with a bundle or its writing.
///
/// Errors from [`crate::Bundle::open`] are wrapped in [`FormatError::InFile`] so that the message
/// names the file; [`FormatError::root`] gives the specific error underneath.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// An operating-system I/O failure, with what was being done to which path.
    #[error("{0}")]
    Io(String),

    /// Any other error, with the bundle file it concerns. The inner error is part of the message
    /// and deliberately not reported as a separate `source()`, so that error chains print it once.
    #[error("{}: {error}", path.display())]
    InFile {
        path: PathBuf,
        error: Box<FormatError>,
    },

    #[error(
        "not a Specter bundle: the file starts with {found:02x?}, expected the magic \"SPECTER\\0\"; \
         pass a .specter file written by specter-pack"
    )]
    BadMagic { found: Vec<u8> },

    #[error(
        "bundle format version {found}.x is newer than this build supports ({supported}.x); \
         upgrade Specter, or re-pack the model with this version of specter-pack"
    )]
    NewerMajor { found: u16, supported: u16 },

    #[error(
        "bundle format major version {found} does not exist (versions start at 1); \
         the header is corrupt: re-pack the model or restore the file from a good copy"
    )]
    InvalidMajor { found: u16 },

    #[error(
        "bundle header checksum mismatch: the first page of the file is corrupt; \
         re-pack the model or restore the file from a good copy"
    )]
    HeaderChecksum,

    #[error(
        "bundle header is invalid: {0}; the file is corrupt or not a format {FORMAT_MAJOR}.x bundle: \
         re-pack the model or restore the file from a good copy"
    )]
    HeaderInvalid(String),

    #[error(
        "bundle is truncated: it has {actual} bytes but its header says {expected}; \
         the copy or download did not finish: copy the file again"
    )]
    Truncated { expected: u64, actual: u64 },

    #[error(
        "bundle has {actual} bytes but its header says {expected}: bytes were appended to it \
         or it is not the file its header describes; restore it from a good copy"
    )]
    LengthMismatch { expected: u64, actual: u64 },

    #[error(
        "manifest checksum mismatch (header expects sha256 {expected}, the bytes hash to {actual}): \
         the manifest is corrupt; re-pack the model or restore the file from a good copy"
    )]
    ManifestChecksum { expected: String, actual: String },

    #[error(
        "manifest is invalid: {0}; the bundle is corrupt or was written by a broken tool: re-pack the model"
    )]
    ManifestInvalid(String),

    #[error("could not encode the manifest: {0}")]
    ManifestEncode(String),

    #[error(
        "{what} (offset {offset}, length {length}) lies outside the {file_len}-byte file; \
         the manifest or header is corrupt: re-pack the model"
    )]
    RangeOutOfFile {
        what: String,
        offset: u64,
        length: u64,
        file_len: u64,
    },

    #[error(
        "{what} (offset {offset}, length {length}) lies outside its section {section:?} \
         (offset {section_offset}, length {section_length}); the manifest is corrupt: re-pack the model"
    )]
    RangeOutOfSection {
        what: String,
        offset: u64,
        length: u64,
        section: String,
        section_offset: u64,
        section_length: u64,
    },

    #[error(
        "{what} starts at offset {offset}, which is not a multiple of {alignment}; \
         the manifest is corrupt: re-pack the model"
    )]
    Misaligned {
        what: String,
        offset: u64,
        alignment: u64,
    },

    #[error("{first} and {second} overlap; the manifest is corrupt: re-pack the model")]
    Overlap { first: String, second: String },

    #[error(
        "{what} refers to section {index}, but the bundle has {count} sections; \
         the manifest is corrupt: re-pack the model"
    )]
    BadSectionIndex {
        what: String,
        index: u32,
        count: usize,
    },

    #[error(
        "expert {expert} of layer {layer} lies in section {section:?}, which is not the Experts \
         section of layer {layer}; the manifest is corrupt: re-pack the model"
    )]
    ExpertSection {
        layer: u32,
        expert: u32,
        section: String,
    },

    #[error(
        "tensor {name:?}: shape {shape:?} of {dtype} needs {expected} bytes, but {actual} were given; \
         check the shape and dtype against the data"
    )]
    TensorLength {
        name: String,
        dtype: &'static str,
        shape: Vec<u64>,
        expected: u64,
        actual: u64,
    },

    #[error("tensor {name:?}: the byte size of shape {shape:?} overflows 64 bits")]
    ShapeOverflow { name: String, shape: Vec<u64> },

    #[error("tensor name {0:?} appears twice; every tensor in a bundle needs a unique name")]
    DuplicateTensor(String),

    #[error("section name {0:?} appears twice; every section in a bundle needs a unique name")]
    DuplicateSection(String),

    #[error(
        "expert {expert} of layer {layer} appears twice; every (layer, expert) has exactly one blob"
    )]
    DuplicateExpert { layer: u32, expert: u32 },

    #[error(
        "section checksum mismatch in {}: the bundle is corrupt; re-pack the model or restore \
         the file from a good copy", names.join(", ")
    )]
    SectionChecksum { names: Vec<String> },

    #[error(
        "no tensor named {0:?} in the bundle; `specter-pack inspect` lists the tensors it has"
    )]
    UnknownTensor(String),

    #[error("no FP16 blob for expert {expert} of layer {layer} in the bundle")]
    UnknownExpert { layer: u32, expert: u32 },

    #[error("tensor {name:?} holds {actual}, but was read as {expected}")]
    DTypeMismatch {
        name: String,
        expected: DType,
        actual: DType,
    },

    /// The manifest's precision is not one the format defines, or a tensor of an expert or draft
    /// section is not stored as it says.
    #[error("the bundle's expert precision does not match its sections: {0}")]
    Precision(String),

    #[error("tensor {name:?} has a dimension of {dim}, too large for this platform")]
    DimensionTooLarge { name: String, dim: u64 },

    /// The writer's methods were called in an order the format does not allow.
    #[error("bundle writer used out of order: {0}")]
    WriterMisuse(String),

    #[error(
        "cannot write the bundle to {}: {reason}; choose an output file path inside an existing, \
         writable directory", path.display()
    )]
    BadOutputPath { path: PathBuf, reason: String },

    /// An option outside what the operation accepts (a chunk size or compression level, say).
    #[error("{0}")]
    InvalidOption(String),

    #[error(
        "not a shipped Specter bundle: the file starts with {found:02x?}, expected the magic \
         \"SPECSHP\\0\"; pass a .specter.zst file written by `specter-pack ship`"
    )]
    NotShipped { found: Vec<u8> },

    #[error(
        "shipped-bundle format version {found}.x is newer than this build supports ({supported}.x); \
         upgrade Specter"
    )]
    ShippedNewerMajor { found: u16, supported: u16 },

    #[error("the shipped file's header is corrupt: {0}; copy the file again from its source")]
    ShippedHeaderCorrupt(String),

    #[error(
        "the shipped file is truncated: it ends at byte {at}, {what}; the copy or download did not \
         finish: copy the file again"
    )]
    ShippedTruncated { at: u64, what: String },

    #[error(
        "chunk {index} of {count} (starting at byte {offset} of the shipped file) is corrupt: \
         {reason}; copy the file again from its source"
    )]
    ChunkCorrupt {
        index: u64,
        count: u64,
        offset: u64,
        reason: String,
    },

    #[error(
        "the shipped file's trailer (at byte {offset}) is invalid: {reason}; the file is corrupt \
         or was cut and re-joined: copy it again from its source"
    )]
    ShippedTrailer { offset: u64, reason: String },

    #[error(
        "the bundle rebuilt from the shipped chunks does not verify ({0}); every chunk matched its \
         checksums, so the bundle was already corrupt when it was shipped: ship it again from a \
         good copy"
    )]
    UnshippedInvalid(Box<FormatError>),

    #[error("compressing chunk {index} (bundle bytes {start}..{end}): {reason}")]
    Compress {
        index: u64,
        start: u64,
        end: u64,
        reason: String,
    },

    #[error(
        "{} already exists; pass --force to replace it, or choose another output path",
        path.display()
    )]
    OutputExists { path: PathBuf },

    #[error(
        "the output {} is the input file itself; choose another output path", path.display()
    )]
    OutputIsInput { path: PathBuf },
}

impl FormatError {
    /// The specific error, looking through any [`FormatError::InFile`] wrapping.
    pub fn root(&self) -> &FormatError {
        match self {
            FormatError::InFile { error, .. } => error.root(),
            other => other,
        }
    }

    /// An [`FormatError::Io`] error saying what was being done when `err` happened.
    pub(crate) fn io(action: impl std::fmt::Display, err: std::io::Error) -> FormatError {
        FormatError::Io(format!("{action}: {err}"))
    }

    /// The specific error, owned, without any [`FormatError::InFile`] wrapping.
    pub fn into_root(self) -> FormatError {
        match self {
            FormatError::InFile { error, .. } => error.into_root(),
            other => other,
        }
    }

    /// This error, said to concern the bundle file at `path` (I/O errors name their path already).
    pub fn in_file(self, path: &std::path::Path) -> FormatError {
        match self {
            // I/O messages already name their path.
            FormatError::Io(_) | FormatError::InFile { .. } => self,
            other => FormatError::InFile {
                path: path.to_path_buf(),
                error: Box::new(other),
            },
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
