//! Counters made when a consumer first calls, not for every consumer in the config, and
//! dropped once all their windows have passed: a million consumers cost their table entry
//! (40 bytes: a lock and room for two cells' pointers) until they call.
//!
//! [`Live`] owns every cell in use, by identity (consumer, scope, limit), across reloads:
//! a limit that did not change keeps its counts. Each snapshot has a [`Counters`] table,
//! one slot per consumer, holding that consumer's cells in the snapshot's layout so the
//! request path takes one slot lock instead of hashing names. The sweeper retires idle
//! cells; a request that meets a retired cell looks the consumer up again.

use super::persist::Saved;
use super::{DirtyQueue, LimitCell, Now};
use crate::cluster::Cluster;
use hashbrown::HashTable;
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tollgate_config::{Consumers, LimitConfig};

const SHARDS: usize = 64;

/// Cells by the hash of their key (a table of pointers: the key is the cell's own).
type Shard = Mutex<HashTable<Arc<LimitCell>>>;

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

/// Who a cell counts: a consumer across its plan's routes, or on one route only.
#[derive(Debug, Clone, Copy)]
pub struct Scope<'a> {
    /// The route whose own limit this is (`None`: a plan's limit).
    pub route: Option<&'a str>,
    /// The consumer's name.
    pub consumer: &'a str,
}

impl Scope<'_> {
    /// `consumer:NAME` or `route:R:consumer:NAME`, as the state file and Redis name it.
    fn write(&self, out: &mut impl Extend<u8>) {
        if let Some(r) = self.route {
            out.extend(*b"route:");
            out.extend(r.bytes());
            out.extend(*b":");
        }
        out.extend(*b"consumer:");
        out.extend(self.consumer.bytes());
    }
}

/// A cell's identity, built on the stack: most fit, and a lookup that finds the cell
/// allocates nothing.
type KeyBuf = SmallVec<[u8; 96]>;

