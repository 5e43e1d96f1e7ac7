//! Link pacing: expert copies held to a set rate, to measure on a fast link what a slower one
//! (`--link-gbps 25`: PCIe 4.0 x16) would do. Around each batch of copies the copy stream runs two
//! one-thread kernels (kernels/util.cu): `link_pace_start` stamps the GPU clock before the
//! copies, `link_pace_wait` holds the stream after them until `bytes / rate` has passed since the
//! stamp. A batch then takes max(real copy time, bytes / rate), and the batch's timing events,
//! hence the copy seconds, the measured bandwidth and the hybrid split, see the paced link.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use crate::backend::cuda::runtime::args::{KernelArgs, LinkPaceStartArgs, LinkPaceWaitArgs};
use crate::backend::cuda::runtime::driver::{guarded, launch_kernel, LaunchMode, NO_CLUSTER};
use crate::backend::cuda::runtime::kernels::{dptr, PaceKernels};
use crate::backend::cuda::CudaDevice;
use crate::{Error, Result};

pub(in crate::backend::cuda) struct LinkPace {
    kernels: PaceKernels,
    /// The GPU clock (ns) at the start of the batch in flight: batches on the one copy stream run
    /// one after another, so one stamp serves them all.
    stamp: CudaSlice<u64>,
    bytes_per_s: f64,
}

impl LinkPace {
    /// Pacing at `bytes_per_s` on `copy` (the stream every paced batch runs on).
    pub(in crate::backend::cuda) fn new(
        dev: &CudaDevice,
        copy: &Arc<CudaStream>,
        bytes_per_s: f64,
    ) -> Result<Self> {
        check_rate(bytes_per_s)?;
        let stamp = guarded("cannot allocate the link pacing stamp", || {
            copy.alloc_zeros::<u64>(1)
        })?;
        Ok(LinkPace {
            kernels: PaceKernels::load(dev)?,
            stamp,
            bytes_per_s,
        })
    }

    pub(in crate::backend::cuda) fn bytes_per_s(&self) -> f64 {
        self.bytes_per_s
    }

    /// Stamps the start of a batch on `copy` (before its first copy).
    pub(in crate::backend::cuda) fn begin(&self, copy: &CudaStream) -> Result<()> {
        let mut args = LinkPaceStartArgs {
            stamp: dptr(&self.stamp, copy),
        };
        // SAFETY: the arguments of link_pace_start (its type says so); the pointer addresses
        // `self.stamp`, one u64 that lives as long as `self`.
        unsafe { launch_one_thread(copy, &self.kernels.start.f, &mut args.params()) }
            .map_err(|e| Error::Backend(format!("cuda link_pace_start: kernel launch failed: {e}")))
    }

    /// After a batch of `bytes` on `copy`: holds the stream until the batch has taken as long as
    /// those bytes take at the paced rate.
    pub(in crate::backend::cuda) fn end(&self, copy: &CudaStream, bytes: usize) -> Result<()> {
        let mut args = LinkPaceWaitArgs {
            stamp: dptr(&self.stamp, copy),
            ns: pace_ns(bytes, self.bytes_per_s),
        };
        // SAFETY: the arguments of link_pace_wait (its type says so); the pointer addresses
        // `self.stamp`, which lives as long as `self`.
        unsafe { launch_one_thread(copy, &self.kernels.wait.f, &mut args.params()) }
            .map_err(|e| Error::Backend(format!("cuda link_pace_wait: kernel launch failed: {e}")))
    }
}

/// A one-thread launch of `f` on `copy`, after the copy stream's earlier work.
///
/// # Safety
/// `params` are the addresses of `f`'s arguments, valid for the call.
unsafe fn launch_one_thread(
    copy: &CudaStream,
    f: &cudarc::driver::CudaFunction,
    params: &mut [*mut std::ffi::c_void],
) -> std::result::Result<(), cudarc::driver::DriverError> {
    let plain = LaunchMode {
        overlap: false,
        cluster: NO_CLUSTER,
    };
    // SAFETY: the caller's promise; a plain launch waits for the stream's earlier work.
    unsafe { launch_kernel(copy, f, ((1, 1, 1), 1, 0), params, plain) }
}

/// A pace must be a positive, finite number of bytes per second.
pub(crate) fn check_rate(bytes_per_s: f64) -> Result<()> {
    if bytes_per_s.is_finite() && bytes_per_s > 0.0 {
        Ok(())
    } else {
        Err(Error::Request(format!(
            "the link pace must be a positive number of bytes per second, got {bytes_per_s}"
        )))
    }
}

/// Nanoseconds `bytes` take at `bytes_per_s` (rounded up).
fn pace_ns(bytes: usize, bytes_per_s: f64) -> u64 {
    (bytes as f64 / bytes_per_s * 1e9).ceil() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_takes_its_bytes_at_the_paced_rate() {
        // 25 GB/s: 25 MB take a millisecond, one 5.77 MB matrix of a DeepSeek-V2-Lite expert 231 us.
        assert_eq!(pace_ns(25_000_000, 25e9), 1_000_000);
        assert_eq!(pace_ns(5_767_168, 25e9), 230_687);
        assert_eq!(pace_ns(0, 25e9), 0);
        assert!(check_rate(25e9).is_ok());
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(matches!(check_rate(bad), Err(Error::Request(_))), "{bad}");
        }
    }
}
