//! Limits shared among nodes, as the request path counts them: a node admits from tokens
//! it leased beforehand ([`Lease`]), on credit, or within its last share while the store is
//! down. What the shared store must do is [`SharedStore`]; the cluster link implements it.
//!
//! A shared limit is counted as a node counts a local one: in sub-windows of W/10 (aligned
//! to the wall clock, so every node agrees on them), a request counting while its
//! sub-window is among the current one and the 10 before it. The store grants tokens for
//! one sub-window only when the grants over those 11 (and any later one) stay within N, so
//! no interval of length W holds more than N granted requests cluster-wide.

use super::slots::{sub_window_ns, SLOTS, SUB};
use super::verdict::{Refused, Standing};
use smallvec::SmallVec;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tollgate_config::LimitConfig;

/// A limit as the shared counting needs it: N requests per window.
#[derive(Debug, Clone, Copy)]
pub struct Limit {
    /// N.
    pub requests: u64,
    /// The window, in nanoseconds.
    pub window_ns: u64,
}

impl Limit {
    /// The sub-window length in nanoseconds.
    pub fn sub_ns(self) -> u64 {
        sub_window_ns(self.window_ns)
    }
}

/// Sub-windows that count beside the current one: a grant for sub-window `s` is checked
/// against every count from `s − SPAN` on.
pub const SPAN: u64 = SUB;

/// What a store that shares limits among nodes must do for the request path.
pub trait SharedStore<C>: Send + Sync + std::fmt::Debug {
    /// Whether the last exchange with the store succeeded.
    fn is_up(&self) -> bool;
    /// Live nodes sharing the limits (at least 1).
    fn nodes(&self) -> u64;
    /// Whether a node admits within its last share while the store is down (else 503).
    fn fail_open(&self) -> bool;
    /// How long before a sub-window's end a busy limit leases for the next one.
    fn lead_ns(&self) -> u64;
    /// Queues `cell` for the next round with the store.
    fn enqueue(&self, cell: &Arc<C>);
    /// Starts the next round now rather than at its tick: a request waits for a lease.
    fn hurry(&self);
    /// Counts a request admitted while the store was down.
    fn admitted_fail_open(&self);
    /// The counting handle for one limit of one consumer (and route, for a route's limit).
    fn shared_limit(
        self: Arc<Self>,
        route: Option<&str>,
        consumer: &str,
        limit: &LimitConfig,
    ) -> SharedLimit<C>;
}

/// How one shared limit is keyed and how much credit it allows.
#[derive(Debug)]
pub struct SharedLimit<C> {
    store: Arc<dyn SharedStore<C>>,
    /// The store's key for this limit's counts.
    key: String,
    /// N × max_overadmission, split among the nodes at check time.
    max_overadmission: f64,
}

/// Counts per sub-window for the current one and the `SPAN` before it, sub-window `k` at
/// `k mod SLOTS`.
type Ring = [u32; SLOTS];

/// A node's state for one shared limit.
#[derive(Debug, Default)]
pub struct Lease {
    /// The current sub-window (wall clock / sub-window length).
    pub(crate) sub: u64,
    /// Leased for `sub`, not used yet.
    pub(crate) tokens: u64,
    /// Leased for `sub + 1`.
    pub(crate) next_tokens: u64,
    pub(crate) next_requested: bool,
    /// Tokens whose sub-window ended unused, to give back: (sub-window, tokens).
    pub(crate) back: SmallVec<[(u64, u64); 2]>,
    /// Which connection to the store granted the tokens held (the store counts them):
    /// give-backs go only to the connection that granted them.
    pub(crate) link: u32,
    /// Admitted on this node, per sub-window.
    pub(crate) own: Ring,
    /// Admitted without a grant (credit, or while the store was down) and not yet counted
    /// by the store, per sub-window.
    pub(crate) owed: Ring,
    /// The sum of `owed`.
    pub(crate) debt: u64,
    /// The store said the limit is used up until this sub-window: no credit, no lease.
    pub(crate) full_until: u64,
    /// The last sub-window the store was heard from or asked again while the limit was
    /// full: tokens other nodes give back unused make room before `full_until`, so a full
    /// limit is asked about once a sub-window.
    pub(crate) rechecked: u64,
    /// The next round asks for a lease although the limit is full (once a sub-window).
    pub(crate) recheck: bool,
    /// What the node may admit per window while the store is down (0: not set yet): its own
    /// admissions over the last window plus an even split of the room left.
    pub(crate) share: u64,
    /// Requests seen since the last lease was asked for (the rate estimate).
    pub(crate) demand: u64,
    pub(crate) last_lease: Option<Instant>,
    /// Counted cluster-wide over the window ending at the sub-window last asked for, as of
    /// the store's last answer.
    pub(crate) granted: u64,
    /// Ask for more when tokens fall to this.
    pub(crate) refill_at: u64,
    /// The limit's N when the tokens held were leased: a lower N since (a reload) gives
    /// them back, as the store granted them against the larger one.
    pub(crate) leased_under: u64,
    pub(crate) queued: bool,
    /// The part of the store that keeps this limit failed the last round while the rest
    /// answered (a dead master of a Redis Cluster): the limit counts as the store being
    /// down until its part answers again.
    pub(crate) cut_off: bool,
    /// An ask for this limit is on its way to the store: no other is sent until it lands.
    pub(crate) asking: bool,
    /// Listed among the limits holding tokens, which the syncer looks at once a second for
    /// tokens whose sub-window ended unused: they go back without waiting for a request.
    pub(crate) held: bool,
}

