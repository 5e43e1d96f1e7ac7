//! The forward pass shared by every architecture, over a [`Backend`].
//!
//! One decoder layer is: norm, attention (standard or MLA), residual, norm, MLP (dense or MoE),
//! residual. The architectures differ only in the parts [`ArchConfig`] describes.

use half::f16;

use super::config::{ArchConfig, AttentionKind, ModelType, NormKind, QkNorm, RouterKind};
use super::rope::{attention_scale, rope_table, RopeTable};
use super::tensors::{
    draft_tensor_name, expected_tensors, expert_tensor_name, router_tensor_name,
    shared_expert_gate_name, shared_expert_prefix, target_tensor_name,
};
use super::{Proj, TensorSpec};
use crate::backend::{AttentionSpec, Backend, GatedMlp, MlaAppend, MlaShape, RopeSpec, RouteSpec};
use crate::model::{KvCache, LanguageModel, ModelInfo, Route, RouteHook, Variant};
use crate::quant::Bits;
use crate::weights::WeightStore;
use crate::{Error, Result};
use specter_format::Layout;

mod pass;
mod step;

/// DeepSeek-V2's `q_a_layernorm` and `kv_a_layernorm` are built with the RMSNorm default eps,
/// not `rms_norm_eps`.
const MLA_LATENT_NORM_EPS: f32 = 1e-6;

struct Norm<B: Backend> {
    weight: B::Weight,
    bias: Option<B::Weight>,
}

struct Linear<B: Backend> {
    weight: B::Weight,
    bias: Option<B::Weight>,
}

enum MlaQuery<B: Backend> {
    Full(B::Weight),
    Lora {
        a: Linear<B>,
        norm: B::Weight,
        b: B::Weight,
        rank: usize,
    },
}

enum Attention<B: Backend> {
    Standard {
        q: Linear<B>,
        k: Linear<B>,
        v: Linear<B>,
        o: Linear<B>,
        q_norm: Option<B::Weight>,
        k_norm: Option<B::Weight>,
    },
    Mla {
        q: MlaQuery<B>,
        kv_a: Linear<B>,
        kv_a_norm: B::Weight,
        kv_b: B::Weight,
        o: Linear<B>,
    },
}

struct MoeBlock<B: Backend> {
    moe_index: usize,
    router: B::Weight,
    target: Vec<GatedMlp<B>>,
    /// Empty when the store holds no draft experts.
    draft: Vec<GatedMlp<B>>,
    shared: Option<GatedMlp<B>>,
    shared_gate: Option<B::Weight>,
}

enum Mlp<B: Backend> {
    Dense(GatedMlp<B>),
    Moe(Box<MoeBlock<B>>),
}

struct Layer<B: Backend> {
    input_norm: Norm<B>,
    post_attention_norm: Norm<B>,
    attention: Attention<B>,
    mlp: Mlp<B>,
}

/// A Mixture-of-Experts causal LM of any supported architecture, with its weights resident on
/// backend `B`.
pub struct MoeModel<B: Backend> {
    cfg: ArchConfig,
    info: ModelInfo,
    backend: B,
    embed: B::Weight,
    layers: Vec<Layer<B>>,
    final_norm: Norm<B>,
    /// `None`: tied to the embedding.
    lm_head: Option<B::Weight>,
    lm_head_bias: Option<B::Weight>,
    rope: RopeTable,
    attention_scale: f32,
    /// The first draft tensor the store lacks, if any.
    draft_missing: Option<String>,
}

/// One layer's cache.
enum LayerKv<B: Backend> {
    /// Rotated keys `[capacity, kv_heads * head_dim]` and values.
    Standard { k: B::Act, v: B::Act },
    /// MLA: the expanded keys `[capacity, heads * (nope + rope)]` and values
    /// `[capacity, heads * v_dim]`. transformers caches the latent and expands the whole cache at
    /// every step; each row's expansion depends only on that row (batch invariance), so expanding
    /// new rows once and caching the result gives the same bits without re-reading the cache
    /// through `kv_b_proj` every step, at `heads * (nope + rope + v) / (rank + rope)` times the
    /// memory.
    Mla { keys: B::Act, values: B::Act },
}

