//! The cluster's copy of the usage history in Redis, and the counts it has not taken yet.

use super::bucket::{class_name, AnalyticsError, Batch, Query, Row, Step, MINUTES_KEPT};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tollgate_config::ClusterConfig;

/// The cluster's copy of the history: per bucket, [`SHARDS`] hashes of
/// `consumer\troute\tclass` → count, a consumer's counts in the one its name picks, so
/// that a Redis Cluster spreads a bucket over its masters by consumer.
pub(super) struct RedisLink {
    target: tollgate_config::RedisTarget,
    tls: Option<std::sync::Arc<tollgate_config::RedisTls>>,
    prefix: String,
    conn: tokio::sync::Mutex<Option<crate::redis_link::RedisConn>>,
    /// Counts Redis did not take (a failover, a moved slot): added with the next batch.
    pending: Mutex<HashMap<(String, String), Increment>>,
    /// Counts dropped (see [`RedisLink::take_lost`]).
    lost: AtomicU64,
}

/// Whether a part failed before Redis ran it (or where what it ran is lost anyway): the
/// link broke or timed out, or the cluster sent it elsewhere or could not serve it.
fn not_taken(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::Ask | ServerErrorKind::MasterDown | ServerErrorKind::ReadOnly
            )
        )
}

/// One count to add into a bucket's hash, and how long the bucket is kept after.
#[derive(Clone, Copy)]
struct Increment {
    n: u64,
    expire: u64,
}

/// Hashes per bucket. Fixed: every node, of every version, must put a consumer's counts
/// in the same one.
const SHARDS: u32 = 16;

/// The shard of a bucket that holds `consumer`'s counts: FNV-1a of the name.
fn shard(consumer: &str) -> u32 {
    let h = consumer.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    h % SHARDS
}

/// Most counts kept for another try while Redis does not take them (a count is one
/// consumer, route and class in one bucket); past it, counts for new ones are dropped.
const MAX_PENDING: usize = 100_000;

impl RedisLink {
    pub(super) fn new(c: &ClusterConfig) -> Self {
        RedisLink {
            target: c.redis.clone(),
            tls: c.redis_tls.clone(),
            prefix: c.key_prefix.clone(),
            conn: tokio::sync::Mutex::new(None),
            pending: Mutex::new(HashMap::new()),
            lost: AtomicU64::new(0),
        }
    }

    /// The hash of the bucket at `ts` that holds the consumers of `shard`; `None`: the
    /// bucket's one hash of every consumer, as earlier versions wrote it (still read, so
    /// that history written before, or by a node not yet upgraded, counts).
    fn key(&self, step: Step, ts: u64, shard: Option<u32>) -> String {
        match shard {
            Some(n) => format!("{}:usage:{}:{ts}:{n}", self.prefix, step.name()),
            None => format!("{}:usage:{}:{ts}", self.prefix, step.name()),
        }
    }

    async fn conn(&self) -> Result<crate::redis_link::RedisConn, redis::RedisError> {
        let mut guard = self.conn.lock().await;
        if let Some(c) = guard.as_ref() {
            return Ok(c.clone());
        }
        let c = crate::redis_link::redis_connection(
            &self.target,
            self.tls.as_ref(),
            Duration::from_secs(2),
        )
        .await?;
        *guard = Some(c.clone());
        Ok(c)
    }

