//! Consumers compiled into a compact table, so a million of them fit in well under 128 bytes
//! each: names live in a byte arena, each consumer's name end and plan side by side, and
//! three tables find a consumer by name, by key (its fingerprint) and by key digest.
//!
//! A key lookup with a million consumers misses the CPU caches at every step, so the steps
//! are few: plain keys are found by a keyed fingerprint whose slot names the owner
//! (see `key_table`), with no key bytes to read, and the owner's plan sits beside its
//! name's end. The keys' bytes are kept only while the table is built, to check them
//! against the hashed keys.
//!
//! Keys may be given as SHA-256 digests (`key_sha256`) so that a consumers file holds no
//! secrets. A key a client presents is looked up as written first; only when that misses and
//! the table holds digests is it hashed (one SHA-256 of the key, ≈ 0.1–0.3 µs).

use crate::key_table::{Fingerprint, KeyTable};
use hashbrown::HashTable;
use sha2::{Digest, Sha256};
use smallvec::SmallVec;
use std::hash::BuildHasher;

/// A SHA-256 digest of an API key.
pub type KeyDigest = [u8; 32];

const NO_PLAN: u32 = u32::MAX;

/// A consumer's place in the name arena and its plan, read together.
#[derive(Debug, Clone, Copy)]
struct Person {
    /// End of the name in `names` (its start is the previous consumer's end).
    name_end: u32,
    plan: u32,
}

/// A key (or digest) and its owner, as the lookup tables hold them.
#[derive(Debug, Clone, Copy)]
struct KeyRef {
    /// Where the key ends in `keys` (it starts where the one before it ends), or the
    /// digest's index.
    at: u32,
    owner: u32,
}

/// Every consumer: name, plan and keys, by index.
pub struct Consumers {
    names: String,
    people: Vec<Person>,
    by_name: HashTable<u32>,
    /// Plain keys by fingerprint.
    plain: KeyTable,
    /// While the table is built: each plain key, end to end, and where each ends with its
    /// owner (for [`Consumers::digest_plain_keys`]).
    keys: Vec<u8>,
    key_list: Vec<KeyRef>,
    digests: Vec<KeyDigest>,
    by_digest: HashTable<KeyRef>,
    /// Where the admin API may give keys (as digests): the first 8 bytes of each plain
    /// key's SHA-256, sorted, and (`plain_digest_owners`, in the same order) its owner,
    /// to find a plain key of the config among digests once the keys' bytes are gone.
    plain_digests: Vec<u64>,
    plain_digest_owners: Vec<u32>,
    /// Random per table: keys are chosen by clients, so they cannot be aimed at one bucket.
    hasher: foldhash::fast::RandomState,
}

impl std::fmt::Debug for Consumers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumers")
            .field("len", &self.len())
            .field("keys", &self.plain.len())
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

fn span(people: &[Person], i: usize) -> std::ops::Range<usize> {
    let start = if i == 0 {
        0
    } else {
        people[i - 1].name_end as usize
    };
    start..people[i].name_end as usize
}

/// The `k`-th plain key in the key arena.
fn key_at<'a>(keys: &'a [u8], list: &[KeyRef], k: usize) -> &'a [u8] {
    let start = if k == 0 { 0 } else { list[k - 1].at as usize };
    keys.get(start..list[k].at as usize).unwrap_or(&[])
}

