//! The rate-limit algorithm: a sliding window of sub-windows, exact on one node.
//!
//! A limit of N requests per window W is counted in 10 sub-windows of W/10, keeping the
//! current one and the 10 before it (11 counters). A request is admitted when the count over
//! those 11 slots is below N. Any interval of length W overlaps at most 11 consecutive slots,
//! so **no interval of length W ever holds more than N admitted requests**, whatever the
//! concurrency. The price is that a request counts for up to W + W/10 (a slight
//! under-admission, never an over-admission). Memory: 11 counters + head + total = 104 bytes
//! per limit per consumer; with the lock and bookkeeping the whole cell is 184 bytes.
//!
//! All of a request's limits are checked under their locks together (taken in a fixed
//! order), and a request refused by one limit is counted by none.
//!
//! Limits shared with other nodes are counted in the same sub-windows, aligned to the wall
//! clock, with tokens leased from Redis: see [`shared`] and [`crate::cluster`].
//!
//! A limit whose counts all sit in one sub-window is kept as two numbers in the consumer's
//! table slot ([`light`]); a cell is made when a consumer calls in a second sub-window while
//! the first still counts ([`table`]), written to the state file when one is configured
//! ([`persist`]), and retired once every window has passed.

pub mod guests;
pub mod light;
pub mod live;
pub mod persist;
pub mod report;
pub mod shared;
mod slots;
mod verdict;

pub use verdict::{Refused, Standing};
pub mod table;

use parking_lot::{Mutex, MutexGuard};
use smallvec::SmallVec;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use slots::{sub_window_ns, SLOTS, SUB};

/// Sliding-window counters for one limit of one consumer on this node.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Window {
    /// Counts by slot, the slot `k` at `k mod SLOTS` (slots before the clock's zero, from a
    /// restored state, at their Euclidean remainder).
    pub(crate) slots: [u64; SLOTS],
    /// Index of the newest slot (time / slot length).
    pub(crate) head: u64,
    /// Sum of all slots.
    pub(crate) total: u64,
}

impl Window {
    fn advance(&mut self, now_slot: u64) {
        if now_slot <= self.head {
            return;
        }
        let steps = now_slot - self.head;
        if steps >= SLOTS as u64 {
            self.slots = [0; SLOTS];
            self.total = 0;
        } else {
            for k in 1..=steps {
                let ix = ((self.head + k) % SLOTS as u64) as usize;
                self.total -= self.slots[ix];
                self.slots[ix] = 0;
            }
        }
        self.head = now_slot;
    }

    /// The window holding `count` requests in slot `slot` and nothing else.
    pub(crate) fn single(slot: u64, count: u64) -> Window {
        let mut w = Window {
            head: slot,
            total: count,
            ..Window::default()
        };
        w.slots[(slot % SLOTS as u64) as usize] = count;
        w
    }

    /// Adds `other`'s counts to these (both moved to the later head first).
    pub(crate) fn merge(&mut self, other: &Window) {
        let mut other = other.clone();
        let head = self.head.max(other.head);
        self.advance(head);
        other.advance(head);
        for (mine, theirs) in self.slots.iter_mut().zip(other.slots) {
            *mine += theirs;
        }
        self.total += other.total;
    }

    /// Moves to `now` and, when `requests` are already counted, returns the wait until
    /// one more would pass.
    fn full(&mut self, requests: u64, slot_ns: u64, now: u64) -> Option<u64> {
        self.advance(now / slot_ns);
        (self.total >= requests).then(|| self.wait_for(self.total + 1 - requests, slot_ns, now))
    }

    /// Counts one request in the current slot; returns what is left.
    fn count_one(&mut self, requests: u64) -> u64 {
        let slot = (self.head % SLOTS as u64) as usize;
        self.slots[slot] += 1;
        self.total += 1;
        requests.saturating_sub(self.total)
    }

