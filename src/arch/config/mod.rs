//! A normalized view of a Hugging Face `config.json` for every supported architecture.
//!
//! Defaults are the ones of the transformers configuration classes (5.17), so a field missing from
//! config.json means what it means to transformers. Where transformers' modeling code ignores a
//! field (e.g. DeepSeek-V2's `moe_layer_freq`), it is ignored here too.

use serde_json::{Map, Value};

use super::SUPPORTED_MODEL_TYPES;
use crate::model::ModelInfo;
use crate::{Error, Result};

/// The architectures this crate runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModelType {
    DeepseekV2,
    Qwen2Moe,
    Phimoe,
    Mixtral,
    Olmoe,
    Qwen3Moe,
}

impl ModelType {
    /// The Hugging Face `model_type` string.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelType::DeepseekV2 => "deepseek_v2",
            ModelType::Qwen2Moe => "qwen2_moe",
            ModelType::Phimoe => "phimoe",
            ModelType::Mixtral => "mixtral",
            ModelType::Olmoe => "olmoe",
            ModelType::Qwen3Moe => "qwen3_moe",
        }
    }

    fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "deepseek_v2" => ModelType::DeepseekV2,
            "qwen2_moe" => ModelType::Qwen2Moe,
            "phimoe" => ModelType::Phimoe,
            "mixtral" => ModelType::Mixtral,
            "olmoe" => ModelType::Olmoe,
            "qwen3_moe" => ModelType::Qwen3Moe,
            other => {
                return Err(Error::Model(format!(
                    "config.json: unsupported model_type {other:?}; supported: {}",
                    SUPPORTED_MODEL_TYPES.join(", ")
                )))
            }
        })
    }
}

/// How a router turns logits into top-k expert ids and weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RouterKind {
    /// Softmax over all experts, top-k of the probabilities, then optionally renormalized to sum to
    /// one (`norm_topk_prob`) and multiplied by `routed_scaling_factor`. Mixtral's "top-k then
    /// softmax" is this with renormalization, which is how transformers computes it.
    SoftmaxTopK,
    /// PhiMoE's SparseMixer top-2 as evaluated at inference: each pick is the arg-max of the
    /// remaining logits, weighted by a softmax over the logits within `2 * jitter_eps` (relative)
    /// of it.
    SparseMixer { jitter_eps: f32 },
}

/// Shared experts that every token runs besides its routed ones.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SharedExperts {
    /// Intermediate width of the (fused) shared MLP.
    pub intermediate_size: usize,
    /// Qwen2-MoE: the shared output is scaled by `sigmoid(shared_expert_gate(x))`.
    pub sigmoid_gate: bool,
}

/// The mixture-of-experts part of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    /// Intermediate width of one routed expert.
    pub intermediate_size: usize,
    /// `is_moe[l]`: decoder layer `l` has routed experts (otherwise a dense MLP).
    pub is_moe: Vec<bool>,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    pub router: RouterKind,
    pub shared: Option<SharedExperts>,
}

/// Normalization applied to query/key projections (before RoPE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// OLMoE: RMSNorm over the whole projection (all heads together).
    Full,
    /// Qwen3-MoE: RMSNorm over each head separately.
    PerHead,
}

/// The attention block.
#[derive(Clone, Debug, PartialEq)]
pub enum AttentionKind {
    /// Multi-head / grouped-query attention with separate q, k, v, o projections.
    Standard {
        head_dim: usize,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: QkNorm,
        /// OLMoE's `clip_qkv`: q, k and v are clamped to `[-c, c]`.
        clip_qkv: Option<f32>,
    },
    /// DeepSeek-V2's multi-head latent attention.
    Mla {
        /// Low-rank query compression (`q_a_proj`, `q_a_layernorm`, `q_b_proj`); `None`: `q_proj`.
        q_lora_rank: Option<usize>,
        kv_lora_rank: usize,
        qk_nope_head_dim: usize,
        qk_rope_head_dim: usize,
        v_head_dim: usize,
        /// `attention_bias`: bias on `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj`.
        bias: bool,
    },
}

