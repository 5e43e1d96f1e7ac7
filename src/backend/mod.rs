//! Where a model runs: the [`Backend`] trait, and [`cpu`], the exact f32 reference.
//!
//! Ops are coarse (one op is one kernel or one cuBLAS call on a GPU): the model never touches
//! activation elements itself, except through [`Backend::to_host`] for logits and router output.
//!
//! Exactness contract: every op computes each row of its output with arithmetic that depends only
//! on that row's inputs (and, for attention, on the cached rows it may see), never on how many
//! rows the call holds. That makes a batch of rows bit-identical to the same rows one at a time.

pub mod cpu;
pub mod cuda;

use half::f16;

use crate::arch::RopeStyle;
use crate::{Error, Result};

/// How to rotate a `[rows, heads * head_stride]` activation in place.
#[derive(Clone, Copy, Debug)]
pub struct RopeSpec {
    pub heads: usize,
    /// Width of one head in the activation.
    pub head_stride: usize,
    /// First rotated channel inside a head (MLA rotates the tail of each query head).
    pub offset: usize,
    /// Number of rotated channels (even).
    pub rot_dim: usize,
    pub style: RopeStyle,
}

/// MLA's per-head widths: `heads` heads of `nope` unrotated key channels and `v_dim` value
/// channels.
#[derive(Clone, Copy, Debug)]
pub struct MlaShape {
    pub heads: usize,
    pub nope: usize,
    pub v_dim: usize,
}

/// What [`Backend::mla_kv_append`] reads besides the compressed projection and writes into:
/// the latent's norm, kv_b, both rotations and the cache row.
pub struct MlaAppend<'a, W> {
    /// The latent's RMSNorm weight (`[rank]`) and epsilon.
    pub norm: &'a W,
    pub eps: f32,
    /// The latent's width: the compressed projection is `[rows, rank + k_rope.rot_dim]`.
    pub rank: usize,
    /// The shared key part's rotation: one head of `rot_dim` channels.
    pub k_rope: RopeSpec,
    /// kv_b's weight, `[heads * (nope + v_dim), rank]` (no bias).
    pub kv_b: &'a W,
    pub shape: MlaShape,
    /// The cache row the new rows go to.
    pub start: usize,
    /// The query's rotation (each head's rope channels).
    pub q_rope: RopeSpec,
    pub inv_freq: &'a [f32],
    pub positions: &'a [usize],
    pub scales: &'a [f32],
}

/// What [`Backend::add_rms_norm_linear`] returns: the normed rows and their products.
pub struct NormedProducts<A> {
    /// The RMSNorm of the residual after the add.
    pub h: A,
    /// `h @ a^T`.
    pub a: A,
    /// `h @ b^T`, where a second weight was given.
    pub b: Option<A>,
}

/// Shapes and masking of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttentionSpec {
    pub heads: usize,
    pub kv_heads: usize,
    /// Query/key width per head.
    pub qk_dim: usize,
    /// Value width per head.
    pub v_dim: usize,
    /// Multiplies q·k before the softmax.
    pub scale: f32,
    /// Position of the first query row; query row `i` sees keys `0..=start + i`.
    pub start: usize,
    /// Keys at or before `position - window` are masked.
    pub window: Option<usize>,
}

/// How the router turns a row of logits into top-k experts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RouteSpec {
    /// Softmax, top-k, optional renormalization, then scaling.
    SoftmaxTopK {
        top_k: usize,
        renormalize: bool,
        scale: f32,
    },
    /// PhiMoE SparseMixer top-2 at inference.
    SparseMixer { jitter_eps: f32 },
}

/// Top-k routing of a batch, on the host (the decode loop and the expert cache need it there).
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    pub top_k: usize,
    /// Row-major `[rows, top_k]` expert ids.
    pub ids: Vec<u32>,
    /// Row-major `[rows, top_k]` weights.
    pub weights: Vec<f32>,
}

