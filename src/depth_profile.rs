//! A depth profile: what `specter-run profile` measured on this machine (the median TPOT at each
//! candidate draft depth, 0 being plain target decoding, in the residency the session was opened
//! with), which `generate --auto-depth --profile` starts automatic depth control
//! ([`crate::decode::AutoDepth`]) from. The sweep that measures it is a tool and lives in
//! specter-run; the runtime keeps what reading and choosing from a profile needs.
//!
//! On the GPU with offloaded experts a profile can also hold plain decoding *without* the draft,
//! its VRAM given to the expert cache as extra slots ([`PlainCandidate`]): where speculation does
//! not pay (nearly uniform routing touches most experts in a window), that is what automatic depth
//! falls back to, since plain decoding with the draft still loaded would waste the memory the
//! draft holds.
//!
//! With the host path available it can hold both again with part of the missing experts computed
//! on host threads (the hybrid path, [`HostCandidates`]); [`DepthProfile::choice`] is then the
//! fastest of the four [`Candidate`]s.
//!
//! A profile names the bundle (its manifest checksum) and the machine (backend, device and
//! residency) it was measured for, and is refused for any other.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::session::Session;
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
    /// Plain decoding without the draft, its memory given to the expert cache (absent when not
    /// measured, and in profiles written before it was).
    #[serde(default)]
    pub plain: Option<PlainCandidate>,
    /// Both again with the host path (absent when not measured).
    #[serde(default)]
    pub host: Option<HostCandidates>,
}

/// The hybrid candidates: part of the missing experts computed on host threads while the rest
/// are copied.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostCandidates {
    /// Host threads.
    pub threads: usize,
    /// Plain decoding at [`PlainCandidate::slots`] with the host path, median TPOT ms.
    pub plain_tpot_ms: Option<f64>,
    /// The draft at `depth` (the fastest nonzero depth of the sweep) with the host path.
    pub depth: usize,
    pub draft_tpot_ms: Option<f64>,
}

/// One way `auto` can decode, simplest first: a tie goes to the simpler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Candidate {
    /// Target-only without the draft, its memory as expert slots.
    Plain,
    /// The draft at automatic depth.
    Draft,
    /// Plain with the host path.
    Hybrid,
    /// The draft with the host path.
    SpecterHybrid,
}

impl Candidate {
    pub fn name(self) -> &'static str {
        match self {
            Candidate::Plain => "plain",
            Candidate::Draft => "draft",
            Candidate::Hybrid => "hybrid",
            Candidate::SpecterHybrid => "specter-hybrid",
        }
    }

    /// Whether it loads the draft.
    pub fn draft(self) -> bool {
        matches!(self, Candidate::Draft | Candidate::SpecterHybrid)
    }

    /// Whether it computes part of the missing experts on the host.
    pub fn host(self) -> bool {
        matches!(self, Candidate::Hybrid | Candidate::SpecterHybrid)
    }
}

/// The fastest of `measured` (candidate, TPOT ms), a tie going to the simpler candidate;
/// times that are not finite and positive are left out. `None` when none is left.
pub fn fastest(measured: &[(Candidate, f64)]) -> Option<Candidate> {
    measured
        .iter()
        .filter(|(_, ms)| ms.is_finite() && *ms > 0.0)
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))
        .map(|(c, _)| *c)
}

/// Plain target-only decoding with the draft's VRAM used as expert slots.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlainCandidate {
    /// Expert slots per MoE layer.
    pub slots: usize,
    /// Median TPOT, milliseconds.
    pub tpot_ms: f64,
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

impl DepthProfile {
    /// Records the draft at `depth` with the host path (`threads` host threads): `ms` per token.
    pub fn record_host_draft(&mut self, threads: usize, depth: usize, ms: f64) {
        let host = self.host_entry(threads);
        host.depth = depth;
        host.draft_tpot_ms = Some(ms);
    }

    /// Records plain decoding with the host path (`threads` host threads): `ms` per token.
    pub fn record_host_plain(&mut self, threads: usize, ms: f64) {
        self.host_entry(threads).plain_tpot_ms = Some(ms);
    }

