//! Every limit cell in use, by identity (consumer, scope, limit), across reloads: a limit
//! that did not change keeps its counts. Tables ([`super::table::Counters`]) find their
//! consumers' cells here; the sweeper retires idle ones.

use super::persist::Saved;
use super::shared::SharedStore;
use super::{DirtyQueue, LimitCell, Now};
use hashbrown::HashTable;
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use tollgate_config::LimitConfig;

const SHARDS: usize = 64;

/// Cells by the hash of their key (a table of pointers: the key is the cell's own).
type Shard = Mutex<HashTable<Arc<LimitCell>>>;

/// Every limit cell in use, by identity.
pub struct Live {
    shards: Box<[Shard]>,
    hasher: foldhash::fast::RandomState,
    next_id: AtomicU64,
    cluster: Option<Arc<dyn SharedStore<LimitCell>>>,
    /// Counts read from the state file, applied when their cell is made.
    restored: Mutex<HashMap<Arc<str>, Saved>>,
    /// Whether `restored` may hold anything (so new cells skip its lock once it is empty).
    restoring: std::sync::atomic::AtomicBool,
    /// Where cells with unwritten counts go, when counters are kept on disk.
    dirty: Option<Arc<DirtyQueue>>,
    /// [`Counters`] tables in existence: counts stay in slots (see [`light`]) only while
    /// there is one, so no other table can make a cell for a consumer a slot counts.
    pub(super) tables: AtomicUsize,
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
    /// `consumer:NAME` or `route:R:consumer:NAME`, as the state file names it. A route's
    /// `:` is written `%3A`, so that route `a:consumer:b` with consumer `c` and route `a`
    /// with consumer `b:consumer:c` are two cells, not one: the route ends at the first
    /// `:consumer:`. (State files from before kept the `:`; [`Live::restore`] reads them.)
    fn write(&self, out: &mut impl Extend<u8>) {
        if let Some(r) = self.route {
            out.extend(*b"route:");
            for b in r.bytes() {
                match b {
                    b':' => out.extend(*b"%3A"),
                    b => out.extend([b]),
                }
            }
            out.extend(*b":");
        }
        out.extend(*b"consumer:");
        out.extend(self.consumer.bytes());
    }
}

/// `route:a:b:consumer:c…` (a key from before routes' colons were escaped) as today's
/// `route:a%3Ab:consumer:c…`; `None` for a key that needs nothing (the route ends at the
/// first `:consumer:`, as a key of either kind reads).
pub(super) fn escaped_route(key: &str) -> Option<String> {
    let rest = key.strip_prefix("route:")?;
    let end = rest.find(":consumer:")?;
    let route = &rest[..end];
    route
        .contains(':')
        .then(|| format!("route:{}{}", route.replace(':', "%3A"), &rest[end..]))
}

/// The key `limit` had for `scope` before the number of requests left a cell's identity:
/// `scope\tNAME\tN\tW`, its name as shown and its number of requests (a state file of an
/// earlier build keeps its counts when the limit did not change meanwhile).
pub(super) fn legacy_key(scope: Scope<'_>, limit: &LimitConfig) -> String {
    let mut k = KeyBuf::new();
    scope.write(&mut k);
    let scope = String::from_utf8_lossy(&k);
    format!(
        "{scope}\t{}\t{}\t{}",
        limit.name,
        limit.requests,
        limit.window.as_secs()
    )
}

/// A cell's identity, built on the stack: most fit, and a lookup that finds the cell
/// allocates nothing.
type KeyBuf = SmallVec<[u8; 96]>;

/// The identity of a cell: who is counted and the limit (its name and window, not its
/// number of requests: a reload that changes only that keeps the counts, as Kong's
/// counters do), as the state file keys it. Names never hold a tab.
pub(super) fn cell_key(scope: Scope<'_>, limit: &LimitConfig) -> KeyBuf {
    let mut w = itoa::Buffer::new();
    let mut k = KeyBuf::new();
    scope.write(&mut k);
    for part in [
        "\t",
        &limit.counted_as,
        "\t",
        w.format(limit.window.as_secs()),
    ] {
        k.extend_from_slice(part.as_bytes());
    }
    k
}

impl Live {
    /// Cells shared through `cluster` when given; written to `dirty` when given.
    pub fn new(
        cluster: Option<Arc<dyn SharedStore<LimitCell>>>,
        dirty: Option<Arc<DirtyQueue>>,
    ) -> Live {
        Live {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: foldhash::fast::RandomState::default(),
            next_id: AtomicU64::new(0),
            cluster,
            restored: Mutex::default(),
            restoring: Default::default(),
            dirty,
            tables: AtomicUsize::new(0),
        }
    }

    /// Whether counts may be kept in table slots now: one table, limits on this node
    /// alone, and no state file to write them to.
    pub(super) fn light_ok(&self) -> bool {
        self.cluster.is_none() && self.dirty.is_none() && self.tables.load(Ordering::Acquire) == 1
    }

    /// The cell in use counting `limit` for `scope`, if there is one.
    pub(super) fn find(&self, scope: Scope<'_>, limit: &LimitConfig) -> Option<Arc<LimitCell>> {
        let key = cell_key(scope, limit);
        let h = self.hash(&key);
        let shard = self.shard(h).lock();
        shard
            .find(h, |c| c.key.as_bytes() == key.as_slice())
            .filter(|c| !c.state.lock().retired)
            .cloned()
    }

    /// Counts to apply to cells as they are made (from the state file). A key written
    /// before routes' colons were escaped is read as today's; one written with the
    /// limit's number of requests is found when its cell is made ([`legacy_key`]).
    pub(crate) fn restore(&self, saved: HashMap<Arc<str>, Saved>) {
        let saved: HashMap<Arc<str>, Saved> = saved
            .into_iter()
            .map(|(k, v)| (escaped_route(&k).map_or(k, Arc::from), v))
            .collect();
        self.restoring.store(!saved.is_empty(), Ordering::Release);
        *self.restored.lock() = saved;
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
        let cell = Arc::new(self.make(scope, limit, &key, now));
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
    fn make(&self, scope: Scope<'_>, limit: &LimitConfig, key: &[u8], now: Now) -> LimitCell {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        // Every part is a `str`, so the key is one.
        let key: Arc<str> = Arc::from(String::from_utf8_lossy(key));
        let Some(cluster) = &self.cluster else {
            let mut cell = LimitCell::new(id, limit.requests, limit.window, key);
            cell.dirty = self.dirty.clone();
            if let Some(s) = self.take_restored(&cell.key, || legacy_key(scope, limit)) {
                let slot_ns = cell.slot_ns();
                if let super::Counter::Local(w) = &mut cell.state.get_mut().counter {
                    *w = s.window_at(slot_ns, now);
                }
            }
            return cell;
        };
        let shared = cluster
            .clone()
            .shared_limit(scope.route, scope.consumer, limit);
        LimitCell::new_shared(id, limit.requests, limit.window, shared, key)
    }

    /// The counts the state file had for `key`, if any are still waiting, else those it
    /// had under the cell's key of an earlier build (`legacy`); either way both are taken,
    /// so the older can never be applied later.
    fn take_restored(&self, key: &Arc<str>, legacy: impl FnOnce() -> String) -> Option<Saved> {
        if !self.restoring.load(Ordering::Acquire) {
            return None;
        }
        let mut r = self.restored.lock();
        let old = r.remove(legacy().as_str());
        let s = r.remove(key).or(old);
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
