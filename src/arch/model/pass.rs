//! A forward pass of [`MoeModel`] in segments: each runs from one MoE layer's output (or the
//! embedding) to the next MoE layer's router logits (or the head). Where an offloaded layer reads
//! its routing back to the host, the pass cannot be recorded whole, but its segments can
//! ([`Backend::begin_segment`]): between two waits for the device, a replayed segment costs one
//! launch instead of one per op, and its kernels run without the host's launch gaps.

use super::{Mlp, MoeKv, MoeModel};
use crate::backend::{Backend, SegmentEnd, SegmentStart};
use crate::model::{RouteHook, Variant};
use crate::{Error, Result};

impl<B: Backend> MoeModel<B> {
    /// The layers and the head over `tokens` at `positions`: the logits, on the device.
    pub(super) fn pass(
        &self,
        variant: Variant,
        tokens: &[u32],
        kv: &mut MoeKv<B>,
        hook: &mut dyn RouteHook,
        positions: &[usize],
        scales: &[f32],
    ) -> Result<B::Act> {
        let be = &self.backend;
        let layers = self.layers.len();
        // The residual stream, made by the first segment's embedding.
        let mut x: Option<B::Act> = None;
        // The last MoE layer's output, added to the residual stream in the next segment's norm.
        let mut pending: Option<B::Act> = None;
        let mut from = 0;
        for index in 0.. {
            let boundary = (from..layers).find(|&l| matches!(self.layers[l].mlp, Mlp::Moe(_)));
            let made_x = x.is_none();
            // A segment's first output is always the residual stream: an op may leave it in a
            // new buffer rather than update it in place (the fused add + norm + products does),
            // so a replay hands back the buffer the recording wrote it to.
            let mut outs = loop {
                let inputs: Vec<(&B::Act, bool)> = x
                    .iter()
                    .map(|a| (a, true))
                    .chain(pending.iter().map(|m| (m, false)))
                    .collect();
                if let SegmentStart::Replayed(mut outs) = be.begin_segment(index, &inputs)? {
                    if outs.is_empty() {
                        return Err(Error::Backend(format!(
                            "segment {index} of a pass was replayed without its residual stream"
                        )));
                    }
                    x = Some(outs.remove(0));
                    break outs;
                }
                let ran = self.segment(
                    tokens,
                    &mut x,
                    pending.as_ref(),
                    kv,
                    from,
                    boundary,
                    (positions, scales),
                );
                let refs: Option<Vec<&B::Act>> = ran
                    .as_ref()
                    .ok()
                    .map(|outs| x.iter().chain(outs.iter()).collect());
                match be.end_segment(refs.as_deref())? {
                    SegmentEnd::Rerun(given) => {
                        // Nothing ran: start again from the residual stream as it was given
                        // (none for the first segment, which makes it).
                        x = match made_x {
                            true => None,
                            false => Some(given.into_iter().next().ok_or_else(|| {
                                Error::Backend(format!(
                                    "segment {index}'s failed recording gave back no inputs"
                                ))
                            })?),
                        };
                    }
                    SegmentEnd::Done => break ran?,
                }
            };
            let wanted = if boundary.is_some() { 2 } else { 1 };
            if x.is_none() || outs.len() != wanted {
                return Err(Error::Backend(format!(
                    "segment {index} of a pass gave {} activations besides the residual stream, not {wanted}",
                    outs.len()
                )));
            }
            let logits = outs
                .pop()
                .ok_or_else(|| Error::Backend(format!("segment {index} gave no logits")))?;
            let Some(b) = boundary else {
                // The head's segment: its one output is the logits.
                return Ok(logits);
            };
            let (Some(h), Mlp::Moe(block)) = (outs.pop(), &self.layers[b].mlp) else {
                return Err(Error::Model(format!(
                    "layer {b}'s segment gave no MoE input"
                )));
            };
            pending = Some(self.moe(block, b, &h, logits, variant, hook)?);
            from = b + 1;
        }
        Err(Error::Model("a pass ran out of segments".into()))
    }

    /// The ops of one segment: layers `from..` up to `boundary`'s router logits (its MoE input
    /// and the logits), or to the head (the logits). `x` is the residual stream, which the first
    /// segment makes; `pending` the MoE output before the segment.
    #[allow(clippy::too_many_arguments)]
    fn segment(
        &self,
        tokens: &[u32],
        x: &mut Option<B::Act>,
        pending: Option<&B::Act>,
        kv: &mut MoeKv<B>,
        from: usize,
        boundary: Option<usize>,
        rope: (&[usize], &[f32]),
    ) -> Result<Vec<B::Act>> {
        let be = &self.backend;
        let (positions, scales) = rope;
        let start = kv.len;
        if x.is_none() {
            *x = Some(be.embedding(&self.embed, tokens)?);
        }
        let x = x
            .as_mut()
            .ok_or_else(|| Error::Model("a pass has no residual stream".into()))?;
        // Each layer's MLP output is added to the residual stream in the next norm's call.
        let mut dense: Option<B::Act> = None;
        let end = boundary.map_or(self.layers.len(), |b| b + 1);
        for l in from..end {
            let layer = &self.layers[l];
            let m = if l == from { pending } else { dense.as_ref() };
            let (h, projected) = match (m, self.input_products(layer)) {
                (Some(m), Some((q, kv_a))) => {
                    let eps = self.cfg.norm_eps;
                    let n =
                        be.add_rms_norm_linear(x, m, &layer.input_norm.weight, eps, q, Some(kv_a))?;
                    let kv_a = n
                        .b
                        .ok_or_else(|| Error::Model("add_rms_norm_linear lost a product".into()))?;
                    (n.h, Some((n.a, kv_a)))
                }
                (Some(m), None) => (self.add_norm(x, m, &layer.input_norm)?, None),
                (None, _) => (self.norm(x, &layer.input_norm)?, None),
            };
            let a = self.attention(
                &layer.attention,
                &h,
                projected,
                &mut kv.layers[l],
                start,
                positions,
                scales,
            )?;
            // An MoE layer's router reads the norm after the attention: one call where the
            // backend fuses them.
            if let (Mlp::Moe(block), None) = (&layer.mlp, &layer.post_attention_norm.bias) {
                let n = &layer.post_attention_norm.weight;
                let eps = self.cfg.norm_eps;
                let r = be.add_rms_norm_linear(x, &a, n, eps, &block.router, None)?;
                return Ok(vec![r.h, r.a]);
            }
            let h = self.add_norm(x, &a, &layer.post_attention_norm)?;
            match &layer.mlp {
                Mlp::Dense(mlp) => dense = Some(be.gated_mlp(&h, mlp)?),
                Mlp::Moe(block) => {
                    let logits = be.linear(&h, &block.router, None)?;
                    return Ok(vec![h, logits]);
                }
            }
        }
        let m = if from == end { pending } else { dense.as_ref() };
        let x = match m {
            None => self.norm(x, &self.final_norm)?,
            Some(m) => self.add_norm(x, m, &self.final_norm)?,
        };
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        Ok(vec![be.linear(&x, head, self.lm_head_bias.as_ref())?])
    }
}
