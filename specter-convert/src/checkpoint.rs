//! The Hugging Face checkpoint reader: a directory with `config.json`, safetensors shards (with or
//! without `model.safetensors.index.json`) and optionally `tokenizer.json`.
//!
//! Shards are memory-mapped; tensors are served straight from the mapping when they are already
//! FP16 and aligned, and converted otherwise. Routed experts are always presented under their
//! architecture's classic per-expert names (`...mlp.experts.{e}.gate_proj.weight`, or Mixtral's and
//! PhiMoE's `...block_sparse_moe.experts.{e}.w1.weight`), also when the checkpoint stores them
//! fused the way transformers 5 holds them in memory (`...mlp.experts.gate_up_proj` `[E, 2I, H]`
//! and `...mlp.experts.down_proj` `[E, H, I]`), so everything downstream sees one naming.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::{Dtype, SafeTensors};
use sha2::{Digest, Sha256};
use specter::arch::{ArchConfig, MoeModel};
use specter::backend::cpu::Cpu;
use specter::weights::{Tensor, WeightStore};
use specter_format::SourceFile;

use crate::{Error, Result};

/// Name of the shard index file transformers writes for sharded checkpoints.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
const CONFIG_FILE: &str = "config.json";
const TOKENIZER_FILE: &str = "tokenizer.json";
/// Largest finite f16 value.
const F16_MAX: f32 = 65504.0;

/// One memory-mapped safetensors file.
struct Shard {
    file_name: String,
    map: Mmap,
}

/// Where a (normalized) tensor's bytes are: a contiguous byte range of one shard.
#[derive(Clone, Debug)]
struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// An opened Hugging Face checkpoint directory.
pub struct Checkpoint {
    dir: PathBuf,
    config_json: String,
    tokenizer_json: Option<Vec<u8>>,
    index_json: Option<Vec<u8>>,
    shards: Vec<Shard>,
    entries: BTreeMap<String, Entry>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field(
                "shards",
                &self.shards.iter().map(|s| &s.file_name).collect::<Vec<_>>(),
            )
            .field("tensors", &self.entries.len())
            .finish()
    }
}

fn model_err(msg: impl Into<String>) -> Error {
    Error::Model(msg.into())
}

impl Checkpoint {
    /// Opens `dir`: reads `config.json` (required) and `tokenizer.json` (optional), finds the
    /// shards (from `model.safetensors.index.json` when present, else every `*.safetensors`),
    /// maps them and parses their headers.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let config_path = dir.join(CONFIG_FILE);
        let config_json = std::fs::read_to_string(&config_path).map_err(|e| {
            Error::io(
                format!("checkpoint {}: reading {CONFIG_FILE}", dir.display()),
                e,
            )
        })?;
        let config: serde_json::Value = serde_json::from_str(&config_json)
            .map_err(|e| model_err(format!("{}: invalid JSON: {e}", config_path.display())))?;

        let tokenizer_json = read_optional(&dir.join(TOKENIZER_FILE))?;
        let index_json = read_optional(&dir.join(INDEX_FILE))?;

        let (shard_names, weight_map) = match &index_json {
            Some(bytes) => {
                let weight_map = parse_index(bytes, &dir.join(INDEX_FILE))?;
                let names: BTreeSet<String> = weight_map.values().cloned().collect();
                (names.into_iter().collect::<Vec<_>>(), Some(weight_map))
            }
            None => (list_safetensors(dir)?, None),
        };
        if shard_names.is_empty() {
            return Err(model_err(format!(
                "checkpoint {}: no {INDEX_FILE} and no *.safetensors files",
                dir.display()
            )));
        }

