//! Each consumer's counters, kept in its slot of the snapshot's table while they are light
//! (see [`light`]) and in cells otherwise: a million consumers cost their line (64 bytes:
//! a lock, room for two limits' counts or two cells' pointers, the plan and a short name),
//! whether they call or not.
//!
//! [`Live`] owns every cell in use, by identity (consumer, scope, limit), across reloads:
//! a limit that did not change keeps its counts. Each snapshot has a [`Counters`] table,
//! one slot per consumer, so the request path takes one slot lock instead of hashing
//! names. Counts stay in slots only while one table exists (and limits are neither shared
//! nor written to a state file): before a new table serves, the old one moves its counts
//! to cells ([`Counters::settle_all`]), and the new one looks a consumer's cells up on its
//! first call. The sweeper retires idle cells; a request that meets a retired cell looks
//! the consumer up again.

use super::light::{self, Checked, Lights};
use super::persist::Saved;
use super::shared::SharedStore;
use super::{Counter, DirtyQueue, LimitCell, Now, Refused, Standing, Window};
use hashbrown::HashTable;
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use tollgate_config::huge::huge_vec;
use tollgate_config::{Consumers, LimitConfig};

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
    tables: AtomicUsize,
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
    fn light_ok(&self) -> bool {
        self.cluster.is_none() && self.dirty.is_none() && self.tables.load(Ordering::Acquire) == 1
    }

    /// The cell in use counting `limit` for `scope`, if there is one.
    fn find(&self, scope: Scope<'_>, limit: &LimitConfig) -> Option<Arc<LimitCell>> {
        let key = cell_key(scope, limit);
        let h = self.hash(&key);
        let shard = self.shard(h).lock();
        shard
            .find(h, |c| c.key.as_bytes() == key.as_slice())
            .filter(|c| !c.state.lock().retired)
            .cloned()
    }

    /// Counts to apply to cells as they are made (from the state file).
    pub(crate) fn restore(&self, saved: HashMap<Arc<str>, Saved>) {
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
        let shared = cluster.clone().shared_limit(scope_name, limit);
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

/// What a table knows of one consumer's counts.
#[derive(Debug, Default)]
enum Slot {
    /// Not looked at since the table was made (or its cells were retired): cells may be
    /// in use from an earlier config.
    #[default]
    Unknown,
    /// Counts held here, no cell (see [`light`]).
    Light(Lights),
    /// The consumer's cells.
    Cells(Group),
}

/// Longest name a [`Line`] holds; longer ones are read from the consumers table.
const SHORT: usize = 19;

/// `Line::name_len` of a name too long to be held in the line.
const LONG: u8 = u8::MAX;

/// What a request needs of consumer `i`, in one cache line: with a million consumers each
/// of these is a cache miss (and a TLB miss), so a cold consumer's name, plan and counts
/// come from the same line instead of three arrays.
#[repr(C, align(64))]
struct Line {
    /// Counts held here, or the consumer's cells.
    slot: Mutex<Slot>,
    /// The consumer's layout slot: its plan, or the last for none.
    plan: u32,
    /// Length of `name`, or [`LONG`].
    name_len: u8,
    name: [u8; SHORT],
}

const _: () = assert!(
    std::mem::size_of::<Line>() == 64,
    "a line is one cache line"
);

impl Line {
    fn new(name: &str, plan: usize) -> Line {
        let mut line = Line {
            slot: Mutex::new(Slot::Unknown),
            plan: u32::try_from(plan).unwrap_or(u32::MAX),
            name_len: LONG,
            name: [0; SHORT],
        };
        if let Some(to) = line.name.get_mut(..name.len()) {
            to.copy_from_slice(name.as_bytes());
            line.name_len = name.len() as u8;
        }
        line
    }

    /// The name, when it is short enough to be held here.
    fn short_name(&self) -> Option<&str> {
        let held = self.name.get(..usize::from(self.name_len))?;
        std::str::from_utf8(held).ok()
    }
}

/// One snapshot's cache of each consumer's counters.
pub struct Counters {
    /// Each consumer's line: a request goes from it straight to the counts, one cache miss
    /// fewer than through a pointer, and finds the name and plan there too.
    lines: Box<[Line]>,
    /// By plan slot: plan index, or `plans.len()` for consumers without a plan.
    layouts: Vec<Layout>,
    /// By plan slot: whether its limits may be counted in the slot ([`light::fits`]).
    light: Vec<bool>,
    /// Made when no other table and no cell existed: a slot not yet looked at has no cell.
    fresh: bool,
    /// Consumers whose slot was given cells (repeats allowed): the sweep visits these
    /// rather than every slot.
    holding: Mutex<Vec<usize>>,
    consumers: Arc<Consumers>,
    live: Arc<Live>,
}

impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Counters")
            .field("lines", &self.lines.len())
            .finish_non_exhaustive()
    }
}

