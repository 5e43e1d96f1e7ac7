//! Recorded forward passes: a pass over a few tokens is captured once as a CUDA graph and then
//! replayed with new tokens and positions, which the host writes into one small device buffer
//! before each replay. A decode step is about 27 launches per layer; replaying them as one graph
//! removes the host's per-launch cost and the gaps between kernels on the device.
//!
//! Greedy one-row passes may be chained on the device (`Backend::feed_choice`): a pass's choice
//! is written into the step buffer's id word, where the next replay's embedding reads it, and
//! copied to pinned memory; the next pass's other words go up from pinned staging, so it is
//! queued before the host has the choice it runs from ([`FedChoices`]).
//!
//! A pass can be replayed only if nothing in its launches depends on the position or tokens
//! except through that buffer: while a step is active, the embedding reads its ids there, rope
//! its cos/sin, the KV-cache append and attention their start position; attention's score scratch
//! is sized for the whole cache. The rest (weights, the KV cache, activation buffers) is named by
//! the step's key or owned by the recording: every buffer allocated while capturing stays with
//! the graph, so no later op can reuse it.
//!
//! A key runs once op by op before it is captured (lazily built tables, such as the device expert
//! lists, are made outside the capture), and a capture that fails is run again op by op and never
//! retried. A pass that waits for the device midway (host routing, which the expert cache's
//! target passes need to decide their copies) is never captured whole: its first run notes the
//! wait, and from its second run on its segments, the runs of ops between the waits, are
//! (src/backend/cuda/graphs/segments.rs). With an expert cache, the draft's passes (resident INT4
//! experts, routing counted on the device) are recorded whole and the target's in segments.

pub(in crate::backend::cuda) mod recording;
pub(in crate::backend::cuda) mod segments;

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaGraph, CudaSlice, PinnedHostSlice};

use crate::backend::cuda::ops::rope::rope_cos_sin;
use crate::backend::cuda::runtime::act::GpuAct;
use crate::backend::cuda::runtime::pool::PooledBuf;
use crate::backend::StepRequest;

/// Most rows a recorded pass may have (decode steps and verification windows).
pub(in crate::backend::cuda) const MAX_ROWS: usize = 32;
/// Most rope frequencies (half the rotated width) a recorded pass may have.
pub(in crate::backend::cuda) const MAX_HALF: usize = 256;
/// Words of the step buffer: ids and positions, then cos and sin per row.
pub(in crate::backend::cuda) const PARAM_WORDS: usize = 2 * MAX_ROWS + 2 * MAX_ROWS * MAX_HALF;
/// Passes whose segments are kept at most (least recently used dropped first, all of a pass's
/// segments together).
pub(in crate::backend::cuda) const MAX_SEGMENT_PASSES: usize = 4;
/// Device memory the recorded segments may keep out of the pool: their activations are small,
/// but attention's score rows are sized for the whole cache (a 17-row window over a long cache
/// keeps megabytes a layer), and with offloaded experts VRAM is the budget.
pub(in crate::backend::cuda) const MAX_SEGMENT_BYTES: usize = 256 << 20;
/// Recordings kept at most (least recently used dropped first).
pub(in crate::backend::cuda) const MAX_RECORDED: usize = 8;
/// Slots of each fed-choice ring: choices on their way to the host, and fed passes' step words
/// staged for upload (see [`FedChoices`]). A chain has at most two choices in flight.
pub(in crate::backend::cuda) const FED_SLOTS: usize = 4;
/// Step words of a fed pass (one row), after its id: position, cos and sin.
pub(in crate::backend::cuda) const FED_WORDS: usize = 1 + 2 * MAX_HALF;

/// Counters of the recorded-pass machinery, for reports.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct StepGraphStats {
    pub enabled: bool,
    /// Passes captured as graphs.
    pub captures: u64,
    /// Passes replayed from a graph.
    pub replays: u64,
    /// Captures that failed (those keys run op by op from then on).
    pub failures: u64,
    /// Segments of passes that wait for the device midway, captured and replayed.
    pub segment_captures: u64,
    pub segment_replays: u64,
}

