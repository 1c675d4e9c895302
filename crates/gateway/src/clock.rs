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

/// Time to within a few milliseconds, for deadlines, idle ages and the `Date` header. Each
/// request sets or checks several of these, and a precise reading (`CLOCK_MONOTONIC` through the
/// vDSO, a TSC read) costs about 45 ns on a virtual machine, against about 10 ns for the
/// tick the kernel already keeps (`CLOCK_*_COARSE`). Never for what is measured: request
/// and upstream latencies keep `Instant::now()`.
pub mod coarse {
    use std::time::{Duration, SystemTime};
    use tokio::time::Instant;

    /// Now: never earlier than the precise clock, and at most two kernel ticks (2 to 8 ms)
    /// later, so a deadline made from it is never early.
    pub fn now() -> Instant {
        imp::now()
    }

    /// The wall clock, to within a kernel tick.
    pub fn wall() -> SystemTime {
        imp::wall()
    }

    #[cfg(target_os = "linux")]
    mod imp {
        use super::*;
        use rustix::time::{clock_getres, clock_gettime, ClockId, Timespec};
        use std::sync::LazyLock;

        fn since_boot(t: Timespec) -> Duration {
            Duration::new(
                u64::try_from(t.tv_sec).unwrap_or(0),
                u32::try_from(t.tv_nsec).unwrap_or(0),
            )
        }

        /// A precise instant and the coarse reading taken just before it.
        static BASE: LazyLock<(Instant, Duration)> = LazyLock::new(|| {
            let tick = since_boot(clock_getres(ClockId::MonotonicCoarse));
            let coarse = since_boot(clock_gettime(ClockId::MonotonicCoarse));
            // The coarse clock lags the precise one by less than a tick: counted from a
            // tick after the precise reading, every reading is at or after the true time.
            (Instant::now() + tick, coarse)
        });

        pub(super) fn now() -> Instant {
            let (at, coarse) = *BASE;
            let moved = since_boot(clock_gettime(ClockId::MonotonicCoarse)).saturating_sub(coarse);
            at + moved
        }

        pub(super) fn wall() -> SystemTime {
            SystemTime::UNIX_EPOCH + since_boot(clock_gettime(ClockId::RealtimeCoarse))
        }
    }

    #[cfg(not(target_os = "linux"))]
    mod imp {
        use super::*;

        pub(super) fn now() -> Instant {
            Instant::now()
        }

        pub(super) fn wall() -> SystemTime {
            SystemTime::now()
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn never_earlier_than_the_precise_clock_and_at_most_a_few_ticks_later() {
            for _ in 0..10_000 {
                let before = Instant::now();
                let c = now();
                let after = Instant::now();
                assert!(c >= before, "{c:?} before {before:?}");
                assert!(c <= after + Duration::from_millis(20), "{c:?} {after:?}");
            }
            let w = wall();
            let precise = SystemTime::now();
            let apart = precise.duration_since(w).unwrap_or_else(|e| e.duration());
            assert!(apart < Duration::from_millis(20), "{apart:?}");
        }
    }
}
