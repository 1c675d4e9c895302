//! The plain keys' lookup table: each key's 96-bit keyed fingerprint and its owner in one
//! 16-byte slot of an open-addressed array, and no key bytes. With a million consumers every
//! lookup misses the CPU caches, and this one reads one slot's cache line (rarely two), where
//! a hash table of indices into a key arena reads three: the table's tags, its slot, and
//! the key.
//!
//! The fingerprint is SipHash-2-4 (128-bit output) under a secret drawn per table, so clients
//! cannot aim keys at one another's fingerprints: two different keys share one with
//! probability 2⁻⁹⁶, and a presented key whose fingerprint is in the table is taken as the
//! key it was made from.

use crate::huge::huge_vec;
use siphasher::sip128::{Hasher128, SipHasher24};
use std::hash::{BuildHasher, Hasher};

/// A key's fingerprint under one table's secret.
pub(crate) type Fingerprint = [u32; 3];

/// Marks a free slot.
const FREE: u32 = u32::MAX;

/// One key: its fingerprint and the consumer holding it. Aligned so that a slot never
/// straddles two cache lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C, align(16))]
struct Slot {
    fingerprint: Fingerprint,
    owner: u32,
}

const FREE_SLOT: Slot = Slot {
    fingerprint: [0; 3],
    owner: FREE,
};

/// Keys by fingerprint, with the index of the consumer holding each.
#[derive(Debug, Clone)]
pub(crate) struct KeyTable {
    /// Linear probing from each fingerprint's home slot; at most three quarters full.
    slots: Vec<Slot>,
    len: usize,
    secret: (u64, u64),
}

impl Default for KeyTable {
    fn default() -> Self {
        KeyTable::with_capacity(0)
    }
}

impl KeyTable {
    /// An empty table with room for `keys` keys, under a fresh secret.
    pub(crate) fn with_capacity(keys: usize) -> Self {
        // Seeded by the standard library's per-process random keys.
        let seed = std::hash::RandomState::new();
        KeyTable {
            slots: huge_vec(room_for(keys), |_| FREE_SLOT),
            len: 0,
            secret: (
                seed.hash_one(0x6b65_7973_u64),
                seed.hash_one(0x7365_6372_u64),
            ),
        }
    }

    /// Number of keys.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// `key`'s fingerprint in this table.
    pub(crate) fn fingerprint(&self, key: &[u8]) -> Fingerprint {
        let mut h = SipHasher24::new_with_keys(self.secret.0, self.secret.1);
        h.write(key);
        let f = h.finish128();
        [f.h1 as u32, (f.h1 >> 32) as u32, (f.h2 >> 32) as u32]
    }

    /// Where a fingerprint's probe starts: its first 64 bits scaled to the table's size.
    fn home(fingerprint: &Fingerprint, slots: usize) -> usize {
        let x = u64::from(fingerprint[0]) | (u64::from(fingerprint[1]) << 32);
        ((u128::from(x) * slots as u128) >> 64) as usize
    }

    /// The owner of `key`.
    pub(crate) fn get(&self, key: &[u8]) -> Option<u32> {
        self.find(&self.fingerprint(key))
    }

    /// The owner of the key with this fingerprint.
    pub(crate) fn find(&self, fingerprint: &Fingerprint) -> Option<u32> {
        let n = self.slots.len();
        let mut i = Self::home(fingerprint, n);
        // The table always has a free slot, which ends every probe.
        for _ in 0..n {
            let s = &self.slots[i];
            if s.owner == FREE {
                return None;
            }
            if s.fingerprint == *fingerprint {
                return Some(s.owner);
            }
            i = if i + 1 == n { 0 } else { i + 1 };
        }
        None
    }

    /// Adds the key with this fingerprint for `owner`, or names the consumer already
    /// holding it.
    pub(crate) fn insert(&mut self, fingerprint: Fingerprint, owner: u32) -> Result<(), u32> {
        if let Some(other) = self.find(&fingerprint) {
            return Err(other);
        }
        if room_for(self.len + 1) > self.slots.len() {
            self.resize(room_for((self.len + 1) * 2));
        }
        self.place(Slot { fingerprint, owner });
        self.len += 1;
        Ok(())
    }

    fn place(&mut self, slot: Slot) {
        let n = self.slots.len();
        let mut i = Self::home(&slot.fingerprint, n);
        while self.slots[i].owner != FREE {
            i = if i + 1 == n { 0 } else { i + 1 };
        }
        self.slots[i] = slot;
    }

    fn resize(&mut self, slots: usize) {
        let old = std::mem::replace(&mut self.slots, huge_vec(slots, |_| FREE_SLOT));
        for s in old.into_iter().filter(|s| s.owner != FREE) {
            self.place(s);
        }
    }

    /// Makes room for `more` keys.
    pub(crate) fn reserve(&mut self, more: usize) {
        let need = room_for(self.len + more);
        if need > self.slots.len() {
            self.resize(need);
        }
    }

    /// Gives back the slots beyond what three quarters full needs.
    pub(crate) fn shrink_to_fit(&mut self) {
        let need = room_for(self.len);
        if need < self.slots.len() {
            self.resize(need);
        }
    }
}

/// Slots for `keys` keys at most three quarters full, one free at least.
fn room_for(keys: usize) -> usize {
    (keys + keys / 3 + 1).max(8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_found_through_growth_and_shrinking_and_others_are_not() {
        let mut t = KeyTable::default();
        for i in 0..5_000u32 {
            let f = t.fingerprint(format!("key-{i}").as_bytes());
            assert_eq!(t.insert(f, i), Ok(()));
        }
        let f = t.fingerprint(b"key-42");
        assert_eq!(t.insert(f, 7), Err(42), "a key held already");
        assert_eq!(t.len(), 5_000);
        t.reserve(100_000);
        for round in 0..2 {
            for i in 0..5_000u32 {
                assert_eq!(
                    t.get(format!("key-{i}").as_bytes()),
                    Some(i),
                    "round {round}"
                );
            }
            for i in 5_000..10_000u32 {
                assert_eq!(t.get(format!("key-{i}").as_bytes()), None);
            }
            assert_eq!(t.get(b""), None);
            t.shrink_to_fit();
        }
        assert!(t.slots.len() <= 5_000 * 4 / 3 + 2);
        assert!(t.slots.iter().any(|s| s.owner == FREE));
    }

    #[test]
    fn a_full_table_of_one_still_answers() {
        let mut t = KeyTable::with_capacity(1);
        assert_eq!(t.get(b"k"), None);
        let f = t.fingerprint(b"k");
        assert_eq!(t.insert(f, 0), Ok(()));
        assert_eq!(t.get(b"k"), Some(0));
        assert_eq!(t.get(b"j"), None);
    }

    #[test]
    fn two_tables_fingerprint_the_same_key_differently() {
        let (a, b) = (KeyTable::default(), KeyTable::default());
        assert_ne!(a.fingerprint(b"same key"), b.fingerprint(b"same key"));
    }
}
