//! Streaming bundle writer: sections are streamed to a temp file and never held in memory; the
//! file appears under its final name only when complete (temp file, fsync, rename, fsync dir).
//!
//! Hashing is kept off the writing thread: inline sha256 would cap writing at one core's hashing
//! speed. Each section, once ended, is hashed from the temp file (read back through a read-only
//! map, normally straight from the page cache) by a job on the rayon pool, in parallel with the
//! caller writing the next sections; [`BundleWriter::finish`] hashes in parallel whatever no idle
//! thread has picked up yet and waits for the rest.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use rayon::prelude::*;
use sha2::{Digest, Sha256};

use crate::header::{Header, HEADER_LEN};
use crate::{
    DType, ExpertEntry, FormatError, Manifest, Precision, Provenance, Result, SectionEntry,
    SectionKind, TensorEntry, PAGE, TENSOR_ALIGN,
};

/// Buffer between the writer and the file: large enough that writes are few, small enough that
/// nothing close to a section is ever held in memory.
const WRITE_BUFFER: usize = 4 << 20;

const ZEROS: [u8; PAGE as usize] = [0u8; PAGE as usize];

struct OpenSection {
    name: String,
    kind: SectionKind,
    offset: u64,
    tensors: usize,
    raw_bytes: bool,
}

struct OpenExpert {
    layer: u32,
    expert: u32,
    offset: u64,
    tensors: usize,
}

/// Where the sha256 of one ended section stands. The job queued for it and `finish` race to claim
/// it; whoever moves it out of `Pending` hashes it, so no section is hashed twice and `finish`
/// never waits on a job that has not started (which could be queued behind it on its own thread).
enum HashState {
    Pending,
    Running,
    Done(Result<[u8; 32]>),
    /// Taken by `finish`, or given up because the writer was dropped.
    Closed,
}

/// One ended section's hash: which bytes of the temp file, and the state of their sha256.
struct SectionHash {
    name: String,
    offset: u64,
    length: u64,
    state: Mutex<HashState>,
    done: Condvar,
}

impl SectionHash {
    fn lock(&self) -> MutexGuard<'_, HashState> {
        // A panic while holding this lock leaves a state that is still meaningful; carry on.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Hashes the section if nobody has claimed it yet (what the background job does).
    fn run_if_pending(&self, file: &File) {
        {
            let mut state = self.lock();
            if !matches!(*state, HashState::Pending) {
                return;
            }
            *state = HashState::Running;
        }
        let result = hash_file_range(file, self.offset, self.length, &self.name);
        *self.lock() = HashState::Done(result);
        self.done.notify_all();
    }

    /// The section's sha256: hashed here if still pending, otherwise waited for. Waiting is safe:
    /// a `Running` hash is executing on another thread and calls nothing that could block on us.
    fn take(&self, file: &File) -> Result<[u8; 32]> {
        let mut state = self.lock();
        loop {
            match std::mem::replace(&mut *state, HashState::Closed) {
                HashState::Pending => {
                    drop(state);
                    return hash_file_range(file, self.offset, self.length, &self.name);
                }
                HashState::Running => {
                    *state = HashState::Running;
                    state = self
                        .done
                        .wait(state)
                        .unwrap_or_else(|poisoned| poisoned.into_inner());
                }
                HashState::Done(result) => return result,
                HashState::Closed => {
                    return Err(FormatError::WriterMisuse(format!(
                        "the sha256 of section {:?} was already taken",
                        self.name
                    )))
                }
            }
        }
    }

