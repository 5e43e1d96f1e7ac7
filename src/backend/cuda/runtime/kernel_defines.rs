// The constants the kernels and the host share, defined once here. build.rs includes this file
// and writes each constant as `#define NAME VALUE` at the top of the embedded source of every
// kernel file that includes the constant's home (the .cu file itself, or a header it splices
// in), so nvcc, NVRTC and the run-time PTX cache all see these values; the kernel files define
// none of them. The backend uses the Rust constants. (Plain `//` comments: build.rs includes
// this file as items, where inner doc comments may not stand.)

/// Declares each shared constant as a Rust constant and lists it in [`KERNEL_DEFINES`].
macro_rules! kernel_defines {
    ($( $(#[doc = $doc:expr])* $rust:ident : $ty:ty = $value:expr => $home:literal $c:literal ;)*) => {
        $(
            $(#[doc = $doc])*
            #[allow(dead_code)]
            pub(crate) const $rust: $ty = $value;
        )*
        /// Every shared constant: (the file it belongs to, its name in the kernels, its value,
        /// its Rust type), for build.rs.
        #[allow(dead_code)]
        pub(crate) const KERNEL_DEFINES: &[(&str, &str, i64, &str)] = &[
            $( ($home, $c, $rust as i64, stringify!($ty)), )*
        ];
    };
}

kernel_defines! {
    /// Threads of the row-wise kernels.
    ROW_THREADS: u32 = 256 => "ops.cu" "ROW_THREADS";
    /// Columns of a row one `argmax_rows` block reads.
    ARGMAX_CHUNK: usize = 4096 => "ops.cu" "ARGMAX_CHUNK";
    /// Most latent columns `mla_kv_append_1` takes (each warp's shared copy).
    MLA_APPEND_MAX_RANK: usize = 512 => "ops.cu" "MLA_APPEND_MAX_RANK";
    /// Most columns `add_norm_linear_1` takes (the block's shared copies of the row and its
    /// update).
    ADD_NORM_MAX_COLS: usize = 4096 => "ops.cu" "ADD_NORM_MAX_COLS";
    /// Warps per block of the FP16 matrix kernels.
    GEMV_WARPS: usize = 4 => "linear_rows.cuh" "WARPS";
    /// Output features per warp of `linear_f16` and `moe_f16_down`.
    GEMV_FEATURES: usize = 2 => "linear_rows.cuh" "FEATURES";
    /// Most rows a work block of the several-row dense kernels takes.
    GEMV_WORK_ROWS: usize = 4 => "linear_rows.cuh" "WORK_ROWS";
    /// Output features per warp of the one-item routed down kernels (`moe_f16_down_1` and the
    /// routed rows of `moe_f16_down_shared_1` and `moe_f16_experts_1`).
    GEMV_DOWN_FEATURES_ONE: usize = 4 => "gemv_f16.cu" "DOWN_FEATURES_ONE";
    /// Counter words of a `moe_f16_experts_1` launch before its combine's arrivals (the ticket,
    /// the combines past their wait, a done count per group).
    EXPERTS_ONE_ARRIVED: usize = 2 + MAX_TOP_K => "gemv_f16.cu" "EXPERTS_ONE_ARRIVED";
    /// Routed gate/up work blocks (of `moe_f16_gate_up_1`'s) a block of `moe_f16_experts_1`
    /// runs.
    EXPERTS_ONE_GATE_UP_WORK: usize = 2 => "gemv_f16.cu" "EXPERTS_ONE_GATE_UP_WORK";
    /// Threads per block of `attention` (also its `__launch_bounds__`).
    ATT_THREADS: u32 = 256 => "attention.cu" "ATT_THREADS";
    /// Most key chunks of one (row, head) in `attention`, one block each (the rows of `part`
    /// each (row, head) owns).
    ATT_SPLITS: usize = 8 => "attention.cu" "ATT_SPLITS";
    /// Keys each warp scores per pass of `attention`'s score loop.
    ATT_KEYS_PER_WARP: usize = 4 => "attention.cu" "ATT_KEYS_PER_WARP";
    /// Threads per block of `attention_combine`.
    ATT_COMBINE_THREADS: u32 = 128 => "attention.cu" "ATT_COMBINE_THREADS";
    /// Most value channels of a clustered `attention` launch (the first block of a cluster
    /// keeps every chunk's partials).
    ATT_CLUSTER_MAX_V: usize = 256 => "attention.cu" "ATT_CLUSTER_MAX_V";
    /// Warps of the fused routing + work-list kernel `route_plan` (its `__launch_bounds__`, and
    /// one warp's `MAX_TOP_K` shared slots each).
    ROUTE_PLAN_WARPS: usize = 8 => "routing.cu" "ROUTE_PLAN_WARPS";
    /// Most experts a row may pick in device routing (the size of each warp's shared choice
    /// slots).
    MAX_TOP_K: usize = 16 => "routing.cuh" "MAX_TOP_K";
    /// Most experts of a layer the device work list handles (its shared cursor array).
    PLAN_MAX_EXPERTS: usize = 1024 => "routing.cuh" "PLAN_MAX_EXPERTS";
    /// Warps per block of the INT4 expert kernels.
    MOE_INT4_WARPS: usize = 8 => "moe_int4.cu" "MOE_WARPS";
    /// Threads per block of the INT4 expert kernels.
    MOE_INT4_THREADS: u32 = 32 * MOE_INT4_WARPS as u32 => "moe_int4.cu" "MOE_THREADS";
    /// Output columns per block of the INT4 expert kernels (one Marlin 16x64 block column).
    MOE_INT4_COLS_PER_BLOCK: usize = 64 => "moe_int4.cu" "MOE_COLS";
    /// Row stride, in floats, of a warp's reduction arrays (68 puts the 32 lanes' writes in
    /// distinct banks).
    MOE_INT4_RED_STRIDE: usize = 68 => "moe_int4.cu" "MOE_RED_STRIDE";
    /// The INT4 kernels come in two variants (`MOE_INT4_KERNELS` in kernels/moe_int4.cu): items
    /// one block handles at a time, whether it stages its activations in dynamic shared memory,
    /// 512-byte load ring slots per warp, and whether it streams gate and up in one pass.
    MOE_INT4_V0_ITEMS: usize = 8 => "moe_int4.cu" "MOE_INT4_V0_ITEMS";
    MOE_INT4_V0_STAGED: bool = true => "moe_int4.cu" "MOE_INT4_V0_STAGED";
    MOE_INT4_V0_RING: usize = 16 => "moe_int4.cu" "MOE_INT4_V0_RING";
    MOE_INT4_V0_PAIRED: bool = true => "moe_int4.cu" "MOE_INT4_V0_PAIRED";
    MOE_INT4_V1_ITEMS: usize = 16 => "moe_int4.cu" "MOE_INT4_V1_ITEMS";
    MOE_INT4_V1_STAGED: bool = true => "moe_int4.cu" "MOE_INT4_V1_STAGED";
    MOE_INT4_V1_RING: usize = 8 => "moe_int4.cu" "MOE_INT4_V1_RING";
    MOE_INT4_V1_PAIRED: bool = false => "moe_int4.cu" "MOE_INT4_V1_PAIRED";
    /// Warps per block of the row-layout expert kernels (kernels/moe_rows.cu).
    MOE_ROWS_WARPS: usize = 8 => "moe_rows.cu" "ROWS_WARPS";
    /// Most items a block of the row-layout expert kernels takes at a time (its staged
    /// activation rows; larger groups run in several chunks).
    MOE_ROWS_ITEMS: usize = 8 => "moe_rows.cu" "ROWS_ITEMS";
    /// Floats of padding after each staged chunk of activations (16 or 32 floats), which puts a
    /// warp's float4 reads of its lanes' chunks in distinct banks.
    MOE_ROWS_PAD: usize = 4 => "moe_rows.cu" "ROWS_PAD";
    /// Pairs of rows one warp of the row-layout expert kernels streams: gate/up, that many
    /// features (each its gate row and its up row); down, that many pairs of adjacent output
    /// rows.
    MOE_ROWS_WARP_PAIRS: usize = 2 => "moe_rows.cu" "ROWS_WARP_PAIRS";
    /// Rows and columns of the output tile one block of the tensor-core products computes
    /// (kernels/gemm_f16.cu), and the inputs each step of its k loop moves.
    GEMM_BM: usize = 128 => "gemm_f16.cu" "GEMM_BM";
    GEMM_BN: usize = 128 => "gemm_f16.cu" "GEMM_BN";
    GEMM_BK: usize = 32 => "gemm_f16.cu" "GEMM_BK";
    /// Shared-memory stages of the tensor-core products' k loop.
    GEMM_STAGES: usize = 3 => "gemm_f16.cu" "GEMM_STAGES";
    /// Threads per block of the tensor-core products (8 warps: 2 x 4 over the tile).
    GEMM_THREADS: u32 = 256 => "gemm_f16.cu" "GEMM_THREADS";
    /// Query rows of one block of the prompt's tensor-core attention, and keys per tile it
    /// stages (kernels/attention_prompt.cu).
    ATTP_ROWS: usize = 64 => "attention_prompt.cu" "ATTP_ROWS";
    ATTP_KEYS: usize = 64 => "attention_prompt.cu" "ATTP_KEYS";
    /// Threads per block of the prompt's tensor-core attention (4 warps of 16 query rows).
    ATTP_THREADS: u32 = 128 => "attention_prompt.cu" "ATTP_THREADS";
}

/// The `#define` lines of the constants whose home is one of `files` (a kernel file and the
/// headers it includes), in table order.
#[allow(dead_code)]
pub(crate) fn kernel_define_lines(files: &[&str]) -> String {
    let mut out = String::new();
    for (home, name, value, ty) in KERNEL_DEFINES {
        if files.contains(home) {
            let value = match *ty {
                "bool" => (if *value != 0 { "true" } else { "false" }).to_string(),
                _ => value.to_string(),
            };
            out.push_str(&format!("#define {name} {value}\n"));
        }
    }
    out
}
