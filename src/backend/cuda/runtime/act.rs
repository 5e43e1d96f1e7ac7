//! Device tensors: activations ([`GpuAct`], f32 rows in pooled buffers) and weights
//! ([`GpuWeight`]: FP16, INT4 or row-layout codes with scales, or a routed expert kept in the bundle for the slots).

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use half::f16;

use crate::backend::cuda::runtime::pool::PooledBuf;
use crate::quant::Bits;

/// A row-major `[rows, cols]` f32 activation in device memory.
///
/// The buffer is shared: [`Backend::head_rows`] hands out a view of the first rows without a copy
/// (the MLA path reads the whole latent cache every step). Writes go through device pointers on
/// the one compute stream, which orders them after every earlier read.
pub struct GpuAct {
    pub(in crate::backend::cuda) buf: Arc<PooledBuf>,
    pub(in crate::backend::cuda) rows: usize,
    pub(in crate::backend::cuda) cols: usize,
}

impl GpuAct {
    /// `(rows, cols)`, as the shape checks take it.
    pub(in crate::backend::cuda) fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Another handle on the same buffer.
    pub(in crate::backend::cuda) fn share(&self) -> GpuAct {
        GpuAct {
            buf: self.buf.clone(),
            rows: self.rows,
            cols: self.cols,
        }
    }
}

/// A weight in device memory, or a routed expert that lives in host memory until a pass needs it.
pub enum GpuWeight {
    F16 {
        name: String,
        shape: Vec<usize>,
        buf: CudaSlice<f16>,
    },
    /// Marlin-tiled INT4 `[k inputs, n outputs]` with its group scales (docs/MARLIN.md).
    Int4 {
        name: String,
        k: usize,
        n: usize,
        qweight: CudaSlice<u32>,
        scales: CudaSlice<f16>,
    },
    /// An 8-, 3- or 2-bit `[n outputs, k inputs]` matrix in the row layout (src/quant/rows.rs)
    /// with its `[n][k / 128]` group scales: routed experts of INT8 targets and 3- and 2-bit drafts.
    Rows {
        name: String,
        bits: Bits,
        k: usize,
        n: usize,
        qweight: CudaSlice<u8>,
        scales: CudaSlice<f16>,
    },
    /// Part of routed expert `expert` of model layer `layer`, copied in by the expert cache.
    Offloaded { layer: usize, expert: usize },
}

impl GpuWeight {
    pub(in crate::backend::cuda) fn describe(&self) -> String {
        match self {
            GpuWeight::F16 { name, shape, .. } => format!("{name} {shape:?}"),
            GpuWeight::Int4 { name, k, n, .. } => format!("{name} (INT4, k {k}, n {n})"),
            GpuWeight::Rows {
                name, bits, k, n, ..
            } => format!("{name} ({bits}-bit rows, k {k}, n {n})"),
            GpuWeight::Offloaded { layer, expert } => {
                format!("offloaded expert {expert} of layer {layer}")
            }
        }
    }
}
