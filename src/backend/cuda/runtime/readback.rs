//! Activations read back to the host through page-locked memory: several at once with one wait
//! for the device. An offloaded MoE layer needs its routing logits and its input on the host
//! before its experts can be placed; one wait instead of one per activation keeps the decode
//! thread's round trip short.

use cudarc::driver::result as drv;

use crate::backend::cuda::backend::CudaBackend;
use crate::backend::cuda::runtime::act::GpuAct;
use crate::backend::cuda::runtime::driver::guarded;
use crate::backend::cuda::runtime::host::PinnedBuffer;
use crate::backend::cuda::runtime::kernels::ptr;
use crate::{Error, Result};

/// Reads larger than this go through pageable memory: a long prompt's logits would otherwise
/// pin hundreds of megabytes for one copy.
const PINNED_READ_LIMIT_BYTES: usize = 32 << 20;

/// The smallest landing buffer: a decode step's logits row (410 KB for a 102,400-token
/// vocabulary) and its input fit.
const PINNED_READ_MIN_BYTES: usize = 1 << 20;

impl CudaBackend {
    /// Each of `parts` on the host (`rows x cols` values each), after one wait for the work
    /// issued so far.
    pub(in crate::backend::cuda) fn read_back(&self, parts: &[&GpuAct]) -> Result<Vec<Vec<f32>>> {
        Ok(self.read_back_then(parts, || Ok(()))?.0)
    }

    /// As [`Self::read_back`], with `meanwhile` issued on the stream after the copies: the host
    /// waits for the copies only, and the device runs what `meanwhile` issued while the host
    /// works on what came back. Its value is returned beside the parts.
    pub(in crate::backend::cuda) fn read_back_then<T>(
        &self,
        parts: &[&GpuAct],
        meanwhile: impl FnOnce() -> Result<T>,
    ) -> Result<(Vec<Vec<f32>>, T)> {
        let lens: Vec<usize> = parts.iter().map(|a| a.rows * a.cols).collect();
        let total: usize = lens.iter().sum();
        if total * 4 > PINNED_READ_LIMIT_BYTES {
            let out = self.read_back_pageable(parts, &lens)?;
            return Ok((out, meanwhile()?));
        }
        let mut landing = self.lock(&self.readback)?;
        if landing.as_ref().is_none_or(|b| b.len() < total * 4) {
            *landing = None;
            let bytes = (total * 4).next_power_of_two().max(PINNED_READ_MIN_BYTES);
            *landing = Some(self.dev.alloc_pinned(bytes)?);
        }
        let buf = landing
            .as_mut()
            .ok_or_else(|| Error::Backend("cuda: no read-back buffer".into()))?;
        let host = buf.as_mut_f32()?;
        let mut at = 0;
        for (a, &n) in parts.iter().zip(&lens) {
            if n > 0 {
                let src = ptr(&a.buf, &self.stream);
                let dst = &mut host[at..at + n];
                guarded("cuMemcpyDtoHAsync", || {
                    // SAFETY: `src` holds at least `n` f32 values (`rows x cols` of its
                    // activation) written on this stream; `dst` is page-locked memory owned by
                    // the backend, which stays allocated (behind the lock held until the wait
                    // below, and afterwards in `self.readback`) while the copy runs.
                    unsafe { drv::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
                })?;
            }
            at += n;
        }
        guarded("cuEventRecord", || self.readback_done.record(&self.stream))?;
        let issued = meanwhile()?;
        self.note_host_sync()?;
        self.wait_timed(|| self.readback_done.synchronize())?;
        let mut at = 0;
        let out = lens
            .iter()
            .map(|&n| {
                at += n;
                host[at - n..at].to_vec()
            })
            .collect();
        Ok((out, issued))
    }

    fn read_back_pageable(&self, parts: &[&GpuAct], lens: &[usize]) -> Result<Vec<Vec<f32>>> {
        // Wait first: a copy into pageable memory would otherwise wait for the queued kernels
        // inside the copy, and the host timing would count the device's time as the host's.
        self.synchronize()?;
        let mut out = Vec::with_capacity(parts.len());
        for (a, &n) in parts.iter().zip(lens) {
            let mut values = vec![0.0f32; n];
            if n > 0 {
                let view = a.buf.slice(..n);
                guarded("cuda: device-to-host copy failed", || {
                    self.stream.memcpy_dtoh(&view, &mut values)
                })?;
            }
            out.push(values);
        }
        guarded("cuStreamSynchronize", || self.stream.synchronize())?;
        Ok(out)
    }

    /// Page-locked space for `values` f32 outputs of the host expert kernel, waiting first for
    /// any copy still reading the last ones.
    pub(in crate::backend::cuda) fn host_output_staging(
        &self,
        values: usize,
    ) -> Result<std::sync::MutexGuard<'_, Option<PinnedBuffer>>> {
        let mut staging = self.lock(&self.host_outputs)?;
        if staging.as_ref().is_none_or(|b| b.len() < values * 4) {
            *staging = None;
            let bytes = (values * 4).next_power_of_two().max(PINNED_READ_MIN_BYTES);
            *staging = Some(self.dev.alloc_pinned(bytes)?);
        }
        Ok(staging)
    }
}
