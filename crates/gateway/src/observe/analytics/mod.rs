//! Usage history: requests per consumer × route × status class in 1-minute buckets, rolled
//! up to hours and days, kept in SQLite on the node (and, with `cluster:`, added into Redis
//! so any node answers for the whole cluster).
//!
//! The request path adds one to a counter in a small per-thread-group map; a task moves
//! the counts into the database in one transaction every [`FLUSH_EVERY`]. Minute buckets
//! are kept for the retention or 7 days, whichever is shorter; hours and days for the
//! whole retention.

use crate::observe::metrics::Metrics;
use parking_lot::Mutex;
use rusqlite::{params, Connection, OpenFlags};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tollgate_config::{AnalyticsConfig, ClusterConfig};

mod bucket;
mod shared;

use bucket::{class_name, Batch, MINUTES_KEPT};
pub use bucket::{AnalyticsError, Query, Row, Step, MAX_BUCKETS, NONE};
use shared::RedisLink;

/// How often counts are moved into the database.
pub const FLUSH_EVERY: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    minute: u64,
    /// The consumer as (address of its table, index), so the hot path hashes integers and
    /// copies the name only for a new slot; the flush merges slots by name.
    consumer: (usize, u32),
    route: usize,
    class: u8,
}

#[derive(Debug)]
struct Slot {
    n: u64,
    consumer: Arc<str>,
    route: Arc<str>,
}

type Shard = Mutex<HashMap<Key, Slot, foldhash::fast::RandomState>>;

/// The node's usage history.
pub struct Analytics {
    shards: Vec<Shard>,
    db: Mutex<Connection>,
    path: PathBuf,
    retention: Duration,
    redis: Option<RedisLink>,
    metrics: Arc<Metrics>,
    last_prune: Mutex<u64>,
}

impl std::fmt::Debug for Analytics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Analytics")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

const SCHEMA: &str = "
PRAGMA journal_mode = WAL;
PRAGMA synchronous = NORMAL;
CREATE TABLE IF NOT EXISTS usage (
    step INTEGER NOT NULL,
    ts INTEGER NOT NULL,
    consumer TEXT NOT NULL,
    route TEXT NOT NULL,
    class INTEGER NOT NULL,
    count INTEGER NOT NULL,
    PRIMARY KEY (step, ts, consumer, route, class)
) WITHOUT ROWID;
";

fn db_err(path: &Path) -> impl Fn(rusqlite::Error) -> AnalyticsError + '_ {
    move |source| AnalyticsError::Db {
        path: path.display().to_string(),
        source,
    }
}

/// Opens (creating if needed) the database at `path` and checks it can be read and written.
fn open_db(path: &Path) -> Result<Connection, AnalyticsError> {
    crate::sqlite::open(path, SCHEMA, crate::sqlite::OURS).map_err(db_err(path))
}

