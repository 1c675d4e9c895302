//! Rate limits: every limit of the consumer on this route (its plan's and the route's),
//! checked together by [`crate::limiter`]; 429 names the limit that refused; 503 when a
//! shared limit cannot be checked and the cluster fails closed.

use crate::clock::Clock;
use crate::limiter::{self, Now, Refused, Standing};
use crate::response::{secs_up, Refusal, RATELIMIT, RATELIMIT_POLICY};
use crate::snapshot::Route;
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

/// Counts the request against all of the consumer's limits, or refuses with 429.
pub fn check(
    route: &Route,
    consumer: usize,
    clock: &dyn Clock,
) -> Result<Option<Standing>, Refusal> {
    let Some(set) = route.limits.get(consumer).filter(|s| !s.cells.is_empty()) else {
        return Ok(None);
    };
    let now = Now {
        mono: clock.now_nanos(),
        wall: clock.wall_nanos(),
    };
    limiter::check(&set.cells, now).map_err(|r| match r {
        Refused::Limit(s) => Refusal::RateLimited {
            limit: {
                let info = &set.info[s.index];
                info.refused.inc();
                info.label.clone()
            },
            retry_after: s.reset,
            policy: set.policy.clone(),
            ratelimit: ratelimit_value(&set.info[s.index].ratelimit_prefix, 0, s.reset),
        },
        Refused::StoreDown => Refusal::LimitStoreDown,
    })
}

/// Adds `RateLimit-Policy` and `RateLimit` (for the tightest limit) to a response.
pub fn headers(route: &Route, consumer: usize, s: Standing, h: &mut HeaderMap) {
    let Some(set) = route.limits.get(consumer) else {
        return;
    };
    if let Some(p) = &set.policy {
        h.insert(RATELIMIT_POLICY, p.clone());
    }
    h.insert(
        RATELIMIT,
        ratelimit_value(&set.info[s.index].ratelimit_prefix, s.remaining, s.reset),
    );
}
