//! The background task that settles a node's shared limits with Redis.

use super::link::Cluster;
use crate::clock::Clock;
use crate::limiter::shared::SPAN;
use crate::limiter::{Counter, LimitCell};
use crate::redis_link::RedisConn;
use futures_util::StreamExt;
use smallvec::SmallVec;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Counts one limit's sub-windows and grants tokens for one of them, atomically.
///
/// KEYS[1]: the limit's hash, sub-window → requests counted. ARGV: N, span (sub-windows
/// counting beside the current one), ttl (ms), the node's current sub-window, the
/// sub-window to grant in, tokens wanted, the sub-window's length (ms); then pairs
/// (sub-window, change) applied first: requests admitted without a grant (+), tokens given
/// back unused (−).
///
/// Grants `min(want, N − counted)`, where `counted` sums every sub-window from `at − span`
/// on, later ones included: after any grant, no span of `span + 1` sub-windows holds more
/// than N grants. Redis's own clock bounds what a node may ask for: nothing is granted or
/// counted more than one sub-window ahead of it, and nothing is dropped that still counts
/// by it, so one node's clock running ahead cannot block a limit for the others.
/// Returns {granted, counted, free_at, over}: `free_at` is the sub-window from which room
/// opens again when the limit is used up (else 0), `over` how far the changes pushed the
/// count past N.
pub(crate) const LEASE: &str = r#"
local n = tonumber(ARGV[1])
local span = tonumber(ARGV[2])
local at = tonumber(ARGV[5])
local want = tonumber(ARGV[6])
local t = redis.call('TIME')
local server = math.floor((tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)) / tonumber(ARGV[7]))
local now = math.min(tonumber(ARGV[4]), server)
if at > server + 1 then want = 0 end
for i = 8, #ARGV, 2 do
  local s = tonumber(ARGV[i])
  if s >= now - span and s <= server + 1 then
    local v = redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
    if v <= 0 then redis.call('HDEL', KEYS[1], ARGV[i]) end
  end
