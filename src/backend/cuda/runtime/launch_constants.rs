//! The launch geometry the host shares with the kernel files: block sizes, work per warp and
//! the limits the kernels size their shared memory by. Each constant names the `#define` in
//! `kernels/` it mirrors; the tests below read those defines from the embedded sources, so a
//! kernel edit that changes one without the other fails `cargo test`.

/// Threads of the row-wise kernels: `ROW_THREADS` in kernels/ops.cu.
pub(crate) const ROW_THREADS: u32 = 256;

/// Columns of a row one `argmax_rows` block reads: `ARGMAX_CHUNK` in kernels/ops.cu.
pub(crate) const ARGMAX_CHUNK: usize = 4096;

/// Rows one `argmax_rows` launch takes: the backend's zeroed merge keys and tickets, one each per
/// row (larger calls launch again for the next rows). A host choice, so it mirrors no define.
pub(crate) const ARGMAX_ROWS: usize = 64;

/// Warps per block of the FP16 matrix kernels: `WARPS` in kernels/gemv_f16.cu.
pub(crate) const GEMV_WARPS: usize = 4;

/// Most rows a work block of the several-row dense kernels takes: `WORK_ROWS` in
/// kernels/gemv_f16.cu.
pub(crate) const GEMV_WORK_ROWS: usize = 4;

/// Row groups a several-row dense kernel (`linear_f16`, `linear2_f16`, `gate_up_silu_f16`, the
/// shared experts' products) splits `rows` into, each feature block's groups in their own work
/// blocks: `row_groups` in kernels/gemv_f16.cu (all rows up to 2, pairs up to 4, then
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

/// Output features per warp of `linear_f16` and `moe_f16_down`: `FEATURES` in
/// kernels/gemv_f16.cu.
pub(crate) const GEMV_FEATURES: usize = 2;

/// Output features per warp of the one-item routed down kernels (`moe_f16_down_1` and the
/// routed rows of `moe_f16_down_shared_1`): `DOWN_FEATURES_ONE` in kernels/gemv_f16.cu.
pub(crate) const GEMV_DOWN_FEATURES_ONE: usize = 4;

/// Counter words of a `moe_f16_experts_1` launch before its combine's arrivals (the ticket, the
/// combines past their wait, a done count per group): `EXPERTS_ONE_ARRIVED` in kernels/gemv_f16.cu.
pub(crate) const EXPERTS_ONE_ARRIVED: usize = 18;

/// Routed gate/up work blocks (of `moe_f16_gate_up_1`'s) a block of `moe_f16_experts_1` runs:
/// `EXPERTS_ONE_GATE_UP_WORK` in kernels/gemv_f16.cu.
pub(crate) const EXPERTS_ONE_GATE_UP_WORK: usize = 2;

/// Widest hidden size `moe_f16_experts_1` runs (an arrival count per 16 outputs in its counter
/// slot); wider layers take the separate launches. A host choice.
pub(crate) const EXPERTS_ONE_MAX_HIDDEN: usize = 8192;

/// Counter slots of `moe_f16_experts_1`, taken in turn by its launches. A launch takes its
/// tickets before its wait for the kernels before and its last combine zeroes the slot, so a slot
/// must not be taken again while its previous launch runs. In a model's passes a slot's next
/// launch comes 64 launches later, after attention launches, which let the next kernel start
/// only once every kernel before them has finished; op calls back to back would need 63
/// launches queued and started within one launch's run. A host choice (133 KB a backend).
/// (A ticket that wraps by itself, taken before the next kernel may launch, lifts the condition;
/// it delays every block's signal to the next kernel by the ticket's round trip, and the target
/// step measured 1.2% slower with it on the H200: branch `experts-ticket-wraps`.)
pub(crate) const EXPERTS_ONE_SLOTS: usize = 64;

/// Words of one slot.
pub(crate) const EXPERTS_ONE_SLOT_WORDS: usize =
    EXPERTS_ONE_ARRIVED + EXPERTS_ONE_MAX_HIDDEN / (GEMV_WARPS * GEMV_DOWN_FEATURES_ONE);

/// Threads per block of `attention`: `ATT_THREADS` in kernels/attention.cu (also its
/// `__launch_bounds__`).
pub(crate) const ATT_THREADS: u32 = 256;

/// Most key chunks of one (row, head) in `attention`, one block each: `ATT_SPLITS` in
/// kernels/attention.cu (the rows of `part` each (row, head) owns).
pub(crate) const ATT_SPLITS: usize = 8;

