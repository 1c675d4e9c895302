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

/// Time to within a few milliseconds, where nothing finer is needed: the upstream pool's
/// idle ages and the `Date` header. A precise reading (`CLOCK_MONOTONIC` through the vDSO,
/// a TSC read) costs about 45 ns on a virtual machine, against about 10 ns for the time the
/// kernel keeps at its tick (`CLOCK_*_COARSE`). Not for deadlines handed to a timer: the
/// coarse clock can lag the precise one by more than a tick, so a deadline made from it
/// could come early. Not for what is measured either.
pub mod coarse {
    use std::time::{Duration, SystemTime};

    /// Monotonic time since an arbitrary start, a few milliseconds behind the precise clock
    /// (3 to 9 ms measured on a 4 ms tick): compared only with other readings of this clock.
    pub fn since_boot() -> Duration {
        imp::since_boot()
    }

    /// The wall clock, a few milliseconds behind.
    pub fn wall() -> SystemTime {
        imp::wall()
    }

    #[cfg(target_os = "linux")]
    mod imp {
        use super::*;
        use rustix::time::{clock_gettime, ClockId, Timespec};

        fn duration(t: Timespec) -> Duration {
            Duration::new(
                u64::try_from(t.tv_sec).unwrap_or(0),
                u32::try_from(t.tv_nsec).unwrap_or(0),
            )
        }

        pub(super) fn since_boot() -> Duration {
            duration(clock_gettime(ClockId::MonotonicCoarse))
        }

        pub(super) fn wall() -> SystemTime {
            SystemTime::UNIX_EPOCH + duration(clock_gettime(ClockId::RealtimeCoarse))
        }
    }

    #[cfg(not(target_os = "linux"))]
    mod imp {
        use super::*;
        use std::sync::OnceLock;
        use std::time::Instant;

        pub(super) fn since_boot() -> Duration {
            static START: OnceLock<Instant> = OnceLock::new();
            START.get_or_init(Instant::now).elapsed()
        }

        pub(super) fn wall() -> SystemTime {
            SystemTime::now()
        }
    }

    #[cfg(all(test, target_os = "linux"))]
    mod tests {
        use super::*;
        use rustix::time::{clock_gettime, ClockId};

        #[test]
        fn never_goes_back_and_follows_the_precise_clock() {
            let mut last = since_boot();
            for _ in 0..10_000 {
                let c = since_boot();
                let t = clock_gettime(ClockId::Monotonic);
                let precise = Duration::new(
                    u64::try_from(t.tv_sec).unwrap_or(0),
                    u32::try_from(t.tv_nsec).unwrap_or(0),
                );
                assert!(c >= last, "{c:?} after {last:?}");
                // Behind the precise clock, never ahead; and not by seconds.
                assert!(c <= precise, "{c:?} ahead of {precise:?}");
                assert!(precise - c < Duration::from_secs(1), "{c:?} {precise:?}");
                last = c;
            }
            let apart = SystemTime::now()
                .duration_since(wall())
                .unwrap_or_else(|e| e.duration());
            assert!(apart < Duration::from_secs(1), "{apart:?}");
        }
    }
}
