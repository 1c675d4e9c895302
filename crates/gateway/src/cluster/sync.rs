//! The background task that settles a node's shared limits with Redis.

use super::asks::{collect, commands, heartbeat_commands, settle, unsettled, Ask, LEASE};
use super::link::Cluster;
use crate::clock::Clock;
use crate::redis_link::RedisConn;
use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a node renews its mark among the live nodes.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// How long every part of a Redis Cluster answers before a part's failure is over (one
/// warning and one notice per failure, however the rounds fall).
const QUIET: Duration = Duration::from_secs(10);

/// Starts the syncer: every `sync_interval` it leases for the limits that need tokens,
/// counts what was admitted without a grant, gives back unused tokens, and renews this
/// node's heartbeat; it reconnects with backoff when Redis fails. Each part of a round (a
/// hash slot's, on a Redis Cluster) is settled as it lands, and a part still on its way
/// (a hung master) does not hold the next rounds back. Ends when the cluster is dropped by
/// everyone else.
pub fn spawn_syncer(cluster: Arc<Cluster>, clock: Arc<dyn Clock>) -> tokio::task::JoinHandle<()> {
    let weak = Arc::downgrade(&cluster);
    let mut tick = tokio::time::interval(cluster.cfg.sync_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let hurry = cluster.hurry.clone();
    drop(cluster);
    tokio::spawn(async move {
        let mut s = Syncer {
            clock,
            conn: None,
            last_heartbeat: None,
            partly: None,
            rounds: 0,
            pending: HashMap::new(),
        };
        let mut flight: FuturesUnordered<BoxFuture<'static, Landed>> = FuturesUnordered::new();
        let mut backoff = Duration::from_millis(100);
        loop {
            // Every sync interval, at once when a request waits for a lease, and as each
            // part in flight lands.
            let landed = tokio::select! {
                _ = tick.tick() => None,
                () = hurry.notified() => {
                    tick.reset();
                    None
                }
                Some(landed) = flight.next(), if !flight.is_empty() => Some(landed),
            };
            let Some(c) = weak.upgrade() else { return };
            if let Some(landed) = landed {
                s.land(&c, landed, &mut flight);
                continue;
            }
            if s.conn.is_none() {
                match connect(&c).await {
                    Ok(x) => {
                        s.conn = Some(x);
                        backoff = Duration::from_millis(100);
                        s.last_heartbeat = None;
                        tracing::info!(redis = %c.cfg.redis.shown(), "cluster: connected to Redis; sharing limits");
                    }
                    Err(e) => {
                        c.metrics.errors.fetch_add(1, Ordering::Relaxed);
                        if c.up.swap(false, Ordering::Relaxed)
                            || backoff == Duration::from_millis(100)
                        {
                            tracing::warn!(
                                redis = %c.cfg.redis.shown(),
                                policy = ?c.cfg.on_redis_down,
                                "cluster: Redis unreachable ({e}); retrying with backoff"
                            );
                        }
                        c.round_done();
                        let most = crate::redis_link::max_backoff(&c.cfg.redis);
                        drop(c);
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(most);
                        continue;
                    }
                }
            }
            s.send(&c, &mut flight);
        }
    })
}

/// The syncer's state between rounds.
struct Syncer {
    clock: Arc<dyn Clock>,
    /// The connection and the lease script's digest (none: connect at the next tick).
    conn: Option<(RedisConn, String)>,
    last_heartbeat: Option<Instant>,
    /// When part of a Redis Cluster last failed, until it has answered for a while.
    partly: Option<Instant>,
    /// Rounds started so far (each one's number).
    rounds: u64,
    /// The rounds with parts still in flight.
    pending: HashMap<u64, Pending>,
}

/// A round's asks, kept until each of its parts has landed.
struct Pending {
    asks: Vec<Ask>,
    /// Parts still in flight.
    left: usize,
    /// Where the heartbeat's count of live nodes stands among the round's commands.
    nodes_at: Option<usize>,
    /// The connection the round went out on.
    link: u32,
    /// No part has failed so far.
    whole: bool,
}

/// One hash slot's part of round `round`: where its commands stood, their answers, how long
/// they took, and, when it failed on a Redis Cluster, the masters as any other master sees
/// them (none: no master answered).
struct Part {
    round: u64,
    at: Vec<usize>,
    answers: redis::RedisResult<Vec<redis::Value>>,
    took: Duration,
    others: Option<(Vec<String>, u32)>,
}

/// What comes back to the syncer.
enum Landed {
    /// One hash slot's part of a round.
    Part(Part),
    /// The Redis Cluster's masters, asked with the heartbeat (for `/status`).
    Masters(Result<(Vec<String>, u32), redis::RedisError>),
    /// The lease script loaded again (after a promoted replica said it lacked it).
    Loaded,
}

impl Syncer {
    /// Starts a round: every queued limit's lease, counts and give-backs (and the
    /// heartbeat when due), one part per hash slot, into `flight`.
    fn send(&mut self, c: &Cluster, flight: &mut FuturesUnordered<BoxFuture<'static, Landed>>) {
        let Some((conn, sha)) = self.conn.as_ref() else {
            return;
        };
        let heartbeat = self.last_heartbeat.is_none_or(|t| t.elapsed() >= HEARTBEAT);
        let wall = self.clock.wall_nanos();
        let mut asks = Vec::new();
        collect(c, wall, &mut asks);
        if asks.is_empty() && !heartbeat {
            // Nothing settled: a request waiting for an ask still in flight sleeps on.
            c.rounds.send_modify(|r| *r += 1);
            return;
        }
        let mut cmds = commands(&asks, sha, wall);
        let mut nodes_at = None;
        if heartbeat {
            self.last_heartbeat = Some(Instant::now());
            nodes_at = Some(cmds.len() + 3);
            cmds.extend(heartbeat_commands(c, wall));
        }
        let round = self.rounds;
        self.rounds += 1;
        let parts = crate::redis_link::query_by_slot(conn, cmds);
        self.pending.insert(
            round,
            Pending {
                asks,
                left: parts.len(),
                nodes_at,
                link: c.link.load(Ordering::Relaxed),
                whole: true,
            },
        );
        for part in parts {
            let mut probe = conn.clone();
            flight.push(Box::pin(async move {
                let started = Instant::now();
                let (at, answers) = part.await;
                let took = started.elapsed();
                let others = if answers.is_err() && probe.is_cluster() {
                    super::link::cluster_masters(&mut probe).await.ok()
                } else {
                    None
                };
                Landed::Part(Part {
                    round,
                    at,
                    answers,
                    took,
                    others,
                })
            }));
        }
        if heartbeat && conn.is_cluster() {
            let mut ask = conn.clone();
            flight.push(Box::pin(async move {
                Landed::Masters(super::link::cluster_masters(&mut ask).await)
            }));
        }
    }

    /// Settles what landed.
    fn land(
        &mut self,
        c: &Cluster,
        landed: Landed,
        flight: &mut FuturesUnordered<BoxFuture<'static, Landed>>,
    ) {
        let Part {
            round,
            at,
            answers,
            took,
            others,
        } = match landed {
            Landed::Part(part) => part,
            Landed::Masters(Ok(masters)) => {
                self.switched(c, masters);
                return;
            }
            Landed::Masters(Err(e)) => {
                tracing::debug!("cluster: CLUSTER SLOTS failed: {e}");
                return;
            }
            Landed::Loaded => return,
        };
        let Some(p) = self.pending.get_mut(&round) else {
            return;
        };
        match answers {
            Ok(values) => {
                let rtt = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
                let old = c.rtt_us.load(Ordering::Relaxed);
                c.rtt_us.store((old * 7 + rtt) / 8, Ordering::Relaxed);
                if !c.up.swap(true, Ordering::Relaxed) {
                    tracing::info!("cluster: Redis answers; shared counting resumed");
                }
                let wall = self.clock.wall_nanos();
                for (i, v) in at.into_iter().zip(values) {
                    if let Some(a) = p.asks.get(i) {
                        settle(c, a, v, wall, p.link);
                    } else if Some(i) == p.nodes_at {
                        if let Ok(n) = redis::from_redis_value::<u64>(v) {
                            c.nodes.store(n.max(1), Ordering::Relaxed);
                        }
                    }
                }
            }
            Err(e) => {
                p.whole = false;
                c.metrics.errors.fetch_add(1, Ordering::Relaxed);
                // The rest of a Redis Cluster answers: only the limits this part keeps
                // count as the store being down, until their part answers again.
                let alive = others.is_some();
                for a in at.iter().filter_map(|&i| p.asks.get(i)) {
                    unsettled(c, a, alive);
                }
                let no_script =
                    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript);
                if let Some(masters) = others {
                    if self.partly.is_none() {
                        tracing::warn!(
                            policy = ?c.cfg.on_redis_down,
                            "cluster: part of the Redis Cluster failed ({e}); the consumers it keeps fall back, the others share on"
                        );
                    }
                    self.partly = Some(Instant::now());
                    if c.connected_to_cluster(masters) {
                        // A replica was promoted: a new connection learns the slots' masters.
                        self.conn = None;
                    }
                    if no_script {
                        // A replica promoted since the connection was made lacks the script.
                        if let Some((conn, _)) = &self.conn {
                            let mut conn = conn.clone();
                            flight.push(Box::pin(async move {
                                if let Err(e) = load_script(&mut conn).await {
                                    tracing::debug!(
                                        "cluster: loading the lease script failed: {e}"
                                    );
                                }
                                Landed::Loaded
                            }));
                        }
                    }
                } else {
                    if c.up.swap(false, Ordering::Relaxed) {
                        tracing::warn!(policy = ?c.cfg.on_redis_down, "cluster: Redis failed ({e}); reconnecting");
                    }
                    self.conn = None;
                }
            }
        }
        p.left = p.left.saturating_sub(1);
        if p.left > 0 {
            // A request waiting for one of these leases need not wait for the rest.
            c.answers.send_modify(|r| *r += 1);
            return;
        }
        let whole = p.whole && !p.asks.is_empty();
        self.pending.remove(&round);
        if whole && self.partly.is_some_and(|t| t.elapsed() >= QUIET) {
            tracing::info!("cluster: every part of the Redis Cluster answers again");
            self.partly = None;
        }
        c.round_done();
    }

    /// Records the Redis Cluster's masters. When they changed while part of the cluster
    /// fails (a replica promoted), a new connection learns the slots' new masters.
    fn switched(&mut self, c: &Cluster, masters: (Vec<String>, u32)) {
        if c.connected_to_cluster(masters) && self.partly.is_some() {
            self.conn = None;
        }
    }
}

