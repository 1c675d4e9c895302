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

mod sync;

/// A connection to the Redis at `url` (`rediss://` for TLS), giving up on connecting or on
/// an answer after `timeout`. Every Redis link of the gateway opens this way.
pub async fn redis_connection(
    url: &str,
    timeout: Duration,
) -> Result<redis::aio::MultiplexedConnection, redis::RedisError> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = redis::Client::open(url)?;
    let cfg = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout));
    client
        .get_multiplexed_async_connection_with_config(&cfg)
        .await
}

/// `redis://:secret@host` → `redis://MARK@host`: a Redis URL without its credentials, for
/// logs and the admin API.
pub fn redacted(url: &str, mark: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}{mark}{}", &url[..s + 3], &url[at..]),
        _ => url.to_string(),
    }
}

use crate::limiter::{LimitCell, Refused, Standing};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
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
        SharedLimit {
            cluster: self.clone(),
            key: format!(
                "{}:{}:{}:{}:{}",
                self.cfg.key_prefix,
                scope,
                limit.name,
                limit.requests,
                limit.window.as_secs()
            ),
            credit_base: limit.requests as f64 * self.cfg.max_overadmission,
        }
    }

    /// How long before a window's end a busy limit leases for the next window.
    fn lead_ns(&self) -> u64 {
        let sync = u64::try_from(self.cfg.sync_interval.as_nanos()).unwrap_or(u64::MAX);
        sync.saturating_mul(3)
            .saturating_add(self.rtt_us.load(Ordering::Relaxed).saturating_mul(3_000))
    }

    fn enqueue(&self, cell: &Arc<LimitCell>, l: &mut Lease) {
        if !l.queued {
            l.queued = true;
            self.queue.lock().push(cell.clone());
        }
    }
}

/// How one shared limit is keyed and how much credit it allows.
#[derive(Debug)]
pub struct SharedLimit {
    cluster: Arc<Cluster>,
    /// Redis key without the window index.
    key: String,
    /// N × max_overadmission, split among the nodes at check time.
    credit_base: f64,
}

/// A node's state for one shared limit in the current window.
#[derive(Debug, Default)]
pub struct Lease {
    window: u64,
    /// Leased for `window`, not used yet.
    tokens: u64,
    /// Leased for `window + 1`.
    next_tokens: u64,
    next_requested: bool,
    /// Admitted without a token (credit, or while Redis was down), to settle.
    debt: u64,
    /// Admitted on this node in this window.
    used: u64,
    /// Admitted on this node in the previous window: its share when Redis is down.
    last_used: u64,
    /// Requests seen since the last lease was asked for (the rate estimate).
    demand: u64,
    last_lease: Option<Instant>,
    /// Granted cluster-wide in this window, as of the last answer from Redis.
    granted: u64,
    /// Ask for more when tokens fall to this.
    refill_at: u64,
    queued: bool,
}

impl Lease {
    /// Moves to `window` if the clock has left the current one.
    pub(crate) fn roll(&mut self, window: u64) {
        if window == self.window {
            return;
        }
        let next = window == self.window + 1;
        self.last_used = if next { self.used } else { 0 };
        self.tokens = if next { self.next_tokens } else { 0 };
        self.granted = 0;
        self.next_tokens = 0;
        self.next_requested = false;
        self.debt = 0;
        self.used = 0;
        self.refill_at = 0;
        self.window = window;
    }

    /// Requests counted in this window: cluster-wide as last known, at least this node's.
    pub(crate) fn counted(&self) -> u64 {
        self.granted.max(self.used)
    }

    /// Whether nothing is counted or owed in this window and no lease is in flight: the
    /// state can go (tokens in hand are given up, which only under-admits).
    pub(crate) fn idle(&self) -> bool {
        self.used == 0 && self.debt == 0 && self.last_used == 0 && !self.queued
    }

    /// Whether Redis has said this window of a limit of `n` is used up.
    pub(crate) fn exhausted(&self, n: u64) -> bool {
        self.granted >= n
    }
}

/// How a request was admitted by a shared limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// With a leased token.
    Token,
    /// On credit, to be paid from the next lease.
    Credit,
    /// Within the node's last share while Redis is unreachable.
    FailOpen,
}

impl SharedLimit {
    /// The Redis key counting `window` (index of the window since the Unix epoch).
    pub fn key_for(&self, window: u64) -> String {
        format!("{}:{window}", self.key)
    }

    fn window_end_ns(cell: &LimitCell, window: u64, wall: u64) -> u64 {
        (window + 1)
            .saturating_mul(cell.window_ns)
            .saturating_sub(wall)
    }

    /// Decides whether a request fits, without counting it. Never waits on Redis.
    pub(crate) fn room(
        &self,
        cell: &Arc<LimitCell>,
        l: &mut Lease,
        wall: u64,
    ) -> Result<Admit, Refused> {
        let c = &self.cluster;
        let window = wall / cell.window_ns.max(1);
        l.roll(window);
        l.demand += 1;
        let refuse = |l: &Lease, soon: bool| {
            let end = Self::window_end_ns(cell, l.window, wall);
            // Still waiting for a lease: retry soon; used up: at the window's end.
            let reset = if soon { end.min(1_000_000_000) } else { end };
            Refused::Limit(Standing {
                index: 0,
                remaining: 0,
                reset: Duration::from_nanos(reset),
            })
        };
        if l.tokens > 0 {
            return Ok(Admit::Token);
        }
        if c.is_up() {
            let exhausted = l.exhausted(cell.requests);
            let credit = if exhausted {
                0
            } else {
                (self.credit_base / c.nodes() as f64).floor() as u64
            };
            if l.debt < credit {
                return Ok(Admit::Credit);
            }
            if !exhausted {
                c.enqueue(cell, l);
            }
            return Err(refuse(l, !exhausted));
        }
        match c.cfg.on_redis_down {
            RedisDown::Closed => Err(Refused::StoreDown),
            RedisDown::Open => {
                let share = if l.last_used > 0 {
                    l.last_used
                } else {
                    cell.requests.div_ceil(c.nodes())
                };
                if l.used < share {
                    Ok(Admit::FailOpen)
                } else {
                    Err(refuse(l, false))
                }
            }
        }
    }

    /// Counts an admitted request and returns where the limit stands.
    pub(crate) fn commit(
        &self,
        cell: &Arc<LimitCell>,
        l: &mut Lease,
        admit: Admit,
        index: usize,
        wall: u64,
    ) -> Standing {
        let c = &self.cluster;
        match admit {
            Admit::Token => l.tokens -= 1,
            Admit::Credit => l.debt += 1,
            Admit::FailOpen => {
                l.debt += 1;
                c.metrics.fail_open_admitted.fetch_add(1, Ordering::Relaxed);
            }
        }
        l.used += 1;
        let end = Self::window_end_ns(cell, l.window, wall);
        let near_end = end < c.lead_ns();
        if l.debt > 0
            || (!l.exhausted(cell.requests) && l.tokens <= l.refill_at)
            || (near_end && !l.next_requested)
        {
            c.enqueue(cell, l);
        }
        Standing {
            index,
            remaining: cell.requests.saturating_sub(l.granted.max(l.used)) + l.tokens,
            reset: Duration::from_nanos(end),
        }
    }
}
