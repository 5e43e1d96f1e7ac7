//! Driver calls made safe to fail: cudarc turns some driver failures (a symbol missing from an
//! old driver) into panics; [`guarded`] maps those and ordinary errors to [`Error::Backend`].

use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::driver::result as drv;

use crate::{Error, Result};

pub(crate) fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// Runs a driver call that cudarc might turn into a panic (a symbol missing from an old driver)
/// and maps both failure kinds to [`Error::Backend`] with `what` as context.
pub(crate) fn guarded<T>(
    what: &str,
    f: impl FnOnce() -> std::result::Result<T, drv::DriverError>,
) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(err)) => Err(Error::Backend(format!("{what}: {err}"))),
        Err(panic) => Err(Error::Backend(format!("{what}: {}", panic_text(&panic)))),
    }
}
