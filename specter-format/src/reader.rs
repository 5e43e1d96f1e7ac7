//! The zero-copy reader: maps a bundle, checks its header and manifest and every range the
//! manifest names, and hands out borrowed views. Opening reads no tensor bytes.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use rkyv::util::AlignedVec;
use sha2::{Digest, Sha256};

use crate::header::{Header, HEADER_LEN};
use crate::writer::tensor_byte_len;
use crate::{
    sha256_hex, ArchivedDType, ArchivedManifest, ArchivedSectionKind, DType, FormatError, Manifest,
    Result, SectionKind, PAGE, TENSOR_ALIGN,
};

/// Alignment of in-memory bundles: a page, like a mapping, so every alignment the format promises
/// relative to the file start holds in memory too.
const MEMORY_ALIGN: usize = PAGE as usize;

enum Storage {
    /// The mapping, with the open file and its path kept for readers that prefer large `read`
    /// calls (or O_DIRECT) to page faults on the mapping.
    Mapped {
        map: Mmap,
        file: File,
        path: PathBuf,
    },
    Memory(AlignedVec<MEMORY_ALIGN>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped { map, .. } => map,
            Storage::Memory(vec) => vec,
        }
    }
}

/// An open, checked bundle. Cheap to share between threads.
pub struct Bundle {
    storage: Storage,
    /// A format 1.x bundle's manifest, converted to the current one when it was opened; `None`
    /// when the file's own manifest is current.
    upgraded: Option<AlignedVec<16>>,
    header: Header,
    tensor_index: HashMap<String, u32>,
    expert_index: HashMap<(u32, u32), u32>,
}

/// A borrowed view of one tensor's bytes.
#[derive(Debug, Clone)]
pub struct TensorView<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// Elements in the tensor.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn as_f16(&self) -> Result<&'a [half::f16]> {
        self.cast(DType::F16)
    }

    pub fn as_bf16(&self) -> Result<&'a [half::bf16]> {
        self.cast(DType::BF16)
    }

    pub fn as_f32(&self) -> Result<&'a [f32]> {
        self.cast(DType::F32)
    }

    pub fn as_u32(&self) -> Result<&'a [u32]> {
        self.cast(DType::U32)
    }

    pub fn as_u8(&self) -> Result<&'a [u8]> {
        self.cast(DType::U8)
    }

    pub fn as_i32(&self) -> Result<&'a [i32]> {
        self.cast(DType::I32)
    }

    fn cast<T: bytemuck::Pod>(&self, want: DType) -> Result<&'a [T]> {
        if self.dtype != want {
            return Err(FormatError::DTypeMismatch {
                name: self.name.to_string(),
                expected: want,
                actual: self.dtype,
            });
        }
        // Tensors start on 64-byte boundaries of a page-aligned buffer and their lengths are whole
        // elements (checked at open), so this cannot fail for a bundle that opened.
        bytemuck::try_cast_slice(self.bytes).map_err(|e| FormatError::Misaligned {
            what: format!("tensor {:?} ({e})", self.name),
            offset: self.bytes.as_ptr() as u64,
            alignment: std::mem::align_of::<T>() as u64,
        })
    }
}

impl Bundle {
    /// Maps `path` read-only and checks it: header (magic, version, checksum, file length),
    /// manifest sha256, manifest structure (bytecheck), and every section, tensor and expert range.
    /// Reads no tensor bytes.
    ///
    /// The file must not be modified while it is open (bundles are replaced by rename, which
    /// leaves open mappings intact).
    pub fn open(path: &Path) -> Result<Bundle> {
        Bundle::open_with(path, true)
    }

    /// As [`Bundle::open`] but without the two checksums that guard only integrity: the header's
    /// and the manifest's sha256. Everything reading through the manifest relies on is still
    /// checked (header fields, bytecheck validation of the manifest, every range), so a damaged
    /// file still cannot make the reader touch memory outside the mapping.
    pub fn open_skipping_checksums(path: &Path) -> Result<Bundle> {
        Bundle::open_with(path, false)
    }

