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

use super::guests::Guests;
use super::light::{self, Checked, Lights};
use super::live::{Live, Scope};
use super::{Counter, LimitCell, Now, Refused, Standing, Window};
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tollgate_config::huge::huge_vec;
use tollgate_config::{Consumers, LimitConfig};

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
    /// The consumer's cells were retired, some of them perhaps not all: others (a longer
    /// limit's) may still count, so they are looked up even in a fresh table.
    Swept,
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
    /// Callers the consumers table does not list, numbered after it.
    guests: Guests<Slot>,
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
            guests: Guests::default(),
        }
    }

    /// The index of the caller by token `name` on plan slot `plan`, made on its first
    /// call; `None` when the table holds [`super::guests::MAX_GUESTS`] such callers
    /// already. A guest keeps the plan it first came with until the table is replaced.
    pub fn guest(&self, name: &str, plan: usize) -> Option<usize> {
        Some(self.lines.len() + self.guests.add(name, plan, None, false)?)
    }

    /// [`Counters::guest`] for a consumer the admin API manages on a plan of its own: not
    /// one of the callers by token, whose number cannot take its place. `listed`: the
    /// listed consumer of that name (one the admin API moved to another plan), whose
    /// counts the guest's limits share.
    pub fn managed_guest(&self, name: &str, plan: usize, listed: Option<usize>) -> Option<usize> {
        Some(self.lines.len() + self.guests.add(name, plan, listed, true)?)
    }

    /// Whether no more callers by token fit in this table (see [`Counters::guest`]).
    pub fn full_of_tokens(&self) -> bool {
        self.guests.full_of_tokens()
    }

    /// Before guest `i` counts: when it is a listed consumer on another plan, its listed
    /// line is given cells (its light counts moved to them), made under the line's lock
    /// if none are in use. The guest's limits of the same identity then count in those
    /// very cells, and so does the line if the consumer is moved back, even while requests
    /// identified before the move are still being checked.
    fn hand_over(&self, i: usize, now: Now) {
        let listed = i
            .checked_sub(self.lines.len())
            .and_then(|n| self.guests.get(n))
            .and_then(|g| g.listed);
        if let Some(l) = listed.map(|l| l as usize).filter(|&l| l < self.lines.len()) {
            self.with_cells(l, now, |_| ());
        }
    }

    /// The index of the guest `name` as it last came (see [`Guests::find`]), without
    /// making one: what its usage is read from.
    pub fn guest_named(&self, name: &str) -> Option<usize> {
        Some(self.lines.len() + self.guests.find(name)?)
    }

    /// A stable identity of consumer `i` for the usage history: the table and index of a
    /// listed consumer, or for a guest its name's address.
    pub fn identity(&self, i: usize) -> (usize, u32) {
        match i
            .checked_sub(self.lines.len())
            .and_then(|n| self.guests.get(n))
        {
            Some(g) => (Arc::as_ptr(&g.name).cast::<u8>() as usize, u32::MAX - 1),
            None => (
                Arc::as_ptr(&self.consumers) as usize,
                u32::try_from(i).unwrap_or(u32::MAX),
            ),
        }
    }

    /// Consumer `i`'s slot and layout slot.
    fn at(&self, i: usize) -> Option<(&Mutex<Slot>, usize)> {
        match self.lines.get(i) {
            Some(line) => Some((&line.slot, line.plan as usize)),
            None => {
                let g = self.guests.get(i - self.lines.len())?;
                Some((&g.slot, g.plan as usize))
            }
        }
    }

    /// The layout slot of consumer `i`: its plan, or the last for none.
    pub fn plan_slot(&self, i: usize) -> usize {
        self.at(i)
            .map_or(self.layouts.len().saturating_sub(1), |(_, p)| p)
    }

    /// Consumer `i`'s plan: an index into the config's plans.
    pub fn plan(&self, i: usize) -> Option<usize> {
        Some(self.plan_slot(i)).filter(|&p| p + 1 < self.layouts.len())
    }

    /// Consumer `i`'s name, from its line when short (no other memory read).
    pub fn name(&self, i: usize) -> &str {
        match self.lines.get(i) {
            Some(line) => match line.short_name() {
                Some(name) => name,
                None => self.consumers.name(i),
            },
            None => self
                .guests
                .get(i - self.lines.len())
                .map_or("", |g| &g.name),
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
        self.check_as(i, positions, now, false)
    }

    /// [`Counters::check`], for a request that asks `again` after waiting for a shared
    /// limit's lease (not counted twice in the rate leases are sized by).
    pub fn check_as(
        &self,
        i: usize,
        positions: &[usize],
        now: Now,
        again: bool,
    ) -> Result<Option<Standing>, Refused> {
        let Some((line, ls)) = self.at(i) else {
            return Err(Refused::Retired);
        };
        let layout = &self.layouts[ls];
        // Guests are counted in cells only: `settle_all` walks the listed consumers.
        let listed = i < self.lines.len();
        if !listed {
            self.hand_over(i, now);
        }
        // A cell retired by the sweeper before this request reached it is dropped from
        // the slot and looked up again: the sweeper retires only idle cells, so a second
        // try finds fresh ones.
        for _ in 0..4 {
            let mut slot = line.lock();
            // Under the slot lock, so that `settle_all` sees any count kept here.
            let light = listed && self.light[ls] && self.live.light_ok();
            if light && matches!(*slot, Slot::Unknown | Slot::Swept) {
                let swept = matches!(*slot, Slot::Swept);
                *slot = self.look_up(i, layout, now, swept);
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
                Slot::Unknown | Slot::Swept => {
                    *slot = Slot::Cells(self.cells_with(i, layout, &[], now))
                }
                Slot::Cells(_) => {}
            }
            let Slot::Cells(group) = &*slot else {
                continue;
            };
            match check_cells(group, layout, positions, now, again) {
                Err(Refused::Retired) => *slot = Slot::Swept,
                checked => return checked,
            }
        }
        Err(Refused::Retired)
    }

    /// An unknown or swept slot's state when counts may be kept in it: the consumer's
    /// cells if any are in use, else empty counts. A fresh table skips the lookup for a
    /// slot never given cells: no cell existed when it was made.
    fn look_up(&self, i: usize, layout: &Layout, now: Now, swept: bool) -> Slot {
        if (!self.fresh || swept) && self.any_in_use(i, layout) {
            return Slot::Cells(self.cells_with(i, layout, &[], now));
        }
        Slot::Light(Lights::default())
    }

    /// Whether any of consumer `i`'s cells is in use.
    fn any_in_use(&self, i: usize, layout: &Layout) -> bool {
        let consumer = self.name(i);
        layout.limits.iter().any(|(limit, route)| {
            let route = route.as_deref();
            self.live.find(Scope { route, consumer }, limit).is_some()
        })
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
        let Some((line, ls)) = self.at(i) else {
            return f(&Group::new());
        };
        if i >= self.lines.len() {
            self.hand_over(i, now);
        }
        let layout = &self.layouts[ls];
        let mut slot = line.lock();
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

    /// Clears the slots whose cells were retired, so their memory goes (a limit's cell
    /// still in use is looked up again by the next request). Returns how many. Only slots
    /// that were given cells are visited.
    pub fn sweep(&self) -> usize {
        let mut visit = std::mem::take(&mut *self.holding.lock());
        visit.sort_unstable();
        visit.dedup();
        let mut cleared = 0;
        visit.retain(|&i| {
            let Some((s, _)) = self.at(i) else {
                return false;
            };
            let mut slot = s.lock();
            match &*slot {
                Slot::Cells(g) if g.iter().any(|c| c.state.lock().retired) => {
                    *slot = Slot::Swept;
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
        for i in 0..self.lines.len() + self.guests.count() {
            if out.len() >= max {
                break;
            }
            let Some((slot, ls)) = self.at(i) else {
                continue;
            };
            let layout = &self.layouts[ls];
            let counting = match &*slot.lock() {
                Slot::Unknown => false,
                Slot::Swept => self.any_in_use(i, layout),
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

/// [`super::check_as`] on the cells of `group` at `positions`, at the numbers of
/// requests of this table's `layout`, locked in id order; a standing's `index` is its
/// place in `positions`.
fn check_cells(
    group: &Group,
    layout: &Layout,
    positions: &[usize],
    now: Now,
    again: bool,
) -> Result<Option<Standing>, Refused> {
    // `order[k]`: the id of the k-th cell locked and the place of its limit in `positions`.
    let mut order: SmallVec<[(u64, usize); 4]> = positions
        .iter()
        .enumerate()
        .filter_map(|(ix, &p)| group.get(p).map(|c| (c.id, ix)))
        .collect();
    order.sort_unstable();
    let cells: SmallVec<[(&Arc<LimitCell>, u64); 4]> = order
        .iter()
        .filter_map(|&(_, ix)| {
            let p = positions[ix];
            Some((group.get(p)?, layout.limits.get(p)?.0.requests))
        })
        .collect();
    let place = |s: Standing| Standing {
        index: order.get(s.index).map_or(0, |o| o.1),
        ..s
    };
    match super::check_as(&cells, now, again) {
        Ok(s) => Ok(s.map(place)),
        Err(Refused::Limit(s)) => Err(Refused::Limit(place(s))),
        Err(Refused::Leasing(s)) => Err(Refused::Leasing(place(s))),
        Err(other) => Err(other),
    }
}

#[cfg(test)]
#[path = "table_tests.rs"]
mod tests;
