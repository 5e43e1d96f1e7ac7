//! Launching the grouped expert kernels of `kernels/moe_rows.cu`: experts quantized in the row
//! layout (docs/FORMAT.md, "Expert encodings"), an INT8 or INT4 target's or a 3- or 2-bit
//! draft's.
//!
//! [`MoeRowsKernels::launch`] runs the gate/up and down stages of a [`MoeLaunch`] whose groups
//! point at row-layout codes and scales (the combine stage is separate):
//!
//! - `gate_up`: the `[2 inter][hidden b / 8]` codes (gate rows, then up rows), `gate_up_scales`
//!   their `[2 inter][hidden / 128]` f16 scales;
//! - `down`: the `[hidden][inter b / 8]` codes, `down_scales` their `[hidden][inter / 128]`.
//!
//! The kernel file's header states the numerics contract: each item's bits follow from its own
//! activation row, expert and the shapes alone, so a batch equals its rows one at a time. A
//! block stages up to `MOE_ROWS_ITEMS` (8) items' activation rows in dynamic shared memory at a
//! time; a launch whose largest group holds one item runs the one-item kernels (`_1`, compiled
//! for that case alone: more blocks an SM), any other the general ones with as many items a chunk
//! as the largest group has (at most eight) and the device's shared memory allows.

use crate::backend::cuda::moe::experts::{ExpertGroup, MoeLaunch};
use crate::backend::cuda::moe::kernel::Kernel;
use crate::backend::cuda::options::LaunchRule;
use crate::backend::cuda::runtime::args::{DevPtr, KernelArgs, RowsDownArgs, RowsGateUpArgs};
use crate::backend::cuda::runtime::driver::NO_CLUSTER;
use crate::backend::cuda::runtime::launch_constants::{
    MOE_ROWS_ITEMS, MOE_ROWS_PAD as PAD, MOE_ROWS_WARPS as WARPS, MOE_ROWS_WARP_PAIRS as WARP_PAIRS,
};
use crate::backend::cuda::{CudaDevice, CudaStream};
use crate::quant::{Bits, GROUP_SIZE};
use crate::{Error, Result};

/// The kernel file (`kernels/moe_rows.cu`).
const MODULE: &str = "moe_rows";

/// Threads per block.
const THREADS: u32 = 32 * WARPS as u32;

/// The widths the kernels come in, in the order of [`MoeRowsKernels`]' arrays.
const WIDTHS: [u32; 4] = [8, 4, 3, 2];

// The kernels read the groups as a 40-byte struct (kernels/common.cuh asserts the same size).
const _: () = assert!(std::mem::size_of::<ExpertGroup>() == 40);

/// The index of `bits` in [`WIDTHS`].
fn width_index(bits: Bits) -> Result<usize> {
    WIDTHS.iter().position(|&w| w == bits.get()).ok_or_else(|| {
        Error::Backend(format!(
            "row-layout MoE launch: no {bits}-bit kernels in the row layout (8, 4, 3 or 2 bits)"
        ))
    })
}

/// Inputs per chunk of the contract at width `bits`: 16 at 8 bits, a 32-input run at 4, 3 and 2.
fn chunk_inputs(bits: Bits) -> usize {
    if bits == Bits::EIGHT {
        16
    } else {
        32
    }
}

/// Floats of one item's staged activation row of `k` inputs: chunks padded by [`PAD`]
/// (`staged_floats` in kernels/moe_rows.cu).
fn staged_floats(k: usize, bits: Bits) -> usize {
    let chunk = chunk_inputs(bits);
    k / chunk * (chunk + PAD)
}

/// Checks the shapes and sizes of a launch of `bits`-bit experts against what the row-layout
/// kernels need.
pub fn check_rows_launch(l: &MoeLaunch, bits: Bits) -> Result<()> {
    width_index(bits)?;
    let bad = |what: String| {
        Err(Error::Backend(format!(
            "row-layout {bits}-bit MoE launch: {what}"
        )))
    };
    for (name, v) in [("hidden", l.hidden), ("inter", l.inter)] {
        if v == 0 || !v.is_multiple_of(GROUP_SIZE) {
            return bad(format!(
                "{name}={v} must be a positive multiple of {GROUP_SIZE} (the quantization group)"
            ));
        }
    }
    l.check_sizes(16).or_else(bad)
}

