//! The store: stored responses by key, bounded in bytes, the least valuable evicted first
//! (moka: TinyLFU admission, LRU eviction). A key is the URI key (route, host, path and the
//! query parameters the route keys on) and the variant (the consumer unless the route is
//! shared, the route's key headers, and the request headers the response `Vary`s on).

use super::control::Freshness;
use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::StatusCode;
use parking_lot::Mutex;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A stored response.
#[derive(Debug)]
pub struct Entry {
    /// Status.
    pub status: StatusCode,
    /// Headers as stored (no hop-by-hop, no `Age`).
    pub headers: HeaderMap,
    /// The whole body.
    pub body: Bytes,
    /// Lifetime and the rules for serving it stale.
    pub fresh: Freshness,
    /// Gateway clock (nanoseconds) when it arrived or was last revalidated.
    pub stored_ns: u64,
    /// The request's host (lower case, no port): what purges by URL match.
    pub host: String,
    /// Path and the keyed query: what purges by URL and prefix match.
    pub path: String,
    /// Surrogate keys (`Surrogate-Key`, `Cache-Tag`): what purges by tag match.
    pub tags: Vec<String>,
    /// What is stored for its URI, and the URI's generation when its request went
    /// upstream: an invalidation of the URI since then makes it unusable.
    pub born: Born,
}

/// The URI an entry was fetched for, and that URI's generation at the time.
#[derive(Debug, Clone)]
pub struct Born {
    uri: Arc<UriInfo>,
    generation: u64,
    /// The invalidation table, the URI's slot in it and the slot's count when the request
    /// went upstream: a URI with nothing stored has no info in the index, and this is what
    /// tells an answer fetched for it that an invalidation came meanwhile.
    table: Arc<[AtomicU64]>,
    slot: usize,
    slot_count: u64,
}

impl Born {
    /// Whether no unsafe method has invalidated the URI since its info was taken.
    pub fn current(&self) -> bool {
        self.uri.generation.load(Ordering::Acquire) == self.generation
    }

    /// Whether the answer fetched may still be stored: no invalidation of its URI (or of
    /// another URI in the same slot, which at worst skips one store) since it left.
    pub fn unchanged(&self) -> bool {
        self.current() && self.table[self.slot].load(Ordering::Acquire) == self.slot_count
    }
}

impl Entry {
    /// Its current age (RFC 9111 §4.2.3).
    pub fn age(&self, now_ns: u64) -> Duration {
        self.fresh.initial_age + Duration::from_nanos(now_ns.saturating_sub(self.stored_ns))
    }

    /// Seconds of freshness left (negative once stale).
    pub fn ttl(&self, now_ns: u64) -> i64 {
        let age = self.age(now_ns).as_secs_f64();
        (self.fresh.lifetime.as_secs_f64() - age).floor() as i64
    }

    /// Whether it may be served without asking the upstream.
    pub fn is_fresh(&self, now_ns: u64) -> bool {
        !self.fresh.no_cache && self.age(now_ns) < self.fresh.lifetime
    }

    /// Whether it may be served stale for this long past its lifetime.
    pub fn stale_within(&self, now_ns: u64, window: Duration) -> bool {
        !self.fresh.must_revalidate
            && !self.fresh.no_cache
            && self.age(now_ns) < self.fresh.lifetime + window
    }

    /// Bytes it takes in the store.
    fn weight(&self, key: &str) -> u32 {
        let headers: usize = self
            .headers
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len() + 32)
            .sum();
        let n = key.len() + self.host.len() + self.path.len() + headers + self.body.len() + 256;
        u32::try_from(n).unwrap_or(u32::MAX)
    }
}

/// What is stored for one URI: what its responses vary on (empty: nothing), its
/// generation (raised by each invalidation: entries of an older one are never served),
/// and the keys of its variants, so that invalidating the URI frees those at once.
#[derive(Debug, Default)]
pub struct UriInfo {
    /// The URI key it is filed under in the index.
    key: String,
    varies: Mutex<Option<Varies>>,
    generation: AtomicU64,
    keys: Mutex<Vec<String>>,
}

/// Most variant keys remembered per URI for freeing at invalidation. Past it the oldest
/// are forgotten: the generation still keeps those variants from being served, and
/// eviction frees them.
const MAX_VARIANTS: usize = 4096;

/// How long requests for a key whose answer could not be stored go straight upstream
/// (Varnish's hit-for-pass, kept short so that caching resumes soon after, say, one 500).
pub const UNCACHEABLE_FOR: Duration = Duration::from_secs(5);

