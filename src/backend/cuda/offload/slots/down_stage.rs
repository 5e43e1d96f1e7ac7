//! The down matrix of a layer's split expert (src/offload/placement.rs): its gate and up run on
//! the host while the link copies the down matrix here, outside the expert slots, so the split
//! evicts nothing; the GPU then applies it to the host's activations.

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr};

use crate::backend::cuda::offload::slots::{timing_event, CopyBatch, ExpertOffload, SplitExperts};
use crate::backend::cuda::runtime::driver::guarded;
use crate::{Error, Result};

/// Device space for one down matrix and its events.
pub(super) struct DownStage {
    pub(super) buf: CudaSlice<u8>,
    /// Recorded on the copy stream when the matrix has landed.
    pub(super) ready: CudaEvent,
    /// Recorded on the compute stream after the last kernel that read it.
    pub(super) read: CudaEvent,
    /// The timing of the copy in flight, until compute waits for it.
    pub(super) copy: Option<(CudaEvent, CudaEvent)>,
    pub(super) split: SplitExperts,
}

impl ExpertOffload {
    /// Copies the down matrix of `expert` of model layer `layer` into the down stage on the copy
    /// stream, once the kernel that last read the stage has run; compute waits for it in
    /// [`Self::down_stage_ptr`].
    pub(crate) fn load_down_stage(&mut self, layer: usize, expert: u32) -> Result<()> {
        let mb = self.matrix_bytes;
        let copy = self.copy_stream.clone();
        let blob = *self
            .layer_mut(layer)?
            .blobs
            .get(expert as usize)
            .ok_or_else(|| Error::Model(format!("offload: no expert {expert} in layer {layer}")))?;
        let stage = self
            .down_stage
            .as_ref()
            .ok_or_else(|| Error::Backend("offload: no down stage".into()))?;
        guarded("cuStreamWaitEvent", || copy.wait(&stage.read))?;
        let (start, end) = (timing_event(&copy)?, timing_event(&copy)?);
        guarded("cuEventRecord", || start.record(&copy))?;
        if let Some(pace) = &self.pace {
            pace.begin(&copy)?;
        }
        self.copy_bytes(blob.file_offset + blob.down, mb, None)?;
        self.pace_to(&copy, mb)?;
        guarded("cuEventRecord", || end.record(&copy))?;
        if let Some(stage) = &mut self.down_stage {
            guarded("cuEventRecord", || stage.ready.record(&copy))?;
            stage.copy = Some((start, end));
        }
        Ok(())
    }

    /// The down stage's address; `compute` first waits for the copy into it.
    pub(crate) fn down_stage_ptr(&mut self, compute: &CudaStream) -> Result<u64> {
        let mb = self.matrix_bytes;
        let stage = self
            .down_stage
            .as_mut()
            .ok_or_else(|| Error::Backend("offload: no down stage".into()))?;
        let arrive = timing_event(compute)?;
        guarded("cuEventRecord", || arrive.record(compute))?;
        guarded("cuStreamWaitEvent", || compute.wait(&stage.ready))?;
        if let Some((start, end)) = stage.copy.take() {
            self.timings.push(CopyBatch {
                start,
                end,
                bytes: mb,
                prefetch: false,
                arrive: Some(arrive),
            });
        }
        let (p, _sync) = stage.buf.device_ptr(compute);
        Ok(p)
    }

    /// The kernels issued on `compute` so far are the last readers of the down stage.
    pub(crate) fn release_down_stage(&mut self, compute: &CudaStream) -> Result<()> {
        match &self.down_stage {
            Some(stage) => guarded("cuEventRecord", || stage.read.record(compute)),
            None => Ok(()),
        }
    }
}
