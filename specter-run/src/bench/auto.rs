//! `auto`'s calibration: on the first prompt, sampled as the bench samples, outside the timed runs, every way `auto` may decode
//! is measured and the fastest kept ([`specter::depth_profile::Candidate`]): the draft at each
//! candidate depth, plain decoding without it, and, where the host path may run, both again with
//! part of the missing experts computed on host threads.

use specter::backend::cuda::CudaOptions;
use specter::depth_profile::{DepthProfile, PlainCandidate};
use specter::offload::Policy;
use specter::session::{Session, SessionOptions};
use specter::Result;

use super::BenchOptions;
use crate::profile;

/// What `auto`'s calibration chose.
#[derive(Clone, Debug, PartialEq)]
pub enum AutoChoice {
    /// Plain decoding without the draft, its VRAM given to the expert cache; with `host`, part of
    /// the misses computed on host threads (the hybrid path).
    Plain { slots: usize, host: bool },
    /// The draft, with automatic depth control starting from the profile: each measured depth
    /// and its seconds per token; with `host`, the hybrid path too.
    Draft {
        profile: Vec<(usize, f64)>,
        host: bool,
    },
}

impl AutoChoice {
    /// Whether the choice computes part of the missing experts on the host.
    pub fn host(&self) -> bool {
        match self {
            AutoChoice::Plain { host, .. } | AutoChoice::Draft { host, .. } => *host,
        }
    }

    /// One line for the report: the mode's bench name, then its settings.
    pub fn describe(&self) -> String {
        let host = if self.host() {
            ", part of the misses on host threads"
        } else {
            ""
        };
        match self {
            AutoChoice::Plain { slots, host: h } => format!(
                "{}: plain lru, {slots} slots, no draft{host}",
                if *h { "hybrid" } else { "lru" }
            ),
            AutoChoice::Draft { profile, host: h } => {
                let best = profile
                    .iter()
                    .min_by(|a, b| a.1.total_cmp(&b.1))
                    .map_or(0, |p| p.0);
                format!(
                    "{}: draft, start depth {best}{host}",
                    if *h { "specter-hybrid" } else { "specter" }
                )
            }
        }
    }
}

/// A session as the bench measures it: opened, then its offloaded experts' host registration
/// (made in the background at load) awaited, so that no timed or calibration run overlaps it and
/// every mode is measured with copies straight from the registered mapping, as a long-running
/// server decodes.
pub(super) fn open_settled(path: &std::path::Path, opts: &SessionOptions) -> Result<Session> {
    let session = Session::open_with(path, opts)?;
    if let Some(gpu) = session.cuda() {
        gpu.wait_host_registration()?;
    }
    Ok(session)
}

/// Host threads of the host path: the user's `--host-threads`, else every core but one.
pub(super) fn host_threads(cuda: &CudaOptions) -> usize {
    cuda.host_experts
        .unwrap_or_else(specter::host_experts::default_threads)
}

/// `auto` with offloaded experts: the offline profile (`specter-run profile`) done on the first
/// prompt with the bench's token count (shorter runs favour speculation: an LRU cache is still
/// filling), outside the timed runs. It sweeps automatic depth's candidate depths with the draft
/// at the case's residency, then measures plain decoding without the draft at the case's matched
/// residency (the draft's memory as slots), keeping one session open at a time so the VRAM
/// budget holds. With [`BenchOptions::auto_host`], each session is measured once more with the
/// host path turned on (the draft at its fastest depth): one run each, the same token count.
/// Returns a new session for the fastest choice (the host path on or off as chosen), the choice
/// and the profile.
pub fn calibrate_auto(
    path: &std::path::Path,
    opts: &BenchOptions,
    draft_opts: &SessionOptions,
) -> Result<(Session, AutoChoice, DepthProfile)> {
    let prompt = &opts.prompts[0];
    let tokens = opts.new_tokens;
    // The bench's own sampling: greedy output that loops keeps a cache's hit rate high, so a
    // choice calibrated greedily can be the wrong one for sampled runs.
    let sampling = opts.sampling;
    let depths = specter::decode::candidate_depths(opts.case.depth);
    let host = opts
        .auto_host
        .then(|| opts.cuda.host_experts_config(host_threads(&opts.cuda)));
    let mut profile = {
        let session = open_settled(path, draft_opts)?;
        let mut profile = profile::sweep(&session, prompt, tokens, &depths, 1, sampling)?;
        if let (Some(h), Some(depth)) = (host, profile.best_draft_depth()) {
            let ms =
                profile::measure_with_host(&session, prompt, tokens, Some(depth), h, 1, sampling)?;
            profile.record_host_draft(h.threads, depth, ms);
        }
        profile
    };
    let mut plain_opts = draft_opts.clone();
    plain_opts.with_draft = false;
    plain_opts.offload = Some((opts.case.matched, Policy::Lru));
    let plain = open_settled(path, &plain_opts)?;
    let plain_ms = profile::measure_plain(&plain, prompt, tokens, 1, sampling)?;
    profile.plain = Some(PlainCandidate {
        slots: opts.case.matched,
        tpot_ms: plain_ms,
    });
    if let Some(h) = host {
        let ms = profile::measure_with_host(&plain, prompt, tokens, None, h, 1, sampling)?;
        profile.record_host_plain(h.threads, ms);
    }
    let chosen = profile.choice();
    let host = host.filter(|_| chosen.host());
    // The chosen way runs in a session of its own, opened as the fixed mode's would be: the
    // calibration's sessions carry what their runs left (the host path turned on and off, the
    // passes recorded with and without it).
    drop(plain);
    if !chosen.draft() {
        plain_opts.cuda.host_experts = host.map(|h| h.threads);
        let choice = AutoChoice::Plain {
            slots: opts.case.matched,
            host: host.is_some(),
        };
        return Ok((open_settled(path, &plain_opts)?, choice, profile));
    }
    let mut draft_opts = draft_opts.clone();
    draft_opts.cuda.host_experts = host.map(|h| h.threads);
    let choice = AutoChoice::Draft {
        profile: profile.seconds_per_token(),
        host: host.is_some(),
    };
    Ok((open_settled(path, &draft_opts)?, choice, profile))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_choice_names_its_mode_and_the_host_path() {
        let plain = AutoChoice::Plain {
            slots: 32,
            host: false,
        };
        assert_eq!(plain.describe(), "lru: plain lru, 32 slots, no draft");
        let hybrid = AutoChoice::Plain {
            slots: 32,
            host: true,
        };
        assert_eq!(
            hybrid.describe(),
            "hybrid: plain lru, 32 slots, no draft, part of the misses on host threads"
        );
        let draft = AutoChoice::Draft {
            profile: vec![(0, 0.04), (4, 0.02), (8, 0.03)],
            host: true,
        };
        assert!(draft.host());
        assert_eq!(
            draft.describe(),
            "specter-hybrid: draft, start depth 4, part of the misses on host threads"
        );
    }
}