/// Normalization layers of the decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    RmsNorm,
    /// With weight and bias (PhiMoE).
    LayerNorm,
}

/// How RoPE rotates a head's channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Channel `i` pairs with `i + d/2` (`rotate_half`).
    Half,
    /// Channel `2i` pairs with `2i + 1` (DeepSeek-V2's complex multiplication).
    Interleaved,
}

/// RoPE scaling (`rope_parameters` / `rope_scaling`).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        attention_factor: Option<f64>,
        beta_fast: f64,
        beta_slow: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        truncate: bool,
    },
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        factor: Option<f64>,
        original_max_position_embeddings: usize,
        attention_factor: Option<f64>,
        short_mscale: Option<f64>,
        long_mscale: Option<f64>,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub partial_rotary_factor: f64,
    pub style: RopeStyle,
    pub scaling: RopeScaling,
}

/// A normalized config.json.
#[derive(Clone, Debug, PartialEq)]
pub struct ArchConfig {
    pub model_type: ModelType,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    /// Width of the dense MLPs (layers without routed experts).
    pub intermediate_size: usize,
    pub moe: MoeConfig,
    pub attention: AttentionKind,
    pub norm: NormKind,
    pub norm_eps: f32,
    pub rope: RopeConfig,
    /// Keys at or before `query_pos - window` are masked.
    pub sliding_window: Option<usize>,
    pub tie_word_embeddings: bool,
    pub lm_head_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub max_position_embeddings: usize,
}

/// Typed access to config.json fields, naming the field on error.
struct Fields<'a> {
    map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    /// The value, with JSON `null` treated as absent (transformers does the same for `None`).
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| invalid(key, v, "a non-negative integer")),
        }
    }

    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        Ok(self.opt_usize(key)?.unwrap_or(default))
    }

    /// A field transformers also accepts under another name (`attribute_map`).
    fn usize_alias_or(&self, key: &str, alias: &str, default: usize) -> Result<usize> {
        match self.opt_usize(key)? {
            Some(v) => Ok(v),
            None => self.usize_or(alias, default),
        }
    }

    fn req_usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| Error::Model(format!("config.json: missing field {key:?}")))
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| invalid(key, v, "a number")),
        }
    }

    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        Ok(self.opt_f64(key)?.unwrap_or(default))
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| invalid(key, v, "a boolean")),
        }
    }

    fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| invalid(key, v, "a string")),
        }
    }

    fn usize_list(&self, key: &str) -> Result<Vec<usize>> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|n| usize::try_from(n).ok())
                        .ok_or_else(|| invalid(key, v, "a list of non-negative integers"))
                })
                .collect(),
            Some(v) => Err(invalid(key, v, "a list of non-negative integers")),
        }
    }

    fn f64_list(&self, key: &str) -> Result<Vec<f64>> {
        match self.get(key) {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_f64()
                        .ok_or_else(|| invalid(key, v, "a list of numbers"))
                })
                .collect(),
            Some(v) => Err(invalid(key, v, "a list of numbers")),
            None => Err(Error::Model(format!("config.json: missing field {key:?}"))),
        }
    }

    /// A token id, or a list of them (`eos_token_id`).
    fn token_ids(&self, key: &str) -> Result<Vec<u32>> {
        let one = |v: &Value| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| invalid(key, v, "a token id or a list of token ids"))
        };
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items.iter().map(one).collect(),
            Some(v) => Ok(vec![one(v)?]),
        }
    }
}

fn invalid(key: &str, v: &Value, expected: &str) -> Error {
    Error::Model(format!(
        "config.json: field {key:?} is {v}, expected {expected}"
    ))
}

fn positive(key: &str, v: usize) -> Result<usize> {
    if v == 0 {
        return Err(Error::Model(format!(
            "config.json: field {key:?} must be positive"
        )));
    }
    Ok(v)
}