/// Items a block stages at a time for a launch whose largest group has `max_count` items, with
/// `max_shared` bytes of dynamic shared memory and `row_bytes` bytes per staged row: as many as
/// the largest group has, at most [`MOE_ROWS_ITEMS`], and no more than fit; `None` when not even
/// one row fits.
fn chunk_items_for(max_count: usize, row_bytes: usize, max_shared: usize) -> Option<usize> {
    let fit = max_shared / row_bytes.max(1);
    let items = max_count.clamp(1, MOE_ROWS_ITEMS).min(fit);
    (items > 0).then_some(items)
}

/// A stage's kernels of one width: the general one and the one-item one (`_1`).
struct Stage<A> {
    general: Kernel<A>,
    one: Kernel<A>,
}

impl<A: KernelArgs> Stage<A> {
    fn load(device: &CudaDevice, stage: &str, bits: u32) -> Result<Self> {
        Ok(Stage {
            general: Kernel::load(device, MODULE, &kernel_name(stage, bits, false))?,
            one: Kernel::load(device, MODULE, &kernel_name(stage, bits, true))?,
        })
    }

    /// The kernel for `l` and its items a chunk and dynamic shared memory, for a stage of `k`
    /// inputs at width `bits`.
    fn pick(
        &self,
        l: &MoeLaunch,
        k: usize,
        bits: Bits,
        what: &str,
    ) -> Result<(&Kernel<A>, u32, u32)> {
        let kernel = if l.max_count <= 1 {
            &self.one
        } else {
            &self.general
        };
        let row_bytes = 4 * staged_floats(k, bits);
        // The one-item kernels get one: max_count is at most 1 there.
        let items = chunk_items_for(l.max_count, row_bytes, kernel.max_dynamic_shared).ok_or_else(
            || {
                Error::Backend(format!(
                    "row-layout {bits}-bit MoE {what}: one staged activation row of {k} inputs \
                     needs {row_bytes} bytes of shared memory, the device allows {}",
                    kernel.max_dynamic_shared
                ))
            },
        )?;
        // At most MOE_ROWS_ITEMS rows that fit a device limit taken from an i32.
        Ok((kernel, items as u32, (items * row_bytes) as u32))
    }
}

/// The gate/up and down kernels of every width, loaded from one device.
pub struct MoeRowsKernels {
    /// Per width of [`WIDTHS`].
    gate_up: [Stage<RowsGateUpArgs>; WIDTHS.len()],
    down: [Stage<RowsDownArgs>; WIDTHS.len()],
    /// How each launch starts (see [`Self::launching`]).
    launches: LaunchRule,
}

impl std::fmt::Debug for MoeRowsKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoeRowsKernels")
            .field("widths", &WIDTHS)
            .finish()
    }
}

impl MoeRowsKernels {
    /// Loads (compiling on first use) the kernels from `device`.
    pub fn new(device: &CudaDevice) -> Result<Self> {
        let gate_up = |i: usize| Stage::load(device, "gate_up", WIDTHS[i]);
        let down = |i: usize| Stage::load(device, "down", WIDTHS[i]);
        Ok(MoeRowsKernels {
            gate_up: [gate_up(0)?, gate_up(1)?, gate_up(2)?, gate_up(3)?],
            down: [down(0)?, down(1)?, down(2)?, down(3)?],
            launches: LaunchRule::default(),
        })
    }

    /// Launches by `rule`, the backend's (`launch_overlapping` where it says so: the gate/up
    /// kernels wait before they read anything an earlier kernel writes, and let the next launch
    /// start only after that wait; the down kernels read their group and ask L2 for their
    /// weights before their wait, which that order makes safe; the measurement lists' launches
    /// left out or started late; labels "moe rows gate/up" and "moe rows down"). Without it,
    /// every launch starts once the kernel before it has finished.
    pub(in crate::backend::cuda) fn launching(mut self, rule: LaunchRule) -> Self {
        self.set_launches(rule);
        self
    }

    pub(in crate::backend::cuda) fn set_launches(&mut self, rule: LaunchRule) {
        self.launches = rule;
    }

    /// Launches `kernel` (labelled `what`) with THREADS-thread blocks.
    fn issue<A: KernelArgs>(
        &self,
        stream: &CudaStream,
        what: &str,
        kernel: &Kernel<A>,
        grid: (u32, u32, u32),
        shared_bytes: u32,
        args: A,
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        // SAFETY: `args` are the arguments of `kernel`'s signature (its type says so), with no
        // more dynamic shared memory than the function was allowed at load; the kernels wait
        // (spx_grid_wait) before they touch anything an earlier kernel writes, reading only
        // weights and (the down kernels, after a gate/up launch) the work list's group before.
        unsafe {
            kernel.issue(
                stream,
                &self.launches,
                what,
                (grid, THREADS, shared_bytes),
                NO_CLUSTER,
                args,
            )
        }
    }

