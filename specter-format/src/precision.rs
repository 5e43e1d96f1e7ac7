//! The manifest's precision against the tensors it describes: every tensor of an `Experts` or
//! `Draft` section must be stored as its layer's width says (docs/FORMAT.md, "Expert encodings").
//! Checked at every open, from the manifest alone.

use std::collections::HashMap;

use crate::reader::{dtype_of, section_kind_of};
use crate::{ArchivedManifest, DType, FormatError, Precision, Result, SectionKind};

/// How one quantized matrix is stored: its codes' dtype and the shapes of codes and scales for `k`
/// inputs and `n` outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// 4 bits, Marlin-tiled (a 4-bit draft's): `qweight` U32 `[k / 16, 2 n]`, `scales` F16
    /// `[k / 128, n]`.
    Marlin,
    /// 8 or 4 bits (a target's), 3 or 2 bits (a draft's) by output row: `qweight` U8
    /// `[n, k * bits / 8]`, `scales` F16 `[n, k / 128]`.
    Rows { bits: u32 },
}

impl Layout {
    /// The layout of a quantized target matrix of `bits` bits: the row layout, whose kernels
    /// the host path follows bit for bit.
    pub fn target(bits: u32) -> Layout {
        Layout::Rows { bits }
    }

    /// The layout of a draft matrix of `bits` bits: Marlin tiles at 4 bits (the draft's tuned
    /// one-row kernels), the row layout at 3 and 2.
    pub fn draft(bits: u32) -> Layout {
        if bits == 4 {
            Layout::Marlin
        } else {
            Layout::Rows { bits }
        }
    }

    pub fn qweight_dtype(self) -> DType {
        match self {
            Layout::Marlin => DType::U32,
            Layout::Rows { .. } => DType::U8,
        }
    }

    /// The `(qweight, scales)` shapes of a `k`-input, `n`-output matrix.
    pub fn shapes(self, k: u64, n: u64, group: u64) -> ([u64; 2], [u64; 2]) {
        match self {
            Layout::Marlin => ([k / 16, 2 * n], [k / group, n]),
            Layout::Rows { bits } => ([n, k * u64::from(bits) / 8], [n, k / group]),
        }
    }

    /// `(k, n)` read off a scales shape.
    fn dims_from_scales(self, scales: &[u64], group: u64) -> Option<(u64, u64)> {
        match (self, scales) {
            (Layout::Marlin, [g, n]) => Some((g.checked_mul(group)?, *n)),
            (Layout::Rows { .. }, [n, g]) => Some((g.checked_mul(group)?, *n)),
            _ => None,
        }
    }
}

/// One quantized matrix's tensors as the manifest lists them: the shapes of its codes and scales
/// (when present), its layout and its section's name.
struct Matrix {
    shapes: [Option<Vec<u64>>; 2],
    layout: Layout,
    section: String,
}

fn mismatch(detail: String) -> FormatError {
    FormatError::Precision(detail)
}

/// Checks the precision's widths, then every expert and draft tensor against them.
pub(crate) fn check(manifest: &ArchivedManifest) -> Result<()> {
    let p = &manifest.precision;
    let precision = Precision {
        target_bits: p.target_bits.to_native(),
        draft_bits: p.draft_bits.to_native(),
        group_size: p.group_size.to_native(),
        target_quant: crate::QuantInfo::unquantized(),
    };
    precision.check().map_err(mismatch)?;
    let group = u64::from(precision.group_size);
    // Per quantized section: its codes' and scales' shapes by matrix name.
    let mut matrices: HashMap<(u32, String), Matrix> = HashMap::new();
    for tensor in manifest.tensors.iter() {
        let section_index = tensor.section.to_native();
        let Some(section) = manifest.sections.get(section_index as usize) else {
            continue; // the range checks name a bad index
        };
        let (role, bits, layout_of): (_, _, fn(u32) -> Layout) =
            match section_kind_of(&section.kind) {
                SectionKind::Experts { .. } => ("target", precision.target_bits, Layout::target),
                SectionKind::Draft { .. } => ("draft", precision.draft_bits, Layout::draft),
                _ => continue,
            };
        let name = tensor.name.as_str();
        let dtype = dtype_of(&tensor.dtype);
        let section_name = section.name.as_str();
        if bits == 16 {
            if dtype != DType::F16 {
                return Err(mismatch(format!(
                    "section {section_name:?} holds {name} as {}, but the manifest says the \
                     target's experts are FP16",
                    dtype.name()
                )));
            }
            continue;
        }
        let layout = layout_of(bits);
        let (matrix, part, want) = if let Some(m) = name.strip_suffix(".qweight") {
            (m, 0, layout.qweight_dtype())
        } else if let Some(m) = name.strip_suffix(".scales") {
            (m, 1, DType::F16)
        } else {
            return Err(mismatch(format!(
                "section {section_name:?} holds {name}, which is neither a .qweight nor a .scales \
                 tensor of the {bits}-bit {role}"
            )));
        };
        if dtype != want {
            return Err(mismatch(format!(
                "section {section_name:?} holds {name} as {}, but the manifest says the {role}'s \
                 experts are {bits}-bit, stored as {}",
                dtype.name(),
                want.name()
            )));
        }
        let shape: Vec<u64> = tensor.shape.iter().map(|d| d.to_native()).collect();
        let entry = matrices
            .entry((section_index, matrix.to_string()))
            .or_insert_with(|| Matrix {
                shapes: [None, None],
                layout,
                section: section_name.to_string(),
            });
        entry.shapes[part] = Some(shape);
    }
    for ((_, matrix), entry) in matrices {
        let Matrix {
            shapes: [qweight, scales],
            layout,
            section,
        } = entry;
        let (Some(qweight), Some(scales)) = (qweight, scales) else {
            return Err(mismatch(format!(
                "section {section:?} holds only one of {matrix}.qweight and {matrix}.scales"
            )));
        };
        let fits = layout
            .dims_from_scales(&scales, group)
            .filter(|&(k, n)| k > 0 && n > 0)
            .is_some_and(|(k, n)| {
                let (q, s) = layout.shapes(k, n, group);
                qweight == q && scales == s
            });
        if !fits {
            return Err(mismatch(format!(
                "{matrix}: codes {qweight:?} and scales {scales:?} are not one {layout:?} matrix \
                 in groups of {group}"
            )));
        }
    }
    Ok(())
}
