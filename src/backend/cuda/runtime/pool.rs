//! Device memory: the stream-ordered pool every allocation comes from, and a cache of
//! activation buffers by size class so an op does not pay an allocate/free pair of driver calls.

use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaSlice};

use crate::backend::cuda::runtime::driver::guarded;
use crate::backend::cuda::CudaDevice;
use crate::Result;

/// Bytes of freed activation buffers kept for reuse at most.
pub(in crate::backend::cuda) const POOL_LIMIT_BYTES: usize = 2 << 30;

/// Freed activation buffers by element count, reused by later allocations. Every use is on the
/// one compute stream, so a buffer handed out again is only written after the kernels that read
/// it before (the same guarantee `cuMemFreeAsync` gives); reuse avoids an allocate/free pair of
/// driver calls per op, dozens per layer.
#[derive(Default)]
pub(in crate::backend::cuda) struct BufferPool {
    free: Mutex<std::collections::HashMap<usize, Vec<CudaSlice<f32>>>>,
    cached_bytes: std::sync::atomic::AtomicUsize,
}

/// Element count handed out for a request of `n`: rounded up to one of eight steps per power of
/// two (at most 12.5% waste), so buffers of nearby sizes (attention scores grow by one key per
/// step) are shared.
pub(in crate::backend::cuda) fn bucket(n: usize) -> usize {
    if n <= 256 {
        return 256;
    }
    let step = 1usize << (usize::BITS - 1 - n.leading_zeros()).saturating_sub(3);
    n.div_ceil(step) * step
}

impl BufferPool {
    pub(in crate::backend::cuda) fn take(&self, n: usize) -> Option<CudaSlice<f32>> {
        let mut free = self.free.lock().ok()?;
        let s = free.get_mut(&n)?.pop()?;
        self.cached_bytes
            .fetch_sub(4 * n, std::sync::atomic::Ordering::Relaxed);
        Some(s)
    }

    pub(in crate::backend::cuda) fn give(&self, s: CudaSlice<f32>) {
        let n = s.len();
        if bucket(n) != n
            || self.cached_bytes.load(std::sync::atomic::Ordering::Relaxed) + 4 * n
                > POOL_LIMIT_BYTES
        {
            return;
        }
        if let Ok(mut free) = self.free.lock() {
            free.entry(n).or_default().push(s);
            self.cached_bytes
                .fetch_add(4 * n, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// A device buffer that returns to its pool when the last activation using it is dropped.
pub struct PooledBuf {
    pub(in crate::backend::cuda) slice: Option<CudaSlice<f32>>,
    pub(in crate::backend::cuda) pool: Arc<BufferPool>,
}

impl std::ops::Deref for PooledBuf {
    type Target = CudaSlice<f32>;
    fn deref(&self) -> &CudaSlice<f32> {
        // Only `Drop` takes the slice out.
        self.slice
            .as_ref()
            .expect("pooled buffer used after release")
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(s) = self.slice.take() {
            self.pool.give(s);
        }
    }
}

/// A device's default memory pool handle.
#[derive(Clone, Copy)]
pub(in crate::backend::cuda) struct MemPool(sys::CUmemoryPool);

// SAFETY: a pool handle is a driver object usable from any thread of the process; the default
// pool lives as long as the device.
unsafe impl Send for MemPool {}
// SAFETY: as above; the attribute calls made through it are thread-safe in the driver.
unsafe impl Sync for MemPool {}

pub(in crate::backend::cuda) fn default_mem_pool(dev: &CudaDevice) -> Result<MemPool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    guarded("cuDeviceGetDefaultMemPool", || {
        dev.context().bind_to_thread()?;
        // SAFETY: `pool` is a valid out-pointer; the device handle comes from the live context.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, dev.context().cu_device()) }.result()
    })?;
    Ok(MemPool(pool))
}

/// Sets (`Some`) or reads (`None`) a 64-bit attribute of a memory pool.
pub(in crate::backend::cuda) fn pool_attribute(
    pool: MemPool,
    attr: sys::CUmemPool_attribute,
    set: Option<u64>,
) -> Result<u64> {
    let mut value: u64 = set.unwrap_or(0);
    guarded("cuMemPool attribute", || {
        let p = &mut value as *mut u64 as *mut std::ffi::c_void;
        // SAFETY: the pool is the device's default pool (never destroyed); both attributes used
        // here are 64-bit values, and `p` points at a live u64.
        unsafe {
            if set.is_some() {
                sys::cuMemPoolSetAttribute(pool.0, attr, p)
            } else {
                sys::cuMemPoolGetAttribute(pool.0, attr, p)
            }
        }
        .result()
    })?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_round_up_by_at_most_an_eighth() {
        for n in [
            1usize,
            255,
            256,
            257,
            1000,
            4096,
            4097,
            100_000,
            102_400 * 17,
        ] {
            let b = bucket(n);
            assert!(b >= n, "{n} -> {b}");
            assert!(
                n <= 256 || (b - n) * 8 <= n,
                "{n} -> {b} wastes more than an eighth"
            );
            assert_eq!(bucket(b), b, "a bucket size is its own bucket");
        }
    }
}
