//! The passes of [`MoeModel`] that a backend may record and replay, and greedy one-row passes
//! chained on the device (`LanguageModel::forward_greedy_chain`).

use super::{mix, MoeKv, MoeModel};
use crate::backend::{Backend, StepEnd, StepRequest, StepStart};
use crate::model::{RouteHook, Variant};
use crate::{Error, Result};

impl<B: Backend> MoeModel<B> {
    /// Runs `tokens` as `LanguageModel::forward` does and leaves the logits on the backend
    /// (recorded and replayed where the hook does not look inside the pass).
    pub(super) fn run(
        &self,
        variant: Variant,
        tokens: &[u32],
        kv: &mut MoeKv<B>,
        hook: &mut dyn RouteHook,
    ) -> Result<B::Act> {
        self.run_pass(variant, tokens, kv, hook, false)
    }

    /// [`Self::run`] for a prompt: the backend's prompt arithmetic
    /// ([`Backend::prompt_pass`]), never recorded (a prompt runs once, and a recording replayed
    /// for a decoding pass of as many rows would give it the prompt's bits).
    pub(super) fn run_prompt(
        &self,
        variant: Variant,
        tokens: &[u32],
        kv: &mut MoeKv<B>,
        hook: &mut dyn RouteHook,
    ) -> Result<B::Act> {
        self.backend.prompt_pass(true);
        let logits = self.run_pass(variant, tokens, kv, hook, true);
        self.backend.prompt_pass(false);
        logits
    }

    fn run_pass(
        &self,
        variant: Variant,
        tokens: &[u32],
        kv: &mut MoeKv<B>,
        hook: &mut dyn RouteHook,
        prompt: bool,
    ) -> Result<B::Act> {
        if tokens.is_empty() {
            return Err(Error::Request("forward needs at least one token".into()));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(Error::Request(format!(
                "token id {bad} is out of the vocabulary (size {})",
                self.cfg.vocab_size
            )));
        }
        let start = kv.len;
        let end = start + tokens.len();
        if kv.layers.len() != self.layers.len() {
            return Err(Error::Request(format!(
                "the KV cache has {} layers, the model {}: it was made for another model",
                kv.layers.len(),
                self.layers.len()
            )));
        }
        if end > kv.capacity {
            return Err(Error::Request(format!(
                "{} tokens at position {start} exceed the KV cache capacity {}",
                tokens.len(),
                kv.capacity
            )));
        }
        if variant == Variant::Draft {
            if let Some(name) = &self.draft_missing {
                return Err(Error::Model(format!(
                    "draft forward: the weights have no draft tensor {name}"
                )));
            }
        }
        let positions: Vec<usize> = (start..end).collect();
        let scales: Vec<f32> = positions.iter().map(|&p| self.rope.scale_at(p)).collect();
        let be = &self.backend;
        if prompt || !recordable(variant, hook) {
            let logits = self.pass(variant, tokens, kv, hook, &positions, &scales)?;
            kv.len = end;
            return Ok(logits);
        }
        // A pass the hook does not look inside may be recorded once and replayed.
        let step = StepRequest {
            key: step_key(kv, tokens.len(), variant),
            tokens,
            start,
            inv_freq: &self.rope.inv_freq,
            scales: &scales,
            fed: false,
        };
        loop {
            if let StepStart::Replayed(logits) = be.begin_step(&step)? {
                kv.len = end;
                return Ok(logits);
            }
            let logits = self.pass(variant, tokens, kv, hook, &positions, &scales);
            match be.end_step(logits.as_ref().ok())? {
                StepEnd::Rerun => continue,
                StepEnd::Done => {
                    let logits = logits?;
                    kv.len = end;
                    return Ok(logits);
                }
            }
        }
    }

    /// The rest of `LanguageModel::forward_greedy_chain` once the first pass's choice is fed:
    /// `steps` choices in all, each taken after the next pass (where it is recorded) is queued.
    pub(super) fn chain_fed(
        &self,
        variant: Variant,
        kv: &mut MoeKv<B>,
        hook: &mut dyn RouteHook,
        steps: usize,
        accept: &mut dyn FnMut(u32) -> bool,
    ) -> Result<()> {
        let be = &self.backend;
        // Passes whose choices are fed and not taken yet: 1, or 2 while one runs ahead.
        let mut queued = 1;
        let mut taken = 0;
        loop {
            if queued == 1 && taken + 1 < steps {
                if let Some(logits) = self.run_fed(variant, kv, hook)? {
                    if !be.feed_choice(&logits)? {
                        return Err(Error::Backend(
                            "a fed pass's choice could not be fed".into(),
                        ));
                    }
                    queued = 2;
                }
            }
            let id = be.take_fed_choice()?;
            queued -= 1;
            taken += 1;
            if !accept(id) || taken == steps {
                if queued > 0 {
                    // The pass run ahead is not wanted: its choice and its position go.
                    be.drop_fed_choices()?;
                    kv.len -= queued;
                }
                return Ok(());
            }
            if queued == 0 {
                // Not recorded yet: run the next pass from the host's copy of the choice.
                let logits = self.run(variant, &[id], kv, hook)?;
                if !be.feed_choice(&logits)? {
                    return Err(Error::Backend("a pass's choice could not be fed".into()));
                }
                queued = 1;
            }
        }
    }

    /// Replays the one-row pass whose token is the last choice fed on the device, when it is
    /// recorded (`None`: it is not, or the hook looks inside passes, or the KV is full).
    fn run_fed(
        &self,
        variant: Variant,
        kv: &mut MoeKv<B>,
        hook: &mut dyn RouteHook,
    ) -> Result<Option<B::Act>> {
        let start = kv.len;
        if !recordable(variant, hook) || start + 1 > kv.capacity {
            return Ok(None);
        }
        let scales = [self.rope.scale_at(start)];
        let step = StepRequest {
            key: step_key(kv, 1, variant),
            tokens: &[0],
            start,
            inv_freq: &self.rope.inv_freq,
            scales: &scales,
            fed: true,
        };
        match self.backend.begin_step(&step)? {
            StepStart::Replayed(logits) => {
                kv.len = start + 1;
                Ok(Some(logits))
            }
            StepStart::Unrecorded => Ok(None),
            StepStart::Run => Err(Error::Backend(
                "the backend asked to run a fed pass op by op".into(),
            )),
        }
    }
}

/// Whether a pass under `hook` may be recorded and replayed: the hook looks inside no pass of
/// `variant` on the host.
fn recordable(variant: Variant, hook: &dyn RouteHook) -> bool {
    !((hook.wants_routes() && !hook.counts_routes_on_device(variant)) || hook.wants_moe_input())
}

/// What a recorded pass is valid for: the KV cache's storage, the row count and the variant.
fn step_key<B: Backend>(kv: &MoeKv<B>, rows: usize, variant: Variant) -> u64 {
    mix(
        mix(kv.storage, rows as u64),
        (variant == Variant::Draft) as u64,
    )
}
