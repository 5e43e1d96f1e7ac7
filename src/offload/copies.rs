//! The small interface between a prefetch planner and the backend that holds the expert cache:
//! what the draft-driven and route-frequency prefetchers (src/decode/prefetch.rs) ask of it.

use crate::Result;

/// A backend whose routed experts live in a cache of per-layer slots it copies into (the CUDA
/// backend with offloaded experts).
pub trait ExpertCopies {
    /// Expert slots per MoE layer; `None` when every routed expert is resident (no cache).
    fn offload_slots(&self) -> Result<Option<usize>>;
    /// Counts the draft's routing on the device from now on, `[moe_layers, experts]`, so a
    /// draft pass needs no host round trip.
    fn enable_route_counts(&self, moe_layers: usize, experts: usize) -> Result<()>;
    /// Zeroes the routing counts (a draft window starts).
    fn reset_route_counts(&self) -> Result<()>;
    /// The routing counts so far, row-major `[moe_layers, experts]`.
    fn route_counts(&self) -> Result<Vec<u32>>;
    /// Starts copying `experts` of decoder layer `layer` into the cache and protects them until
    /// [`ExpertCopies::clear_plans`]; returns the bytes issued.
    fn prefetch(&self, layer: usize, experts: &[u32]) -> Result<usize>;
    /// Ends the current prefetch plan's protection.
    fn clear_plans(&self) -> Result<()>;
    /// A verify pass starts (for the share of prefetch copy time hidden behind drafting).
    fn mark_verify(&self) -> Result<()>;
}