    /// Gives up on the hash: cancels it if it has not started, waits for it if it has, so that no
    /// job still reads the temp file once this returns.
    fn cancel(&self) {
        let mut state = self.lock();
        while matches!(*state, HashState::Running) {
            state = self
                .done
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        *state = HashState::Closed;
    }
}

/// Writes a bundle, one section at a time. See docs/FORMAT.md for the layout it produces.
pub struct BundleWriter {
    /// `None` once finished (or after the file was handed to `finish`).
    out: Option<BufWriter<File>>,
    /// A second handle on the temp file, from which ended sections are read back to be hashed.
    reader: Arc<File>,
    /// One per entry of `sections`, in the same order.
    hashes: Vec<Arc<SectionHash>>,
    path: PathBuf,
    temp_path: PathBuf,
    /// Bytes written so far: the absolute offset of the next byte.
    pos: u64,
    sections: Vec<SectionEntry>,
    tensors: Vec<TensorEntry>,
    experts: Vec<ExpertEntry>,
    tensor_names: HashSet<String>,
    section_names: HashSet<String>,
    expert_keys: HashSet<(u32, u32)>,
    open_section: Option<OpenSection>,
    open_expert: Option<OpenExpert>,
    precision: Precision,
}

impl BundleWriter {
    /// Creates `<dir>/.<file>.tmp-<pid>` next to `path`; nothing appears under `path` until
    /// [`BundleWriter::finish`].
    pub fn create(path: &Path) -> Result<BundleWriter> {
        let bad_path = |reason: &str| FormatError::BadOutputPath {
            path: path.to_path_buf(),
            reason: reason.to_string(),
        };
        let file_name = path
            .file_name()
            .ok_or_else(|| bad_path("it does not name a file"))?;
        if path.is_dir() {
            return Err(bad_path("it is a directory"));
        }
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if !dir.is_dir() {
            return Err(bad_path(&format!(
                "its directory {} does not exist",
                dir.display()
            )));
        }
        let mut temp_name = std::ffi::OsString::from(".");
        temp_name.push(file_name);
        temp_name.push(format!(".tmp-{}", std::process::id()));
        let temp_path = dir.join(temp_name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&temp_path)
            .map_err(|e| bad_path(&format!("cannot create {}: {e}", temp_path.display())))?;
        let reader = match file.try_clone() {
            Ok(reader) => Arc::new(reader),
            Err(e) => {
                drop(file);
                let _ = std::fs::remove_file(&temp_path);
                return Err(bad_path(&format!(
                    "cannot reopen {}: {e}",
                    temp_path.display()
                )));
            }
        };
        let mut writer = BundleWriter {
            out: Some(BufWriter::with_capacity(WRITE_BUFFER, file)),
            reader,
            hashes: Vec::new(),
            path: path.to_path_buf(),
            temp_path,
            pos: 0,
            sections: Vec::new(),
            tensors: Vec::new(),
            experts: Vec::new(),
            tensor_names: HashSet::new(),
            section_names: HashSet::new(),
            expert_keys: HashSet::new(),
            open_section: None,
            open_expert: None,
            precision: Precision::default(),
        };
        // The header is written last, when the manifest's place and hash are known; reserve its page.
        writer.write_zeros(HEADER_LEN as u64)?;
        Ok(writer)
    }

    /// Starts a section on a page boundary. Only one section is open at a time.
    pub fn begin_section(&mut self, name: &str, kind: SectionKind) -> Result<()> {
        if let Some(open) = &self.open_section {
            return Err(FormatError::WriterMisuse(format!(
                "begin_section({name:?}) while section {:?} is still open; call end_section first",
                open.name
            )));
        }
        if !self.section_names.insert(name.to_string()) {
            return Err(FormatError::DuplicateSection(name.to_string()));
        }
        self.pad_between_sections_to(PAGE)?;
        self.open_section = Some(OpenSection {
            name: name.to_string(),
            kind,
            offset: self.pos,
            tensors: 0,
            raw_bytes: false,
        });
        Ok(())
    }

    /// Appends a tensor to the open section, its start aligned to 64 bytes (to a page when it
    /// starts an expert blob). `bytes.len()` must equal the product of `shape` times the dtype size.
    pub fn write_tensor(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[u64],
        bytes: &[u8],
    ) -> Result<()> {
        let section_index = self.sections.len() as u32;
        let section = self.open_section.as_ref().ok_or_else(|| {
            FormatError::WriterMisuse(format!("write_tensor({name:?}) with no open section"))
        })?;
        if section.raw_bytes {
            return Err(FormatError::WriterMisuse(format!(
                "write_tensor({name:?}) into section {:?}, which already holds raw bytes",
                section.name
            )));
        }
        let expected = tensor_byte_len(name, dtype, shape)?;
        if expected != bytes.len() as u64 {
            return Err(FormatError::TensorLength {
                name: name.to_string(),
                dtype: dtype.name(),
                shape: shape.to_vec(),
                expected,
                actual: bytes.len() as u64,
            });
        }
        if self.tensor_names.contains(name) {
            return Err(FormatError::DuplicateTensor(name.to_string()));
        }
        self.pad_section_to(TENSOR_ALIGN)?;
        let offset = self.pos;
        self.write_bytes(bytes)?;
        self.tensor_names.insert(name.to_string());
        self.tensors.push(TensorEntry {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            section: section_index,
            offset,
            length: bytes.len() as u64,
        });
        if let Some(section) = &mut self.open_section {
            section.tensors += 1;
        }
        if let Some(expert) = &mut self.open_expert {
            expert.tensors += 1;
        }
        Ok(())
    }