    fn host_entry(&mut self, threads: usize) -> &mut HostCandidates {
        self.host.get_or_insert(HostCandidates {
            threads,
            plain_tpot_ms: None,
            depth: 0,
            draft_tpot_ms: None,
        })
    }

    /// The fastest speculative (or depth-0) TPOT the sweep measured, ms.
    pub fn best_tpot_ms(&self) -> f64 {
        self.tpot_ms.iter().copied().fold(f64::INFINITY, f64::min)
    }

    /// Each measured depth with its TPOT in seconds: a start for [`crate::decode::AutoDepth::seed`].
    pub fn seconds_per_token(&self) -> Vec<(usize, f64)> {
        self.depths
            .iter()
            .zip(&self.tpot_ms)
            .map(|(&d, &ms)| (d, ms / 1e3))
            .collect()
    }

    /// Plain decoding without the draft measured faster than every depth with it (the host
    /// candidates left aside).
    pub fn prefers_plain(&self) -> Option<&PlainCandidate> {
        self.plain
            .as_ref()
            .filter(|p| p.tpot_ms < self.best_tpot_ms())
    }

    /// The fastest nonzero depth the sweep measured (the draft's candidate with the host path).
    pub fn best_draft_depth(&self) -> Option<usize> {
        self.depths
            .iter()
            .zip(&self.tpot_ms)
            .filter(|(&d, _)| d > 0)
            .min_by(|a, b| a.1.total_cmp(b.1))
            .map(|(&d, _)| d)
    }

    /// Every candidate measured, with its TPOT (ms): the draft's at its best depth.
    pub fn candidates(&self) -> Vec<(Candidate, f64)> {
        let mut out = vec![(Candidate::Draft, self.best_tpot_ms())];
        if let Some(p) = &self.plain {
            out.push((Candidate::Plain, p.tpot_ms));
        }
        if let Some(h) = &self.host {
            out.extend(h.plain_tpot_ms.map(|ms| (Candidate::Hybrid, ms)));
            out.extend(h.draft_tpot_ms.map(|ms| (Candidate::SpecterHybrid, ms)));
        }
        out
    }

    /// The fastest candidate measured (the draft when nothing else was).
    pub fn choice(&self) -> Candidate {
        self.choice_with(true)
    }

    /// [`Self::choice`], among the host path's candidates only when `host` allows them.
    pub fn choice_with(&self, host: bool) -> Candidate {
        let allowed: Vec<(Candidate, f64)> = self
            .candidates()
            .into_iter()
            .filter(|(c, _)| host || !c.host())
            .collect();
        fastest(&allowed).unwrap_or(Candidate::Draft)
    }

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
            return Err(mismatch(path, &self.key, &key));
        }
        Ok(self.best_depth)
    }

    /// Refuses a profile measured for another bundle, backend or device than `session`'s (the
    /// residency differs by design when the session runs the profile's plain candidate).
    pub fn check_machine(&self, session: &Session, path: &Path) -> Result<()> {
        let key = session_key(session)?;
        if (&key.manifest_sha256, &key.backend, &key.device)
            != (
                &self.key.manifest_sha256,
                &self.key.backend,
                &self.key.device,
            )
        {
            return Err(mismatch(path, &self.key, &key));
        }
        Ok(())
    }
}

fn mismatch(path: &Path, profiled: &ProfileKey, here: &ProfileKey) -> Error {
    Error::Request(format!(
        "the profile {} was measured for another bundle or machine ({profiled:?}), not this one ({here:?}): run specter-run profile again",
        path.display()
    ))
}

