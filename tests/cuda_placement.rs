//! Tokens never depend on where the experts are: on the GPU, the target's logits at every
//! position are bitwise equal, and its greedy tokens over 64 steps equal, whether every routed
//! expert is in VRAM or one or half of each layer's are (lru and ondemand), with the host path
//! on and off, with pinned staging on and off, in target-only, Specter and SpecMoEOff decoding,
//! with passes recorded or run op by op, and with the fused kernels or their plain forms
//! (`CudaOptions::plain`). The draft's logits, call by call, do not depend on the target's
//! placement either.
//!
//! Run for every fixture and for a random model of DeepSeek-V2-Lite's real widths (3 layers): at
//! a fixture's tiny widths some paths coincide that do not at real ones (the fused add + norm +
//! products of a one-row step is taken from 256 columns on), and a random model's near-ties turn
//! any difference into other tokens within a few steps.
//!
//! These need an NVIDIA GPU, so they are ignored by default (see tests/common/gpu.rs);
//! `scripts/gpu-check.sh run placement` runs them on the GPU machine.

mod common;

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use common::{Fixture, FIXTURES};
use rand::{Rng, SeedableRng};
use specter::arch::{ArchConfig, MoeModel};
use specter::backend::cuda::{
    CudaBackend, CudaDevice, CudaOptions, HostExpertsConfig, HostPath, OffloadConfig, SplitExperts,
};
use specter::decode::{
    generate, generate_observed, DraftPrefetcher, FrequencyPrefetcher, GenerateOptions, Mode,
    Sampling,
};
use specter::model::{KvCache, LanguageModel, ModelInfo, NoHook, RouteHook, Variant};
use specter::offload::Policy;
use specter_convert::pack::{convert, ConvertOptions, Silent, TargetPrecision};
use specter_format::Bundle;

