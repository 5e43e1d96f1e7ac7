//! The offline depth sweep behind `specter-run profile`: decode a short greedy continuation at
//! each candidate draft depth (0 is plain target decoding) on this machine, in the residency the
//! session was opened with, and keep the fastest as the starting depth that automatic depth
//! control ([`crate::decode::AutoDepth`]) then adjusts online.
//!
//! A profile names the bundle (its manifest checksum) and the machine (backend, device and
//! residency) it was measured for, and is refused for any other.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::backend::cuda::CudaPrefetcher;
use crate::decode::{generate, generate_observed, GenerateOptions, Mode, Sampling};
use crate::model::{LanguageModel, NoHook};
use crate::session::{Session, SessionModel};
use crate::{Error, Result};

/// What a profile was measured on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProfileKey {
    /// Hex sha256 of the bundle's manifest.
    pub manifest_sha256: String,
    /// `cpu` or `cuda`.
    pub backend: String,
    /// The GPU's name (empty on the CPU).
    pub device: String,
    /// How routed experts were held ("all resident", or the cache's description).
    pub residency: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DepthProfile {
    pub key: ProfileKey,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    /// Candidate depths, in the order measured.
    pub depths: Vec<usize>,
    /// Median TPOT at each depth, milliseconds.
    pub tpot_ms: Vec<f64>,
    /// Acceptance rate at each depth (0 for depth 0).
    pub acceptance: Vec<f64>,
    /// The fastest depth.
    pub best_depth: usize,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The key of `session`: its bundle, backend, device and residency.
pub fn session_key(session: &Session) -> Result<ProfileKey> {
    let (backend, device, residency) = match session.cuda() {
        None => ("cpu".to_string(), String::new(), "all resident".to_string()),
        Some(g) => (
            "cuda".to_string(),
            g.device().name().to_string(),
            g.residency_description()?,
        ),
    };
    Ok(ProfileKey {
        manifest_sha256: hex(&session.bundle.header().manifest_sha256),
        backend,
        device,
        residency,
    })
}

/// Decodes `new_tokens` greedy tokens after `prompt` at every depth in `depths` (0: target-only),
/// `repeats` times each, and returns the profile. The session must hold the draft.
pub fn sweep(
    session: &Session,
    prompt: &[u32],
    new_tokens: usize,
    depths: &[usize],
    repeats: usize,
) -> Result<DepthProfile> {
    if depths.is_empty() || repeats == 0 || new_tokens < 2 {
        return Err(Error::Request(
            "a depth sweep needs at least one depth, one repeat and two new tokens".into(),
        ));
    }
    let key = session_key(session)?;
    let mut tpot_ms = Vec::with_capacity(depths.len());
    let mut acceptance = Vec::with_capacity(depths.len());
    for &depth in depths {
        let opts = GenerateOptions {
            mode: if depth == 0 {
                Mode::Target
            } else {
                Mode::Specter
            },
            max_new_tokens: new_tokens,
            depth: depth.max(1),
            sampling: Sampling::greedy(),
            stop_at_eos: false,
        };
        let mut runs = Vec::with_capacity(repeats);
        let mut accepted = 0.0;
        for _ in 0..repeats {
            let out = match &session.model {
                SessionModel::Cpu(m) => {
                    generate(m.as_ref(), prompt, &opts, &mut NoHook, &mut |_| {})?
                }
                SessionModel::Cuda(m) => {
                    let gpu = m.backend();
                    // Every run starts from the same (empty) expert cache.
                    gpu.reset_offload()?;
                    if gpu.offload_slots()?.is_some() && opts.mode == Mode::Specter {
                        let mut prefetcher = CudaPrefetcher::new(gpu, m.info(), 55e9)?;
                        let out = generate_observed(
                            m.as_ref(),
                            prompt,
                            &opts,
                            &mut prefetcher,
                            &mut |_| {},
                        )?;
                        if let Some(e) = prefetcher.take_error() {
                            return Err(e);
                        }
                        out
                    } else {
                        generate(m.as_ref(), prompt, &opts, &mut NoHook, &mut |_| {})?
                    }
                }
            };
            accepted = out.stats.acceptance_rate;
            runs.push(out.stats.tpot_ms);
        }
        runs.sort_by(f64::total_cmp);
        tpot_ms.push(runs[runs.len() / 2]);
        acceptance.push(accepted);
    }
    let best = (0..depths.len())
        .min_by(|&a, &b| tpot_ms[a].total_cmp(&tpot_ms[b]))
        .unwrap_or(0);
    Ok(DepthProfile {
        key,
        prompt_tokens: prompt.len(),
        new_tokens,
        depths: depths.to_vec(),
        tpot_ms,
        acceptance,
        best_depth: depths[best],
    })
}

impl DepthProfile {
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| Error::Request(format!("cannot encode the profile: {e}")))?;
        std::fs::write(path, text + "\n").map_err(|e| {
            Error::Request(format!("cannot write the profile {}: {e}", path.display()))
        })
    }

    pub fn load(path: &Path) -> Result<DepthProfile> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::Request(format!("cannot read the profile {}: {e}", path.display()))
        })?;
        serde_json::from_str(&text)
            .map_err(|e| Error::Request(format!("{} is not a depth profile: {e}", path.display())))
    }

    /// The starting depth for `session`, refusing a profile measured for another bundle,
    /// backend, device or residency.
    pub fn start_depth_for(&self, session: &Session, path: &Path) -> Result<usize> {
        let key = session_key(session)?;
        if key != self.key {
            return Err(Error::Request(format!(
                "the profile {} was measured for another bundle or machine ({:?}), not this one ({:?}): run specter-run profile again",
                path.display(),
                self.key,
                key
            )));
        }
        Ok(self.best_depth)
    }
}