        let mut shards = Vec::with_capacity(shard_names.len());
        let mut raw: Vec<(String, Entry)> = Vec::new();
        let mut seen: HashMap<String, usize> = HashMap::new();
        for (shard_idx, file_name) in shard_names.iter().enumerate() {
            let path = dir.join(file_name);
            let file = File::open(&path).map_err(|e| {
                let why = if index_json.is_some() {
                    format!("shard {file_name} named in {INDEX_FILE}")
                } else {
                    format!("shard {file_name}")
                };
                Error::io(format!("checkpoint {}: opening {why}", dir.display()), e)
            })?;
            // SAFETY: the mapping is read-only and lives as long as the Checkpoint. Checkpoint files
            // are treated as immutable inputs; a file truncated underneath a live mapping is outside
            // what any mmap-based reader can defend against.
            let map = unsafe { Mmap::map(&file) }
                .map_err(|e| Error::io(format!("mapping {}", path.display()), e))?;
            let (header_len, metadata) = SafeTensors::read_metadata(&map).map_err(|e| {
                model_err(format!(
                    "{}: not a valid safetensors file: {e}",
                    path.display()
                ))
            })?;
            let data_start = 8 + header_len;
            for (name, info) in metadata.tensors() {
                if let Some(&other) = seen.get(&name) {
                    return Err(model_err(format!(
                        "checkpoint {}: tensor {name} appears in both {} and {file_name}",
                        dir.display(),
                        shard_names[other]
                    )));
                }
                seen.insert(name.clone(), shard_idx);
                let (s, e) = info.data_offsets;
                raw.push((
                    name,
                    Entry {
                        shard: shard_idx,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        start: data_start + s,
                        end: data_start + e,
                    },
                ));
            }
            shards.push(Shard {
                file_name: file_name.clone(),
                map,
            });
        }

        if let Some(weight_map) = &weight_map {
            for (name, file_name) in weight_map {
                match seen.get(name) {
                    Some(&idx) if shard_names[idx] == *file_name => {}
                    Some(&idx) => {
                        return Err(model_err(format!(
                            "checkpoint {}: {INDEX_FILE} places {name} in {file_name}, but it is in {}",
                            dir.display(),
                            shard_names[idx]
                        )))
                    }
                    None => {
                        return Err(model_err(format!(
                            "checkpoint {}: {INDEX_FILE} places {name} in {file_name}, which does not hold it",
                            dir.display()
                        )))
                    }
                }
            }
        }

        let model_type = config.get("model_type").and_then(|v| v.as_str());
        let hidden_size = config
            .get("hidden_size")
            .and_then(|v| v.as_u64())
            .map(|h| h as usize);
        let entries = normalize(model_type, hidden_size, raw)
            .map_err(|e| model_err(format!("checkpoint {}: {e}", dir.display())))?;

        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            config_json,
            tokenizer_json,
            index_json,
            shards,
            entries,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `config.json`, verbatim.
    pub fn config_json(&self) -> &str {
        &self.config_json
    }

    /// `tokenizer.json`, verbatim, if the checkpoint has one.
    pub fn tokenizer_json(&self) -> Option<&[u8]> {
        self.tokenizer_json.as_deref()
    }

    /// Every tensor, under its normalized name, sorted.
    pub fn tensor_names(&self) -> Vec<String> {
        self.entries.keys().cloned().collect()
    }

    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        Ok(self.entry(name)?.shape.clone())
    }

    /// The safetensors dtype a tensor is stored in (before any conversion).
    pub fn dtype(&self, name: &str) -> Result<Dtype> {
        Ok(self.entry(name)?.dtype)
    }

    /// Name, length and sha256 of every file the checkpoint was read from: `config.json`,
    /// `tokenizer.json` and the index when present, then the shards. Shards are hashed in parallel.
    pub fn source_files(&self) -> Result<Vec<SourceFile>> {
        let mut files = vec![source_file(CONFIG_FILE, self.config_json.as_bytes())];
        if let Some(t) = &self.tokenizer_json {
            files.push(source_file(TOKENIZER_FILE, t));
        }
        if let Some(i) = &self.index_json {
            files.push(source_file(INDEX_FILE, i));
        }
        let shards: Vec<SourceFile> = self
            .shards
            .par_iter()
            .map(|s| source_file(&s.file_name, &s.map))
            .collect();
        files.extend(shards);
        Ok(files)
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.entries.get(name).ok_or_else(|| {
            model_err(format!(
                "checkpoint {}: no tensor {name}",
                self.dir.display()
            ))
        })
    }

    fn bytes(&self, entry: &Entry) -> &[u8] {
        // Ranges come from headers that `read_metadata` validated against the file length.
        &self.shards[entry.shard].map[entry.start..entry.end]
    }
}