impl ArchConfig {
    /// Parses config.json. An unknown `model_type` is an error listing the supported ones; a
    /// missing or ill-typed field is an error naming it.
    pub fn from_config_json(text: &str) -> Result<Self> {
        let root: Value = serde_json::from_str(text)
            .map_err(|e| Error::Model(format!("config.json: not valid JSON: {e}")))?;
        let map = root
            .as_object()
            .ok_or_else(|| Error::Model("config.json: top level is not an object".into()))?;
        let f = Fields { map };
        let model_type =
            ModelType::parse(f.opt_str("model_type")?.ok_or_else(|| {
                Error::Model("config.json: missing field \"model_type\"".into())
            })?)?;
        use ModelType as M;

        // Defaults of each transformers config class.
        let (d_vocab, d_hidden, d_inter, d_layers, d_heads, d_max_pos, d_eps, d_theta) =
            match model_type {
                M::DeepseekV2 => (102400, 4096, 11008, 32, 32, 2048, 1e-6, 10_000.0),
                M::Qwen2Moe => (151936, 2048, 5632, 24, 16, 32768, 1e-6, 10_000.0),
                M::Phimoe => (32064, 4096, 6400, 32, 32, 4096 * 32, 1e-5, 1_000_000.0),
                M::Mixtral => (32000, 4096, 14336, 32, 32, 4096 * 32, 1e-5, 1_000_000.0),
                M::Olmoe => (50304, 2048, 2048, 16, 16, 4096, 1e-5, 10_000.0),
                M::Qwen3Moe => (151936, 2048, 6144, 24, 32, 32768, 1e-6, 10_000.0),
            };
        let vocab_size = positive("vocab_size", f.usize_or("vocab_size", d_vocab)?)?;
        let hidden_size = positive("hidden_size", f.usize_or("hidden_size", d_hidden)?)?;
        let intermediate_size = f.usize_or("intermediate_size", d_inter)?;
        let num_layers = positive(
            "num_hidden_layers",
            f.usize_or("num_hidden_layers", d_layers)?,
        )?;
        let num_heads = positive(
            "num_attention_heads",
            f.usize_or("num_attention_heads", d_heads)?,
        )?;
        let d_kv_heads = match model_type {
            M::Qwen2Moe => 16,
            M::Phimoe | M::Mixtral => 8,
            M::Qwen3Moe => 4,
            M::DeepseekV2 | M::Olmoe => num_heads,
        };
        let num_kv_heads = positive(
            "num_key_value_heads",
            f.usize_or("num_key_value_heads", d_kv_heads)?,
        )?;
        if !num_heads.is_multiple_of(num_kv_heads) {
            return Err(Error::Model(format!(
                "config.json: num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})"
            )));
        }
        let max_position_embeddings = positive(
            "max_position_embeddings",
            f.usize_or("max_position_embeddings", d_max_pos)?,
        )?;
        let norm_eps = f.f64_or("rms_norm_eps", d_eps)? as f32;
        let hidden_act = f.opt_str("hidden_act")?.unwrap_or("silu");
        if hidden_act != "silu" {
            return Err(Error::Model(format!(
                "config.json: field \"hidden_act\" is {hidden_act:?}; only \"silu\" is supported"
            )));
        }

        let (d_bos, d_eos): (Option<u32>, Vec<u32>) = match model_type {
            M::DeepseekV2 | M::Phimoe | M::Mixtral => (Some(1), vec![2]),
            M::Olmoe => (None, vec![50279]),
            M::Qwen2Moe | M::Qwen3Moe => (None, Vec::new()),
        };
        let bos_token_id = match f.get("bos_token_id") {
            Some(_) => f.token_ids("bos_token_id")?.first().copied(),
            None if map.contains_key("bos_token_id") => None,
            None => d_bos,
        };
        let eos_token_ids = if map.contains_key("eos_token_id") {
            f.token_ids("eos_token_id")?
        } else {
            d_eos
        };

        // Attention.
        let default_head_dim = hidden_size / num_heads;
        let attention = match model_type {
            M::DeepseekV2 => {
                if f.bool_or("mlp_bias", false)? {
                    return Err(Error::Model(
                        "config.json: field \"mlp_bias\" = true is not supported".into(),
                    ));
                }
                AttentionKind::Mla {
                    q_lora_rank: match f.get("q_lora_rank") {
                        Some(_) => Some(positive("q_lora_rank", f.req_usize("q_lora_rank")?)?),
                        None if map.contains_key("q_lora_rank") => None,
                        None => Some(1536),
                    },
                    kv_lora_rank: positive("kv_lora_rank", f.usize_or("kv_lora_rank", 512)?)?,
                    qk_nope_head_dim: f.usize_or("qk_nope_head_dim", 128)?,
                    qk_rope_head_dim: positive(
                        "qk_rope_head_dim",
                        f.usize_or("qk_rope_head_dim", 64)?,
                    )?,
                    v_head_dim: positive("v_head_dim", f.usize_or("v_head_dim", 128)?)?,
                    bias: f.bool_or("attention_bias", false)?,
                }
            }
            M::Qwen2Moe => AttentionKind::Standard {
                head_dim: positive("head_dim", f.usize_or("head_dim", default_head_dim)?)?,
                qkv_bias: f.bool_or("qkv_bias", true)?,
                o_bias: false,
                qk_norm: QkNorm::None,
                clip_qkv: None,
            },
            M::Phimoe | M::Mixtral => {
                let bias = model_type == M::Phimoe && f.bool_or("attention_bias", false)?;
                AttentionKind::Standard {
                    head_dim: positive("head_dim", f.usize_or("head_dim", default_head_dim)?)?,
                    qkv_bias: bias,
                    o_bias: bias,
                    qk_norm: QkNorm::None,
                    clip_qkv: None,
                }
            }
            M::Olmoe => {
                let bias = f.bool_or("attention_bias", false)?;
                AttentionKind::Standard {
                    head_dim: positive("head_dim", f.usize_or("head_dim", default_head_dim)?)?,
                    qkv_bias: bias,
                    o_bias: bias,
                    qk_norm: QkNorm::Full,
                    clip_qkv: f.opt_f64("clip_qkv")?.map(|c| c as f32),
                }
            }
            M::Qwen3Moe => {
                let bias = f.bool_or("attention_bias", false)?;
                AttentionKind::Standard {
                    head_dim: positive("head_dim", f.usize_or("head_dim", default_head_dim)?)?,
                    qkv_bias: bias,
                    o_bias: bias,
                    qk_norm: QkNorm::PerHead,
                    clip_qkv: None,
                }
            }
        };

        // Mixture of experts.
        let moe = parse_moe(&f, model_type, num_layers, intermediate_size)?;

        // Sliding window, as each model's mask function applies it.
        let sliding_window = match model_type {
            M::Mixtral | M::Phimoe => f.opt_usize("sliding_window")?,
            M::Qwen3Moe => {
                if f.bool_or("use_sliding_window", false)? {
                    Some(f.usize_or("sliding_window", 4096)?)
                } else {
                    None
                }
            }
            M::Qwen2Moe => {
                if f.bool_or("use_sliding_window", false)? {
                    return Err(Error::Model(
                        "config.json: field \"use_sliding_window\" = true (per-layer sliding attention) is not supported for qwen2_moe"
                            .into(),
                    ));
                }
                None
            }
            M::DeepseekV2 | M::Olmoe => None,
        };
        if sliding_window == Some(0) {
            return Err(Error::Model(
                "config.json: field \"sliding_window\" must be positive".into(),
            ));
        }

        let rope = parse_rope(&f, model_type, d_theta, max_position_embeddings)?;

        let cfg = ArchConfig {
            model_type,
            vocab_size,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            intermediate_size,
            moe,
            attention,
            norm: if model_type == M::Phimoe {
                NormKind::LayerNorm
            } else {
                NormKind::RmsNorm
            },
            norm_eps,
            rope,
            sliding_window,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            lm_head_bias: model_type == M::Phimoe && f.bool_or("lm_head_bias", false)?,
            bos_token_id,
            eos_token_ids,
            max_position_embeddings,
        };
        cfg.validate_rope_dims()?;
        Ok(cfg)
    }

