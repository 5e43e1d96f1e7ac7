//! The work list of a grouped MoE launch, shared by the FP16 (target) and INT4 (draft) expert
//! kernels.
//!
//! One launch runs every expert hit by a batch once over all the rows routed to it:
//!
//! 1. gate/up: `h[item][j] = silu(x[row]·gate[j]) * (x[row]·up[j])` for `j < inter`;
//! 2. down: `out[item][c] = weight[item] * (h[item]·down[c])` for `c < hidden`;
//! 3. combine: `y[r] = sum over the row's items in ascending expert id of out[item]`.
//!
//! Items are (row, expert) pairs, numbered so that each expert's items are consecutive
//! (`first..first + count` of its [`ExpertGroup`]). Every item's arithmetic depends only on its
//! own row and expert, never on how many rows the launch holds, so a batch is bit-identical to
//! the same rows one at a time (the backend's exactness contract).

use crate::quant::Bits;

/// One expert's share of a grouped launch; mirrors `struct ExpertGroup` in kernels/common.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ExpertGroup {
    /// FP16: `[2 * inter, hidden]` row-major, gate rows then up rows. INT4: the Marlin-tiled
    /// `qweight` of the `K = hidden, N = 2 * inter` matrix (docs/MARLIN.md).
    pub gate_up: u64,
    /// INT4: the gate/up group scales (Marlin-permuted f16). FP16: 0.
    pub gate_up_scales: u64,
    /// FP16: `[hidden, inter]` row-major. INT4: `qweight` of the `K = inter, N = hidden` matrix.
    pub down: u64,
    /// INT4: the down group scales. FP16: 0.
    pub down_scales: u64,
    /// This expert's items are `first..first + count`.
    pub first: u32,
    pub count: u32,
}

/// Device pointers and sizes of one grouped launch (all pointers are device addresses).
#[derive(Clone, Copy, Debug)]
pub struct MoeLaunch {
    /// `[rows, hidden]` f32 input.
    pub x: u64,
    pub hidden: usize,
    pub inter: usize,
    /// `[groups]` [`ExpertGroup`].
    pub groups: u64,
    pub num_groups: usize,
    /// The largest `count` among the groups (bounds the grid).
    pub max_count: usize,
    /// `[items]` u32: the input row of each item.
    pub item_row: u64,
    /// `[items]` f32: the routing weight of each item.
    pub item_weight: u64,
    pub items: usize,
    /// `[items, inter]` f32 scratch for the gate/up activations.
    pub h: u64,
    /// `[items, hidden]` f32: each item's weighted down output.
    pub out: u64,
}

/// The largest grid y extent the driver accepts (a launch's groups).
pub(crate) const MAX_GRID_Y: usize = 65_535;

impl MoeLaunch {
    /// What every grouped expert kernel needs of a launch beyond its weights' shapes: sizes that
    /// fit the kernels' 32-bit indices and the grid, a consistent `max_count`, no null pointer
    /// where there is work, and activation rows (`x`, `h`) aligned to `align` bytes for the
    /// kernels' vector reads. The error says which.
    pub(crate) fn check_sizes(&self, align: u64) -> std::result::Result<(), String> {
        if u32::try_from(2 * self.inter).is_err() || u32::try_from(self.hidden).is_err() {
            return Err(format!(
                "hidden={} inter={} exceed the kernels' 32-bit sizes",
                self.hidden, self.inter
            ));
        }
        if self.num_groups > MAX_GRID_Y {
            return Err(format!(
                "{} groups exceed the grid limit of {MAX_GRID_Y}",
                self.num_groups
            ));
        }
        if u32::try_from(self.items).is_err() {
            return Err(format!(
                "{} items exceed the kernels' 32-bit item index",
                self.items
            ));
        }
        if self.items > 0 && self.max_count == 0 {
            return Err(format!("{} items but max_count is 0", self.items));
        }
        if self.max_count > self.items {
            return Err(format!(
                "max_count={} exceeds the {} items of the launch",
                self.max_count, self.items
            ));
        }
        if self.num_groups > 0 && self.items > 0 {
            let pointers = [
                ("x", self.x),
                ("groups", self.groups),
                ("item_row", self.item_row),
                ("item_weight", self.item_weight),
                ("h", self.h),
                ("out", self.out),
            ];
            if let Some((name, _)) = pointers.iter().find(|(_, p)| *p == 0) {
                return Err(format!("device pointer {name} is null"));
            }
            for (name, p) in [("x", self.x), ("h", self.h)] {
                if !p.is_multiple_of(align) {
                    return Err(format!(
                        "device pointer {name}={p:#x} is not {align}-byte aligned"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A one-row MoE layer's combine inside its down launch (thread block clusters, sm_90 and newer):
/// `y[hidden]` = the row's `top_k` item outputs (ascending item, each group one item) plus the
/// shared experts' output, with `moe_combine`'s arithmetic.
pub(crate) struct CombineInDown {
    pub(crate) top_k: usize,
    pub(crate) y: u64,
}

/// The shared experts' down product for `launch_moe_f16`: `y = h @ down^T`, `[rows, hidden]`.
pub(crate) struct SharedDown {
    pub(crate) h: u64,
    pub(crate) rows: usize,
    pub(crate) inter: usize,
    pub(crate) down: u64,
    pub(crate) y: u64,
}

/// How a layer's routed experts are stored on the device, which decides their kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExpertKind {
    F16,
    /// Marlin-tiled INT4 (the default draft's).
    Int4,
    /// The row layout at 8 or 4 bits (a quantized target's), 3 or 2 bits (a draft's).
    Rows(Bits),
}

impl ExpertKind {
    /// The kind of a target's routed experts stored at `target` bits (`None`: FP16).
    pub(crate) fn of_target(target: Option<Bits>) -> ExpertKind {
        match target {
            None => ExpertKind::F16,
            Some(b) => ExpertKind::Rows(b),
        }
    }
}