    /// Issues gate/up then down for every group of `l` at width `bits` (8, 4, 3 or 2) on `stream`
    /// (asynchronously).
    ///
    /// `l.max_count` only picks the kernels and the items staged at a time: a group larger than
    /// it is still computed in full, in more chunks. Expert code matrices must be 16-byte
    /// aligned and scales 2-byte aligned, `x` and `h` 16-byte aligned (checked). The down
    /// launch reads its groups before it waits for the launch before it, so that launch must be
    /// this list's gate/up (as here) whenever launches may overlap.
    pub fn launch(&self, stream: &CudaStream, l: &MoeLaunch, bits: Bits) -> Result<()> {
        self.launch_gate_up(stream, l, bits)?;
        self.launch_down(stream, l, bits)
    }

    /// Issues only the gate/up stage: `h` of every item.
    pub fn launch_gate_up(&self, stream: &CudaStream, l: &MoeLaunch, bits: Bits) -> Result<()> {
        let Some(w) = Self::checked_width(l, bits)? else {
            return Ok(());
        };
        let (kernel, chunk_items, bytes) = self.gate_up[w].pick(l, l.hidden, bits, "gate/up")?;
        // A warp streams WARP_PAIRS features (a gate row and an up row each).
        let grid = (
            l.inter.div_ceil(WARPS * WARP_PAIRS) as u32,
            l.num_groups as u32,
            1,
        );
        // The shapes were checked above (they fit 32 bits, hidden and inter multiples of 128),
        // and the caller's MoeLaunch promises device buffers of the sizes it documents and
        // groups whose items lie in 0..items with codes and scales of [2 inter] rows of hidden
        // inputs. The dynamic shared memory holds chunk_items staged rows of hidden inputs,
        // within the function's limit.
        let args = RowsGateUpArgs {
            groups: DevPtr(l.groups),
            x: DevPtr(l.x),
            item_row: DevPtr(l.item_row),
            h: DevPtr(l.h),
            hidden: l.hidden as u32,
            inter: l.inter as u32,
            chunk_items,
        };
        self.issue(stream, "moe rows gate/up", kernel, grid, bytes, args)
            .map_err(|e| {
                Error::Backend(format!(
                    "launching the {bits}-bit row-layout gate/up kernel: {e}"
                ))
            })
    }

    /// Issues only the down stage: `out` of every item, from `h`.
    pub fn launch_down(&self, stream: &CudaStream, l: &MoeLaunch, bits: Bits) -> Result<()> {
        let Some(w) = Self::checked_width(l, bits)? else {
            return Ok(());
        };
        let (kernel, chunk_items, bytes) = self.down[w].pick(l, l.inter, bits, "down")?;
        let grid = (
            // A warp streams WARP_PAIRS pairs of adjacent output rows.
            l.hidden.div_ceil(2 * WARP_PAIRS * WARPS) as u32,
            l.num_groups as u32,
            1,
        );
        // Shapes checked above and buffers as MoeLaunch documents them (codes and scales of
        // [hidden] rows of inter inputs); chunk_items staged rows of inter inputs, within the
        // function's limit.
        let args = RowsDownArgs {
            groups: DevPtr(l.groups),
            h: DevPtr(l.h),
            item_weight: DevPtr(l.item_weight),
            out: DevPtr(l.out),
            hidden: l.hidden as u32,
            inter: l.inter as u32,
            chunk_items,
        };
        self.issue(stream, "moe rows down", kernel, grid, bytes, args)
            .map_err(|e| {
                Error::Backend(format!(
                    "launching the {bits}-bit row-layout down kernel: {e}"
                ))
            })
    }

    /// The width index of a launch of `l`, once its shapes are checked; `None` when it has no
    /// work.
    fn checked_width(l: &MoeLaunch, bits: Bits) -> Result<Option<usize>> {
        check_rows_launch(l, bits)?;
        if l.num_groups == 0 || l.items == 0 {
            return Ok(None);
        }
        width_index(bits).map(Some)
    }
}