    /// Adds `rows` (and what an earlier batch could not add) into Redis. What a master
    /// did not take is kept for the next batch, so a failover or a moved slot delays
    /// counts instead of losing them.
    pub(super) async fn add(&self, rows: &[Batch], ttl: u64) -> Result<(), redis::RedisError> {
        let mut all = std::mem::take(&mut *self.pending.lock());
        for (ts, c, r, class, n) in rows {
            for step in [Step::Minute, Step::Hour, Step::Day] {
                let s = step.secs();
                let keep = if step == Step::Minute {
                    ttl.min(MINUTES_KEPT)
                } else {
                    ttl
                };
                let at = (
                    self.key(step, ts / s * s, Some(shard(c))),
                    format!("{c}\t{r}\t{class}"),
                );
                let e = all.entry(at).or_insert(Increment {
                    n: 0,
                    expire: keep + s,
                });
                e.n += n;
            }
        }
        let conn = match self.conn().await {
            Ok(c) => c,
            Err(e) => {
                self.keep(all);
                return Err(e);
            }
        };
        let all: Vec<((String, String), Increment)> = all.into_iter().collect();
        let mut cmds = Vec::with_capacity(all.len() * 2);
        for ((key, field), inc) in &all {
            let mut add = redis::cmd("HINCRBY");
            add.arg(key).arg(field).arg(inc.n);
            let mut expire = redis::cmd("EXPIRE");
            expire.arg(key).arg(inc.expire);
            cmds.push((key.clone(), add));
            cmds.push((key.clone(), expire));
        }
        // Each bucket's shard is its own key: a Redis Cluster spreads them over its
        // masters, and a master that fails fails its own part alone.
        let mut parts = crate::redis_link::query_by_slot(&conn, cmds, None);
        let mut failed = HashMap::new();
        let mut first_error = None;
        while let Some((at, answer)) = futures_util::StreamExt::next(&mut parts).await {
            if let Err(e) = answer {
                let counts = at
                    .into_iter()
                    .filter(|i| i % 2 == 0)
                    .filter_map(|i| all.get(i / 2));
                if not_taken(&e) {
                    failed.extend(counts.map(|(k, inc)| (k.clone(), *inc)));
                } else {
                    // Redis answered, and refused (a key of another type, say): the
                    // same counts would be refused again, and some of the part ran.
                    self.lost
                        .fetch_add(counts.count() as u64, Ordering::Relaxed);
                }
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            None => Ok(()),
            Some(e) => {
                self.keep(failed);
                *self.conn.lock().await = None;
                Err(e)
            }
        }
    }

    /// Counts dropped since the last call: refused by Redis, or past [`MAX_PENDING`].
    pub(super) fn take_lost(&self) -> u64 {
        self.lost.swap(0, Ordering::Relaxed)
    }

    /// Whether counts from an earlier batch wait to be added.
    pub(super) fn has_pending(&self) -> bool {
        !self.pending.lock().is_empty()
    }

    /// Keeps `counts` for the next batch, within [`MAX_PENDING`].
    fn keep(&self, counts: HashMap<(String, String), Increment>) {
        let mut pending = self.pending.lock();
        for (k, inc) in counts {
            if pending.len() >= MAX_PENDING && !pending.contains_key(&k) {
                self.lost.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let e = pending.entry(k).or_insert(Increment { n: 0, ..inc });
            e.n += inc.n;
        }
    }

    pub(super) async fn query(&self, q: &Query) -> Result<Vec<Row>, AnalyticsError> {
        let conn = self.conn().await?;
        let s = q.step.secs();
        let buckets: Vec<u64> = (q.from / s..q.to.div_ceil(s))
            .map(|b| b * s)
            .filter(|ts| *ts < q.to)
            .collect();
        // One consumer's counts are in one shard of each bucket; everyone's in all.
        let shards: Vec<Option<u32>> = match q.consumer.as_deref() {
            Some(c) => vec![Some(shard(c)), None],
            None => (0..SHARDS).map(Some).chain([None]).collect(),
        };
        let mut cmds = Vec::with_capacity(buckets.len() * shards.len());
        for ts in &buckets {
            for n in &shards {
                let key = self.key(q.step, *ts, *n);
                let mut cmd = redis::cmd("HGETALL");
                cmd.arg(&key);
                cmds.push((key, cmd));
            }
        }
        let all: Vec<HashMap<String, u64>> = match crate::redis_link::query_keyed(&conn, cmds).await
        {
            Ok(v) => v
                .into_iter()
                .map(|v| redis::from_redis_value(v).unwrap_or_default())
                .collect(),
            Err(e) => {
                *self.conn.lock().await = None;
                return Err(e.into());
            }
        };
        // A bucket's hashes summed (a count may be in its shard and in the old hash both),
        // then its rows in order.
        let mut rows = Vec::new();
        let mut fields = all.into_iter();
        for ts in &buckets {
            let mut sum: HashMap<String, u64> = HashMap::new();
            for _ in &shards {
                for (f, count) in fields.next().unwrap_or_default() {
                    *sum.entry(f).or_default() += count;
                }
            }
            let mut part: Vec<Row> = sum
                .into_iter()
                .filter_map(|(f, count)| {
                    let mut it = f.splitn(3, '\t');
                    let (c, r, class) = (it.next()?, it.next()?, it.next()?);
                    let wanted = q.consumer.as_deref().is_none_or(|w| w == c)
                        && q.route.as_deref().is_none_or(|w| w == r);
                    wanted.then(|| Row {
                        ts: *ts,
                        consumer: c.to_string(),
                        route: r.to_string(),
                        status: class_name(class.parse().unwrap_or(0)),
                        count,
                    })
                })
                .collect();
            part.sort_by(|a, b| {
                (&a.consumer, &a.route, &a.status).cmp(&(&b.consumer, &b.route, &b.status))
            });
            rows.extend(part);
        }
        Ok(rows)
    }
}
