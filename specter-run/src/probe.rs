//! Route fidelity: how well the INT4 draft's routing forecasts the FP16 target's.
//!
//! The whole scheme rests on the draft routing to the experts the target will need. The probe
//! measures that directly, teacher-forced over one token sequence: one target pass and one draft
//! pass (each with a fresh cache) over the same tokens, then a per-position, per-MoE-layer
//! comparison of the top-k expert sets, plus the window figures the prefetcher cares about: over
//! `window` consecutive positions (a verification window), how much of the target's union of
//! experts the draft's union covers.
//!
//! ```no_run
//! use std::path::Path;
//!
//! use specter_convert::pack::read_calibration_tokens;
//! use specter::session::{BackendKind, Session};
//! use specter_run::probe::{probe, render_text, ProbeOptions, DEFAULT_CALIBRATION_TOKENS};
//!
//! # fn main() -> specter::Result<()> {
//! let session = Session::open(Path::new("model.specter"), BackendKind::Cpu)?;
//! let tokens = read_calibration_tokens(
//!     Path::new("calibration.txt"),
//!     session.tokenizer.as_ref(),
//!     DEFAULT_CALIBRATION_TOKENS,
//! )?;
//! let report = probe(session.cpu_model()?, &tokens, &ProbeOptions { window: 16 })?;
//! print!("{}", render_text(&report));
//! # Ok(())
//! # }
//! ```

use serde::Serialize;
use specter::model::{LanguageModel, Route, RouteHook, Variant};
use specter::{Error, Result};

/// Verification window depth used for the window figures when none is given.
pub const DEFAULT_WINDOW: usize = 16;

/// A sensible cap on the tokens read from a calibration file: enough positions for stable
/// shares, few enough for two passes of a large model to stay quick.
pub const DEFAULT_CALIBRATION_TOKENS: usize = 2048;

/// Most positions run in one forward call.
const PASS_CHUNK: usize = 256;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeOptions {
    /// Positions per window for the union figures (the verify window depth K).
    pub window: usize,
}

impl Default for ProbeOptions {
    fn default() -> Self {
        ProbeOptions {
            window: DEFAULT_WINDOW,
        }
    }
}

/// The figures of one MoE layer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerFidelity {
    /// Decoder layer index.
    pub layer: usize,
    /// Index among the MoE layers.
    pub moe_layer: usize,
    /// Mean over positions of |draft top-k ∩ target top-k| / k.
    pub recall: f64,
    /// Share of positions where the draft's top-k set equals the target's.
    pub exact_match: f64,
    /// Mean number of distinct experts the target routes to in one window.
    pub target_window_unique: f64,
    /// Mean number of distinct experts the draft routes to in one window (what a prefetcher
    /// driven by the draft would fetch).
    pub predicted_window_unique: f64,
    /// Share of the target's window unions covered by the draft's window unions (summed over
    /// windows).
    pub window_recall: f64,
    /// Share of the draft's window unions the target actually used (summed over windows).
    pub window_precision: f64,
}

/// Route fidelity of a draft against its target over one teacher-forced token sequence.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProbeReport {
    /// Positions compared.
    pub tokens: usize,
    /// Share of positions where the draft's arg-max token equals the target's.
    pub token_agreement: f64,
    /// Mean over MoE layers of [`LayerFidelity::recall`].
    pub route_recall: f64,
    /// Mean over MoE layers of [`LayerFidelity::exact_match`].
    pub route_exact_match: f64,
    /// Positions per window.
    pub window: usize,
    /// Mean over MoE layers of [`LayerFidelity::window_recall`].
    pub window_recall: f64,
    /// Mean over MoE layers of [`LayerFidelity::window_precision`].
    pub window_precision: f64,
    pub per_layer: Vec<LayerFidelity>,
    /// Per MoE layer: mean over positions t >= 1 of the share of the target's top-k at t that was
    /// also in its top-k at t - 1 (how much a one-step expert cache would reuse).
    pub expert_reuse: Vec<f64>,
}