/// The KV cache of a [`MoeModel`]: positions `0..len` are filled, room for `capacity`.
pub struct MoeKv<B: Backend> {
    len: usize,
    capacity: usize,
    layers: Vec<LayerKv<B>>,
    /// Names the cache's storage (see [`Backend::storage_id`]), part of a recorded pass's key.
    storage: u64,
}

impl<B: Backend> MoeKv<B> {
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

impl<B: Backend> KvCache for MoeKv<B> {
    fn len(&self) -> usize {
        self.len
    }

    fn truncate(&mut self, len: usize) {
        // Rows past `len` are stale and are overwritten by the next forward.
        self.len = self.len.min(len);
    }
}

/// Reads tensors by name and checks them against the expected shapes.
struct Loader<'a, B: Backend> {
    store: &'a dyn WeightStore,
    backend: &'a B,
    specs: std::collections::HashMap<String, Vec<usize>>,
}

impl<B: Backend> Loader<'_, B> {
    /// A tensor checked against its expected shape, borrowed from the store when it can be (a
    /// bundle's mapping): the backend may then upload it straight from the file.
    fn tensor(&self, name: &str) -> Result<crate::weights::Tensor<'_, f16>> {
        if !self.store.contains(name) {
            return Err(Error::Model(format!("weights: missing tensor {name}")));
        }
        let t = self.store.f16(name)?;
        if let Some(expected) = self.specs.get(name) {
            if &t.shape != expected {
                return Err(Error::Model(format!(
                    "weights: tensor {name} has shape {:?}, expected {expected:?}",
                    t.shape
                )));
            }
        }
        Ok(t)
    }

    fn weight(&self, name: &str) -> Result<B::Weight> {
        let t = self.tensor(name)?;
        self.backend.weight_f16(name, &t.shape, &t.data)
    }

    fn opt(&self, name: &str, present: bool) -> Result<Option<B::Weight>> {
        present.then(|| self.weight(name)).transpose()
    }

    fn linear(&self, prefix: &str, bias: bool) -> Result<Linear<B>> {
        Ok(Linear {
            weight: self.weight(&format!("{prefix}.weight"))?,
            bias: self.opt(&format!("{prefix}.bias"), bias)?,
        })
    }

    fn norm(&self, prefix: &str, kind: NormKind) -> Result<Norm<B>> {
        Ok(Norm {
            weight: self.weight(&format!("{prefix}.weight"))?,
            bias: self.opt(&format!("{prefix}.bias"), kind == NormKind::LayerNorm)?,
        })
    }

    /// A gated MLP from separate gate/up/down tensors, gate and up fused.
    fn gated(&self, gate: &str, up: &str, down: &str) -> Result<GatedMlp<B>> {
        let g = self.tensor(gate)?;
        let u = self.tensor(up)?;
        let (gs, us) = (&g.shape, &u.shape);
        if gs != us || gs.len() != 2 {
            return Err(Error::Model(format!(
                "weights: {gate} {gs:?} and {up} {us:?} differ"
            )));
        }
        let fused = format!("{gate}+{up}");
        Ok(GatedMlp {
            gate_up: self.backend.weight_f16_parts(
                &fused,
                &[2 * gs[0], gs[1]],
                &[&g.data, &u.data],
            )?,
            down: self.weight(down)?,
        })
    }

    /// A quantized expert matrix of `k` inputs and `n` outputs stored in `layout`: `name(kind)`
    /// names its `qweight` and `scales`.
    fn quantized(
        &self,
        name: impl Fn(&str) -> String,
        layout: Layout,
        k: usize,
        n: usize,
    ) -> Result<B::Weight> {
        let (qname, sname) = (name("qweight"), name("scales"));
        let s = self.store.f16(&sname)?;
        match layout {
            Layout::Marlin => {
                let q = self.store.u32(&qname)?;
                self.backend.weight_int4(&qname, k, n, &q.data, &s.data)
            }
            Layout::Rows { bits } => {
                let bits = Bits::new(bits)?;
                let q = self.store.u8(&qname)?;
                self.backend
                    .weight_rows(&qname, bits, k, n, &q.data, &s.data)
            }
        }
    }

    /// One routed expert's quantized copy in `layout`: `tensor(part, kind)` names its tensors.
    fn quantized_expert(
        &self,
        tensor: impl Fn(&str, &str) -> String,
        layout: Layout,
        hidden: usize,
        inter: usize,
    ) -> Result<GatedMlp<B>> {
        Ok(GatedMlp {
            gate_up: self.quantized(|kind| tensor("gate_up", kind), layout, hidden, 2 * inter)?,
            down: self.quantized(|kind| tensor("down", kind), layout, inter, hidden)?,
        })
    }
}

