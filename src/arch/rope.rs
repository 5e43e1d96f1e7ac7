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
