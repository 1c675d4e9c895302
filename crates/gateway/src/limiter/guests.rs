//! Callers the consumers table does not list: the subject of a verified token on a route
//! that gives such callers a plan. A table's guests are numbered in arrival order and
//! counted like consumers; they last as long as the table (until the next reload). A name
//! that comes with another plan (another route's, or a token that names another) is
//! another guest: its counts are its name's, limit by limit, as for any consumer.

use parking_lot::{Mutex, RwLock};
use smallvec::SmallVec;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

/// Most guests one table takes: past this a caller the consumers table does not list is
/// refused until the next reload starts a new table.
pub const MAX_GUESTS: usize = 1 << 20;

/// Guests per chunk: chunks are made as guests arrive and never move, so a guest's name
/// and slot are read without a lock.
const CHUNK: usize = 4096;

/// One guest: its name, its layout slot, and its counts (`S`, the table's slot type).
#[derive(Debug)]
pub struct Guest<S> {
    /// Its name, as the token's consumer claim gives it.
    pub name: Arc<str>,
    /// Its layout slot: the plan it first came with.
    pub plan: u32,
    /// The listed consumer of its name, when it is one counted on another plan than its
    /// listed one (the admin API gave it that plan).
    pub listed: Option<u32>,
    /// Its counts.
    pub slot: Mutex<S>,
}

/// A guest name's plan slots and its number on each (nearly always one).
type Plans = SmallVec<[(u32, u32); 1]>;

/// [`CHUNK`] guests, each set once.
type Chunk<S> = Box<[OnceLock<Guest<S>>]>;

/// The guests of one table, by number and by name.
pub struct Guests<S> {
    /// By name: each plan slot it came with, and its number there. Read on every request
    /// of a guest (a shared lock, no allocation); written when one arrives.
    by_name: RwLock<HashMap<Arc<str>, Plans>>,
    /// How many there are.
    count: std::sync::atomic::AtomicUsize,
    chunks: Box<[OnceLock<Chunk<S>>]>,
}

impl<S> Default for Guests<S> {
    fn default() -> Self {
        Guests {
            by_name: RwLock::default(),
            count: std::sync::atomic::AtomicUsize::new(0),
            chunks: (0..MAX_GUESTS / CHUNK).map(|_| OnceLock::new()).collect(),
        }
    }
}

impl<S: Default> Guests<S> {
    /// The number of guest `name` on plan slot `plan`, made on its first call (`listed`:
    /// the listed consumer of that name, if any); `None` when there are [`MAX_GUESTS`]
    /// already.
    pub fn add(&self, name: &str, plan: usize, listed: Option<usize>) -> Option<usize> {
        let plan = u32::try_from(plan).ok()?;
        let find = |plans: &Plans| {
            plans
                .iter()
                .find(|(p, _)| *p == plan)
                .map(|(_, n)| *n as usize)
        };
        if let Some(n) = self.by_name.read().get(name).and_then(find) {
            return Some(n);
        }
        let mut by_name = self.by_name.write();
        if let Some(n) = by_name.get(name).and_then(find) {
            return Some(n);
        }
        let n = self.count.load(std::sync::atomic::Ordering::Relaxed);
        if n >= MAX_GUESTS {
            return None;
        }
        let chunk = self
            .chunks
            .get(n / CHUNK)?
            .get_or_init(|| (0..CHUNK).map(|_| OnceLock::new()).collect());
        let number = u32::try_from(n).ok()?;
        let name: Arc<str> = match by_name.get_key_value(name) {
            Some((k, _)) => k.clone(),
            None => Arc::from(name),
        };
        let guest = Guest {
            name: name.clone(),
            plan,
            listed: listed.and_then(|l| u32::try_from(l).ok()),
            slot: Mutex::new(S::default()),
        };
        chunk.get(n % CHUNK)?.set(guest).ok()?;
        by_name.entry(name).or_default().push((plan, number));
        self.count
            .store(n + 1, std::sync::atomic::Ordering::Relaxed);
        Some(n)
    }
}

impl<S> Guests<S> {
    /// The number of guest `name` made last (a guest on two plans has two), or `None`
    /// when no caller of that name came.
    pub fn find(&self, name: &str) -> Option<usize> {
        let by_name = self.by_name.read();
        by_name.get(name)?.last().map(|(_, n)| *n as usize)
    }

    /// Guest number `n`.
    pub fn get(&self, n: usize) -> Option<&Guest<S>> {
        self.chunks.get(n / CHUNK)?.get()?.get(n % CHUNK)?.get()
    }

    /// How many there are.
    pub fn count(&self) -> usize {
        self.count.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guest_keeps_its_number_on_its_plan() {
        let g: Guests<u8> = Guests::default();
        assert_eq!(g.add("zed", 1, None), Some(0));
        assert_eq!(g.add("yve", 0, None), Some(1));
        assert_eq!(g.add("zed", 1, None), Some(0));
        assert_eq!(g.add("zed", 0, None), Some(2));
        let zed = g.get(0).expect("zed");
        assert_eq!((&*zed.name, zed.plan), ("zed", 1));
        assert_eq!(g.count(), 3);
        assert!(g.get(3).is_none());
        for i in 0..CHUNK + 1 {
            g.add(&format!("g{i}"), 0, None).expect("room");
        }
        // zed, yve, zed are 0 to 2: g{i} is number i + 3, and the second chunk starts at
        // CHUNK.
        assert_eq!(
            *g.get(CHUNK + 3).expect("second chunk").name,
            *format!("g{CHUNK}")
        );
    }
}