/// A captured graph. cudarc's graph is not `Send`: it is only touched under the backend's lock.
pub(in crate::backend::cuda) struct Graph(pub(in crate::backend::cuda) CudaGraph);
// SAFETY: the graph and its executable are driver objects used from one thread at a time (every
// access holds `CudaBackend::steps`' lock), which is what the driver requires of them.
unsafe impl Send for Graph {}

pub(in crate::backend::cuda) struct Recorded {
    pub(in crate::backend::cuda) key: u64,
    pub(in crate::backend::cuda) graph: Graph,
    pub(in crate::backend::cuda) logits: GpuAct,
    /// Every buffer the recorded kernels use besides weights and the KV cache.
    pub(in crate::backend::cuda) _keep: Vec<Arc<PooledBuf>>,
    pub(in crate::backend::cuda) used: u64,
}

/// A recorded segment of a pass that waits for the device midway (see
/// src/backend/cuda/graphs/segments.rs).
pub(in crate::backend::cuda) struct RecordedSegment {
    /// The pass's key and the segment's index in it; a pass's segments are dropped together.
    pub(in crate::backend::cuda) key: SegmentKey,
    pub(in crate::backend::cuda) graph: Graph,
    /// The activations the segment read from before it when recorded (where the graph reads
    /// them), each with whether it also writes it.
    pub(in crate::backend::cuda) inputs: Vec<(GpuAct, bool)>,
    pub(in crate::backend::cuda) outputs: Vec<GpuAct>,
    pub(in crate::backend::cuda) _keep: Vec<Arc<PooledBuf>>,
    /// Device bytes the recording keeps out of the pool (its ops' buffers).
    pub(in crate::backend::cuda) bytes: usize,
}

/// The recorded segments of passes that wait for the device midway (see
/// src/backend/cuda/graphs/segments.rs), and the one being captured.
#[derive(Default)]
pub(in crate::backend::cuda) struct SegmentGraphs {
    pub(in crate::backend::cuda) recorded: Vec<RecordedSegment>,
    /// Pass keys whose segments are recorded, least recently used first.
    pub(in crate::backend::cuda) passes: VecDeque<u64>,
    /// Segments whose capture failed: they run op by op.
    pub(in crate::backend::cuda) failed: HashSet<SegmentKey>,
    pub(in crate::backend::cuda) capture: Option<SegmentCapture>,
    /// Device bytes the recorded segments keep, at most about [`MAX_SEGMENT_BYTES`].
    pub(in crate::backend::cuda) bytes: usize,
    /// Passes whose further segments are not recorded: their recorded ones alone reached
    /// [`MAX_SEGMENT_BYTES`].
    pub(in crate::backend::cuda) full: HashSet<u64>,
}

impl SegmentGraphs {
    /// Drops every recorded segment (not the failed keys: those stay op by op).
    pub(in crate::backend::cuda) fn clear(&mut self) {
        self.recorded.clear();
        self.passes.clear();
        self.bytes = 0;
        self.full.clear();
    }
}

/// A segment: the key of the pass it belongs to, and its index in that pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(in crate::backend::cuda) struct SegmentKey {
    pub(in crate::backend::cuda) pass: u64,
    pub(in crate::backend::cuda) index: usize,
}

/// A segment being captured.
pub(in crate::backend::cuda) struct SegmentCapture {
    pub(in crate::backend::cuda) key: SegmentKey,
    pub(in crate::backend::cuda) inputs: Vec<(GpuAct, bool)>,
    pub(in crate::backend::cuda) keep: Vec<Arc<PooledBuf>>,
}

