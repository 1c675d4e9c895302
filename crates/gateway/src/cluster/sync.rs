//! The background task that settles a node's shared limits with Redis.

use super::asks::{collect, commands, heartbeat_commands, settle, sweep, unsettled, Ask, LEASE};
use super::link::Cluster;
use crate::clock::Clock;
use crate::redis_link::RedisConn;
use futures_util::future::{BoxFuture, FutureExt, Shared};
use futures_util::stream::{FuturesUnordered, StreamExt};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a node renews its mark among the live nodes.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// The first wait before connecting again after a failure.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
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
            beat_wall: None,
            resumed: None,
            partly: None,
            rounds: 0,
            ended: 0,
            pending: HashMap::new(),
            probe: Probe::default(),
            reloaded: None,
            backoff: FIRST_BACKOFF,
            retry_at: None,
            futile: 0,
            said: None,
        };
        let mut flight: FuturesUnordered<BoxFuture<'static, Landed>> = FuturesUnordered::new();
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
            if s.conn.as_ref().is_some_and(|(conn, _)| conn.is_stale()) {
                // The sentinels name a new master, or are promoting a replica: moved to
                // before the next round, so no round fails and nothing more is written to
                // the old one.
                tracing::info!(redis = %c.cfg.redis.shown(), "cluster: the sentinels name or promote another master; moving to it");
                s.conn = None;
            }
            if s.conn.is_none() {
                // A connection whose rounds failed before any answered: the next waits out
                // the backoff, as a failed connect does.
                let wait = s.retry_at.take().map_or(Duration::ZERO, |t| {
                    t.saturating_duration_since(Instant::now())
                });
                if !wait.is_zero() {
                    s.failed(&c);
                    drop(c);
                    tokio::time::sleep(wait).await;
                    continue;
                }
                match connect(&c).await {
                    Ok(x) => {
                        s.conn = Some(x);
                        s.last_heartbeat = None;
                        // Said once, not at each try of a connection that never answers a
                        // round (a replica, one node of a Redis Cluster named as a server).
                        if s.futile == 0 {
                            tracing::info!(redis = %c.cfg.redis.shown(), "cluster: connected to Redis; sharing limits");
                        }
                        s.futile += 1;
                    }
                    Err(e) => {
                        c.metrics.errors.fetch_add(1, Ordering::Relaxed);
                        let why = failure(&e);
                        if c.up.swap(false, Ordering::Relaxed) || s.said.as_ref() != Some(&why) {
                            tracing::warn!(
                                redis = %c.cfg.redis.shown(),
                                policy = ?c.cfg.on_redis_down,
                                "cluster: Redis unreachable ({}); retrying with backoff",
                                shortened(&e)
                            );
                        }
                        s.said = Some(why);
                        s.failed(&c);
                        let wait = s.next_backoff(&c);
                        drop(c);
                        tokio::time::sleep(wait).await;
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
    /// The last heartbeat's time on the node's clock, and on the monotonic one.
    beat_wall: Option<(Instant, u64)>,
    /// When Redis answered again after it failed, or the clock stepped forward: for a
    /// node's time to live after it, the other nodes may not have renewed their marks yet
    /// (the first node back trims them), so the count of nodes is not lowered then.
    resumed: Option<Instant>,
    /// When part of a Redis Cluster last failed, until it has answered for a while.
    partly: Option<Instant>,
    /// Rounds started so far (each one's number).
    rounds: u64,
    /// Rounds ended, each after every earlier one (what [`Cluster::rounds`] counts).
    ended: u64,
    /// The rounds with parts still in flight.
    pending: HashMap<u64, Pending>,
    /// Whether any master answers, asked once for the parts that fail together.
    probe: Probe,
    /// When the lease script was last loaded again after a master said it lacked it.
    reloaded: Option<Instant>,
    /// The wait before the next connect after a failure (doubling to a bound).
    backoff: Duration,
    /// No connect before this: the last connection failed before any round answered.
    retry_at: Option<Instant>,
    /// Connections made since a round last answered.
    futile: u32,
    /// The failure last logged while Redis is down (each new one is logged once).
    said: Option<String>,
}

/// One question "does any master of the Redis Cluster answer?", shared by every part that
/// fails within [`PROBE_FRESH`] of it, so that an incident costs one `CLUSTER SLOTS` a while
/// rather than one per failed part.
#[derive(Clone, Default)]
struct Probe(Arc<parking_lot::Mutex<Option<(Instant, Asked)>>>);

/// A probe on its way or answered, for every part that asks.
type Asked = Shared<BoxFuture<'static, Masters>>;

/// The masters of a Redis Cluster and the slots they serve, if any master answered.
type Masters = Option<(Vec<String>, u32)>;

/// How long one probe's answer stands for later failures.
const PROBE_FRESH: Duration = Duration::from_millis(500);

impl Probe {
    /// The latest probe if it is fresh, else a new one on `conn`.
    fn ask(&self, conn: &RedisConn) -> Asked {
        let mut last = self.0.lock();
        if let Some((at, probe)) = last.as_ref() {
            if at.elapsed() < PROBE_FRESH {
                return probe.clone();
            }
        }
        let mut conn = conn.clone();
        let probe: BoxFuture<'static, Masters> =
            Box::pin(async move { super::link::cluster_masters(&mut conn).await.ok() });
        let probe = probe.shared();
        *last = Some((Instant::now(), probe.clone()));
        probe
    }
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
        if heartbeat {
            sweep(c, wall, &mut asks);
        }
        let round = self.rounds;
        self.rounds += 1;
        if asks.is_empty() && !heartbeat {
            // Nothing settled: a request waiting for an ask still in flight sleeps on.
            self.ended(c);
            return;
        }
        let mut cmds = commands(c, &asks, sha, wall);
        let mut nodes_at = None;
        if heartbeat {
            let now = Instant::now();
            self.last_heartbeat = Some(now);
            // A clock stepped forward past the others' marks trims them all (each mark is
            // dated by its node's clock): the count of nodes is not lowered for a mark's
            // lifetime after, as after Redis comes back, so this node does not take itself
            // for alone and admit the whole cluster's credit.
            if let Some((at, was)) = self.beat_wall {
                let ran = u64::try_from(now.duration_since(at).as_nanos()).unwrap_or(u64::MAX);
                if wall.saturating_sub(was) > ran.saturating_add(1_000_000_000) {
                    self.resumed = Some(now);
                }
            }
            self.beat_wall = Some((now, wall));
            nodes_at = Some(cmds.len() + 3);
            cmds.extend(heartbeat_commands(c, wall));
        }
        // On a Redis Cluster, a part is given up on after ten round trips (a quarter to a
        // whole second): a dead master's limits then fall back at once, instead of waiting
        // the seconds the client retries it until a replica is promoted.
        let deadline = conn.is_cluster().then(|| {
            (Duration::from_micros(c.rtt_us.load(Ordering::Relaxed)) * 10)
                .clamp(Duration::from_millis(250), Duration::from_secs(1))
        });
        let parts = crate::redis_link::query_by_slot(conn, cmds, deadline);
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
            let (probe, conn) = (self.probe.clone(), conn.clone());
            flight.push(Box::pin(async move {
                let started = Instant::now();
                let (at, answers) = part.await;
                let took = started.elapsed();
                // A cluster that says it is down is down, whoever says it.
                let others = match &answers {
                    Err(e)
                        if conn.is_cluster()
                            && e.kind()
                                != redis::ErrorKind::Server(
                                    redis::ServerErrorKind::ClusterDown,
                                ) =>
                    {
                        probe.ask(&conn).await
                    }
                    _ => None,
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
        // Taken out while it is settled (the syncer's other state stays free to change),
        // and put back while parts of it are still in flight.
        let Some(mut p) = self.pending.remove(&round) else {
            return;
        };
        // A part sent on an earlier connection says nothing of the one in use now.
        let current = p.link == c.link.load(Ordering::Relaxed);
        match answers {
            Ok(values) => {
                let rtt = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
                let old = c.rtt_us.load(Ordering::Relaxed);
                c.rtt_us.store((old * 7 + rtt) / 8, Ordering::Relaxed);
                if current && !c.up.swap(true, Ordering::Relaxed) {
                    tracing::info!("cluster: Redis answers; shared counting resumed");
                    self.resumed = Some(Instant::now());
                }
                if current {
                    (self.backoff, self.futile, self.said) = (FIRST_BACKOFF, 0, None);
                }
                let fresh = self
                    .resumed
                    .is_some_and(|t| t.elapsed() < Duration::from_millis(super::asks::NODE_TTL_MS));
                let wall = self.clock.wall_nanos();
                let mut values = values.into_iter();
                for i in at {
                    match (p.asks.get(i), values.next()) {
                        (Some(a), Some(v)) => settle(c, a, v, wall, p.link),
                        // Fewer answers than asks: nothing is known of the rest.
                        (Some(a), None) => unsettled(c, a, false),
                        (None, Some(v)) if Some(i) == p.nodes_at => {
                            if let Ok(n) = redis::from_redis_value::<u64>(v) {
                                let n = if fresh { n.max(c.nodes()) } else { n };
                                c.nodes.store(n.max(1), Ordering::Relaxed);
                            }
                        }
                        (None, _) => {}
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
                match others {
                    Some(masters) if current => {
                        if self.partly.is_none() {
                            tracing::warn!(
                                policy = ?c.cfg.on_redis_down,
                                "cluster: part of the Redis Cluster failed ({e}); the consumers it keeps fall back, the others share on"
                            );
                        }
                        self.partly = Some(Instant::now());
                        self.switched(c, masters);
                        if no_script && self.reloaded.is_none_or(|t| t.elapsed() >= HEARTBEAT) {
                            // A replica promoted since the connection was made lacks the
                            // script: loaded again on every master, once a while.
                            self.reloaded = Some(Instant::now());
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
                    }
                    // The connection's first failure decides; its other rounds and parts
                    // that fail with it change nothing more.
                    None if current && self.conn.is_some() => {
                        let why = failure(&e);
                        if c.up.swap(false, Ordering::Relaxed) || self.said.as_ref() != Some(&why) {
                            tracing::warn!(
                                policy = ?c.cfg.on_redis_down,
                                "cluster: Redis failed ({}){}; reconnecting",
                                shortened(&e),
                                misnamed(&e)
                            );
                        }
                        self.said = Some(why);
                        self.conn = None;
                        // A connection that answered a round reconnects at once (a
                        // failover); one that never did waits, or it would be made again
                        // every sync interval.
                        if self.futile > 0 {
                            self.retry_at = Some(Instant::now() + self.next_backoff(c));
                        }
                    }
                    _ => {}
                }
            }
        }
        p.left = p.left.saturating_sub(1);
        if p.left > 0 {
            self.pending.insert(round, p);
            // A request waiting for one of these leases need not wait for the rest.
            c.answers.send_modify(|r| *r += 1);
            return;
        }
        let whole = p.whole && !p.asks.is_empty();
        // Part of the store, not all of it: with Redis down altogether `redis_up` says so.
        if !p.asks.is_empty() && c.is_cluster_topology() {
            c.partly_down
                .store(!p.whole && c.is_up(), Ordering::Relaxed);
        }
        if whole && self.partly.is_some_and(|t| t.elapsed() >= QUIET) {
            tracing::info!("cluster: every part of the Redis Cluster answers again");
            self.partly = None;
        }
        c.answers.send_modify(|r| *r += 1);
        self.ended(c);
    }

    /// Moves [`Cluster::rounds`] on to the rounds that have ended with every round before
    /// them: a request or test that waits for rounds after its call waits for the round
    /// that took it.
    fn ended(&mut self, c: &Cluster) {
        let upto = self.pending.keys().min().copied().unwrap_or(self.rounds);
        if upto > self.ended {
            let more = upto - self.ended;
            self.ended = upto;
            c.rounds.send_modify(|r| *r += more);
        }
    }

    /// The wait before the next connect, doubled for the one after (to the target's bound).
    fn next_backoff(&mut self, c: &Cluster) -> Duration {
        let wait = self.backoff;
        self.backoff = (wait * 2).min(crate::redis_link::max_backoff(&c.cfg.redis));
        wait
    }

    /// A round that could not be sent (no connection to Redis): it ends at once, and a
    /// request waiting for a lease checks again (and finds the store down).
    fn failed(&mut self, c: &Cluster) {
        self.rounds += 1;
        c.answers.send_modify(|r| *r += 1);
        self.ended(c);
    }

    /// Records the Redis Cluster's masters. When they changed while part of the cluster
    /// fails (a replica promoted), a new connection learns the slots' new masters.
    fn switched(&mut self, c: &Cluster, masters: (Vec<String>, u32)) {
        if c.connected_to_cluster(masters) && self.partly.is_some() {
            self.conn = None;
        }
    }
}

/// A failure as told from the last one logged: a server's answer by its kind (a `MOVED`
/// names other slots each round), anything else by its words.
fn failure(e: &redis::RedisError) -> String {
    match e.kind() {
        redis::ErrorKind::Server(k) => format!("{k:?}"),
        _ => shortened(e),
    }
}

/// An error's words, cut so that its log line stays near 300 characters with the hint
/// beside it (a pipeline's error lists every command that failed).
fn shortened(e: &redis::RedisError) -> String {
    let mut text = e.to_string();
    if let Some((at, _)) = text.char_indices().nth(160) {
        text.truncate(at);
        text.push('…');
    }
    text
}

/// What a round's failure says of the config, when the server named is not one that
/// takes writes of every key: one node of a Redis Cluster, or a replica.
fn misnamed(e: &redis::RedisError) -> &'static str {
    use redis::{ErrorKind as K, ServerErrorKind as S};
    match e.kind() {
        K::Server(S::Moved | S::Ask | S::CrossSlot) => {
            ": the server is one node of a Redis Cluster; list its nodes in cluster.redis.cluster_nodes"
        }
        K::Server(S::ReadOnly) => {
            ": the server is a replica; name the master, or its sentinels in cluster.redis.sentinels"
        }
        _ => "",
    }
}

async fn connect(c: &Cluster) -> Result<(RedisConn, String), redis::RedisError> {
    let (mut conn, address) = crate::redis_link::redis_connection_at(
        &c.cfg.redis,
        c.cfg.redis_tls.as_ref(),
        Duration::from_secs(1),
    )
    .await?;
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