/// Runs the target and the draft teacher-forced over `tokens` and compares their routing.
///
/// Errors: fewer than two tokens, a zero window, a sequence longer than the model's context, ids
/// outside the vocabulary (the model's [`Error::Request`]), and a model without draft experts
/// (the draft pass's error, with what it means for the probe).
pub fn probe<M: LanguageModel>(
    model: &M,
    tokens: &[u32],
    opts: &ProbeOptions,
) -> Result<ProbeReport> {
    if tokens.len() < 2 {
        return Err(Error::Request(format!(
            "the route-fidelity probe needs at least 2 tokens, got {}",
            tokens.len()
        )));
    }
    if opts.window == 0 {
        return Err(Error::Request(
            "the probe's window must be at least 1 position".into(),
        ));
    }
    let info = model.info();
    let shape = RouteShape {
        moe_layers: info.moe_layers.len(),
        num_experts: info.num_experts,
        top_k: info.top_k,
        rows: tokens.len(),
    };
    if shape.moe_layers == 0 || shape.top_k == 0 || shape.num_experts == 0 {
        return Err(Error::Model(format!(
            "the model reports {} MoE layers, {} experts, top-{}: there is no routing to probe",
            shape.moe_layers, shape.num_experts, shape.top_k
        )));
    }

    let target = run_pass(model, Variant::Target, tokens, &shape)?;
    let draft = run_pass(model, Variant::Draft, tokens, &shape).map_err(|e| match e {
        Error::Model(msg) => Error::Model(format!(
            "the route-fidelity probe compares the draft with the target, and the draft pass \
             failed (a bundle needs its INT4 draft experts for this): {msg}"
        )),
        other => other,
    })?;

    let agreeing = target
        .argmax
        .iter()
        .zip(&draft.argmax)
        .filter(|(t, d)| t == d)
        .count();
    let token_agreement = agreeing as f64 / tokens.len() as f64;

    let per_layer: Vec<LayerFidelity> = (0..shape.moe_layers)
        .map(|m| {
            compare_layer(
                info.moe_layers[m],
                m,
                &target.routes[m],
                &draft.routes[m],
                &shape,
                opts.window,
            )
        })
        .collect();
    let expert_reuse = target
        .routes
        .iter()
        .map(|ids| consecutive_reuse(ids, shape.top_k))
        .collect();
    let mean = |f: fn(&LayerFidelity) -> f64| -> f64 {
        per_layer.iter().map(f).sum::<f64>() / per_layer.len() as f64
    };
    Ok(ProbeReport {
        tokens: tokens.len(),
        token_agreement,
        route_recall: mean(|l| l.recall),
        route_exact_match: mean(|l| l.exact_match),
        window: opts.window,
        window_recall: mean(|l| l.window_recall),
        window_precision: mean(|l| l.window_precision),
        per_layer,
        expert_reuse,
    })
}

/// What the routing of one pass must look like.
struct RouteShape {
    moe_layers: usize,
    num_experts: usize,
    top_k: usize,
    rows: usize,
}

/// One pass's result: per MoE layer the row-major `[rows, top_k]` expert ids, and per row the
/// arg-max token.
struct PassRoutes {
    routes: Vec<Vec<u32>>,
    argmax: Vec<u32>,
}

/// Keeps the routing of one variant, checking it against the model's declared shape.
struct RouteRecorder<'s> {
    variant: Variant,
    shape: &'s RouteShape,
    routes: Vec<Vec<u32>>,
    /// The first inconsistency seen (a hook cannot return an error itself).
    fault: Option<String>,
}

impl RouteHook for RouteRecorder<'_> {
    fn on_route(&mut self, route: Route<'_>) {
        let Route {
            variant,
            layer,
            moe_layer,
            top_k,
            topk,
        } = route;
        if variant != self.variant || self.fault.is_some() {
            return;
        }
        let shape = self.shape;
        if moe_layer >= shape.moe_layers {
            self.fault = Some(format!(
                "layer {layer} reported MoE layer index {moe_layer}, but the model has {} MoE layers",
                shape.moe_layers
            ));
        } else if top_k != shape.top_k {
            self.fault = Some(format!(
                "layer {layer} routed top-{top_k}, the model declares top-{}",
                shape.top_k
            ));
        } else if let Some(&bad) = topk.iter().find(|&&e| e as usize >= shape.num_experts) {
            self.fault = Some(format!(
                "layer {layer} routed to expert {bad}, the model has {} experts",
                shape.num_experts
            ));
        } else {
            self.routes[moe_layer].extend_from_slice(topk);
        }
    }
}