/// Slots of the invalidation table ([`Born`]): 32 KiB, whatever the traffic.
const INVALIDATION_SLOTS: usize = 4096;

/// foldhash: moka's default SipHash costs more than the rest of a lookup.
type Hasher = foldhash::fast::RandomState;

/// Slots of the [`PassTable`].
const PASS_SLOTS: usize = 16_384;

/// Varnish's hit-for-pass markers: for each key whose last answer could not be stored,
/// the gateway clock (ns) until which its requests go straight upstream. A direct-mapped
/// table of (hash of the key, until): checked before the store, at the cost of one hash
/// and two loads, with no allocation and no housekeeping. It is lossy by design: a marker
/// overwritten by another key's only sends one more request down the storing path, and a
/// torn read at worst keeps one key passing a little longer.
struct PassTable {
    slots: Box<[(AtomicU64, AtomicU64)]>,
    hasher: Hasher,
}

impl PassTable {
    fn new() -> Self {
        PassTable {
            slots: (0..PASS_SLOTS)
                .map(|_| (AtomicU64::new(0), AtomicU64::new(0)))
                .collect(),
            hasher: Hasher::default(),
        }
    }

    /// `key`'s slot and tag (never 0, the tag of an empty slot).
    fn slot(&self, key: &str) -> (&(AtomicU64, AtomicU64), u64) {
        let h = self.hasher.hash_one(key);
        // The low bits pick the slot; the whole hash is the tag.
        let i = usize::try_from(h % PASS_SLOTS as u64).unwrap_or(0);
        (&self.slots[i], h | 1)
    }

    fn mark(&self, key: &str, until: u64) {
        let ((tag, at), t) = self.slot(key);
        at.store(until, Ordering::Relaxed);
        tag.store(t, Ordering::Release);
    }

    /// Stops `key` passing, leaving a slot that another key holds as it is.
    fn clear(&self, key: &str) {
        let ((tag, at), t) = self.slot(key);
        if tag.load(Ordering::Acquire) == t {
            at.store(0, Ordering::Relaxed);
        }
    }

    /// Until when `key` passes (0: it does not).
    fn until(&self, key: &str) -> u64 {
        let ((tag, at), t) = self.slot(key);
        if tag.load(Ordering::Acquire) == t {
            at.load(Ordering::Relaxed)
        } else {
            0
        }
    }
}

/// The request headers that form a key, by name.
pub type Varies = Arc<[HeaderName]>;

/// Counters of the store for `/metrics`.
#[derive(Debug, Default)]
pub struct CacheMetrics {
    /// Served from the store without asking the upstream.
    pub hits: AtomicU64,
    /// Went upstream: nothing stored, or nothing usable.
    pub misses: AtomicU64,
    /// Served stale (while revalidating, or because the upstream failed).
    pub stale: AtomicU64,
    /// Stale entries revalidated by a 304.
    pub revalidated: AtomicU64,
    /// Waited for another request's answer to the same key and were served from it.
    pub coalesced: AtomicU64,
    /// Requests waiting now for another request's answer to the same key.
    pub waiting: AtomicU64,
    /// Responses stored.
    pub stored: AtomicU64,
    /// Entries evicted to make room.
    pub evictions: AtomicU64,
    /// Entries removed by purges and unsafe methods.
    pub purged: AtomicU64,
}

/// The store shared by every route; outlives reloads.
pub struct Store {
    entries: moka::sync::Cache<String, Arc<Entry>, Hasher>,
    /// URI key → what its responses vary on, its generation and the keys of its stored
    /// variants. Only URIs with something stored are filed here (a miss files nothing, so
    /// unique URLs whose answers are never stored cost no memory); an info is dropped
    /// once no entry holds it.
    uris: dashmap::DashMap<String, Arc<UriInfo>, Hasher>,
    /// Invalidations by slot of the URI key's hash (see [`Born`]).
    invalidations: Arc<[AtomicU64]>,
    hasher: Hasher,
    /// Stores since the last sweep of unreferenced URI infos.
    puts: AtomicU64,
    /// Whether a response that varies was ever stored: until then no lookup needs `varies`.
    any_vary: AtomicBool,
    /// Keys whose last answer could not be stored: requests for them go straight upstream
    /// for a while, neither looking up, nor waiting for one another, nor storing.
    uncacheable: PassTable,
    /// Largest response stored.
    pub max_object: u64,
    /// Counters.
    pub metrics: Arc<CacheMetrics>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("entries", &self.entries.entry_count())
            .finish()
    }
}