/// `k mod SLOTS`, as a ring index.
fn at(k: u64) -> usize {
    (k % SLOTS as u64) as usize
}

impl Lease {
    /// Moves to sub-window `sub` if the clock has left the current one. Tokens of a
    /// sub-window that ended are given back. A clock that went back stays in the current
    /// sub-window, unless it went back by more than a window: then the state starts over
    /// there (the store would grant nothing for sub-windows it has not reached).
    pub(crate) fn roll(&mut self, sub: u64) {
        if sub <= self.sub {
            if self.sub - sub > SPAN {
                *self = Lease {
                    sub,
                    queued: self.queued,
                    asking: self.asking,
                    cut_off: self.cut_off,
                    ..Lease::default()
                };
            }
            return;
        }
        let steps = sub - self.sub;
        if self.tokens > 0 {
            self.back.push((self.sub, self.tokens));
        }
        self.tokens = 0;
        if steps == 1 {
            self.tokens = self.next_tokens;
        } else if self.next_tokens > 0 {
            self.back.push((self.sub + 1, self.next_tokens));
        }
        // Ask again with two thirds of what was leased ahead left, as after any lease.
        self.refill_at = self.tokens * 2 / 3;
        self.next_tokens = 0;
        self.next_requested = false;
        // The slots taken over held sub-windows that no longer count.
        for k in 1..=steps.min(SLOTS as u64) {
            let i = at(self.sub + k);
            self.debt -= u64::from(self.owed[i]);
            self.owed[i] = 0;
            self.own[i] = 0;
        }
        self.sub = sub;
        let oldest = sub.saturating_sub(SPAN);
        self.back.retain(|(s, _)| *s >= oldest);
    }

    /// Gives back every token held, for this sub-window and the next.
    fn give_back_held(&mut self) {
        if self.tokens > 0 {
            self.back.push((self.sub, self.tokens));
        }
        if self.next_tokens > 0 {
            self.back.push((self.sub + 1, self.next_tokens));
        }
        self.tokens = 0;
        self.next_tokens = 0;
        self.next_requested = false;
        self.refill_at = 0;
    }

    /// Admitted on this node over the window (the current sub-window and `SPAN` before).
    pub(crate) fn own_total(&self) -> u64 {
        self.own.iter().map(|&n| u64::from(n)).sum()
    }

    /// Requests counted in the window: cluster-wide as last known, at least this node's.
    pub(crate) fn counted(&self) -> u64 {
        self.granted.max(self.own_total())
    }

    /// Whether nothing is counted or owed in the window and no lease is in flight: the
    /// state can go (tokens in hand are given up, which only under-admits).
    pub(crate) fn idle(&self) -> bool {
        self.debt == 0 && !self.queued && !self.asking && self.own.iter().all(|&n| n == 0)
    }

    /// Whether this node admitted anything in the current sub-window.
    pub(crate) fn busy(&self) -> bool {
        self.own[at(self.sub)] > 0
    }

    /// Whether the store has said the limit is used up in the current sub-window.
    pub(crate) fn full(&self) -> bool {
        self.sub < self.full_until
    }

    /// Counts owed to the store: (sub-window, requests), oldest first.
    pub(crate) fn owed(&self) -> SmallVec<[(u64, u64); 2]> {
        (0..SLOTS as u64)
            .rev()
            .filter_map(|k| {
                let s = self.sub.checked_sub(k)?;
                let n = self.owed[at(s)];
                (n > 0).then_some((s, u64::from(n)))
            })
            .collect()
    }

