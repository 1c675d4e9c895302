//! Limits shared among nodes, as the request path counts them: a node admits from tokens
//! it leased beforehand ([`Lease`]), on credit, or within its last share while the store is
//! down. What the shared store must do is [`SharedStore`]; the cluster link implements it.

use super::verdict::{Refused, Standing};
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

/// What a store that shares limits among nodes must do for the request path.
pub trait SharedStore<C>: Send + Sync + std::fmt::Debug {
    /// Whether the last exchange with the store succeeded.
    fn is_up(&self) -> bool;
    /// Live nodes sharing the limits (at least 1).
    fn nodes(&self) -> u64;
    /// Whether a node admits within its last share while the store is down (else 503).
    fn fail_open(&self) -> bool;
    /// How long before a window's end a busy limit leases for the next window.
    fn lead_ns(&self) -> u64;
    /// Queues `cell` for the next round with the store.
    fn enqueue(&self, cell: &Arc<C>);
    /// Counts a request admitted while the store was down.
    fn admitted_fail_open(&self);
    /// The counting handle for one limit of one scope (consumer, or route+consumer).
    fn shared_limit(self: Arc<Self>, scope: &str, limit: &LimitConfig) -> SharedLimit<C>;
}

/// How one shared limit is keyed and how much credit it allows.
#[derive(Debug)]
pub struct SharedLimit<C> {
    store: Arc<dyn SharedStore<C>>,
    /// Redis key without the window index.
    key: String,
    /// N × max_overadmission, split among the nodes at check time.
    credit_base: f64,
}

/// A node's state for one shared limit in the current window.
#[derive(Debug, Default)]
pub struct Lease {
    pub(crate) window: u64,
    /// Leased for `window`, not used yet.
    pub(crate) tokens: u64,
    /// Leased for `window + 1`.
    pub(crate) next_tokens: u64,
    pub(crate) next_requested: bool,
    /// Admitted without a token (credit, or while Redis was down), to settle.
    pub(crate) debt: u64,
    /// Admitted on this node in this window.
    pub(crate) used: u64,
    /// Admitted on this node in the previous window: its share when Redis is down.
    pub(crate) last_used: u64,
    /// Requests seen since the last lease was asked for (the rate estimate).
    pub(crate) demand: u64,
    pub(crate) last_lease: Option<Instant>,
    /// Granted cluster-wide in this window, as of the last answer from Redis.
    pub(crate) granted: u64,
    /// Ask for more when tokens fall to this.
    pub(crate) refill_at: u64,
    pub(crate) queued: bool,
}

impl Lease {
    /// Moves to `window` if the clock has left the current one.
    pub(crate) fn roll(&mut self, window: u64) {
        if window == self.window {
            return;
        }
        let next = window == self.window + 1;
        self.last_used = if next { self.used } else { 0 };
        self.tokens = if next { self.next_tokens } else { 0 };
        self.granted = 0;
        self.next_tokens = 0;
        self.next_requested = false;
        self.debt = 0;
        self.used = 0;
        self.refill_at = 0;
        self.window = window;
    }

    /// Requests counted in this window: cluster-wide as last known, at least this node's.
    pub(crate) fn counted(&self) -> u64 {
        self.granted.max(self.used)
    }

    /// Whether nothing is counted or owed in this window and no lease is in flight: the
    /// state can go (tokens in hand are given up, which only under-admits).
    pub(crate) fn idle(&self) -> bool {
        self.used == 0 && self.debt == 0 && self.last_used == 0 && !self.queued
    }

    /// Whether Redis has said this window of a limit of `n` is used up.
    pub(crate) fn exhausted(&self, n: u64) -> bool {
        self.granted >= n
    }
}

/// How a request was admitted by a shared limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// With a leased token.
    Token,
    /// On credit, to be paid from the next lease.
    Credit,
    /// Within the node's last share while Redis is unreachable.
    FailOpen,
}

impl<C> SharedLimit<C> {
    /// A handle counting one limit in `store` under `key` (without the window index),
    /// allowing `credit_base` (N × max_overadmission) of credit among the nodes.
    pub fn new(store: Arc<dyn SharedStore<C>>, key: String, credit_base: f64) -> Self {
        SharedLimit {
            store,
            key,
            credit_base,
        }
    }

    /// The Redis key counting `window` (index of the window since the Unix epoch).
    pub fn key_for(&self, window: u64) -> String {
        format!("{}:{window}", self.key)
    }

    fn window_end_ns(window_ns: u64, window: u64, wall: u64) -> u64 {
        (window + 1).saturating_mul(window_ns).saturating_sub(wall)
    }

    /// Decides whether a request fits, without counting it. Never waits on Redis.
    pub(crate) fn room(
        &self,
        cell: &Arc<C>,
        Limit {
            requests,
            window_ns,
        }: Limit,
        l: &mut Lease,
        wall: u64,
    ) -> Result<Admit, Refused> {
        let c = &self.store;
        let window = wall / window_ns.max(1);
        l.roll(window);
        l.demand += 1;
        let refuse = |l: &Lease, soon: bool| {
            let end = Self::window_end_ns(window_ns, l.window, wall);
            // Still waiting for a lease: retry soon; used up: at the window's end.
            let reset = if soon { end.min(1_000_000_000) } else { end };
            Refused::Limit(Standing {
                index: 0,
                remaining: 0,
                reset: Duration::from_nanos(reset),
            })
        };
        if l.tokens > 0 {
            return Ok(Admit::Token);
        }
        if c.is_up() {
            let exhausted = l.exhausted(requests);
            let credit = if exhausted {
                0
            } else {
                (self.credit_base / c.nodes() as f64).floor() as u64
            };
            if l.debt < credit {
                return Ok(Admit::Credit);
            }
            if !exhausted {
                queue(c.as_ref(), cell, l);
            }
            return Err(refuse(l, !exhausted));
        }
        match c.fail_open() {
            false => Err(Refused::StoreDown),
            true => {
                let share = if l.last_used > 0 {
                    l.last_used
                } else {
                    requests.div_ceil(c.nodes())
                };
                if l.used < share {
                    Ok(Admit::FailOpen)
                } else {
                    Err(refuse(l, false))
                }
            }
        }
    }

    /// Counts an admitted request and returns where the limit stands.
    pub(crate) fn commit(
        &self,
        cell: &Arc<C>,
        Limit {
            requests,
            window_ns,
        }: Limit,
        l: &mut Lease,
        admit: Admit,
        index: usize,
        wall: u64,
    ) -> Standing {
        let c = &self.store;
        match admit {
            Admit::Token => l.tokens -= 1,
            Admit::Credit => l.debt += 1,
            Admit::FailOpen => {
                l.debt += 1;
                c.admitted_fail_open();
            }
        }
        l.used += 1;
        let end = Self::window_end_ns(window_ns, l.window, wall);
        let near_end = end < c.lead_ns();
        if l.debt > 0
            || (!l.exhausted(requests) && l.tokens <= l.refill_at)
            || (near_end && !l.next_requested)
        {
            queue(c.as_ref(), cell, l);
        }
        Standing {
            index,
            remaining: requests.saturating_sub(l.granted.max(l.used)) + l.tokens,
            reset: Duration::from_nanos(end),
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