/// One forward pass as a backend may record it once and replay it (CUDA graphs): everything the
/// pass's device work depends on, other than its tokens and their positions, is named by `key`.
pub struct StepRequest<'a> {
    /// The variant, the row count and the KV cache's storage (see [`Backend::storage_id`]).
    pub key: u64,
    pub tokens: &'a [u32],
    /// Position of the first token.
    pub start: usize,
    /// The model's rope frequencies and each row's cos/sin scale, as [`Backend::rope`] gets them.
    pub inv_freq: &'a [f32],
    pub scales: &'a [f32],
    /// The pass's one token is the last greedy choice fed on the device
    /// ([`Backend::feed_choice`]), not `tokens` (which then gives only the row count): the
    /// backend replays a recording of the pass, or answers [`StepStart::Unrecorded`].
    pub fed: bool,
}

/// What the caller of [`Backend::begin_step`] does next.
pub enum StepStart<A> {
    /// Run the pass's ops, then call [`Backend::end_step`].
    Run,
    /// The pass was replayed: these are its logits.
    Replayed(A),
    /// A fed pass ([`StepRequest::fed`]) has no recording: nothing ran. The caller takes the
    /// fed choice to the host and runs the pass from it.
    Unrecorded,
}

/// What the caller of [`Backend::begin_segment`] does next.
pub enum SegmentStart<A> {
    /// Run the segment's ops, then call [`Backend::end_segment`].
    Run,
    /// The segment was replayed: these are its outputs, in the order `end_segment` got them when
    /// it was recorded.
    Replayed(Vec<A>),
}

/// What the caller of [`Backend::end_segment`] does next.
pub enum SegmentEnd<A> {
    /// The segment ran; its outputs stand.
    Done,
    /// The ops were only recorded, and recording failed: run the segment again (it will not be
    /// recorded a second time) from these, the inputs [`Backend::begin_segment`] was given, in
    /// its order. An op of the segment may have replaced the caller's handle on an input with
    /// a new buffer that nothing wrote.
    Rerun(Vec<A>),
}

/// What the caller of [`Backend::end_step`] does next.
pub enum StepEnd {
    /// The pass ran; its result stands.
    Done,
    /// The ops were only recorded, and recording failed: run the pass again (it will not be
    /// recorded a second time).
    Rerun,
}

/// A gated (SwiGLU) MLP: `down(silu(gate(x)) * up(x))`, gate and up fused into one
/// `[2 * inter, in]` weight (gate rows first).
pub struct GatedMlp<B: Backend + ?Sized> {
    pub gate_up: B::Weight,
    pub down: B::Weight,
}

pub trait Backend: Send + Sync {
    /// A row-major `[rows, cols]` f32 activation.
    type Act: Send + Sync;
    /// A resident weight: a matrix `[out, in]` or a vector.
    type Weight: Send + Sync;

    fn name(&self) -> &'static str;

    /// An FP16 weight (matrix `[out, in]` or vector).
    fn weight_f16(&self, name: &str, shape: &[usize], data: &[f16]) -> Result<Self::Weight>;
    /// An FP16 weight made of `parts` laid end to end (a fused gate/up matrix).
    fn weight_f16_parts(
        &self,
        name: &str,
        shape: &[usize],
        parts: &[&[f16]],
    ) -> Result<Self::Weight> {
        let joined: Vec<f16> = parts.concat();
        self.weight_f16(name, shape, &joined)
    }

    /// Starts loading a model from a store backed by `backing`. Until [`Self::finish_load`], a
    /// backend may hand out weights whose bytes (borrowed from `backing`) are not uploaded yet,
    /// and upload them all at once, with large reads, in `finish_load`. Callers keep the store
    /// alive until then.
    fn begin_load(&self, backing: Option<crate::weights::Backing<'_>>) -> Result<()> {
        let _ = backing;
        Ok(())
    }

    /// Uploads everything deferred since [`Self::begin_load`]; the weights are usable after it.
    fn finish_load(&self) -> Result<()> {
        Ok(())
    }