    /// Starts one FP16 routed expert's blob, on a page boundary, inside the open Experts section
    /// of `layer`; the tensors written until [`BundleWriter::end_expert`] form the blob.
    pub fn begin_expert(&mut self, layer: u32, expert: u32) -> Result<()> {
        let section = self.open_section.as_ref().ok_or_else(|| {
            FormatError::WriterMisuse(format!(
                "begin_expert({layer}, {expert}) with no open section"
            ))
        })?;
        if section.kind != (SectionKind::Experts { layer }) {
            return Err(FormatError::WriterMisuse(format!(
                "begin_expert({layer}, {expert}) in section {:?} of kind {:?}; expert blobs go in \
                 the Experts section of their layer",
                section.name, section.kind
            )));
        }
        if let Some(open) = &self.open_expert {
            return Err(FormatError::WriterMisuse(format!(
                "begin_expert({layer}, {expert}) while expert {} of layer {} is open; call end_expert first",
                open.expert, open.layer
            )));
        }
        if !self.expert_keys.insert((layer, expert)) {
            return Err(FormatError::DuplicateExpert { layer, expert });
        }
        self.pad_section_to(PAGE)?;
        self.open_expert = Some(OpenExpert {
            layer,
            expert,
            offset: self.pos,
            tensors: 0,
        });
        Ok(())
    }

    /// Ends the open expert blob and records it.
    pub fn end_expert(&mut self) -> Result<()> {
        let open = self
            .open_expert
            .take()
            .ok_or_else(|| FormatError::WriterMisuse("end_expert with no open expert".into()))?;
        if open.tensors == 0 {
            return Err(FormatError::WriterMisuse(format!(
                "expert {} of layer {} has no tensors; write its gate, up and down before end_expert",
                open.expert, open.layer
            )));
        }
        self.experts.push(ExpertEntry {
            layer: open.layer,
            expert: open.expert,
            section: self.sections.len() as u32,
            offset: open.offset,
            length: self.pos - open.offset,
        });
        Ok(())
    }

    /// Appends raw bytes to the open Tokenizer, Config or Other section (which then holds no
    /// tensors). May be called several times to stream large contents.
    pub fn write_raw(&mut self, bytes: &[u8]) -> Result<()> {
        let section = self
            .open_section
            .as_mut()
            .ok_or_else(|| FormatError::WriterMisuse("write_raw with no open section".into()))?;
        if !matches!(
            section.kind,
            SectionKind::Tokenizer | SectionKind::Config | SectionKind::Other
        ) {
            return Err(FormatError::WriterMisuse(format!(
                "write_raw into section {:?} of kind {:?}; raw bytes go in Tokenizer, Config or Other sections",
                section.name, section.kind
            )));
        }
        if section.tensors > 0 {
            return Err(FormatError::WriterMisuse(format!(
                "write_raw into section {:?}, which already holds tensors",
                section.name
            )));
        }
        section.raw_bytes = true;
        self.write_bytes(bytes)
    }