    /// Nanoseconds from `now` until `need` counted requests have left the window.
    fn wait_for(&self, need: u64, slot_ns: u64, now: u64) -> u64 {
        let mut freed = 0;
        let head = i128::from(self.head);
        for slot in head - i128::from(SUB)..=head {
            freed += self.slots[slot.rem_euclid(SLOTS as i128) as usize];
            if freed >= need {
                // The slot stops counting once the clock reaches slot + SLOTS.
                let end = (slot + SLOTS as i128) * i128::from(slot_ns) - i128::from(now);
                return u64::try_from(end.max(0)).unwrap_or(u64::MAX);
            }
        }
        slot_ns * SLOTS as u64
    }
}

/// Cells with counts not yet written to the state file.
pub type DirtyQueue = Mutex<Vec<Arc<LimitCell>>>;

/// One limit's counters for one consumer, shared across config reloads while the limit's
/// name and window are unchanged (a new number of requests applies to the counts made).
#[derive(Debug)]
pub struct LimitCell {
    /// Stable order for taking several locks.
    pub(crate) id: u64,
    /// Requests allowed per window, as the last check's config said: a hint for reports
    /// and lease sizes (each check passes its own).
    requests: AtomicU64,
    /// Window length in nanoseconds.
    pub(crate) window_ns: u64,
    pub(crate) state: Mutex<CellState>,
    /// Set when the limit is shared with other nodes.
    pub(crate) shared: Option<Box<shared::SharedLimit<LimitCell>>>,
    /// Who is counted and the limit itself: the key of the state file.
    pub(crate) key: Arc<str>,
    /// Where the cell goes once it has counts to write, when counters are kept on disk.
    pub(crate) dirty: Option<Arc<DirtyQueue>>,
}

/// A cell's counters and bookkeeping, under its lock.
#[derive(Debug)]
pub(crate) struct CellState {
    pub(crate) counter: Counter,
    /// Taken out of use once idle: a request finding it so looks the consumer up again.
    pub(crate) retired: bool,
    /// Counted since last written to the state file.
    pub(crate) dirty: bool,
}

impl CellState {
    fn new(counter: Counter) -> Mutex<CellState> {
        Mutex::new(CellState {
            counter,
            retired: false,
            dirty: false,
        })
    }
}

/// How a limit is counted.
#[derive(Debug)]
pub(crate) enum Counter {
    /// On this node alone: the sliding window.
    Local(Window),
    /// Across nodes: tokens leased from Redis per sub-window (see [`crate::cluster`]).
    Shared(Box<shared::Lease>),
}

/// Time of a check: the monotonic clock (local limits) and the wall clock (shared limits).
#[derive(Debug, Clone, Copy)]
pub struct Now {
    /// Monotonic nanoseconds.
    pub mono: u64,
    /// Nanoseconds since the Unix epoch.
    pub wall: u64,
}

impl LimitCell {
    /// Local counters for "`requests` per `window`" (window: a whole number of seconds, ≥ 1 s),
    /// known in the state file as `key`.
    pub fn new(id: u64, requests: u64, window: Duration, key: Arc<str>) -> Self {
        LimitCell {
            id,
            requests: AtomicU64::new(requests),
            window_ns: nanos(window),
            state: CellState::new(Counter::Local(Window::default())),
            shared: None,
            key,
            dirty: None,
        }
    }

    /// Requests allowed per window.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Notes the number of requests a check was made at (a reload may change it).
    pub(crate) fn set_requests(&self, requests: u64) {
        self.requests.store(requests, Ordering::Relaxed);
    }

    /// `requests` per its window, as shared counting needs it.
    fn shape(&self, requests: u64) -> shared::Limit {
        shared::Limit {
            requests,
            window_ns: self.window_ns,
        }
    }