    /// Drops every deferred upload (the load failed and its weights are being dropped).
    fn cancel_load(&self) {}

    /// An INT4 Marlin-tiled weight used as `[n, k]`: `k` inputs, `n` outputs.
    fn weight_int4(
        &self,
        name: &str,
        k: usize,
        n: usize,
        qweight: &[u32],
        scales: &[f16],
    ) -> Result<Self::Weight>;

    /// An 8-, 4-, 3- or 2-bit weight in the row layout (`crate::quant::rows_pack`) used as `[n, k]`:
    /// `k` inputs, `n` outputs. Products with it round their input rows to f16 first, as with
    /// INT4 weights. The default refuses: a backend without kernels for the width says so.
    fn weight_rows(
        &self,
        name: &str,
        bits: crate::quant::Bits,
        k: usize,
        n: usize,
        qweight: &[u8],
        scales: &[f16],
    ) -> Result<Self::Weight> {
        let _ = (k, n, qweight, scales);
        Err(Error::Backend(format!(
            "{name}: the {} backend has no kernels for {bits}-bit weights",
            self.name()
        )))
    }

    /// Refuses, before any weight is read, routed experts this backend cannot run as they are
    /// stored. The default accepts every width [`Self::weight_int4`] and [`Self::weight_rows`]
    /// take.
    fn check_expert_widths(&self, widths: crate::weights::ExpertWidths) -> Result<()> {
        let _ = widths;
        Ok(())
    }

    /// `rows x cols` zeros.
    fn zeros(&self, rows: usize, cols: usize) -> Result<Self::Act>;
    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<Self::Act>;
    fn to_host(&self, x: &Self::Act) -> Result<Vec<f32>>;
    fn shape(&self, x: &Self::Act) -> (usize, usize);

    /// Rows of `table` (`[vocab, hidden]`) for `ids`.
    fn embedding(&self, table: &Self::Weight, ids: &[u32]) -> Result<Self::Act>;
    /// RMSNorm over each consecutive group of `group` columns (the whole row when `group` equals
    /// the width), times `weight` (of length `group`).
    fn rms_norm(
        &self,
        x: &Self::Act,
        weight: &Self::Weight,
        eps: f32,
        group: usize,
    ) -> Result<Self::Act>;
    fn layer_norm(
        &self,
        x: &Self::Act,
        weight: &Self::Weight,
        bias: &Self::Weight,
        eps: f32,
    ) -> Result<Self::Act>;
    /// `x @ w^T (+ bias)`.
    fn linear(
        &self,
        x: &Self::Act,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
    ) -> Result<Self::Act>;
    /// Splits columns into consecutive pieces of the given widths.
    fn split_cols(&self, x: &Self::Act, widths: &[usize]) -> Result<Vec<Self::Act>>;
    /// Clamps every element to `[-limit, limit]`.
    fn clamp(&self, x: &mut Self::Act, limit: f32) -> Result<()>;
    /// `x += y`.
    fn add_assign(&self, x: &mut Self::Act, y: &Self::Act) -> Result<()>;
    /// `x += sigmoid(gate) * y`, `gate` being `[rows, 1]`.
    fn add_sigmoid_gated(&self, x: &mut Self::Act, y: &Self::Act, gate: &Self::Act) -> Result<()>;

    /// Rotates row `r` by angles `positions[r] * inv_freq[i]`, cos/sin scaled by `scales[r]`.
    fn rope(
        &self,
        x: &mut Self::Act,
        spec: RopeSpec,
        inv_freq: &[f32],
        positions: &[usize],
        scales: &[f32],
    ) -> Result<()>;

