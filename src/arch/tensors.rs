//! Tensor names and shapes of each architecture's Hugging Face checkpoint.
//!
//! The name patterns live here, in code, next to the forward pass that reads them.

use super::config::{ArchConfig, AttentionKind, ModelType, NormKind, QkNorm};
use super::{Proj, TensorRole, TensorSpec};

/// Prefix of a layer's MoE block (router, experts, shared experts).
fn moe_prefix(cfg: &ArchConfig, layer: usize) -> String {
    match cfg.model_type {
        ModelType::Mixtral | ModelType::Phimoe => format!("model.layers.{layer}.block_sparse_moe"),
        _ => format!("model.layers.{layer}.mlp"),
    }
}

/// The checkpoint name of a routed expert's projection weight.
pub fn expert_tensor_name(cfg: &ArchConfig, layer: usize, expert: usize, proj: Proj) -> String {
    let prefix = moe_prefix(cfg, layer);
    match cfg.model_type {
        ModelType::Mixtral | ModelType::Phimoe => {
            let w = match proj {
                Proj::Gate => "w1",
                Proj::Down => "w2",
                Proj::Up => "w3",
            };
            format!("{prefix}.experts.{expert}.{w}.weight")
        }
        _ => {
            let p = match proj {
                Proj::Gate => "gate_proj",
                Proj::Up => "up_proj",
                Proj::Down => "down_proj",
            };
            format!("{prefix}.experts.{expert}.{p}.weight")
        }
    }
}

/// The name of a draft (quantized) expert tensor: `part` is `"gate_up"` or `"down"`, `kind` is
/// `"qweight"` or `"scales"`.
pub fn draft_tensor_name(layer: usize, expert: usize, part: &str, kind: &str) -> String {
    format!("draft.layers.{layer}.experts.{expert}.{part}.{kind}")
}

/// The name of a quantized (INT8 or INT4) target expert tensor, as [`draft_tensor_name`] names
/// the draft's. An FP16 target keeps the checkpoint's names ([`expert_tensor_name`]).
pub fn target_tensor_name(layer: usize, expert: usize, part: &str, kind: &str) -> String {
    format!("target.layers.{layer}.experts.{expert}.{part}.{kind}")
}

/// The router weight (`[num_experts, hidden]`) of an MoE layer.
pub fn router_tensor_name(cfg: &ArchConfig, layer: usize) -> String {
    format!("{}.gate.weight", moe_prefix(cfg, layer))
}

/// Prefix of the shared expert(s) MLP of an MoE layer (`.gate_proj.weight` etc. follow).
pub fn shared_expert_prefix(cfg: &ArchConfig, layer: usize) -> String {
    match cfg.model_type {
        ModelType::DeepseekV2 => format!("{}.shared_experts", moe_prefix(cfg, layer)),
        _ => format!("{}.shared_expert", moe_prefix(cfg, layer)),
    }
}

/// The sigmoid gate of Qwen2-MoE's shared expert (`[1, hidden]`).
pub fn shared_expert_gate_name(cfg: &ArchConfig, layer: usize) -> String {
    format!("{}.shared_expert_gate.weight", moe_prefix(cfg, layer))
}

