//! The route-fidelity probe over the real architectures: every fixture converted into a bundle
//! (RTN INT4 draft), a draft that equals its target exactly (experts on the INT4 grid), and
//! degraded drafts (experts swapped between ids, experts quantized from noise).

// The root crate's test helpers: fixtures (found from the repository root) and the GPU tests'
// convention.
#[path = "../../tests/common/mod.rs"]
mod common;

use common::{argmax, random_tokens, DraftExperts, Fixture, GridStore, FIXTURES};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specter::arch::MoeModel;
use specter::backend::cpu::Cpu;
use specter::model::{LanguageModel, NoHook, Route, RouteHook, Variant};
use specter::session::{BackendKind, Session};
use specter::Error;
use specter_convert::pack::{convert, ConvertOptions, Silent};
use specter_run::probe::{probe, render_json, render_text, ProbeOptions, ProbeReport};

/// The fixture's three prompts, each followed by its greedy continuation, back to back: text the
/// model itself finds likely, so the comparison is not only over noise.
fn fixture_sequence(fx: &Fixture) -> Vec<u32> {
    fx.prompts()
        .into_iter()
        .zip(fx.greedy())
        .flat_map(|(p, g)| p.into_iter().chain(g))
        .collect()
}

/// Every figure of a report is a share in [0, 1] (or a count in range), and the shapes match
/// the model.
fn assert_well_formed(name: &str, r: &ProbeReport, model: &impl LanguageModel, tokens: usize) {
    let info = model.info();
    let unit = |what: &str, v: f64| {
        assert!(
            (0.0..=1.0).contains(&v),
            "{name}: {what} = {v} outside [0, 1]"
        );
    };
    assert_eq!(r.tokens, tokens, "{name}");
    for (what, v) in [
        ("token_agreement", r.token_agreement),
        ("route_recall", r.route_recall),
        ("route_exact_match", r.route_exact_match),
        ("window_recall", r.window_recall),
        ("window_precision", r.window_precision),
    ] {
        unit(what, v);
    }
    assert!(r.route_recall >= r.route_exact_match, "{name}");
    assert_eq!(r.per_layer.len(), info.moe_layers.len(), "{name}");
    assert_eq!(r.expert_reuse.len(), info.moe_layers.len(), "{name}");
    let most_per_window = (info.num_experts.min(r.window.min(tokens) * info.top_k)) as f64;
    for (m, l) in r.per_layer.iter().enumerate() {
        assert_eq!((l.moe_layer, l.layer), (m, info.moe_layers[m]), "{name}");
        for (what, v) in [
            ("recall", l.recall),
            ("exact_match", l.exact_match),
            ("window_recall", l.window_recall),
            ("window_precision", l.window_precision),
            ("expert_reuse", r.expert_reuse[m]),
        ] {
            unit(what, v);
        }
        assert!(l.recall >= l.exact_match, "{name} layer {m}");
        for v in [l.target_window_unique, l.predicted_window_unique] {
            assert!(
                (info.top_k as f64..=most_per_window).contains(&v),
                "{name} layer {m}: {v} unique experts per window"
            );
        }
    }
}

/// Keeps every route of one variant, per MoE layer, in call order.
struct Routes {
    variant: Variant,
    per_layer: Vec<Vec<u32>>,
}

impl RouteHook for Routes {
    fn on_route(&mut self, r: Route<'_>) {
        if r.variant == self.variant {
            self.per_layer[r.moe_layer].extend_from_slice(r.topk);
        }
    }
}

/// Runs `variant` over `tokens` in calls of `call` positions and returns the arg-max per position
/// and the routes.
fn run_in_calls<M: LanguageModel>(
    model: &M,
    variant: Variant,
    tokens: &[u32],
    call: usize,
) -> (Vec<u32>, Routes) {
    let vocab = model.info().vocab_size;
    let mut routes = Routes {
        variant,
        per_layer: vec![Vec::new(); model.info().moe_layers.len()],
    };
    let mut kv = model.new_kv(tokens.len()).unwrap();
    let mut argmaxes = Vec::new();
    for chunk in tokens.chunks(call) {
        let logits = model.forward(variant, chunk, &mut kv, &mut routes).unwrap();
        assert_eq!(logits.len(), chunk.len() * vocab);
        argmaxes.extend(logits.chunks(vocab).map(argmax));
    }
    (argmaxes, routes)
}