    fn open_with(path: &Path, checksums: bool) -> Result<Bundle> {
        let file = File::open(path)
            .map_err(|e| FormatError::io(format!("opening bundle {}", path.display()), e))?;
        let metadata = file
            .metadata()
            .map_err(|e| FormatError::io(format!("reading the size of {}", path.display()), e))?;
        if !metadata.is_file() {
            return Err(FormatError::Io(format!(
                "{} is not a regular file; pass the path of a .specter bundle",
                path.display()
            )));
        }
        let len = metadata.len();
        if len < HEADER_LEN as u64 {
            // Too short to map usefully; read what is there so the error says why.
            let bytes = std::fs::read(path)
                .map_err(|e| FormatError::io(format!("reading {}", path.display()), e))?;
            return Err(Header::decode_with(&bytes, checksums)
                .err()
                .unwrap_or(FormatError::Truncated {
                    expected: HEADER_LEN as u64,
                    actual: len,
                })
                .in_file(path));
        }
        // SAFETY: the mapping is read-only and private to this process. Its contents could change
        // if another process wrote to the file while it is mapped; bundles are never modified in
        // place (writers create a new file and rename it), and this is documented above.
        let map = unsafe { Mmap::map(&file) }
            .map_err(|e| FormatError::io(format!("mapping {}", path.display()), e))?;
        let storage = Storage::Mapped {
            map,
            file,
            path: path.to_path_buf(),
        };
        Bundle::check(storage, checksums).map_err(|e| e.in_file(path))
    }