fn run_pass<M: LanguageModel>(
    model: &M,
    variant: Variant,
    tokens: &[u32],
    shape: &RouteShape,
) -> Result<PassRoutes> {
    let vocab = model.info().vocab_size;
    let mut kv = model.new_kv(tokens.len())?;
    let mut recorder = RouteRecorder {
        variant,
        shape,
        routes: vec![Vec::with_capacity(shape.rows * shape.top_k); shape.moe_layers],
        fault: None,
    };
    // The batched path computes each row exactly as a sequential pass would (the model's
    // exactness contract), so calls of many positions give the teacher-forced routing; calls of
    // at most PASS_CHUNK positions bound the logits (and activations) held at once on long
    // calibration sequences.
    let mut argmax_ids = Vec::with_capacity(shape.rows);
    for chunk in tokens.chunks(PASS_CHUNK) {
        let logits = model.forward(variant, chunk, &mut kv, &mut recorder)?;
        if vocab == 0 || logits.len() != chunk.len() * vocab {
            return Err(Error::Model(format!(
                "{variant:?} pass returned {} logits for {} positions of vocabulary {vocab}",
                logits.len(),
                chunk.len()
            )));
        }
        argmax_ids.extend(logits.chunks_exact(vocab).map(argmax));
    }
    if let Some(fault) = recorder.fault {
        return Err(Error::Model(format!("{variant:?} pass: {fault}")));
    }
    for (m, ids) in recorder.routes.iter().enumerate() {
        if ids.len() != shape.rows * shape.top_k {
            return Err(Error::Model(format!(
                "{variant:?} pass: MoE layer {m} reported {} expert ids for {} positions of \
                 top-{} (expected {})",
                ids.len(),
                shape.rows,
                shape.top_k,
                shape.rows * shape.top_k
            )));
        }
    }
    Ok(PassRoutes {
        routes: recorder.routes,
        argmax: argmax_ids,
    })
}

/// Index of the largest value (the first one on ties; NaNs never win).
fn argmax(row: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in row.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

/// A row's experts as a sorted set.
fn expert_set(row: &[u32]) -> Vec<u32> {
    let mut s = row.to_vec();
    s.sort_unstable();
    s.dedup();
    s
}

/// |a ∩ b| for sorted sets.
fn intersection(a: &[u32], b: &[u32]) -> usize {
    let (mut i, mut j, mut n) = (0, 0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                n += 1;
                i += 1;
                j += 1;
            }
        }
    }
    n
}

/// Windows of `window` consecutive positions over `rows` positions, as (count, positions per
/// window). A trailing partial window is dropped when at least one full window exists (it would
/// understate the unions); a sequence shorter than one window is a single window.
fn windows(rows: usize, window: usize) -> (usize, usize) {
    if rows < window {
        (1, rows)
    } else {
        (rows / window, window)
    }
}

fn compare_layer(
    layer: usize,
    moe_layer: usize,
    target: &[u32],
    draft: &[u32],
    shape: &RouteShape,
    window: usize,
) -> LayerFidelity {
    let k = shape.top_k;
    let target_sets: Vec<Vec<u32>> = target.chunks_exact(k).map(expert_set).collect();
    let draft_sets: Vec<Vec<u32>> = draft.chunks_exact(k).map(expert_set).collect();
    let rows = target_sets.len();

    let mut recall_sum = 0.0;
    let mut exact = 0usize;
    for (t, d) in target_sets.iter().zip(&draft_sets) {
        recall_sum += intersection(t, d) as f64 / k as f64;
        exact += usize::from(t == d);
    }

    let mut target_in = vec![false; shape.num_experts];
    let mut draft_in = vec![false; shape.num_experts];
    let (mut target_total, mut draft_total, mut both_total) = (0usize, 0usize, 0usize);
    let (count, len) = windows(rows, window);
    for w in 0..count {
        target_in.fill(false);
        draft_in.fill(false);
        for r in w * len..(w + 1) * len {
            target_sets[r]
                .iter()
                .for_each(|&e| target_in[e as usize] = true);
            draft_sets[r]
                .iter()
                .for_each(|&e| draft_in[e as usize] = true);
        }
        for (&t, &d) in target_in.iter().zip(&draft_in) {
            target_total += usize::from(t);
            draft_total += usize::from(d);
            both_total += usize::from(t && d);
        }
    }
    let share = |num: usize, den: usize| {
        if den == 0 {
            1.0
        } else {
            num as f64 / den as f64
        }
    };
    LayerFidelity {
        layer,
        moe_layer,
        recall: recall_sum / rows as f64,
        exact_match: exact as f64 / rows as f64,
        target_window_unique: target_total as f64 / count as f64,
        predicted_window_unique: draft_total as f64 / count as f64,
        window_recall: share(both_total, target_total),
        window_precision: share(both_total, draft_total),
    }
}

