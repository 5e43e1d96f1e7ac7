//! Typed kernel arguments: one struct per kernel signature, its fields the kernel's parameters in
//! order, each of the type the driver reads for it (a device address, a 32-bit integer or float,
//! a 64-bit integer), or a group of them that several signatures share (a field of a
//! [`Params`] struct stands for its own fields in order). tests/kernels_compile.rs checks every
//! struct against the parameters of its kernels in the PTX that NVRTC compiles, so a signature
//! and its struct cannot drift apart.

use std::ffi::c_void;

/// A device address (any pointer parameter).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct DevPtr(pub u64);

/// Parameters in a kernel's order: one scalar, or a struct of them.
pub trait Params: Copy {
    /// Appends the address of each parameter, in order; valid while `self` is neither moved
    /// nor dropped.
    fn push_params(&mut self, out: &mut Vec<*mut c_void>);
    /// Appends each parameter's PTX type, in order.
    fn push_ptx(out: &mut Vec<&'static str>);
    /// Appends each scalar parameter's name, in order: `field` for a scalar, the names of its
    /// own fields for a struct.
    fn push_names(field: &'static str, out: &mut Vec<&'static str>);
}

/// One scalar parameter of the PTX type `$ptx`.
macro_rules! scalar_param {
    ($($ty:ty => $ptx:literal),*) => {
        $(
            impl Params for $ty {
                fn push_params(&mut self, out: &mut Vec<*mut c_void>) {
                    out.push(self as *mut $ty as *mut c_void);
                }
                fn push_ptx(out: &mut Vec<&'static str>) {
                    out.push($ptx);
                }
                fn push_names(field: &'static str, out: &mut Vec<&'static str>) {
                    out.push(field);
                }
            }
        )*
    };
}

scalar_param!(DevPtr => ".u64", u64 => ".u64", i32 => ".u32", u32 => ".u32", f32 => ".f32");

/// The arguments of one kernel signature.
pub trait KernelArgs: Params {
    /// The kernels that take these arguments.
    const KERNELS: &'static [&'static str];

    /// Each parameter's address, in order: what the driver's launch takes.
    fn params(&mut self) -> Vec<*mut c_void> {
        let mut out = Vec::new();
        self.push_params(&mut out);
        out
    }

    /// Each parameter's PTX type, in order.
    fn ptx() -> Vec<&'static str> {
        let mut out = Vec::new();
        Self::push_ptx(&mut out);
        out
    }

    /// Each parameter's name, in order (a nested struct's fields by their own names).
    fn names() -> Vec<&'static str> {
        let mut out = Vec::new();
        Self::push_names("", &mut out);
        out
    }
}