/// Every tensor the checkpoint holds, with shape (`[out, in]` for linear weights) and role.
pub fn expected_tensors(cfg: &ArchConfig) -> Vec<TensorSpec> {
    let mut out = Vec::new();
    let h = cfg.hidden_size;
    sh(
        &mut out,
        "model.embed_tokens.weight".into(),
        vec![cfg.vocab_size, h],
    );
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        norm(&mut out, cfg, format!("{p}.input_layernorm"));
        norm(&mut out, cfg, format!("{p}.post_attention_layernorm"));
        let a = format!("{p}.self_attn");
        match &cfg.attention {
            AttentionKind::Standard {
                head_dim,
                qkv_bias,
                o_bias,
                qk_norm,
                ..
            } => {
                let q = cfg.num_heads * head_dim;
                let kv = cfg.num_kv_heads * head_dim;
                for (proj, width) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                    sh(&mut out, format!("{a}.{proj}.weight"), vec![width, h]);
                    if *qkv_bias {
                        sh(&mut out, format!("{a}.{proj}.bias"), vec![width]);
                    }
                }
                sh(&mut out, format!("{a}.o_proj.weight"), vec![h, q]);
                if *o_bias {
                    sh(&mut out, format!("{a}.o_proj.bias"), vec![h]);
                }
                match qk_norm {
                    QkNorm::None => {}
                    QkNorm::Full => {
                        sh(&mut out, format!("{a}.q_norm.weight"), vec![q]);
                        // transformers sizes it from hidden / heads, which equals head_dim unless
                        // config.json overrides head_dim.
                        sh(
                            &mut out,
                            format!("{a}.k_norm.weight"),
                            vec![h / cfg.num_heads * cfg.num_kv_heads],
                        );
                    }
                    QkNorm::PerHead => {
                        sh(&mut out, format!("{a}.q_norm.weight"), vec![*head_dim]);
                        sh(&mut out, format!("{a}.k_norm.weight"), vec![*head_dim]);
                    }
                }
            }
            AttentionKind::Mla {
                q_lora_rank,
                kv_lora_rank,
                qk_nope_head_dim,
                qk_rope_head_dim,
                v_head_dim,
                bias,
            } => {
                let qk = qk_nope_head_dim + qk_rope_head_dim;
                match q_lora_rank {
                    None => sh(
                        &mut out,
                        format!("{a}.q_proj.weight"),
                        vec![cfg.num_heads * qk, h],
                    ),
                    Some(r) => {
                        sh(&mut out, format!("{a}.q_a_proj.weight"), vec![*r, h]);
                        if *bias {
                            sh(&mut out, format!("{a}.q_a_proj.bias"), vec![*r]);
                        }
                        sh(&mut out, format!("{a}.q_a_layernorm.weight"), vec![*r]);
                        sh(
                            &mut out,
                            format!("{a}.q_b_proj.weight"),
                            vec![cfg.num_heads * qk, *r],
                        );
                    }
                }
                sh(
                    &mut out,
                    format!("{a}.kv_a_proj_with_mqa.weight"),
                    vec![kv_lora_rank + qk_rope_head_dim, h],
                );
                if *bias {
                    sh(
                        &mut out,
                        format!("{a}.kv_a_proj_with_mqa.bias"),
                        vec![kv_lora_rank + qk_rope_head_dim],
                    );
                }
                sh(
                    &mut out,
                    format!("{a}.kv_a_layernorm.weight"),
                    vec![*kv_lora_rank],
                );
                sh(
                    &mut out,
                    format!("{a}.kv_b_proj.weight"),
                    vec![
                        cfg.num_heads * (qk_nope_head_dim + v_head_dim),
                        *kv_lora_rank,
                    ],
                );
                sh(
                    &mut out,
                    format!("{a}.o_proj.weight"),
                    vec![h, cfg.num_heads * v_head_dim],
                );
                if *bias {
                    sh(&mut out, format!("{a}.o_proj.bias"), vec![h]);
                }
            }
        }
        if cfg.moe.is_moe[l] {
            let inter = cfg.moe.intermediate_size;
            sh(
                &mut out,
                router_tensor_name(cfg, l),
                vec![cfg.moe.num_experts, h],
            );
            if let Some(s) = cfg.moe.shared {
                let sp = shared_expert_prefix(cfg, l);
                sh(
                    &mut out,
                    format!("{sp}.gate_proj.weight"),
                    vec![s.intermediate_size, h],
                );
                sh(
                    &mut out,
                    format!("{sp}.up_proj.weight"),
                    vec![s.intermediate_size, h],
                );
                sh(
                    &mut out,
                    format!("{sp}.down_proj.weight"),
                    vec![h, s.intermediate_size],
                );
                if s.sigmoid_gate {
                    sh(&mut out, shared_expert_gate_name(cfg, l), vec![1, h]);
                }
            }
            for e in 0..cfg.moe.num_experts {
                for proj in [Proj::Gate, Proj::Up, Proj::Down] {
                    let shape = if proj == Proj::Down {
                        vec![h, inter]
                    } else {
                        vec![inter, h]
                    };
                    out.push(TensorSpec {
                        name: expert_tensor_name(cfg, l, e, proj),
                        shape,
                        role: TensorRole::RoutedExpert {
                            layer: l,
                            expert: e,
                            proj,
                        },
                    });
                }
            }
        } else {
            let i = cfg.intermediate_size;
            sh(&mut out, format!("{p}.mlp.gate_proj.weight"), vec![i, h]);
            sh(&mut out, format!("{p}.mlp.up_proj.weight"), vec![i, h]);
            sh(&mut out, format!("{p}.mlp.down_proj.weight"), vec![h, i]);
        }
    }
    norm(&mut out, cfg, "model.norm".into());
    if !cfg.tie_word_embeddings {
        sh(&mut out, "lm_head.weight".into(), vec![cfg.vocab_size, h]);
    }
    if cfg.lm_head_bias {
        sh(&mut out, "lm_head.bias".into(), vec![cfg.vocab_size]);
    }
    out
}