/// The identity of a cell: who is counted and the limit, as the state file keys it.
/// Names never hold a tab.
fn cell_key(scope: Scope<'_>, limit: &LimitConfig) -> KeyBuf {
    let mut n = itoa::Buffer::new();
    let mut w = itoa::Buffer::new();
    let mut k = KeyBuf::new();
    scope.write(&mut k);
    for part in [
        "\t",
        &limit.name,
        "\t",
        n.format(limit.requests),
        "\t",
        w.format(limit.window.as_secs()),
    ] {
        k.extend_from_slice(part.as_bytes());
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

    fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The shard of a key's hash: bits that neither the table's buckets (low bits) nor its
    /// tags (top seven) use.
    fn shard(&self, h: u64) -> &Shard {
        &self.shards[(h >> 32) as usize % SHARDS]
    }

    /// The cell counting `limit` for `scope`, made if none is in use.
    pub fn cell(&self, scope: Scope<'_>, limit: &LimitConfig, now: Now) -> Arc<LimitCell> {
        let key = cell_key(scope, limit);
        let h = self.hash(&key);
        let mut shard = self.shard(h).lock();
        let found = shard.find_entry(h, |c| c.key.as_bytes() == key.as_slice());
        if let Ok(e) = &found {
            if !e.get().state.lock().retired {
                return e.get().clone();
            }
        }
        let cell = Arc::new(self.make(limit, &key, now));
        match found {
            Ok(mut e) => *e.get_mut() = cell.clone(),
            Err(absent) => {
                absent
                    .into_table()
                    .insert_unique(h, cell.clone(), |c| self.hash(c.key.as_bytes()));
            }
        }
        cell
    }

    /// A new cell for `limit` known as `key`, with its restored counts if the state file had
    /// them.
    fn make(&self, limit: &LimitConfig, key: &[u8], now: Now) -> LimitCell {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        // Every part is a `str`, so the key is one.
        let key: Arc<str> = Arc::from(String::from_utf8_lossy(key));
        let Some(cluster) = &self.cluster else {
            let mut cell = LimitCell::new(id, limit.requests, limit.window, key);
            cell.dirty = self.dirty.clone();
            if let Some(s) = self.take_restored(&cell.key) {
                let slot_ns = cell.slot_ns();
                if let super::Counter::Local(w) = &mut cell.state.get_mut().counter {
                    *w = s.window_at(slot_ns, now);
                }
            }
            return cell;
        };
        // The scope is the key up to its first tab (names never hold one).
        let scope_name = key.split('\t').next().unwrap_or_default();
        let shared = cluster.limit(scope_name, limit);
        LimitCell::new_shared(id, limit.requests, limit.window, shared, key)
    }

    /// The counts the state file had for `key`, if any are still waiting.
    fn take_restored(&self, key: &Arc<str>) -> Option<Saved> {
        if !self.restoring.load(Ordering::Acquire) {
            return None;
        }
        let mut r = self.restored.lock();
        let s = r.remove(key);
        if r.is_empty() {
            self.restoring.store(false, Ordering::Release);
        }
        s
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
            shard.retain(|c| {
                let keep = !c.idle(now, true);
                retired += usize::from(!keep);
                keep
            });
            // A burst of consumers leaves a large table behind: give it back.
            if shard.capacity() > 64 && shard.len() * 4 < shard.capacity() {
                shard.shrink_to_fit(|c| self.hash(c.key.as_bytes()));
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
    /// Each consumer's cells, held in its slot (empty until its first call): a request goes
    /// from the slot straight to the cells, one cache miss fewer than through a pointer.
    slots: Box<[Mutex<Group>]>,
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
            slots: (0..consumers.len())
                .map(|_| Mutex::new(Group::new()))
                .collect(),
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

    /// Runs `f` on consumer `i`'s cells, made (or found in use since an earlier config) on
    /// first call, under the consumer's slot lock. `f` may clear them (one was retired):
    /// the next call makes them again.
    pub fn with_group<R>(&self, i: usize, now: Now, f: impl FnOnce(&mut Group) -> R) -> R {
        let mut slot = self.slots[i].lock();
        if slot.is_empty() {
            let consumer = self.consumers.name(i);
            let layout = &self.layouts[self.plan_slot(i)];
            slot.extend(layout.limits.iter().map(|(limit, route)| {
                let route = route.as_deref();
                self.live.cell(Scope { route, consumer }, limit, now)
            }));
        }
        f(&mut slot)
    }

    /// Consumer `i`'s cells, made on first call (see [`Counters::with_group`]).
    pub fn group(&self, i: usize, now: Now) -> Group {
        self.with_group(i, now, |g| g.clone())
    }

    /// Clears the slots whose cells were retired, so their memory goes. Returns how many.
    pub fn sweep(&self) -> usize {
        let mut cleared = 0;
        for s in self.slots.iter() {
            let mut slot = s.lock();
            if slot.iter().any(|c| c.state.lock().retired) {
                *slot = Group::new();
                cleared += 1;
            }
        }
        cleared
    }

    /// Consumers with cells, and their cells, up to `max`.
    pub fn active(&self, max: usize) -> Vec<(usize, Group)> {
        let mut out = Vec::new();
        for (i, s) in self.slots.iter().enumerate() {
            if out.len() >= max {
                break;
            }
            let g = s.lock();
            if !g.is_empty() {
                out.push((i, g.clone()));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn limit() -> LimitConfig {
        LimitConfig {
            name: "per-minute".into(),
            requests: 60,
            window: Duration::from_secs(60),
        }
    }

    #[test]
    fn cell_keys_keep_the_state_files_format() {
        let plan = Scope {
            route: None,
            consumer: "acme",
        };
        let route = Scope {
            route: Some("orders"),
            consumer: "acme",
        };
        assert_eq!(
            cell_key(plan, &limit()).as_slice(),
            b"consumer:acme\tper-minute\t60\t60"
        );
        assert_eq!(
            cell_key(route, &limit()).as_slice(),
            b"route:orders:consumer:acme\tper-minute\t60\t60"
        );
    }

    #[test]
    fn one_identity_is_one_cell_until_it_is_retired() {
        let live = Live::new(None, None);
        let now = Now { mono: 1, wall: 1 };
        let who = |consumer| Scope {
            route: None,
            consumer,
        };
        let a = live.cell(who("a"), &limit(), now);
        assert!(Arc::ptr_eq(&a, &live.cell(who("a"), &limit(), now)));
        let b = live.cell(who("b"), &limit(), now);
        assert!(!Arc::ptr_eq(&a, &b));
        assert_eq!(&*a.key, "consumer:a\tper-minute\t60\t60");
        assert_eq!(live.len(), 2);
        a.state.lock().retired = true;
        let again = live.cell(who("a"), &limit(), now);
        assert!(!Arc::ptr_eq(&a, &again), "a retired cell is replaced");
        assert_eq!(live.len(), 2);
    }

    #[test]
    fn a_cleared_slot_is_filled_again_with_fresh_cells() {
        let mut consumers = Consumers::default();
        assert_eq!(consumers.push("a", Some(0), &["k"], &[]), Ok(0));
        let layouts = vec![
            Layout {
                limits: vec![(limit(), None)],
            },
            Layout::default(),
        ];
        let live = Arc::new(Live::new(None, None));
        let counters = Counters::new(Arc::new(consumers), layouts, live.clone());
        let now = Now { mono: 1, wall: 1 };
        assert!(counters.active(10).is_empty(), "nothing made before a call");
        let first = counters.with_group(0, now, |g| g[0].clone());
        assert_eq!(&*first.key, "consumer:a\tper-minute\t60\t60");
        assert!(Arc::ptr_eq(&first, &counters.group(0, now)[0]));
        first.state.lock().retired = true;
        counters.with_group(0, now, |g| g.clear());
        let again = counters.with_group(0, now, |g| g[0].clone());
        assert!(!Arc::ptr_eq(&first, &again));
        assert_eq!(counters.active(10).len(), 1);
        again.state.lock().retired = true;
        assert_eq!(counters.sweep(), 1);
        assert!(counters.active(10).is_empty());
    }
}