end
local flat = redis.call('HGETALL', KEYS[1])
local counts = {}
local total = 0
for i = 1, #flat, 2 do
  local s = tonumber(flat[i])
  if s < now - span then
    redis.call('HDEL', KEYS[1], flat[i])
  elseif s >= at - span then
    local c = tonumber(flat[i + 1])
    total = total + c
    counts[#counts + 1] = {s, c}
  end
end
local over = math.max(0, total - n)
local grant = 0
if want > 0 and total < n then
  grant = math.min(want, n - total)
  redis.call('HINCRBY', KEYS[1], ARGV[5], grant)
  total = total + grant
  counts[#counts + 1] = {at, grant}
end
local free_at = 0
if total >= n then
  table.sort(counts, function(a, b) return a[1] < b[1] end)
  local left = total
  for _, sc in ipairs(counts) do
    left = left - sc[2]
    if left < n then
      free_at = sc[1] + span + 1
      break
    end
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {grant, total, free_at, over}
"#;

/// How long a node counts as alive after its last heartbeat.
const NODE_TTL_MS: u64 = 3_000;
const HEARTBEAT: Duration = Duration::from_secs(1);

struct Ask {
    cell: Arc<LimitCell>,
    /// The sub-window the tokens are for.
    at: u64,
    want: u64,
    /// Admitted without a grant, per sub-window: counted by this call.
    owed: SmallVec<[(u64, u64); 2]>,
    /// Tokens given back, per sub-window.
    back: SmallVec<[(u64, u64); 2]>,
    next: bool,
}

/// Starts the syncer: every `sync_interval` it leases for the limits that need tokens,
/// counts what was admitted without a grant, gives back unused tokens, and renews this
/// node's heartbeat; it reconnects with backoff when Redis fails. Ends when the cluster is
/// dropped by everyone else.
pub fn spawn_syncer(cluster: Arc<Cluster>, clock: Arc<dyn Clock>) -> tokio::task::JoinHandle<()> {
    let weak = Arc::downgrade(&cluster);
    drop(cluster);
    tokio::spawn(async move {
        let mut conn: Option<(RedisConn, String)> = None;
        let mut backoff = Duration::from_millis(100);
        let mut last_heartbeat: Option<Instant> = None;
        // Part of a Redis Cluster failed in the last round that asked anything.
        let mut partly = false;
        let Some(c) = weak.upgrade() else { return };
        let mut tick = tokio::time::interval(c.cfg.sync_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let hurry = c.hurry.clone();
        drop(c);
        loop {
            // Every sync interval, or at once when a request waits for a lease.
            tokio::select! {
                _ = tick.tick() => {}
                () = hurry.notified() => tick.reset(),
            }
            let Some(c) = weak.upgrade() else { return };
            if conn.is_none() {
                match connect(&c).await {
                    Ok(x) => {
                        conn = Some(x);
                        backoff = Duration::from_millis(100);
                        last_heartbeat = None;
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
            let Some((link, sha)) = conn.as_mut() else {
                continue;
            };
            let heartbeat = last_heartbeat.is_none_or(|t| t.elapsed() >= HEARTBEAT);
            match round(&c, link, sha, clock.as_ref(), heartbeat).await {
                Ok(settled) => {
                    if heartbeat {
                        last_heartbeat = Some(Instant::now());
                    }
                    if !c.up.swap(true, Ordering::Relaxed) {
                        tracing::info!("cluster: Redis answers; shared counting resumed");
                    }
                    match (&settled.failed, partly) {
                        (Some(e), false) => tracing::warn!(
                            policy = ?c.cfg.on_redis_down,
                            "cluster: part of the Redis Cluster failed ({e}); the consumers it keeps fall back, the others share on"
                        ),
                        (None, true) if settled.asked => {
                            tracing::info!(
                                "cluster: every part of the Redis Cluster answers again"
                            );
                        }
                        _ => {}
                    }
                    if settled.failed.is_some() {
                        partly = true;
                    } else if settled.asked {
                        partly = false;
                    }
                    if partly && settled.switched {
                        // A master was replaced while part of the cluster failed: a new
                        // connection learns the slots' new masters.
                        conn = None;
                    }
                }
                Err(e) => {
                    c.metrics.errors.fetch_add(1, Ordering::Relaxed);
                    if c.up.swap(false, Ordering::Relaxed) {
                        tracing::warn!(policy = ?c.cfg.on_redis_down, "cluster: Redis failed ({e}); reconnecting");
                    }
                    conn = None;
                }
            }
            c.round_done();
        }
    })
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

/// What one queued limit needs now.
fn collect(c: &Cluster, wall: u64, asks: &mut Vec<Ask>) {
    let queued = std::mem::take(&mut *c.queue.lock());
    let nodes = c.nodes();
    // A lease should last until the next one lands even if Redis is slow: two sync
    // intervals plus three round trips of traffic.
    let horizon_ns = u64::try_from(c.cfg.sync_interval.as_nanos())
        .unwrap_or(u64::MAX)
        .saturating_mul(2)
        .saturating_add(c.rtt_us.load(Ordering::Relaxed).saturating_mul(3_000));
    for cell in queued {
        let n = cell.requests;
        let sub_ns = cell.slot_ns();
        let mut state = cell.state.lock();
        let Counter::Shared(l) = &mut state.counter else {
            continue;
        };
        l.queued = false;
        l.roll(wall / sub_ns);
        // Recent rate × horizon, within a fair share of what is left. A first lease knows no
        // rate: it asks for what came in (its requests wait for it), not for the whole
        // limit, which would leave it "full" for every other node and for this one.
        let elapsed = l
            .last_lease
            .map_or(Duration::from_nanos(horizon_ns), |t| t.elapsed())
            .max(Duration::from_millis(1));
        let rate_size =
            (l.demand as f64 * horizon_ns as f64 / elapsed.as_nanos() as f64).ceil() as u64 + 1;
        let fair = n.saturating_sub(l.granted).div_ceil(nodes).max(1);
        let size = rate_size.min(fair).min(n);
        l.demand = 0;
        l.last_lease = Some(Instant::now());
        let top_up = if !l.full() && l.tokens <= l.refill_at {
            size
        } else {
            0
        };
        let owed = l.owed();
        if l.link != c.link.load(Ordering::Relaxed) {
            // Granted through an earlier connection (maybe by a Redis that restarted empty,
            // or a master that died): giving them back here could take another's count.
            l.back.clear();
        }
        let back = std::mem::take(&mut l.back);
        if top_up > 0 || !owed.is_empty() || !back.is_empty() {
            if top_up > 0 {
                // Ask again with two thirds left: over a round trip of traffic in hand.
                l.refill_at = size * 2 / 3;
            }
            asks.push(Ask {
                cell: cell.clone(),
                at: l.sub,
                want: top_up,
                owed,
                back,
                next: false,
            });
        }
        let end = (l.sub + 1).saturating_mul(sub_ns).saturating_sub(wall);
        if end < c.lead_ns().min(sub_ns / 2)
            && !l.next_requested
            && l.busy()
            && l.sub + 1 >= l.full_until
        {
            l.next_requested = true;
            asks.push(Ask {
                cell: cell.clone(),
                at: l.sub + 1,
                want: size.min(n.div_ceil(nodes)),
                owed: SmallVec::new(),
                back: SmallVec::new(),
                next: true,
            });
        }
    }
}

fn key_of(cell: &LimitCell) -> String {
    cell.shared
        .as_ref()
        .map_or_else(String::new, |s| s.key().to_string())
}

/// One round with the store: every queued limit's lease, counts and give-backs (and the
/// heartbeat when due), each part settled as it answers. Fails only when no part answered.
async fn round(
    c: &Cluster,
    conn: &mut RedisConn,
    sha: &str,
    clock: &dyn Clock,
    heartbeat: bool,
) -> Result<Settled, redis::RedisError> {
    let wall = clock.wall_nanos();
    let mut asks = Vec::new();
    collect(c, wall, &mut asks);
    if asks.is_empty() && !heartbeat {
        return Ok(Settled::default());
    }
    let mut cmds = Vec::with_capacity(asks.len() + 4);
    for a in &asks {
        let n = a.cell.requests;
        // The hash outlives the window by a margin, so late changes still find it.
        let ttl_ms = (a.cell.window_ns / 1_000_000).saturating_mul(2).max(10_000);
        let now = wall / a.cell.slot_ns();
        let key = key_of(&a.cell);
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(sha)
            .arg(1)
            .arg(&key)
            .arg(n)
            .arg(SPAN)
            .arg(ttl_ms)
            .arg(now)
            .arg(a.at)
            .arg(a.want)
            .arg((a.cell.slot_ns() / 1_000_000).max(1));
        for (s, k) in &a.owed {
            cmd.arg(*s).arg(*k);
        }
        for (s, k) in &a.back {
            cmd.arg(*s).arg(-i64::try_from(*k).unwrap_or(i64::MAX));
        }
        cmds.push((key, cmd));
    }
    let nodes_key = format!("{}:nodes", c.cfg.key_prefix);
    if heartbeat {
        let now_ms = wall / 1_000_000;
        let mut add = redis::cmd("ZADD");
        add.arg(&nodes_key).arg(now_ms).arg(&c.node_id);
        let mut trim = redis::cmd("ZREMRANGEBYSCORE");
        trim.arg(&nodes_key)
            .arg("-inf")
            .arg(now_ms.saturating_sub(NODE_TTL_MS));
        let mut keep = redis::cmd("PEXPIRE");
        keep.arg(&nodes_key).arg(NODE_TTL_MS * 10);
        let mut count = redis::cmd("ZCARD");
        count.arg(&nodes_key);
        for cmd in [add, trim, keep, count] {
            cmds.push((nodes_key.clone(), cmd));
        }
    }
    let started = Instant::now();
    let link = c.link.load(Ordering::Relaxed);
    let mut parts = crate::redis_link::query_by_slot(conn, cmds);
    let mut settled = Settled {
        asked: !asks.is_empty(),
        ..Settled::default()
    };
    let mut answered: Option<Duration> = None;
    let mut unanswered = Vec::new();
    let mut nodes = None;
    while let Some((at, answers)) = parts.next().await {
        match answers {
            Ok(values) => {
                answered = Some(started.elapsed());
                let wall = clock.wall_nanos();
                for (i, v) in at.into_iter().zip(values) {
                    match asks.get(i) {
                        Some(a) => settle(c, a, v, wall, link),
                        None if i == asks.len() + 3 => nodes = Some(v),
                        None => {}
                    }
                }
                // A request waiting for one of these leases need not wait for the rest.
                c.answers.send_modify(|r| *r += 1);
            }
            Err(e) => {
                unanswered.extend(at.into_iter().filter(|&i| i < asks.len()));
                settled.failed = Some(e);
            }
        }
    }
    // When a part failed and none answered, a Redis Cluster may still be alive elsewhere
    // (the parts asked all live on one master): then only those parts are down.
    let mut masters = None;
    if settled.failed.is_some() && answered.is_none() && conn.is_cluster() {
        masters = super::link::cluster_masters(conn).await.ok();
    }
    let alive = answered.is_some() || masters.is_some();
    // Some of a failed part may have run (a timeout after Redis answered): ask again, count
    // again what is owed (at worst twice, which only under-admits), and drop the give-backs
    // (sending one twice would take back another node's count). When the rest of the
    // store is alive, the failed part's limits count as the store being down until their
    // part answers.
    for i in unanswered {
        let a = &asks[i];
        if let Counter::Shared(l) = &mut a.cell.state.lock().counter {
            if a.next {
                l.next_requested = false;
            }
            l.cut_off = alive;
            requeue(c, &a.cell, l);
        }
    }
    if !alive {
        return match settled.failed {
            Some(e) => Err(e),
            None => Ok(settled),
        };
    }
    if let Some(rtt) = answered {
        let rtt = u64::try_from(rtt.as_micros()).unwrap_or(u64::MAX);
        let old = c.rtt_us.load(Ordering::Relaxed);
        c.rtt_us.store((old * 7 + rtt) / 8, Ordering::Relaxed);
    }
    if settled
        .failed
        .as_ref()
        .is_some_and(|e| e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript))
    {
        // A replica promoted since the connection was made lacks the script.
        if let Err(e) = load_script(conn).await {
            tracing::debug!("cluster: loading the lease script again failed: {e}");
        }
    }
    if let Some(n) = nodes.and_then(|v| redis::from_redis_value::<u64>(v).ok()) {
        c.nodes.store(n.max(1), Ordering::Relaxed);
    }
    if heartbeat && conn.is_cluster() {
        // The round stands whatever this answers.
        let masters = match masters {
            Some(m) => Ok(m),
            None => super::link::cluster_masters(conn).await,
        };
        match masters {
            Ok(masters) => settled.switched = c.connected_to_cluster(masters),
            Err(e) => tracing::debug!("cluster: CLUSTER SLOTS failed: {e}"),
        }
    }
    Ok(settled)
}

/// How a round went, when any of it answered.
#[derive(Default)]
struct Settled {
    /// It asked for a limit (not only the heartbeat).
    asked: bool,
    /// Why a part failed (a dead master of a Redis Cluster) while the rest answered.
    failed: Option<redis::RedisError>,
    /// The Redis Cluster's masters are not those of the last heartbeat.
    switched: bool,
}

/// Applies the store's answer `v` to one ask.
fn settle(c: &Cluster, a: &Ask, v: redis::Value, wall: u64, link: u32) {
    let Ok((granted, total, free_at, over)) = redis::from_redis_value::<(u64, u64, u64, u64)>(v)
    else {
        // Not an answer of the script: nothing is known to be settled.
        c.metrics.errors.fetch_add(1, Ordering::Relaxed);
        if let Counter::Shared(l) = &mut a.cell.state.lock().counter {
            if a.next {
                l.next_requested = false;
            }
            requeue(c, &a.cell, l);
        }
        return;
    };
    c.metrics.granted.fetch_add(granted, Ordering::Relaxed);
    let owed: u64 = a.owed.iter().map(|(_, k)| k).sum();
    let over = over.min(owed);
    if over > 0 {
        c.metrics.overadmitted.fetch_add(over, Ordering::Relaxed);
    }
    let mut state = a.cell.state.lock();
    let Counter::Shared(l) = &mut state.counter else {
        return;
    };
    l.cut_off = false;
    l.roll(wall / a.cell.slot_ns());
    for (s, k) in &a.owed {
        l.settled(*s, *k);
    }
    l.granted = total;
    // The store's latest word on the window: tokens given back since it last said "full"
    // (this node's own, unused) may have made room again. A lease for the next
    // sub-window speaks of a later window only, so it never clears it.
    l.full_until = if a.next {
        l.full_until.max(free_at)
    } else {
        free_at
    };
    if granted > 0 {
        l.link = link;
    }
    if a.at == l.sub {
        l.tokens += granted;
    } else if a.at == l.sub + 1 {
        l.next_tokens += granted;
    } else if granted > 0 {
        // The sub-window ended while asking: the tokens go back.
        l.back.push((a.at, granted));
    }
    requeue(c, &a.cell, l);
}

/// Queues `cell` again when it still owes counts or has tokens to give back.
fn requeue(c: &Cluster, cell: &Arc<LimitCell>, l: &mut crate::limiter::shared::Lease) {
    if (l.debt > 0 || !l.back.is_empty()) && !l.queued {
        l.queued = true;
        c.queue.lock().push(cell.clone());
    }
}
