//! Milliseconds since the process started, for start-up reports (time to first token).
//!
//! The clock starts at [`mark_process_start`], which a binary calls first thing in `main`; the
//! few milliseconds between `exec` and `main` are not counted. Without the call it starts at the
//! first reading.

use std::sync::OnceLock;
use std::time::Instant;

static START: OnceLock<Instant> = OnceLock::new();

/// Starts the clock (later calls do nothing).
pub fn mark_process_start() {
    START.get_or_init(Instant::now);
}

/// Milliseconds since [`mark_process_start`].
pub fn since_start_ms() -> f64 {
    START.get_or_init(Instant::now).elapsed().as_secs_f64() * 1e3
}

/// When the stages of opening a session finished, in ms since process start.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct StartupTimes {
    /// Header and manifest checked (no tensor bytes read).
    pub bundle_opened_ms: f64,
    /// The GPU's context, kernels and expert slots ready (`None` on the CPU backend).
    pub device_ready_ms: Option<f64>,
    /// Every weight the first token needs is on the backend.
    pub weights_resident_ms: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_only_moves_forward() {
        mark_process_start();
        let a = since_start_ms();
        let b = since_start_ms();
        assert!(a >= 0.0 && b >= a);
    }
}