    /// Copies `src`'s rows into `dst` starting at row `row`.
    fn write_rows(&self, dst: &mut Self::Act, row: usize, src: &Self::Act) -> Result<()>;
    /// A copy of the first `rows` rows.
    fn head_rows(&self, x: &Self::Act, rows: usize) -> Result<Self::Act>;
    /// MLA: from `kv` (`[len, heads * (nope + v)]`, per head nope then v) and the shared rotated
    /// key `k_pe` (`[len, rope]`), builds keys `[len, heads * (nope + rope)]` and values
    /// `[len, heads * v]`.
    fn mla_expand_kv(
        &self,
        kv: &Self::Act,
        k_pe: &Self::Act,
        heads: usize,
        nope: usize,
        v_dim: usize,
    ) -> Result<(Self::Act, Self::Act)>;
    /// Causal softmax attention of `q` (`[rows, heads * qk_dim]`) over the first `kv_len` rows of
    /// `k` (`[.., kv_heads * qk_dim]`) and `v` (`[.., kv_heads * v_dim]`).
    fn attention(
        &self,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        kv_len: usize,
        spec: AttentionSpec,
    ) -> Result<Self::Act>;

    /// `x += y`, then RMSNorm of every whole row of `x` times `weight`: a decoder layer's
    /// residual add and the norm after it. The default runs [`Self::add_assign`] then
    /// [`Self::rms_norm`]; a backend may fuse them, with the same bits.
    fn add_rms_norm(
        &self,
        x: &mut Self::Act,
        y: &Self::Act,
        weight: &Self::Weight,
        eps: f32,
    ) -> Result<Self::Act> {
        self.add_assign(x, y)?;
        let (_, cols) = self.shape(x);
        self.rms_norm(x, weight, eps, cols)
    }

    /// `(x @ a^T, x @ b^T)`, no bias: two products of one input (MLA's query and compressed
    /// key/value projections). The default runs [`Self::linear`] twice; a backend may run both
    /// in one launch, with the same bits.
    fn linear_pair(
        &self,
        x: &Self::Act,
        a: &Self::Weight,
        b: &Self::Weight,
    ) -> Result<(Self::Act, Self::Act)> {
        Ok((self.linear(x, a, None)?, self.linear(x, b, None)?))
    }

    /// `x += y`, the RMSNorm `h` of `x` times `norm` ([`Self::add_rms_norm`]), and `h`'s
    /// products with `a` and, where given, `b` (no bias): a residual add, the norm after it and
    /// the products that read the norm (MLA's query and compressed projections, an MoE layer's
    /// router). The default runs those ops ([`add_rms_norm_linear_ops`]); a backend may fuse
    /// them, with the same bits.
    fn add_rms_norm_linear(
        &self,
        x: &mut Self::Act,
        y: &Self::Act,
        norm: &Self::Weight,
        eps: f32,
        a: &Self::Weight,
        b: Option<&Self::Weight>,
    ) -> Result<NormedProducts<Self::Act>> {
        add_rms_norm_linear_ops(self, x, y, norm, eps, a, b)
    }

    /// MLA's latent step: `compressed` (`[rows, rank + rope]`) split into the latent, RMS-normed
    /// over its `rank` columns with `norm` and `eps`, and the shared key part rotated as `rope`
    /// says (one head of `rope.rot_dim` channels). The default runs [`Self::split_cols`],
    /// [`Self::rms_norm`] and [`Self::rope`]; a backend may fuse them, with the same bits.
    #[allow(clippy::too_many_arguments)]
    fn mla_latent(
        &self,
        compressed: &Self::Act,
        norm: &Self::Weight,
        eps: f32,
        rank: usize,
        rope: RopeSpec,
        inv_freq: &[f32],
        positions: &[usize],
        scales: &[f32],
    ) -> Result<(Self::Act, Self::Act)> {
        let mut parts = self
            .split_cols(compressed, &[rank, rope.rot_dim])?
            .into_iter();
        let (latent, mut pe) = match (parts.next(), parts.next()) {
            (Some(a), Some(b)) => (a, b),
            _ => return Err(Error::Backend("split_cols returned too few parts".into())),
        };
        let latent = self.rms_norm(&latent, norm, eps, rank)?;
        self.rope(&mut pe, rope, inv_freq, positions, scales)?;
        Ok((latent, pe))
    }