/// Mean over positions t >= 1 of |top-k(t) ∩ top-k(t-1)| / k.
fn consecutive_reuse(ids: &[u32], k: usize) -> f64 {
    let sets: Vec<Vec<u32>> = ids.chunks_exact(k).map(expert_set).collect();
    if sets.len() < 2 {
        return 0.0;
    }
    let reused: f64 = sets
        .windows(2)
        .map(|p| intersection(&p[1], &p[0]) as f64 / k as f64)
        .sum();
    reused / (sets.len() - 1) as f64
}

/// A readable table of the report.
pub fn render_text(r: &ProbeReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "route fidelity, draft vs target, teacher-forced over {} tokens",
        r.tokens
    );
    let _ = writeln!(s, "  token agreement    {:.4}", r.token_agreement);
    let _ = writeln!(s, "  route recall       {:.4}", r.route_recall);
    let _ = writeln!(s, "  route exact match  {:.4}", r.route_exact_match);
    let _ = writeln!(
        s,
        "  window {:<3}         recall {:.4}  precision {:.4}",
        r.window, r.window_recall, r.window_precision
    );
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "{:>5} {:>4} {:>7} {:>7} {:>9} {:>9} {:>8} {:>8} {:>7}",
        "layer", "moe", "recall", "exact", "tgt/win", "drf/win", "w.recall", "w.prec", "reuse"
    );
    for (l, reuse) in r.per_layer.iter().zip(&r.expert_reuse) {
        let _ = writeln!(
            s,
            "{:>5} {:>4} {:>7.4} {:>7.4} {:>9.2} {:>9.2} {:>8.4} {:>8.4} {:>7.4}",
            l.layer,
            l.moe_layer,
            l.recall,
            l.exact_match,
            l.target_window_unique,
            l.predicted_window_unique,
            l.window_recall,
            l.window_precision,
            reuse
        );
    }
    s
}

/// The report as pretty-printed JSON (field names as in [`ProbeReport`]).
pub fn render_json(r: &ProbeReport) -> Result<String> {
    serde_json::to_string_pretty(r)
        .map_err(|e| Error::Io(format!("cannot serialize the probe report: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(experts: usize, k: usize, rows: usize) -> RouteShape {
        RouteShape {
            moe_layers: 1,
            num_experts: experts,
            top_k: k,
            rows,
        }
    }

    #[test]
    fn layer_figures_match_a_hand_count() {
        // 4 positions of top-2 over 6 experts, windows of 2.
        let target = [0, 1, 2, 3, 1, 0, 4, 5];
        let draft = [1, 0, 2, 4, 1, 0, 5, 3];
        let l = compare_layer(7, 0, &target, &draft, &shape(6, 2, 4), 2);
        // Per position overlap: 2, 1, 2, 1 of 2.
        assert_eq!(l.recall, 0.75);
        assert_eq!(l.exact_match, 0.5);
        // Window 0: target {0,1,2,3}, draft {0,1,2,4}; window 1: target {0,1,4,5}, draft {0,1,3,5}.
        assert_eq!(l.target_window_unique, 4.0);
        assert_eq!(l.predicted_window_unique, 4.0);
        assert_eq!(l.window_recall, 6.0 / 8.0);
        assert_eq!(l.window_precision, 6.0 / 8.0);
        assert_eq!(l.layer, 7);
    }

    #[test]
    fn window_recall_and_precision_differ_when_the_draft_overshoots() {
        // One window of 3 positions; the draft covers the target's union and two more experts.
        let target = [0, 1, 0, 1, 1, 0];
        let draft = [0, 1, 2, 3, 1, 0];
        let l = compare_layer(0, 0, &target, &draft, &shape(4, 2, 3), 8);
        assert_eq!(l.window_recall, 1.0);
        assert_eq!(l.window_precision, 0.5);
        assert_eq!(l.predicted_window_unique, 4.0);
        assert_eq!(l.target_window_unique, 2.0);
        assert!((l.recall - 2.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn windows_drop_only_a_trailing_partial_window() {
        assert_eq!(windows(5, 16), (1, 5));
        assert_eq!(windows(35, 16), (2, 16));
        assert_eq!(windows(4, 2), (2, 2));
    }

    #[test]
    fn reuse_counts_experts_kept_from_the_previous_position() {
        let ids = [0, 1, 1, 2, 3, 4, 4, 3];
        // Overlaps with the previous position: 1, 0, 2 of 2.
        assert_eq!(consecutive_reuse(&ids, 2), 0.5);
    }

    #[test]
    fn argmax_takes_the_first_maximum_and_skips_nan() {
        assert_eq!(argmax(&[0.5, 2.0, 2.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -3.0, -2.0]), 2);
    }
}