    /// Counters for a limit shared with other nodes through `shared`.
    pub(crate) fn new_shared(
        id: u64,
        requests: u64,
        window: Duration,
        shared: shared::SharedLimit<LimitCell>,
        key: Arc<str>,
    ) -> Self {
        LimitCell {
            id,
            requests: AtomicU64::new(requests),
            window_ns: nanos(window),
            state: CellState::new(Counter::Shared(Box::default())),
            shared: Some(Box::new(shared)),
            key,
            dirty: None,
        }
    }

    /// Sub-window length in nanoseconds.
    pub(crate) fn slot_ns(&self) -> u64 {
        sub_window_ns(self.window_ns)
    }

    /// Whether nothing is counted any more (every window has passed and, for a shared
    /// limit, nothing is left to settle); if so, and `retire`, the cell is taken out of use.
    pub(crate) fn idle(&self, now: Now, retire: bool) -> bool {
        let mut state = self.state.lock();
        let idle = match &mut state.counter {
            Counter::Local(w) => {
                w.advance(now.mono / self.slot_ns());
                w.total == 0
            }
            Counter::Shared(l) => {
                l.roll(now.wall / self.slot_ns());
                l.idle()
            }
        };
        if idle && retire {
            state.retired = true;
        }
        idle || state.retired
    }

    /// Requests counted in the current window: on this node for a local limit, across the
    /// cluster (as last settled with Redis) for a shared one.
    pub fn used(&self, now: Now) -> u64 {
        let mut state = self.state.lock();
        match &mut state.counter {
            Counter::Local(w) => {
                w.advance(now.mono / self.slot_ns());
                w.total
            }
            Counter::Shared(l) => {
                l.roll(now.wall / self.slot_ns());
                l.counted()
            }
        }
    }
}

enum Room {
    Local,
    Shared(shared::Admit),
}

/// What the limits of one check say so far: the refusal to give (the limit that frees up
/// last, a store that is down before any limit) or the tightest standing.
#[derive(Default)]
struct Tally {
    refused: Option<Refused>,
    tightest: Option<Standing>,
}

impl Tally {
    /// Limit `index` is used up until `wait` nanoseconds from now.
    fn full(&mut self, index: usize, wait: u64) {
        let later = match self.refused {
            // A limit used up outweighs one whose lease is still to come.
            None | Some(Refused::Leasing(_)) => true,
            Some(Refused::Limit(r)) => wait > r.reset.as_nanos() as u64,
            Some(_) => false,
        };
        if later {
            self.refused = Some(Refused::Limit(Standing {
                index,
                remaining: 0,
                reset: Duration::from_nanos(wait),
            }));
        }
    }

    /// A shared limit refused with `r`.
    fn shared(&mut self, index: usize, r: Refused) {
        // Down outweighs used up, which outweighs a lease still to come: the request may
        // wait for a lease only when every other limit has room.
        let replace = match (self.refused, r) {
            (None, _) | (_, Refused::StoreDown) => true,
            (Some(Refused::Limit(old)), Refused::Limit(new)) => new.reset > old.reset,
            (Some(Refused::Leasing(_)), Refused::Limit(_)) => true,
            (Some(Refused::Leasing(old)), Refused::Leasing(new)) => new.reset > old.reset,
            (Some(_), _) => false,
        };
        if replace {
            self.refused = Some(match r {
                Refused::Limit(s) => Refused::Limit(Standing { index, ..s }),
                Refused::Leasing(s) => Refused::Leasing(Standing { index, ..s }),
                other => other,
            });
        }
    }

    /// Whether a limit with `remaining` left could be the tightest so far (its reset
    /// decides a tie).
    fn tighter(&self, remaining: u64) -> bool {
        self.tightest.is_none_or(|t| remaining <= t.remaining)
    }

    /// Notes an admitted limit's standing. The tightest has the fewest requests left; of
    /// two with as few, the one that resets later (with none left in either, that is the
    /// one that holds the client off longer: `RateLimit` names it).
    fn admitted(&mut self, s: Standing) {
        let tighter = self.tightest.is_none_or(|t| {
            s.remaining < t.remaining || (s.remaining == t.remaining && s.reset > t.reset)
        });
        if tighter {
            self.tightest = Some(s);
        }
    }
}