impl Drop for Counters {
    fn drop(&mut self) {
        self.live.tables.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Counters {
    /// An empty table for `consumers`, their cells laid out by `layouts` (one per plan,
    /// then one for no plan).
    ///
    /// While an older table exists, no slot of either keeps counts of its own. Before
    /// this table serves, [`Counters::settle_all`] must be called on the one it replaces.
    pub fn new(consumers: Arc<Consumers>, layouts: Vec<Layout>, live: Arc<Live>) -> Counters {
        let others = live.tables.fetch_add(1, Ordering::AcqRel);
        let fresh = others == 0 && live.is_empty();
        let none = layouts.len().saturating_sub(1);
        Counters {
            // In huge pages where the kernel offers them: a cold consumer's line then costs
            // a cache miss without a page walk (`tollgate_config::huge`).
            lines: huge_vec(consumers.len(), |i| {
                Line::new(consumers.name(i), consumers.plan(i).unwrap_or(none))
            })
            .into_boxed_slice(),
            light: layouts.iter().map(|l| light::fits(&l.limits)).collect(),
            layouts,
            fresh,
            holding: Mutex::default(),
            consumers,
            live,
        }
    }

    /// The layout slot of consumer `i`: its plan, or the last for none.
    pub fn plan_slot(&self, i: usize) -> usize {
        self.lines[i].plan as usize
    }

    /// Consumer `i`'s plan: an index into the config's plans.
    pub fn plan(&self, i: usize) -> Option<usize> {
        Some(self.plan_slot(i)).filter(|&p| p + 1 < self.layouts.len())
    }

    /// Consumer `i`'s name, from its line when short (no other memory read).
    pub fn name(&self, i: usize) -> &str {
        match self.lines[i].short_name() {
            Some(name) => name,
            None => self.consumers.name(i),
        }
    }

    /// Checks consumer `i`'s limits at `positions` of its layout and, if all have room,
    /// counts the request in each ([`super::check`]). A standing's `index` is its place in
    /// `positions`.
    pub fn check(
        &self,
        i: usize,
        positions: &[usize],
        now: Now,
    ) -> Result<Option<Standing>, Refused> {
        let ls = self.plan_slot(i);
        let layout = &self.layouts[ls];
        // A cell retired by the sweeper before this request reached it is dropped from
        // the slot and looked up again: the sweeper retires only idle cells, so a second
        // try finds fresh ones.
        for _ in 0..4 {
            let mut slot = self.lines[i].slot.lock();
            // Under the slot lock, so that `settle_all` sees any count kept here.
            let light = self.light[ls] && self.live.light_ok();
            if light && matches!(*slot, Slot::Unknown) {
                *slot = self.look_up(i, layout, now);
            }
            match &mut *slot {
                Slot::Light(lights) if light => {
                    return match light::check(lights, &layout.limits, positions, now.mono) {
                        Checked::Kept(checked) => checked,
                        Checked::Grown(checked, windows) => {
                            *slot = Slot::Cells(self.cells_with(i, layout, &windows, now));
                            checked
                        }
                    };
                }
                Slot::Light(lights) => {
                    let windows = light::windows(lights, layout.limits.len());
                    *slot = Slot::Cells(self.cells_with(i, layout, &windows, now));
                }
                Slot::Unknown => *slot = Slot::Cells(self.cells_with(i, layout, &[], now)),
                Slot::Cells(_) => {}
            }
            let Slot::Cells(group) = &*slot else {
                continue;
            };
            match check_cells(group, positions, now) {
                Err(Refused::Retired) => *slot = Slot::Unknown,
                checked => return checked,
            }
        }
        Err(Refused::Retired)
    }

    /// An unknown slot's state when counts may be kept in it: the consumer's cells if any
    /// are in use, else empty counts.
    fn look_up(&self, i: usize, layout: &Layout, now: Now) -> Slot {
        if !self.fresh {
            let consumer = self.name(i);
            let any = layout.limits.iter().any(|(limit, route)| {
                let route = route.as_deref();
                self.live.find(Scope { route, consumer }, limit).is_some()
            });
            if any {
                return Slot::Cells(self.cells_with(i, layout, &[], now));
            }
        }
        Slot::Light(Lights::default())
    }

    /// Consumer `i`'s cells, found in use or made, with `windows` (in layout order; none
    /// for a plain lookup) added to their counts.
    fn cells_with(&self, i: usize, layout: &Layout, windows: &[Window], now: Now) -> Group {
        self.holding.lock().push(i);
        let consumer = self.name(i);
        let mut group = Group::new();
        for (k, (limit, route)) in layout.limits.iter().enumerate() {
            let scope = Scope {
                route: route.as_deref(),
                consumer,
            };
            let mut cell = self.live.cell(scope, limit, now);
            if let Some(w) = windows.get(k).filter(|w| w.total > 0) {
                // A cell retired between its lookup and here is replaced by the next
                // lookup: counts are never added to a retired one.
                for _ in 0..4 {
                    let mut state = cell.state.lock();
                    if !state.retired {
                        if let Counter::Local(mine) = &mut state.counter {
                            mine.merge(w);
                        }
                        break;
                    }
                    drop(state);
                    cell = self.live.cell(scope, limit, now);
                }
            }
            group.push(cell);
        }
        group
    }

    /// Consumer `i`'s cells, made if it has none: counts kept in its slot move to them.
    fn with_cells<R>(&self, i: usize, now: Now, f: impl FnOnce(&Group) -> R) -> R {
        let layout = &self.layouts[self.plan_slot(i)];
        let mut slot = self.lines[i].slot.lock();
        let windows = match &*slot {
            Slot::Cells(g) if !g.iter().any(|c| c.state.lock().retired) => return f(g),
            Slot::Light(lights) => light::windows(lights, layout.limits.len()),
            _ => Vec::new(),
        };
        let group = self.cells_with(i, layout, &windows, now);
        let out = f(&group);
        *slot = Slot::Cells(group);
        out
    }

    /// Consumer `i`'s cells (see [`Counters::with_cells`]).
    pub fn group(&self, i: usize, now: Now) -> Group {
        self.with_cells(i, now, |g| g.clone())
    }

    /// Moves every count kept in a slot to cells, so that a table made after this one
    /// finds them (call before the new table serves).
    pub fn settle_all(&self, now: Now) {
        for i in 0..self.lines.len() {
            let layout = &self.layouts[self.plan_slot(i)];
            let counting = match &*self.lines[i].slot.lock() {
                Slot::Light(lights) => light::in_use(lights, &layout.limits, now.mono),
                _ => false,
            };
            if counting {
                self.with_cells(i, now, |_| ());
            }
        }
    }

    /// Clears the slots whose cells were retired, so their memory goes. Returns how many.
    /// Only slots that were given cells are visited.
    pub fn sweep(&self) -> usize {
        let mut visit = std::mem::take(&mut *self.holding.lock());
        visit.sort_unstable();
        visit.dedup();
        let mut cleared = 0;
        visit.retain(|&i| {
            let Some(s) = self.lines.get(i) else {
                return false;
            };
            let mut slot = s.slot.lock();
            match &*slot {
                Slot::Cells(g) if g.iter().any(|c| c.state.lock().retired) => {
                    *slot = Slot::Unknown;
                    cleared += 1;
                    false
                }
                Slot::Cells(_) => true,
                _ => false,
            }
        });
        self.holding.lock().extend(visit);
        cleared
    }

    /// Consumers with counts in their windows at `now`, and their cells (made for those
    /// whose counts were kept in their slot), up to `max`.
    pub fn active(&self, max: usize, now: Now) -> Vec<(usize, Group)> {
        let mut out = Vec::new();
        for i in 0..self.lines.len() {
            if out.len() >= max {
                break;
            }
            let layout = &self.layouts[self.plan_slot(i)];
            let counting = match &*self.lines[i].slot.lock() {
                Slot::Unknown => false,
                Slot::Light(lights) => light::in_use(lights, &layout.limits, now.mono),
                Slot::Cells(g) => !g.is_empty(),
            };
            if counting {
                out.push((i, self.group(i, now)));
            }
        }
        out
    }
}

/// [`super::check`] on the cells of `group` at `positions`, locked in id order; a
/// standing's `index` is its place in `positions`.
fn check_cells(group: &Group, positions: &[usize], now: Now) -> Result<Option<Standing>, Refused> {
    // `order[k]`: the id of the k-th cell locked and the place of its limit in `positions`.
    let mut order: SmallVec<[(u64, usize); 4]> = positions
        .iter()
        .enumerate()
        .filter_map(|(ix, &p)| group.get(p).map(|c| (c.id, ix)))
        .collect();
    order.sort_unstable();
    let cells: SmallVec<[&Arc<LimitCell>; 4]> = order
        .iter()
        .filter_map(|&(_, ix)| group.get(positions[ix]))
        .collect();
    let place = |s: Standing| Standing {
        index: order.get(s.index).map_or(0, |o| o.1),
        ..s
    };
    match super::check(&cells, now) {
        Ok(s) => Ok(s.map(place)),
        Err(Refused::Limit(s)) => Err(Refused::Limit(place(s))),
        Err(other) => Err(other),
    }
}

#[cfg(test)]
#[path = "table_tests.rs"]
mod tests;