impl Analytics {
    /// Opens the database named by `cfg`. Errors name the file; the caller decides whether
    /// to go on without history (`analytics.required: false`).
    pub fn open(
        cfg: &AnalyticsConfig,
        cluster: Option<&ClusterConfig>,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<Analytics>, AnalyticsError> {
        let db = open_db(&cfg.path)?;
        let shards = (0..8)
            .map(|_| Mutex::new(HashMap::with_hasher(Default::default())))
            .collect();
        Ok(Arc::new(Analytics {
            shards,
            db: Mutex::new(db),
            path: cfg.path.clone(),
            retention: cfg.retention,
            redis: cluster.map(RedisLink::new),
            metrics,
            last_prune: Mutex::new(0),
        }))
    }

    /// Counts one request at `wall_secs` of `consumer` (its identity as table address and
    /// index, and its name; `None` for requests without one). Takes one of several locks,
    /// chosen by thread, so that threads rarely meet.
    pub fn count(
        &self,
        wall_secs: u64,
        consumer: Option<((usize, u32), &str)>,
        route: &Arc<str>,
        status: u16,
    ) {
        let (id, name) = consumer.unwrap_or(((0, u32::MAX), NONE));
        let key = Key {
            minute: wall_secs / 60,
            consumer: id,
            route: Arc::as_ptr(route).cast::<u8>() as usize,
            class: u8::try_from((status / 100).clamp(1, 5)).unwrap_or(5),
        };
        let shard = &self.shards[shard_index() % self.shards.len()];
        shard
            .lock()
            .entry(key)
            .or_insert_with(|| Slot {
                n: 0,
                consumer: Arc::from(name),
                route: route.clone(),
            })
            .n += 1;
    }

    /// Moves the counts so far into the database (and Redis), in one transaction. Returns
    /// how many (minute, consumer, route, class) counts were written.
    pub async fn flush(self: &Arc<Self>, now_secs: u64) -> usize {
        let mut merged: HashMap<(u64, Arc<str>, Arc<str>, u8), u64> = HashMap::new();
        for s in &self.shards {
            let taken = std::mem::take(&mut *s.lock());
            for (k, v) in taken {
                *merged
                    .entry((k.minute, v.consumer, v.route, k.class))
                    .or_default() += v.n;
            }
        }
        let rows: Vec<Batch> = merged
            .into_iter()
            .map(|((m, c, r, class), n)| (m * 60, c, r, class, n))
            .collect();
        let n = rows.len();
        if let Some(r) = self
            .redis
            .as_ref()
            .filter(|r| !rows.is_empty() || r.has_pending())
        {
            let ttl = self.retention.as_secs();
            if let Err(e) = r.add(&rows, ttl).await {
                self.metrics.analytics_errors.inc();
                tracing::warn!("usage history: cannot add the batch into Redis ({e}); what it did not take is tried again with the next");
            }
            let lost = r.take_lost();
            if lost > 0 {
                self.metrics.analytics_errors.inc();
                tracing::warn!("usage history: {lost} counts Redis refused or that waited too long are dropped");
            }
        }
        // SQLite blocks: off the async workers.
        let me = self.clone();
        let done = tokio::task::spawn_blocking(move || {
            if !rows.is_empty() {
                if let Err(e) = me.write(&rows) {
                    me.metrics.analytics_errors.inc();
                    tracing::warn!("usage history: {e}; this batch is lost");
                }
            }
            me.prune(now_secs);
        })
        .await;
        if done.is_err() {
            self.metrics.analytics_errors.inc();
        }
        n
    }

    fn write(&self, rows: &[Batch]) -> Result<(), AnalyticsError> {
        let err = db_err(&self.path);
        let mut db = self.db.lock();
        let tx = db.transaction().map_err(&err)?;
        {
            let mut up = tx
                .prepare_cached(
                    "INSERT INTO usage (step, ts, consumer, route, class, count) VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                     ON CONFLICT (step, ts, consumer, route, class) DO UPDATE SET count = count + excluded.count",
                )
                .map_err(&err)?;
            for (ts, c, r, class, n) in rows {
                for step in [Step::Minute, Step::Hour, Step::Day] {
                    let s = step.secs();
                    up.execute(params![
                        s as i64,
                        (ts / s * s) as i64,
                        &**c,
                        &**r,
                        *class,
                        *n as i64
                    ])
                    .map_err(&err)?;
                }
            }
        }
        tx.commit().map_err(&err)
    }

    /// Forgets buckets past their keeping time, at most once an hour.
    fn prune(&self, now_secs: u64) {
        {
            let mut last = self.last_prune.lock();
            if now_secs < *last + 3600 {
                return;
            }
            *last = now_secs;
        }
        let keep = self.retention.as_secs();
        let minutes = keep.min(MINUTES_KEPT);
        let db = self.db.lock();
        let r = db.execute(
            "DELETE FROM usage WHERE (step = 60 AND ts < ?1) OR (step > 60 AND ts < ?2)",
            params![
                now_secs.saturating_sub(minutes) as i64,
                now_secs.saturating_sub(keep) as i64
            ],
        );
        if let Err(e) = r {
            self.metrics.analytics_errors.inc();
            tracing::warn!(path = %self.path.display(), "usage history: cannot prune: {e}");
        }
    }

    /// Reads the history: from Redis (the whole cluster) when shared, else this node's
    /// database. Counts not yet flushed are flushed first. When Redis cannot answer, this
    /// node's own history answers, and why Redis did not comes with it.
    pub async fn query(
        self: &Arc<Self>,
        q: &Query,
        now_secs: u64,
    ) -> Result<History, AnalyticsError> {
        self.flush(now_secs).await;
        let mut cluster_error = None;
        if let Some(r) = &self.redis {
            match r.query(q).await {
                Ok(rows) => {
                    return Ok(History {
                        rows,
                        source: "cluster",
                        cluster_error: None,
                    })
                }
                Err(e) => {
                    tracing::debug!(
                        "usage history: Redis cannot answer ({e}); this node's answers"
                    );
                    cluster_error = Some(e.to_string());
                }
            }
        }
        let me = self.clone();
        let q = q.clone();
        let rows = tokio::task::spawn_blocking(move || query_db(&me.db.lock(), &me.path, &q))
            .await
            .unwrap_or_else(|_| Ok(Vec::new()))?;
        Ok(History {
            rows,
            source: "node",
            cluster_error,
        })
    }

    /// Where the history is read from while Redis answers, for `/status`: `cluster` or
    /// `node`.
    pub fn source(&self) -> &'static str {
        if self.redis.is_some() {
            "cluster"
        } else {
            "node"
        }
    }
}

