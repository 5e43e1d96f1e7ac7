//! Expert offloading, backend-free: the per-layer expert cache policy that the GPU and the
//! simulator share (slots, LRU, plan protection, counters),
//! the draft-driven prefetch planner (and SpecMoEOff's route-frequency Top-M rule) and the copy
//! interface a backend with an expert cache implements for it ([`ExpertCopies`]), copy engines
//! (a simulated clock here), and
//! [`OffloadSimulator`], which drives them from a decode run's routing so hit rates, bytes moved
//! and stalls under a given bandwidth can be measured on the CPU.

mod cache;
mod copies;
mod placement;
mod planner;
mod simulator;
mod stats;
mod transfer;

pub use cache::{
    Elsewhere, Evicted, ExpertCache, Hit, InitialResidency, Load, Policy, ResidencyConfig, Round,
};
pub use copies::ExpertCopies;
pub use placement::{HostShare, HostSplit};
pub use planner::{frequency_top_m, Plan, Planner, FREQUENCY_STEPS};
pub use simulator::{ComputeModel, OffloadSimulator, SimulatorConfig};
pub use stats::{OffloadStats, PathFigures, PathTelemetry};
pub use transfer::{SimulatedTransfers, TransferEngine, TransferId};
