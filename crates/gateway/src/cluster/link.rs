//! A node's link to the cluster: what the request path reads of it, and what the syncer
//! fills in.

use crate::limiter::shared::{SharedLimit, SharedStore};
use crate::limiter::LimitCell;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::watch;
use tollgate_config::{ClusterConfig, LimitConfig, RedisDown};

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
    pub(super) queue: Mutex<Vec<Arc<LimitCell>>>,
    pub(super) up: AtomicBool,
    pub(super) nodes: AtomicU64,
    pub(super) rtt_us: AtomicU64,
    pub(super) rounds: watch::Sender<u64>,
    /// The Redis server the syncer last connected to, and when it switched to another.
    pub(super) server: parking_lot::Mutex<Server>,
    /// Counters for metrics.
    pub metrics: ClusterMetrics,
}

/// Which Redis server a node shares its limits through, for `/status`.
#[derive(Debug, Default, Clone)]
pub struct Server {
    /// `host:port` (with sentinels, the master they named).
    pub address: Option<String>,
    /// When the node connected to it, seconds since the epoch.
    pub connected_at: Option<u64>,
    /// When the node last moved to another server (a failover), seconds since the epoch.
    pub switched_at: Option<u64>,
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
            server: parking_lot::Mutex::default(),
            metrics: ClusterMetrics::default(),
        })
    }

    /// The Redis server the node uses (or last used), and when it switched.
    pub fn server(&self) -> Server {
        self.server.lock().clone()
    }

    /// Records a connection to the server at `address`.
    pub(super) fn connected_to(&self, address: String) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut s = self.server.lock();
        if s.address.as_ref().is_some_and(|a| *a != address) {
            s.switched_at = Some(now);
        }
        s.address = Some(address);
        s.connected_at = Some(now);
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
    pub fn limit(self: &Arc<Self>, scope: &str, limit: &LimitConfig) -> SharedLimit<LimitCell> {
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

impl SharedStore<LimitCell> for Cluster {
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

    fn shared_limit(self: Arc<Self>, scope: &str, limit: &LimitConfig) -> SharedLimit<LimitCell> {
        self.limit(scope, limit)
    }
}