/// The model of the checkpoint directory `dir` on the CPU reference backend. The runtime opens
/// bundles; a checkpoint is run only by conversion (GPTQ calibration) and by tests.
pub fn open_cpu_model(dir: &Path) -> Result<MoeModel<Cpu>> {
    let ck = Checkpoint::open(dir)?;
    let cfg = ArchConfig::from_config_json(ck.config_json())?;
    MoeModel::load(cfg, &ck, Cpu)
}

impl WeightStore for Checkpoint {
    fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    fn f16(&self, name: &str) -> Result<Tensor<'_, f16>> {
        let entry = self.entry(name)?;
        let bytes = self.bytes(entry);
        let data: Cow<'_, [f16]> = match entry.dtype {
            Dtype::F16 => {
                let values = cast_or_copy(bytes, f16::from_le_bytes);
                if let Some(i) = values.iter().position(|v| !v.is_finite()) {
                    return Err(non_finite(name, i, values[i].to_f32()));
                }
                values
            }
            Dtype::BF16 => Cow::Owned(to_f16_checked(
                name,
                bytes
                    .chunks_exact(2)
                    .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()),
            )?),
            Dtype::F32 => Cow::Owned(to_f16_checked(
                name,
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            )?),
            other => {
                return Err(model_err(format!(
                "tensor {name}: dtype {other:?} cannot be read as f16 (expected F16, BF16 or F32)"
            )))
            }
        };
        Ok(Tensor {
            shape: entry.shape.clone(),
            data,
        })
    }

    fn u32(&self, name: &str) -> Result<Tensor<'_, u32>> {
        let entry = self.entry(name)?;
        match entry.dtype {
            // I32 is reinterpreted bit for bit: packed INT4 words are stored as either.
            Dtype::U32 | Dtype::I32 => Ok(Tensor {
                shape: entry.shape.clone(),
                data: cast_or_copy(self.bytes(entry), u32::from_le_bytes),
            }),
            other => Err(model_err(format!(
                "tensor {name}: dtype {other:?} cannot be read as u32 (expected U32 or I32)"
            ))),
        }
    }
}

/// Views little-endian bytes as `T` without copying when the host is little-endian and the bytes
/// are aligned, else decodes them.
fn cast_or_copy<T, const N: usize>(bytes: &[u8], decode: fn([u8; N]) -> T) -> Cow<'_, [T]>
where
    T: bytemuck::Pod,
{
    if cfg!(target_endian = "little") {
        if let Ok(view) = bytemuck::try_cast_slice::<u8, T>(bytes) {
            return Cow::Borrowed(view);
        }
    }
    Cow::Owned(
        bytes
            .chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                decode(a)
            })
            .collect(),
    )
}

fn non_finite(name: &str, index: usize, value: f32) -> Error {
    model_err(format!(
        "tensor {name}: element {index} is {value}, not a finite number"
    ))
}

/// Converts to f16, failing on NaN, infinities and finite values beyond f16's range (which would
/// silently become infinities).
fn to_f16_checked(name: &str, values: impl Iterator<Item = f32>) -> Result<Vec<f16>> {
    let mut out = Vec::with_capacity(values.size_hint().0);
    for (i, x) in values.enumerate() {
        if !x.is_finite() {
            return Err(non_finite(name, i, x));
        }
        if x.abs() > F16_MAX {
            return Err(model_err(format!(
                "tensor {name}: element {i} is {x}, outside f16's range (|x| <= {F16_MAX})"
            )));
        }
        out.push(f16::from_f32(x));
    }
    Ok(out)
}

fn source_file(name: &str, bytes: &[u8]) -> SourceFile {
    SourceFile {
        name: name.to_string(),
        length: bytes.len() as u64,
        sha256: Sha256::digest(bytes).into(),
    }
}