impl<B: Backend> MoeModel<B> {
    /// Loads every tensor `cfg` needs from `store` (by Hugging Face name) onto `backend`. The
    /// draft's INT4 experts are loaded when the store holds them; otherwise a Draft forward fails
    /// naming the first missing one.
    pub fn load(cfg: ArchConfig, store: &dyn WeightStore, backend: B) -> Result<Self> {
        Self::load_with(cfg, store, backend, true)
    }

    /// As [`Self::load`]; with `with_draft` false the draft's INT4 experts are not loaded even when
    /// the store has them (target-only runs then keep that memory for FP16 experts).
    pub fn load_with(
        cfg: ArchConfig,
        store: &dyn WeightStore,
        backend: B,
        with_draft: bool,
    ) -> Result<Self> {
        // Weights may be uploaded in one batch at the end (large reads instead of a copy per
        // tensor); the store outlives both calls.
        backend.begin_load(store.backing())?;
        // On failure the backend, with whatever it deferred, is dropped with the weights.
        let model = Self::load_tensors(cfg, store, backend, with_draft)?;
        model.backend.finish_load()?;
        Ok(model)
    }

    fn load_tensors(
        cfg: ArchConfig,
        store: &dyn WeightStore,
        backend: B,
        with_draft: bool,
    ) -> Result<Self> {
        let specs: Vec<TensorSpec> = expected_tensors(&cfg);
        let loader = Loader::<B> {
            store,
            backend: &backend,
            specs: specs.into_iter().map(|s| (s.name, s.shape)).collect(),
        };
        let (hidden, inter) = cfg.expert_dims();
        let widths = store.expert_widths()?;
        backend.check_expert_widths(widths)?;
        let mut info = cfg.model_info();
        info.expert_bytes = widths.target_expert_bytes(hidden, inter);

        let mut draft_missing = None;
        if !with_draft {
            draft_missing = Some("(the draft was not loaded: target-only session)".to_string());
        }
        'find: for l in cfg.moe_layers() {
            if !with_draft {
                break;
            }
            for e in 0..cfg.moe.num_experts {
                for part in ["gate_up", "down"] {
                    for kind in ["qweight", "scales"] {
                        let name = draft_tensor_name(l, e, part, kind);
                        if !store.contains(&name) {
                            draft_missing = Some(name);
                            break 'find;
                        }
                    }
                }
            }
        }

