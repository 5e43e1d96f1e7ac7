//! Page-locked host memory: registered read-only mappings and pinned staging buffers.
//!
//! Host-to-device copies run at full PCIe speed only from page-locked memory. Specter prefers to
//! register the bundle's read-only file mapping itself (no extra copy in host RAM); where the
//! driver refuses that, it stages through a [`PinnedBuffer`].

use crate::backend::cuda::runtime::driver::guarded;
use crate::{Error, Result};
use cudarc::driver::{result as drv, sys, CudaContext, CudaEvent, CudaStream, DevicePtrMut};
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;

/// Issues an asynchronous copy of `src` into the start of `dst` on `stream` and records `done`
/// after it.
///
/// # Safety
/// `src` must be page-locked (pinned or registered) and stay valid and unmodified until `done`
/// has completed; the owners below guarantee that by waiting on `done` before releasing it.
unsafe fn copy_htod_async<D: DevicePtrMut<u8>>(
    src: &[u8],
    dst: &mut D,
    stream: &CudaStream,
    done: &CudaEvent,
) -> Result<()> {
    if dst.len() < src.len() {
        return Err(Error::Backend(format!(
            "host-to-device copy of {} bytes into a device buffer of {} bytes",
            src.len(),
            dst.len()
        )));
    }
    guarded("cannot make the CUDA context current", || {
        stream.context().bind_to_thread()
    })?;
    {
        let (dptr, _record_dst) = dst.device_ptr_mut(stream);
        // SAFETY: `dptr` addresses at least `src.len()` bytes (checked above) and stays alive while
        // `_record_dst` is held; the caller keeps `src` alive until `done` completes.
        guarded("cuMemcpyHtoDAsync", || unsafe {
            drv::memcpy_htod_async(dptr, src, stream.cu_stream())
        })?;
    }
    guarded("cuEventRecord", || done.record(stream))
}

fn checked_range(range: &Range<usize>, len: usize, what: &str) -> Result<()> {
    if range.start > range.end || range.end > len {
        return Err(Error::Backend(format!(
            "byte range {}..{} is outside the {what} of {len} bytes",
            range.start, range.end
        )));
    }
    Ok(())
}

/// Host bytes registered with `cuMemHostRegister(CU_MEMHOSTREGISTER_READ_ONLY)`: the device can
/// DMA from them directly, and they may be a read-only file mapping. Unregistered on drop (after
/// any copy issued through [`Self::copy_to_device`] has finished).
pub struct RegisteredHost<'a> {
    ptr: *const u8,
    len: usize,
    ctx: Arc<CudaContext>,
    last_use: CudaEvent,
    _borrow: PhantomData<&'a [u8]>,
}

// SAFETY: the registration only refers to bytes borrowed immutably for 'a (and `&[u8]` is Sync);
// the context handle and event are thread-safe driver objects.
unsafe impl Send for RegisteredHost<'_> {}
// SAFETY: as above; every method takes `&self` and only reads the bytes.
unsafe impl Sync for RegisteredHost<'_> {}

