//! The seam between a model (an architecture's forward pass over a backend) and the decode loop.
//!
//! The decode loop, the expert planner and the cache policy are backend-free: they see a model only
//! through [`LanguageModel`], and the model reports its routing through [`RouteHook`].

use crate::Result;

/// Which copy of the routed experts a forward pass uses. Everything else (embeddings, attention,
/// norms, routers, shared experts, lm_head) is the same tensor for both.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// The FP16 routed experts: the model whose output is the contract.
    Target,
    /// The INT4 (GPTQ or RTN, group 128, Marlin-tiled) routed experts.
    Draft,
}

/// One MoE layer's routing in a forward pass, as [`RouteHook::on_route`] is told it.
#[derive(Clone, Copy, Debug)]
pub struct Route<'a> {
    pub variant: Variant,
    /// The decoder layer index.
    pub layer: usize,
    /// The index among MoE layers (0-based).
    pub moe_layer: usize,
    pub top_k: usize,
    /// Row-major `[rows, top_k]` expert ids.
    pub topk: &'a [u32],
}

/// Told, at every MoE layer of every forward pass, which experts each row routes to, before they
/// run. The offload code uses it to count the draft's routing (the forecast) and to account the
/// target's hits and misses.
pub trait RouteHook {
    /// One MoE layer's routing (its fields bundled so that the three indices cannot be swapped).
    fn on_route(&mut self, route: Route<'_>);

    /// Whether [`RouteHook::on_route`] wants the routing at all. A GPU backend then keeps the
    /// routing on the device and skips a host round trip per MoE layer.
    fn wants_routes(&self) -> bool {
        true
    }

    /// Whether `variant`'s routing may stay on the device, counted there per MoE layer and expert
    /// (a backend that keeps such counts, such as the CUDA backend's, hands them to whoever asked
    /// for them) instead of reported through [`RouteHook::on_route`]: that saves a host round trip
    /// per MoE layer. [`RouteHook::on_route`] is then not called for that variant's passes.
    fn counts_routes_on_device(&self, variant: Variant) -> bool {
        let _ = variant;
        false
    }

    /// Whether [`RouteHook::on_moe_input`] wants the hidden states: copying them to the host costs
    /// a transfer per MoE layer, so the forward pass makes it only when asked.
    fn wants_moe_input(&self) -> bool {
        false
    }

    /// The normalized hidden states entering a MoE layer's experts, row-major `[rows, hidden]`,
    /// with the same `topk` as [`RouteHook::on_route`]. Calibration (GPTQ) collects them; nothing
    /// else needs them, so the default ignores them.
    fn on_moe_input(
        &mut self,
        _variant: Variant,
        _moe_layer: usize,
        _hidden: &[f32],
        _topk: &[u32],
    ) {
    }
}

/// A hook that ignores everything.
pub struct NoHook;

impl RouteHook for NoHook {
    fn on_route(&mut self, _: Route<'_>) {}

    fn wants_routes(&self) -> bool {
        false
    }
}

/// Facts the decode loop and the planner need about a model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelInfo {
    pub architecture: String,
    pub vocab_size: usize,
    /// Longest sequence (prompt plus generated tokens) the KV cache accepts.
    pub max_context: usize,
    pub num_layers: usize,
    /// Decoder layer index of each MoE layer, in order.
    pub moe_layers: Vec<usize>,
    pub num_experts: usize,
    pub top_k: usize,
    /// Bytes of one FP16 routed expert (gate, up and down): what one expert copy costs.
    pub expert_bytes: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// A key/value cache: positions `0..len()` are filled.
pub trait KvCache {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Forget every position at or after `len` (crop after verification; drop the draft's scratch).
    fn truncate(&mut self, len: usize);
}

/// A causal language model with a target and a draft variant sharing one KV layout.
///
/// Exactness contract (what makes speculative decoding lossless): the logits of a row depend only
/// on the tokens at and before it, never on how many rows are computed in one call. A backend must
/// compute each row with the same arithmetic whether it runs alone or in a batch.
pub trait LanguageModel {
    type Kv: KvCache;

    fn info(&self) -> &ModelInfo;