const NEW_TOKENS: usize = 64;

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn gpu_logits_do_not_depend_on_placement_on_any_fixture() {
    let device = Arc::new(common::gpu::device());
    let mut failures = Vec::new();
    for name in FIXTURES {
        let fixture = Fixture::load(name);
        let (_dir, bundle) = fixture.bundle();
        let prompts: Vec<Vec<u32>> = fixture.prompts().into_iter().take(2).collect();
        failures.extend(check_model(
            name,
            &device,
            Arc::new(bundle),
            &fixture.cfg,
            &prompts,
            2,
        ));
    }
    assert_none(&failures);
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn gpu_logits_do_not_depend_on_placement_at_deepseek_v2_lite_widths() {
    let device = Arc::new(common::gpu::device());
    let dir = tempfile::tempdir().expect("tempdir");
    let config = specter_convert::synth::preset_config_layers("deepseek-v2-lite", Some(3)).unwrap();
    let cfg = ArchConfig::from_config_json(&config).unwrap();
    let hf = dir.path().join("hf");
    let tensors = specter::arch::expected_tensors(&cfg);
    specter_convert::synth::write_checkpoint(&hf, &config, &tensors, 0, 4 << 30, 0.02).unwrap();
    let path = dir.path().join("dsv2-3l.specter");
    convert(&hf, &path, &ConvertOptions::default(), &Silent).expect("convert");
    std::fs::remove_dir_all(&hf).unwrap();
    let bundle = Arc::new(Bundle::open(&path).expect("open bundle"));
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(58);
    // Two prompts of 40 tokens, past the rows at which a prompt's dense products take tensor
    // cores; SPECTER_PLACEMENT_PROMPTS sets another count (a device call short of time).
    let count = std::env::var("SPECTER_PLACEMENT_PROMPTS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(2);
    let prompts: Vec<Vec<u32>> = (0..count)
        .map(|_| {
            (0..40)
                .map(|_| rng.random_range(3..cfg.vocab_size as u32))
                .collect()
        })
        .collect();
    assert_none(&check_model(
        "deepseek-v2-lite x3",
        &device,
        bundle,
        &cfg,
        &prompts,
        4,
    ));
}

/// Quantized targets: an INT8 target with a 4-bit draft, and an INT4 target with a 3-bit draft
/// (all row-layout kernels), on every fixture and on a 2-layer model of DeepSeek-V2-Lite's
/// widths, the host path's placements included.
#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn gpu_logits_do_not_depend_on_placement_at_every_target_precision() {
    let device = Arc::new(common::gpu::device());
    let mut failures = Vec::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let config = specter_convert::synth::preset_config_layers("deepseek-v2-lite", Some(2)).unwrap();
    let cfg = ArchConfig::from_config_json(&config).unwrap();
    let hf = dir.path().join("hf");
    let tensors = specter::arch::expected_tensors(&cfg);
    specter_convert::synth::write_checkpoint(&hf, &config, &tensors, 0, 4 << 30, 0.02).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(59);
    let prompts: Vec<Vec<u32>> = (0..1)
        .map(|_| {
            (0..16)
                .map(|_| rng.random_range(3..cfg.vocab_size as u32))
                .collect()
        })
        .collect();
    for (target, draft_bits) in [(TargetPrecision::Int8, 4), (TargetPrecision::Int4, 3)] {
        let opts = ConvertOptions {
            target,
            draft_bits: Some(draft_bits),
            ..ConvertOptions::default()
        };
        let what =
            |model: &str| format!("{model} ({} target, {draft_bits}-bit draft)", target.name());
        for name in FIXTURES {
            let fixture = Fixture::load(name);
            let (_dir, bundle) = fixture.bundle_with(&opts);
            let prompts: Vec<Vec<u32>> = fixture.prompts().into_iter().take(1).collect();
            failures.extend(check_model(
                &what(name),
                &device,
                Arc::new(bundle),
                &fixture.cfg,
                &prompts,
                2,
            ));
        }
        let path = dir
            .path()
            .join(format!("dsv2-2l-{}.specter", target.name()));
        convert(&hf, &path, &opts, &Silent).expect("convert");
        let bundle = Arc::new(Bundle::open(&path).expect("open bundle"));
        failures.extend(check_model(
            &what("deepseek-v2-lite x2"),
            &device,
            bundle,
            &cfg,
            &prompts,
            4,
        ));
    }
    assert_none(&failures);
}

/// Where the experts are and how the backend runs, for one decode.
#[derive(Clone)]
struct Placement {
    label: String,
    offload: Option<(usize, Policy, HostPath, Option<HostExpertsConfig>)>,
    options: CudaOptions,
}

impl Placement {
    fn resident(label: &str, options: CudaOptions) -> Self {
        Placement {
            label: label.into(),
            offload: None,
            options,
        }
    }

    fn offloaded(
        label: &str,
        slots: usize,
        policy: Policy,
        host_path: HostPath,
        host: Option<HostExpertsConfig>,
    ) -> Self {
        Placement {
            label: label.into(),
            offload: Some((slots, policy, host_path, host)),
            options: CudaOptions::default(),
        }
    }
}

/// Every placement and mode against all-resident target-only decoding with default options.
fn check_model(
    name: &str,
    device: &Arc<CudaDevice>,
    bundle: Arc<Bundle>,
    cfg: &ArchConfig,
    prompts: &[Vec<u32>],
    host_threads: usize,
) -> Vec<String> {
    let experts = cfg.moe.num_experts;
    let half = (experts / 2).max(1);
    let host = |link: f64, split| HostExpertsConfig {
        threads: host_threads,
        link_bytes_per_s: link,
        host_bytes_per_s: 50e9,
        split,
    };
    // The host path splitting misses with the link (and one miss a layer split across both),
    // and every miss on the host (a link a billion times slower).
    let shared_host = host(50e9, SplitExperts::Measured);
    let whole_host = host(50e9, SplitExperts::Never);
    let all_host = host(50.0, SplitExperts::Never);
    let off = |f: fn(&mut CudaOptions)| {
        let mut o = CudaOptions::default();
        f(&mut o);
        o
    };
    let placements = vec![
        Placement::resident("resident", CudaOptions::default()),
        Placement::resident("resident, op by op", off(|o| o.graphs = false)),
        Placement::resident("resident, plain kernels", off(|o| o.plain = true)),
        Placement::resident(
            "resident, plain kernels op by op",
            off(|o| {
                o.plain = true;
                o.graphs = false
            }),
        ),
        Placement::offloaded("lru 1 slot", 1, Policy::Lru, HostPath::Auto, None),
        Placement::offloaded("lru half", half, Policy::Lru, HostPath::Auto, None),
        Placement::offloaded(
            "ondemand half",
            half,
            Policy::OnDemand,
            HostPath::Auto,
            None,
        ),
        Placement::offloaded(
            "lru half, pinned staging",
            half,
            Policy::Lru,
            HostPath::PinnedStaging,
            None,
        ),
        Placement::offloaded(
            "lru half, host path",
            half,
            Policy::Lru,
            HostPath::Auto,
            Some(shared_host),
        ),
        Placement::offloaded(
            "lru half, host path, whole experts",
            half,
            Policy::Lru,
            HostPath::Auto,
            Some(whole_host),
        ),
        Placement::offloaded(
            "lru 1 slot, every miss on the host",
            1,
            Policy::Lru,
            HostPath::Auto,
            Some(all_host),
        ),
        Placement {
            options: off(|o| o.graphs = false),
            ..Placement::offloaded("lru 1 slot, op by op", 1, Policy::Lru, HostPath::Auto, None)
        },
        Placement {
            options: off(|o| o.plain = true),
            ..Placement::offloaded(
                "lru half, plain kernels",
                half,
                Policy::Lru,
                HostPath::Auto,
                None,
            )
        },
    ];

    let modes = [
        (Mode::Target, 1),
        (Mode::Specter, 4),
        (Mode::Specter, 16),
        (Mode::SpecMoeOff, 3),
    ];
    // Every difference found, so that one GPU run reports all of them, not only the first.
    let mut failures: Vec<String> = Vec::new();
    for (p, prompt) in prompts.iter().enumerate() {
        let reference = reference_run(device, &bundle, cfg, prompt);
        // The draft's rows, call by call, of the first Specter run at each depth.
        let mut draft_calls: HashMap<(String, usize), Vec<u64>> = HashMap::new();
        let mut compared = 0usize;
        for placement in &placements {
            let model = open(device, &bundle, cfg, placement);
            // Experts the host computed (whole or split) over this placement's decodes.
            let mut on_host = 0u64;
            for &(mode, depth) in &modes {
                let what = format!(
                    "{name} prompt {p}, {} {mode:?} depth {depth}",
                    placement.label
                );
                let tap = Tap::new(&model, Some(&reference));
                let (tokens, host) = decode(&tap, prompt, mode, depth);
                on_host += host;
                let seen = tap.seen.into_inner();
                if let Some(i) = first_difference(&tokens, &reference.tokens) {
                    failures.push(format!(
                        "{what}: tokens differ from all-resident target-only (first at index {i})"
                    ));
                }
                if let Some((pos, rel)) = seen.mismatch {
                    failures.push(format!(
                        "{what}: target logits at position {pos} differ from all-resident \
                         target-only's (max relative difference {rel:.3e})"
                    ));
                }
                let wanted: BTreeSet<usize> =
                    (prompt.len() - 1..prompt.len() - 1 + NEW_TOKENS).collect();
                let missing: Vec<usize> = wanted.difference(&seen.checked).copied().collect();
                if !missing.is_empty() {
                    failures.push(format!(
                        "{what}: no logits row of the reference's prefix at positions {missing:?}"
                    ));
                }
                compared += seen.checked.len();
                if mode.is_speculative() {
                    let first = draft_calls
                        .entry((format!("{mode:?}"), depth))
                        .or_insert_with(|| seen.draft.clone());
                    if *first != seen.draft {
                        failures.push(format!(
                            "{what}: the draft's logits differ from the first placement's \
                             (call {} of {} and {})",
                            first_difference(first, &seen.draft).unwrap_or(0),
                            first.len(),
                            seen.draft.len()
                        ));
                    }
                }
                // The production path (greedy choices on the device, chained where possible,
                // prefetch observers where experts are offloaded) gives the same tokens.
                let (plain, host) = decode(&model, prompt, mode, depth);
                on_host += host;
                if let Some(i) = first_difference(&plain, &reference.tokens) {
                    failures.push(format!(
                        "{what}, production path: tokens differ from all-resident target-only \
                         (first at index {i})"
                    ));
                }
            }
            if placement.offload.is_some() && placement.options.graphs {
                let graphs = model.backend().step_graph_stats().unwrap();
                if graphs.segment_replays == 0 {
                    failures.push(format!(
                        "{name} ({}): no segment was replayed: {graphs:?}",
                        placement.label
                    ));
                }
            }
            if matches!(placement.offload, Some((_, _, _, Some(_)))) && on_host == 0 {
                failures.push(format!(
                    "{name} ({}): no expert ran on the host",
                    placement.label
                ));
            }
        }
        eprintln!(
            "{name} prompt {p}: {} placements x {} modes, {compared} logits rows compared",
            placements.len(),
            modes.len()
        );
    }
    failures
}

/// Fails with every difference `failures` lists.
fn assert_none(failures: &[String]) {
    assert!(
        failures.is_empty(),
        "{} differences across placements:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// All-resident target-only decoding with default options: its tokens and the logits row at
/// each position of prompt and output.
struct Reference {
    /// Prompt, then the generated tokens.
    sequence: Vec<u32>,
    tokens: Vec<u32>,
    rows: Vec<Vec<f32>>,
}

fn reference_run(
    device: &Arc<CudaDevice>,
    bundle: &Arc<Bundle>,
    cfg: &ArchConfig,
    prompt: &[u32],
) -> Reference {
    let model = open(
        device,
        bundle,
        cfg,
        &Placement::resident("reference", CudaOptions::default()),
    );
    let tap = Tap::new(&model, None);
    let (tokens, _) = decode(&tap, prompt, Mode::Target, 1);
    let mut sequence = prompt.to_vec();
    sequence.extend(&tokens);
    let seen = tap.seen.into_inner();
    let rows = (0..sequence.len() - 1)
        .map(|pos| {
            seen.rows
                .iter()
                .find(|(prefix, _)| prefix[..] == sequence[..=pos])
                .map(|(_, row)| row.clone())
                .unwrap_or_else(|| panic!("the reference computed no row at position {pos}"))
        })
        .collect();
    Reference {
        sequence,
        tokens,
        rows,
    }
}

fn open(
    device: &Arc<CudaDevice>,
    bundle: &Arc<Bundle>,
    cfg: &ArchConfig,
    placement: &Placement,
) -> MoeModel<CudaBackend> {
    let offload = placement
        .offload
        .map(|(slots, policy, host_path, host_experts)| OffloadConfig {
            bundle: bundle.clone(),
            config: cfg.clone(),
            slots_per_layer: slots,
            policy,
            host_path,
            host_experts,
            link_pace_bytes_per_s: None,
        });
    let backend = CudaBackend::with_device(device.clone(), offload, &placement.options)
        .unwrap_or_else(|e| panic!("backend for {}: {e}", placement.label));
    MoeModel::load(cfg.clone(), bundle.as_ref(), backend).expect("load")
}

/// Greedy decoding of `prompt` as the product runs it: with offloaded experts the speculative
/// modes prefetch what the draft forecasts (route-frequency Top-M for SpecMoEOff). Returns the
/// tokens and how many experts the host computed (whole or split), read before the cache and
/// its counters are reset for the next decode.
fn decode<M: LanguageModel + Placed>(
    model: &M,
    prompt: &[u32],
    mode: Mode,
    depth: usize,
) -> (Vec<u32>, u64) {
    let opts = GenerateOptions {
        mode,
        max_new_tokens: NEW_TOKENS,
        depth,
        sampling: Sampling::greedy(),
        stop_at_eos: false,
    };
    let gpu = model.gpu();
    let offloaded = gpu.backend().offload_slots().unwrap().is_some();
    let tokens = match mode {
        Mode::Specter if offloaded => {
            let mut p = DraftPrefetcher::new(gpu.backend(), gpu.info(), 55e9).unwrap();
            let out = generate_observed(model, prompt, &opts, &mut p, &mut |_| {}).unwrap();
            assert!(p.take_error().is_none(), "prefetch failed");
            out.tokens
        }
        Mode::SpecMoeOff if offloaded => {
            let mut p = FrequencyPrefetcher::new(gpu.backend(), gpu.info()).unwrap();
            let out = generate_observed(model, prompt, &opts, &mut p, &mut |_| {}).unwrap();
            assert!(p.take_error().is_none(), "frequency prefetch failed");
            out.tokens
        }
        _ => {
            generate(model, prompt, &opts, &mut NoHook, &mut |_| {})
                .unwrap()
                .tokens
        }
    };
    let mut on_host = 0;
    if offloaded {
        let stats = gpu.backend().offload_stats().unwrap().expect("offloaded");
        on_host = stats.host_experts + stats.split_experts;
        // The next decode starts from an empty cache, as every placement's first one does.
        gpu.backend().reset_offload().unwrap();
    }
    (tokens, on_host)
}

/// The GPU model under a decode, whether tapped or not.
trait Placed {
    fn gpu(&self) -> &MoeModel<CudaBackend>;
}

impl Placed for MoeModel<CudaBackend> {
    fn gpu(&self) -> &MoeModel<CudaBackend> {
        self
    }
}

impl Placed for Tap<'_> {
    fn gpu(&self) -> &MoeModel<CudaBackend> {
        self.inner
    }
}

/// What a tapped decode computed.
#[derive(Default)]
struct Seen {
    /// Without a reference: every target row with the tokens at and before it.
    rows: Vec<(Vec<u32>, Vec<f32>)>,
    /// With a reference: positions whose row had the reference's prefix (each compared).
    checked: BTreeSet<usize>,
    /// The first compared row that differed: its position and largest relative difference.
    mismatch: Option<(usize, f64)>,
    /// A hash of every draft row, in call order.
    draft: Vec<u64>,
}

/// The GPU model, with every logits row a pass computes recorded or compared: a target row whose
/// tokens at and before it are the reference's prefix must equal the reference's row there.
/// Greedy choices are made on the host from the rows (`LanguageModel`'s defaults).
struct Tap<'m> {
    inner: &'m MoeModel<CudaBackend>,
    reference: Option<&'m Reference>,
    /// The tokens in each KV cache (by address): a Specter draft shares the target's.
    histories: RefCell<HashMap<usize, Vec<u32>>>,
    seen: RefCell<Seen>,
}

impl<'m> Tap<'m> {
    fn new(inner: &'m MoeModel<CudaBackend>, reference: Option<&'m Reference>) -> Self {
        Tap {
            inner,
            reference,
            histories: RefCell::new(HashMap::new()),
            seen: RefCell::new(Seen::default()),
        }
    }
}

impl LanguageModel for Tap<'_> {
    type Kv = <MoeModel<CudaBackend> as LanguageModel>::Kv;

    fn info(&self) -> &ModelInfo {
        self.inner.info()
    }

    fn new_kv(&self, capacity: usize) -> specter::Result<Self::Kv> {
        self.inner.new_kv(capacity)
    }

    fn forward(
        &self,
        variant: Variant,
        tokens: &[u32],
        kv: &mut Self::Kv,
        hook: &mut dyn RouteHook,
    ) -> specter::Result<Vec<f32>> {
        self.tap(variant, tokens, kv, hook, false)
    }

    // Prompts take the model's prompt arithmetic, as in decoding.
    fn prefill(
        &self,
        variant: Variant,
        tokens: &[u32],
        kv: &mut Self::Kv,
        hook: &mut dyn RouteHook,
    ) -> specter::Result<Vec<f32>> {
        self.tap(variant, tokens, kv, hook, true)
    }
}

