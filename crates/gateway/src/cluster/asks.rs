//! What a round asks of the store for each queued limit, and how each answer is settled.

use super::link::Cluster;
use crate::limiter::shared::SPAN;
use crate::limiter::{Counter, LimitCell};
use smallvec::SmallVec;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Counts one limit's sub-windows and grants tokens for one of them, atomically.
///
/// KEYS[1]: the limit's hash, sub-window → requests counted; KEYS[2]: node → the number of
/// its last ask run (in the same hash slot). ARGV: N, span (sub-windows counting beside the
/// current one), ttl (ms), the node's current sub-window, the sub-window to grant in,
/// tokens wanted, the sub-window's length (ms), the node's id, the ask's number (rising per
/// node); then pairs (sub-window, change) applied first: requests admitted without a grant
/// (+), tokens given back unused (−).
///
/// An ask whose number is not above the node's last one changes nothing, is granted
/// nothing and says it did not run: a client's retry of an ask that timed out, or an old
/// ask that arrives after a newer one, is run at most once, so no give-back is taken twice
/// and no count is added more than the node sends it. Nodes not heard from for an hour are
/// forgotten once more than 64 are kept.
///
/// Grants `min(want, N − counted)`, where `counted` sums every sub-window from `at − span`
/// on, later ones included: after any grant, no span of `span + 1` sub-windows holds more
/// than N grants. Redis's own clock bounds what a node may ask for: nothing is granted or
/// counted more than one sub-window ahead of it, and nothing is dropped that still counts
/// by it, so one node's clock running ahead cannot block a limit for the others.
/// Returns {granted, counted, free_at, over, ran}: `free_at` is the sub-window from which
/// room opens again when the limit is used up (else 0), `over` how far the changes pushed
/// the count past N, `ran` 1 if the ask ran.
pub const LEASE: &str = include_str!("lease.lua");
/// How long a node counts as alive after its last heartbeat.
pub(super) const NODE_TTL_MS: u64 = 3_000;

/// One limit's call of the lease script in a round.
pub(super) struct Ask {
    pub(super) cell: Arc<LimitCell>,
    /// The sub-window the tokens are for.
    pub(super) at: u64,
    pub(super) want: u64,
    /// The limit's N the ask is made under.
    pub(super) n: u64,
    /// Admitted without a grant, per sub-window: counted by this call.
    pub(super) owed: SmallVec<[(u64, u64); 2]>,
    /// Tokens given back, per sub-window.
    pub(super) back: SmallVec<[(u64, u64); 2]>,
    pub(super) next: bool,
}

