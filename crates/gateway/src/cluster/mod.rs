//! Limits shared by several nodes through Redis, with no Redis call on the request path.
//!
//! A shared limit of N per window W is counted in fixed windows aligned to the wall clock
//! (`[kW, (k+1)W)`, the same on every node). Redis holds, per limit and window, how many
//! requests have been granted cluster-wide. A node admits a request from **tokens** it has
//! leased from Redis beforehand; a background task (one per node) leases more every
//! `sync_interval`, in one pipelined round of Lua calls that each grant
//! `min(want, N − granted)` atomically. Lease sizes follow each node's own traffic
//! (its recent rate × (two sync intervals + three Redis round trips)), capped at a fair
//! share of what is left (`(N − granted) / nodes`), so the budget goes where the traffic is.
//! Near a window's end, busy nodes lease for the next window so it starts with tokens.
//!
//! A node without tokens may admit a few requests on **credit** — at most
//! `floor(N × max_overadmission / nodes)` outstanding — and pays them from its next lease.
//! Credit is the only way to admit without a grant, so with Redis reachable:
//!
//! > cluster-wide admitted per window ≤ N + nodes × floor(N × max_overadmission / nodes)
//! > ≤ N × (1 + max_overadmission)
//!
//! whatever the sync interval, the rates or the split of traffic (and exactly N when
//! `N × max_overadmission < nodes`, e.g. a limit of 1: it waits for its token). Tokens a node
//! leased and did not use by the window's end are lost: that is under-admission, never over.
//!
//! While Redis is unreachable, `on_redis_down: open` lets each node admit up to its last
//! share (what it admitted in the previous window, or N / nodes without history), so the
//! cluster admits at most Σ last shares ≈ N per window when traffic keeps its split (at most
//! nodes × N in the worst case); `closed` answers 503. Requests admitted meanwhile are
//! settled with Redis if it is back before their window ends. Reconnects back off from
//! 100 ms to 5 s.

mod report;
mod sync;

use crate::limiter::shared::{SharedLimit, SharedStore};
use crate::limiter::LimitCell;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::watch;
use tollgate_config::{ClusterConfig, LimitConfig, RedisDown};

pub use sync::spawn_syncer;

/// Counters about the cluster link, for metrics.
#[derive(Debug, Default)]
pub struct ClusterMetrics {
    /// Failed rounds and connection attempts.
    pub errors: AtomicU64,
    /// Tokens granted to this node.
    pub granted: AtomicU64,
    /// Requests admitted on credit that Redis could not grant afterwards.
    pub overadmitted: AtomicU64,
    /// Requests admitted while Redis was unreachable.
    pub fail_open_admitted: AtomicU64,
}

/// A node's link to the cluster: what the request path reads, what the syncer fills.
#[derive(Debug)]
pub struct Cluster {
    /// Settings.
    pub cfg: ClusterConfig,
    /// This node's id in Redis.
    pub node_id: String,
    queue: Mutex<Vec<Arc<LimitCell>>>,
    up: AtomicBool,
    nodes: AtomicU64,
    rtt_us: AtomicU64,
    rounds: watch::Sender<u64>,
    /// Counters for metrics.
    pub metrics: ClusterMetrics,
}

impl Cluster {
    /// The cluster state of a node; the syncer is started with [`spawn_syncer`].
    pub fn new(cfg: ClusterConfig) -> Arc<Cluster> {
        let node_id = format!(
            "{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        );
        Arc::new(Cluster {
            cfg,
            node_id,
            queue: Mutex::new(Vec::new()),
            up: AtomicBool::new(false),
            nodes: AtomicU64::new(1),
            rtt_us: AtomicU64::new(1_000),
            rounds: watch::channel(0).0,
            metrics: ClusterMetrics::default(),
        })
    }

    /// Whether the last exchange with Redis succeeded.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// Live nodes seen in Redis (at least 1).
    pub fn nodes(&self) -> u64 {
        self.nodes.load(Ordering::Relaxed).max(1)
    }

    /// Follows completed sync rounds (each round: leases asked and answered, or failed).
    pub fn rounds(&self) -> watch::Receiver<u64> {
        self.rounds.subscribe()
    }

    /// The round trip of the last sync round with Redis, in microseconds (a smoothed value).
    pub fn last_round_micros(&self) -> u64 {
        self.rtt_us.load(Ordering::Relaxed)
    }

    /// Sync rounds so far, failed ones included.
    pub fn rounds_done(&self) -> u64 {
        *self.rounds.borrow()
    }

    /// The shared-counting handle for one limit of one scope (consumer, or route+consumer).
    pub fn limit(self: &Arc<Self>, scope: &str, limit: &LimitConfig) -> SharedLimit {
        SharedLimit::new(
            self.clone(),
            format!(
                "{}:{}:{}:{}:{}",
                self.cfg.key_prefix,
                scope,
                limit.name,
                limit.requests,
                limit.window.as_secs()
            ),
            limit.requests as f64 * self.cfg.max_overadmission,
        )
    }

    /// How long before a window's end a busy limit leases for the next window.
    pub(crate) fn lead_ns(&self) -> u64 {
        let sync = u64::try_from(self.cfg.sync_interval.as_nanos()).unwrap_or(u64::MAX);
        sync.saturating_mul(3)
            .saturating_add(self.rtt_us.load(Ordering::Relaxed).saturating_mul(3_000))
    }
}

impl SharedStore for Cluster {
    fn is_up(&self) -> bool {
        Cluster::is_up(self)
    }

    fn nodes(&self) -> u64 {
        Cluster::nodes(self)
    }

    fn fail_open(&self) -> bool {
        self.cfg.on_redis_down == RedisDown::Open
    }

    fn lead_ns(&self) -> u64 {
        Cluster::lead_ns(self)
    }

    fn enqueue(&self, cell: &Arc<LimitCell>) {
        self.queue.lock().push(cell.clone());
    }

    fn admitted_fail_open(&self) {
        self.metrics
            .fail_open_admitted
            .fetch_add(1, Ordering::Relaxed);
    }

    fn shared_limit(self: Arc<Self>, scope: &str, limit: &LimitConfig) -> SharedLimit {
        self.limit(scope, limit)
    }
}
