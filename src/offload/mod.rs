//! Expert offloading, backend-free: the per-layer expert cache (residency, LRU, plan protection),
//! the draft-driven prefetch planner (and SpecMoEOff's route-frequency Top-M rule), copy engines (a simulated clock here), and
//! [`OffloadSimulator`], which drives them from a decode run's routing so hit rates, bytes moved
//! and stalls under a given bandwidth can be measured on the CPU.

mod cache;
mod planner;
mod simulator;
mod transfer;

pub use cache::{
    Evicted, ExpertCache, InitialResidency, Insert, LoadKind, Lookup, Policy, ResidencyConfig,
};
pub use planner::{frequency_top_m, Plan, Planner, FREQUENCY_STEPS};
pub use simulator::{ComputeModel, OffloadSimulator, OffloadStats, SimulatorConfig};
pub use transfer::{SimulatedTransfers, TransferEngine, TransferId};