    /// An empty cache able to hold `capacity` positions (at most `info().max_context`).
    fn new_kv(&self, capacity: usize) -> Result<Self::Kv>;

    /// Runs `tokens` at positions `kv.len()..kv.len() + tokens.len()`, appends their keys and values
    /// to `kv`, and returns the logits, row-major `[tokens.len(), vocab_size]`, in f32.
    fn forward(
        &self,
        variant: Variant,
        tokens: &[u32],
        kv: &mut Self::Kv,
        hook: &mut dyn RouteHook,
    ) -> Result<Vec<f32>>;

    /// [`LanguageModel::forward`] reduced to each row's greedy choice, the index
    /// `decode::argmax` gives over the row's logits. A greedy decode loop needs no
    /// more, so a backend may choose on the device and return only the ids; this default
    /// chooses on the host.
    fn forward_greedy(
        &self,
        variant: Variant,
        tokens: &[u32],
        kv: &mut Self::Kv,
        hook: &mut dyn RouteHook,
    ) -> Result<Vec<u32>> {
        let logits = self.forward(variant, tokens, kv, hook)?;
        row_choices(&logits, tokens.len(), self.info().vocab_size)
    }

    /// [`LanguageModel::forward`] for a prompt (prefill). A backend may compute a prompt's
    /// products of many rows with other arithmetic than decoding passes (tensor cores): a prompt
    /// row's logits then need not have the bits of the same row run alone, an exception to the
    /// exactness contract above that every mode and placement shares, so the tokens decoded after
    /// it are the same in all of them. The default is `forward`.
    fn prefill(
        &self,
        variant: Variant,
        tokens: &[u32],
        kv: &mut Self::Kv,
        hook: &mut dyn RouteHook,
    ) -> Result<Vec<f32>> {
        self.forward(variant, tokens, kv, hook)
    }

    /// [`LanguageModel::prefill`] reduced to each row's greedy choice, as
    /// [`LanguageModel::forward_greedy`] is to `forward`; this default chooses on the host.
    fn prefill_greedy(
        &self,
        variant: Variant,
        tokens: &[u32],
        kv: &mut Self::Kv,
        hook: &mut dyn RouteHook,
    ) -> Result<Vec<u32>> {
        let logits = self.prefill(variant, tokens, kv, hook)?;
        row_choices(&logits, tokens.len(), self.info().vocab_size)
    }

    /// Greedy one-row passes, each over the choice of the pass before: from `token`, at most
    /// `steps` passes, `accept` given each choice in order and returning whether to go on. The
    /// KV then holds the positions of exactly the passes whose choices `accept` was given, and
    /// the choices are [`LanguageModel::forward_greedy`]'s. A backend that records passes may
    /// queue each pass before the choice it runs from has reached the host; this default runs
    /// them one at a time.
    fn forward_greedy_chain(
        &self,
        variant: Variant,
        token: u32,
        kv: &mut Self::Kv,
        hook: &mut dyn RouteHook,
        steps: usize,
        accept: &mut dyn FnMut(u32) -> bool,
    ) -> Result<()> {
        let mut token = token;
        for _ in 0..steps {
            token = one_choice(self.forward_greedy(variant, &[token], kv, hook)?)?;
            if !accept(token) {
                break;
            }
        }
        Ok(())
    }
}

/// Each row's greedy choice (`decode::argmax`) of `rows` rows of logits over `vocab` tokens.
fn row_choices(logits: &[f32], rows: usize, vocab: usize) -> Result<Vec<u32>> {
    if vocab == 0 || logits.len() != rows * vocab {
        return Err(crate::Error::Model(format!(
            "forward returned {} logits for {rows} rows of vocabulary {vocab}",
            logits.len()
        )));
    }
    Ok(logits
        .chunks(vocab)
        .map(crate::decode::sampling::argmax)
        .collect())
}

/// The choice of a one-row greedy pass.
pub(crate) fn one_choice(ids: Vec<u32>) -> Result<u32> {
    match ids[..] {
        [id] => Ok(id),
        _ => Err(crate::Error::Model(format!(
            "a one-row greedy forward returned {} ids",
            ids.len()
        ))),
    }
}