    /// MLA after `kv_b_proj`: keys and values of the new rows built from `kv` and `k_pe` (as
    /// [`Self::mla_expand_kv`]) and written into the caches at row `start`, and the query `q`
    /// rotated in place as `q_rope` says. The default runs [`Self::mla_expand_kv`],
    /// [`Self::write_rows`] twice and [`Self::rope`]; a backend may fuse them, with the same bits.
    #[allow(clippy::too_many_arguments)]
    fn mla_expand_append(
        &self,
        kv: &Self::Act,
        k_pe: &Self::Act,
        mla: MlaShape,
        keys: &mut Self::Act,
        values: &mut Self::Act,
        start: usize,
        q: &mut Self::Act,
        q_rope: RopeSpec,
        inv_freq: &[f32],
        positions: &[usize],
        scales: &[f32],
    ) -> Result<()> {
        let (new_keys, new_values) =
            self.mla_expand_kv(kv, k_pe, mla.heads, mla.nope, mla.v_dim)?;
        self.write_rows(keys, start, &new_keys)?;
        self.write_rows(values, start, &new_values)?;
        self.rope(q, q_rope, inv_freq, positions, scales)
    }

    /// MLA from the compressed projection to the caches: [`Self::mla_latent`] of `compressed`,
    /// `kv_b`'s product of the latent (no bias), then [`Self::mla_expand_append`] (keys and
    /// values written at row `start`, `q` rotated in place), as `step` describes them. The
    /// default runs those three ops ([`mla_kv_append_ops`]); a backend may fuse them, with the
    /// same bits.
    fn mla_kv_append(
        &self,
        compressed: &Self::Act,
        step: &MlaAppend<'_, Self::Weight>,
        keys: &mut Self::Act,
        values: &mut Self::Act,
        q: &mut Self::Act,
    ) -> Result<()> {
        mla_kv_append_ops(self, compressed, step, keys, values, q)
    }

    /// Routed expert `expert` of model layer `layer`. `load` reads and uploads it like any other
    /// weights (the default); a backend that offloads experts returns a handle instead and
    /// copies the expert in when a pass needs it.
    fn routed_expert(
        &self,
        layer: usize,
        expert: usize,
        load: &mut dyn FnMut() -> Result<GatedMlp<Self>>,
    ) -> Result<GatedMlp<Self>>
    where
        Self: Sized,
    {
        let _ = (layer, expert);
        load()
    }

    /// Router top-k over `logits` (`[rows, num_experts]`).
    fn route(&self, logits: &Self::Act, spec: RouteSpec) -> Result<Routing>;
    /// [`Self::route`], and `shared`'s MLP over `x` when given: a backend that waits for the
    /// device to route issues the MLP so that it runs during that wait. The same values as
    /// `route` then `gated_mlp`.
    fn route_beside_shared(
        &self,
        logits: &Self::Act,
        spec: RouteSpec,
        x: &Self::Act,
        shared: Option<&GatedMlp<Self>>,
    ) -> Result<(Routing, Option<Self::Act>)>
    where
        Self: Sized,
    {
        let routing = self.route(logits, spec)?;
        let out = shared.map(|mlp| self.gated_mlp(x, mlp)).transpose()?;
        Ok((routing, out))
    }
    /// Routes `logits` and runs the routed experts over `x` in one step: [`Self::route`] then
    /// [`Self::moe_experts`], returning the routing too. With `host_routing` false the caller
    /// does not need the routing, and a backend may keep it on the device (returning `None`).
    /// `count_as`: a backend that counts routings on the device (see
    /// [`crate::model::RouteHook::counts_routes_on_device`]) adds this call's to MoE layer
    /// `count_as`'s counts; others ignore it.
    fn routed_moe(
        &self,
        x: &Self::Act,
        logits: &Self::Act,
        spec: RouteSpec,
        experts: &[GatedMlp<Self>],
        host_routing: bool,
        count_as: Option<usize>,
    ) -> Result<(Self::Act, Option<Routing>)>
    where
        Self: Sized,
    {
        let _ = (host_routing, count_as);
        let routing = self.route(logits, spec)?;
        let out = self.moe_experts(x, &routing, experts)?;
        Ok((out, Some(routing)))
    }