impl Tap<'_> {
    /// The inner model's pass (its prefill where `prompt`), each target row checked or kept.
    fn tap(
        &self,
        variant: Variant,
        tokens: &[u32],
        kv: &mut <Self as LanguageModel>::Kv,
        hook: &mut dyn RouteHook,
        prompt: bool,
    ) -> specter::Result<Vec<f32>> {
        let start = kv.len();
        let key = kv as *const <Self as LanguageModel>::Kv as usize;
        let logits = if prompt {
            self.inner.prefill(variant, tokens, kv, hook)?
        } else {
            self.inner.forward(variant, tokens, kv, hook)?
        };
        let vocab = self.info().vocab_size;
        let mut histories = self.histories.borrow_mut();
        let history = histories.entry(key).or_default();
        history.truncate(start);
        history.extend_from_slice(tokens);
        let mut seen = self.seen.borrow_mut();
        for (i, row) in logits.chunks(vocab).enumerate() {
            let pos = start + i;
            let prefix = &history[..=pos];
            match (variant, self.reference) {
                (Variant::Draft, _) => seen.draft.push(hash_bits(row)),
                (Variant::Target, None) => seen.rows.push((prefix.to_vec(), row.to_vec())),
                (Variant::Target, Some(r)) => {
                    if pos < r.rows.len() && r.sequence[..=pos] == *prefix {
                        seen.checked.insert(pos);
                        let want = &r.rows[pos];
                        let same = want
                            .iter()
                            .zip(row)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        if !same && seen.mismatch.is_none() {
                            seen.mismatch = Some((pos, relative_difference(want, row)));
                        }
                    }
                }
            }
        }
        Ok(logits)
    }
}

fn hash_bits(row: &[f32]) -> u64 {
    row.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
        (h ^ v.to_bits() as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn relative_difference(want: &[f32], got: &[f32]) -> f64 {
    let scale = want
        .iter()
        .fold(0f64, |m, v| m.max(v.abs() as f64))
        .max(1e-30);
    let diff = want
        .iter()
        .zip(got)
        .fold(0f64, |m, (a, b)| m.max((*a as f64 - *b as f64).abs()));
    diff / scale
}

fn first_difference<T: PartialEq>(a: &[T], b: &[T]) -> Option<usize> {
    (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i))
}
