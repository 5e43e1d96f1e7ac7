//! Routed experts that live in host memory: the per-layer slots in VRAM they are copied into
//! (the cache policy of src/offload/cache.rs decides which), the host path that computes some of
//! them on host threads, and link pacing.

pub(in crate::backend::cuda) mod pace;
pub(in crate::backend::cuda) mod slots;

use crate::backend::cuda::CudaBackend;
use crate::offload::ExpertCopies;
use crate::Result;

/// What the prefetchers of src/decode/prefetch.rs ask of the backend, by its own methods.
impl ExpertCopies for CudaBackend {
    fn offload_slots(&self) -> Result<Option<usize>> {
        CudaBackend::offload_slots(self)
    }

    fn enable_route_counts(&self, moe_layers: usize, experts: usize) -> Result<()> {
        CudaBackend::enable_route_counts(self, moe_layers, experts)
    }

    fn reset_route_counts(&self) -> Result<()> {
        CudaBackend::reset_route_counts(self)
    }

    fn route_counts(&self) -> Result<Vec<u32>> {
        CudaBackend::route_counts(self)
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) -> Result<usize> {
        CudaBackend::prefetch(self, layer, experts)
    }

    fn clear_plans(&self) -> Result<()> {
        CudaBackend::clear_plans(self)
    }

    fn mark_verify(&self) -> Result<()> {
        CudaBackend::mark_verify(self)
    }
}