/// [`check_as`] for a request's first check, each cell at its own number of requests.
#[cfg(test)]
pub fn check(cells: &[&Arc<LimitCell>], now: Now) -> Result<Option<Standing>, Refused> {
    let cells: Vec<(&Arc<LimitCell>, u64)> = cells.iter().map(|c| (*c, c.requests())).collect();
    check_as(&cells, now, false)
}

/// Checks every limit together. If all have room, counts the request in each and returns
/// the standing of the tightest one; otherwise counts nothing and returns the standing of
/// the limit that refused (the one that frees up last). `again`: the request checks again
/// after waiting for a shared limit's lease (it is not counted twice in the lease sizing).
///
/// Each cell comes with the number of requests its limit allows in the caller's config:
/// a cell outlives reloads that change it, and tables of two configs may share it a
/// while, so what one table enforces is its own (the cell keeps the latest as a hint for
/// reports and lease sizes). `cells` must be sorted by id, so locks are always taken in
/// the same order.
pub fn check_as(
    cells: &[(&Arc<LimitCell>, u64)],
    now: Now,
    again: bool,
) -> Result<Option<Standing>, Refused> {
    if cells.is_empty() {
        return Ok(None);
    }
    let mut guards: SmallVec<[(MutexGuard<'_, CellState>, Room); 4]> =
        SmallVec::with_capacity(cells.len());
    let mut tally = Tally::default();
    for (index, &(cell, requests)) in cells.iter().enumerate() {
        let mut state = cell.state.lock();
        if state.retired {
            return Err(Refused::Retired);
        }
        if cell.requests() != requests {
            cell.set_requests(requests);
        }
        let room = match &mut state.counter {
            Counter::Local(w) => {
                if let Some(wait) = w.full(requests, cell.slot_ns(), now.mono) {
                    tally.full(index, wait);
                }
                Room::Local
            }
            Counter::Shared(l) => match cell.shared.as_ref() {
                Some(shared) => match shared.room(cell, cell.shape(requests), l, now.wall, again) {
                    Ok(admit) => Room::Shared(admit),
                    Err(r) => {
                        tally.shared(index, r);
                        Room::Local
                    }
                },
                None => Room::Local,
            },
        };
        guards.push((state, room));
    }
    if let Some(r) = tally.refused {
        return Err(r);
    }
    for (index, (&(cell, requests), (state, room))) in
        cells.iter().zip(guards.iter_mut()).enumerate()
    {
        if !state.dirty {
            if let Some(q) = &cell.dirty {
                state.dirty = true;
                q.lock().push(Arc::clone(cell));
            }
        }
        let standing = match (&mut state.counter, room) {
            (Counter::Local(w), _) => {
                let remaining = w.count_one(requests);
                if !tally.tighter(remaining) {
                    continue;
                }
                Standing {
                    index,
                    remaining,
                    reset: Duration::from_nanos(w.wait_for(1, cell.slot_ns(), now.mono)),
                }
            }
            (Counter::Shared(l), Room::Shared(admit)) => match cell.shared.as_ref() {
                Some(shared) => {
                    shared.commit(cell, cell.shape(requests), l, *admit, index, now.wall)
                }
                None => continue,
            },
            (Counter::Shared(_), Room::Local) => continue,
        };
        tally.admitted(standing);
    }
    Ok(tally.tightest)
}

/// Sub-window length in nanoseconds of a limit over `window`, the same as its cell's
/// ([`LimitCell::slot_ns`]): counts kept in a slot and in a cell must agree on it.
pub(crate) fn slot_ns_of(window: Duration) -> u64 {
    sub_window_ns(nanos(window))
}

/// `d` in nanoseconds (saturating).
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    const S: u64 = 1_000_000_000;

    fn at(ns: u64) -> Now {
        Now { mono: ns, wall: ns }
    }

    fn cell(id: u64, n: u64, secs: u64) -> Arc<LimitCell> {
        Arc::new(LimitCell::new(
            id,
            n,
            Duration::from_secs(secs),
            Arc::from("test"),
        ))
    }

    fn check(cells: &[Arc<LimitCell>], now: Now) -> Result<Option<Standing>, Refused> {
        let refs: Vec<&Arc<LimitCell>> = cells.iter().collect();
        super::check(&refs, now)
    }

    #[test]
    fn admits_n_then_refuses_until_the_window_passes() {
        let c = [cell(1, 3, 10)];
        for _ in 0..3 {
            assert!(check(&c, at(0)).is_ok());
        }
        let Err(Refused::Limit(refused)) = check(&c, at(0)) else {
            panic!("over")
        };
        // All three were counted in slot 0, which stops counting at 11 s.
        assert_eq!(refused.reset, Duration::from_secs(11));
        assert!(check(&c, at(10 * S)).is_err());
        assert!(check(&c, at(11 * S)).is_ok());
    }

    #[test]
    fn one_per_30s() {
        let c = [cell(1, 1, 30)];
        assert!(check(&c, at(5 * S)).is_ok());
        for t in [5, 6, 20, 34] {
            assert!(check(&c, at(t * S)).is_err(), "t={t}");
        }
        assert!(check(&c, at(33 * S)).is_err());
        assert!(check(&c, at(36 * S)).is_ok());
    }

    #[test]
    fn never_more_than_n_in_any_window() {
        // Requests every 10 ms for 60 s against 50 per 2 s: check every 2 s interval.
        let c = [cell(1, 50, 2)];
        let mut admitted = Vec::new();
        for i in 0..6000u64 {
            let t = i * 10_000_000;
            if check(&c, at(t)).is_ok() {
                admitted.push(t);
            }
        }
        for (i, &start) in admitted.iter().enumerate() {
            let within = admitted[i..]
                .iter()
                .take_while(|&&t| t < start + 2 * S)
                .count();
            assert!(within <= 50, "{within} in the 2 s from {start}");
        }
        // And it does not starve: at least 50 per 2.2 s on average.
        assert!(admitted.len() >= 6000 / 220 * 50, "{}", admitted.len());
    }

    #[test]
    fn a_refusal_by_one_limit_uses_up_none() {
        let fast = cell(1, 100, 1);
        let slow = cell(2, 2, 100);
        let both = [fast.clone(), slow.clone()];
        assert!(check(&both, at(0)).is_ok());
        assert!(check(&both, at(0)).is_ok());
        let Err(Refused::Limit(r)) = check(&both, at(0)) else {
            panic!("slow limit is full")
        };
        assert_eq!(r.index, 1);
        assert_eq!(fast.used(at(0)), 2);
        assert_eq!(slow.used(at(0)), 2);
    }

    #[test]
    fn a_limit_costs_under_200_bytes_per_consumer() {
        // The README promises this; the Arc's two counters come on top.
        let size = std::mem::size_of::<LimitCell>();
        assert!(size <= 192, "{size}");
    }

    #[test]
    fn reports_the_tightest_limit() {
        let both = [cell(1, 100, 1), cell(2, 5, 100)];
        let s = check(&both, at(0)).expect("ok").expect("limited");
        assert_eq!((s.index, s.remaining), (1, 4));
    }

    #[test]
    fn of_two_limits_used_up_the_one_that_holds_off_longer_is_reported() {
        let both = [cell(1, 1, 1), cell(2, 1, 3600)];
        let s = check(&both, at(0)).expect("ok").expect("limited");
        assert_eq!((s.index, s.remaining), (1, 0), "{s:?}");
        let first_longer = [cell(3, 1, 3600), cell(4, 1, 1)];
        let s = check(&first_longer, at(0)).expect("ok").expect("limited");
        assert_eq!((s.index, s.remaining), (0, 0), "{s:?}");
    }
}