/// Checks the report's token agreement, per-layer recall and exact match against a direct count
/// over passes run in calls of `call` positions.
fn assert_matches_direct_count<M: LanguageModel>(
    name: &str,
    report: &ProbeReport,
    model: &M,
    tokens: &[u32],
    call: usize,
) {
    let (target_argmax, target_routes) = run_in_calls(model, Variant::Target, tokens, call);
    let (draft_argmax, draft_routes) = run_in_calls(model, Variant::Draft, tokens, call);
    let agree = target_argmax
        .iter()
        .zip(&draft_argmax)
        .filter(|(a, b)| a == b)
        .count();
    assert_eq!(
        report.token_agreement,
        agree as f64 / tokens.len() as f64,
        "{name}"
    );
    let k = model.info().top_k;
    for (m, layer) in report.per_layer.iter().enumerate() {
        let (t, d) = (&target_routes.per_layer[m], &draft_routes.per_layer[m]);
        assert_eq!((t.len(), d.len()), (tokens.len() * k, tokens.len() * k));
        let mut shared = 0usize;
        let mut equal = 0usize;
        for (tr, dr) in t.chunks(k).zip(d.chunks(k)) {
            let hits = tr.iter().filter(|e| dr.contains(e)).count();
            shared += hits;
            equal += usize::from(hits == k);
        }
        let rows = tokens.len() as f64;
        let recall = shared as f64 / (k as f64 * rows);
        assert!((layer.recall - recall).abs() < 1e-12, "{name} layer {m}");
        assert!(
            (layer.exact_match - equal as f64 / rows).abs() < 1e-12,
            "{name} layer {m}"
        );
    }
}

#[test]
fn every_fixture_with_an_rtn_draft() {
    let mut table = String::from(
        "| fixture | tokens | token_agreement | route_recall | route_exact_match | window_recall (16) |\n\
         |---|---|---|---|---|---|\n",
    );
    for name in FIXTURES {
        let fx = Fixture::load(name);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.specter");
        convert(&fx.dir, &path, &ConvertOptions::default(), &Silent).unwrap();
        let session = Session::open(&path, BackendKind::Cpu).unwrap();
        let model = session.cpu_model().unwrap();
        assert!(model.has_draft(), "{name}");
        let tokens = fixture_sequence(&fx);
        let report = probe(model, &tokens, &ProbeOptions::default()).unwrap();
        assert_well_formed(name, &report, model, tokens.len());
        assert_eq!(report.window, 16);

        // The probe's figures equal a direct count over one-token-per-call passes (decoding's
        // way of running the model).
        assert_matches_direct_count(name, &report, model, &tokens, 1);

        let text = render_text(&report);
        assert!(text.contains("token agreement") && text.lines().count() > report.per_layer.len());
        let json: serde_json::Value = serde_json::from_str(&render_json(&report).unwrap()).unwrap();
        for key in [
            "tokens",
            "token_agreement",
            "route_recall",
            "route_exact_match",
            "window",
            "window_recall",
            "window_precision",
            "per_layer",
            "expert_reuse",
        ] {
            assert!(json.get(key).is_some(), "{name}: JSON lacks {key}");
        }
        assert_eq!(
            json["per_layer"].as_array().map(Vec::len),
            Some(report.per_layer.len())
        );

        println!("{name}:\n{text}");
        table.push_str(&format!(
            "| {name} | {} | {:.3} | {:.3} | {:.3} | {:.3} |\n",
            report.tokens,
            report.token_agreement,
            report.route_recall,
            report.route_exact_match,
            report.window_recall
        ));
    }
    println!("{table}");
}

fn grid_model(fx: &Fixture, draft: DraftExperts) -> MoeModel<Cpu> {
    let model = MoeModel::load(fx.cfg.clone(), &GridStore::new(fx, draft), Cpu).unwrap();
    assert!(model.has_draft());
    model
}

#[test]
fn a_draft_equal_to_its_target_scores_one_and_degraded_drafts_score_clearly_lower() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_9001);
    for name in FIXTURES {
        let fx = Fixture::load(name);
        let tokens = random_tokens(&mut rng, 40, fx.cfg.vocab_size);
        let opts = ProbeOptions { window: 8 };

        let exact = grid_model(&fx, DraftExperts::Exact);
        let r = probe(&exact, &tokens, &opts).unwrap();
        assert_well_formed(name, &r, &exact, tokens.len());
        assert_eq!(
            (r.token_agreement, r.route_recall, r.route_exact_match),
            (1.0, 1.0, 1.0),
            "{name}"
        );
        assert_eq!((r.window_recall, r.window_precision), (1.0, 1.0), "{name}");
        for l in &r.per_layer {
            assert_eq!(l.target_window_unique, l.predicted_window_unique, "{name}");
        }

        for degraded in [DraftExperts::Shifted, DraftExperts::Noise(rng.random())] {
            let model = grid_model(&fx, degraded);
            let d = probe(&model, &tokens, &opts).unwrap();
            assert_well_formed(name, &d, &model, tokens.len());
            println!(
                "{name} {degraded:?}: token agreement {:.3}, route recall {:.3}, exact {:.3}, \
                 window recall {:.3}",
                d.token_agreement, d.route_recall, d.route_exact_match, d.window_recall
            );
            // The target is the same model: its own figures do not move.
            assert_eq!(d.expert_reuse, r.expert_reuse, "{name} {degraded:?}");
            assert!(d.token_agreement < 0.8, "{name} {degraded:?}: {d:?}");
            assert!(d.route_exact_match < 0.95, "{name} {degraded:?}: {d:?}");
            // The first MoE layer sees the same input in both passes (nothing before it differs):
            // its routing stays exact; every later one degrades.
            assert_eq!(d.per_layer[0].exact_match, 1.0, "{name} {degraded:?}");
            for l in &d.per_layer[1..] {
                assert!(
                    l.exact_match < 0.85 && l.recall < 0.95,
                    "{name} {degraded:?}: {l:?}"
                );
            }
        }
    }
}

