//! Launching the grouped W4A16 expert kernels of `kernels/moe_int4.cu` (the INT4 draft experts).
//!
//! [`MoeInt4Kernels::launch`] runs the gate/up and down stages of a [`MoeLaunch`] whose expert
//! weights are Marlin-tiled INT4 (docs/MARLIN.md); the combine stage is separate. The kernels
//! use tensor-core mma for every group size (no separate small-batch path, so an item's bits never
//! depend on its group's size). Each entry comes in variants that take up to 8 or 16 items per
//! block at a time; the launch picks the smallest that covers the largest group, and both compute
//! the same bits for an item.
//!
//! Every variant keeps its warps' load rings, and a staged variant its block's activations, in
//! dynamic shared memory (sized per launch from K); [`MoeInt4Kernels::new`] raises each
//! function's dynamic shared memory limit to what the device allows, and a launch that would need
//! more is refused with [`Error::Backend`].

use crate::backend::cuda::moe::experts::{
    CombineInDown, ExpertGroup, MoeLaunch, SharedDown, MAX_GRID_Y,
};
use crate::backend::cuda::moe::kernel::Kernel;
use crate::backend::cuda::options::LaunchRule;
use crate::backend::cuda::runtime::args::{
    DevPtr, Int4DownArgs, Int4DownCombineArgs, Int4GateUpArgs, KernelArgs,
};
use crate::backend::cuda::runtime::driver::NO_CLUSTER;
use crate::backend::cuda::runtime::launch_constants::{
    GEMV_FEATURES, GEMV_WARPS, MOE_INT4_COLS_PER_BLOCK as COLS_PER_BLOCK, MOE_INT4_GROUP as GROUP,
    MOE_INT4_PAIRED as PAIRED, MOE_INT4_RED_STRIDE as RED_STRIDE, MOE_INT4_RING as RING,
    MOE_INT4_STAGED as STAGED, MOE_INT4_THREADS as THREADS, MOE_INT4_VARIANTS as VARIANTS,
    MOE_INT4_WARPS as WARPS,
};
use crate::backend::cuda::{CudaDevice, CudaStream};
use crate::{Error, Result};

/// The kernel file (`kernels/moe_int4.cu`).
const MODULE: &str = "moe_int4";

// The kernels read the groups as a 40-byte struct (kernels/common.cuh asserts the same size).
const _: () = assert!(std::mem::size_of::<ExpertGroup>() == 40);

/// The gate/up and down kernels of every variant, loaded from one device.
pub struct MoeInt4Kernels {
    gate_up: [Kernel<Int4GateUpArgs>; 2],
    down: [Kernel<Int4DownArgs>; 2],
    /// The 8-item down with the one-row combine in its clusters (`moe_int4_down_combine_8`).
    down_combine: Kernel<Int4DownCombineArgs>,
    /// How each launch starts (see [`Self::launching`]).
    launches: LaunchRule,
}

impl std::fmt::Debug for MoeInt4Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoeInt4Kernels")
            .field("variants", &VARIANTS)
            .finish()
    }
}

/// Checks the shapes and sizes of a launch against what the INT4 kernels need.
pub fn check_int4_launch(l: &MoeLaunch) -> Result<()> {
    let bad = |what: String| Err(Error::Backend(format!("INT4 MoE launch: {what}")));
    if l.hidden == 0 || l.inter == 0 {
        return bad(format!(
            "hidden={} inter={} must both be positive",
            l.hidden, l.inter
        ));
    }
    if !l.hidden.is_multiple_of(GROUP) {
        return bad(format!(
            "hidden={} must be a multiple of {GROUP} (K of gate/up: quantization group, eight warps of tile rows)",
            l.hidden
        ));
    }
    if !l.hidden.is_multiple_of(COLS_PER_BLOCK) {
        return bad(format!(
            "hidden={} must be a multiple of {COLS_PER_BLOCK} (N of down: Marlin block columns)",
            l.hidden
        ));
    }
    if !l.inter.is_multiple_of(GROUP) {
        return bad(format!(
            "inter={} must be a multiple of {GROUP} (K of down: quantization group, eight warps of tile rows)",
            l.inter
        ));
    }
    if !(2 * l.inter).is_multiple_of(COLS_PER_BLOCK) {
        return bad(format!(
            "2*inter={} must be a multiple of {COLS_PER_BLOCK} (N of gate/up: Marlin block columns)",
            2 * l.inter
        ));
    }
    l.check_sizes(8).or_else(bad)
}