        let mut layers = Vec::with_capacity(cfg.num_layers);
        let mut moe_index = 0;
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            let a = format!("{p}.self_attn");
            let attention = match &cfg.attention {
                AttentionKind::Standard {
                    qkv_bias,
                    o_bias,
                    qk_norm,
                    ..
                } => Attention::Standard {
                    q: loader.linear(&format!("{a}.q_proj"), *qkv_bias)?,
                    k: loader.linear(&format!("{a}.k_proj"), *qkv_bias)?,
                    v: loader.linear(&format!("{a}.v_proj"), *qkv_bias)?,
                    o: loader.linear(&format!("{a}.o_proj"), *o_bias)?,
                    q_norm: loader.opt(&format!("{a}.q_norm.weight"), *qk_norm != QkNorm::None)?,
                    k_norm: loader.opt(&format!("{a}.k_norm.weight"), *qk_norm != QkNorm::None)?,
                },
                AttentionKind::Mla {
                    q_lora_rank, bias, ..
                } => Attention::Mla {
                    q: match q_lora_rank {
                        None => MlaQuery::Full(loader.weight(&format!("{a}.q_proj.weight"))?),
                        Some(rank) => MlaQuery::Lora {
                            a: loader.linear(&format!("{a}.q_a_proj"), *bias)?,
                            norm: loader.weight(&format!("{a}.q_a_layernorm.weight"))?,
                            b: loader.weight(&format!("{a}.q_b_proj.weight"))?,
                            rank: *rank,
                        },
                    },
                    kv_a: loader.linear(&format!("{a}.kv_a_proj_with_mqa"), *bias)?,
                    kv_a_norm: loader.weight(&format!("{a}.kv_a_layernorm.weight"))?,
                    kv_b: loader.weight(&format!("{a}.kv_b_proj.weight"))?,
                    o: loader.linear(&format!("{a}.o_proj"), *bias)?,
                },
            };
            let mlp = if cfg.moe.is_moe[l] {
                let mut target = Vec::with_capacity(cfg.moe.num_experts);
                let mut draft = Vec::new();
                for e in 0..cfg.moe.num_experts {
                    target.push(backend.routed_expert(l, e, &mut || match widths.target {
                        None => loader.gated(
                            &expert_tensor_name(&cfg, l, e, Proj::Gate),
                            &expert_tensor_name(&cfg, l, e, Proj::Up),
                            &expert_tensor_name(&cfg, l, e, Proj::Down),
                        ),
                        Some(bits) => loader.quantized_expert(
                            |part, kind| target_tensor_name(l, e, part, kind),
                            Layout::target(bits.get()),
                            hidden,
                            inter,
                        ),
                    })?);
                    if draft_missing.is_none() {
                        draft.push(loader.quantized_expert(
                            |part, kind| draft_tensor_name(l, e, part, kind),
                            Layout::draft(widths.draft.get()),
                            hidden,
                            inter,
                        )?);
                    }
                }
                let shared = match cfg.moe.shared {
                    None => None,
                    Some(_) => {
                        let sp = shared_expert_prefix(&cfg, l);
                        Some(loader.gated(
                            &format!("{sp}.gate_proj.weight"),
                            &format!("{sp}.up_proj.weight"),
                            &format!("{sp}.down_proj.weight"),
                        )?)
                    }
                };
                let shared_gate = loader.opt(
                    &shared_expert_gate_name(&cfg, l),
                    cfg.moe.shared.is_some_and(|s| s.sigmoid_gate),
                )?;
                let block = MoeBlock {
                    moe_index,
                    router: loader.weight(&router_tensor_name(&cfg, l))?,
                    target,
                    draft,
                    shared,
                    shared_gate,
                };
                moe_index += 1;
                Mlp::Moe(Box::new(block))
            } else {
                Mlp::Dense(loader.gated(
                    &format!("{p}.mlp.gate_proj.weight"),
                    &format!("{p}.mlp.up_proj.weight"),
                    &format!("{p}.mlp.down_proj.weight"),
                )?)
            };
            layers.push(Layer {
                input_norm: loader.norm(&format!("{p}.input_layernorm"), cfg.norm)?,
                post_attention_norm: loader
                    .norm(&format!("{p}.post_attention_layernorm"), cfg.norm)?,
                attention,
                mlp,
            });
        }
        let embed = loader.weight("model.embed_tokens.weight")?;
        let final_norm = loader.norm("model.norm", cfg.norm)?;
        let lm_head = loader.opt("lm_head.weight", !cfg.tie_word_embeddings)?;
        let lm_head_bias = loader.opt("lm_head.bias", cfg.lm_head_bias)?;
        drop(loader);
        Ok(MoeModel {
            info,
            rope: rope_table(&cfg),
            attention_scale: attention_scale(&cfg),
            cfg,
            backend,
            embed,
            layers,
            final_norm,
            lm_head,
            lm_head_bias,
            draft_missing,
        })
    }

    pub fn config(&self) -> &ArchConfig {
        &self.cfg
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Whether the store held the draft's INT4 experts.
    pub fn has_draft(&self) -> bool {
        self.draft_missing.is_none()
    }

    fn norm(&self, x: &B::Act, n: &Norm<B>) -> Result<B::Act> {
        match &n.bias {
            Some(b) => self.backend.layer_norm(x, &n.weight, b, self.cfg.norm_eps),
            None => {
                let (_, cols) = self.backend.shape(x);
                self.backend.rms_norm(x, &n.weight, self.cfg.norm_eps, cols)
            }
        }
    }

    fn linear(&self, x: &B::Act, l: &Linear<B>) -> Result<B::Act> {
        self.backend.linear(x, &l.weight, l.bias.as_ref())
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        attn: &Attention<B>,
        h: &B::Act,
        projected: Option<(B::Act, B::Act)>,
        kv: &mut LayerKv<B>,
        start: usize,
        positions: &[usize],
        scales: &[f32],
    ) -> Result<B::Act> {
        let be = &self.backend;
        let rows = positions.len();
        let end = start + rows;
        let cfg = &self.cfg;
        match (attn, &cfg.attention, kv) {
            (
                Attention::Standard {
                    q,
                    k,
                    v,
                    o,
                    q_norm,
                    k_norm,
                },
                AttentionKind::Standard {
                    head_dim,
                    qk_norm,
                    clip_qkv,
                    ..
                },
                LayerKv::Standard {
                    k: k_cache,
                    v: v_cache,
                },
            ) => {
                let mut qs = self.linear(h, q)?;
                let mut ks = self.linear(h, k)?;
                let mut vs = self.linear(h, v)?;
                if let (Some(qn), Some(kn)) = (q_norm, k_norm) {
                    let (q_group, k_group) = match qk_norm {
                        QkNorm::PerHead => (*head_dim, *head_dim),
                        _ => (be.shape(&qs).1, be.shape(&ks).1),
                    };
                    qs = be.rms_norm(&qs, qn, cfg.norm_eps, q_group)?;
                    ks = be.rms_norm(&ks, kn, cfg.norm_eps, k_group)?;
                }
                if let Some(c) = clip_qkv {
                    be.clamp(&mut qs, *c)?;
                    be.clamp(&mut ks, *c)?;
                    be.clamp(&mut vs, *c)?;
                }
                let spec = |heads| RopeSpec {
                    heads,
                    head_stride: *head_dim,
                    offset: 0,
                    rot_dim: *head_dim,
                    style: cfg.rope.style,
                };
                be.rope(
                    &mut qs,
                    spec(cfg.num_heads),
                    &self.rope.inv_freq,
                    positions,
                    scales,
                )?;
                be.rope(
                    &mut ks,
                    spec(cfg.num_kv_heads),
                    &self.rope.inv_freq,
                    positions,
                    scales,
                )?;
                be.write_rows(k_cache, start, &ks)?;
                be.write_rows(v_cache, start, &vs)?;
                let out = be.attention(
                    &qs,
                    k_cache,
                    v_cache,
                    end,
                    AttentionSpec {
                        heads: cfg.num_heads,
                        kv_heads: cfg.num_kv_heads,
                        qk_dim: *head_dim,
                        v_dim: *head_dim,
                        scale: self.attention_scale,
                        start,
                        window: cfg.sliding_window,
                    },
                )?;
                self.linear(&out, o)
            }
            (
                Attention::Mla {
                    q,
                    kv_a,
                    kv_a_norm,
                    kv_b,
                    o,
                },
                AttentionKind::Mla {
                    kv_lora_rank,
                    qk_nope_head_dim,
                    qk_rope_head_dim,
                    v_head_dim,
                    ..
                },
                LayerKv::Mla { keys, values },
            ) => {
                let (nope, rope, vd) = (*qk_nope_head_dim, *qk_rope_head_dim, *v_head_dim);
                let q_spec = RopeSpec {
                    heads: cfg.num_heads,
                    head_stride: nope + rope,
                    offset: nope,
                    rot_dim: rope,
                    style: cfg.rope.style,
                };
                let (mut qs, compressed) = match (projected, q, &kv_a.bias) {
                    // Computed with the norm before (see `input_products`).
                    (Some(p), _, _) => p,
                    // No q_lora and no bias: both projections of `h` in one call.
                    (None, MlaQuery::Full(w), None) => be.linear_pair(h, w, &kv_a.weight)?,
                    (None, q, _) => (self.mla_query(q, h)?, self.linear(h, kv_a)?),
                };
                let k_spec = RopeSpec {
                    heads: 1,
                    head_stride: rope,
                    offset: 0,
                    rot_dim: rope,
                    style: cfg.rope.style,
                };
                let step = MlaAppend {
                    norm: kv_a_norm,
                    eps: MLA_LATENT_NORM_EPS,
                    rank: *kv_lora_rank,
                    k_rope: k_spec,
                    kv_b,
                    shape: MlaShape {
                        heads: cfg.num_heads,
                        nope,
                        v_dim: vd,
                    },
                    start,
                    q_rope: q_spec,
                    inv_freq: &self.rope.inv_freq,
                    positions,
                    scales,
                };
                be.mla_kv_append(&compressed, &step, keys, values, &mut qs)?;
                let out = be.attention(
                    &qs,
                    keys,
                    values,
                    end,
                    AttentionSpec {
                        heads: cfg.num_heads,
                        kv_heads: cfg.num_heads,
                        qk_dim: nope + rope,
                        v_dim: vd,
                        scale: self.attention_scale,
                        start,
                        window: None,
                    },
                )?;
                self.linear(&out, o)
            }
            _ => Err(Error::Backend(
                "attention weights and cache do not match the configuration".into(),
            )),
        }
    }

    /// The products of a layer's attention input that can run with the norm before them (the
    /// backend's `add_rms_norm_linear`): MLA's query and compressed projections, where the
    /// query has no q_lora, neither has a bias and the norm is an RMSNorm.
    fn input_products<'l>(&self, layer: &'l Layer<B>) -> Option<(&'l B::Weight, &'l B::Weight)> {
        match (&layer.attention, &layer.input_norm.bias) {
            (
                Attention::Mla {
                    q: MlaQuery::Full(w),
                    kv_a,
                    ..
                },
                None,
            ) if kv_a.bias.is_none() => Some((w, &kv_a.weight)),
            _ => None,
        }
    }

    /// MLA's query projection (with q_lora: down, norm, up).
    fn mla_query(&self, q: &MlaQuery<B>, h: &B::Act) -> Result<B::Act> {
        let be = &self.backend;
        match q {
            MlaQuery::Full(w) => be.linear(h, w, None),
            MlaQuery::Lora { a, norm, b, rank } => {
                let qa = self.linear(h, a)?;
                let qa = be.rms_norm(&qa, norm, MLA_LATENT_NORM_EPS, *rank)?;
                be.linear(&qa, b, None)
            }
        }
    }

    /// `x += y`, then the norm `n` of `x`: one call where the backend fuses them.
    fn add_norm(&self, x: &mut B::Act, y: &B::Act, n: &Norm<B>) -> Result<B::Act> {
        match &n.bias {
            Some(_) => {
                self.backend.add_assign(x, y)?;
                self.norm(x, n)
            }
            None => self
                .backend
                .add_rms_norm(x, y, &n.weight, self.cfg.norm_eps),
        }
    }

    /// The MoE block of `layer` over `h`, whose router logits `logits` the segment before it
    /// computed.
    fn moe(
        &self,
        block: &MoeBlock<B>,
        layer: usize,
        h: &B::Act,
        logits: B::Act,
        variant: Variant,
        hook: &mut dyn RouteHook,
    ) -> Result<B::Act> {
        let be = &self.backend;
        let experts = match variant {
            Variant::Target => &block.target,
            Variant::Draft => match &self.draft_missing {
                Some(name) => {
                    return Err(Error::Model(format!(
                        "draft forward: the weights have no draft tensor {name}"
                    )))
                }
                None => &block.draft,
            },
        };
        let moe = &self.cfg.moe;
        let spec = match moe.router {
            RouterKind::SoftmaxTopK => RouteSpec::SoftmaxTopK {
                top_k: moe.top_k,
                // transformers' DeepSeek-V2 router ignores norm_topk_prob.
                renormalize: moe.norm_topk_prob && self.cfg.model_type != ModelType::DeepseekV2,
                scale: moe.routed_scaling_factor,
            },
            RouterKind::SparseMixer { jitter_eps } => RouteSpec::SparseMixer { jitter_eps },
        };
        let on_device = hook.counts_routes_on_device(variant);
        if (hook.wants_routes() && !on_device) || hook.wants_moe_input() {
            let (routing, shared) =
                be.route_beside_shared(&logits, spec, h, block.shared.as_ref())?;
            hook.on_route(Route {
                variant,
                layer,
                moe_layer: block.moe_index,
                top_k: routing.top_k,
                topk: &routing.ids,
            });
            if hook.wants_moe_input() {
                let hidden = be.to_host(h)?;
                hook.on_moe_input(variant, block.moe_index, &hidden, &routing.ids);
            }
            let mut out = be.moe_experts(h, &routing, experts)?;
            if let Some(s) = shared {
                self.add_shared(&mut out, h, &s, block.shared_gate.as_ref())?;
            }
            return Ok(out);
        }
        let count_as = on_device.then_some(block.moe_index);
        match (&block.shared, &block.shared_gate) {
            // The shared experts run with the routed ones, added in their combine.
            (Some(mlp), None) => be.routed_moe_shared(h, &logits, spec, experts, count_as, mlp),
            (Some(mlp), Some(gate)) => {
                let mut out = be.routed_moe(h, &logits, spec, experts, false, count_as)?.0;
                self.add_shared_mlp(&mut out, h, mlp, Some(gate))?;
                Ok(out)
            }
            (None, _) => Ok(be.routed_moe(h, &logits, spec, experts, false, count_as)?.0),
        }
    }

    /// `out += shared(h)`, or `out += sigmoid(gate . h) * shared(h)` for a gated shared expert.
    fn add_shared_mlp(
        &self,
        out: &mut B::Act,
        h: &B::Act,
        mlp: &GatedMlp<B>,
        gate: Option<&B::Weight>,
    ) -> Result<()> {
        let s = self.backend.gated_mlp(h, mlp)?;
        self.add_shared(out, h, &s, gate)
    }

    /// `out += s`, or `out += sigmoid(gate . h) * s` for a gated shared expert, where `s` is the
    /// shared MLP's output over `h`.
    fn add_shared(
        &self,
        out: &mut B::Act,
        h: &B::Act,
        s: &B::Act,
        gate: Option<&B::Weight>,
    ) -> Result<()> {
        let be = &self.backend;
        match gate {
            Some(g) => {
                let g = be.linear(h, g, None)?;
                be.add_sigmoid_gated(out, s, &g)
            }
            None => be.add_assign(out, s),
        }
    }
}

