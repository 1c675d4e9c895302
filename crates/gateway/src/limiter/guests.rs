//! Callers the consumers table does not list: the subject of a verified token on a route
//! that gives such callers a plan. A table's guests are numbered in arrival order and
//! counted like consumers; they last as long as the table (until the next reload). A name
//! that comes with another plan (another route's, or a token that names another) is
//! another guest: its counts are its name's, limit by limit, as for any consumer.

use parking_lot::{Mutex, RwLock};
use smallvec::SmallVec;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

/// Most callers by token one table takes: past this a caller the consumers table does not
/// list is refused until the next reload starts a new table.
pub const MAX_GUESTS: usize = 1 << 20;

/// Most guests of every kind: consumers the admin API manages have as many places again,
/// so that callers by token cannot take theirs.
const MAX_ALL: usize = 2 * MAX_GUESTS;

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
    /// How many came by token (not through the admin API), and how many may.
    by_token: std::sync::atomic::AtomicUsize,
    token_cap: usize,
    chunks: Box<[OnceLock<Chunk<S>>]>,
}

impl<S> Default for Guests<S> {
    fn default() -> Self {
        Guests {
            by_name: RwLock::default(),
            count: std::sync::atomic::AtomicUsize::new(0),
            by_token: std::sync::atomic::AtomicUsize::new(0),
            token_cap: MAX_GUESTS,
            chunks: (0..MAX_ALL / CHUNK).map(|_| OnceLock::new()).collect(),
        }
    }
}

impl<S: Default> Guests<S> {
    /// The number of guest `name` on plan slot `plan`, made on its first call (`listed`:
    /// the listed consumer of that name, if any; `managed`: made for a consumer the admin
    /// API manages, not for a caller by token); `None` when the callers by token are
    /// [`MAX_GUESTS`] already (for a caller by token), or the table is full.
    pub fn add(
        &self,
        name: &str,
        plan: usize,
        listed: Option<usize>,
        managed: bool,
    ) -> Option<usize> {
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
        let tokens = self.by_token.load(std::sync::atomic::Ordering::Relaxed);
        if n >= MAX_ALL || (!managed && tokens >= self.token_cap) {
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
        if !managed {
            self.by_token
                .store(tokens + 1, std::sync::atomic::Ordering::Relaxed);
        }
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

    /// Whether no more callers by token fit (or no more guests of any kind): a reload,
    /// even of an unchanged file, then starts a new table.
    pub fn full_of_tokens(&self) -> bool {
        self.by_token.load(std::sync::atomic::Ordering::Relaxed) >= self.token_cap
            || self.count() >= MAX_ALL
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guest_keeps_its_number_on_its_plan() {
        let g: Guests<u8> = Guests::default();
        assert_eq!(g.add("zed", 1, None, false), Some(0));
        assert_eq!(g.add("yve", 0, None, false), Some(1));
        assert_eq!(g.add("zed", 1, None, false), Some(0));
        assert_eq!(g.add("zed", 0, None, false), Some(2));
        let zed = g.get(0).expect("zed");
        assert_eq!((&*zed.name, zed.plan), ("zed", 1));
        assert_eq!(g.count(), 3);
        assert!(g.get(3).is_none());
        for i in 0..CHUNK + 1 {
            g.add(&format!("g{i}"), 0, None, false).expect("room");
        }
        // zed, yve, zed are 0 to 2: g{i} is number i + 3, and the second chunk starts at
        // CHUNK.
        assert_eq!(
            *g.get(CHUNK + 3).expect("second chunk").name,
            *format!("g{CHUNK}")
        );
    }

    #[test]
    fn callers_by_token_cannot_take_the_places_of_managed_consumers() {
        let g: Guests<u8> = Guests {
            token_cap: 2,
            ..Guests::default()
        };
        assert!(g.add("t1", 0, None, false).is_some());
        assert!(g.add("t2", 0, None, false).is_some());
        assert!(g.full_of_tokens());
        assert_eq!(
            g.add("t3", 0, None, false),
            None,
            "no room for a third token"
        );
        assert_eq!(
            g.add("t1", 0, None, false),
            Some(0),
            "one that came still counts"
        );
        assert_eq!(g.add("managed", 1, Some(7), true), Some(2));
        assert_eq!(g.get(2).and_then(|m| m.listed), Some(7));
    }
}
