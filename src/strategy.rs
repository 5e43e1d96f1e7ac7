//! How one decode runs on an open session: from the backend, the mode and the residency, which
//! observers drive it (draft-driven or route-frequency prefetch on a GPU with offloaded experts,
//! the offload simulation on the CPU, automatic depth). `generate`, `bench`, `profile`, `demo`
//! and `serve` all decode through [`decode_on_session`].

use crate::decode::{
    self, AutoDepth, AutoDepthReport, DecodeObserver, DraftPrefetcher, FrequencyPrefetcher,
    GenerateOptions, GenerateOutput, Mode,
};
use crate::model::{LanguageModel, NoHook};
use crate::offload::{OffloadSimulator, Policy, SimulatorConfig};
use crate::session::{Session, SessionModel};
use crate::{Error, Result};

/// Host-to-device copy bandwidth assumed before one is measured, bytes/s: about what pinned
/// copies sustain over PCIe 5.0 x16. The CPU simulation of expert copies runs at it, and the GPU
/// prefetch schedule starts from it until the copy stream has timed real copies.
pub const DEFAULT_COPY_BANDWIDTH: f64 = 55e9;

/// How automatic depth starts: the depth of the first round (at most the options' depth, which
/// is the most it may use) and measured (depth, seconds per token) to seed its costs with.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AutoDepthStart {
    pub start: usize,
    pub seed: Vec<(usize, f64)>,
}

/// How one decode on an open session is observed, beyond its [`GenerateOptions`].
#[derive(Clone, Debug, PartialEq)]
pub struct DecodePlan {
    /// Run under automatic depth control.
    pub auto_depth: Option<AutoDepthStart>,
    /// CPU backend: simulate offloading with this many experts per layer resident.
    pub simulated_slots: Option<usize>,
    /// Bytes/s: see [`GenerationRequest::copy_bandwidth`].
    pub copy_bandwidth: f64,
}

impl Default for DecodePlan {
    fn default() -> Self {
        DecodePlan {
            auto_depth: None,
            simulated_slots: None,
            copy_bandwidth: DEFAULT_COPY_BANDWIDTH,
        }
    }
}

/// A decode's output and what its observers measured.
#[derive(Clone, Debug)]
pub struct Decoded {
    pub output: GenerateOutput,
    pub auto_depth: Option<AutoDepthReport>,
    /// GPU prefetch schedule: mean draft step time, ms.
    pub draft_step_ms: Option<f64>,
}

/// Decodes `prompt` on `session` under `opts`, observed as the backend, mode and residency call
/// for: with offloaded experts on the GPU the speculative modes prefetch what the draft forecasts
/// (route-frequency Top-M for SpecMoEOff); on the CPU `plan.simulated_slots` runs the offload
/// simulator; automatic depth wraps whichever of these runs. `on_token` returning false stops
/// after that token. The GPU's expert cache is used as it stands (callers reset it between runs).
pub fn decode_on_session(
    session: &Session,
    prompt: &[u32],
    opts: &GenerateOptions,
    plan: &DecodePlan,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Decoded> {
    let auto = plan.auto_depth.as_ref();
    match &session.model {
        SessionModel::Cpu(m) => match plan.simulated_slots {
            Some(slots) => decode_simulated(m.as_ref(), prompt, opts, plan, slots, on_token),
            None => observed(m.as_ref(), prompt, opts, &mut NoHook, auto, on_token),
        },
        SessionModel::Cuda(m) => {
            if plan.simulated_slots.is_some() {
                return Err(Error::Request(
                    "offloading is simulated on the CPU backend only: on CUDA the copies are real"
                        .into(),
                ));
            }
            let gpu = m.backend();
            let offloaded = gpu.offload_slots()?.is_some();
            match opts.mode {
                Mode::SpecMoeOff if offloaded => {
                    let mut prefetcher = FrequencyPrefetcher::new(gpu, m.info())?;
                    let out = observed(m.as_ref(), prompt, opts, &mut prefetcher, auto, on_token)?;
                    match prefetcher.take_error() {
                        Some(e) => Err(e),
                        None => Ok(out),
                    }
                }
                Mode::Specter if offloaded => {
                    let mut prefetcher = DraftPrefetcher::new(gpu, m.info(), plan.copy_bandwidth)?;
                    let mut out =
                        observed(m.as_ref(), prompt, opts, &mut prefetcher, auto, on_token)?;
                    if let Some(e) = prefetcher.take_error() {
                        return Err(e);
                    }
                    out.draft_step_ms = Some(prefetcher.draft_step_seconds() * 1e3);
                    Ok(out)
                }
                _ => observed(m.as_ref(), prompt, opts, &mut NoHook, auto, on_token),
            }
        }
    }
}

/// Decodes with `inner` observing, under automatic depth control when `auto` is given.
fn observed<M: LanguageModel>(
    model: &M,
    prompt: &[u32],
    opts: &GenerateOptions,
    inner: &mut dyn DecodeObserver,
    auto: Option<&AutoDepthStart>,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Decoded> {
    let (output, auto_depth) = match auto {
        None => (
            decode::generate_until(model, prompt, opts, inner, on_token)?,
            None,
        ),
        Some(start) => {
            let mut control = AutoDepth::new(inner, opts.depth, start.start);
            control.seed(&start.seed);
            let output = decode::generate_until(model, prompt, opts, &mut control, on_token)?;
            (output, Some(control.report()))
        }
    };
    Ok(Decoded {
        output,
        auto_depth,
        draft_step_ms: None,
    })
}

/// The CPU backend with `slots` experts per layer resident in a simulated cache: only copies are
/// simulated (compute is not), at `plan.copy_bandwidth`.
fn decode_simulated<M: LanguageModel>(
    model: &M,
    prompt: &[u32],
    opts: &GenerateOptions,
    plan: &DecodePlan,
    slots: usize,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Decoded> {
    let info = model.info();
    if slots == 0 || slots > info.num_experts {
        return Err(Error::Request(format!(
            "--resident-experts must be between 1 and {} (experts per layer)",
            info.num_experts
        )));
    }
    let policy = if opts.mode.is_speculative() {
        Policy::Specter
    } else {
        Policy::Lru
    };
    let mut sim = OffloadSimulator::new(SimulatorConfig::copies_only(
        info,
        slots,
        policy,
        plan.copy_bandwidth,
    ))?;
    if opts.mode == Mode::SpecMoeOff {
        sim = sim.with_frequency_prefetch(crate::offload::frequency_top_m(slots, info.top_k))?;
    }
    let mut auto_depth = None;
    let output = decode::simulate_offload(info, &mut sim, |sim| {
        let decoded = observed(model, prompt, opts, sim, plan.auto_depth.as_ref(), on_token)?;
        auto_depth = decoded.auto_depth;
        Ok(decoded.output)
    })?;
    Ok(Decoded {
        output,
        auto_depth,
        draft_step_ms: None,
    })
}