/// What one queued limit needs now.
pub(super) fn collect(c: &Cluster, wall: u64, asks: &mut Vec<Ask>) {
    let queued = std::mem::take(&mut *c.queue.lock());
    let nodes = c.nodes();
    // A lease should last until the next one lands even if Redis is slow: two sync
    // intervals plus three round trips of traffic.
    let horizon_ns = u64::try_from(c.cfg.sync_interval.as_nanos())
        .unwrap_or(u64::MAX)
        .saturating_mul(2)
        .saturating_add(c.rtt_us.load(Ordering::Relaxed).saturating_mul(3_000));
    for cell in queued {
        let n = cell.requests();
        let sub_ns = cell.slot_ns();
        let mut state = cell.state.lock();
        let Counter::Shared(l) = &mut state.counter else {
            continue;
        };
        l.queued = false;
        if l.asking {
            // Its last ask is still on its way (a slow master): that lands first, then the
            // limit is queued again if it still needs anything.
            continue;
        }
        l.roll(wall / sub_ns);
        if l.cut_off {
            // Its part of the store failed: a probe that changes nothing goes first, so
            // that asks stuck on a hung master and run when it resumes hold no counts or
            // give-backs. Those wait for the probe's answer.
            l.asking = true;
            asks.push(Ask {
                cell: cell.clone(),
                at: l.sub,
                want: 0,
                n,
                owed: SmallVec::new(),
                back: SmallVec::new(),
                next: false,
            });
            continue;
        }
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
        // Taken whatever comes of it: a recheck asked in a sub-window that is over, or
        // for a limit no longer full, has nothing left to ask.
        let recheck = std::mem::take(&mut l.recheck);
        let top_up = if (!l.full() || recheck) && l.tokens <= l.refill_at {
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
            l.asking = true;
            asks.push(Ask {
                cell: cell.clone(),
                at: l.sub,
                want: top_up,
                n,
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
            l.asking = true;
            asks.push(Ask {
                cell: cell.clone(),
                at: l.sub + 1,
                want: size.min(n.div_ceil(nodes)),
                n,
                owed: SmallVec::new(),
                back: SmallVec::new(),
                next: true,
            });
        }
    }
}

/// Gives back the tokens left unused when their sub-window ended on limits no request has
/// touched since (a request would give them back itself): another node may need them, and
/// the store's count, `tollgate usage` among its readers, should not keep them. Run once a
/// second, over the limits granted tokens lately.
pub(super) fn sweep(c: &Cluster, wall: u64, asks: &mut Vec<Ask>) {
    let held = std::mem::take(&mut *c.holders.lock());
    let mut keep = Vec::with_capacity(held.len());
    for cell in held {
        let mut state = cell.state.lock();
        let Counter::Shared(l) = &mut state.counter else {
            continue;
        };
        if !l.queued && !l.asking {
            l.roll(wall / cell.slot_ns());
            if l.link != c.link.load(Ordering::Relaxed) {
                // Granted through an earlier connection: see `collect`.
                l.back.clear();
            }
            if !l.back.is_empty() {
                l.asking = true;
                asks.push(Ask {
                    cell: cell.clone(),
                    at: l.sub,
                    want: 0,
                    n: cell.requests(),
                    owed: l.owed(),
                    back: std::mem::take(&mut l.back),
                    next: false,
                });
            }
        }
        if l.tokens > 0 || l.next_tokens > 0 || l.queued || l.asking {
            drop(state);
            keep.push(cell);
        } else {
            l.held = false;
        }
    }
    c.holders.lock().extend(keep);
}

fn key_of(cell: &LimitCell) -> String {
    cell.shared
        .as_ref()
        .map_or_else(String::new, |s| s.key().to_string())
}

/// The lease script's call for each ask, with the key it names.
pub(super) fn commands(
    c: &Cluster,
    asks: &[Ask],
    sha: &str,
    wall: u64,
) -> Vec<(String, redis::Cmd)> {
    let mut cmds = Vec::with_capacity(asks.len() + 4);
    for a in asks {
        let n = a.n;
        // The hash outlives the window by a margin, so late changes still find it.
        let ttl_ms = (a.cell.window_ns / 1_000_000).saturating_mul(2).max(10_000);
        let now = wall / a.cell.slot_ns();
        let key = key_of(&a.cell);
        let seq = c.asks.fetch_add(1, Ordering::Relaxed) + 1;
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(sha)
            .arg(2)
            .arg(&key)
            .arg(format!("{key}:asks"))
            .arg(n)
            .arg(SPAN)
            .arg(ttl_ms)
            .arg(now)
            .arg(a.at)
            .arg(a.want)
            .arg((a.cell.slot_ns() / 1_000_000).max(1))
            .arg(&c.node_id)
            .arg(seq);
        for (s, k) in &a.owed {
            cmd.arg(*s).arg(*k);
        }
        for (s, k) in &a.back {
            cmd.arg(*s).arg(-i64::try_from(*k).unwrap_or(i64::MAX));
        }
        cmds.push((key, cmd));
    }
    cmds
}

/// The heartbeat: this node's mark in the set of live nodes, the set trimmed, and its size
/// (the fourth command's answer).
pub(super) fn heartbeat_commands(c: &Cluster, wall: u64) -> Vec<(String, redis::Cmd)> {
    let nodes_key = format!("{}:nodes", c.cfg.key_prefix);
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
    [add, trim, keep, count]
        .into_iter()
        .map(|cmd| (nodes_key.clone(), cmd))
        .collect()
}

/// An ask whose part failed. Some of it may have run (a timeout after Redis answered): ask
/// again, count again what is owed (at worst twice, which only under-admits), and drop the
/// give-backs (one sent again could take back another node's count if the first ran late).
/// `cut_off`: the rest of the store answers, so this limit alone counts as the store being
/// down, and is probed before anything else is sent for it.
pub(super) fn unsettled(c: &Cluster, a: &Ask, cut_off: bool) {
    if let Counter::Shared(l) = &mut a.cell.state.lock().counter {
        l.asking = false;
        if a.next {
            l.next_requested = false;
        }
        l.cut_off = cut_off;
        if cut_off {
            // Tokens it holds were granted by a part that has failed since (a master that
            // may come back empty): they are never given back.
            l.link = u32::MAX;
            l.back.clear();
        }
        requeue(c, &a.cell, l);
    }
}

/// Applies the store's answer `v` to one ask.
pub(super) fn settle(c: &Cluster, a: &Ask, v: redis::Value, wall: u64, link: u32) {
    let answer = redis::from_redis_value::<(u64, u64, u64, u64, u64)>(v);
    let Ok((granted, total, free_at, over, 1)) = answer else {
        // Not an answer of the script, or the answer to a copy of an ask that ran before
        // (whose own answer never came): nothing is known to be settled.
        if answer.is_err() {
            c.metrics.errors.fetch_add(1, Ordering::Relaxed);
        }
        unsettled(c, a, false);
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
    l.asking = false;
    l.cut_off = false;
    l.roll(wall / a.cell.slot_ns());
    for (s, k) in &a.owed {
        l.settled(*s, *k);
    }
    l.granted = total;
    if a.at == l.sub {
        // The store's word for this sub-window is fresh: no need to ask again in it.
        l.rechecked = l.rechecked.max(l.sub);
        l.recheck = false;
    }
    // The store's latest word on the window: tokens given back since it last said "full"
    // (this node's own, unused) may have made room again. A lease for the next
    // sub-window speaks of a later window only, so it never clears it.
    l.full_until = if a.next {
        l.full_until.max(free_at)
    } else {
        free_at
    };
    if granted > 0 {
        if l.link != link {
            // Tokens held from another connection, or from a part that failed since: they
            // are spent no more, so none of them is given back through this one.
            l.tokens = 0;
            l.next_tokens = 0;
        }
        l.link = link;
        l.leased_under = l.leased_under.max(a.n);
    }
    if a.at == l.sub {
        l.tokens += granted;
    } else if a.at == l.sub + 1 {
        l.next_tokens += granted;
    } else if granted > 0 {
        // The sub-window ended while asking: the tokens go back.
        l.back.push((a.at, granted));
    }
    if (l.tokens > 0 || l.next_tokens > 0) && !l.held {
        l.held = true;
        c.holders.lock().push(a.cell.clone());
    }
    requeue(c, &a.cell, l);
}

/// Queues `cell` again when it still owes counts, has tokens to give back, or a recheck
/// of a full limit waits to be asked.
fn requeue(c: &Cluster, cell: &Arc<LimitCell>, l: &mut crate::limiter::shared::Lease) {
    if (l.debt > 0 || !l.back.is_empty() || l.recheck) && !l.queued {
        l.queued = true;
        c.queue.lock().push(cell.clone());
    }
}