impl<'a> RegisteredHost<'a> {
    pub(crate) fn register_read_only(ctx: &Arc<CudaContext>, bytes: &'a [u8]) -> Result<Self> {
        if bytes.is_empty() {
            return Err(Error::Backend(
                "cannot register an empty host range with CUDA".into(),
            ));
        }
        let supported = guarded(
            "cuDeviceGetAttribute(READ_ONLY_HOST_REGISTER_SUPPORTED)",
            || {
                ctx.attribute(
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED,
                )
            },
        )?;
        if supported == 0 {
            return Err(Error::Backend(
                "this GPU and driver cannot register read-only host memory \
                 (CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED = 0); copies go through pinned staging"
                    .into(),
            ));
        }
        let last_use = guarded("cuEventCreate", || ctx.new_event(None))?;
        guarded("cannot make the CUDA context current", || {
            ctx.bind_to_thread()
        })?;
        guarded(
            &format!(
                "cuMemHostRegister(READ_ONLY) of {} bytes failed",
                bytes.len()
            ),
            || {
                // SAFETY: `bytes` is a valid allocation of `bytes.len()` bytes that stays borrowed
                // (so mapped and unmodified) for 'a, which outlives this registration. READ_ONLY
                // tells the driver it will never write through the pointer, so the cast to *mut
                // does not permit mutation.
                unsafe {
                    sys::cuMemHostRegister_v2(
                        bytes.as_ptr() as *mut std::ffi::c_void,
                        bytes.len(),
                        sys::CU_MEMHOSTREGISTER_READ_ONLY,
                    )
                }
                .result()
            },
        )?;
        Ok(RegisteredHost {
            ptr: bytes.as_ptr(),
            len: bytes.len(),
            ctx: ctx.clone(),
            last_use,
            _borrow: PhantomData,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The registered bytes.
    pub fn as_slice(&self) -> &'a [u8] {
        // SAFETY: built from a `&'a [u8]` of exactly this pointer and length.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// Asynchronously copies `range` of the registered bytes into the start of `dst` on `stream`.
    pub fn copy_to_device<D: DevicePtrMut<u8>>(
        &self,
        range: Range<usize>,
        dst: &mut D,
        stream: &CudaStream,
    ) -> Result<()> {
        checked_range(&range, self.len, "registered host range")?;
        let src = &self.as_slice()[range];
        // SAFETY: `src` lies inside the registered (page-locked) range, which Drop keeps registered
        // and borrowed until `last_use` (recorded after this copy) has completed.
        unsafe { copy_htod_async(src, dst, stream, &self.last_use) }
    }

    /// Waits until every copy issued through [`Self::copy_to_device`] has finished.
    pub fn wait(&self) -> Result<()> {
        guarded("cuEventSynchronize", || self.last_use.synchronize())
    }
}

impl Drop for RegisteredHost<'_> {
    fn drop(&mut self) {
        // Unregistering while a DMA is still reading would fault the copy; errors here cannot be
        // returned from drop and only mean the memory stays registered until process exit.
        let _ = self.last_use.synchronize();
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` is exactly the pointer registered in `register_read_only`, not yet
        // unregistered, and no copy from it is in flight (waited above).
        let _ = unsafe { sys::cuMemHostUnregister(self.ptr as *mut std::ffi::c_void) };
    }
}

/// A page-locked host allocation (`cuMemHostAlloc`) used to stage copies to the device.
pub struct PinnedBuffer {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<CudaContext>,
    last_use: CudaEvent,
}

// SAFETY: the buffer exclusively owns its allocation; shared access only reads it, and every
// mutable access goes through `&mut self`.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    pub(crate) fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::Backend(
                "cannot allocate an empty pinned host buffer".into(),
            ));
        }
        let last_use = guarded("cuEventCreate", || ctx.new_event(None))?;
        guarded("cannot make the CUDA context current", || {
            ctx.bind_to_thread()
        })?;
        let raw = guarded(
            &format!("cuMemHostAlloc of {len} bytes failed (page-locked memory exhausted?)"),
            || {
                // SAFETY: plain allocation; the memory is zeroed below before anyone reads it.
                unsafe { drv::malloc_host(len, 0) }
            },
        )?;
        let ptr = raw as *mut u8;
        if ptr.is_null() {
            return Err(Error::Backend(format!(
                "cuMemHostAlloc of {len} bytes returned null"
            )));
        }
        // SAFETY: `ptr` is a fresh allocation of `len` writable bytes.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(PinnedBuffer {
            ptr,
            len,
            ctx: ctx.clone(),
            last_use,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes (device copies only read them, so no wait is needed).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` owns `len` initialised bytes (zeroed at allocation) for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes for writing; waits first for copies that still read them.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        guarded("cuEventSynchronize", || self.last_use.synchronize())?;
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only access; no copy is in
        // flight (waited above).
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }

    /// The buffer as f32 values for writing (its whole 4-byte words); waits first for copies
    /// that still read it.
    pub fn as_mut_f32(&mut self) -> Result<&mut [f32]> {
        guarded("cuEventSynchronize", || self.last_use.synchronize())?;
        // SAFETY: cuMemHostAlloc returns page-aligned memory, so `ptr` is aligned for f32; the
        // `len / 4` words lie inside the allocation and were initialised (zeroed) at allocation;
        // `&mut self` makes this the only access, and no copy is in flight (waited above).
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut f32, self.len / 4) })
    }

    /// Asynchronously copies `range` of the buffer into the start of `dst` on `stream`.
    pub fn copy_to_device<D: DevicePtrMut<u8>>(
        &self,
        range: Range<usize>,
        dst: &mut D,
        stream: &CudaStream,
    ) -> Result<()> {
        checked_range(&range, self.len, "pinned buffer")?;
        let src = &self.as_slice()[range];
        // SAFETY: `src` lies in this pinned allocation; `as_mut_slice` and Drop wait on `last_use`
        // (recorded after the copy) before the bytes change or are freed.
        unsafe { copy_htod_async(src, dst, stream, &self.last_use) }
    }

    /// As [`Self::copy_to_device`], into raw device memory.
    ///
    /// # Safety
    /// `dst` must address at least `range.len()` bytes of device memory whose allocation has
    /// completed and that stays allocated until the copy has (the stream is synchronised).
    pub(crate) unsafe fn copy_to_device_ptr(
        &self,
        range: Range<usize>,
        dst: sys::CUdeviceptr,
        stream: &CudaStream,
    ) -> Result<()> {
        checked_range(&range, self.len, "pinned buffer")?;
        let src = &self.as_slice()[range];
        // SAFETY: `src` lies in this pinned allocation, and `as_mut_slice` and Drop wait on
        // `last_use` (recorded after the copy) before the bytes change or are freed; the caller
        // vouches for `dst`.
        guarded("cuMemcpyHtoDAsync", || unsafe {
            drv::memcpy_htod_async(dst, src, stream.cu_stream())
        })?;
        guarded("cuEventRecord", || self.last_use.record(stream))
    }

    /// Waits until every copy issued through [`Self::copy_to_device`] has finished.
    pub fn wait(&self) -> Result<()> {
        guarded("cuEventSynchronize", || self.last_use.synchronize())
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let _ = self.last_use.synchronize();
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from cuMemHostAlloc, is freed only here, and no copy reads it (waited
        // above).
        let _ = unsafe { drv::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}
