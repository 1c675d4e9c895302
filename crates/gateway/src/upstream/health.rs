//! Target health: passive (failed connects, timeouts and 5xx answers in a row take a target
//! out for `backoff`, after which one request tries it again) and active (`GET path` every
//! `interval`; `unhealthy` failures in a row take it out, `healthy` successes bring it back).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use tollgate_config::HealthConfig;

/// Milliseconds on a process-wide monotonic clock (never 0).
fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let start = START.get_or_init(Instant::now);
    u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX) + 1
}

/// One target's health.
#[derive(Debug)]
pub struct Health {
    /// Passive failures in a row.
    fails: AtomicU32,
    /// Passive: out of rotation until this time (ms on [`now_ms`]); 0 when in.
    out_until: AtomicU64,
    /// Active checks' verdict (true without active checks).
    active_up: AtomicBool,
    /// Active checks: successes (positive) or failures (negative) in a row.
    streak: std::sync::atomic::AtomicI64,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            fails: AtomicU32::new(0),
            out_until: AtomicU64::new(0),
            active_up: AtomicBool::new(true),
            streak: std::sync::atomic::AtomicI64::new(0),
        }
    }
}

impl Health {
    /// Whether requests may go to the target now. A target whose passive back-off has
    /// passed is in again; its next failure takes it out at once.
    pub fn is_up(&self) -> bool {
        if !self.active_up.load(Ordering::Relaxed) {
            return false;
        }
        let until = self.out_until.load(Ordering::Relaxed);
        until == 0 || now_ms() >= until
    }

    /// Whether active checks (if any) let requests go to the target, whatever passive
    /// checks say.
    pub fn actively_up(&self) -> bool {
        self.active_up.load(Ordering::Relaxed)
    }

    /// A request to the target failed (connect, timeout, 5xx). Returns true when this
    /// failure took the target out.
    pub fn failed(&self, cfg: &HealthConfig) -> bool {
        if cfg.failures == 0 {
            return false;
        }
        let n = self.fails.fetch_add(1, Ordering::Relaxed).saturating_add(1);
        if n < cfg.failures {
            return false;
        }
        let backoff = u64::try_from(cfg.backoff.as_millis()).unwrap_or(u64::MAX);
        let was = self
            .out_until
            .swap(now_ms().saturating_add(backoff), Ordering::Relaxed);
        was == 0 || was <= now_ms()
    }

    /// A request to the target succeeded: it is fully in.
    pub fn succeeded(&self) {
        if self.fails.load(Ordering::Relaxed) != 0 {
            self.fails.store(0, Ordering::Relaxed);
        }
        if self.out_until.load(Ordering::Relaxed) != 0 {
            self.out_until.store(0, Ordering::Relaxed);
        }
    }

    /// Notes an active check's result; returns the verdict when it changed. Only the
    /// upstream's one checking task calls it, so the streak needs no read-modify-write.
    pub fn checked(&self, ok: bool, healthy: u32, unhealthy: u32) -> Option<bool> {
        let prev = self.streak.load(Ordering::Relaxed);
        let s = match (ok, prev) {
            (true, p) if p > 0 => p + 1,
            (true, _) => 1,
            (false, p) if p < 0 => p - 1,
            (false, _) => -1,
        };
        self.streak.store(s, Ordering::Relaxed);
        let up = self.active_up.load(Ordering::Relaxed);
        if up && s <= -i64::from(unhealthy) {
            self.active_up.store(false, Ordering::Relaxed);
            return Some(false);
        }
        if !up && s >= i64::from(healthy) {
            self.active_up.store(true, Ordering::Relaxed);
            // Back by active checks: passive failures start over.
            self.succeeded();
            return Some(true);
        }
        None
    }
}

/// How long to wait before the first active check of a new upstream: a small spread so
/// that upstreams made by one reload are not all checked at one instant.
pub fn first_check_delay(interval: Duration) -> Duration {
    let ms = u64::try_from(interval.as_millis()).unwrap_or(0).min(1000);
    Duration::from_millis(fastrand::u64(0..=ms / 10))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(failures: u32, backoff_ms: u64) -> HealthConfig {
        HealthConfig {
            failures,
            backoff: Duration::from_millis(backoff_ms),
            active: None,
        }
    }

    #[test]
    fn passive_failures_in_a_row_take_a_target_out() {
        let h = Health::default();
        let c = cfg(3, 60_000);
        assert!(!h.failed(&c));
        h.succeeded();
        assert!(!h.failed(&c));
        assert!(!h.failed(&c));
        assert!(h.is_up());
        assert!(h.failed(&c), "the third failure in a row takes it out");
        assert!(!h.is_up());
        h.succeeded();
        assert!(h.is_up());
    }

    #[test]
    fn passive_checks_can_be_off() {
        let h = Health::default();
        for _ in 0..10 {
            assert!(!h.failed(&cfg(0, 1000)));
        }
        assert!(h.is_up());
    }

    #[test]
    fn a_passed_backoff_lets_the_target_be_tried_again() {
        let h = Health::default();
        assert!(h.failed(&cfg(1, 0)));
        assert!(h.is_up(), "a zero back-off has passed at once");
        assert!(
            h.failed(&cfg(1, 60_000)),
            "and the next failure takes it out again"
        );
        assert!(!h.is_up());
    }

    #[test]
    fn active_checks_need_streaks_both_ways() {
        let h = Health::default();
        assert_eq!(h.checked(false, 2, 3), None);
        assert_eq!(h.checked(false, 2, 3), None);
        assert_eq!(
            h.checked(true, 2, 3),
            None,
            "a success breaks the failure streak"
        );
        assert_eq!(h.checked(false, 2, 3), None);
        assert_eq!(h.checked(false, 2, 3), None);
        assert_eq!(h.checked(false, 2, 3), Some(false));
        assert!(!h.is_up());
        assert_eq!(h.checked(true, 2, 3), None);
        assert_eq!(h.checked(true, 2, 3), Some(true));
        assert!(h.is_up());
    }
}
