//! Counters made when a consumer first calls, not for every consumer in the config, and
//! dropped once all their windows have passed: a million consumers cost their table entry
//! (16 bytes) until they call.
//!
//! [`Live`] owns every cell in use, by identity (consumer, scope, limit), across reloads:
//! a limit that did not change keeps its counts. Each snapshot has a [`Counters`] table,
//! one slot per consumer, caching that consumer's cells in the snapshot's layout so the
//! request path takes one slot lock instead of hashing names. The sweeper retires idle
//! cells; a request that meets a retired cell looks the consumer up again.

use super::persist::Saved;
use super::{DirtyQueue, LimitCell, Now};
use crate::cluster::Cluster;
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tollgate_config::{Consumers, LimitConfig};

const SHARDS: usize = 64;

type Shard = Mutex<HashMap<Arc<str>, Arc<LimitCell>, foldhash::fast::RandomState>>;

/// Every limit cell in use, by identity.
pub struct Live {
    shards: Box<[Shard]>,
    hasher: foldhash::fast::RandomState,
    next_id: AtomicU64,
    cluster: Option<Arc<Cluster>>,
    /// Counts read from the state file, applied when their cell is made.
    restored: Mutex<HashMap<Arc<str>, Saved>>,
    /// Whether `restored` may hold anything (so new cells skip its lock once it is empty).
    restoring: std::sync::atomic::AtomicBool,
    /// Where cells with unwritten counts go, when counters are kept on disk.
    dirty: Option<Arc<DirtyQueue>>,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live").field("cells", &self.len()).finish()
    }
}

/// The identity of a cell: who is counted and the limit, as the state file keys it.
/// Names never hold a tab.
pub(crate) fn cell_key(scope: &str, limit: &LimitConfig) -> String {
    let mut n = itoa::Buffer::new();
    let mut w = itoa::Buffer::new();
    let (n, w) = (n.format(limit.requests), w.format(limit.window.as_secs()));
    let mut k = String::with_capacity(scope.len() + limit.name.len() + n.len() + w.len() + 3);
    for part in [scope, "\t", &limit.name, "\t", n, "\t", w] {
        k.push_str(part);
    }
    k
}

impl Live {
    /// Cells shared through `cluster` when given; written to `dirty` when given.
    pub fn new(cluster: Option<Arc<Cluster>>, dirty: Option<Arc<DirtyQueue>>) -> Live {
        Live {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: foldhash::fast::RandomState::default(),
            next_id: AtomicU64::new(0),
            cluster,
            restored: Mutex::default(),
            restoring: Default::default(),
            dirty,
        }
    }

    /// Counts to apply to cells as they are made (from the state file).
    pub(crate) fn restore(&self, saved: HashMap<Arc<str>, Saved>) {
        self.restoring.store(!saved.is_empty(), Ordering::Release);
        *self.restored.lock() = saved;
    }

    /// The link to the cluster, if limits are shared.
    pub fn cluster(&self) -> Option<&Arc<Cluster>> {
        self.cluster.as_ref()
    }

    fn shard(&self, key: &str) -> &Shard {
        &self.shards[self.hasher.hash_one(key) as usize % SHARDS]
    }

