//! A consumer's current usage of each of its limits, from the counters that enforce them:
//! this node's counters for local limits, Redis for shared ones.

use crate::cluster::Cluster;
use crate::limiter::Now;
use crate::snapshot::Snapshot;
use serde::{Deserialize, Serialize};

/// Usage of one limit.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LimitUsage {
    /// The limit's name.
    pub name: String,
    /// `plan` or `route:NAME`.
    pub scope: String,
    /// Requests allowed per window.
    pub requests: u64,
    /// Window length in seconds.
    pub window_seconds: u64,
    /// Requests counted in the current window.
    pub used: u64,
    /// Requests left in the current window.
    pub remaining: u64,
}

/// Usage of every limit of a consumer.
#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    /// The consumer.
    pub consumer: String,
    /// Whether the counts are shared by the cluster (read from Redis).
    pub shared: bool,
    /// What `used` counts: `requests` admitted (on one node), or tokens `granted` to the
    /// nodes (shared: leased ahead of requests, some maybe not yet used).
    pub counted: &'static str,
    /// One entry per limit.
    pub limits: Vec<LimitUsage>,
}

/// Why usage could not be read.
#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    /// No consumer by that name.
    #[error("no consumer named {0:?}")]
    UnknownConsumer(String),
    /// The consumer is managed through the admin API on another plan than its listed
    /// one, and the table of such consumers is full.
    #[error("too many consumers on plans other than their listed ones to count one more")]
    TooManyGuests,
    /// The consumer is managed through the admin API on a plan this node's config lacks.
    #[error("consumer {0:?} is on a plan this node's config does not define")]
    UnknownPlan(String),
    /// Redis could not be read.
    #[error("cannot read the shared counters from Redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// Usage of `consumer` (listed, or managed through the admin API) now, from `snap`'s
/// counters (and Redis for shared limits).
pub async fn usage(
    snap: &Snapshot,
    cluster: Option<&Cluster>,
    consumer: &str,
    now: Now,
) -> Result<Usage, UsageError> {
    // Listed in the config or managed through the admin API, as a request finds it; else
    // a caller a token named (on its plan or the route's `anonymous_plan`) since the
    // last reload.
    let index = snap
        .find_consumer(consumer)
        .map_err(|r| match r {
            crate::exchange::Refusal::UnknownPlan => UsageError::UnknownPlan(consumer.into()),
            _ => UsageError::TooManyGuests,
        })?
        .or_else(|| {
            // Only a name neither listed nor managed: a deleted consumer stays unknown.
            let known = snap.config.consumers.find(consumer).is_some()
                || snap.roster.get(consumer).is_some();
            (!known)
                .then(|| snap.counters.guest_named(consumer))
                .flatten()
        })
        .ok_or_else(|| UsageError::UnknownConsumer(consumer.to_string()))?;
    let group = snap.counters.group(index, now);
    let mut limits = Vec::new();
    let mut keys = Vec::new();
    for (cell, info) in snap.limits_of(index, &group) {
        // Shared limits are read from Redis below; local ones from the cell.
        let used = match &cell.shared {
            Some(shared) => {
                let sub = now.wall / cell.slot_ns();
                keys.push((limits.len(), shared.key().to_string(), sub));
                0
            }
            None => cell.used(now),
        };
        limits.push(LimitUsage {
            name: info.name.clone(),
            scope: info.scope.clone(),
            requests: cell.requests(),
            window_seconds: info.window_secs,
            used,
            remaining: cell.requests().saturating_sub(used),
        });
    }
    let shared = !keys.is_empty();
    if let (Some(c), true) = (cluster, shared) {
        let conn = crate::redis_link::redis_connection(
            &c.cfg.redis,
            c.cfg.redis_tls.as_ref(),
            std::time::Duration::from_secs(2),
        )
        .await?;
        let cmds = keys
            .iter()
            .map(|(_, k, _)| {
                let mut cmd = redis::cmd("HGETALL");
                cmd.arg(k);
                (k.clone(), cmd)
            })
            .collect();
        let counts = crate::redis_link::query_keyed(&conn, cmds).await?;
        for ((at, _, sub), v) in keys.iter().zip(counts) {
            let subs: Vec<(u64, u64)> = redis::from_redis_value(v).unwrap_or_default();
            let l = &mut limits[*at];
            l.used = counted(&subs, *sub);
            l.remaining = l.requests.saturating_sub(l.used);
        }
    }
    Ok(Usage {
        consumer: consumer.to_string(),
        shared,
        counted: if shared { "granted" } else { "requests" },
        limits,
    })
}

/// Requests a limit's sub-window counts hold in the window ending at sub-window `sub`.
pub fn counted(subs: &[(u64, u64)], sub: u64) -> u64 {
    let from = sub.saturating_sub(crate::limiter::shared::SPAN);
    subs.iter()
        .filter(|(s, _)| (from..=sub).contains(s))
        .map(|(_, n)| n)
        .sum()
}
