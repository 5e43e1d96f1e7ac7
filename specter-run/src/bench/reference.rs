//! What every greedy bench run is checked against: all-resident target-only decoding, on the GPU
//! where every expert fits in VRAM, else the CPU reference. Speculative modes and target-only
//! modes at partial residency alike must give its tokens; any other token is an error.

use std::path::Path;

use specter::decode::{GenerateOptions, Mode};
use specter::session::{BackendKind, Session, SessionOptions};
use specter::{Error, Result};
use specter_format::SectionKind;

use super::{run_one, BenchMode, BenchOptions};

/// Greedy tokens per prompt, and where they were computed.
pub(super) struct Reference {
    pub tokens: Vec<Vec<u32>>,
    pub source: String,
}

/// Device memory kept free beside the weights for activations and the KV cache.
const WORKING_BYTES: u64 = 1 << 30;

/// Decodes every prompt target-only with every expert resident (untimed), on the bench's own
/// backend where the model fits, else on the CPU.
pub(super) fn compute(path: &Path, opts: &BenchOptions) -> Result<Reference> {
    let (backend, source) = match opts.backend {
        BackendKind::Cpu => (BackendKind::Cpu, "the CPU reference".to_string()),
        BackendKind::Cuda => match resident_shortfall(path)? {
            None => (
                BackendKind::Cuda,
                "target-only, every expert in VRAM".to_string(),
            ),
            Some(why) => (BackendKind::Cpu, format!("the CPU reference ({why})")),
        },
    };
    let mut session_opts = SessionOptions::new(backend);
    session_opts.with_draft = false;
    session_opts.cuda = opts.cuda.clone();
    session_opts.cuda.host_experts = None;
    let session = Session::open_with(path, &session_opts)?;
    let gen = GenerateOptions {
        mode: Mode::Target,
        max_new_tokens: opts.new_tokens,
        depth: 1,
        sampling: opts.sampling,
        stop_at_eos: false,
    };
    let tokens = opts
        .prompts
        .iter()
        .map(|prompt| Ok(run_one(&session, prompt, &gen, None)?.0.tokens))
        .collect::<Result<_>>()?;
    Ok(Reference { tokens, source })
}

/// Why every routed expert would not fit in device 0's free memory (beside the shared weights
/// and working memory), or `None` when it would.
fn resident_shortfall(path: &Path) -> Result<Option<String>> {
    let bundle = specter_format::Bundle::open(path)?;
    let need = (0..bundle.section_count())
        .filter(|&i| {
            matches!(
                bundle.section_kind(i),
                SectionKind::Shared | SectionKind::Experts { .. }
            )
        })
        .map(|i| bundle.section_bytes(i).len() as u64)
        .sum::<u64>()
        + WORKING_BYTES;
    let device = specter::backend::cuda::CudaDevice::open(0)?;
    let (free, _) = device.memory_info()?;
    Ok((need > free as u64).then(|| {
        format!(
            "all resident needs {:.1} GB, the GPU has {:.1} GB free",
            need as f64 / 1e9,
            free as f64 / 1e9
        )
    }))
}

/// The error for a greedy run whose tokens are not the reference's: the mode, the prompt and
/// the first index that differs.
pub(super) fn mismatch(
    mode: BenchMode,
    prompt: usize,
    repeat: usize,
    got: &[u32],
    want: &[u32],
    source: &str,
) -> Option<Error> {
    let at = (0..got.len().max(want.len())).find(|&i| got.get(i) != want.get(i))?;
    let show = |t: Option<&u32>| t.map_or("nothing".to_string(), |t| t.to_string());
    Some(Error::Model(format!(
        "bench: mode {} on prompt {prompt} (repeat {repeat}) is not lossless: its tokens leave \
         {source}'s at index {at} ({} instead of {})",
        mode.name(),
        show(got.get(at)),
        show(want.get(at)),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mismatch_names_the_mode_the_prompt_and_the_first_index() {
        assert!(mismatch(BenchMode::Lru, 0, 0, &[1, 2, 3], &[1, 2, 3], "r").is_none());
        let err = mismatch(
            BenchMode::Lru,
            2,
            1,
            &[1, 2, 9, 4],
            &[1, 2, 3, 4],
            "the GPU's",
        )
        .unwrap()
        .to_string();
        assert!(
            err.contains("mode lru on prompt 2 (repeat 1)")
                && err.contains("at index 2 (9 instead of 3)"),
            "{err}"
        );
        let err = mismatch(BenchMode::Specter, 0, 0, &[1], &[1, 5], "r")
            .unwrap()
            .to_string();
        assert!(err.contains("at index 1 (nothing instead of 5)"), "{err}");
    }
}
