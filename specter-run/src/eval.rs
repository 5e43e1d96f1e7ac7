//! Quality of a bundle against a reference bundle of the same model (normally its FP16 target),
//! measured as llama.cpp's `perplexity --kl-divergence` measures a quantized model: both models run
//! teacher-forced over the same text, in windows of `context` tokens, and at every position their
//! next-token distributions are compared (KL divergence of the reference's from the tested one's,
//! and whether their top tokens agree), beside each one's perplexity on the text.
//!
//! The bundle's draft is judged the same way against the reference, and against its own target
//! as the speculative loop sees it: how often its greedy token is the target's (greedy acceptance,
//! teacher-forced) and how much of the target's routing it forecasts ([`crate::probe`]).

use serde::Serialize;
use specter::model::{LanguageModel, NoHook, Variant};
use specter::{Error, Result};

use crate::probe::{probe, ProbeOptions};

/// Tokens per window when none is given.
pub const DEFAULT_CONTEXT: usize = 512;
/// Most tokens read from the text when no cap is given.
pub const DEFAULT_TOKENS: usize = 4096;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvalOptions {
    /// Tokens per teacher-forced window.
    pub context: usize,
    /// Positions of each window left unscored: 0 scores from its first token on (the prediction
    /// of its second); llama.cpp's `perplexity` scores only a window's second half, which
    /// `context / 2` reproduces.
    pub score_from: usize,
}

impl Default for EvalOptions {
    fn default() -> Self {
        EvalOptions {
            context: DEFAULT_CONTEXT,
            score_from: 0,
        }
    }
}

/// One model's next-token distributions against the reference's.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Agreement {
    /// Positions scored.
    pub positions: usize,
    /// Mean over positions of KL(reference || tested), in nats.
    pub mean_kl: f64,
    /// The 99th percentile and the largest of those divergences.
    pub p99_kl: f64,
    pub max_kl: f64,
    /// Share of positions where both models' most likely token is the same.
    pub top1_agreement: f64,
    /// The tested model's perplexity on the text.
    pub perplexity: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EvalReport {
    pub tokens: usize,
    pub context: usize,
    pub score_from: usize,
    /// The reference's own perplexity on the text.
    pub reference_perplexity: f64,
    /// The bundle's target against the reference.
    pub target: Agreement,
    /// The bundle's draft against the reference.
    pub draft: Agreement,
    /// Share of positions where the draft's greedy token is the bundle's target's.
    pub draft_acceptance: f64,
    /// Mean over MoE layers and positions of the share of the target's top-k experts the draft
    /// also routed to.
    pub route_recall: f64,
}

/// Accumulates one model's per-position figures.
#[derive(Default)]
struct Scores {
    kl: Vec<f64>,
    agree: usize,
    nll: f64,
}

impl Scores {
    fn finish(mut self) -> Agreement {
        let n = self.kl.len();
        self.kl.sort_by(f64::total_cmp);
        let at = |q: f64| self.kl[((n as f64 * q) as usize).min(n - 1)];
        Agreement {
            positions: n,
            mean_kl: self.kl.iter().sum::<f64>() / n as f64,
            p99_kl: at(0.99),
            max_kl: self.kl[n - 1],
            top1_agreement: self.agree as f64 / n as f64,
            perplexity: (self.nll / n as f64).exp(),
        }
    }
}

/// `log_softmax(row)` in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row
        .iter()
        .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
    let sum: f64 = row.iter().map(|&v| (f64::from(v) - max).exp()).sum();
    let log_sum = max + sum.ln();
    row.iter().map(|&v| f64::from(v) - log_sum).collect()
}