    /// Closes the open section and records its length; its sha256 is computed in the background
    /// (see the module documentation) and written into the manifest by `finish`.
    pub fn end_section(&mut self) -> Result<()> {
        if let Some(open) = &self.open_expert {
            return Err(FormatError::WriterMisuse(format!(
                "end_section while expert {} of layer {} is open; call end_expert first",
                open.expert, open.layer
            )));
        }
        let open = self
            .open_section
            .take()
            .ok_or_else(|| FormatError::WriterMisuse("end_section with no open section".into()))?;
        let length = self.pos - open.offset;
        // The hashing job reads the file, so the section's last bytes must have left the buffer.
        let temp = &self.temp_path;
        self.out
            .as_mut()
            .ok_or_else(|| FormatError::WriterMisuse("end_section after finish".into()))?
            .flush()
            .map_err(|e| FormatError::io(format!("writing {}", temp.display()), e))?;
        let hash = Arc::new(SectionHash {
            name: open.name.clone(),
            offset: open.offset,
            length,
            state: Mutex::new(HashState::Pending),
            done: Condvar::new(),
        });
        self.hashes.push(Arc::clone(&hash));
        let reader = Arc::clone(&self.reader);
        rayon::spawn(move || hash.run_if_pending(&reader));
        self.sections.push(SectionEntry {
            name: open.name,
            kind: open.kind,
            offset: open.offset,
            length,
            // Filled in by `finish` once the hash is known.
            sha256: [0; 32],
        });
        Ok(())
    }

    /// Writes the manifest (sections, tensors and experts as written; the rest from the caller)
    /// and the header, fsyncs the file, renames it over the output path and fsyncs the directory.
    /// Returns the file's length.
    /// Records how the experts are encoded (an FP16 target with a 4-bit draft unless set). The
    /// reader checks every expert and draft tensor against it.
    pub fn set_precision(&mut self, precision: Precision) {
        self.precision = precision;
    }

    pub fn finish(
        mut self,
        architecture: &str,
        hyperparameters_json: &str,
        provenance: Provenance,
    ) -> Result<u64> {
        if let Some(open) = &self.open_section {
            return Err(FormatError::WriterMisuse(format!(
                "finish while section {:?} is open; call end_section first",
                open.name
            )));
        }
        // Every section's bytes were flushed to the file when it ended.
        self.collect_section_hashes()?;
        let manifest = Manifest {
            architecture: architecture.to_string(),
            hyperparameters_json: hyperparameters_json.to_string(),
            sections: std::mem::take(&mut self.sections),
            tensors: std::mem::take(&mut self.tensors),
            experts: std::mem::take(&mut self.experts),
            precision: self.precision.clone(),
            provenance,
        };
        let manifest_bytes = rkyv::to_bytes::<rkyv::rancor::Error>(&manifest)
            .map_err(|e| FormatError::ManifestEncode(e.to_string()))?;
        self.pad_between_sections_to(PAGE)?;
        let manifest_offset = self.pos;
        self.write_bytes(&manifest_bytes)?;
        let file_len = self.pos;
        let temp = self.temp_path.display().to_string();
        let header = Header::new(
            file_len,
            manifest_offset,
            manifest_bytes.len() as u64,
            Sha256::digest(&manifest_bytes).into(),
        );

        let out = self
            .out
            .take()
            .ok_or_else(|| FormatError::WriterMisuse("finish called twice".into()))?;
        let mut file = out
            .into_inner()
            .map_err(|e| FormatError::io(format!("writing {temp}"), e.into_error()))?;
        file.seek(SeekFrom::Start(0))
            .and_then(|_| file.write_all(&header.encode()))
            .map_err(|e| FormatError::io(format!("writing the header of {temp}"), e))?;
        file.sync_all()
            .map_err(|e| FormatError::io(format!("syncing {temp} to disk"), e))?;
        drop(file);
        std::fs::rename(&self.temp_path, &self.path).map_err(|e| {
            FormatError::io(format!("renaming {temp} to {}", self.path.display()), e)
        })?;
        // From here the temp file no longer exists; Drop must not try to remove anything.
        self.temp_path = PathBuf::new();
        sync_parent_dir(&self.path)?;
        Ok(file_len)
    }

    fn write_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        let temp = &self.temp_path;
        let out = self
            .out
            .as_mut()
            .ok_or_else(|| FormatError::WriterMisuse("write after finish".into()))?;
        out.write_all(bytes)
            .map_err(|e| FormatError::io(format!("writing {}", temp.display()), e))?;
        self.pos += bytes.len() as u64;
        Ok(())
    }