    /// [`Self::routed_moe`] without host routing, then `+= plus` (the shared experts' output):
    /// the default runs the two; a backend may add `plus` in the experts' combine, with the same
    /// bits.
    fn routed_moe_plus(
        &self,
        x: &Self::Act,
        logits: &Self::Act,
        spec: RouteSpec,
        experts: &[GatedMlp<Self>],
        count_as: Option<usize>,
        plus: &Self::Act,
    ) -> Result<Self::Act>
    where
        Self: Sized,
    {
        let (mut out, _) = self.routed_moe(x, logits, spec, experts, false, count_as)?;
        self.add_assign(&mut out, plus)?;
        Ok(out)
    }

    /// An MoE layer's routed experts (as [`Self::routed_moe_plus`]) with its ungated shared
    /// experts `shared` (a dense gated MLP over every row) added in the combine: the default runs
    /// the two; a backend may run the shared experts inside the routed experts' launches, with
    /// the same bits.
    fn routed_moe_shared(
        &self,
        x: &Self::Act,
        logits: &Self::Act,
        spec: RouteSpec,
        experts: &[GatedMlp<Self>],
        count_as: Option<usize>,
        shared: &GatedMlp<Self>,
    ) -> Result<Self::Act>
    where
        Self: Sized,
    {
        let s = self.gated_mlp(x, shared)?;
        self.routed_moe_plus(x, logits, spec, experts, count_as, &s)
    }

    /// A dense gated MLP over every row.
    fn gated_mlp(&self, x: &Self::Act, mlp: &GatedMlp<Self>) -> Result<Self::Act>;
    /// Routed experts: each expert hit by `routing` runs once over the rows routed to it; a row's
    /// output is the weighted sum of its experts' outputs, added in ascending expert id.
    /// `experts[e]` is expert `e`'s MLP.
    fn moe_experts(
        &self,
        x: &Self::Act,
        routing: &Routing,
        experts: &[GatedMlp<Self>],
    ) -> Result<Self::Act>;
    /// Each row's greedy choice: the index `decode::argmax_scan` gives (the first
    /// maximum; NaN never wins, -0 equals +0; 0 when no value is above -inf). The decode loop's
    /// greedy passes take their tokens from here, so every backend gives exactly that index.
    fn argmax(&self, x: &Self::Act) -> Result<Vec<u32>>;

    /// Starts a forward pass that a backend may record and replay (only passes whose caller
    /// needs no routing on the host come here). The default runs every pass op by op.
    fn begin_step(&self, step: &StepRequest) -> Result<StepStart<Self::Act>> {
        Ok(if step.fed {
            StepStart::Unrecorded
        } else {
            StepStart::Run
        })
    }

    /// Ends the pass [`Self::begin_step`] started; `logits` is its output, or `None` when an op
    /// failed.
    fn end_step(&self, logits: Option<&Self::Act>) -> Result<StepEnd> {
        let _ = logits;
        Ok(StepEnd::Done)
    }

    /// Starts segment `index` of the pass [`Self::begin_step`] started: the ops between two
    /// waits for the device (an offloaded layer's routing read back to the host), which a
    /// backend may record once and replay where it cannot record the whole pass. `inputs` are
    /// the activations the segment reads that earlier ops made, each with whether the segment
    /// also writes it in place; a replay takes them wherever they now lie. The default runs
    /// every segment op by op.
    fn begin_segment(
        &self,
        index: usize,
        inputs: &[(&Self::Act, bool)],
    ) -> Result<SegmentStart<Self::Act>> {
        let _ = (index, inputs);
        Ok(SegmentStart::Run)
    }