    fn validate_rope_dims(&self) -> Result<()> {
        let dim = self.rope_dim();
        if dim == 0 || !dim.is_multiple_of(2) {
            return Err(Error::Model(format!(
                "config.json: rotary dimension {dim} must be even and positive"
            )));
        }
        if let RopeScaling::LongRope {
            short_factor,
            long_factor,
            ..
        } = &self.rope.scaling
        {
            for (name, v) in [("short_factor", short_factor), ("long_factor", long_factor)] {
                if v.len() != dim / 2 {
                    return Err(Error::Model(format!(
                        "config.json: rope {name} has {} entries, expected {} (rotary dim / 2)",
                        v.len(),
                        dim / 2
                    )));
                }
            }
        }
        Ok(())
    }

    /// Width of the rotated part of a query/key head.
    pub fn rope_dim(&self) -> usize {
        match &self.attention {
            AttentionKind::Standard { head_dim, .. } => *head_dim,
            AttentionKind::Mla {
                qk_rope_head_dim, ..
            } => *qk_rope_head_dim,
        }
    }

    /// Decoder layer index of every MoE layer, in order.
    pub fn moe_layers(&self) -> Vec<usize> {
        self.moe
            .is_moe
            .iter()
            .enumerate()
            .filter(|(_, m)| **m)
            .map(|(l, _)| l)
            .collect()
    }