/// The fewest keys of an `attention` chunk: `ATT_CHUNK_MIN` in kernels/attention.cu, there
/// `ATT_WARPS * ATT_KEYS_PER_WARP` (eight warps of four keys).
pub(crate) const ATT_CHUNK_MIN: usize = 32;

/// Threads per block of `attention_combine`: `ATT_COMBINE_THREADS` in kernels/attention.cu.
pub(crate) const ATT_COMBINE_THREADS: u32 = 128;

/// (row, head) pairs up to which `attention` combines its chunks in the same launch (the
/// backend's counters; decode and verification windows are far below it); larger calls, long
/// prompts, launch `attention_combine`. A host choice: both give the same bits.
pub(crate) const ATT_COUNTERS: usize = 8192;

/// Most value channels of a clustered `attention` launch: `ATT_CLUSTER_MAX_V` in
/// kernels/attention.cu (the first block of a cluster keeps every chunk's partials).
pub(crate) const ATT_CLUSTER_MAX_V: usize = 256;

/// Threads per block of `mla_expand_kv` (one block per row and head). Mirrors no define: the
/// kernel strides by `blockDim.x`, so any block size computes the same values.
pub(crate) const MLA_THREADS: u32 = 128;

/// Most latent columns `mla_kv_append_1` takes (each warp's shared copy): `MLA_APPEND_MAX_RANK`
/// in kernels/ops.cu.
pub(crate) const MLA_APPEND_MAX_RANK: usize = 512;

/// Fewest latent columns `mla_kv_append_1` takes: its product waits, and norms the latent, at
/// the first pieces every lane loads, which needs 32 pieces of 8 (kernels/linear_rows.cuh,
/// `lane_dot2`). A property of that code, not a define.
pub(crate) const MLA_APPEND_MIN_RANK: usize = 256;

/// Most columns `add_norm_linear_1` takes (the block's shared copies of the row and its update):
/// `ADD_NORM_MAX_COLS` in kernels/ops.cu.
pub(crate) const ADD_NORM_MAX_COLS: usize = 4096;

/// Fewest columns `add_norm_linear_1` takes: its products wait, and the block norms the row, at
/// the first pieces every lane loads (as `MLA_APPEND_MIN_RANK`).
pub(crate) const ADD_NORM_MIN_COLS: usize = 256;

/// Threads of the fused routing + work-list kernel `route_plan`: `32 * ROUTE_PLAN_WARPS` in
/// kernels/routing.cu (its `__launch_bounds__`, and one warp's `MAX_TOP_K` shared slots each).
pub(crate) const ROUTE_PLAN_THREADS: u32 = 256;

/// Rows up to which routing and the work list are built by that one launch; past it the rows
/// are routed one block each and the plan follows in a second launch. A host choice (the
/// kernel takes any number of rows), so it mirrors no define.
pub(crate) const ROUTE_PLAN_MAX_ROWS: usize = 64;

/// Most experts a row may pick in device routing: `MAX_TOP_K` in kernels/routing.cu (the size
/// of each warp's shared choice slots).
pub(crate) const MAX_TOP_K: usize = 16;

/// Most experts of a layer the device work list handles: `PLAN_MAX_EXPERTS` in
/// kernels/routing.cu (the size of its shared cursor array).
pub(crate) const PLAN_MAX_EXPERTS: usize = 1024;

/// Threads per block of the INT4 expert kernels: `MOE_THREADS` in kernels/moe_int4.cu.
pub(crate) const MOE_INT4_THREADS: u32 = 256;

/// Output columns per block of the INT4 expert kernels (one Marlin 16x64 block column):
/// `MOE_COLS` in kernels/moe_int4.cu.
pub(crate) const MOE_INT4_COLS_PER_BLOCK: usize = 64;

/// Input features per quantization group, which is also what the INT4 kernels' K must be a
/// multiple of: their `MOE_WARPS` warps each take `K / (16 * MOE_WARPS)` whole tile rows of 16
/// features, and 16 * `MOE_WARPS` (kernels/moe_int4.cu) is 128.
pub(crate) const MOE_INT4_GROUP: usize = 128;

/// Items one INT4 block handles at a time, per kernel variant: the `MAXI` argument of each
/// `MOE_INT4_KERNELS(MAXI, MIN_BLOCKS, STAGED, RING, PAIRED)` line of kernels/moe_int4.cu, in
/// order.
pub(crate) const MOE_INT4_VARIANTS: [usize; 2] = [8, 16];

/// Whether each INT4 variant stages its activations in dynamic shared memory: the `STAGED`
/// argument of the same lines.
pub(crate) const MOE_INT4_STAGED: [bool; 2] = [true, true];