/// The entry point of `stage` ("gate_up" or "down") at width `bits`, in its one-item form where
/// `one`.
fn kernel_name(stage: &str, bits: u32, one: bool) -> String {
    format!("moe_rows_{stage}_{bits}{}", if one { "_1" } else { "" })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_width_names_kernels_its_arguments_allow() {
        // Kernel::load refuses a name its argument type does not list; only a GPU would see it.
        for b in WIDTHS {
            for one in [false, true] {
                let name = kernel_name("gate_up", b, one);
                assert!(RowsGateUpArgs::KERNELS.contains(&name.as_str()), "{name}");
                let name = kernel_name("down", b, one);
                assert!(RowsDownArgs::KERNELS.contains(&name.as_str()), "{name}");
            }
        }
    }

    fn launch(hidden: usize, inter: usize) -> MoeLaunch {
        MoeLaunch {
            x: 0x1000,
            hidden,
            inter,
            groups: 0x2000,
            num_groups: 3,
            max_count: 5,
            item_row: 0x3000,
            item_weight: 0x4000,
            items: 9,
            h: 0x5000,
            out: 0x6000,
        }
    }

    fn bits(b: u32) -> Bits {
        Bits::new(b).unwrap()
    }

    fn message(l: &MoeLaunch, b: u32) -> String {
        match check_rows_launch(l, bits(b)) {
            Err(Error::Backend(msg)) => msg,
            other => panic!("expected a backend error, got {other:?}"),
        }
    }

    #[test]
    fn accepts_real_shapes_at_every_row_width() {
        for b in WIDTHS {
            check_rows_launch(&launch(2048, 1408), bits(b)).unwrap();
            check_rows_launch(&launch(128, 128), bits(b)).unwrap();
            // An empty launch needs no pointers.
            let mut l = launch(256, 128);
            (l.items, l.max_count, l.x) = (0, 0, 0);
            check_rows_launch(&l, bits(b)).unwrap();
        }
    }

    #[test]
    fn names_each_problem() {
        assert!(message(&launch(0, 128), 8).contains("hidden=0"));
        assert!(message(&launch(2000, 1408), 3).contains("hidden=2000"));
        assert!(message(&launch(2048, 1400), 2).contains("inter=1400"));
        assert!(message(&launch(2048, 64), 8).contains("inter=64"));
        let mut l = launch(256, 128);
        l.num_groups = 70_000;
        assert!(message(&l, 8).contains("70000 groups"));
        let mut l = launch(256, 128);
        l.max_count = 0;
        assert!(message(&l, 8).contains("max_count is 0"));
        let mut l = launch(256, 128);
        l.max_count = 10;
        assert!(message(&l, 8).contains("max_count=10"));
        let mut l = launch(256, 128);
        l.item_row = 0;
        assert!(message(&l, 3).contains("pointer item_row"));
        let mut l = launch(256, 128);
        l.h += 8;
        assert!(message(&l, 2).contains("h=0x5008 is not 16-byte aligned"));
        assert!(message(&l, 2).starts_with("row-layout 2-bit MoE launch"));
    }

    #[test]
    fn staged_rows_are_padded_chunks() {
        // DeepSeek-V2-Lite: 2048 inputs of gate/up, 1408 of down.
        assert_eq!(staged_floats(2048, bits(8)), 128 * 20);
        assert_eq!(staged_floats(1408, bits(8)), 88 * 20);
        assert_eq!(staged_floats(2048, bits(3)), 64 * 36);
        assert_eq!(staged_floats(1408, bits(2)), 44 * 36);
        assert_eq!(staged_floats(1408, bits(4)), 44 * 36);
    }

    #[test]
    fn chunk_items_follow_the_largest_group_and_the_shared_memory() {
        let row = 4 * staged_floats(2048, bits(8));
        let max = 227 * 1024;
        assert_eq!(chunk_items_for(1, row, max), Some(1));
        assert_eq!(chunk_items_for(3, row, max), Some(3));
        assert_eq!(chunk_items_for(17, row, max), Some(MOE_ROWS_ITEMS));
        // Rows too long for eight: as many as fit, then none.
        assert_eq!(chunk_items_for(8, row, 3 * row + 5), Some(3));
        assert_eq!(chunk_items_for(8, row, row - 1), None);
        assert_eq!(width_index(bits(8)).unwrap(), 0);
        assert_eq!(width_index(bits(4)).unwrap(), 1);
        assert_eq!(width_index(bits(2)).unwrap(), 3);
    }
}