    /// The store now counts `n` requests owed for sub-window `s`.
    pub(crate) fn settled(&mut self, s: u64, n: u64) {
        if s > self.sub || s + SPAN < self.sub {
            return;
        }
        let slot = &mut self.owed[at(s)];
        let paid = n.min(u64::from(*slot));
        *slot -= paid as u32;
        self.debt -= paid;
    }

    /// Nanoseconds from `wall` until the oldest request this node counts leaves the window.
    fn oldest_leaves(&self, sub_ns: u64, wall: u64) -> u64 {
        let oldest = (0..SLOTS as u64)
            .rev()
            .filter_map(|k| self.sub.checked_sub(k))
            .find(|&s| self.own[at(s)] > 0)
            .unwrap_or(self.sub);
        (oldest + SLOTS as u64)
            .saturating_mul(sub_ns)
            .saturating_sub(wall)
    }
}

/// How a request was admitted by a shared limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// With a leased token.
    Token,
    /// On credit, to be counted by the store in the next round.
    Credit,
    /// Within the node's last share while the store is unreachable.
    FailOpen,
}

impl<C> SharedLimit<C> {
    /// A handle counting one limit in `store` under `key`, allowing N ×
    /// `max_overadmission` of credit among the nodes (N: the limit's requests when asked).
    pub fn new(store: Arc<dyn SharedStore<C>>, key: String, max_overadmission: f64) -> Self {
        SharedLimit {
            store,
            key,
            max_overadmission,
        }
    }

    /// The store's key for this limit's counts (a hash: sub-window → requests).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Decides whether a request fits, without counting it. Never waits on the store.
    /// `again`: the request asked before and waited for a lease; it is not counted in the
    /// rate the leases are sized by a second time.
    pub(crate) fn room(
        &self,
        cell: &Arc<C>,
        limit: Limit,
        l: &mut Lease,
        wall: u64,
        again: bool,
    ) -> Result<Admit, Refused> {
        let c = &self.store;
        let sub_ns = limit.sub_ns();
        l.roll(wall / sub_ns);
        if !again {
            l.demand += 1;
        }
        if limit.requests < l.leased_under {
            // Lowered since the tokens held were leased: the store decides again under
            // the new N, which they would otherwise pass.
            l.give_back_held();
            l.leased_under = limit.requests;
        }
        if !l.back.is_empty() || l.debt > 0 {
            // Tokens of a sub-window that ended go back, and what was admitted without a
            // grant is counted, in the next round (also when this request is refused).
            queue(c.as_ref(), cell, l);
        }
        let refuse = |wait: u64| {
            Refused::Limit(Standing {
                index: 0,
                remaining: 0,
                reset: Duration::from_nanos(wait),
            })
        };
        if l.tokens > 0 {
            return Ok(Admit::Token);
        }
        if c.is_up() && !l.cut_off {
            l.share = 0;
            if l.full() {
                // Used up until the store said room opens.
                let wait = l.full_until.saturating_mul(sub_ns).saturating_sub(wall);
                if l.back.is_empty() {
                    // An ask queued or on its way brings the store's word for now: the
                    // request waits for it (bounded by the lease wait).
                    let pending = l.recheck || l.asking;
                    if l.rechecked >= l.sub && !pending {
                        return Err(refuse(wait));
                    }
                    if l.rechecked < l.sub {
                        // Not heard from in this sub-window: other nodes may have given
                        // their unused tokens back since. Asked once, the request waiting
                        // for the answer.
                        l.rechecked = l.sub;
                        l.recheck = true;
                        queue(c.as_ref(), cell, l);
                    }
                }
                // The store counted tokens this node has since given up unused: once they
                // are back, it may have room. The request waits for that round's word.
                c.hurry();
                return Err(Refused::Leasing(Standing {
                    index: 0,
                    remaining: 0,
                    reset: Duration::from_nanos(wait),
                }));
            }
            let credit_base = limit.requests as f64 * self.max_overadmission;
            let credit = (credit_base / c.nodes() as f64).floor() as u64;
            if l.debt < credit {
                return Ok(Admit::Credit);
            }
            queue(c.as_ref(), cell, l);
            c.hurry();
            // Waiting for a lease: the caller may wait for the round, else retry soon.
            let sub_end = (l.sub + 1).saturating_mul(sub_ns).saturating_sub(wall);
            return Err(Refused::Leasing(Standing {
                index: 0,
                remaining: 0,
                reset: Duration::from_nanos(sub_end.min(1_000_000_000)),
            }));
        }
        if l.cut_off {
            // Only this limit's part of the store failed: the next round asks it again.
            queue(c.as_ref(), cell, l);
        }
        if !c.fail_open() {
            return Err(Refused::StoreDown);
        }
        if l.share == 0 {
            // What the node admitted over the last window, and an even split of the room the
            // cluster had left when last heard of: about N cluster-wide while the traffic
            // keeps its split, at most N + the whole cluster's last window.
            let own = l.own_total();
            l.share = own
                + limit
                    .requests
                    .saturating_sub(l.counted())
                    .div_ceil(c.nodes());
        }
        if l.own_total() < l.share {
            Ok(Admit::FailOpen)
        } else {
            Err(refuse(l.oldest_leaves(sub_ns, wall)))
        }
    }