/// 512-byte load ring slots per warp of each INT4 variant: the `RING` argument of the same lines.
pub(crate) const MOE_INT4_RING: [usize; 2] = [16, 8];

/// Whether each INT4 variant streams gate and up in one pass (two reduction arrays a warp): the
/// `PAIRED` argument of the same lines.
pub(crate) const MOE_INT4_PAIRED: [bool; 2] = [true, false];

/// Warps per block of the INT4 expert kernels: `MOE_WARPS` in kernels/moe_int4.cu.
pub(crate) const MOE_INT4_WARPS: usize = 8;

/// Row stride, in floats, of a warp's reduction arrays: `MOE_RED_STRIDE` in kernels/moe_int4.cu.
pub(crate) const MOE_INT4_RED_STRIDE: usize = 68;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::kernel_source;
    use std::collections::HashMap;

    /// The `#define NAME VALUE` lines of an embedded kernel file whose value is an integer
    /// literal (macros with parameters and other values are left out).
    fn integer_defines(kernel: &str) -> HashMap<String, i64> {
        let source = kernel_source(kernel)
            .unwrap_or_else(|err| panic!("{err}"))
            .source;
        let mut defines = HashMap::new();
        for line in source.lines() {
            let Some(rest) = line.trim().strip_prefix("#define") else {
                continue;
            };
            let mut words = rest.split_whitespace();
            let (Some(name), Some(value)) = (words.next(), words.next()) else {
                continue;
            };
            if name.contains('(') {
                continue;
            }
            if let Ok(v) = value.parse::<i64>() {
                let previous = defines.insert(name.to_string(), v);
                assert!(
                    previous.is_none(),
                    "kernels/{kernel}.cu defines {name} twice"
                );
            }
        }
        defines
    }

    fn define(defines: &HashMap<String, i64>, kernel: &str, name: &str) -> i64 {
        *defines
            .get(name)
            .unwrap_or_else(|| panic!("kernels/{kernel}.cu has no integer #define {name}"))
    }

    /// The arguments of one `MOE_INT4_KERNELS` line but MIN_BLOCKS, which only the kernel reads.
    #[derive(Debug, PartialEq)]
    struct Int4Instance {
        maxi: usize,
        staged: bool,
        ring: usize,
        paired: bool,
    }

    /// Every `MOE_INT4_KERNELS(MAXI, MIN_BLOCKS, STAGED, RING, PAIRED)` instantiation line of
    /// kernels/moe_int4.cu.
    fn int4_instantiations() -> Vec<Int4Instance> {
        let source = kernel_source("moe_int4")
            .unwrap_or_else(|err| panic!("{err}"))
            .source;
        source
            .lines()
            .filter_map(|line| line.trim().strip_prefix("MOE_INT4_KERNELS("))
            .map(|args| {
                let args = args
                    .strip_suffix(')')
                    .unwrap_or_else(|| panic!("unterminated MOE_INT4_KERNELS({args}"));
                let parts: Vec<&str> = args.split(',').map(str::trim).collect();
                let [maxi, _min_blocks, staged, ring, paired] = parts[..] else {
                    panic!("MOE_INT4_KERNELS({args}) does not have five arguments");
                };
                let flag = |name: &str, value: &str| match value {
                    "true" => true,
                    "false" => false,
                    other => panic!("MOE_INT4_KERNELS {name} argument {other:?}"),
                };
                Int4Instance {
                    maxi: maxi.parse().expect("MAXI is an integer"),
                    staged: flag("STAGED", staged),
                    ring: ring.parse().expect("RING is an integer"),
                    paired: flag("PAIRED", paired),
                }
            })
            .collect()
    }

    #[test]
    fn row_kernels_match_ops_cu() {
        let ops = integer_defines("ops");
        assert_eq!(i64::from(ROW_THREADS), define(&ops, "ops", "ROW_THREADS"));
        assert_eq!(ARGMAX_CHUNK as i64, define(&ops, "ops", "ARGMAX_CHUNK"));
        assert_eq!(
            MLA_APPEND_MAX_RANK as i64,
            define(&ops, "ops", "MLA_APPEND_MAX_RANK")
        );
        assert_eq!(
            ADD_NORM_MAX_COLS as i64,
            define(&ops, "ops", "ADD_NORM_MAX_COLS")
        );
        let gemv = integer_defines("gemv_f16");
        assert_eq!(
            GEMV_WORK_ROWS as i64,
            define(&gemv, "gemv_f16", "WORK_ROWS")
        );
        let groups: Vec<u32> = [1, 2, 3, 4, 5, 8, 9, 16, 17, 32]
            .into_iter()
            .map(gemv_row_groups)
            .collect();
        assert_eq!(groups, [1, 1, 2, 2, 2, 2, 3, 4, 5, 8]);
    }

    #[test]
    fn gemv_kernels_match_gemv_f16_cu() {
        let gemv = integer_defines("gemv_f16");
        for (name, value) in [
            ("WARPS", GEMV_WARPS),
            ("FEATURES", GEMV_FEATURES),
            ("DOWN_FEATURES_ONE", GEMV_DOWN_FEATURES_ONE),
            ("EXPERTS_ONE_ARRIVED", EXPERTS_ONE_ARRIVED),
            ("EXPERTS_ONE_GATE_UP_WORK", EXPERTS_ONE_GATE_UP_WORK),
        ] {
            assert_eq!(value as i64, define(&gemv, "gemv_f16", name), "{name}");
        }
    }

    #[test]
    fn attention_matches_attention_cu() {
        let att = integer_defines("attention");
        assert_eq!(
            i64::from(ATT_THREADS),
            define(&att, "attention", "ATT_THREADS")
        );
        assert_eq!(ATT_SPLITS as i64, define(&att, "attention", "ATT_SPLITS"));
        assert_eq!(
            ATT_CHUNK_MIN as i64,
            i64::from(ATT_THREADS / 32) * define(&att, "attention", "ATT_KEYS_PER_WARP"),
            "ATT_CHUNK_MIN is ATT_WARPS * ATT_KEYS_PER_WARP"
        );
        assert_eq!(
            i64::from(ATT_COMBINE_THREADS),
            define(&att, "attention", "ATT_COMBINE_THREADS")
        );
        assert_eq!(
            ATT_CLUSTER_MAX_V as i64,
            define(&att, "attention", "ATT_CLUSTER_MAX_V")
        );
    }

    #[test]
    fn routing_matches_routing_cu() {
        let routing = integer_defines("routing");
        assert_eq!(
            i64::from(ROUTE_PLAN_THREADS),
            32 * define(&routing, "routing", "ROUTE_PLAN_WARPS")
        );
        assert_eq!(MAX_TOP_K as i64, define(&routing, "routing", "MAX_TOP_K"));
        assert_eq!(
            PLAN_MAX_EXPERTS as i64,
            define(&routing, "routing", "PLAN_MAX_EXPERTS")
        );
    }

    #[test]
    fn int4_kernels_match_moe_int4_cu() {
        let int4 = integer_defines("moe_int4");
        assert_eq!(
            i64::from(MOE_INT4_THREADS),
            define(&int4, "moe_int4", "MOE_THREADS")
        );
        assert_eq!(
            i64::from(MOE_INT4_THREADS),
            32 * define(&int4, "moe_int4", "MOE_WARPS"),
            "MOE_THREADS is MOE_WARPS whole warps"
        );
        assert_eq!(
            MOE_INT4_COLS_PER_BLOCK as i64,
            define(&int4, "moe_int4", "MOE_COLS")
        );
        assert_eq!(
            MOE_INT4_GROUP as i64,
            16 * define(&int4, "moe_int4", "MOE_WARPS")
        );
        assert_eq!(
            MOE_INT4_WARPS as i64,
            define(&int4, "moe_int4", "MOE_WARPS")
        );
        assert_eq!(
            MOE_INT4_RED_STRIDE as i64,
            define(&int4, "moe_int4", "MOE_RED_STRIDE")
        );
        let mirrored: Vec<Int4Instance> = (0..MOE_INT4_VARIANTS.len())
            .map(|v| Int4Instance {
                maxi: MOE_INT4_VARIANTS[v],
                staged: MOE_INT4_STAGED[v],
                ring: MOE_INT4_RING[v],
                paired: MOE_INT4_PAIRED[v],
            })
            .collect();
        assert_eq!(
            mirrored,
            int4_instantiations(),
            "MAXI, STAGED, RING and PAIRED of each MOE_INT4_KERNELS line"
        );
    }

    #[test]
    fn define_parser_reads_only_integer_object_macros() {
        // ops.cu defines ROW_THREADS and RMS_CACHE as integers; attention.cu's ATT_WARPS is an
        // expression and moe_int4.cu's MOE_XS_STRIDE takes a parameter: neither is read.
        let ops = integer_defines("ops");
        assert!(ops.contains_key("ROW_THREADS") && ops.contains_key("RMS_CACHE"));
        assert!(!integer_defines("attention").contains_key("ATT_WARPS"));
        assert!(!integer_defines("moe_int4").contains_key("MOE_XS_STRIDE(MAXI)"));
        assert!(!integer_defines("moe_int4").contains_key("MOE_XS_STRIDE"));
    }
}
