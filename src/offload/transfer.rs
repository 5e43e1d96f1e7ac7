//! Expert copy engines. The simulated one keeps a clock: copies run one after another on a single
//! copy engine at a fixed bandwidth, overlapping with whatever compute time the caller advances.

use crate::{Error, Result};

/// Names one issued copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferId(pub u64);

/// Copies experts from host memory into device slots.
pub trait TransferEngine {
    /// Current time in seconds (simulated or wall-clock, depending on the engine).
    fn now(&self) -> f64;
    /// Starts copying `bytes` of expert `expert` of MoE layer `layer`; returns at once.
    fn issue(&mut self, layer: usize, expert: usize, bytes: usize) -> TransferId;
    /// Whether the copy has finished by `now()`.
    fn is_complete(&self, id: TransferId) -> bool;
    /// Blocks until the copy has finished; returns the seconds spent waiting (the stall).
    fn wait(&mut self, id: TransferId) -> f64;
}

/// A copy engine on a simulated clock: one copy at a time at `bandwidth_bytes_per_s`, each paying
/// `latency_s` first. `advance` models compute, during which issued copies make progress.
#[derive(Clone, Debug)]
pub struct SimulatedTransfers {
    bandwidth_bytes_per_s: f64,
    latency_s: f64,
    clock: f64,
    /// When the copy engine finishes everything issued so far.
    engine_free_at: f64,
    /// Completion time of every issued copy, indexed by its id.
    done_at: Vec<f64>,
    stall_s: f64,
}

impl SimulatedTransfers {
    pub fn new(bandwidth_bytes_per_s: f64, latency_s: f64) -> Result<Self> {
        if !(bandwidth_bytes_per_s.is_finite() && bandwidth_bytes_per_s > 0.0) {
            return Err(Error::Request(format!(
                "copy bandwidth {bandwidth_bytes_per_s} bytes/s must be finite and positive"
            )));
        }
        if !(latency_s.is_finite() && latency_s >= 0.0) {
            return Err(Error::Request(format!(
                "copy latency {latency_s} s must be finite and >= 0"
            )));
        }
        Ok(SimulatedTransfers {
            bandwidth_bytes_per_s,
            latency_s,
            clock: 0.0,
            engine_free_at: 0.0,
            done_at: Vec::new(),
            stall_s: 0.0,
        })
    }

    /// Seconds one copy of `bytes` occupies the copy engine.
    pub fn copy_seconds(&self, bytes: usize) -> f64 {
        self.latency_s + bytes as f64 / self.bandwidth_bytes_per_s
    }

    pub fn bandwidth_bytes_per_s(&self) -> f64 {
        self.bandwidth_bytes_per_s
    }

    /// Moves the clock forward by `seconds` of compute (negative or non-finite values are ignored).
    pub fn advance(&mut self, seconds: f64) {
        if seconds.is_finite() && seconds > 0.0 {
            self.clock += seconds;
        }
    }

    /// Total seconds spent in [`TransferEngine::wait`].
    pub fn stall_s(&self) -> f64 {
        self.stall_s
    }

    /// Back to time zero with nothing in flight.
    pub fn reset(&mut self) {
        self.clock = 0.0;
        self.engine_free_at = 0.0;
        self.done_at.clear();
        self.stall_s = 0.0;
    }

    fn done_time(&self, id: TransferId) -> f64 {
        // An id this engine never issued has nothing to wait for.
        usize::try_from(id.0)
            .ok()
            .and_then(|index| self.done_at.get(index))
            .copied()
            .unwrap_or(f64::NEG_INFINITY)
    }
}

impl TransferEngine for SimulatedTransfers {
    fn now(&self) -> f64 {
        self.clock
    }

    fn issue(&mut self, _layer: usize, _expert: usize, bytes: usize) -> TransferId {
        let start = self.clock.max(self.engine_free_at);
        let done = start + self.copy_seconds(bytes);
        self.engine_free_at = done;
        self.done_at.push(done);
        TransferId(self.done_at.len() as u64 - 1)
    }

    fn is_complete(&self, id: TransferId) -> bool {
        self.done_time(id) <= self.clock
    }

    fn wait(&mut self, id: TransferId) -> f64 {
        let done = self.done_time(id);
        if done > self.clock {
            let stalled = done - self.clock;
            self.clock = done;
            self.stall_s += stalled;
            stalled
        } else {
            0.0
        }
    }
}