    /// Counts an admitted request and returns where the limit stands.
    pub(crate) fn commit(
        &self,
        cell: &Arc<C>,
        limit: Limit,
        l: &mut Lease,
        admit: Admit,
        index: usize,
        wall: u64,
    ) -> Standing {
        let c = &self.store;
        match admit {
            Admit::Token => l.tokens -= 1,
            Admit::Credit | Admit::FailOpen => {
                let slot = &mut l.owed[at(l.sub)];
                *slot = slot.saturating_add(1);
                l.debt += 1;
                if admit == Admit::FailOpen {
                    c.admitted_fail_open();
                }
            }
        }
        let slot = &mut l.own[at(l.sub)];
        *slot = slot.saturating_add(1);
        let sub_ns = limit.sub_ns();
        let sub_end = (l.sub + 1).saturating_mul(sub_ns).saturating_sub(wall);
        let near_end = sub_end < c.lead_ns().min(sub_ns / 2);
        if l.debt > 0 || (!l.full() && l.tokens <= l.refill_at) || (near_end && !l.next_requested) {
            queue(c.as_ref(), cell, l);
        }
        Standing {
            index,
            remaining: limit.requests.saturating_sub(l.counted()) + l.tokens,
            reset: Duration::from_nanos(l.oldest_leaves(sub_ns, wall)),
        }
    }
}

/// Queues `cell` for the store's next round, once until that round takes it.
fn queue<C>(store: &dyn SharedStore<C>, cell: &Arc<C>, l: &mut Lease) {
    if !l.queued {
        l.queued = true;
        store.enqueue(cell);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owe(l: &mut Lease, n: u32) {
        l.owed[at(l.sub)] += n;
        l.own[at(l.sub)] += n;
        l.debt += u64::from(n);
    }

    #[test]
    fn a_sub_window_that_ends_gives_its_tokens_back() {
        let mut l = Lease {
            sub: 100,
            tokens: 5,
            next_tokens: 7,
            ..Lease::default()
        };
        l.roll(101);
        assert_eq!((l.tokens, l.next_tokens), (7, 0));
        assert_eq!(l.back.as_slice(), &[(100, 5)]);
        // Skipping a sub-window gives back both what was in hand and what was leased ahead.
        l.next_tokens = 3;
        l.roll(105);
        assert_eq!(l.tokens, 0);
        assert_eq!(l.back.as_slice(), &[(100, 5), (101, 7), (102, 3)]);
        // What no longer counts is not given back: 102 counts until 112, not at 113.
        l.roll(112);
        assert_eq!(l.back.as_slice(), &[(102, 3)]);
        l.roll(113);
        assert!(l.back.is_empty(), "{:?}", l.back);
        // A clock that went back stays in the sub-window...
        l.tokens = 2;
        l.roll(103);
        assert_eq!((l.sub, l.tokens), (113, 2));
        // ...unless it went back by more than a window: the state starts over there.
        l.roll(102);
        assert_eq!((l.sub, l.tokens), (102, 0));
    }

    #[test]
    fn owed_counts_stay_while_they_count_and_are_settled_once() {
        let mut l = Lease {
            sub: 50,
            ..Lease::default()
        };
        owe(&mut l, 3);
        l.roll(52);
        owe(&mut l, 2);
        assert_eq!(l.owed().as_slice(), &[(50, 3), (52, 2)]);
        assert_eq!((l.debt, l.own_total()), (5, 5));
        l.settled(50, 3);
        assert_eq!(l.owed().as_slice(), &[(52, 2)]);
        assert_eq!(l.debt, 2);
        // Settling more than is owed, or a sub-window out of the window, changes nothing more.
        l.settled(52, 9);
        l.settled(30, 1);
        assert_eq!((l.debt, l.owed().len()), (0, 0));
        // Counts leave with their sub-window: 52 still counts at 62, not at 63.
        owe(&mut l, 4);
        l.roll(62);
        assert_eq!((l.debt, l.own_total()), (4, 6));
        l.roll(63);
        assert_eq!((l.debt, l.own_total()), (0, 0));
        assert!(l.idle());
    }
}
