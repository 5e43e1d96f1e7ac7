//! RoPE frequencies and scales, computed the way transformers computes them (in f32, from the
//! same formulas), so rotated queries and keys match its reference closely.

use super::config::{ArchConfig, AttentionKind, ModelType, RopeScaling};

/// Inverse frequencies and per-position cos/sin scale of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable {
    pub inv_freq: Vec<f32>,
    /// Scale of cos/sin for positions whose sequence length (position + 1) is at most
    /// `switch_after`, and for all positions when `switch_after` is `None`.
    pub scale: f32,
    /// PhiMoE LongRoPE: past `original_max_position_embeddings`, cos/sin use `long_scale`.
    pub switch_after: Option<usize>,
    pub long_scale: f32,
}

impl RopeTable {
    /// The cos/sin scale of the token at `position`.
    ///
    /// transformers' PhiMoE picks the scale from the longest position in the whole forward call;
    /// here it depends on the row's own position, so that a row's result does not depend on the
    /// rows batched with it. The two agree whenever a call does not straddle the switch.
    pub fn scale_at(&self, position: usize) -> f32 {
        match self.switch_after {
            Some(limit) if position + 1 > limit => self.long_scale,
            _ => self.scale,
        }
    }
}

/// `base ** (2i / dim)` for `i < dim / 2`, as transformers: exponent in f32, power rounded to f32.
fn pos_freqs(base: f64, dim: usize) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| {
            let e = (2 * i) as f32 / dim as f32;
            base.powf(e as f64) as f32
        })
        .collect()
}

fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// The model's RoPE table.
pub fn rope_table(cfg: &ArchConfig) -> RopeTable {
    let dim = cfg.rope_dim();
    let base = cfg.rope.theta;
    let plain = |inv_freq: Vec<f32>, scale: f32| RopeTable {
        inv_freq,
        scale,
        switch_after: None,
        long_scale: scale,
    };
    match &cfg.rope.scaling {
        RopeScaling::None => plain(pos_freqs(base, dim).iter().map(|p| 1.0 / p).collect(), 1.0),
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            attention_factor,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            truncate,
        } => {
            let factor = *factor;
            let attention = match attention_factor {
                Some(a) => *a,
                None => match (mscale, mscale_all_dim) {
                    (Some(m), Some(a)) if *m != 0.0 && *a != 0.0 => {
                        yarn_get_mscale(factor, *m) / yarn_get_mscale(factor, *a)
                    }
                    _ => yarn_get_mscale(factor, 1.0),
                },
            };
            let d = dim as f64;
            let orig = *original_max_position_embeddings as f64;
            let correction_dim = |rotations: f64| {
                d * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
            };
            let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
            if *truncate {
                low = low.floor();
                high = high.ceil();
            }
            let low = low.max(0.0);
            let mut high = high.min(d - 1.0);
            if low == high {
                high += 0.001;
            }
            let pf = pos_freqs(base, dim);
            let inv_freq = (0..dim / 2)
                .map(|i| {
                    let extrapolation = 1.0 / pf[i];
                    let interpolation = 1.0 / ((factor as f32) * pf[i]);
                    let ramp = ((i as f32 - low as f32) / ((high - low) as f32)).clamp(0.0, 1.0);
                    let extrapolation_factor = 1.0 - ramp;
                    interpolation * (1.0 - extrapolation_factor)
                        + extrapolation * extrapolation_factor
                })
                .collect();
            plain(inv_freq, attention as f32)
        }
        RopeScaling::LongRope {
            short_factor,
            original_max_position_embeddings,
            factor,
            attention_factor,
            short_mscale,
            long_mscale,
            ..
        } => {
            let pf = pos_freqs(base, dim);
            // transformers' PhiMoE always rotates with the short factors (its forward recomputes
            // the frequencies without a sequence length); only the cos/sin scale switches.
            let inv_freq = pf
                .iter()
                .zip(short_factor)
                .map(|(p, s)| 1.0 / ((*s as f32) * p))
                .collect();
            let orig = *original_max_position_embeddings;
            let default_attention = || {
                let factor = factor.unwrap_or(cfg.max_position_embeddings as f64 / orig as f64);
                if factor <= 1.0 {
                    1.0
                } else {
                    (1.0 + factor.ln() / (orig as f64).ln()).sqrt()
                }
            };
            let attention = attention_factor.unwrap_or_else(default_attention);
            RopeTable {
                inv_freq,
                scale: short_mscale.unwrap_or(attention) as f32,
                switch_after: Some(orig),
                long_scale: long_mscale.unwrap_or(attention) as f32,
            }
        }
    }
}

/// The softmax scale of attention scores: `1 / sqrt(qk head dim)`, times DeepSeek-V2's YaRN
/// `mscale(factor, mscale_all_dim)^2`.
pub fn attention_scale(cfg: &ArchConfig) -> f32 {
    let (qk_dim, mla) = match &cfg.attention {
        AttentionKind::Standard { head_dim, .. } => (*head_dim, false),
        AttentionKind::Mla {
            qk_nope_head_dim,
            qk_rope_head_dim,
            ..
        } => (qk_nope_head_dim + qk_rope_head_dim, true),
    };
    let mut scale = (qk_dim as f64).powf(-0.5);
    if mla && cfg.model_type == ModelType::DeepseekV2 {
        if let RopeScaling::Yarn {
            factor,
            mscale_all_dim: Some(m),
            ..
        } = &cfg.rope.scaling
        {
            if *m != 0.0 {
                let ms = yarn_get_mscale(*factor, *m);
                scale *= ms * ms;
            }
        }
    }
    scale as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phimoe_longrope_switches_scale_past_original_length() {
        let factors: Vec<String> = (0..8)
            .map(|i| format!("{}", 1.0 + i as f64 * 0.5))
            .collect();
        let cfg = ArchConfig::from_config_json(&format!(
            r#"{{"model_type": "phimoe", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 1024, "original_max_position_embeddings": 64,
                "rope_scaling": {{"type": "longrope", "short_factor": [{f}], "long_factor": [{f}],
                                  "short_mscale": 1.1, "long_mscale": 1.3}}}}"#,
            f = factors.join(",")
        ))
        .unwrap();
        let t = rope_table(&cfg);
        assert_eq!(t.scale_at(0), 1.1);
        assert_eq!(t.scale_at(63), 1.1);
        assert_eq!(t.scale_at(64), 1.3);
        // Short factors divide the plain frequencies.
        let plain = 1.0 / 1e6f64.powf(2.0 / 16.0); // phimoe default rope_theta
        assert!(
            (t.inv_freq[1] as f64 - plain / 1.5).abs() < 1e-7,
            "{:?} {}",
            t.inv_freq,
            plain / 1.5
        );
    }

    #[test]
    fn deepseek_yarn_scales_softmax_by_mscale_squared() {
        let cfg = ArchConfig::from_config_json(
            r#"{"model_type": "deepseek_v2", "num_experts_per_tok": 2, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
                "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                 "mscale": 0.707, "mscale_all_dim": 0.707}}"#,
        )
        .unwrap();
        let m = 0.1 * 0.707 * 40f64.ln() + 1.0;
        let want = (48f64).powf(-0.5) * m * m;
        assert!((attention_scale(&cfg) as f64 - want).abs() < 1e-7);
        // mscale == mscale_all_dim: cos/sin are not scaled.
        assert_eq!(rope_table(&cfg).scale, 1.0);
    }
}