    /// The same checks as [`Bundle::open`] over bytes already in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Bundle> {
        Bundle::from_slice(&bytes)
    }

    /// Copies `bytes` into a page-aligned buffer and checks them as [`Bundle::open`] does.
    pub fn from_slice(bytes: &[u8]) -> Result<Bundle> {
        let mut aligned = AlignedVec::<MEMORY_ALIGN>::with_capacity(bytes.len());
        aligned.extend_from_slice(bytes);
        Bundle::check(Storage::Memory(aligned), true)
    }

    fn check(storage: Storage, checksums: bool) -> Result<Bundle> {
        let bytes = storage.bytes();
        let header = Header::decode_with(bytes, checksums)?;
        let actual = bytes.len() as u64;
        if actual < header.file_len {
            return Err(FormatError::Truncated {
                expected: header.file_len,
                actual,
            });
        }
        if actual > header.file_len {
            return Err(FormatError::LengthMismatch {
                expected: header.file_len,
                actual,
            });
        }
        let manifest_range = checked_range(
            "the manifest",
            header.manifest_offset,
            header.manifest_len,
            actual,
        )?;
        if header.manifest_offset % PAGE != 0 {
            return Err(FormatError::Misaligned {
                what: "the manifest".into(),
                offset: header.manifest_offset,
                alignment: PAGE,
            });
        }
        if header.manifest_offset < HEADER_LEN as u64 {
            return Err(FormatError::Overlap {
                first: "the header".into(),
                second: "the manifest".into(),
            });
        }
        let manifest_bytes = &bytes[manifest_range];
        let actual_sha: [u8; 32] = if checksums {
            Sha256::digest(manifest_bytes).into()
        } else {
            header.manifest_sha256
        };
        if actual_sha != header.manifest_sha256 {
            return Err(FormatError::ManifestChecksum {
                expected: sha256_hex(&header.manifest_sha256),
                actual: sha256_hex(&actual_sha),
            });
        }
        let upgraded = if header.major == 1 {
            Some(upgrade_v1(manifest_bytes)?)
        } else {
            None
        };
        let current = upgraded.as_deref().unwrap_or(manifest_bytes);
        let manifest = rkyv::access::<ArchivedManifest, rkyv::rancor::Error>(current)
            .map_err(|e| FormatError::ManifestInvalid(e.to_string()))?;
        let (tensor_index, expert_index) = check_manifest(manifest, &header, actual)?;
        crate::precision::check(manifest)?;
        Ok(Bundle {
            storage,
            upgraded,
            header,
            tensor_index,
            expert_index,
        })
    }

    /// The decoded header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The manifest, in place.
    pub fn manifest(&self) -> &ArchivedManifest {
        let bytes = self.manifest_bytes();
        // SAFETY: these exact bytes passed `rkyv::access` (bytecheck validation) when the bundle
        // was opened, and the storage is immutable and owned by `self` for as long as the
        // returned reference lives.
        unsafe { rkyv::access_unchecked::<ArchivedManifest>(bytes) }
    }

    fn manifest_bytes(&self) -> &[u8] {
        if let Some(upgraded) = &self.upgraded {
            return upgraded;
        }
        // Both fit in usize and lie inside the storage: checked at open.
        let start = self.header.manifest_offset as usize;
        let end = start + self.header.manifest_len as usize;
        &self.storage.bytes()[start..end]
    }

    /// An owned copy of the manifest (for printing it, for example).
    pub fn to_manifest(&self) -> Result<Manifest> {
        rkyv::deserialize::<Manifest, rkyv::rancor::Error>(self.manifest())
            .map_err(|e| FormatError::ManifestInvalid(e.to_string()))
    }

    pub fn architecture(&self) -> &str {
        self.manifest().architecture.as_str()
    }

    pub fn hyperparameters_json(&self) -> &str {
        self.manifest().hyperparameters_json.as_str()
    }

    /// The named tensor (constant time).
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let index = *self
            .tensor_index
            .get(name)
            .ok_or_else(|| FormatError::UnknownTensor(name.to_string()))?;
        let entry = &self.manifest().tensors[index as usize];
        let shape = entry
            .shape
            .iter()
            .map(|d| {
                let d = d.to_native();
                usize::try_from(d).map_err(|_| FormatError::DimensionTooLarge {
                    name: name.to_string(),
                    dim: d,
                })
            })
            .collect::<Result<Vec<usize>>>()?;
        Ok(TensorView {
            name: entry.name.as_str(),
            dtype: dtype_of(&entry.dtype),
            shape,
            bytes: self.range(entry.offset.to_native(), entry.length.to_native()),
        })
    }

    /// Whether the bundle has a tensor of this name.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensor_index.contains_key(name)
    }

    /// Every tensor name, in manifest order.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.manifest().tensors.iter().map(|t| t.name.as_str())
    }

    /// One FP16 routed expert's blob (gate, up and down back to back), page-aligned.
    pub fn expert_blob(&self, layer: u32, expert: u32) -> Result<&[u8]> {
        let index = *self
            .expert_index
            .get(&(layer, expert))
            .ok_or(FormatError::UnknownExpert { layer, expert })?;
        let entry = &self.manifest().experts[index as usize];
        Ok(self.range(entry.offset.to_native(), entry.length.to_native()))
    }

    /// Number of sections.
    pub fn section_count(&self) -> usize {
        self.manifest().sections.len()
    }

    /// The bytes of section `index` (its `length` bytes, without trailing padding).
    ///
    /// # Panics
    /// If `index >= self.section_count()`, like slice indexing.
    pub fn section_bytes(&self, index: usize) -> &[u8] {
        let entry = &self.manifest().sections[index];
        self.range(entry.offset.to_native(), entry.length.to_native())
    }

    /// The kind of section `index`, as an owned value.
    ///
    /// # Panics
    /// If `index >= self.section_count()`, like slice indexing.
    pub fn section_kind(&self, index: usize) -> SectionKind {
        section_kind_of(&self.manifest().sections[index].kind)
    }

    /// Index of the first section of `kind`.
    pub fn find_section(&self, kind: &SectionKind) -> Option<usize> {
        self.manifest()
            .sections
            .iter()
            .position(|s| section_kind_of(&s.kind) == *kind)
    }

    /// Index of the section called `name`.
    pub fn find_section_named(&self, name: &str) -> Option<usize> {
        self.manifest()
            .sections
            .iter()
            .position(|s| s.name.as_str() == name)
    }

    /// The bytes of the first section of `kind`.
    pub fn section_by_kind(&self, kind: &SectionKind) -> Option<&[u8]> {
        self.find_section(kind).map(|i| self.section_bytes(i))
    }

    /// The source tokenizer.json stored in the bundle, if any.
    pub fn tokenizer_bytes(&self) -> Option<&[u8]> {
        self.section_by_kind(&SectionKind::Tokenizer)
    }

    /// The source config.json stored in the bundle, if any.
    pub fn config_bytes(&self) -> Option<&[u8]> {
        self.section_by_kind(&SectionKind::Config)
    }

    /// The whole file (for registering the mapping with a DMA engine, for example).
    pub fn as_bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    /// The file behind the mapping and the path it was opened by; `None` for in-memory bundles.
    /// Reading it gives the same bytes as [`Self::as_bytes`] (bundles are never modified in place).
    pub fn file(&self) -> Option<(&File, &Path)> {
        match &self.storage {
            Storage::Mapped { file, path, .. } => Some((file, path)),
            Storage::Memory(_) => None,
        }
    }

    pub fn file_len(&self) -> u64 {
        self.header.file_len
    }

    /// A range checked at open.
    fn range(&self, offset: u64, length: u64) -> &[u8] {
        let start = offset as usize;
        &self.storage.bytes()[start..start + length as usize]
    }
}

