//! Recorded segments of passes that wait for the device midway.
//!
//! A pass over offloaded experts reads each MoE layer's routing back to the host, which decides
//! the layer's copies and host work; such a pass cannot be one graph. Its segments can: the ops
//! from one MoE layer's output to the next layer's router logits (a norm, attention, another
//! norm, the router: a dozen launches) depend on nothing the host decides but the step's tokens
//! and positions, which they read from the step buffer as a recorded pass does. From a pass's
//! second run on, each segment is captured once and then replayed as one launch, so the device
//! runs it without waiting for the host's launches between its kernels.
//!
//! A segment's inputs (the residual stream and the MoE output before it) lie wherever the ops
//! before it put them; the graph reads them where they lay when it was recorded. A replay copies
//! an input that has moved into that buffer first (and one the segment writes in place back
//! after). Its outputs are where the recording wrote them, the residual stream first: an op may
//! leave the stream in a buffer of its own rather than update it in place (the fused add + norm +
//! products does), so the pass takes the stream from the outputs, never assumes it stayed in its
//! input. The recording keeps those buffers, and every buffer its ops allocated, out of the pool
//! for as long as it lives.

use cudarc::driver::sys;

use crate::backend::cuda::backend::CudaBackend;
use crate::backend::cuda::graphs::*;
use crate::backend::cuda::runtime::act::GpuAct;
use crate::backend::cuda::runtime::driver::guarded;
use crate::backend::cuda::runtime::kernels::ptr;
use crate::backend::{SegmentEnd, SegmentStart};
use crate::Result;

/// What a replay does with one input: nothing (it lies where the graph reads it), or a copy in
/// (and back out, for one the segment writes) between these device addresses.
fn moved(
    given: &GpuAct,
    recorded: &GpuAct,
    stream: &cudarc::driver::CudaStream,
) -> Option<(u64, u64)> {
    let (from, to) = (ptr(&given.buf, stream), ptr(&recorded.buf, stream));
    (from != to).then_some((from, to))
}

impl CudaBackend {
    pub(in crate::backend::cuda) fn begin_segment_impl(
        &self,
        index: usize,
        inputs: &[(&GpuAct, bool)],
    ) -> Result<SegmentStart<GpuAct>> {
        let mut g = self.lock(&self.steps)?;
        let pass = match g.active.as_ref() {
            // Only the segments of a pass already known not to be recordable whole (it waited
            // for the device in an earlier run), and not while a whole pass is being captured.
            Some(a) if !a.capturing && g.failed.contains(&a.key) => a.key,
            _ => return Ok(SegmentStart::Run),
        };
        if !g.enabled || g.segments.capture.is_some() {
            return Ok(SegmentStart::Run);
        }
        let key = SegmentKey { pass, index };
        if let Some(i) = g.segments.recorded.iter().position(|r| r.key == key) {
            let same_shapes = g.segments.recorded[i].inputs.len() == inputs.len()
                && g.segments.recorded[i]
                    .inputs
                    .iter()
                    .zip(inputs)
                    .all(|((r, rw), (a, aw))| (r.rows, r.cols, rw) == (a.rows, a.cols, aw));
            if !same_shapes {
                return Ok(SegmentStart::Run);
            }
            g.segments.touch(pass);
            let s = &self.stream;
            let rec = &g.segments.recorded[i];
            for ((recorded, _), (given, _)) in rec.inputs.iter().zip(inputs) {
                if let Some((from, to)) = moved(given, recorded, s) {
                    copy(from, to, 4 * given.rows * given.cols, s)?;
                }
            }
            guarded("cuda: segment graph launch failed", || rec.graph.0.launch())?;
            for ((recorded, writes), (given, _)) in rec.inputs.iter().zip(inputs) {
                if let (true, Some((to, from))) = (*writes, moved(given, recorded, s)) {
                    copy(from, to, 4 * given.rows * given.cols, s)?;
                }
            }
            let outputs = rec.outputs.iter().map(GpuAct::share).collect();
            g.stats.segment_replays += 1;
            return Ok(SegmentStart::Replayed(outputs));
        }
        if g.segments.failed.contains(&key) || g.segments.full.contains(&pass) {
            return Ok(SegmentStart::Run);
        }
        let begun = self
            .stream
            .begin_capture(sys::CUstreamCaptureMode_enum::CU_STREAM_CAPTURE_MODE_RELAXED);
        if begun.is_err() {
            g.segments.failed.insert(key);
            g.stats.failures += 1;
            return Ok(SegmentStart::Run);
        }
        g.segments.capture = Some(SegmentCapture {
            key,
            inputs: inputs.iter().map(|(a, w)| (a.share(), *w)).collect(),
            keep: Vec::new(),
        });
        Ok(SegmentStart::Run)
    }