/// Declares parameter structs: each field a scalar or another parameter struct.
macro_rules! params {
    ($( $(#[doc = $doc:expr])* $name:ident { $( $field:ident : $ty:ty ),* $(,)? } )*) => {
        $(
            $(#[doc = $doc])*
            #[derive(Clone, Copy, Debug)]
            pub struct $name { $( pub $field: $ty, )* }

            impl Params for $name {
                fn push_params(&mut self, out: &mut Vec<*mut c_void>) {
                    $( self.$field.push_params(out); )*
                }
                fn push_ptx(out: &mut Vec<&'static str>) {
                    $( <$ty as Params>::push_ptx(out); )*
                }
                fn push_names(_field: &'static str, out: &mut Vec<&'static str>) {
                    $( <$ty as Params>::push_names(stringify!($field), out); )*
                }
            }
        )*
    };
}

/// Declares an argument struct per kernel signature and lists every one in
/// [`kernel_signatures`].
macro_rules! kernel_args {
    ($( $(#[doc = $doc:expr])* $name:ident for [$($kernel:literal),+] { $($fields:tt)* } )*) => {
        $(
            params! { $(#[doc = $doc])* $name { $($fields)* } }

            impl KernelArgs for $name {
                const KERNELS: &'static [&'static str] = &[$($kernel),+];
            }
        )*

        /// Every argument struct: its kernels and their parameters' PTX types.
        pub fn kernel_signatures() -> Vec<(&'static [&'static str], Vec<&'static str>)> {
            vec![$( (<$name as KernelArgs>::KERNELS, <$name as KernelArgs>::ptx()) ),*]
        }

        /// Every argument struct: its kernels and their parameters' names, which the kernels'
        /// C signatures must repeat in the same order.
        pub fn kernel_param_names() -> Vec<(&'static [&'static str], Vec<&'static str>)> {
            vec![$( (<$name as KernelArgs>::KERNELS, <$name as KernelArgs>::names()) ),*]
        }
    };
}

params! {
    /// A grouped-expert work list to build: the experts' pointer table, the most groups, and
    /// where the groups, each item's row and weight, and each row's items go.
    WorkList {
        table: DevPtr,
        max_groups: i32,
        groups: DevPtr,
        item_row: DevPtr,
        item_weight: DevPtr,
        row_items: DevPtr,
    }
    /// MLA's expanded caches: the shape of a head and the key and value buffers.
    MlaCaches {
        heads: i32,
        nope: i32,
        rope: i32,
        v_dim: i32,
        keys: DevPtr,
        values: DevPtr,
    }
    /// The parameters `mla_expand_append` and `mla_kv_append_1` end with: the caches, then where
    /// the rows go (`start`, or the step buffer's position), the query and its rotation tables
    /// and style.
    MlaAppendTail {
        caches: MlaCaches,
        start: i32,
        start_at: DevPtr,
        q: DevPtr,
        cos_t: DevPtr,
        sin_t: DevPtr,
        interleaved: i32,
    }
}

kernel_args! {
    /// Split-key attention: one block per chunk of a (row, head)'s keys (kernels/attention.cu).
    AttentionArgs for ["attention"] {
        q: DevPtr,
        k: DevPtr,
        v: DevPtr,
        part: DevPtr,
        scratch: DevPtr,
        heads: i32,
        kv_heads: i32,
        qk_dim: i32,
        v_dim: i32,
        scale: f32,
        start: i32,
        window: i32,
        score_stride: i32,
        start_at: DevPtr,
        counters: DevPtr,
        out: DevPtr,
        splits: i32,
        cluster: i32,
    }
    /// The combine of each (row, head)'s chunks, as a launch of its own.
    AttentionCombineArgs for ["attention_combine"] {
        part: DevPtr,
        out: DevPtr,
        heads: i32,
        v_dim: i32,
        start: i32,
        window: i32,
        start_at: DevPtr,
    }
    /// `y = x @ w^T (+ bias)`, FP16 weights (kernels/gemv_f16.cu).
    LinearArgs for ["linear_f16", "linear_f16_1"] {
        x: DevPtr,
        rows: i32,
        k: i32,
        w: DevPtr,
        n: i32,
        bias: DevPtr,
        y: DevPtr,
    }
    /// Two products of one input in one launch: `a` as `linear_f16` takes it, then the second
    /// weight, bias and output, and the feature blocks of the first.
    Linear2Args for ["linear2_f16", "linear2_f16_1"] {
        a: LinearArgs,
        wb: DevPtr,
        nb: i32,
        bb: DevPtr,
        yb: DevPtr,
        blocks_a: i32,
    }
    /// A gated MLP's gate/up product with the activation fused.
    GateUpSiluArgs for ["gate_up_silu_f16"] {
        x: DevPtr,
        rows: i32,
        k: i32,
        w: DevPtr,
        inter: i32,
        h: DevPtr,
    }
    /// Routing and work list (block 0) beside the shared experts' gate/up.
    RoutePlanSharedArgs for ["route_plan_shared_f16", "route_plan_shared_f16_1"] {
        plan: RoutePlanArgs,
        x: DevPtr,
        k: i32,
        w_shared: DevPtr,
        inter_shared: i32,
        h_shared: DevPtr,
    }
    /// The grouped routed experts' gate/up, FP16 weights.
    MoeGateUpArgs for ["moe_f16_gate_up", "moe_f16_gate_up_1"] {
        x: DevPtr,
        hidden: i32,
        inter: i32,
        groups: DevPtr,
        num_groups: i32,
        item_row: DevPtr,
        h: DevPtr,
    }
    /// The grouped routed experts' down product.
    MoeDownArgs for ["moe_f16_down", "moe_f16_down_1"] {
        h: DevPtr,
        hidden: i32,
        inter: i32,
        groups: DevPtr,
        num_groups: i32,
        item_weight: DevPtr,
        out: DevPtr,
    }
    /// The routed down with the shared experts' down product in the same launch.
    MoeDownSharedArgs for ["moe_f16_down_shared", "moe_f16_down_shared_1"] {
        down: MoeDownArgs,
        h_shared: DevPtr,
        rows: i32,
        inter_shared: i32,
        w_down: DevPtr,
        y_shared: DevPtr,
    }
    /// A one-row MoE layer's shared down, routed experts and combine in one launch.
    MoeExpertsOneArgs for ["moe_f16_experts_1"] {
        gate_up: MoeGateUpArgs,
        item_weight: DevPtr,
        out: DevPtr,
        h_shared: DevPtr,
        inter_shared: i32,
        w_down: DevPtr,
        y_shared: DevPtr,
        row_items: DevPtr,
        top_k: i32,
        y: DevPtr,
        counters: DevPtr,
    }
    /// The INT4 draft experts' gate/up (with the shared down in other blocks) (kernels/moe_int4.cu).
    Int4GateUpArgs for ["moe_int4_gate_up_8", "moe_int4_gate_up_16"] {
        groups: DevPtr,
        x: DevPtr,
        item_row: DevPtr,
        h: DevPtr,
        hidden: u32,
        inter: u32,
        num_groups: u32,
        s_h: DevPtr,
        s_inter: u32,
        s_down: DevPtr,
        s_y: DevPtr,
    }
    /// The INT4 draft experts' down product.
    Int4DownArgs for ["moe_int4_down_8", "moe_int4_down_16"] {
        groups: DevPtr,
        h: DevPtr,
        item_weight: DevPtr,
        out: DevPtr,
        hidden: u32,
        inter: u32,
    }
    /// The one-row INT4 down with the combine in its clusters.
    Int4DownCombineArgs for ["moe_int4_down_combine_8"] {
        down: Int4DownArgs,
        top_k: u32,
        s_y: DevPtr,
        y: DevPtr,
    }
    /// The row-layout experts' gate/up at 8, 4, 3 or 2 bits, and its one-item forms
    /// (kernels/moe_rows.cu).
    RowsGateUpArgs for [
        "moe_rows_gate_up_8", "moe_rows_gate_up_4", "moe_rows_gate_up_3", "moe_rows_gate_up_2",
        "moe_rows_gate_up_8_1", "moe_rows_gate_up_4_1", "moe_rows_gate_up_3_1",
        "moe_rows_gate_up_2_1"
    ] {
        groups: DevPtr,
        x: DevPtr,
        item_row: DevPtr,
        h: DevPtr,
        hidden: u32,
        inter: u32,
        chunk_items: u32,
    }
    /// The row-layout experts' down product, and its one-item forms.
    RowsDownArgs for [
        "moe_rows_down_8", "moe_rows_down_4", "moe_rows_down_3", "moe_rows_down_2",
        "moe_rows_down_8_1", "moe_rows_down_4_1", "moe_rows_down_3_1", "moe_rows_down_2_1"
    ] {
        groups: DevPtr,
        h: DevPtr,
        item_weight: DevPtr,
        out: DevPtr,
        hidden: u32,
        inter: u32,
        chunk_items: u32,
    }
    /// Embedding rows of token ids (kernels/ops.cu).
    EmbeddingArgs for ["embedding"] {
        table: DevPtr,
        ids: DevPtr,
        hidden: i32,
        y: DevPtr,
    }
    /// RMSNorm over groups of columns.
    RmsNormArgs for ["rms_norm"] {
        x: DevPtr,
        w: DevPtr,
        eps: f32,
        group: i32,
        y: DevPtr,
    }
    /// `x += a`, then RMSNorm of the sum.
    AddRmsNormArgs for ["add_rms_norm"] {
        x: DevPtr,
        a: DevPtr,
        w: DevPtr,
        eps: f32,
        cols: i32,
        y: DevPtr,
    }
    /// LayerNorm with weight and bias.
    LayerNormArgs for ["layer_norm"] {
        x: DevPtr,
        w: DevPtr,
        b: DevPtr,
        eps: f32,
        cols: i32,
        y: DevPtr,
    }
    /// Column ranges of a matrix into up to four outputs.
    CopyColsArgs for ["copy_cols"] {
        x: DevPtr,
        x_cols: i32,
        col0: i32,
        width: i32,
        total: u64,
        y0: DevPtr,
        w0: i32,
        y1: DevPtr,
        w1: i32,
        y2: DevPtr,
        w2: i32,
        y3: DevPtr,
        w3: i32,
    }
    /// Rows written at the position the step buffer holds.
    CopyRowsAtArgs for ["copy_rows_at"] {
        src: DevPtr,
        dst: DevPtr,
        cols: i32,
        row_at: DevPtr,
    }
    /// A prompt's causal attention on tensor cores (kernels/attention_prompt.cu), one entry point
    /// per (query/key width, value width).
    AttentionPromptArgs for [
        "attention_prompt_64_64", "attention_prompt_128_128", "attention_prompt_192_128"
    ] {
        q: DevPtr,
        k: DevPtr,
        v: DevPtr,
        out: DevPtr,
        rows: i32,
        heads: i32,
        kv_heads: i32,
        scale: f32,
        start: i32,
        window: i32,
    }
    /// `a = (half)x`, n values (kernels/gemm_f16.cu).
    ToF16RowsArgs for ["to_f16_rows"] {
        x: DevPtr,
        a: DevPtr,
        n: u64,
    }
    /// `y = a @ w^T (+ bias)` on tensor cores, f16 `a` (kernels/gemm_f16.cu).
    GemmArgs for ["gemm_f16"] {
        a: DevPtr,
        w: DevPtr,
        bias: DevPtr,
        y: DevPtr,
        m: i32,
        n: i32,
        k: i32,
    }
    /// A prompt pass's routed experts, FP16 weights, on tensor cores (kernels/gemm_f16.cu): each
    /// item's input row gathered and rounded to f16.
    MoeGatherArgs for ["moe_gather_f16"] {
        x: DevPtr,
        item_row: DevPtr,
        items: i32,
        hidden: i32,
        x16: DevPtr,
    }
    /// Their gate/up product and activation, `h16` f16 `[items][inter]`.
    MoeGemmGateUpArgs for ["moe_gemm_gate_up_f16"] {
        x16: DevPtr,
        hidden: i32,
        inter: i32,
        groups: DevPtr,
        h16: DevPtr,
    }
    /// Their down product, weighted per item.
    MoeGemmDownArgs for ["moe_gemm_down_f16"] {
        h16: DevPtr,
        hidden: i32,
        inter: i32,
        groups: DevPtr,
        item_weight: DevPtr,
        out: DevPtr,
    }
    /// `x` clamped to `[-limit, limit]`.
    ClampArgs for ["clamp_f32"] {
        x: DevPtr,
        limit: f32,
        n: u64,
    }
    /// `x += y`.
    AddArgs for ["add_f32"] {
        x: DevPtr,
        y: DevPtr,
        n: u64,
    }
    /// `x += sigmoid(gate) * y`, a gate per row.
    AddSigmoidGatedArgs for ["add_sigmoid_gated"] {
        x: DevPtr,
        y: DevPtr,
        gate: DevPtr,
        cols: i32,
        n: u64,
    }
    /// Rotary embedding in place.
    RopeArgs for ["rope"] {
        x: DevPtr,
        cos_t: DevPtr,
        sin_t: DevPtr,
        cols: i32,
        heads: i32,
        head_stride: i32,
        offset: i32,
        rot_dim: i32,
        interleaved: i32,
    }
    /// MLA: the latent's norm and the shared key's rotation.
    MlaLatentArgs for ["mla_latent"] {
        c: DevPtr,
        cols: i32,
        rank: i32,
        w: DevPtr,
        eps: f32,
        cos_t: DevPtr,
        sin_t: DevPtr,
        rope: i32,
        interleaved: i32,
        latent: DevPtr,
        pe: DevPtr,
    }
    /// MLA: keys and values of new rows into the caches, and the query's rotation.
    MlaExpandAppendArgs for ["mla_expand_append"] {
        kv: DevPtr,
        k_pe: DevPtr,
        tail: MlaAppendTail,
    }
    /// MLA for one row, from the compressed projection to the caches, in one launch.
    MlaKvAppendArgs for ["mla_kv_append_1"] {
        c: DevPtr,
        rank: i32,
        w_norm: DevPtr,
        eps: f32,
        w_kv: DevPtr,
        tail: MlaAppendTail,
    }
    /// `x + a`, its RMSNorm and one or two products of it, for one row.
    AddNormLinearArgs for ["add_norm_linear_1"] {
        x: DevPtr,
        a: DevPtr,
        w_norm: DevPtr,
        eps: f32,
        cols: i32,
        x_out: DevPtr,
        h_out: DevPtr,
        wa: DevPtr,
        na: i32,
        ya: DevPtr,
        wb: DevPtr,
        nb: i32,
        yb: DevPtr,
        blocks_a: i32,
    }
    /// MLA: keys and values from the latent cache.
    MlaExpandKvArgs for ["mla_expand_kv"] {
        kv: DevPtr,
        k_pe: DevPtr,
        caches: MlaCaches,
    }
    /// The greedy choice of each row.
    ArgmaxArgs for ["argmax_rows"] {
        x: DevPtr,
        cols: i32,
        keys: DevPtr,
        counts: DevPtr,
        out: DevPtr,
    }
    /// Each row's expert outputs added (and `plus`).
    MoeCombineArgs for ["moe_combine"] {
        out: DevPtr,
        row_items: DevPtr,
        top_k: i32,
        hidden: i32,
        y: DevPtr,
        plus: DevPtr,
    }
    /// Softmax top-k routing (kernels/routing.cu).
    RouteTopkArgs for ["route_softmax_topk"] {
        logits: DevPtr,
        experts: i32,
        top_k: i32,
        renormalize: i32,
        scale: f32,
        ids: DevPtr,
        weights: DevPtr,
    }
    /// SparseMixer top-2 routing.
    RouteSparseMixerArgs for ["route_sparse_mixer"] {
        logits: DevPtr,
        experts: i32,
        jitter_eps: f32,
        ids: DevPtr,
        weights: DevPtr,
    }
    /// Routing counts per expert.
    CountRoutesArgs for ["count_routes"] {
        ids: DevPtr,
        n: i32,
        counts: DevPtr,
    }
    /// The grouped-expert work list from a routing.
    MoePlanArgs for ["moe_plan"] {
        ids: DevPtr,
        weights: DevPtr,
        rows: i32,
        top_k: i32,
        experts: i32,
        list: WorkList,
    }
    /// Routing and its work list in one launch.
    RoutePlanArgs for ["route_plan"] {
        route: RouteTopkArgs,
        rows: i32,
        list: WorkList,
    }
    /// Stamps the GPU clock before a batch of paced copies (kernels/util.cu).
    LinkPaceStartArgs for ["link_pace_start"] {
        stamp: DevPtr,
    }
    /// Holds the copy stream until the paced time has passed.
    LinkPaceWaitArgs for ["link_pace_wait"] {
        stamp: DevPtr,
        ns: u64,
    }
}
