//! What the harnesses that run I/O share: one runtime per thread, and a bound on an input.

use std::time::Duration;
use tokio::runtime::Runtime;

/// How long one input may take before the harness calls it a hang.
pub(super) const HANG: Duration = Duration::from_secs(5);

thread_local! {
    /// One single-threaded runtime per thread, reused by every input.
    pub(super) static RUNTIME: Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime");
}