    /// Waits for every section's sha256 (hashing in parallel those no job has started, largest
    /// first so that one big section does not start last) and records them in `sections`.
    fn collect_section_hashes(&mut self) -> Result<()> {
        let mut order: Vec<usize> = (0..self.hashes.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(self.hashes[i].length));
        let reader = &*self.reader;
        let hashes = &self.hashes;
        let results: Vec<(usize, Result<[u8; 32]>)> = order
            .into_par_iter()
            .map(|i| (i, hashes[i].take(reader)))
            .collect();
        for (i, result) in results {
            self.sections[i].sha256 = result?;
        }
        self.hashes.clear();
        Ok(())
    }

    fn write_zeros(&mut self, mut count: u64) -> Result<()> {
        while count > 0 {
            let n = count.min(PAGE) as usize;
            self.write_bytes(&ZEROS[..n])?;
            count -= n as u64;
        }
        Ok(())
    }

    /// Zero padding between sections: not part of any section, so in no checksum.
    fn pad_between_sections_to(&mut self, align: u64) -> Result<()> {
        let pad = padding(self.pos, align);
        self.write_zeros(pad)
    }

    /// Zero padding inside the open section: counted in its length and checksum.
    fn pad_section_to(&mut self, align: u64) -> Result<()> {
        let pad = padding(self.pos, align) as usize;
        // `align` is at most a page, so one slice of zeros covers it.
        self.write_bytes(&ZEROS[..pad])
    }
}

impl Drop for BundleWriter {
    fn drop(&mut self) {
        if self.temp_path.as_os_str().is_empty() {
            return;
        }
        // An unfinished bundle is useless; leave nothing behind. Errors here have nowhere to go.
        // Hashing jobs are stopped first so that none still reads the file being removed.
        for hash in &self.hashes {
            hash.cancel();
        }
        drop(self.out.take());
        let _ = std::fs::remove_file(&self.temp_path);
    }
}

/// Bytes read per step when hashing a section back from the temp file: mapped a piece at a time
/// so that hashing a huge section never maps more than this much of it at once.
const HASH_CHUNK: u64 = 8 << 20;

/// sha256 of `length` bytes of `file` from `offset` (a section of the temp file, named `section`
/// in errors), read through read-only maps of at most [`HASH_CHUNK`] bytes.
fn hash_file_range(file: &File, offset: u64, length: u64, section: &str) -> Result<[u8; 32]> {
    let mut hasher = Sha256::new();
    let mut done = 0u64;
    while done < length {
        let n = (length - done).min(HASH_CHUNK);
        // SAFETY: the map is read-only and covers bytes of the writer's own temp file that were
        // written and flushed before this section ended; the writer only ever appends after them
        // (the header it rewrites at offset 0 lies outside every section), never truncates the
        // file, and waits for every hashing job before it removes the file. Another process
        // modifying the temp file is outside what any mapped read can guard against, as for
        // `Bundle::open`.
        let map = unsafe {
            memmap2::MmapOptions::new()
                .offset(offset + done)
                .len(n as usize)
                .map(file)
        }
        .map_err(|e| {
            FormatError::io(
                format!("reading section {section:?} back from the temp file to hash it"),
                e,
            )
        })?;
        #[cfg(unix)]
        let _ = map.advise(memmap2::Advice::Sequential);
        hasher.update(&map[..]);
        done += n;
    }
    Ok(hasher.finalize().into())
}

/// Zero bytes needed to bring `pos` to a multiple of `align` (a power of two).
fn padding(pos: u64, align: u64) -> u64 {
    (align - pos % align) % align
}

/// Bytes a tensor of `shape` and `dtype` occupies, or an error if that overflows.
pub(crate) fn tensor_byte_len(name: &str, dtype: DType, shape: &[u64]) -> Result<u64> {
    shape
        .iter()
        .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| FormatError::ShapeOverflow {
            name: name.to_string(),
            shape: shape.to_vec(),
        })
}

/// Makes the rename durable: without syncing the directory a crash can lose the new entry.
pub(crate) fn sync_parent_dir(path: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| FormatError::io(format!("syncing directory {}", dir.display()), e))?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}
