//! Rate limits: every limit of the consumer on this route (its plan's and the route's),
//! checked together by [`crate::limiter`]; 429 names the limit that refused; 503 when a
//! shared limit cannot be checked and the cluster fails closed.

use crate::clock::Clock;
use crate::exchange::Refusal;
use crate::limiter::{Now, Refused, Standing};
use crate::response::{secs_up, RATELIMIT, RATELIMIT_POLICY};
use crate::snapshot::{Route, Snapshot};
use http::{HeaderMap, HeaderValue};
use std::time::Duration;

/// `"name";r=REMAINING;t=RESET`, from the limit's precomputed prefix (on every admitted
/// request, so no formatting machinery).
fn ratelimit_value(prefix: &str, remaining: u64, reset: Duration) -> HeaderValue {
    let mut r = itoa::Buffer::new();
    let mut t = itoa::Buffer::new();
    let (r, t) = (r.format(remaining), t.format(secs_up(reset)));
    let mut v = String::with_capacity(prefix.len() + r.len() + 3 + t.len());
    v.push_str(prefix);
    v.push_str(r);
    v.push_str(";t=");
    v.push_str(t);
    HeaderValue::from_str(&v).unwrap_or_else(|_| HeaderValue::from_static("\"limit\";r=0;t=1"))
}

/// What the limits said of a request they did not refuse.
#[derive(Debug)]
pub enum Limited {
    /// Counted; the tightest limit's standing, if the route has limits.
    Admitted(Option<Standing>),
    /// Nothing counted: a shared limit waits on its lease, which the cluster's next round
    /// brings. Checked again then, the request may pass.
    Leasing,
}

/// How a request meets its limits: for the first time, or again after waiting for a lease
/// (and whether it may wait once more).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// The first check: it may wait for a lease.
    First,
    /// A check after a wait; `may_wait`: the wait is not over.
    Again {
        /// Whether a shared limit still leasing says [`Limited::Leasing`] (else 429).
        may_wait: bool,
    },
}

/// Counts the request against all of the consumer's limits (those of its plan's slot),
/// or refuses with 429. While it may wait, a shared limit whose lease is on its way says
/// [`Limited::Leasing`] instead of refusing.
pub fn check(
    snap: &Snapshot,
    route: &Route,
    consumer: usize,
    slot: usize,
    clock: &dyn Clock,
    attempt: Attempt,
) -> Result<Limited, Refusal> {
    let Some(set) = route
        .limit_sets
        .get(slot)
        .filter(|s| !s.positions.is_empty())
    else {
        return Ok(Limited::Admitted(None));
    };
    let now = Now {
        mono: clock.now_nanos(),
        wall: clock.wall_nanos(),
    };
    let (again, may_wait) = match attempt {
        Attempt::First => (false, true),
        Attempt::Again { may_wait } => (true, may_wait),
    };
    match snap.counters.check_as(consumer, &set.positions, now, again) {
        Ok(s) => Ok(Limited::Admitted(s)),
        Err(Refused::Leasing(_)) if may_wait => Ok(Limited::Leasing),
        Err(Refused::Limit(s) | Refused::Leasing(s)) => {
            let Some(info) = set.info.get(s.index) else {
                return Err(Refusal::LimitStoreDown);
            };
            info.refused.inc();
            Err(Refusal::RateLimited {
                limit: info.label.clone(),
                retry_after: s.reset,
                policy: set.policy.clone(),
                ratelimit: ratelimit_value(&info.ratelimit_prefix, 0, s.reset),
            })
        }
        // A shared limit that cannot be checked, or cells retired under the request
        // again and again (the sweeper retires only idle ones, so this does not last).
        Err(Refused::StoreDown | Refused::Retired) => Err(Refusal::LimitStoreDown),
    }
}

/// Adds `RateLimit-Policy` and `RateLimit` (for the tightest limit) to a response.
pub fn headers(route: &Route, plan_slot: usize, s: Standing, h: &mut HeaderMap) {
    let Some(set) = route.limit_sets.get(plan_slot) else {
        return;
    };
    if let Some(p) = &set.policy {
        h.insert(RATELIMIT_POLICY, p.clone());
    }
    if let Some(info) = set.info.get(s.index) {
        h.insert(
            RATELIMIT,
            ratelimit_value(&info.ratelimit_prefix, s.remaining, s.reset),
        );
    }
}