impl<B: Backend> LanguageModel for MoeModel<B> {
    type Kv = MoeKv<B>;

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_kv(&self, capacity: usize) -> Result<MoeKv<B>> {
        if capacity == 0 || capacity > self.info.max_context {
            return Err(Error::Request(format!(
                "KV capacity {capacity} must be in 1..={} (the model's max context)",
                self.info.max_context
            )));
        }
        let be = &self.backend;
        let cfg = &self.cfg;
        let layers = (0..cfg.num_layers)
            .map(|_| {
                Ok(match &cfg.attention {
                    AttentionKind::Standard { head_dim, .. } => LayerKv::Standard {
                        k: be.zeros(capacity, cfg.num_kv_heads * head_dim)?,
                        v: be.zeros(capacity, cfg.num_kv_heads * head_dim)?,
                    },
                    AttentionKind::Mla {
                        qk_nope_head_dim,
                        qk_rope_head_dim,
                        v_head_dim,
                        ..
                    } => LayerKv::Mla {
                        keys: be.zeros(
                            capacity,
                            cfg.num_heads * (qk_nope_head_dim + qk_rope_head_dim),
                        )?,
                        values: be.zeros(capacity, cfg.num_heads * v_head_dim)?,
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let storage = layers
            .iter()
            .flat_map(|l| match l {
                LayerKv::Standard { k, v } => [k, v],
                LayerKv::Mla { keys, values } => [keys, values],
            })
            .fold(capacity as u64, |h, a| mix(h, be.storage_id(a)));
        Ok(MoeKv {
            len: 0,
            capacity,
            layers,
            storage,
        })
    }

    fn forward(
        &self,
        variant: Variant,
        tokens: &[u32],
        kv: &mut MoeKv<B>,
        hook: &mut dyn RouteHook,
    ) -> Result<Vec<f32>> {
        let logits = self.run(variant, tokens, kv, hook)?;
        self.backend.to_host(&logits)
    }

    fn prefill(
        &self,
        variant: Variant,
        tokens: &[u32],
        kv: &mut MoeKv<B>,
        hook: &mut dyn RouteHook,
    ) -> Result<Vec<f32>> {
        let logits = self.run_prompt(variant, tokens, kv, hook)?;
        self.backend.to_host(&logits)
    }

    fn prefill_greedy(
        &self,
        variant: Variant,
        tokens: &[u32],
        kv: &mut MoeKv<B>,
        hook: &mut dyn RouteHook,
    ) -> Result<Vec<u32>> {
        let logits = self.run_prompt(variant, tokens, kv, hook)?;
        self.backend.argmax(&logits)
    }

    /// The choice is made where the logits are (the backend's `argmax`): a GPU returns one id a
    /// row instead of the whole row of logits.
    fn forward_greedy(
        &self,
        variant: Variant,
        tokens: &[u32],
        kv: &mut MoeKv<B>,
        hook: &mut dyn RouteHook,
    ) -> Result<Vec<u32>> {
        let logits = self.run(variant, tokens, kv, hook)?;
        self.backend.argmax(&logits)
    }

    /// Where the backend feeds greedy choices on the device ([`Backend::feed_choice`]) and a
    /// pass is recorded, the next pass is queued before the host has the choice it runs from:
    /// the device goes from one pass to the next without waiting for the host. The choices are
    /// the backend's argmax either way.
    fn forward_greedy_chain(
        &self,
        variant: Variant,
        token: u32,
        kv: &mut MoeKv<B>,
        hook: &mut dyn RouteHook,
        steps: usize,
        accept: &mut dyn FnMut(u32) -> bool,
    ) -> Result<()> {
        if steps == 0 {
            return Ok(());
        }
        let be = &self.backend;
        let logits = self.run(variant, &[token], kv, hook)?;
        if !be.feed_choice(&logits)? {
            let mut id = crate::model::one_choice(be.argmax(&logits)?)?;
            for taken in 1..=steps {
                if !accept(id) || taken == steps {
                    break;
                }
                id = crate::model::one_choice(self.forward_greedy(variant, &[id], kv, hook)?)?;
            }
            return Ok(());
        }
        let chained = self.chain_fed(variant, kv, hook, steps, accept);
        if chained.is_err() {
            // The error is the one to report; the queue is only cleared for the next chain.
            let _ = be.drop_fed_choices();
        }
        chained
    }
}

/// One step of a 64-bit hash (FNV-style multiply, then xor-shift), for keys.
fn mix(h: u64, v: u64) -> u64 {
    let h = (h ^ v).wrapping_mul(0x0000_0100_0000_01b3);
    h ^ (h >> 29)
}