    /// Ends the segment [`Self::begin_segment`] started; `outputs` are the activations later
    /// ops read, or `None` when an op failed.
    fn end_segment(&self, outputs: Option<&[&Self::Act]>) -> Result<SegmentEnd<Self::Act>> {
        let _ = outputs;
        Ok(SegmentEnd::Done)
    }

    /// Greedy passes fed on the device, for a backend that records passes: chooses the greedy
    /// token of `logits`' one row ([`Backend::argmax`]'s) where the next fed pass
    /// ([`StepRequest::fed`]) reads its token, and starts copying it to the host, where
    /// [`Backend::take_fed_choice`] returns it. The next pass can then be queued before the
    /// choice reaches the host. Returns false, doing nothing, where the backend cannot (the
    /// default) or `logits` is not one row.
    fn feed_choice(&self, logits: &Self::Act) -> Result<bool> {
        let _ = logits;
        Ok(false)
    }

    /// The oldest choice [`Backend::feed_choice`] fed and no one took yet, once on the host.
    fn take_fed_choice(&self) -> Result<u32> {
        Err(crate::Error::Backend(
            "this backend feeds no greedy choices".into(),
        ))
    }

    /// Forgets every fed choice not taken (their passes' results are discarded).
    fn drop_fed_choices(&self) -> Result<()> {
        Ok(())
    }

    /// A number naming an activation's storage, equal for two activations only when they share
    /// it (a recorded pass is valid for the KV cache it was recorded on); 0 when the backend
    /// records nothing.
    fn storage_id(&self, x: &Self::Act) -> u64 {
        let _ = x;
        0
    }

    /// Marks the ops that follow, until it is called with `false`, as a prompt's pass (prefill):
    /// a backend may then compute products of many rows with other arithmetic than a decoding
    /// step's (tensor cores), so a prompt row's bits may differ from the same row's one-row
    /// step. The choice depends on the shapes alone, never on placement or mode, and every mode
    /// runs its prompt this way, so tokens still depend on neither. The default ignores it.
    fn prompt_pass(&self, on: bool) {
        let _ = on;
    }
}

/// [`Backend::add_rms_norm_linear`] as its ops ([`Backend::add_rms_norm`], then
/// [`Backend::linear`] or [`Backend::linear_pair`]): the default, and a backend's path where its
/// fused form does not apply.
pub fn add_rms_norm_linear_ops<B: Backend + ?Sized>(
    be: &B,
    x: &mut B::Act,
    y: &B::Act,
    norm: &B::Weight,
    eps: f32,
    a: &B::Weight,
    b: Option<&B::Weight>,
) -> Result<NormedProducts<B::Act>> {
    let h = be.add_rms_norm(x, y, norm, eps)?;
    let (a, b) = match b {
        Some(b) => {
            let (pa, pb) = be.linear_pair(&h, a, b)?;
            (pa, Some(pb))
        }
        None => (be.linear(&h, a, None)?, None),
    };
    Ok(NormedProducts { h, a, b })
}

/// [`Backend::mla_kv_append`] as its three ops: the default, and a backend's path where its
/// fused form does not apply.
pub fn mla_kv_append_ops<B: Backend + ?Sized>(
    be: &B,
    compressed: &B::Act,
    step: &MlaAppend<'_, B::Weight>,
    keys: &mut B::Act,
    values: &mut B::Act,
    q: &mut B::Act,
) -> Result<()> {
    let (latent, pe) = be.mla_latent(
        compressed,
        step.norm,
        step.eps,
        step.rank,
        step.k_rope,
        step.inv_freq,
        step.positions,
        step.scales,
    )?;
    let kv = be.linear(&latent, step.kv_b, None)?;
    be.mla_expand_append(
        &kv,
        &pe,
        step.shape,
        keys,
        values,
        step.start,
        q,
        step.q_rope,
        step.inv_freq,
        step.positions,
        step.scales,
    )
}

