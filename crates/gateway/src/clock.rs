//! Time for rate limits, injectable so tests drive it instead of sleeping.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A monotonic clock in nanoseconds since an arbitrary start.
pub trait Clock: Send + Sync + 'static {
    /// Nanoseconds since this clock's start; never goes backwards.
    fn now_nanos(&self) -> u64;

    /// Nanoseconds since the Unix epoch: cluster windows are aligned to it so that every
    /// node agrees on them.
    fn wall_nanos(&self) -> u64;
}

/// The real monotonic clock.
#[derive(Debug)]
pub struct SystemClock {
    start: Instant,
}

impl SystemClock {
    /// A clock starting now.
    pub fn new() -> Arc<Self> {
        Arc::new(SystemClock {
            start: Instant::now(),
        })
    }
}

impl Clock for SystemClock {
    fn now_nanos(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn wall_nanos(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
    }
}

/// A clock that moves only when told to; for tests of time-based behaviour.
#[derive(Debug, Default)]
pub struct ManualClock {
    nanos: AtomicU64,
}

impl ManualClock {
    /// A clock at time zero.
    pub fn new() -> Arc<Self> {
        Arc::new(ManualClock::default())
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_add(by, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_nanos(&self) -> u64 {
        self.nanos.load(Ordering::SeqCst)
    }

    fn wall_nanos(&self) -> u64 {
        self.nanos.load(Ordering::SeqCst)
    }
}

/// Whole seconds since the first call: a cheap, coarse clock for rate-limiting log lines.
pub fn coarse_secs() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_secs()
        + 1
}