/// The variant (index into [`VARIANTS`]) for a launch whose largest group has `max_count` items.
fn variant_for(max_count: usize) -> usize {
    VARIANTS
        .iter()
        .position(|&v| v >= max_count)
        .unwrap_or(VARIANTS.len() - 1)
}

/// Bytes of one warp's space in the dynamic shared memory of `variant` (`moe_warp_space_bytes`
/// in kernels/moe_int4.cu): its load ring of `RING` 512-byte slots, which its reduction arrays
/// (one `[M][RED_STRIDE]` f32 array per matrix of a pass, two when `PAIRED`) reuse afterwards.
fn warp_space_bytes(variant: usize) -> usize {
    let matrices = if PAIRED[variant] { 2 } else { 1 };
    (512 * RING[variant]).max(matrices * VARIANTS[variant] * RED_STRIDE * 4)
}

/// Dynamic shared memory of one block of `variant` for a matrix with `k` input features: the
/// eight warps' spaces, then, when staged, each warp's `k / 128` tile rows of activations as
/// f16, `8 M + 8` words per tile row (`MOE_XS_STRIDE`), so 8 (k / 128) (8 M + 8) 4 = 2 k (M + 1)
/// bytes.
fn dynamic_shared_bytes(variant: usize, k: usize) -> usize {
    let staged = if STAGED[variant] {
        2 * k * (VARIANTS[variant] + 1)
    } else {
        0
    };
    WARPS * warp_space_bytes(variant) + staged
}

impl<A: KernelArgs> Kernel<A> {
    /// The dynamic shared memory of a launch of variant `variant` with K = `k`, checked against
    /// what this function was allowed.
    fn dynamic_shared(&self, variant: usize, k: usize, stage: &str) -> Result<u32> {
        let bytes = dynamic_shared_bytes(variant, k);
        if bytes > self.max_dynamic_shared {
            return Err(Error::Backend(format!(
                "INT4 MoE launch: the {stage} kernel with K={k} and {}-item chunks needs {bytes} \
                 bytes of dynamic shared memory per block, the device allows {}",
                VARIANTS[variant], self.max_dynamic_shared
            )));
        }
        // max_dynamic_shared came from an i32.
        Ok(bytes as u32)
    }
}

impl MoeInt4Kernels {
    /// Loads (compiling on first use) the kernels from `device`.
    pub fn new(device: &CudaDevice) -> Result<Self> {
        fn load<A: KernelArgs>(device: &CudaDevice, stage: &str) -> Result<[Kernel<A>; 2]> {
            let f = |v: usize| {
                Kernel::load(device, MODULE, &format!("moe_int4_{stage}_{}", VARIANTS[v]))
            };
            Ok([f(0)?, f(1)?])
        }
        Ok(MoeInt4Kernels {
            gate_up: load(device, "gate_up")?,
            down: load(device, "down")?,
            down_combine: Kernel::load(
                device,
                MODULE,
                &format!("moe_int4_down_combine_{}", VARIANTS[0]),
            )?,
            launches: LaunchRule::default(),
        })
    }