fn sh(out: &mut Vec<TensorSpec>, name: String, shape: Vec<usize>) {
    out.push(TensorSpec {
        name,
        shape,
        role: TensorRole::Shared,
    });
}

fn norm(out: &mut Vec<TensorSpec>, cfg: &ArchConfig, name: String) {
    sh(out, format!("{name}.weight"), vec![cfg.hidden_size]);
    if cfg.norm == NormKind::LayerNorm {
        sh(out, format!("{name}.bias"), vec![cfg.hidden_size]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixtral_and_deepseek_names() {
        let cfg = ArchConfig::from_config_json(
            r#"{"model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96,
                "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "vocab_size": 100}"#,
        )
        .unwrap();
        let t = expected_tensors(&cfg);
        let w2 = t
            .iter()
            .find(|s| s.name == "model.layers.1.block_sparse_moe.experts.3.w2.weight")
            .unwrap();
        assert_eq!(w2.shape, vec![64, 96]);
        assert_eq!(
            w2.role,
            TensorRole::RoutedExpert {
                layer: 1,
                expert: 3,
                proj: Proj::Down
            }
        );
        let k = t
            .iter()
            .find(|s| s.name == "model.layers.0.self_attn.k_proj.weight")
            .unwrap();
        assert_eq!(k.shape, vec![32, 64]);
        // embed + lm_head + final norm + per layer (2 norms + 4 attn + router + 4 experts * 3).
        assert_eq!(t.len(), 3 + 2 * (2 + 4 + 1 + 12));

        let cfg = ArchConfig::from_config_json(
            r#"{"model_type": "deepseek_v2", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96,
                "num_attention_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 2,
                "moe_intermediate_size": 32, "first_k_dense_replace": 1, "q_lora_rank": 24, "kv_lora_rank": 16,
                "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "vocab_size": 100,
                "tie_word_embeddings": true}"#,
        )
        .unwrap();
        let t = expected_tensors(&cfg);
        let names: Vec<&str> = t.iter().map(|s| s.name.as_str()).collect();
        assert!(names.contains(&"model.layers.0.mlp.gate_proj.weight"));
        assert!(names.contains(&"model.layers.1.mlp.shared_experts.up_proj.weight"));
        assert!(names.contains(&"model.layers.1.self_attn.q_a_layernorm.weight"));
        assert!(!names.contains(&"lm_head.weight"));
        let kvb = t
            .iter()
            .find(|s| s.name == "model.layers.1.self_attn.kv_b_proj.weight")
            .unwrap();
        assert_eq!(kvb.shape, vec![4 * 16, 16]);
        assert_eq!(
            expert_tensor_name(&cfg, 1, 2, Proj::Up),
            "model.layers.1.mlp.experts.2.up_proj.weight"
        );
        assert_eq!(
            draft_tensor_name(3, 5, "gate_up", "scales"),
            "draft.layers.3.experts.5.gate_up.scales"
        );
    }
}