impl Store {
    /// A store of at most `max_size` bytes, keeping responses up to `max_object` bytes.
    pub fn new(max_size: u64, max_object: u64) -> Store {
        let metrics = Arc::new(CacheMetrics::default());
        let m = metrics.clone();
        let entries = moka::sync::Cache::builder()
            .max_capacity(max_size)
            .weigher(|k: &String, v: &Arc<Entry>| v.weight(k))
            .eviction_listener(move |_, _, cause| {
                if cause == moka::notification::RemovalCause::Size {
                    m.evictions.fetch_add(1, Ordering::Relaxed);
                }
            })
            .build_with_hasher(Hasher::default());
        let uris = dashmap::DashMap::with_hasher(Hasher::default());
        let uncacheable = PassTable::new();
        Store {
            entries,
            uris,
            invalidations: (0..INVALIDATION_SLOTS).map(|_| AtomicU64::new(0)).collect(),
            hasher: Hasher::default(),
            puts: AtomicU64::new(0),
            any_vary: AtomicBool::new(false),
            uncacheable,
            max_object,
            metrics,
        }
    }

    /// The headers responses under `uri` vary on, when a response that varies was stored
    /// for it. Costs nothing until some stored response varies.
    pub fn varies(&self, uri: &str) -> Option<Varies> {
        if !self.any_vary.load(Ordering::Relaxed) {
            return None;
        }
        self.uris.get(uri)?.varies.lock().clone()
    }

    /// What is stored for `uri` and its generation now: taken before a request goes
    /// upstream, so that an invalidation while it is away keeps its answer out. Files
    /// nothing in the index.
    pub fn born(&self, uri: &str) -> Born {
        let info = match self.uris.get(uri) {
            Some(i) => i.clone(),
            None => Arc::new(UriInfo {
                key: uri.to_string(),
                ..UriInfo::default()
            }),
        };
        let generation = info.generation.load(Ordering::Acquire);
        let slot = self.slot(uri);
        Born {
            uri: info,
            generation,
            table: self.invalidations.clone(),
            slot,
            slot_count: self.invalidations[slot].load(Ordering::Acquire),
        }
    }

    fn slot(&self, uri: &str) -> usize {
        usize::try_from(self.hasher.hash_one(uri) % INVALIDATION_SLOTS as u64).unwrap_or(0)
    }

    /// URI infos in the index (for `/metrics`): at most about twice the entries.
    pub fn index_len(&self) -> usize {
        self.uris.len()
    }

    /// Notes at `now_ns` that the last answer for `flight` could not be stored.
    pub fn mark_uncacheable(&self, flight: &str, now_ns: u64) {
        let until = now_ns.saturating_add(UNCACHEABLE_FOR.as_nanos() as u64);
        self.uncacheable.mark(flight, until);
    }

    /// An answer for `flight` was stored: requests for it look up again.
    pub fn cacheable_again(&self, flight: &str) {
        self.uncacheable.clear(flight);
    }

    /// Whether an answer for `flight` could not be stored within [`UNCACHEABLE_FOR`].
    pub fn is_uncacheable(&self, flight: &str, now_ns: u64) -> bool {
        self.uncacheable.until(flight) > now_ns
    }

    /// The entry under `key`, unless its URI was invalidated since it was fetched.
    pub fn get(&self, key: &str) -> Option<Arc<Entry>> {
        self.entries.get(key).filter(|e| e.born.current())
    }

    /// Stores `entry` under `key`, noting it and what it varies on (if anything) under its
    /// URI; not when the URI was invalidated while the entry's request was upstream.
    pub fn put(&self, varies: Varies, mut key: String, mut entry: Entry) {
        // Kept as long as the entry: without the room it was built in.
        key.shrink_to_fit();
        // Filed first, its generation read, then the slot checked: an invalidation either
        // came before the check (nothing stored) or finds the info and outdates the entry.
        let info = self
            .uris
            .entry(entry.born.uri.key.clone())
            .or_insert_with(|| entry.born.uri.clone())
            .clone();
        if !entry.born.unchanged() {
            return;
        }
        if !Arc::ptr_eq(&info, &entry.born.uri) {
            entry.born = Born {
                generation: info.generation.load(Ordering::Acquire),
                uri: info.clone(),
                ..entry.born
            };
            if !entry.born.unchanged() {
                return;
            }
        }
        if varies.is_empty() {
            *info.varies.lock() = None;
        } else {
            self.any_vary.store(true, Ordering::Relaxed);
            *info.varies.lock() = Some(varies);
        }
        {
            let mut keys = info.keys.lock();
            if !keys.contains(&key) {
                // Keys of variants evicted since are let go as the list doubles: it holds
                // about the variants stored, whose keys the store counts, and not every
                // variant ever stored.
                if keys.len() >= MAX_VARIANTS || (keys.len() >= 64 && keys.len().is_power_of_two())
                {
                    keys.retain(|k| self.entries.contains_key(k));
                }
                if keys.len() >= MAX_VARIANTS {
                    keys.remove(0);
                }
                keys.push(key.clone());
            }
        }
        // What is kept holds its own bytes, whoever stores it.
        entry.headers = owned(&entry.headers);
        self.entries.insert(key, Arc::new(entry));
        self.metrics.stored.fetch_add(1, Ordering::Relaxed);
        self.sweep_now_and_then();
    }

