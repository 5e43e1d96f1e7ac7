//! What conversion stores for each routed expert besides (or instead of) its FP16 weights: the
//! draft's codes, and a quantized target's. A 4-bit draft's matrix is stored Marlin-tiled, every
//! other quantized matrix by output rows (docs/FORMAT.md, "Expert encodings").

use specter::arch;
use specter_format::{BundleWriter, DType, Layout, QuantStat};

use crate::quant::{self, Bits, QuantMatrix, GROUP_SIZE};
use crate::{Error, Result};

/// The target's routed experts as a bundle stores them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TargetPrecision {
    Fp16,
    Int8,
    Int4,
}

impl TargetPrecision {
    pub fn parse(name: &str) -> Result<TargetPrecision> {
        match name {
            "fp16" => Ok(TargetPrecision::Fp16),
            "int8" => Ok(TargetPrecision::Int8),
            "int4" => Ok(TargetPrecision::Int4),
            _ => Err(Error::Request(format!(
                "--target {name}: the target's experts are fp16, int8 or int4"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TargetPrecision::Fp16 => "fp16",
            TargetPrecision::Int8 => "int8",
            TargetPrecision::Int4 => "int4",
        }
    }

    pub fn bits(self) -> u32 {
        match self {
            TargetPrecision::Fp16 => 16,
            TargetPrecision::Int8 => 8,
            TargetPrecision::Int4 => 4,
        }
    }

    /// The width the target's experts are quantized to; `None` for FP16.
    pub fn quant_bits(self) -> Option<Bits> {
        match self {
            TargetPrecision::Fp16 => None,
            TargetPrecision::Int8 => Some(Bits::EIGHT),
            TargetPrecision::Int4 => Some(Bits::FOUR),
        }
    }

    /// The draft's width when none is asked for: 4 bits under FP16 and INT8 targets; under an
    /// INT4 target the draft must be smaller, and 3 bits kept the draft's acceptance where 2 did
    /// not (docs/BENCHMARKS.md, "Target precision").
    pub fn default_draft_bits(self) -> u32 {
        match self {
            TargetPrecision::Fp16 | TargetPrecision::Int8 => 4,
            TargetPrecision::Int4 => 3,
        }
    }

    /// The draft's width for `asked` (or the default), checked: 4, 3 or 2 bits, fewer than the
    /// target's.
    pub fn draft_bits(self, asked: Option<u32>) -> Result<Bits> {
        let bits = asked.unwrap_or(self.default_draft_bits());
        if !specter_format::DRAFT_BITS.contains(&bits) {
            return Err(Error::Request(format!(
                "--draft-bits {bits}: the draft's experts are 4, 3 or 2 bits"
            )));
        }
        if bits >= self.bits() {
            return Err(Error::Request(format!(
                "--draft-bits {bits} with --target {}: the draft must be smaller than its target \
                 (a {bits}-bit draft of a {}-bit target saves no time); use --draft-bits 3 or 2",
                self.name(),
                self.bits()
            )));
        }
        Bits::new(bits)
    }
}

/// Whose copy of an expert a quantized matrix is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Draft,
    Target,
}

impl Role {
    /// The tensor name of `part`'s `kind` (qweight or scales) of this role's copy of an expert.
    pub fn tensor_name(self, layer: usize, expert: usize, part: &str, kind: &str) -> String {
        match self {
            Role::Draft => arch::draft_tensor_name(layer, expert, part, kind),
            Role::Target => arch::target_tensor_name(layer, expert, part, kind),
        }
    }
}

/// One quantized copy a conversion makes of every routed expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Encoding {
    pub role: Role,
    pub bits: Bits,
}

/// A quantized matrix as stored.
pub enum Packed {
    /// A 4-bit draft's.
    Marlin(quant::MarlinWeight),
    /// A target's (8 or 4 bits), a 3- or 2-bit draft's.
    Rows(quant::RowsWeight),
}

impl Packed {
    /// `m` in `role`'s layout (specter_format's `Layout::target` and `Layout::draft`).
    pub fn pack(m: &QuantMatrix, role: Role) -> Result<Packed> {
        Ok(match (role, m.bits) {
            (Role::Draft, Bits::FOUR) => Packed::Marlin(quant::marlin_pack(m)?),
            _ => Packed::Rows(quant::rows_pack(m)?),
        })
    }

    /// Writes the codes and scales as `{prefix}.qweight` and `{prefix}.scales` (`prefix` ends
    /// in the part, `gate_up` or `down`).
    pub fn write(&self, writer: &mut BundleWriter, qweight: &str, scales: &str) -> Result<()> {
        let (k, n, bits, codes, s): (usize, usize, Bits, &[u8], &[half::f16]) = match self {
            Packed::Marlin(m) => (
                m.k,
                m.n,
                Bits::FOUR,
                bytemuck::cast_slice(&m.qweight),
                &m.scales,
            ),
            Packed::Rows(m) => (m.k, m.n, m.bits, &m.qweight, &m.scales),
        };
        let layout = match self {
            Packed::Marlin(_) => Layout::Marlin,
            Packed::Rows(_) => Layout::Rows { bits: bits.get() },
        };
        let (q_shape, s_shape) = layout.shapes(k as u64, n as u64, GROUP_SIZE as u64);
        writer.write_tensor(qweight, layout.qweight_dtype(), &q_shape, codes)?;
        writer.write_tensor(scales, DType::F16, &s_shape, bytemuck::cast_slice(s))?;
        Ok(())
    }
}

/// One expert's copy in one [`Encoding`]: gate and up fused (`[hidden, 2 inter]`, gate's outputs
/// first) and down, with the error of each.
pub struct QuantExpert {
    pub encoding: Encoding,
    pub gate_up: Packed,
    pub down: Packed,
    pub stats: Vec<QuantStat>,
}

impl QuantExpert {
    pub fn new(
        encoding: Encoding,
        gate_up: &QuantMatrix,
        down: &QuantMatrix,
        stats: Vec<QuantStat>,
    ) -> Result<QuantExpert> {
        Ok(QuantExpert {
            encoding,
            gate_up: Packed::pack(gate_up, encoding.role)?,
            down: Packed::pack(down, encoding.role)?,
            stats,
        })
    }

    /// Writes the four tensors under their role's names: a target's as one expert blob (the
    /// caller begins and ends it), a draft's into its layer's draft section.
    pub fn write(&self, writer: &mut BundleWriter, layer: usize, expert: usize) -> Result<()> {
        for (part, m) in [("gate_up", &self.gate_up), ("down", &self.down)] {
            let name = |kind| self.encoding.role.tensor_name(layer, expert, part, kind);
            m.write(writer, &name("qweight"), &name("scales"))?;
        }
        Ok(())
    }
}