    /// `(hidden, moe intermediate)`: a routed expert's gate/up are `[inter, hidden]`, down is
    /// `[hidden, inter]`.
    pub fn expert_dims(&self) -> (usize, usize) {
        (self.hidden_size, self.moe.intermediate_size)
    }

    /// Facts the decode loop and the planner need.
    pub fn model_info(&self) -> ModelInfo {
        let (hidden, inter) = self.expert_dims();
        ModelInfo {
            architecture: self.model_type.as_str().to_string(),
            vocab_size: self.vocab_size,
            max_context: self.max_position_embeddings,
            num_layers: self.num_layers,
            moe_layers: self.moe_layers(),
            num_experts: self.moe.num_experts,
            top_k: self.moe.top_k,
            expert_bytes: 3 * hidden * inter * 2,
            bos_token_id: self.bos_token_id,
            eos_token_ids: self.eos_token_ids.clone(),
        }
    }
}

fn parse_moe(
    f: &Fields<'_>,
    model_type: ModelType,
    num_layers: usize,
    intermediate_size: usize,
) -> Result<MoeConfig> {
    use ModelType as M;
    let (num_experts, top_k, moe_inter, norm_topk_prob, scaling, router, shared, is_moe) =
        match model_type {
            M::DeepseekV2 => {
                let n = f.usize_alias_or("n_routed_experts", "num_experts", 64)?;
                let top_k = f.req_usize("num_experts_per_tok")?;
                let inter = f.usize_or("moe_intermediate_size", 1407)?;
                let n_shared = f.usize_or("n_shared_experts", 2)?;
                let topk_method = f.opt_str("topk_method")?.unwrap_or("greedy");
                if topk_method != "greedy" {
                    return Err(Error::Model(format!(
                    "config.json: field \"topk_method\" is {topk_method:?}; only \"greedy\" is supported"
                )));
                }
                let first_dense = f.usize_or("first_k_dense_replace", 0)?;
                let shared = (n_shared > 0).then_some(SharedExperts {
                    intermediate_size: inter * n_shared,
                    sigmoid_gate: false,
                });
                (
                    n,
                    top_k,
                    inter,
                    f.bool_or("norm_topk_prob", false)?,
                    f.f64_or("routed_scaling_factor", 1.0)? as f32,
                    RouterKind::SoftmaxTopK,
                    shared,
                    (0..num_layers)
                        .map(|l| l >= first_dense)
                        .collect::<Vec<_>>(),
                )
            }
            M::Qwen2Moe | M::Qwen3Moe => {
                let qwen2 = model_type == M::Qwen2Moe;
                let n = if qwen2 {
                    f.usize_or("num_experts", 60)?
                } else {
                    f.usize_alias_or("num_local_experts", "num_experts", 128)?
                };
                let top_k = f.usize_or("num_experts_per_tok", if qwen2 { 4 } else { 8 })?;
                let inter = f.usize_or("moe_intermediate_size", if qwen2 { 1408 } else { 768 })?;
                let step = positive("decoder_sparse_step", f.usize_or("decoder_sparse_step", 1)?)?;
                let mlp_only = f.usize_list("mlp_only_layers")?;
                let shared = if qwen2 {
                    let si = f.usize_or("shared_expert_intermediate_size", 5632)?;
                    // A zero-width shared expert contributes nothing; checkpoints omit it.
                    (si > 0).then_some(SharedExperts {
                        intermediate_size: si,
                        sigmoid_gate: true,
                    })
                } else {
                    None
                };
                (
                    n,
                    top_k,
                    inter,
                    f.bool_or("norm_topk_prob", false)?,
                    1.0,
                    RouterKind::SoftmaxTopK,
                    shared,
                    (0..num_layers)
                        .map(|l| !mlp_only.contains(&l) && n > 0 && (l + 1) % step == 0)
                        .collect(),
                )
            }
            M::Mixtral => (
                f.usize_alias_or("num_local_experts", "num_experts", 8)?,
                f.usize_or("num_experts_per_tok", 2)?,
                intermediate_size,
                true,
                1.0,
                RouterKind::SoftmaxTopK,
                None,
                vec![true; num_layers],
            ),
            M::Phimoe => {
                let top_k = f.usize_or("num_experts_per_tok", 2)?;
                if top_k != 2 {
                    return Err(Error::Model(format!(
                    "config.json: field \"num_experts_per_tok\" is {top_k}; PhiMoE's SparseMixer routes exactly 2"
                )));
                }
                (
                    f.usize_or("num_local_experts", 16)?,
                    top_k,
                    intermediate_size,
                    false,
                    1.0,
                    RouterKind::SparseMixer {
                        jitter_eps: f.f64_or("router_jitter_noise", 0.01)? as f32,
                    },
                    None,
                    vec![true; num_layers],
                )
            }
            M::Olmoe => (
                f.usize_alias_or("num_experts", "num_local_experts", 64)?,
                f.usize_or("num_experts_per_tok", 8)?,
                intermediate_size,
                f.bool_or("norm_topk_prob", false)?,
                1.0,
                RouterKind::SoftmaxTopK,
                None,
                vec![true; num_layers],
            ),
        };
    if is_moe.iter().any(|m| *m) {
        if num_experts == 0 || top_k == 0 || top_k > num_experts {
            return Err(Error::Model(format!(
                "config.json: num_experts_per_tok ({top_k}) must be in 1..=number of experts ({num_experts})"
            )));
        }
        if moe_inter == 0 {
            return Err(Error::Model(
                "config.json: the routed experts' intermediate size is 0".into(),
            ));
        }
    }
    Ok(MoeConfig {
        num_experts,
        top_k,
        intermediate_size: moe_inter,
        is_moe,
        norm_topk_prob,
        routed_scaling_factor: scaling,
        router,
        shared,
    })
}