    /// Launches by `rule`, the backend's (`launch_overlapping` where it says so: both kernels
    /// begin with `SPX_PROLOGUE`, which waits before they read anything an earlier kernel
    /// writes; the measurement lists' launches left out or started late; labels "moe int4
    /// gate/up", "moe int4 down" and "moe int4 down + combine"). Without it, every launch
    /// starts once the kernel before it has finished.
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
        self.issue_clustered(stream, what, kernel, (grid, NO_CLUSTER), shared_bytes, args)
    }

    /// [`Self::issue`] in thread block clusters of `grids.1` blocks (the grid `grids.0` a
    /// multiple of it).
    fn issue_clustered<A: KernelArgs>(
        &self,
        stream: &CudaStream,
        what: &str,
        kernel: &Kernel<A>,
        grids: ((u32, u32, u32), (u32, u32, u32)),
        shared_bytes: u32,
        args: A,
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        // SAFETY: `args` are the arguments of `kernel`'s signature (its type says so), with the
        // dynamic shared memory the function was allowed; the kernel waits (SPX_PROLOGUE, or
        // linear_block's wait for the shared experts' blocks) before it touches anything an
        // earlier kernel writes.
        unsafe {
            kernel.issue(
                stream,
                &self.launches,
                what,
                (grids.0, THREADS, shared_bytes),
                grids.1,
                args,
            )
        }
    }

    /// Items per block chunk of the kernel variant a launch with largest group `max_count` runs
    /// (8 or 16); every variant uses the tensor-core path and gives an item the same bits.
    pub fn chunk_items(max_count: usize) -> usize {
        VARIANTS[variant_for(max_count)]
    }

    /// Issues gate/up then down for every group of `l` on `stream` (asynchronously).
    ///
    /// `l.max_count` only selects the variant: a group larger than it is still computed in full,
    /// in more chunks. Expert `qweight` and scale pointers must be 16-byte aligned, `x` and `h`
    /// 8-byte aligned.
    pub fn launch(&self, stream: &CudaStream, l: &MoeLaunch) -> Result<()> {
        self.launch_gate_up(stream, l)?;
        self.launch_down(stream, l)
    }

    /// [`Self::launch`] with the shared experts' down product of one row, `shared.y =
    /// shared.h @ shared.down^T`, run by extra blocks of the gate/up launch: the same bits as
    /// `linear_f16_1`.
    pub(crate) fn launch_with_shared_down(
        &self,
        stream: &CudaStream,
        l: &MoeLaunch,
        shared: &SharedDown,
    ) -> Result<()> {
        self.gate_up(stream, l, Some(shared))?;
        self.launch_down(stream, l)
    }

    /// [`Self::launch_with_shared_down`] whose down launch also combines the row:
    /// `combine.y = sum of the top_k item outputs + shared.y`, with `moe_combine`'s bits, in
    /// thread block clusters of the top_k groups of a block column (sm_90 and newer; the
    /// caller's choice). For one row whose groups are its top_k (at most 8) items.
    pub(crate) fn launch_with_shared_down_combined(
        &self,
        stream: &CudaStream,
        l: &MoeLaunch,
        shared: &SharedDown,
        combine: &CombineInDown,
    ) -> Result<()> {
        if Self::checked_variant(l)? != Some(0)
            || l.num_groups != combine.top_k
            || l.items != combine.top_k
            || !(1..=8).contains(&combine.top_k)
        {
            return Err(Error::Backend(format!(
                "INT4 down with the combine: {} groups of {} items (at most {} a group) are not \
                 one row's top_k of {}, 1 to 8",
                l.num_groups, l.items, l.max_count, combine.top_k
            )));
        }
        self.gate_up(stream, l, Some(shared))?;
        let kernel = &self.down_combine;
        let top_k = combine.top_k as u32;
        let grid = ((l.hidden / COLS_PER_BLOCK) as u32, top_k, 1);
        let bytes = kernel.dynamic_shared(0, l.inter, "down with the combine")?;
        // As moe_int4_down_8's (checked above and by MoeLaunch's promise), plus the shared output
        // and y, `hidden` floats each (SharedDown's and the caller's). The grid's rows are the
        // cluster's top_k blocks.
        let args = Int4DownCombineArgs {
            down: down_args(l),
            top_k,
            s_y: DevPtr(shared.y),
            y: DevPtr(combine.y),
        };
        let grids = (grid, (1, top_k, 1));
        self.issue_clustered(
            stream,
            "moe int4 down + combine",
            kernel,
            grids,
            bytes,
            args,
        )
        .map_err(|e| {
            Error::Backend(format!(
                "launching the INT4 down kernel with the combine: {e}"
            ))
        })
    }

    /// Issues only the gate/up stage: `h` of every item.
    pub fn launch_gate_up(&self, stream: &CudaStream, l: &MoeLaunch) -> Result<()> {
        self.gate_up(stream, l, None)
    }

    /// The variant a launch of `l` runs, once its shapes are checked; `None` when it has no work.
    fn checked_variant(l: &MoeLaunch) -> Result<Option<usize>> {
        check_int4_launch(l)?;
        let empty = l.num_groups == 0 || l.items == 0;
        Ok((!empty).then(|| variant_for(l.max_count)))
    }

    fn gate_up(
        &self,
        stream: &CudaStream,
        l: &MoeLaunch,
        shared: Option<&SharedDown>,
    ) -> Result<()> {
        let Some(variant) = Self::checked_variant(l)? else {
            return Ok(());
        };
        let kernel = &self.gate_up[variant];
        let grid_x = (l.inter / COLS_PER_BLOCK) as u32;
        let shared_rows = match shared {
            Some(sd) => shared_down_rows(sd, l.hidden, grid_x)?,
            None => 0,
        };
        let rows = l.num_groups + shared_rows as usize;
        if rows > MAX_GRID_Y {
            return Err(Error::Backend(format!(
                "INT4 gate/up: {rows} grid rows exceed the limit of {MAX_GRID_Y}"
            )));
        }
        let grid = (grid_x, rows as u32, 1);
        let bytes = kernel.dynamic_shared(variant, l.hidden, "gate/up")?;
        // The shapes were checked above (they fit 32 bits), and the caller's MoeLaunch promises
        // device buffers of the sizes it documents, groups whose items lie in 0..items with
        // qweight/scales of the K = hidden, N = 2 inter matrix, and a SharedDown one row of
        // s_inter inputs, a [hidden][s_inter] f16 weight and hidden outputs. The dynamic shared
        // memory is what the variant needs for K = hidden, within the limit set on the function
        // at load.
        let args = Int4GateUpArgs {
            groups: DevPtr(l.groups),
            x: DevPtr(l.x),
            item_row: DevPtr(l.item_row),
            h: DevPtr(l.h),
            hidden: l.hidden as u32,
            inter: l.inter as u32,
            num_groups: l.num_groups as u32,
            s_h: DevPtr(shared.map_or(0, |sd| sd.h)),
            s_inter: shared.map_or(0, |sd| sd.inter as u32),
            s_down: DevPtr(shared.map_or(0, |sd| sd.down)),
            s_y: DevPtr(shared.map_or(0, |sd| sd.y)),
        };
        self.issue(stream, "moe int4 gate/up", kernel, grid, bytes, args)
            .map_err(|e| Error::Backend(format!("launching the INT4 gate/up kernel: {e}")))
    }

    /// Issues only the down stage: `out` of every item, from `h`.
    pub fn launch_down(&self, stream: &CudaStream, l: &MoeLaunch) -> Result<()> {
        let Some(variant) = Self::checked_variant(l)? else {
            return Ok(());
        };
        let kernel = &self.down[variant];
        let grid = ((l.hidden / COLS_PER_BLOCK) as u32, l.num_groups as u32, 1);
        let bytes = kernel.dynamic_shared(variant, l.inter, "down")?;
        // Shapes checked above and buffers as MoeLaunch documents them (qweight/scales of the
        // K = inter, N = hidden matrix); dynamic shared memory as the variant needs for K =
        // inter, within the function's limit.
        self.issue(stream, "moe int4 down", kernel, grid, bytes, down_args(l))
            .map_err(|e| Error::Backend(format!("launching the INT4 down kernel: {e}")))
    }
}