/// `offset..offset + length` as a usize range, if it fits inside `limit` bytes without overflow.
fn checked_range(
    what: &str,
    offset: u64,
    length: u64,
    limit: u64,
) -> Result<std::ops::Range<usize>> {
    let out = || FormatError::RangeOutOfFile {
        what: what.to_string(),
        offset,
        length,
        file_len: limit,
    };
    let end = offset.checked_add(length).ok_or_else(out)?;
    if end > limit {
        return Err(out());
    }
    // `limit` is a buffer length, so both fit in usize.
    Ok(offset as usize..end as usize)
}

type Indexes = (HashMap<String, u32>, HashMap<(u32, u32), u32>);

/// Checks every range and cross-reference in a validated manifest, and builds the name indexes.
/// A format 1.x manifest (validated like any other), as the current manifest: the same values
/// with [`Precision::default`] (an FP16 target and a 4-bit draft, which 1.x always held).
fn upgrade_v1(bytes: &[u8]) -> Result<AlignedVec<16>> {
    let old = rkyv::access::<crate::ArchivedManifestV1, rkyv::rancor::Error>(bytes)
        .map_err(|e| FormatError::ManifestInvalid(format!("format 1.x manifest: {e}")))?;
    let old = rkyv::deserialize::<crate::ManifestV1, rkyv::rancor::Error>(old)
        .map_err(|e| FormatError::ManifestInvalid(format!("format 1.x manifest: {e}")))?;
    rkyv::to_bytes::<rkyv::rancor::Error>(&old.upgrade())
        .map_err(|e| FormatError::ManifestEncode(e.to_string()))
}