    /// Drops the URI infos nothing holds any more, once the map has grown well past the
    /// entries (amortized: one pass per many stores).
    fn sweep_now_and_then(&self) {
        let n = self.puts.fetch_add(1, Ordering::Relaxed);
        if n % 256 != 255 {
            return;
        }
        if self.uris.len() as u64 > 2 * self.entries.entry_count() + 256 {
            // The shard's lock is held while an info is judged: no request can take it
            // between the count and the removal.
            self.uris.retain(|_, info| Arc::strong_count(info) > 1);
        }
    }

    /// Makes every variant stored under `uri` (and every answer on its way upstream for
    /// it) unusable, and frees the variants it knows of.
    pub fn invalidate_uri(&self, uri: &str) {
        self.invalidations[self.slot(uri)].fetch_add(1, Ordering::AcqRel);
        let info = match self.uris.get(uri) {
            Some(i) => i.clone(),
            None => return,
        };
        info.generation.fetch_add(1, Ordering::AcqRel);
        let keys = std::mem::take(&mut *info.keys.lock());
        let mut n = 0;
        for k in keys {
            if self.entries.remove(&k).is_some() {
                n += 1;
            }
        }
        self.metrics.purged.fetch_add(n, Ordering::Relaxed);
    }

    /// Removes the entries `pred` picks; returns how many there were.
    pub fn purge_where(&self, pred: impl Fn(&String, &Arc<Entry>) -> bool) -> u64 {
        // Writes not yet applied by moka's housekeeping are not seen by `iter`.
        self.entries.run_pending_tasks();
        let keys: Vec<Arc<String>> = self
            .entries
            .iter()
            .filter(|(k, v)| v.born.current() && pred(k, v))
            .map(|(k, _)| k)
            .collect();
        for k in &keys {
            self.entries.invalidate(k.as_str());
        }
        let n = keys.len() as u64;
        self.metrics.purged.fetch_add(n, Ordering::Relaxed);
        n
    }

    /// Removes everything; returns how many entries there were.
    pub fn purge_all(&self) -> u64 {
        self.entries.run_pending_tasks();
        let n = self.entries.entry_count();
        self.entries.invalidate_all();
        for slot in self.invalidations.iter() {
            slot.fetch_add(1, Ordering::AcqRel);
        }
        for info in self.uris.iter() {
            info.generation.fetch_add(1, Ordering::AcqRel);
            info.keys.lock().clear();
        }
        self.metrics.purged.fetch_add(n, Ordering::Relaxed);
        n
    }

    /// Entries and bytes held (after pending evictions have run).
    pub fn usage(&self) -> (u64, u64) {
        self.entries.run_pending_tasks();
        (self.entries.entry_count(), self.entries.weighted_size())
    }
}

/// A copy of `h` whose values hold their own bytes: an answer's values may be slices of
/// its whole head (`upstream::h1`), and what the store keeps must not keep more than it
/// counts ([`Entry`]'s weight). [`Store::put`] keeps only such copies.
fn owned(h: &HeaderMap) -> HeaderMap {
    // Room for what each hit adds (Age, Cache-Status, the request id, ...): a clone
    // keeps the capacity, and a full map would grow on every hit.
    let mut out = HeaderMap::with_capacity(h.len() + 6);
    for (name, v) in h {
        let mut copy = HeaderValue::from_bytes(v.as_bytes()).unwrap_or_else(|_| v.clone());
        copy.set_sensitive(v.is_sensitive());
        out.append(name.clone(), copy);
    }
    out
}

/// The surrogate keys a response names.
pub fn tags(resp: &HeaderMap) -> Vec<String> {
    let mut out = Vec::new();
    for name in ["surrogate-key", "cache-tag"] {
        for v in resp.get_all(name) {
            let v: &HeaderValue = v;
            if let Ok(s) = v.to_str() {
                out.extend(
                    s.split([' ', ','])
                        .filter(|t| !t.is_empty())
                        .map(str::to_string),
                );
            }
        }
    }
    out
}

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