    pub(in crate::backend::cuda) fn end_segment_impl(
        &self,
        outputs: Option<&[&GpuAct]>,
    ) -> Result<SegmentEnd<GpuAct>> {
        let mut g = self.lock(&self.steps)?;
        let Some(capture) = g.segments.capture.take() else {
            return Ok(SegmentEnd::Done);
        };
        let ended = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        let (Ok(Some(graph)), Some(outputs)) = (ended, outputs) else {
            // Nothing of the segment ran: run it again op by op, and never capture it.
            g.segments.failed.insert(capture.key);
            g.stats.failures += 1;
            let given = capture.inputs.into_iter().map(|(a, _)| a).collect();
            return Ok(SegmentEnd::Rerun(given));
        };
        guarded("cuda: graph launch failed", || graph.launch())
            .map_err(|e| crate::Error::Backend(format!("{e} (first replay of a segment)")))?;
        g.stats.segment_captures += 1;
        let bytes = capture.keep.iter().map(|b| 4 * b.len()).sum::<usize>();
        let sg = &mut g.segments;
        if !sg.passes.contains(&capture.key.pass) && sg.passes.len() >= MAX_SEGMENT_PASSES {
            sg.drop_oldest_pass();
        }
        sg.touch(capture.key.pass);
        sg.bytes += bytes;
        // Over the memory bound: other passes' segments go first, least recently used first;
        // a pass that is over it alone records no further segments.
        while sg.bytes > MAX_SEGMENT_BYTES && sg.passes.len() > 1 {
            sg.drop_oldest_pass();
        }
        if sg.bytes > MAX_SEGMENT_BYTES {
            sg.full.insert(capture.key.pass);
        }
        sg.recorded.push(RecordedSegment {
            key: capture.key,
            graph: Graph(graph),
            inputs: capture.inputs,
            outputs: outputs.iter().map(|a| a.share()).collect(),
            _keep: capture.keep,
            bytes,
        });
        Ok(SegmentEnd::Done)
    }
}

impl SegmentGraphs {
    /// Drops the least recently used pass's segments.
    fn drop_oldest_pass(&mut self) {
        if let Some(oldest) = self.passes.pop_front() {
            let freed: usize = self
                .recorded
                .iter()
                .filter(|r| r.key.pass == oldest)
                .map(|r| r.bytes)
                .sum();
            self.recorded.retain(|r| r.key.pass != oldest);
            self.bytes -= freed;
            self.full.remove(&oldest);
        }
    }

    /// Marks `pass`'s segments as the most recently used.
    fn touch(&mut self, pass: u64) {
        if self.passes.back() != Some(&pass) {
            self.passes.retain(|&p| p != pass);
            self.passes.push_back(pass);
        }
    }
}

/// Queues a device-to-device copy of `bytes` on `stream`.
fn copy(from: u64, to: u64, bytes: usize, stream: &cudarc::driver::CudaStream) -> Result<()> {
    guarded("cuda: copying a segment's input", || {
        // SAFETY: both addresses are the starts of live activation buffers of the same shape
        // (the caller's input and the recording's, which the recording keeps), each holding at
        // least `bytes`; the copy is ordered on the one compute stream with the ops using them.
        unsafe { cudarc::driver::result::memcpy_dtod_async(to, from, bytes, stream.cu_stream()) }
    })
}