/// RoPE parameters, standardized the way transformers does: `rope_scaling` (legacy) or
/// `rope_parameters`, `rope_theta` from the dict, the top level, or the class default;
/// `original_max_position_embeddings` from the top level first (Phi-3 style), then the dict, then
/// `max_position_embeddings`.
fn parse_rope(
    f: &Fields<'_>,
    model_type: ModelType,
    default_theta: f64,
    max_pos: usize,
) -> Result<RopeConfig> {
    let empty = Map::new();
    let params = match f.get("rope_scaling").or_else(|| f.get("rope_parameters")) {
        None => &empty,
        Some(Value::Object(m)) => m,
        Some(v) => return Err(invalid("rope_parameters", v, "an object")),
    };
    let p = Fields { map: params };
    let theta = match p.opt_f64("rope_theta")? {
        Some(t) => t,
        None => f.f64_or("rope_theta", default_theta)?,
    };
    let partial_rotary_factor = match p.opt_f64("partial_rotary_factor")? {
        Some(v) => v,
        None => f.f64_or("partial_rotary_factor", 1.0)?,
    };
    if partial_rotary_factor != 1.0 {
        return Err(Error::Model(format!(
            "config.json: partial_rotary_factor {partial_rotary_factor} is not supported by {}",
            model_type.as_str()
        )));
    }
    let rope_type = match p.opt_str("rope_type")? {
        Some(t) => t,
        None => p.opt_str("type")?.unwrap_or("default"),
    };
    let original_max = || -> Result<usize> {
        if let Some(v) = f.opt_usize("original_max_position_embeddings")? {
            return Ok(v);
        }
        Ok(p.opt_usize("original_max_position_embeddings")?
            .unwrap_or(max_pos))
    };
    let scaling = match rope_type {
        "default" => RopeScaling::None,
        "yarn" => {
            let original = positive("rope_parameters.original_max_position_embeddings", original_max()?)?;
            let factor = match p.opt_f64("factor")? {
                Some(v) => v,
                None => max_pos as f64 / original as f64,
            };
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original,
                attention_factor: p.opt_f64("attention_factor")?,
                // transformers: `get("beta_fast") or 32`, so 0 also means the default.
                beta_fast: p.opt_f64("beta_fast")?.filter(|v| *v != 0.0).unwrap_or(32.0),
                beta_slow: p.opt_f64("beta_slow")?.filter(|v| *v != 0.0).unwrap_or(1.0),
                mscale: p.opt_f64("mscale")?,
                mscale_all_dim: p.opt_f64("mscale_all_dim")?,
                truncate: p.bool_or("truncate", true)?,
            }
        }
        "longrope" if model_type != ModelType::Phimoe => {
            return Err(Error::Model(format!(
                "config.json: rope type \"longrope\" is only supported for phimoe, not {}",
                model_type.as_str()
            )))
        }
        "longrope" => {
            let original = positive("rope_parameters.original_max_position_embeddings", original_max()?)?;
            let short_mscale = p.opt_f64("short_mscale")?;
            let long_mscale = p.opt_f64("long_mscale")?;
            if model_type == ModelType::Phimoe && (short_mscale.is_none() || long_mscale.is_none()) {
                return Err(Error::Model(
                    "config.json: phimoe longrope needs numeric rope short_mscale and long_mscale".into(),
                ));
            }
            RopeScaling::LongRope {
                short_factor: p.f64_list("short_factor").map_err(|e| rope_field(e, "short_factor"))?,
                long_factor: p.f64_list("long_factor").map_err(|e| rope_field(e, "long_factor"))?,
                factor: p.opt_f64("factor")?,
                original_max_position_embeddings: original,
                attention_factor: p.opt_f64("attention_factor")?,
                short_mscale,
                long_mscale,
            }
        }
        other => {
            return Err(Error::Model(format!(
                "config.json: rope type {other:?} is not supported (supported: default, yarn, longrope)"
            )))
        }
    };
    if theta.is_nan() || theta <= 0.0 {
        return Err(Error::Model(format!(
            "config.json: rope_theta {theta} must be positive"
        )));
    }
    Ok(RopeConfig {
        theta,
        partial_rotary_factor,
        style: if model_type == ModelType::DeepseekV2 {
            RopeStyle::Interleaved
        } else {
            RopeStyle::Half
        },
        scaling,
    })
}

fn rope_field(e: Error, name: &str) -> Error {
    match e {
        Error::Model(m) => Error::Model(format!("{m} (rope parameter {name})")),
        other => other,
    }
}

#[cfg(test)]
mod tests;