fn check_manifest(manifest: &ArchivedManifest, header: &Header, file_len: u64) -> Result<Indexes> {
    let sections = &manifest.sections;
    let manifest_start = header.manifest_offset;
    let manifest_end = header.manifest_offset + header.manifest_len;
    let mut names = HashMap::with_capacity(sections.len());
    let mut by_offset = Vec::with_capacity(sections.len());
    for section in sections.iter() {
        let name = section.name.as_str();
        let what = format!("section {name:?}");
        let (offset, length) = (section.offset.to_native(), section.length.to_native());
        checked_range(&what, offset, length, file_len)?;
        if offset % PAGE != 0 {
            return Err(FormatError::Misaligned {
                what,
                offset,
                alignment: PAGE,
            });
        }
        if offset < HEADER_LEN as u64 {
            return Err(FormatError::Overlap {
                first: "the header".into(),
                second: what,
            });
        }
        if offset < manifest_end && offset + length > manifest_start {
            return Err(FormatError::Overlap {
                first: what,
                second: "the manifest".into(),
            });
        }
        if names.insert(name, ()).is_some() {
            return Err(FormatError::DuplicateSection(name.to_string()));
        }
        by_offset.push((offset, length, name));
    }
    by_offset.sort_unstable();
    for pair in by_offset.windows(2) {
        let (a_off, a_len, a_name) = pair[0];
        let (b_off, _, b_name) = pair[1];
        if a_off + a_len > b_off {
            return Err(FormatError::Overlap {
                first: format!("section {a_name:?}"),
                second: format!("section {b_name:?}"),
            });
        }
    }

    let section_of = |what: &str, index: u32| {
        sections
            .get(index as usize)
            .ok_or(FormatError::BadSectionIndex {
                what: what.to_string(),
                index,
                count: sections.len(),
            })
    };
    let inside_section = |what: String, offset: u64, length: u64, index: u32| -> Result<()> {
        let section = section_of(&what, index)?;
        let (s_off, s_len) = (section.offset.to_native(), section.length.to_native());
        let end = offset.checked_add(length);
        // Section ranges were checked above, so `s_off + s_len` does not overflow.
        if offset < s_off || end.is_none_or(|end| end > s_off + s_len) {
            return Err(FormatError::RangeOutOfSection {
                what,
                offset,
                length,
                section: section.name.as_str().to_string(),
                section_offset: s_off,
                section_length: s_len,
            });
        }
        Ok(())
    };

    let mut tensor_index = HashMap::with_capacity(manifest.tensors.len());
    for (i, tensor) in manifest.tensors.iter().enumerate() {
        let name = tensor.name.as_str();
        let what = format!("tensor {name:?}");
        let (offset, length) = (tensor.offset.to_native(), tensor.length.to_native());
        inside_section(what.clone(), offset, length, tensor.section.to_native())?;
        if offset % TENSOR_ALIGN != 0 {
            return Err(FormatError::Misaligned {
                what,
                offset,
                alignment: TENSOR_ALIGN,
            });
        }
        let dtype = dtype_of(&tensor.dtype);
        let shape: Vec<u64> = tensor.shape.iter().map(|d| d.to_native()).collect();
        let expected = tensor_byte_len(name, dtype, &shape)?;
        if expected != length {
            return Err(FormatError::TensorLength {
                name: name.to_string(),
                dtype: dtype.name(),
                shape,
                expected,
                actual: length,
            });
        }
        if tensor_index.insert(name.to_string(), i as u32).is_some() {
            return Err(FormatError::DuplicateTensor(name.to_string()));
        }
    }

    let mut expert_index = HashMap::with_capacity(manifest.experts.len());
    for (i, expert) in manifest.experts.iter().enumerate() {
        let (layer, number) = (expert.layer.to_native(), expert.expert.to_native());
        let what = format!("expert {number} of layer {layer}");
        let (offset, length) = (expert.offset.to_native(), expert.length.to_native());
        let section_index = expert.section.to_native();
        inside_section(what.clone(), offset, length, section_index)?;
        let section = section_of(&what, section_index)?;
        if section_kind_of(&section.kind) != (SectionKind::Experts { layer }) {
            return Err(FormatError::ExpertSection {
                layer,
                expert: number,
                section: section.name.as_str().to_string(),
            });
        }
        if offset % PAGE != 0 {
            return Err(FormatError::Misaligned {
                what,
                offset,
                alignment: PAGE,
            });
        }
        if expert_index.insert((layer, number), i as u32).is_some() {
            return Err(FormatError::DuplicateExpert {
                layer,
                expert: number,
            });
        }
    }
    Ok((tensor_index, expert_index))
}

pub(crate) fn dtype_of(archived: &ArchivedDType) -> DType {
    match archived {
        ArchivedDType::F16 => DType::F16,
        ArchivedDType::BF16 => DType::BF16,
        ArchivedDType::F32 => DType::F32,
        ArchivedDType::I32 => DType::I32,
        ArchivedDType::U32 => DType::U32,
        ArchivedDType::U8 => DType::U8,
    }
}

pub(crate) fn section_kind_of(archived: &ArchivedSectionKind) -> SectionKind {
    match archived {
        ArchivedSectionKind::Shared => SectionKind::Shared,
        ArchivedSectionKind::Experts { layer } => SectionKind::Experts {
            layer: layer.to_native(),
        },
        ArchivedSectionKind::Draft { layer } => SectionKind::Draft {
            layer: layer.to_native(),
        },
        ArchivedSectionKind::Tokenizer => SectionKind::Tokenizer,
        ArchivedSectionKind::Config => SectionKind::Config,
        ArchivedSectionKind::Other => SectionKind::Other,
    }
}
