//! Config parsing: error messages for bad input, and real checkpoints' config.json files.

mod parsing {
    use super::super::*;

    #[test]
    fn unknown_model_type_lists_supported() {
        let err = ArchConfig::from_config_json(r#"{"model_type": "llama"}"#)
            .unwrap_err()
            .to_string();
        for t in SUPPORTED_MODEL_TYPES {
            assert!(err.contains(t), "{err}");
        }
    }

    #[test]
    fn bad_field_is_named() {
        let err =
            ArchConfig::from_config_json(r#"{"model_type": "mixtral", "hidden_size": "big"}"#)
                .unwrap_err()
                .to_string();
        assert!(err.contains("hidden_size"), "{err}");
        let err = ArchConfig::from_config_json(r#"{"model_type": "deepseek_v2"}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("num_experts_per_tok"), "{err}");
    }

    #[test]
    fn defaults_and_layer_rules() {
        let c = ArchConfig::from_config_json(
            r#"{"model_type": "qwen2_moe", "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}"#,
        )
        .unwrap();
        assert_eq!(c.moe_layers(), vec![1, 5]);
        assert_eq!(c.moe.num_experts, 60);
        assert_eq!(
            c.moe.shared,
            Some(SharedExperts {
                intermediate_size: 5632,
                sigmoid_gate: true
            })
        );
        let c = ArchConfig::from_config_json(
            r#"{"model_type": "deepseek_v2", "num_hidden_layers": 4, "first_k_dense_replace": 1,
                "num_experts_per_tok": 6, "q_lora_rank": null,
                "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                 "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}}"#,
        )
        .unwrap();
        assert_eq!(c.moe_layers(), vec![1, 2, 3]);
        assert!(matches!(
            c.attention,
            AttentionKind::Mla {
                q_lora_rank: None,
                ..
            }
        ));
        assert!(matches!(c.rope.scaling, RopeScaling::Yarn { factor, .. } if factor == 40.0));
        assert_eq!(c.rope.style, RopeStyle::Interleaved);
        let c = ArchConfig::from_config_json(r#"{"model_type": "mixtral"}"#).unwrap();
        assert_eq!(c.rope.theta, 1e6);
        assert_eq!(c.eos_token_ids, vec![2]);
        assert_eq!(c.model_info().expert_bytes, 3 * 4096 * 14336 * 2);
    }
}

mod real_configs {
    use super::super::*;

    #[test]
    fn deepseek_v2_lite_legacy_rope_scaling() {
        let c = ArchConfig::from_config_json(
            r#"{"model_type":"deepseek_v2","vocab_size":102400,"hidden_size":2048,"intermediate_size":10944,
                "moe_intermediate_size":1408,"num_hidden_layers":27,"num_attention_heads":16,"num_key_value_heads":16,
                "n_shared_experts":2,"n_routed_experts":64,"routed_scaling_factor":1.0,"kv_lora_rank":512,
                "q_lora_rank":null,"qk_rope_head_dim":64,"v_head_dim":128,"qk_nope_head_dim":128,
                "topk_method":"greedy","n_group":1,"topk_group":1,"num_experts_per_tok":6,"moe_layer_freq":1,
                "first_k_dense_replace":1,"norm_topk_prob":false,"hidden_act":"silu",
                "max_position_embeddings":163840,"rms_norm_eps":1e-06,"rope_theta":10000,
                "rope_scaling":{"beta_fast":32,"beta_slow":1,"factor":40,"mscale":0.707,"mscale_all_dim":0.707,
                                "original_max_position_embeddings":4096,"type":"yarn"},
                "attention_bias":false,"bos_token_id":100000,"eos_token_id":100001,"tie_word_embeddings":false}"#,
        )
        .unwrap();
        let info = c.model_info();
        assert_eq!(info.moe_layers.len(), 26);
        assert_eq!(info.moe_layers[0], 1);
        assert_eq!(info.expert_bytes, 3 * 2048 * 1408 * 2);
        assert_eq!(
            (info.bos_token_id, info.eos_token_ids.clone()),
            (Some(100000), vec![100001])
        );
        assert_eq!(c.rope_dim(), 64);
        assert_eq!(
            c.moe.shared,
            Some(SharedExperts {
                intermediate_size: 2816,
                sigmoid_gate: false
            })
        );
        assert!(matches!(
            c.rope.scaling,
            RopeScaling::Yarn {
                original_max_position_embeddings: 4096,
                truncate: true,
                ..
            }
        ));
    }

    #[test]
    fn phi35_moe_longrope_and_biases() {
        let factors = vec!["1.0"; 64].join(",");
        let c = ArchConfig::from_config_json(&format!(
            r#"{{"model_type":"phimoe","vocab_size":32064,"hidden_size":4096,"intermediate_size":6400,
                "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"num_local_experts":16,
                "num_experts_per_tok":2,"max_position_embeddings":131072,"original_max_position_embeddings":4096,
                "rope_theta":10000.0,"sliding_window":131072,"attention_bias":true,"lm_head_bias":true,
                "rope_scaling":{{"type":"longrope","short_factor":[{factors}],"long_factor":[{factors}],
                                 "short_mscale":1.243,"long_mscale":1.243,"original_max_position_embeddings":4096}}}}"#
        ))
        .unwrap();
        assert_eq!(c.norm, NormKind::LayerNorm);
        assert!(c.lm_head_bias);
        assert_eq!(c.sliding_window, Some(131072));
        assert_eq!(c.moe.router, RouterKind::SparseMixer { jitter_eps: 0.01 });
        assert!(matches!(
            c.attention,
            AttentionKind::Standard {
                head_dim: 128,
                qkv_bias: true,
                o_bias: true,
                ..
            }
        ));
        assert_eq!(c.moe_layers().len(), 32);
        // Too few LongRoPE factors for the rotary dimension is a named error.
        let err = ArchConfig::from_config_json(
            r#"{"model_type":"phimoe","rope_scaling":{"type":"longrope","short_factor":[1.0],"long_factor":[1.0],
                "short_mscale":1.0,"long_mscale":1.0}}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("short_factor"), "{err}");
    }
}