/// Index of the largest value (the first on ties).
fn argmax(row: &[f64]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// KL(p || q) of two log-distributions.
fn kl(log_p: &[f64], log_q: &[f64]) -> f64 {
    log_p
        .iter()
        .zip(log_q)
        .map(|(&lp, &lq)| {
            if lp == f64::NEG_INFINITY {
                0.0
            } else {
                lp.exp() * (lp - lq)
            }
        })
        .sum::<f64>()
        .max(0.0)
}

fn forward<M: LanguageModel>(model: &M, variant: Variant, window: &[u32]) -> Result<Vec<f32>> {
    let mut kv = model.new_kv(window.len())?;
    let logits = model.forward(variant, window, &mut kv, &mut NoHook)?;
    let vocab = model.info().vocab_size;
    if logits.len() != window.len() * vocab {
        return Err(Error::Model(format!(
            "{variant:?} pass returned {} logits for {} positions of vocabulary {vocab}",
            logits.len(),
            window.len()
        )));
    }
    Ok(logits)
}

/// Runs `tested` (target and draft) and `reference` (target) over `tokens` and compares them.
///
/// Errors: fewer than two tokens, a window under two tokens or beyond either model's context, the
/// two models' vocabularies differing, and a `tested` model without a draft.
pub fn eval<T: LanguageModel, R: LanguageModel>(
    tested: &T,
    reference: &R,
    tokens: &[u32],
    opts: &EvalOptions,
) -> Result<EvalReport> {
    if tokens.len() < 2 {
        return Err(Error::Request(format!(
            "eval needs at least 2 tokens of text, got {}",
            tokens.len()
        )));
    }
    let max_context = tested.info().max_context.min(reference.info().max_context);
    if opts.context < 2 || opts.context > max_context {
        return Err(Error::Request(format!(
            "--context {}: a window holds 2 to {max_context} tokens (the models' context)",
            opts.context
        )));
    }
    if opts.score_from + 1 >= opts.context {
        return Err(Error::Request(format!(
            "--score-from {}: a window of {} tokens scores its positions {} to {}; the first \
             scored one must be below the last",
            opts.score_from,
            opts.context,
            0,
            opts.context - 2
        )));
    }
    let vocab = tested.info().vocab_size;
    if reference.info().vocab_size != vocab {
        return Err(Error::Request(format!(
            "the bundle's vocabulary has {vocab} tokens and the reference's {}: they are not \
             the same model",
            reference.info().vocab_size
        )));
    }
    let (mut target, mut draft, mut reference_nll) = (Scores::default(), Scores::default(), 0.0);
    let (mut accepted, mut recall_sum, mut recall_positions) = (0usize, 0.0f64, 0usize);
    for window in tokens
        .chunks(opts.context)
        .filter(|w| w.len() >= opts.score_from + 2)
    {
        let want = forward(reference, Variant::Target, window)?;
        let got = forward(tested, Variant::Target, window)?;
        let drafted = forward(tested, Variant::Draft, window)?;
        for i in opts.score_from..window.len() - 1 {
            let next = window[i + 1] as usize;
            let row = |l: &[f32]| log_softmax(&l[i * vocab..(i + 1) * vocab]);
            let (r, t, d) = (row(&want), row(&got), row(&drafted));
            reference_nll -= r[next];
            let top = argmax(&r);
            for (scores, q) in [(&mut target, &t), (&mut draft, &d)] {
                scores.kl.push(kl(&r, q));
                scores.agree += usize::from(argmax(q) == top);
                scores.nll -= q[next];
            }
            accepted += usize::from(argmax(&d) == argmax(&t));
        }
        let routes = probe(tested, window, &ProbeOptions { window: 1 })?;
        recall_sum += routes.route_recall * window.len() as f64;
        recall_positions += window.len();
    }
    if target.kl.is_empty() {
        return Err(Error::Request(format!(
            "{} tokens leave no window with a position to score (--context {}, --score-from {})",
            tokens.len(),
            opts.context,
            opts.score_from
        )));
    }
    let target = target.finish();
    let positions = target.positions;
    Ok(EvalReport {
        tokens: tokens.len(),
        context: opts.context,
        score_from: opts.score_from,
        reference_perplexity: (reference_nll / positions as f64).exp(),
        target,
        draft: draft.finish(),
        draft_acceptance: accepted as f64 / positions as f64,
        route_recall: recall_sum / recall_positions as f64,
    })
}

pub fn render_text(r: &EvalReport, tested: &str, reference: &str) -> String {
    let line = |name: &str, a: &Agreement| {
        format!(
            "{name:<8} {:>10.6} {:>10.6} {:>10.6} {:>9.2}% {:>11.4}\n",
            a.mean_kl,
            a.p99_kl,
            a.max_kl,
            a.top1_agreement * 100.0,
            a.perplexity
        )
    };
    let mut out = format!(
        "{tested} against {reference}: {} tokens in windows of {}, {} positions scored\n\n",
        r.tokens, r.context, r.target.positions
    );
    out += &format!(
        "{:<8} {:>10} {:>10} {:>10} {:>10} {:>11}\n",
        "", "mean KL", "p99 KL", "max KL", "top-1", "perplexity"
    );
    out += &line("target", &r.target);
    out += &line("draft", &r.draft);
    out += &format!(
        "{:<8} {:>10} {:>10} {:>10} {:>10} {:>11.4}\n",
        "ref", "", "", "", "", r.reference_perplexity
    );
    out += &format!(
        "\ndraft against its target: greedy acceptance {:.2}%, route recall {:.2}%\n",
        r.draft_acceptance * 100.0,
        r.route_recall * 100.0
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_of_a_distribution_with_itself_is_zero_and_positive_otherwise() {
        let p = log_softmax(&[1.0, 2.0, 3.0, f32::NEG_INFINITY]);
        let q = log_softmax(&[1.5, 2.0, 2.5, 0.0]);
        assert_eq!(kl(&p, &p), 0.0);
        assert!(kl(&p, &q) > 0.0);
        // By hand: sum p (log p - log q) over the three finite entries.
        let direct: f64 = (0..3).map(|i| p[i].exp() * (p[i] - q[i])).sum();
        assert!((kl(&p, &q) - direct).abs() < 1e-12);
        assert!((p.iter().map(|v| v.exp()).sum::<f64>() - 1.0).abs() < 1e-12);
    }

    #[test]
    fn scores_take_means_percentiles_and_perplexity() {
        let s = Scores {
            kl: (0..100).map(f64::from).collect(),
            agree: 25,
            nll: 100.0 * 2f64.ln(),
        };
        let a = s.finish();
        assert_eq!(a.positions, 100);
        assert_eq!(a.mean_kl, 49.5);
        assert_eq!(a.p99_kl, 99.0);
        assert_eq!(a.max_kl, 99.0);
        assert_eq!(a.top1_agreement, 0.25);
        assert!((a.perplexity - 2.0).abs() < 1e-12);
    }
}
