//! The background task that settles a node's shared limits with Redis.

use super::link::Cluster;
use crate::clock::Clock;
use crate::limiter::{Counter, LimitCell};
use redis::aio::MultiplexedConnection;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Grants `min(want, limit − granted)` for one limit and window, atomically.
/// KEYS[1]: the window's counter. ARGV: limit, want, ttl (ms). Returns {granted, total}.
const LEASE: &str = r#"
local total = tonumber(redis.call('GET', KEYS[1]) or '0')
local grant = math.min(tonumber(ARGV[2]), tonumber(ARGV[1]) - total)
if grant > 0 then
  total = redis.call('INCRBY', KEYS[1], grant)
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
else
  grant = 0
end
return {grant, total}
"#;

/// How long a node counts as alive after its last heartbeat.
const NODE_TTL_MS: u64 = 3_000;
const HEARTBEAT: Duration = Duration::from_secs(1);

struct Ask {
    cell: Arc<LimitCell>,
    window: u64,
    want: u64,
    /// Debt this ask settles (paid first from the grant).
    debt: u64,
    next: bool,
}

/// Starts the syncer: every `sync_interval` it leases for the limits that need tokens,
/// settles debts, and renews this node's heartbeat; it reconnects with backoff when Redis
/// fails. Ends when the cluster is dropped by everyone else.
pub fn spawn_syncer(cluster: Arc<Cluster>, clock: Arc<dyn Clock>) -> tokio::task::JoinHandle<()> {
    let weak = Arc::downgrade(&cluster);
    drop(cluster);
    tokio::spawn(async move {
        let mut conn: Option<(MultiplexedConnection, String)> = None;
        let mut backoff = Duration::from_millis(100);
        let mut last_heartbeat: Option<Instant> = None;
        let Some(c) = weak.upgrade() else { return };
        let mut tick = tokio::time::interval(c.cfg.sync_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        drop(c);
        loop {
            tick.tick().await;
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
                        drop(c);
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(5));
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

async fn connect(c: &Cluster) -> Result<(MultiplexedConnection, String), redis::RedisError> {
    let (mut conn, address) =
        crate::redis_link::redis_connection_at(&c.cfg.redis, Duration::from_secs(1)).await?;
    c.connected_to(address);
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(LEASE)
        .query_async(&mut conn)
        .await?;
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
        let mut state = cell.state.lock();
        let Counter::Shared(l) = &mut state.counter else {
            continue;
        };
        l.queued = false;
        l.roll(wall / cell.window_ns.max(1));
        // Recent rate × horizon, within a fair share of what is left.
        let elapsed = l
            .last_lease
            .map_or(Duration::from_millis(1), |t| t.elapsed())
            .max(Duration::from_millis(1));
        let rate_size =
            (l.demand as f64 * horizon_ns as f64 / elapsed.as_nanos() as f64).ceil() as u64 + 1;
        let fair = n.saturating_sub(l.granted).div_ceil(nodes).max(1);
        let size = rate_size.min(fair).min(n);
        l.demand = 0;
        l.last_lease = Some(Instant::now());
        if !l.exhausted(n) {
            let top_up = if l.tokens <= l.refill_at { size } else { 0 };
            let want = l.debt + top_up;
            if want > 0 {
                // Ask again with two thirds left: over a round trip of traffic in hand.
                l.refill_at = size * 2 / 3;
                asks.push(Ask {
                    cell: cell.clone(),
                    window: l.window,
                    want,
                    debt: l.debt,
                    next: false,
                });
            }
        }
        let end = (l.window + 1)
            .saturating_mul(cell.window_ns)
            .saturating_sub(wall);
        if end < c.lead_ns() && !l.next_requested && l.used > 0 {
            l.next_requested = true;
            asks.push(Ask {
                cell: cell.clone(),
                window: l.window + 1,
                want: size.min(n.div_ceil(nodes)),
                debt: 0,
                next: true,
            });
        }
    }
}

fn key_of(cell: &LimitCell, window: u64) -> String {
    cell.shared
        .as_ref()
        .map_or_else(String::new, |s| s.key_for(window))
}

async fn round(
    c: &Cluster,
    conn: &mut MultiplexedConnection,
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
    let mut pipe = redis::pipe();
    for a in &asks {
        // The key outlives its window by a margin, so late settles still find it.
        let ttl_ms = (a.cell.window_ns / 1_000_000).saturating_mul(2).max(10_000);
        pipe.cmd("EVALSHA")
            .arg(sha)
            .arg(1)
            .arg(key_of(&a.cell, a.window))
            .arg(a.cell.requests)
            .arg(a.want)
            .arg(ttl_ms);
    }
    let nodes_key = format!("{}:nodes", c.cfg.key_prefix);
    if heartbeat {
        let now_ms = wall / 1_000_000;
        pipe.cmd("ZADD")
            .arg(&nodes_key)
            .arg(now_ms)
            .arg(&c.node_id)
            .ignore();
        pipe.cmd("ZREMRANGEBYSCORE")
            .arg(&nodes_key)
            .arg("-inf")
            .arg(now_ms.saturating_sub(NODE_TTL_MS))
            .ignore();
        pipe.cmd("PEXPIRE")
            .arg(&nodes_key)
            .arg(NODE_TTL_MS * 10)
            .ignore();
        pipe.cmd("ZCARD").arg(&nodes_key);
    }
    let started = Instant::now();
    let result: Result<Vec<redis::Value>, _> = pipe.query_async(conn).await;
    let values = match result {
        Ok(v) => v,
        Err(e) => {
            // Nothing was granted: let the limits ask again.
            for a in &asks {
                if let Counter::Shared(l) = &mut a.cell.state.lock().counter {
                    if a.next {
                        l.next_requested = false;
                    }
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
    for a in &asks {
        let (granted, total) = match values.next() {
            Some(v) => redis::from_redis_value::<(u64, u64)>(v).unwrap_or((0, 0)),
            None => (0, 0),
        };
        c.metrics.granted.fetch_add(granted, Ordering::Relaxed);
        let mut state = a.cell.state.lock();
        let Counter::Shared(l) = &mut state.counter else {
            continue;
        };
        l.roll(wall / a.cell.window_ns.max(1));
        if a.next {
            if l.window + 1 == a.window {
                l.next_tokens += granted;
            } else if l.window == a.window {
                l.tokens += granted;
                l.granted = l.granted.max(total);
            }
            continue;
        }
        if l.window != a.window {
            continue;
        }
        let paid = granted.min(a.debt);
        let unpaid = a.debt - paid;
        if unpaid > 0 {
            c.metrics.overadmitted.fetch_add(unpaid, Ordering::Relaxed);
        }
        l.debt = l.debt.saturating_sub(a.debt);
        l.tokens += granted - paid;
        l.granted = l.granted.max(total);
    }
    if heartbeat {
        if let Some(v) = values.next() {
            if let Ok(n) = redis::from_redis_value::<u64>(v) {
                c.nodes.store(n.max(1), Ordering::Relaxed);
            }
        }
    }
    Ok(())
}