/// The step now running op by op, maybe being captured.
pub(in crate::backend::cuda) struct ActiveStep {
    pub(in crate::backend::cuda) key: u64,
    pub start: usize,
    pub rows: usize,
    pub tokens: Vec<u32>,
    pub inv_freq: Vec<f32>,
    pub scales: Vec<f32>,
    pub capturing: bool,
    /// The pass waited for the device (host routing, say): it cannot be recorded.
    pub(in crate::backend::cuda) synced: bool,
    pub keep: Vec<Arc<PooledBuf>>,
}

/// Where the active step's inputs lie in the step buffer.
#[derive(Clone, Copy)]
pub(in crate::backend::cuda) struct StepArgs {
    pub start: usize,
    pub rows: usize,
    pub ids: u64,
    pub positions: u64,
    pub cos: u64,
    pub sin: u64,
}

pub(in crate::backend::cuda) struct StepGraphs {
    pub(in crate::backend::cuda) enabled: bool,
    /// The step buffer (see [`PARAM_WORDS`]).
    pub(in crate::backend::cuda) params: CudaSlice<u32>,
    pub(in crate::backend::cuda) warmed: HashSet<u64>,
    pub(in crate::backend::cuda) failed: HashSet<u64>,
    pub(in crate::backend::cuda) recorded: Vec<Recorded>,
    pub(in crate::backend::cuda) clock: u64,
    pub active: Option<ActiveStep>,
    pub(in crate::backend::cuda) stats: StepGraphStats,
    /// Greedy choices fed on the device (made on first use).
    pub(in crate::backend::cuda) fed: Option<FedChoices>,
    /// The recorded segments of passes that wait for the device midway.
    pub(in crate::backend::cuda) segments: SegmentGraphs,
}

/// Greedy choices fed on the device to the next recorded one-row pass
/// ([`crate::backend::Backend::feed_choice`]): each is written into the step buffer's id word,
/// where a fed pass's embedding reads it, and copied into a pinned host slot. A fed pass's other
/// step words go up from pinned staging too, so queuing it never waits for the device.
pub(in crate::backend::cuda) struct FedChoices {
    /// `FED_SLOTS` choice words, then `FED_SLOTS` staging areas of `FED_WORDS` words.
    pub(in crate::backend::cuda) host: PinnedHostSlice<u32>,
    /// Recorded after each choice's copy to the host.
    pub(in crate::backend::cuda) choice_copied: Vec<Arc<CudaEvent>>,
    /// Recorded after each staging area's upload: the host waits on it before writing the area
    /// again (an event never recorded is complete).
    pub(in crate::backend::cuda) staged_sent: Vec<CudaEvent>,
    /// Choice slots fed and not taken, oldest first.
    pub(in crate::backend::cuda) queue: VecDeque<usize>,
    pub(in crate::backend::cuda) next_choice: usize,
    pub(in crate::backend::cuda) next_staged: usize,
}

impl StepGraphs {
    pub fn new(params: CudaSlice<u32>, enabled: bool) -> Self {
        StepGraphs {
            enabled,
            params,
            warmed: HashSet::new(),
            failed: HashSet::new(),
            recorded: Vec::new(),
            clock: 0,
            active: None,
            stats: StepGraphStats {
                enabled,
                ..Default::default()
            },
            fed: None,
            segments: SegmentGraphs::default(),
        }
    }
}

/// The step buffer's words for `step`: ids, positions, cos, sin (f32 bits).
pub(in crate::backend::cuda) fn param_words(step: &StepRequest) -> Vec<u32> {
    let rows = step.tokens.len();
    let positions: Vec<usize> = (step.start..step.start + rows).collect();
    let (cos, sin) = rope_cos_sin(step.inv_freq, &positions, step.scales);
    let mut words = Vec::with_capacity(2 * rows + cos.len() + sin.len());
    words.extend_from_slice(step.tokens);
    words.extend(positions.iter().map(|&p| p as u32));
    words.extend(cos.iter().chain(&sin).map(|v| v.to_bits()));
    words
}