fn read_optional(path: &Path) -> Result<Option<Vec<u8>>> {
    match std::fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(format!("reading {}", path.display()), e)),
    }
}

/// `weight_map` of an index file: tensor name -> shard file name.
fn parse_index(bytes: &[u8], path: &Path) -> Result<BTreeMap<String, String>> {
    let value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| model_err(format!("{}: invalid JSON: {e}", path.display())))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| model_err(format!("{}: no \"weight_map\" object", path.display())))?;
    let mut out = BTreeMap::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| {
            model_err(format!(
                "{}: weight_map entry {name} is not a file name",
                path.display()
            ))
        })?;
        // Shards must sit in the checkpoint directory itself.
        if file.contains('/') || file.contains('\\') || file == ".." {
            return Err(model_err(format!(
                "{}: weight_map entry {name} points outside the directory ({file})",
                path.display()
            )));
        }
        out.insert(name.clone(), file.to_string());
    }
    Ok(out)
}

fn list_safetensors(dir: &Path) -> Result<Vec<String>> {
    let read =
        std::fs::read_dir(dir).map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
    let mut names = Vec::new();
    for item in read {
        let item = item.map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
        let name = item.file_name().to_string_lossy().into_owned();
        if name.ends_with(".safetensors") {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// How an architecture names its per-expert projections in classic checkpoints.
struct ExpertNames {
    /// The MoE block's attribute in a decoder layer.
    block: &'static str,
    gate: &'static str,
    up: &'static str,
    down: &'static str,
}

fn expert_names(model_type: Option<&str>) -> ExpertNames {
    match model_type {
        Some("mixtral") | Some("phimoe") => ExpertNames {
            block: "block_sparse_moe",
            gate: "w1",
            up: "w3",
            down: "w2",
        },
        _ => ExpertNames {
            block: "mlp",
            gate: "gate_proj",
            up: "up_proj",
            down: "down_proj",
        },
    }
}

/// Renames transformers 5's in-memory module names back to the classic checkpoint names of
/// architectures whose classic names differ (Mixtral and PhiMoE call the MoE block
/// `block_sparse_moe`, and PhiMoE's classic router is `gate`, not `router`).
fn classic_name(model_type: Option<&str>, name: &str) -> String {
    match model_type {
        Some("mixtral") | Some("phimoe") => {
            let renamed = name.replace(".mlp.", ".block_sparse_moe.");
            match renamed.strip_suffix(".block_sparse_moe.router.weight") {
                Some(prefix) => format!("{prefix}.block_sparse_moe.gate.weight"),
                None => renamed,
            }
        }
        _ => name.to_string(),
    }
}

const FUSED_GATE_UP: &str = ".experts.gate_up_proj";
const FUSED_DOWN: &str = ".experts.down_proj";

/// Maps raw checkpoint names to normalized names, splitting fused expert tensors into per-expert
/// byte ranges (each expert's slice of `[E, 2I, H]` / `[E, H, I]` is contiguous, so no copy).
fn normalize(
    model_type: Option<&str>,
    hidden_size: Option<usize>,
    raw: Vec<(String, Entry)>,
) -> std::result::Result<BTreeMap<String, Entry>, String> {
    let names = expert_names(model_type);
    let mut out = BTreeMap::new();
    let mut insert = |name: String, entry: Entry, from: &str| -> std::result::Result<(), String> {
        if out.contains_key(&name) {
            return Err(format!("tensor {name} (from {from}) is stored twice"));
        }
        out.insert(name, entry);
        Ok(())
    };
    // Per prefix, the intermediate size seen in gate_up and down, to check they agree.
    let mut fused_inter: BTreeMap<String, (Option<usize>, Option<usize>)> = BTreeMap::new();
    for (raw_name, entry) in raw {
        let name = classic_name(model_type, &raw_name);
        let fused = name
            .strip_suffix(FUSED_GATE_UP)
            .map(|p| (p.to_string(), true))
            .or_else(|| {
                name.strip_suffix(FUSED_DOWN)
                    .map(|p| (p.to_string(), false))
            });
        let Some((block_prefix, is_gate_up)) = fused else {
            insert(name, entry, &raw_name)?;
            continue;
        };
        if model_type.is_none() {
            return Err(format!(
                "fused expert tensor {raw_name} needs config.json's model_type to be named"
            ));
        }
        let [experts, rows, cols] = entry.shape[..] else {
            return Err(format!(
                "fused expert tensor {raw_name} has shape {:?}; expected 3 dimensions",
                entry.shape
            ));
        };
        let elem = entry.dtype.bitsize() / 8;
        if elem == 0 || !entry.dtype.bitsize().is_multiple_of(8) {
            return Err(format!(
                "fused expert tensor {raw_name} has sub-byte dtype {:?}",
                entry.dtype
            ));
        }
        let (hidden, inter) = if is_gate_up {
            if !rows.is_multiple_of(2) {
                return Err(format!(
                    "{raw_name}: shape {:?} is not [E, 2*I, H]",
                    entry.shape
                ));
            }
            (cols, rows / 2)
        } else {
            (rows, cols)
        };
        if let Some(h) = hidden_size {
            if hidden != h {
                let want = if is_gate_up {
                    "[E, 2*I, hidden_size]"
                } else {
                    "[E, hidden_size, I]"
                };
                return Err(format!(
                    "{raw_name}: shape {:?} is not {want} with hidden_size {h} (transposed layouts are not supported)",
                    entry.shape
                ));
            }
        }
        let seen = fused_inter.entry(block_prefix.clone()).or_default();
        if is_gate_up {
            seen.0 = Some(inter);
        } else {
            seen.1 = Some(inter);
        }
        let slice = |expert: usize, offset_elems: usize, shape: Vec<usize>| -> Entry {
            let per_expert = rows * cols * elem;
            let start = entry.start + expert * per_expert + offset_elems * elem;
            let len: usize = shape.iter().product::<usize>() * elem;
            Entry {
                shard: entry.shard,
                dtype: entry.dtype,
                shape,
                start,
                end: start + len,
            }
        };
        // The block prefix ends with the MoE block attribute; classic names hang experts under it.
        for e in 0..experts {
            let base = format!("{block_prefix}.experts.{e}");
            if is_gate_up {
                insert(
                    format!("{base}.{}.weight", names.gate),
                    slice(e, 0, vec![inter, hidden]),
                    &raw_name,
                )?;
                insert(
                    format!("{base}.{}.weight", names.up),
                    slice(e, inter * hidden, vec![inter, hidden]),
                    &raw_name,
                )?;
            } else {
                insert(
                    format!("{base}.{}.weight", names.down),
                    slice(e, 0, vec![hidden, inter]),
                    &raw_name,
                )?;
            }
        }
        if !block_prefix.ends_with(names.block) {
            return Err(format!(
                "fused expert tensor {raw_name} is not under a .{} block",
                names.block
            ));
        }
    }
    for (prefix, (gate_up, down)) in fused_inter {
        if let (Some(a), Some(b)) = (gate_up, down) {
            if a != b {
                return Err(format!(
                    "{prefix}: fused gate_up_proj implies intermediate size {a} but down_proj has {b}"
                ));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn misaligned_bytes_are_decoded_not_cast() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let words: Vec<u32> = (0..33).map(|_| rng.random()).collect();
        let mut bytes = vec![0u8];
        bytes.extend(words.iter().flat_map(|w| w.to_le_bytes()));
        // Offset 1 of a Vec<u8> is never 4-byte aligned (allocations are at least 8-aligned).
        let view = cast_or_copy(&bytes[1..], u32::from_le_bytes);
        assert!(matches!(view, Cow::Owned(_)));
        assert_eq!(&view[..], &words[..]);
        let halves: Vec<f16> = (0..9)
            .map(|_| f16::from_f32(rng.random_range(-4.0..4.0)))
            .collect();
        let mut hb = vec![0u8];
        hb.extend(halves.iter().flat_map(|h| h.to_le_bytes()));
        assert_eq!(&cast_or_copy(&hb[1..], f16::from_le_bytes)[..], &halves[..]);
    }
}