/// What a read of the history found.
#[derive(Debug)]
pub struct History {
    /// The counts.
    pub rows: Vec<Row>,
    /// Where they were read: `cluster` (Redis) or `node` (this node's database).
    pub source: &'static str,
    /// Why Redis did not answer, when the node's own history did in its place.
    pub cluster_error: Option<String>,
}

/// Reads the cluster's history from Redis directly (the CLI).
pub async fn query_redis(cfg: &ClusterConfig, q: &Query) -> Result<Vec<Row>, AnalyticsError> {
    RedisLink::new(cfg).query(q).await
}

/// Reads rows from a database file directly (the CLI, with no node running).
pub fn query_file(path: &Path, q: &Query) -> Result<Vec<Row>, AnalyticsError> {
    let c = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY)
        .map_err(db_err(path))?;
    query_db(&c, path, q)
}

fn query_db(db: &Connection, path: &Path, q: &Query) -> Result<Vec<Row>, AnalyticsError> {
    let err = db_err(path);
    let s = q.step.secs();
    let mut stmt = db
        .prepare_cached(
            "SELECT ts, consumer, route, class, count FROM usage
             WHERE step = ?1 AND ts >= ?2 AND ts < ?3
               AND (?4 IS NULL OR consumer = ?4) AND (?5 IS NULL OR route = ?5)
             ORDER BY ts, consumer, route, class",
        )
        .map_err(&err)?;
    let rows = stmt
        .query_map(
            params![
                s as i64,
                (q.from / s * s) as i64,
                q.to as i64,
                q.consumer,
                q.route
            ],
            |r| {
                let class: u8 = r.get(3)?;
                Ok(Row {
                    ts: u64::try_from(r.get::<_, i64>(0)?).unwrap_or(0),
                    consumer: r.get(1)?,
                    route: r.get(2)?,
                    status: class_name(class),
                    count: u64::try_from(r.get::<_, i64>(4)?).unwrap_or(0),
                })
            },
        )
        .map_err(&err)?;
    rows.collect::<Result<Vec<_>, _>>().map_err(err)
}

/// A shard per worker thread, more or less: threads are spread by a hash of their id.
fn shard_index() -> usize {
    thread_local! {
        static SHARD: usize = {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(0);
            usize::try_from(h.finish() % 64).unwrap_or(0)
        };
    }
    SHARD.with(|s| *s)
}

/// Moves counts into the database every [`FLUSH_EVERY`] until `analytics` is dropped
/// elsewhere; `now` gives wall seconds.
pub fn spawn_flusher(
    analytics: &Arc<Analytics>,
    now: impl Fn() -> u64 + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    let weak = Arc::downgrade(analytics);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(FLUSH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(a) = weak.upgrade() else { return };
            a.flush(now()).await;
        }
    })
}
