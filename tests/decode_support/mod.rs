//! A deterministic toy [`LanguageModel`] for decode and offload tests.
//!
//! Its logits are a hash of the token prefix, so any wrong token in the KV changes every later
//! row. Its KV records which variant wrote each position: a target row whose KV still holds a
//! draft-written position gets "poisoned" logits, the way a real model's output would be wrong
//! after a bad crop. The draft's logits are the target's plus noise, with the argmax pushed off
//! the target's on a configurable fraction of prefixes. Both variants report routing: top-k
//! experts per MoE layer from a skewed hash of the prefix (the draft occasionally deviating).
#![allow(dead_code)]

use std::cell::RefCell;

use specter::model::{KvCache, LanguageModel, ModelInfo, Route, RouteHook, Variant};
use specter::{Error, Result};

pub fn mix(a: u64, b: u64) -> u64 {
    // splitmix64 finaliser over a combined word.
    let mut z = a ^ b
        .wrapping_add(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(a << 6)
        .wrapping_add(a >> 2);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Uniform in [0, 1) from a hash.
fn unit(h: u64) -> f32 {
    (h >> 40) as f32 / (1u64 << 24) as f32
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvEntry {
    pub token: u32,
    pub variant: Variant,
    /// Hash of the token prefix up to and including this position.
    pub content: u64,
    /// Hash over the draft-written positions up to here (0: none).
    pub taint: u64,
}

#[derive(Debug)]
pub struct ToyKv {
    capacity: usize,
    pub entries: Vec<KvEntry>,
}

impl KvCache for ToyKv {
    fn len(&self) -> usize {
        self.entries.len()
    }
    fn truncate(&mut self, len: usize) {
        self.entries.truncate(len);
    }
}

/// One recorded forward call: the KV as it was before, and the tokens run.
#[derive(Clone, Debug)]
pub struct Call {
    pub variant: Variant,
    pub kv_before: Vec<(u32, Variant)>,
    pub tokens: Vec<u32>,
}

pub struct ToyModel {
    info: ModelInfo,
    seed: u64,
    /// Per mille of prefixes where the draft's argmax is forced away from the target's.
    pub disagree_per_mille: u64,
    /// Amplitude of the noise added to the draft's logits.
    pub draft_noise: f32,
    /// Spread of the target's logits.
    pub logit_scale: f32,
    /// Per mille of (row, layer) pairs where the draft routes differently from the target.
    pub route_noise_per_mille: u64,
    /// Experts are drawn as floor(n * u^skew): larger skew concentrates routing on low ids.
    pub route_skew: f32,
    pub calls: RefCell<Vec<Call>>,
}

impl ToyModel {
    pub fn new(vocab_size: usize, max_context: usize, seed: u64) -> Self {
        ToyModel {
            info: ModelInfo {
                architecture: "toy".into(),
                vocab_size,
                max_context,
                num_layers: 4,
                moe_layers: vec![1, 2, 3],
                num_experts: 16,
                top_k: 2,
                expert_bytes: 1 << 20,
                bos_token_id: None,
                eos_token_ids: vec![(vocab_size - 1) as u32],
            },
            seed,
            disagree_per_mille: 300,
            draft_noise: 0.3,
            logit_scale: 4.0,
            route_noise_per_mille: 0,
            route_skew: 1.0,
            calls: RefCell::new(Vec::new()),
        }
    }

    pub fn with_experts(mut self, num_experts: usize, top_k: usize) -> Self {
        self.info.num_experts = num_experts;
        self.info.top_k = top_k;
        self
    }

    pub fn take_calls(&self) -> Vec<Call> {
        std::mem::take(&mut *self.calls.borrow_mut())
    }

    fn row_logits(&self, variant: Variant, entry: &KvEntry, out: &mut Vec<f32>) {
        let vocab = self.info.vocab_size;
        let base: Vec<f32> = (0..vocab)
            .map(|v| (unit(mix(entry.content, v as u64)) - 0.5) * self.logit_scale)
            .collect();
        match variant {
            Variant::Target => {
                if entry.taint == 0 {
                    out.extend_from_slice(&base);
                } else {
                    out.extend(
                        (0..vocab)
                            .map(|v| base[v] + (unit(mix(entry.taint, v as u64)) - 0.5) * 50.0),
                    );
                }
            }
            Variant::Draft => {
                let h = mix(entry.content, 0xD1AF7);
                let mut row: Vec<f32> = (0..vocab)
                    .map(|v| base[v] + (unit(mix(h, v as u64)) - 0.5) * 2.0 * self.draft_noise)
                    .collect();
                if h % 1000 < self.disagree_per_mille {
                    let target_best = argmax(&base);
                    let other = (target_best + 1 + (mix(h, 1) as usize % (vocab - 1))) % vocab;
                    row[other] = row[target_best] + 1.0;
                }
                out.extend_from_slice(&row);
            }
        }
    }

    fn route(&self, variant: Variant, entry: &KvEntry, moe_layer: usize, topk: &mut Vec<u32>) {
        let n = self.info.num_experts;
        let mut h = mix(entry.content, 0xE0 + moe_layer as u64);
        if variant == Variant::Draft && mix(h, 0x5EED) % 1000 < self.route_noise_per_mille {
            h = mix(h, 0xBAD);
        }
        let start = topk.len();
        let mut salt = 0u64;
        while topk.len() - start < self.info.top_k {
            salt += 1;
            let u = unit(mix(h, salt));
            let expert = ((n as f32 * u.powf(self.route_skew)) as usize).min(n - 1) as u32;
            if !topk[start..].contains(&expert) {
                topk.push(expert);
            }
        }
    }
}

pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

impl LanguageModel for ToyModel {
    type Kv = ToyKv;

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_kv(&self, capacity: usize) -> Result<ToyKv> {
        if capacity > self.info.max_context {
            return Err(Error::Request(format!(
                "kv capacity {capacity} > {}",
                self.info.max_context
            )));
        }
        Ok(ToyKv {
            capacity,
            entries: Vec::with_capacity(capacity),
        })
    }

    fn forward(
        &self,
        variant: Variant,
        tokens: &[u32],
        kv: &mut ToyKv,
        hook: &mut dyn RouteHook,
    ) -> Result<Vec<f32>> {
        if kv.entries.len() + tokens.len() > kv.capacity {
            return Err(Error::Model(format!(
                "kv overflow: {} + {} > {}",
                kv.entries.len(),
                tokens.len(),
                kv.capacity
            )));
        }
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= self.info.vocab_size) {
            return Err(Error::Model(format!("token {bad} out of vocabulary")));
        }
        self.calls.borrow_mut().push(Call {
            variant,
            kv_before: kv.entries.iter().map(|e| (e.token, e.variant)).collect(),
            tokens: tokens.to_vec(),
        });
        let first_new = kv.entries.len();
        for &token in tokens {
            let (content, taint) = kv
                .entries
                .last()
                .map_or((self.seed, 0), |e| (e.content, e.taint));
            let position = kv.entries.len() as u64;
            kv.entries.push(KvEntry {
                token,
                variant,
                content: mix(content, u64::from(token) + 1),
                taint: if variant == Variant::Draft {
                    mix(taint, position + 1)
                } else {
                    taint
                },
            });
        }
        let new = &kv.entries[first_new..];
        let mut topk = Vec::with_capacity(tokens.len() * self.info.top_k);
        for (moe_layer, &layer) in self.info.moe_layers.iter().enumerate() {
            topk.clear();
            for entry in new {
                self.route(variant, entry, moe_layer, &mut topk);
            }
            hook.on_route(Route {
                variant,
                layer,
                moe_layer,
                top_k: self.info.top_k,
                topk: &topk,
            });
        }
        let mut logits = Vec::with_capacity(tokens.len() * self.info.vocab_size);
        for entry in new {
            self.row_logits(variant, entry, &mut logits);
        }
        Ok(logits)
    }
}

/// Random prompts of the given lengths over `vocab`.
pub fn prompts(seed: u64, lengths: &[usize], vocab: usize) -> Vec<Vec<u32>> {
    lengths
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            (0..len)
                .map(|j| (mix(seed + i as u64, j as u64) % vocab as u64) as u32)
                .collect()
        })
        .collect()
}
