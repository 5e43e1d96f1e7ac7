//! The launch geometry of the kernels that only the host decides: zeroed scratch sizes, the rows
//! and widths the host sends to one kernel or another, and the derived sizes. The constants the
//! kernels share are defined once in kernel_defines.rs (which build.rs writes into the kernel
//! sources) and re-exported here.

pub(crate) use crate::backend::cuda::runtime::kernel_defines::*;

/// Rows one `argmax_rows` launch takes: the backend's zeroed merge keys and tickets, one each per
/// row (larger calls launch again for the next rows).
pub(crate) const ARGMAX_ROWS: usize = 64;

/// Row groups a several-row dense kernel (`linear_f16`, `linear2_f16`, `gate_up_silu_f16`, the
/// shared experts' products) splits `rows` into, each feature block's groups in their own work
/// blocks: `row_groups` in kernels/linear_rows.cuh (all rows up to 2, pairs up to 4, then
/// `GEMV_WORK_ROWS`). The host sizes grids by it; the kernels' loops cover every work block
/// whatever the grid.
pub(crate) fn gemv_row_groups(rows: usize) -> u32 {
    let per = match rows {
        0..=2 => rows.max(1),
        3..=4 => 2,
        _ => GEMV_WORK_ROWS,
    };
    u32::try_from(rows.div_ceil(per)).unwrap_or(u32::MAX).max(1)
}

/// Widest hidden size `moe_f16_experts_1` runs (an arrival count per 16 outputs in its counter
/// slot); wider layers take the separate launches.
pub(crate) const EXPERTS_ONE_MAX_HIDDEN: usize = 8192;

/// Counter slots of `moe_f16_experts_1`, taken in turn by its launches. A launch takes its
/// tickets before its wait for the kernels before and its last combine zeroes the slot, so a slot
/// must not be taken again while its previous launch runs. In a model's passes a slot's next
/// launch comes 64 launches of that kernel later, with an attention launch between every two of
/// them; attention never lets the kernel after it start early, and it starts its own work only
/// once every kernel before it has finished, so by then the slot's previous launch has ended.
/// (An argument, not a check: nothing at run time tests it.) 133 KB a backend.
pub(crate) const EXPERTS_ONE_SLOTS: usize = 64;

/// Words of one slot.
pub(crate) const EXPERTS_ONE_SLOT_WORDS: usize =
    EXPERTS_ONE_ARRIVED + EXPERTS_ONE_MAX_HIDDEN / (GEMV_WARPS * GEMV_DOWN_FEATURES_ONE);

/// The fewest keys of an `attention` chunk: one pass of its score loop, `ATT_KEYS_PER_WARP` keys
/// for each of its warps (`ATT_CHUNK_MIN` in kernels/attention.cu).
pub(crate) const ATT_CHUNK_MIN: usize = ATT_THREADS as usize / 32 * ATT_KEYS_PER_WARP;

/// (row, head) pairs up to which `attention` combines its chunks in the same launch (the
/// backend's counters; decode and verification windows are far below it); larger calls, long
/// prompts, launch `attention_combine`. Both give the same bits.
pub(crate) const ATT_COUNTERS: usize = 8192;

/// Threads per block of `mla_expand_kv` (one block per row and head): the kernel strides by
/// `blockDim.x`, so any block size computes the same values.
pub(crate) const MLA_THREADS: u32 = 128;

/// Fewest latent columns `mla_kv_append_1` takes: its product waits, and norms the latent, at
/// the first pieces every lane loads, which needs 32 pieces of 8 (kernels/linear_rows.cuh,
/// `lane_dot2`). A property of that code.
pub(crate) const MLA_APPEND_MIN_RANK: usize = 256;

/// Fewest columns `add_norm_linear_1` takes: its products wait, and the block norms the row, at
/// the first pieces every lane loads (as `MLA_APPEND_MIN_RANK`).
pub(crate) const ADD_NORM_MIN_COLS: usize = 256;

/// Threads of the fused routing + work-list kernel `route_plan`.
pub(crate) const ROUTE_PLAN_THREADS: u32 = 32 * ROUTE_PLAN_WARPS as u32;

/// Rows up to which routing and the work list are built by that one launch; past it the rows
/// are routed one block each and the plan follows in a second launch (the kernel takes any
/// number of rows).
pub(crate) const ROUTE_PLAN_MAX_ROWS: usize = 64;

/// Input features per quantization group, which is also what the INT4 kernels' K must be a
/// multiple of: their `MOE_INT4_WARPS` warps each take `K / (16 * MOE_INT4_WARPS)` whole tile
/// rows of 16 features.
pub(crate) const MOE_INT4_GROUP: usize = 16 * MOE_INT4_WARPS;

/// Per INT4 kernel variant (kernel_defines.rs): items a block handles at a time, whether it
/// stages its activations, its load ring slots per warp, whether it pairs gate and up.
pub(crate) const MOE_INT4_VARIANTS: [usize; 2] = [MOE_INT4_V0_ITEMS, MOE_INT4_V1_ITEMS];
pub(crate) const MOE_INT4_STAGED: [bool; 2] = [MOE_INT4_V0_STAGED, MOE_INT4_V1_STAGED];
pub(crate) const MOE_INT4_RING: [usize; 2] = [MOE_INT4_V0_RING, MOE_INT4_V1_RING];
pub(crate) const MOE_INT4_PAIRED: [bool; 2] = [MOE_INT4_V0_PAIRED, MOE_INT4_V1_PAIRED];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::kernel_source;

    /// Every shared constant reaches the kernel sources that include its home file, as build.rs
    /// writes it, and no kernel file defines one of them itself.
    #[test]
    fn the_shared_constants_are_defined_once_for_the_kernels() {
        for (home, name, value, ty) in KERNEL_DEFINES {
            let kernel = home.trim_end_matches(".cu");
            if home.ends_with(".cu") {
                let source = kernel_source(kernel).unwrap().source;
                let want = match *ty {
                    "bool" => format!("#define {name} {}\n", *value != 0),
                    _ => format!("#define {name} {value}\n"),
                };
                assert!(source.starts_with("// The constants shared"), "{kernel}");
                assert!(source.contains(&want), "kernels/{kernel}.cu lacks {want:?}");
                assert_eq!(
                    source.matches(&format!("#define {name} ")).count(),
                    1,
                    "kernels/{kernel}.cu defines {name} again"
                );
            }
        }
        // A header's constants reach every file that includes it.
        let gemv = kernel_source("gemv_f16").unwrap().source;
        assert!(gemv.contains(&format!("#define WARPS {GEMV_WARPS}\n")));
        assert!(gemv.contains(&format!("#define MAX_TOP_K {MAX_TOP_K}\n")));
    }

    #[test]
    fn the_derived_constants_hold() {
        assert_eq!(ATT_CHUNK_MIN, 32);
        assert_eq!(MOE_INT4_GROUP, 128);
        assert_eq!(MOE_INT4_THREADS as usize, 32 * MOE_INT4_WARPS);
        assert_eq!(EXPERTS_ONE_ARRIVED, 2 + MAX_TOP_K);
        assert_eq!(gemv_row_groups(1), 1);
        assert_eq!(gemv_row_groups(4), 2);
        assert_eq!(gemv_row_groups(17), 5);
    }
}