#[test]
fn the_window_depth_sets_the_union_figures() {
    let fx = Fixture::load("qwen2_moe");
    let model = grid_model(&fx, DraftExperts::Noise(0x5eed_9002));
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_9003);
    let tokens = random_tokens(&mut rng, 48, fx.cfg.vocab_size);
    let one = probe(&model, &tokens, &ProbeOptions { window: 1 }).unwrap();
    let wide = probe(&model, &tokens, &ProbeOptions { window: 16 }).unwrap();
    for (a, b) in one.per_layer.iter().zip(&wide.per_layer) {
        // A one-position window is the per-position comparison.
        assert!((a.window_recall - a.recall).abs() < 1e-12);
        assert_eq!(a.target_window_unique, fx.cfg.moe.top_k as f64);
        // Unions over more positions hold more experts, and the per-position figures do not
        // depend on the window.
        assert!(b.target_window_unique > a.target_window_unique);
        assert_eq!((a.recall, a.exact_match), (b.recall, b.exact_match));
    }
    assert_eq!((one.window, wide.window), (1, 16));
}

#[test]
fn a_long_sequence_gives_the_figures_of_one_whole_pass() {
    // Longer than the probe's largest forward call, so it runs in several.
    let fx = Fixture::load("olmoe");
    let model = grid_model(&fx, DraftExperts::Noise(0x5eed_9005));
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_9006);
    let tokens = random_tokens(&mut rng, 600, fx.cfg.vocab_size);
    let report = probe(&model, &tokens, &ProbeOptions::default()).unwrap();
    assert_well_formed("olmoe", &report, &model, tokens.len());
    assert_matches_direct_count("olmoe", &report, &model, &tokens, tokens.len());
}

#[test]
fn bad_requests_are_refused_with_the_reason() {
    let fx = Fixture::load("mixtral");
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_9004);
    let vocab = fx.cfg.vocab_size;
    let tokens = random_tokens(&mut rng, 6, vocab);
    let with_draft = grid_model(&fx, DraftExperts::Exact);
    let opts = ProbeOptions::default();

    let err = probe(&with_draft, &tokens[..1], &opts).unwrap_err();
    assert!(
        matches!(&err, Error::Request(m) if m.contains("at least 2 tokens")),
        "{err}"
    );

    let mut out_of_vocab = tokens.clone();
    out_of_vocab[3] = vocab as u32 + 7;
    let err = probe(&with_draft, &out_of_vocab, &opts).unwrap_err();
    assert!(
        matches!(&err, Error::Request(m) if m.contains(&(vocab + 7).to_string())),
        "{err}"
    );

    let err = probe(&with_draft, &tokens, &ProbeOptions { window: 0 }).unwrap_err();
    assert!(matches!(err, Error::Request(_)), "{err}");

    let too_long = random_tokens(&mut rng, with_draft.info().max_context + 1, vocab);
    let err = probe(&with_draft, &too_long, &opts).unwrap_err();
    assert!(matches!(err, Error::Request(_)), "{err}");

    // The plain checkpoint has no INT4 experts: the draft pass fails, and the error says so.
    let no_draft = fx.model();
    assert!(!no_draft.has_draft());
    let mut kv = no_draft.new_kv(4).unwrap();
    assert!(no_draft
        .forward(Variant::Target, &tokens[..2], &mut kv, &mut NoHook)
        .is_ok());
    let err = probe(&no_draft, &tokens, &opts).unwrap_err();
    assert!(
        matches!(&err, Error::Model(m) if m.contains("draft") && m.contains("probe")),
        "{err}"
    );
}

/// A depth sweep decodes as its caller samples (`bench --modes auto` calibrates with the bench's
/// own sampling): sampled at temperature 1, speculative acceptance is rejection sampling's, not
/// greedy's, and the tokens differ, so the measured depths do too.
#[test]
fn a_depth_sweep_samples_as_asked() {
    let fx = Fixture::load(FIXTURES[0]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.specter");
    convert(&fx.dir, &path, &ConvertOptions::default(), &Silent).unwrap();
    let session = Session::open(&path, BackendKind::Cpu).unwrap();
    let prompt = fx.prompts()[0].clone();
    let sweep =
        |sampling| specter_run::profile::sweep(&session, &prompt, 24, &[4], 1, sampling).unwrap();
    let greedy = sweep(specter::decode::Sampling::greedy());
    let again = sweep(specter::decode::Sampling::greedy());
    let sampled = sweep(specter::decode::Sampling {
        temperature: 1.0,
        top_p: 1.0,
        seed: 7,
    });
    assert_eq!(greedy.acceptance, again.acceptance, "greedy sweeps agree");
    assert_ne!(
        greedy.acceptance, sampled.acceptance,
        "a sampled sweep accepted exactly what a greedy one did: it did not sample"
    );
}
