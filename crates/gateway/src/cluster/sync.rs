//! The background task that settles a node's shared limits with Redis.

use super::link::Cluster;
use crate::clock::Clock;
use crate::limiter::shared::SPAN;
use crate::limiter::{Counter, LimitCell};
use crate::redis_link::RedisConn;
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
                        c.rounds.send_modify(|r| *r += 1);
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
                Ok(()) => {
                    if heartbeat {
                        last_heartbeat = Some(Instant::now());
                    }
                    if !c.up.swap(true, Ordering::Relaxed) {
                        tracing::info!("cluster: Redis answers; shared counting resumed");
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
            c.rounds.send_modify(|r| *r += 1);
        }
    })
}

async fn connect(c: &Cluster) -> Result<(RedisConn, String), redis::RedisError> {
    let (mut conn, address) =
        crate::redis_link::redis_connection_at(&c.cfg.redis, Duration::from_secs(1)).await?;
    c.link.fetch_add(1, Ordering::Relaxed);
    // On a Redis Cluster this goes to every node.
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(LEASE)
        .query_async(&mut conn)
        .await?;
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

async fn round(
    c: &Cluster,
    conn: &mut RedisConn,
    sha: &str,
    clock: &dyn Clock,
    heartbeat: bool,
) -> Result<(), redis::RedisError> {
    let wall = clock.wall_nanos();
    let mut asks = Vec::new();
    collect(c, wall, &mut asks);
    if asks.is_empty() && !heartbeat {
        return Ok(());
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
    let values = match crate::redis_link::query_keyed(conn, cmds).await {
        Ok(v) => v,
        Err(e) => {
            // Some of the round may have run (a timeout after Redis answered, one slot's
            // pipeline of several): ask again, count again what is owed (at worst twice,
            // which only under-admits), and drop the give-backs (sending one twice would
            // take back another node's count).
            for a in asks {
                if let Counter::Shared(l) = &mut a.cell.state.lock().counter {
                    if a.next {
                        l.next_requested = false;
                    }
                    requeue(c, &a.cell, l);
                }
            }
            return Err(e);
        }
    };
    let rtt = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
    let old = c.rtt_us.load(Ordering::Relaxed);
    c.rtt_us.store((old * 7 + rtt) / 8, Ordering::Relaxed);

    let mut values = values.into_iter();
    let wall = clock.wall_nanos();
    let link = c.link.load(Ordering::Relaxed);
    for a in &asks {
        let answer = values
            .next()
            .and_then(|v| redis::from_redis_value::<(u64, u64, u64, u64)>(v).ok());
        let Some((granted, total, free_at, over)) = answer else {
            // Not an answer of the script: nothing is known to be settled.
            c.metrics.errors.fetch_add(1, Ordering::Relaxed);
            if let Counter::Shared(l) = &mut a.cell.state.lock().counter {
                if a.next {
                    l.next_requested = false;
                }
                requeue(c, &a.cell, l);
            }
            continue;
        };
        c.metrics.granted.fetch_add(granted, Ordering::Relaxed);
        let owed: u64 = a.owed.iter().map(|(_, k)| k).sum();
        let over = over.min(owed);
        if over > 0 {
            c.metrics.overadmitted.fetch_add(over, Ordering::Relaxed);
        }
        let mut state = a.cell.state.lock();
        let Counter::Shared(l) = &mut state.counter else {
            continue;
        };
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
    if heartbeat {
        let mut rest = values.skip(3);
        if let Some(v) = rest.next() {
            if let Ok(n) = redis::from_redis_value::<u64>(v) {
                c.nodes.store(n.max(1), Ordering::Relaxed);
            }
        }
        if conn.is_cluster() {
            // For `/status` only: the round stands whatever this answers.
            match super::link::cluster_masters(conn).await {
                Ok(masters) => c.connected_to_cluster(masters),
                Err(e) => tracing::debug!("cluster: CLUSTER SLOTS failed: {e}"),
            }
        }
    }
    Ok(())
}

/// Queues `cell` again when it still owes counts or has tokens to give back.
fn requeue(c: &Cluster, cell: &Arc<LimitCell>, l: &mut crate::limiter::shared::Lease) {
    if (l.debt > 0 || !l.back.is_empty()) && !l.queued {
        l.queued = true;
        c.queue.lock().push(cell.clone());
    }
}