/// A digest's first 8 bytes, as a number.
fn digest_prefix(d: &KeyDigest) -> u64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&d[..8]);
    u64::from_be_bytes(first)
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
            people: Vec::with_capacity(consumers),
            by_name: HashTable::with_capacity(consumers),
            plain: KeyTable::with_capacity(keys),
            keys: Vec::new(),
            key_list: Vec::new(),
            digests: Vec::new(),
            by_digest: HashTable::new(),
            plain_digests: Vec::new(),
            plain_digest_owners: Vec::new(),
            hasher: foldhash::fast::RandomState::default(),
        }
    }

    /// Makes room for `more` consumers with a key each.
    pub fn reserve(&mut self, more: usize) {
        let hasher = self.hasher.clone();
        self.people.reserve(more);
        let (names, people) = (&self.names, &self.people);
        self.by_name.reserve(more, |&i| {
            hasher.hash_one(&names.as_bytes()[span(people, i as usize)])
        });
        self.plain.reserve(more);
    }

    /// Number of consumers.
    pub fn len(&self) -> usize {
        self.people.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.people.is_empty()
    }

    /// Consumer `i`'s name (names are printable ASCII, checked when added).
    pub fn name(&self, i: usize) -> &str {
        // A `String` arena: slicing it checks two boundaries, not the whole name.
        self.names.get(span(&self.people, i)).unwrap_or("")
    }

    /// Consumer `i`'s plan: an index into [`crate::Config::plans`].
    pub fn plan(&self, i: usize) -> Option<usize> {
        match self.people[i].plan {
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
            .find(h, |r| self.digests[r.at as usize] == *d)
            .map(|r| r.owner as usize)
    }

    /// The consumer the config gives the key with this SHA-256, as a digest
    /// (`key_sha256`) or as the key itself (`keys`, found by the digest's first 8 bytes:
    /// two keys sharing them are one in 10^13 at a million keys).
    pub fn digest_owner(&self, d: &KeyDigest) -> Option<usize> {
        if let Some(owner) = self.by_digest(d) {
            return Some(owner);
        }
        let prefix = digest_prefix(d);
        self.plain_digests
            .binary_search(&prefix)
            .ok()
            .map(|at| self.plain_digest_owners[at] as usize)
    }

    fn plain_owner(&self, key: &[u8]) -> Option<usize> {
        self.plain.get(key).map(|o| o as usize)
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
        // Each key fingerprinted once, to check it and then to add it.
        let prints: SmallVec<[Fingerprint; 2]> = keys
            .iter()
            .map(|k| self.plain.fingerprint(k.as_bytes()))
            .collect();
        for (j, (k, f)) in keys.iter().zip(&prints).enumerate() {
            if let Some(other) = self.plain.find(f) {
                return Err(Conflict::Key {
                    other: other as usize,
                    at: j,
                });
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
            || too_big(self.digests.len(), digests.len())
            || too_big(self.len(), 1)
        {
            return Err(Conflict::TooLarge);
        }
        let me = self.len() as u32;
        self.names.push_str(name);
        self.people.push(Person {
            name_end: self.names.len() as u32,
            plan: plan.and_then(|p| u32::try_from(p).ok()).unwrap_or(NO_PLAN),
        });
        let hasher = self.hasher.clone();
        let h = hasher.hash_one(name.as_bytes());
        let (names, people) = (&self.names, &self.people);
        self.by_name.insert_unique(h, me, |&i| {
            hasher.hash_one(&names.as_bytes()[span(people, i as usize)])
        });
        for (k, f) in keys.iter().zip(prints) {
            // Checked free above, so this adds it.
            let _ = self.plain.insert(f, me);
            self.keys.extend_from_slice(k.as_bytes());
            let at = self.keys.len() as u32;
            self.key_list.push(KeyRef { at, owner: me });
        }
        for d in digests {
            let at = self.digests.len() as u32;
            self.digests.push(*d);
            let all = &self.digests;
            self.by_digest
                .insert_unique(hasher.hash_one(d), KeyRef { at, owner: me }, |r| {
                    hasher.hash_one(all[r.at as usize])
                });
        }
        Ok(me as usize)
    }

    /// Hashes each plain key once the table is built, before [`Consumers::shrink_to_fit`]
    /// drops their bytes, and only when needed (the table holds digests, or `index`):
    /// returns the pairs where one consumer's plain key is another's hashed key (`(plain
    /// key's owner, digest's owner)`), and with `index` keeps the plain keys by the first
    /// 8 bytes of their digest for [`Consumers::digest_owner`] (12 bytes a key; where the
    /// admin API may give keys).
    pub fn digest_plain_keys(&mut self, index: bool) -> Vec<(usize, usize)> {
        if self.digests.is_empty() && !index {
            return Vec::new();
        }
        let mut found = Vec::new();
        let mut pairs: Vec<(u64, u32)> = Vec::new();
        for k in 0..self.key_list.len() {
            let d = key_digest(key_at(&self.keys, &self.key_list, k));
            let owner = self.key_list[k].owner;
            if let Some(other) = self.by_digest(&d) {
                found.push((owner as usize, other));
            }
            if index {
                pairs.push((digest_prefix(&d), owner));
            }
        }
        if index {
            pairs.sort_unstable();
            self.plain_digests = pairs.iter().map(|p| p.0).collect();
            self.plain_digest_owners = pairs.iter().map(|p| p.1).collect();
        }
        found.sort_unstable();
        found
    }

    /// Gives back memory reserved beyond what the table holds, and the plain keys' bytes:
    /// lookups need only their fingerprints.
    pub fn shrink_to_fit(&mut self) {
        let hasher = self.hasher.clone();
        self.names.shrink_to_fit();
        self.people.shrink_to_fit();
        self.keys = Vec::new();
        self.key_list = Vec::new();
        self.plain.shrink_to_fit();
        self.digests.shrink_to_fit();
        let (names, people) = (&self.names, &self.people);
        self.by_name
            .shrink_to_fit(|&i| hasher.hash_one(&names.as_bytes()[span(people, i as usize)]));
        let all = &self.digests;
        self.by_digest
            .shrink_to_fit(|r| hasher.hash_one(all[r.at as usize]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_of_every_length_class_are_found_by_their_owner() {
        let keys: Vec<String> = [1, 127, 128, 300, 16_383, 16_384, 70_000]
            .iter()
            .enumerate()
            .map(|(i, &n)| char::from(b'a' + i as u8).to_string().repeat(n))
            .collect();
        let mut t = Consumers::default();
        for (i, k) in keys.iter().enumerate() {
            let me = t.push(&format!("c{i}"), Some(i), &[k.as_str()], &[]);
            assert_eq!(me, Ok(i));
        }
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(t.by_key(k.as_bytes()), Some(i), "key of length {}", k.len());
            assert_eq!(t.plan(i), Some(i));
            assert_eq!(t.name(i), format!("c{i}"));
        }
        // A prefix or an extension of a stored key is another key.
        assert_eq!(t.by_key(&keys[3].as_bytes()[1..]), None);
        assert_eq!(t.by_key(format!("{}b", keys[1]).as_bytes()), None);
        t.shrink_to_fit();
        assert_eq!(t.by_key(keys[6].as_bytes()), Some(6));
    }

    #[test]
    fn hashed_keys_name_their_owner_and_clashes_are_reported_in_order() {
        let mut t = Consumers::default();
        assert_eq!(t.push("a", None, &["k1", "k2"], &[]), Ok(0));
        assert_eq!(t.push("b", None, &[], &[key_digest(b"k2")]), Ok(1));
        assert_eq!(t.push("c", None, &[], &[key_digest(b"k1")]), Ok(2));
        assert_eq!(t.by_key(b"k2"), Some(0), "the plain key is looked up first");
        assert_eq!(t.plan(1), None);
        assert_eq!(t.digest_plain_keys(false), vec![(0, 1), (0, 2)]);
        assert_eq!(
            t.push("d", None, &[], &[key_digest(b"k1")]),
            Err(Conflict::Key { other: 2, at: 0 })
        );
        assert_eq!(
            t.push("e", None, &["k3", "k1"], &[]),
            Err(Conflict::Key { other: 0, at: 1 })
        );
    }

    #[test]
    fn a_digest_finds_its_owner_among_plain_and_hashed_keys_once_the_bytes_are_gone() {
        let mut t = Consumers::default();
        for i in 0..1000u32 {
            let k = format!("key-{i}");
            assert_eq!(
                t.push(&format!("c{i}"), None, &[k.as_str()], &[]),
                Ok(i as usize)
            );
        }
        assert_eq!(t.push("h", None, &[], &[key_digest(b"hashed")]), Ok(1000));
        assert!(t.digest_plain_keys(true).is_empty());
        t.shrink_to_fit();
        for i in [0u32, 1, 499, 999] {
            let d = key_digest(format!("key-{i}").as_bytes());
            assert_eq!(t.digest_owner(&d), Some(i as usize));
        }
        assert_eq!(t.digest_owner(&key_digest(b"hashed")), Some(1000));
        assert_eq!(t.digest_owner(&key_digest(b"key-1000")), None);
    }
}
