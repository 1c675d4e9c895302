//! Consumers compiled into a compact table, so a million of them fit in well under 128 bytes
//! each: names and keys live in two byte arenas, plans in a `u32` array, and three hash
//! tables of `u32` indices find a consumer by name, by key and by key digest.
//!
//! Keys may be given as SHA-256 digests (`key_sha256`) so that a consumers file holds no
//! secrets. A key a client presents is looked up as written first; only when that misses and
//! the table holds digests is it hashed (one SHA-256 of the key, ≈ 0.1–0.3 µs).

use hashbrown::HashTable;
use sha2::{Digest, Sha256};
use std::hash::BuildHasher;

/// A SHA-256 digest of an API key.
pub type KeyDigest = [u8; 32];

const NO_PLAN: u32 = u32::MAX;

/// Every consumer: name, plan and keys, by index.
pub struct Consumers {
    names: String,
    /// End of each name in `names` (its start is the previous end).
    name_ends: Vec<u32>,
    plans: Vec<u32>,
    by_name: HashTable<u32>,
    keys: Vec<u8>,
    key_ends: Vec<u32>,
    key_owner: Vec<u32>,
    by_key: HashTable<u32>,
    digests: Vec<KeyDigest>,
    digest_owner: Vec<u32>,
    by_digest: HashTable<u32>,
    /// Random per table: keys are chosen by clients, so they cannot be aimed at one bucket.
    hasher: foldhash::fast::RandomState,
}

impl std::fmt::Debug for Consumers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumers")
            .field("len", &self.len())
            .field("keys", &self.key_owner.len())
            .field("digests", &self.digests.len())
            .finish()
    }
}

impl Default for Consumers {
    fn default() -> Self {
        Consumers::with_capacity(0, 0)
    }
}

/// Why a consumer could not be added.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Conflict {
    /// The name is taken by the consumer at this index.
    Name(usize),
    /// A key is taken by the consumer at `other` (this one's index when the consumer
    /// lists it twice); `at` is the key's place: `keys[at]`, or `key_sha256[at - keys]`.
    Key {
        /// The consumer holding it.
        other: usize,
        /// Which of the new consumer's keys.
        at: usize,
    },
    /// The names or keys passed 4 GiB in all.
    TooLarge,
}

fn span(ends: &[u32], i: usize) -> std::ops::Range<usize> {
    let start = if i == 0 { 0 } else { ends[i - 1] as usize };
    start..ends[i] as usize
}

/// The SHA-256 digest of a key, as `key_sha256` entries give it.
pub fn key_digest(key: &[u8]) -> KeyDigest {
    Sha256::digest(key).into()
}

impl Consumers {
    /// An empty table with room for `consumers` consumers holding `keys` keys in all.
    pub fn with_capacity(consumers: usize, keys: usize) -> Self {
        Consumers {
            names: String::with_capacity(consumers * 8),
            name_ends: Vec::with_capacity(consumers),
            plans: Vec::with_capacity(consumers),
            by_name: HashTable::with_capacity(consumers),
            keys: Vec::new(),
            key_ends: Vec::with_capacity(keys),
            key_owner: Vec::with_capacity(keys),
            by_key: HashTable::with_capacity(keys),
            digests: Vec::new(),
            digest_owner: Vec::new(),
            by_digest: HashTable::new(),
            hasher: foldhash::fast::RandomState::default(),
        }
    }

    /// Makes room for `more` consumers with a key each.
    pub fn reserve(&mut self, more: usize) {
        let hasher = self.hasher.clone();
        self.name_ends.reserve(more);
        self.plans.reserve(more);
        self.key_ends.reserve(more);
        self.key_owner.reserve(more);
        let (names, ends) = (&self.names, &self.name_ends);
        self.by_name.reserve(more, |&i| {
            hasher.hash_one(&names.as_bytes()[span(ends, i as usize)])
        });
        let (keys, kends) = (&self.keys, &self.key_ends);
        self.by_key
            .reserve(more, |&i| hasher.hash_one(&keys[span(kends, i as usize)]));
    }

    /// Number of consumers.
    pub fn len(&self) -> usize {
        self.name_ends.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.name_ends.is_empty()
    }

    /// Consumer `i`'s name (names are printable ASCII, checked when added).
    pub fn name(&self, i: usize) -> &str {
        // A `String` arena: slicing it checks two boundaries, not the whole name.
        self.names.get(span(&self.name_ends, i)).unwrap_or("")
    }

    /// Consumer `i`'s plan: an index into [`crate::Config::plans`].
    pub fn plan(&self, i: usize) -> Option<usize> {
        match self.plans[i] {
            NO_PLAN => None,
            p => Some(p as usize),
        }
    }

    /// The consumer named `name`.
    pub fn find(&self, name: &str) -> Option<usize> {
        let h = self.hasher.hash_one(name.as_bytes());
        self.by_name
            .find(h, |&i| self.name(i as usize) == name)
            .map(|&i| i as usize)
    }