/// Shape checks every backend makes before an op, so that both refuse the same calls with the
/// same words. Shapes are `(rows, cols)`; the error is the detail after the op's name.
pub(crate) mod check {
    use super::{AttentionSpec, RopeSpec};

    /// A dense weight's `shape` (one or two dimensions) holding `values` values; `allow_empty`
    /// lets a backend that needs no allocation take a zero-sized one.
    pub fn weight(
        name: &str,
        shape: &[usize],
        values: usize,
        allow_empty: bool,
    ) -> Result<(), String> {
        let n: usize = shape.iter().product();
        if n != values || shape.is_empty() || shape.len() > 2 || (n == 0 && !allow_empty) {
            return Err(format!(
                "{name}: shape {shape:?} does not hold {values} values"
            ));
        }
        Ok(())
    }

    pub fn split(widths: &[usize], cols: usize) -> Result<(), String> {
        if widths.iter().sum::<usize>() != cols {
            return Err(format!("widths {widths:?} do not add up to {cols}"));
        }
        Ok(())
    }

    pub fn same(x: (usize, usize), y: (usize, usize)) -> Result<(), String> {
        if x != y {
            return Err(format!("[{}, {}] += [{}, {}]", x.0, x.1, y.0, y.1));
        }
        Ok(())
    }

    pub fn sigmoid_gated(
        x: (usize, usize),
        y: (usize, usize),
        gate: (usize, usize),
    ) -> Result<(), String> {
        if x != y || gate.0 != x.0 || gate.1 != 1 {
            return Err(format!(
                "x [{}, {}], gate [{}, {}]",
                x.0, x.1, gate.0, gate.1
            ));
        }
        Ok(())
    }

    pub fn rope(
        spec: &RopeSpec,
        x: (usize, usize),
        inv_freq: usize,
        positions: usize,
        scales: usize,
    ) -> Result<(), String> {
        if !spec.rot_dim.is_multiple_of(2)
            || inv_freq != spec.rot_dim / 2
            || positions != x.0
            || scales != x.0
            || spec.heads * spec.head_stride != x.1
            || spec.offset + spec.rot_dim > spec.head_stride
        {
            return Err(format!("{spec:?} does not fit [{}, {}]", x.0, x.1));
        }
        Ok(())
    }

    pub fn write_rows(dst: (usize, usize), row: usize, src: (usize, usize)) -> Result<(), String> {
        if src.1 != dst.1 || row + src.0 > dst.0 {
            return Err(format!(
                "[{}, {}] at row {row} into [{}, {}]",
                src.0, src.1, dst.0, dst.1
            ));
        }
        Ok(())
    }

    pub fn mla_expand(
        kv: (usize, usize),
        k_pe: (usize, usize),
        heads: usize,
        nope: usize,
        v_dim: usize,
    ) -> Result<(), String> {
        if kv.1 != heads * (nope + v_dim) || kv.0 != k_pe.0 {
            return Err(format!(
                "kv [{}, {}], k_pe [{}, {}]",
                kv.0, kv.1, k_pe.0, k_pe.1
            ));
        }
        Ok(())
    }

    pub fn attention(
        spec: &AttentionSpec,
        q: (usize, usize),
        k: (usize, usize),
        v: (usize, usize),
        kv_len: usize,
    ) -> Result<(), String> {
        if spec.kv_heads == 0
            || spec.heads == 0
            || !spec.heads.is_multiple_of(spec.kv_heads)
            || q.1 != spec.heads * spec.qk_dim
            || k.1 != spec.kv_heads * spec.qk_dim
            || v.1 != spec.kv_heads * spec.v_dim
            || kv_len > k.0
            || kv_len > v.0
            || spec.start + q.0 > kv_len
        {
            return Err(format!(
                "{spec:?}: q [{}, {}], k [{}, {}], v [{}, {}], kv_len {kv_len}",
                q.0, q.1, k.0, k.1, v.0, v.1
            ));
        }
        Ok(())
    }
}