/// A profile measured at `depths` with these TPOTs (ms), and a plain candidate at 32 slots: the
/// one the tests of the profile's users (here and in specter-run) build their cases from.
#[doc(hidden)]
pub fn sample_profile(depths: Vec<usize>, tpot_ms: Vec<f64>, plain: Option<f64>) -> DepthProfile {
    DepthProfile {
        key: ProfileKey {
            manifest_sha256: "ab".into(),
            backend: "cuda".into(),
            device: "gpu".into(),
            residency: "16 of 64".into(),
        },
        prompt_tokens: 16,
        new_tokens: 32,
        acceptance: vec![0.5; depths.len()],
        best_depth: 1,
        depths,
        tpot_ms,
        plain: plain.map(|tpot_ms| PlainCandidate { slots: 32, tpot_ms }),
        host: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(tpot_ms: Vec<f64>, plain: Option<f64>) -> DepthProfile {
        sample_profile((0..tpot_ms.len()).collect(), tpot_ms, plain)
    }

    #[test]
    fn plain_is_preferred_only_when_faster_than_every_depth() {
        assert_eq!(profile(vec![40.0, 30.0, 35.0], None).prefers_plain(), None);
        assert_eq!(
            profile(vec![40.0, 30.0, 35.0], Some(31.0)).prefers_plain(),
            None
        );
        assert_eq!(
            profile(vec![40.0, 30.0, 35.0], Some(23.0)).prefers_plain(),
            Some(&PlainCandidate {
                slots: 32,
                tpot_ms: 23.0
            })
        );
        assert_eq!(profile(vec![40.0, 30.0, 35.0], None).best_tpot_ms(), 30.0);
    }

    #[test]
    fn the_fastest_candidate_wins_and_a_tie_goes_to_the_simpler() {
        use Candidate::*;
        assert_eq!(fastest(&[]), None);
        assert_eq!(
            fastest(&[
                (Draft, 30.0),
                (Plain, 25.0),
                (Hybrid, 20.0),
                (SpecterHybrid, 21.0)
            ]),
            Some(Hybrid)
        );
        assert_eq!(
            fastest(&[(SpecterHybrid, 9.5), (Hybrid, 12.0), (Draft, 10.0)]),
            Some(SpecterHybrid)
        );
        // Ties: plain before the draft, both before the host path, hybrid before specter-hybrid.
        assert_eq!(fastest(&[(Draft, 20.0), (Plain, 20.0)]), Some(Plain));
        assert_eq!(fastest(&[(Hybrid, 20.0), (Draft, 20.0)]), Some(Draft));
        assert_eq!(
            fastest(&[(SpecterHybrid, 20.0), (Hybrid, 20.0)]),
            Some(Hybrid)
        );
        // A failed or missing measurement never wins.
        assert_eq!(
            fastest(&[(Hybrid, f64::NAN), (Plain, 0.0), (Draft, 40.0)]),
            Some(Draft)
        );
        assert_eq!(fastest(&[(Hybrid, f64::INFINITY)]), None);
    }

    #[test]
    fn the_profile_chooses_among_every_measured_candidate() {
        let mut p = profile(vec![40.0, 30.0, 35.0], Some(31.0));
        assert_eq!(p.choice(), Candidate::Draft);
        assert_eq!(p.best_draft_depth(), Some(1));
        p.host = Some(HostCandidates {
            threads: 8,
            plain_tpot_ms: Some(29.0),
            depth: 1,
            draft_tpot_ms: None,
        });
        assert_eq!(p.choice(), Candidate::Hybrid);
        p.host.as_mut().unwrap().draft_tpot_ms = Some(28.0);
        assert_eq!(p.choice(), Candidate::SpecterHybrid);
        assert!(p.choice().draft() && p.choice().host());
        assert_eq!(p.choice_with(false), Candidate::Draft);
        // Depth 0 is no draft candidate for the host path.
        let zero_best = profile(vec![10.0, 30.0, 35.0], None);
        assert_eq!(zero_best.best_draft_depth(), Some(1));
        assert_eq!(profile(vec![10.0], None).best_draft_depth(), None);
    }

    #[test]
    fn profiles_written_before_the_plain_candidate_still_load() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.json");
        let mut value = serde_json::to_value(profile(vec![2.0, 1.0, 3.0], None)).unwrap();
        value.as_object_mut().unwrap().remove("plain");
        value.as_object_mut().unwrap().remove("host");
        std::fs::write(&path, value.to_string()).unwrap();
        let loaded = DepthProfile::load(&path).unwrap();
        assert_eq!(loaded.plain, None);
        assert_eq!(loaded.host, None);
        assert_eq!(loaded.best_depth, 1);
        std::fs::write(&path, "{\"depths\": 3}").unwrap();
        assert!(
            matches!(DepthProfile::load(&path), Err(Error::Request(m)) if m.contains("not a depth profile"))
        );
    }
}