    /// The cell counting `limit` for `scope` (`consumer:NAME` or `route:R:consumer:NAME`),
    /// made if none is in use.
    pub fn cell(&self, scope: &str, limit: &LimitConfig, now: Now) -> Arc<LimitCell> {
        let key = cell_key(scope, limit);
        let mut shard = self.shard(&key).lock();
        if let Some(c) = shard.get(key.as_str()) {
            if !c.state.lock().retired {
                return c.clone();
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let key: Arc<str> = Arc::from(key);
        let mut cell = match &self.cluster {
            Some(cluster) => LimitCell::new_shared(
                id,
                limit.requests,
                limit.window,
                cluster.limit(scope, limit),
            ),
            None => LimitCell::new(id, limit.requests, limit.window),
        };
        cell.key = key.clone();
        if cell.shared.is_none() {
            cell.dirty = self.dirty.clone();
            let saved = if self.restoring.load(Ordering::Acquire) {
                let mut r = self.restored.lock();
                let s = r.remove(&key);
                if r.is_empty() {
                    self.restoring.store(false, Ordering::Release);
                }
                s
            } else {
                None
            };
            if let Some(s) = saved {
                let slot_ns = cell.slot_ns();
                if let super::Counter::Local(w) = &mut cell.state.get_mut().counter {
                    *w = s.window_at(slot_ns, now);
                }
            }
        }
        let cell = Arc::new(cell);
        shard.insert(key, cell.clone());
        cell
    }

    /// Cells in use.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// Whether no cell is in use.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Retires every cell whose windows have all passed. Returns how many.
    pub fn sweep(&self, now: Now) -> usize {
        let mut retired = 0;
        for s in self.shards.iter() {
            let mut shard = s.lock();
            shard.retain(|_, c| {
                let keep = !c.idle(now, true);
                retired += usize::from(!keep);
                keep
            });
            // A burst of consumers leaves a large table behind: give it back.
            if shard.capacity() > 64 && shard.len() * 4 < shard.capacity() {
                shard.shrink_to_fit();
            }
        }
        retired
    }
}

/// The limits a consumer on one plan may be counted in, in the order of its cells: the
/// plan's, then each route's own.
#[derive(Debug, Default)]
pub struct Layout {
    /// Each limit, and the route it belongs to (`None`: the plan's, shared by every route).
    pub limits: Vec<(LimitConfig, Option<Arc<str>>)>,
}

/// A consumer's cells, in its plan's [`Layout`] order.
pub type Group = SmallVec<[Arc<LimitCell>; 2]>;

/// One snapshot's cache of each consumer's cells.
pub struct Counters {
    slots: Box<[Mutex<Option<Arc<Group>>>]>,
    /// By plan slot: plan index, or `plans.len()` for consumers without a plan.
    layouts: Vec<Layout>,
    consumers: Arc<Consumers>,
    live: Arc<Live>,
}

impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Counters")
            .field("slots", &self.slots.len())
            .finish_non_exhaustive()
    }
}

impl Counters {
    /// An empty table for `consumers`, their cells laid out by `layouts` (one per plan,
    /// then one for no plan).
    pub fn new(consumers: Arc<Consumers>, layouts: Vec<Layout>, live: Arc<Live>) -> Counters {
        Counters {
            slots: (0..consumers.len()).map(|_| Mutex::new(None)).collect(),
            layouts,
            consumers,
            live,
        }
    }

    /// The layout slot of consumer `i`: its plan, or the last for none.
    pub fn plan_slot(&self, i: usize) -> usize {
        self.consumers
            .plan(i)
            .unwrap_or(self.layouts.len().saturating_sub(1))
    }

    /// Consumer `i`'s cells, made (or found in use since an earlier config) on first call.
    pub fn group(&self, i: usize, now: Now) -> Arc<Group> {
        let mut slot = self.slots[i].lock();
        if let Some(g) = &*slot {
            return g.clone();
        }
        let name = self.consumers.name(i);
        let layout = &self.layouts[self.plan_slot(i)];
        let mut plan_scope = String::with_capacity(9 + name.len());
        plan_scope.push_str("consumer:");
        plan_scope.push_str(name);
        let group: Group = layout
            .limits
            .iter()
            .map(|(limit, route)| match route {
                None => self.live.cell(&plan_scope, limit, now),
                Some(r) => self
                    .live
                    .cell(&format!("route:{r}:consumer:{name}"), limit, now),
            })
            .collect();
        let g = Arc::new(group);
        *slot = Some(g.clone());
        g
    }

    /// Drops consumer `i`'s cached cells if they are still `seen` (one was retired).
    pub fn forget(&self, i: usize, seen: &Arc<Group>) {
        let mut slot = self.slots[i].lock();
        if slot.as_ref().is_some_and(|g| Arc::ptr_eq(g, seen)) {
            *slot = None;
        }
    }

    /// Clears the slots whose cells were retired, so their memory goes. Returns how many.
    pub fn sweep(&self) -> usize {
        let mut cleared = 0;
        for s in self.slots.iter() {
            let mut slot = s.lock();
            let retired = slot
                .as_ref()
                .is_some_and(|g| g.iter().any(|c| c.state.lock().retired));
            if retired {
                *slot = None;
                cleared += 1;
            }
        }
        cleared
    }

    /// Consumers with cells, and their cells, up to `max`.
    pub fn active(&self, max: usize) -> Vec<(usize, Arc<Group>)> {
        let mut out = Vec::new();
        for (i, s) in self.slots.iter().enumerate() {
            if out.len() >= max {
                break;
            }
            if let Some(g) = &*s.lock() {
                out.push((i, g.clone()));
            }
        }
        out
    }
}