    /// The consumer a presented key identifies: as written, else (when the table holds
    /// digests) by its SHA-256.
    pub fn by_key(&self, key: &[u8]) -> Option<usize> {
        if let Some(owner) = self.plain_owner(key) {
            return Some(owner);
        }
        if self.digests.is_empty() {
            return None;
        }
        self.by_digest(&key_digest(key))
    }

    fn by_digest(&self, d: &KeyDigest) -> Option<usize> {
        let h = self.hasher.hash_one(d);
        self.by_digest
            .find(h, |&k| self.digests[k as usize] == *d)
            .map(|&k| self.digest_owner[k as usize] as usize)
    }

    fn plain_owner(&self, key: &[u8]) -> Option<usize> {
        let h = self.hasher.hash_one(key);
        self.by_key
            .find(h, |&k| &self.keys[span(&self.key_ends, k as usize)] == key)
            .map(|&k| self.key_owner[k as usize] as usize)
    }

    /// Adds a consumer. Nothing is added when the name or a key is already taken.
    pub fn push(
        &mut self,
        name: &str,
        plan: Option<usize>,
        keys: &[&str],
        digests: &[KeyDigest],
    ) -> Result<usize, Conflict> {
        if let Some(other) = self.find(name) {
            return Err(Conflict::Name(other));
        }
        for (j, k) in keys.iter().enumerate() {
            if let Some(other) = self.plain_owner(k.as_bytes()) {
                return Err(Conflict::Key { other, at: j });
            }
            if keys[..j].contains(k) {
                return Err(Conflict::Key {
                    other: self.len(),
                    at: j,
                });
            }
        }
        for (j, d) in digests.iter().enumerate() {
            let at = keys.len() + j;
            if let Some(other) = self.by_digest(d) {
                return Err(Conflict::Key { other, at });
            }
            if digests[..j].contains(d) {
                return Err(Conflict::Key {
                    other: self.len(),
                    at,
                });
            }
        }
        let too_big = |len: usize, add: usize| u32::try_from(len + add).is_err();
        if too_big(self.names.len(), name.len())
            || too_big(self.keys.len(), keys.iter().map(|k| k.len()).sum())
            || too_big(self.len(), 1)
        {
            return Err(Conflict::TooLarge);
        }
        let me = self.len() as u32;
        self.names.push_str(name);
        self.name_ends.push(self.names.len() as u32);
        self.plans
            .push(plan.and_then(|p| u32::try_from(p).ok()).unwrap_or(NO_PLAN));
        let hasher = self.hasher.clone();
        let h = hasher.hash_one(name.as_bytes());
        let (names, ends) = (&self.names, &self.name_ends);
        self.by_name.insert_unique(h, me, |&i| {
            hasher.hash_one(&names.as_bytes()[span(ends, i as usize)])
        });
        for k in keys {
            self.keys.extend_from_slice(k.as_bytes());
            self.key_ends.push(self.keys.len() as u32);
            self.key_owner.push(me);
            let ix = (self.key_owner.len() - 1) as u32;
            let (bytes, ends) = (&self.keys, &self.key_ends);
            self.by_key
                .insert_unique(hasher.hash_one(k.as_bytes()), ix, |&i| {
                    hasher.hash_one(&bytes[span(ends, i as usize)])
                });
        }
        for d in digests {
            self.digests.push(*d);
            self.digest_owner.push(me);
            let ix = (self.digests.len() - 1) as u32;
            let all = &self.digests;
            self.by_digest.insert_unique(hasher.hash_one(d), ix, |&i| {
                hasher.hash_one(all[i as usize])
            });
        }
        Ok(me as usize)
    }

    /// Pairs of consumers where one's plain key is the other's hashed key: `(plain key's
    /// owner, digest's owner)`. Checked once the table is built (one SHA-256 per plain key,
    /// and only when the table holds both kinds).
    pub fn cross_conflicts(&self) -> Vec<(usize, usize)> {
        if self.digests.is_empty() {
            return Vec::new();
        }
        (0..self.key_owner.len())
            .filter_map(|k| {
                let d = key_digest(&self.keys[span(&self.key_ends, k)]);
                let owner = self.key_owner[k] as usize;
                self.by_digest(&d).map(|other| (owner, other))
            })
            .collect()
    }

    /// Gives back memory reserved beyond what the table holds.
    pub fn shrink_to_fit(&mut self) {
        let hasher = self.hasher.clone();
        self.names.shrink_to_fit();
        self.name_ends.shrink_to_fit();
        self.plans.shrink_to_fit();
        self.keys.shrink_to_fit();
        self.key_ends.shrink_to_fit();
        self.key_owner.shrink_to_fit();
        self.digests.shrink_to_fit();
        self.digest_owner.shrink_to_fit();
        let (names, ends) = (&self.names, &self.name_ends);
        self.by_name
            .shrink_to_fit(|&i| hasher.hash_one(&names.as_bytes()[span(ends, i as usize)]));
        let (keys, kends) = (&self.keys, &self.key_ends);
        self.by_key
            .shrink_to_fit(|&i| hasher.hash_one(&keys[span(kends, i as usize)]));
        let all = &self.digests;
        self.by_digest
            .shrink_to_fit(|&i| hasher.hash_one(all[i as usize]));
    }
}