async fn connect(c: &Cluster) -> Result<(RedisConn, String), redis::RedisError> {
    let (mut conn, address) =
        crate::redis_link::redis_connection_at(&c.cfg.redis, Duration::from_secs(1)).await?;
    c.link.fetch_add(1, Ordering::Relaxed);
    // On a Redis Cluster this goes to every master.
    let sha = match load_script(&mut conn).await {
        Ok(sha) => sha,
        Err(e) if conn.is_cluster() => {
            // A master that is down fails its slots' part of each round until it is back or
            // replaced (and a part that finds no script loads it again); the other masters
            // share their consumers' limits meanwhile.
            tracing::warn!(
                "cluster: loading the lease script failed on part of the Redis Cluster ({e})"
            );
            redis::Script::new(LEASE).get_hash().to_string()
        }
        Err(e) => return Err(e),
    };
    if conn.is_cluster() {
        // For `/status` only: the heartbeat asks again.
        if let Ok(masters) = super::link::cluster_masters(&mut conn).await {
            c.connected_to_cluster(masters);
        }
    } else {
        c.connected_to(address);
    }
    Ok((conn, sha))
}

/// Loads the lease script (on every master of a Redis Cluster) and returns its digest.
async fn load_script(conn: &mut RedisConn) -> Result<String, redis::RedisError> {
    redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(LEASE)
        .query_async(conn)
        .await
}
