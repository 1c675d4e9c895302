//! A node's link to the cluster: what the request path reads of it, and what the syncer
//! fills in.

use crate::limiter::shared::{SharedLimit, SharedStore};
use crate::limiter::LimitCell;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
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
    /// The limits that were granted tokens and may hold some still (`Lease::held`).
    pub(super) holders: Mutex<Vec<Arc<LimitCell>>>,
    pub(super) up: AtomicBool,
    /// A Redis Cluster's last round failed in part (a master down): the limits it keeps
    /// fall back while the others share on.
    pub(super) partly_down: AtomicBool,
    pub(super) nodes: AtomicU64,
    pub(super) rtt_us: AtomicU64,
    pub(super) rounds: watch::Sender<u64>,
    /// Moves on at each part of a round settled (a hash slot's answers on a Redis
    /// Cluster) and at each round's end.
    pub(super) answers: watch::Sender<u64>,
    /// Starts the next round before its tick: a request waits for a lease.
    pub(super) hurry: Arc<tokio::sync::Notify>,
    /// Connections made to Redis so far: tokens are given back only on the connection
    /// that granted them.
    pub(super) link: AtomicU32,
    /// Asks sent to the store so far: each carries its number, so that the store runs it
    /// at most once.
    pub(super) asks: AtomicU64,
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
    /// On a Redis Cluster: the masters serving slots, as last asked.
    pub masters: Vec<String>,
    /// On a Redis Cluster: how many of the 16,384 hash slots have a master.
    pub slots: u32,
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
            holders: Mutex::new(Vec::new()),
            up: AtomicBool::new(false),
            partly_down: AtomicBool::new(false),
            nodes: AtomicU64::new(1),
            rtt_us: AtomicU64::new(1_000),
            rounds: watch::channel(0).0,
            answers: watch::channel(0).0,
            hurry: Arc::new(tokio::sync::Notify::new()),
            link: AtomicU32::new(0),
            asks: AtomicU64::new(0),
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

    /// Records the masters of a Redis Cluster and how many slots they serve; a changed set
    /// of masters (a failover, a resharding) counts as a switch, and is returned true.
    pub(super) fn connected_to_cluster(&self, (masters, slots): (Vec<String>, u32)) -> bool {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut s = self.server.lock();
        let mut switched = false;
        if s.masters != masters {
            if !s.masters.is_empty() {
                s.switched_at = Some(now);
                switched = true;
            }
            s.connected_at = Some(now);
        }
        s.address = Some(masters.join(","));
        s.masters = masters;
        s.slots = slots;
        switched
    }

    /// Whether the last exchange with Redis succeeded.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// Whether the limits are shared through a Redis Cluster (not one server).
    pub fn is_cluster_topology(&self) -> bool {
        matches!(self.cfg.redis, tollgate_config::RedisTarget::Cluster { .. })
    }

    /// Whether the last round with a Redis Cluster failed in part (see `on_redis_down`).
    pub fn is_partly_down(&self) -> bool {
        self.partly_down.load(Ordering::Relaxed)
    }

    /// Live nodes seen in Redis (at least 1).
    pub fn nodes(&self) -> u64 {
        self.nodes.load(Ordering::Relaxed).max(1)
    }

    /// Follows ended sync rounds (each round: leases asked and answered, or failed), counted
    /// as each ends with every earlier round: two more than now means a round that started
    /// after now has ended.
    pub fn rounds(&self) -> watch::Receiver<u64> {
        self.rounds.subscribe()
    }

    /// Follows what settles leases: each part of a round answered or failed (a hash slot's
    /// on a Redis Cluster, whose other parts may still be on their way), and each round's
    /// end. A request waiting for its lease checks again at each.
    pub fn answers(&self) -> watch::Receiver<u64> {
        self.answers.subscribe()
    }

    /// The round trip of the last sync round with Redis, in microseconds (a smoothed value).
    pub fn last_round_micros(&self) -> u64 {
        self.rtt_us.load(Ordering::Relaxed)
    }

    /// Sync rounds so far, failed ones included.
    pub fn rounds_done(&self) -> u64 {
        *self.rounds.borrow()
    }

    /// The shared-counting handle for one limit of a consumer (on one route, for a route's
    /// own limit). Its key names the consumer in braces, `PREFIX:[route:R:]consumer:{NAME}:
    /// LIMIT:N:W`: a Redis Cluster keeps all of a consumer's keys in one hash slot.
    pub fn limit(
        self: &Arc<Self>,
        route: Option<&str>,
        consumer: &str,
        limit: &LimitConfig,
    ) -> SharedLimit<LimitCell> {
        let route = route.map_or_else(String::new, |r| format!("route:{}:", key_part(r)));
        SharedLimit::new(
            self.clone(),
            format!(
                "{}:{route}consumer:{{{}}}:{}:{}",
                self.cfg.key_prefix,
                key_part(consumer),
                limit.counted_as,
                limit.window.as_secs()
            ),
            self.cfg.max_overadmission,
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

    fn hurry(&self) {
        self.hurry.notify_one();
    }

    fn admitted_fail_open(&self) {
        self.metrics
            .fail_open_admitted
            .fetch_add(1, Ordering::Relaxed);
    }

    fn shared_limit(
        self: Arc<Self>,
        route: Option<&str>,
        consumer: &str,
        limit: &LimitConfig,
    ) -> SharedLimit<LimitCell> {
        self.limit(route, consumer, limit)
    }
}

/// `name` as a part of a Redis key: `%`, `{` and `}` percent-encoded. The consumer's braces
/// are then the key's hash tag whatever the names hold, and every key made from it (the
/// limit's counts, its asks) lies in one hash slot: a name that began with `}` would leave
/// an empty tag, and the keys in slots of their own.
pub(crate) fn key_part(name: &str) -> std::borrow::Cow<'_, str> {
    if !name.contains(['%', '{', '}']) {
        return std::borrow::Cow::Borrowed(name);
    }
    let mut out = String::with_capacity(name.len() + 6);
    for c in name.chars() {
        match c {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// The masters of a Redis Cluster (`host:port`, sorted) and how many slots they serve,
/// from `CLUSTER SLOTS` as the first master to answer sees them: it fails only when no
/// master answers.
pub(super) async fn cluster_masters(
    conn: &mut crate::redis_link::RedisConn,
) -> Result<(Vec<String>, u32), redis::RedisError> {
    use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
    let crate::redis_link::RedisConn::Cluster(cluster) = conn else {
        return Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "not a Redis Cluster",
        )));
    };
    let mut ask = redis::cmd("CLUSTER");
    ask.arg("SLOTS");
    let any_master = RoutingInfo::MultiNode((
        MultipleNodeRoutingInfo::AllMasters,
        Some(ResponsePolicy::OneSucceeded),
    ));
    let ranges: Vec<redis::Value> =
        redis::from_redis_value(cluster.route_command(ask, any_master).await?)?;
    let mut masters = Vec::new();
    let mut slots = 0u32;
    for r in ranges {
        let redis::Value::Array(parts) = r else {
            continue;
        };
        let int = |v: Option<&redis::Value>| match v {
            Some(redis::Value::Int(n)) => u32::try_from(*n).ok(),
            _ => None,
        };
        if let (Some(lo), Some(hi)) = (int(parts.first()), int(parts.get(1))) {
            slots += hi.saturating_sub(lo) + 1;
        }
        if let Some(redis::Value::Array(m)) = parts.get(2) {
            let host = match m.first() {
                Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                _ => continue,
            };
            if let Some(port) = int(m.get(1)) {
                masters.push(format!("{host}:{port}"));
            }
        }
    }
    masters.sort();
    masters.dedup();
    Ok((masters, slots))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redis_link::slot_of;

    #[test]
    fn a_limits_keys_share_one_slot_whatever_the_names_hold() {
        let cfg = tollgate_config::from_yaml(
            "listeners: [{address: \"127.0.0.1:0\"}]\nupstreams: {b: {targets: [\"127.0.0.1:1\"]}}\ncluster: {redis: {url: \"redis://127.0.0.1:1\"}}\nroutes: [{name: r, path_prefix: /, upstream: b}]\n",
        )
        .expect("config");
        let c = Cluster::new(cfg.cluster.expect("cluster"));
        let limit = LimitConfig {
            name: "per-second".into(),
            counted_as: "per-second".into(),
            requests: 10,
            window: std::time::Duration::from_secs(1),
        };
        for (route, consumer) in [
            (None, "alice"),
            (None, "}x"),
            (None, "{}"),
            (Some("r{}"), "bob"),
            (Some("}"), "a}b{c"),
            (None, "100%"),
        ] {
            let l = c.limit(route, consumer, &limit);
            let key = l.key();
            assert_eq!(
                slot_of(key),
                slot_of(&format!("{key}:asks")),
                "{route:?} {consumer}: {key}"
            );
            // The tag is the consumer's name alone.
            assert_eq!(
                slot_of(key),
                slot_of(&format!("{{{}}}", key_part(consumer)))
            );
        }
        assert_eq!(key_part("alice"), "alice");
        assert_eq!(key_part("}x{%"), "%7Dx%7B%25");
    }
}