/// The arguments of a down launch of `l`, in moe_int4_down_<M>'s order (the clustered form
/// takes more after them).
/// The down kernels' arguments for `l` (its sizes checked to fit 32 bits).
fn down_args(l: &MoeLaunch) -> Int4DownArgs {
    Int4DownArgs {
        groups: DevPtr(l.groups),
        h: DevPtr(l.h),
        item_weight: DevPtr(l.item_weight),
        out: DevPtr(l.out),
        hidden: l.hidden as u32,
        inter: l.inter as u32,
    }
}

/// Grid rows of shared-down blocks a gate/up launch of `grid_x` columns adds: each block of
/// eight warps runs two of `linear_f16_1`'s four-warp work blocks of `hidden` outputs.
fn shared_down_rows(sd: &SharedDown, hidden: usize, grid_x: u32) -> Result<u32> {
    let bad = |what: String| {
        Err(Error::Backend(format!(
            "INT4 gate/up with shared down: {what}"
        )))
    };
    if sd.rows != 1 {
        return bad(format!("{} rows; the launch runs one", sd.rows));
    }
    if sd.inter == 0 || u32::try_from(sd.inter).is_err() {
        return bad(format!(
            "shared inter={} is not a positive 32-bit size",
            sd.inter
        ));
    }
    if sd.h == 0 || sd.down == 0 || sd.y == 0 {
        return bad("a device pointer is null".into());
    }
    let work = hidden.div_ceil(GEMV_FEATURES * GEMV_WARPS);
    let blocks = work.div_ceil(2);
    let rows = blocks.div_ceil(grid_x.max(1) as usize);
    u32::try_from(rows)
        .ok()
        .filter(|r| (*r as usize) <= MAX_GRID_Y)
        .map_or_else(|| bad(format!("{rows} grid rows")), Ok)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn message(l: &MoeLaunch) -> String {
        match check_int4_launch(l) {
            Err(Error::Backend(msg)) => msg,
            other => panic!("expected a backend error, got {other:?}"),
        }
    }

    #[test]
    fn accepts_real_shapes() {
        check_int4_launch(&launch(2048, 1408)).unwrap();
        check_int4_launch(&launch(256, 128)).unwrap();
        // An empty launch needs no pointers.
        let mut l = launch(256, 128);
        (l.items, l.max_count, l.x) = (0, 0, 0);
        check_int4_launch(&l).unwrap();
    }

    #[test]
    fn names_each_problem() {
        assert!(message(&launch(0, 128)).contains("hidden=0"));
        assert!(message(&launch(2000, 1408)).contains("hidden=2000"));
        assert!(message(&launch(2048, 1400)).contains("inter=1400"));
        assert!(message(&launch(2048, 64)).contains("inter=64"));
        let mut l = launch(256, 128);
        l.num_groups = 70_000;
        assert!(message(&l).contains("70000 groups"));
        let mut l = launch(256, 128);
        l.max_count = 0;
        assert!(message(&l).contains("max_count is 0"));
        let mut l = launch(256, 128);
        l.max_count = 10;
        assert!(message(&l).contains("max_count=10"));
        let mut l = launch(256, 128);
        l.h = 0;
        assert!(message(&l).contains("pointer h"));
        let mut l = launch(256, 128);
        l.x += 4;
        assert!(message(&l).contains("x=0x1004 is not 8-byte aligned"));
    }

    #[test]
    fn dynamic_shared_memory_fits_the_model_shapes() {
        // DeepSeek-V2-Lite: gate/up K = 2048, down K = 1408.
        // 16 items: eight warp spaces of 4352 bytes (the reduction array outgrows the 4 KiB
        // ring), then 2 K (16 + 1) bytes of staged activations.
        assert_eq!(dynamic_shared_bytes(1, 2048), 34_816 + 69_632);
        assert_eq!(dynamic_shared_bytes(1, 1408), 34_816 + 47_872);
        // 8 items: eight 8 KiB rings, then 2 K (8 + 1) bytes.
        assert_eq!(dynamic_shared_bytes(0, 2048), 65_536 + 36_864);
        assert_eq!(dynamic_shared_bytes(0, 1408), 65_536 + 25_344);
        // Within an H100/H200 block's 227 KiB beside the ~4 KB of static shared memory; the
        // 8-item variant's two blocks an SM within its 228 KiB.
        assert!(dynamic_shared_bytes(1, 2048) + 4_224 <= 227 * 1024);
        assert!(2 * (dynamic_shared_bytes(0, 2048) + 2_112 + 1024) <= 228 * 1024);
    }

    #[test]
    fn variant_covers_the_largest_group() {
        assert_eq!(VARIANTS[variant_for(1)], 8);
        assert_eq!(VARIANTS[variant_for(8)], 8);
        assert_eq!(VARIANTS[variant_for(9)], 16);
        assert_eq!(VARIANTS[variant_for(16)], 16);
        // Larger groups run in chunks of sixteen.
        assert_eq!(VARIANTS[variant_for(17)], 16);
        assert_eq!(MoeInt4Kernels::chunk_items(4), 8);
        assert_eq!(MoeInt4Kernels::chunk_items(40), 16);
    }
}
