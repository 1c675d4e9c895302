//! Tokens already verified, remembered until they expire so that a caller repeating its
//! token pays a lookup rather than a signature check. Bounded in bytes; an entry made
//! under older keys is verified again.

use http::{HeaderName, HeaderValue};
use moka::sync::Cache;
use smallvec::SmallVec;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest a token is remembered, whatever its `exp`.
const MAX_REMEMBERED: Duration = Duration::from_secs(3600);

/// What a verified token says, as the request path needs it.
#[derive(Debug)]
pub struct Verified {
    /// The consumer, by index in the snapshot (a listed consumer or a guest).
    pub consumer: usize,
    /// `exp`, in seconds since the epoch.
    pub exp: Option<u64>,
    /// `nbf`, in seconds since the epoch.
    pub nbf: Option<u64>,
    /// The key set's generation it was verified under.
    pub generation: u64,
    /// How many consumer changes the admin API had made then: its consumer is looked up
    /// again after one (deleted, or moved to another plan).
    pub roster: u64,
    /// Headers set from its claims.
    pub headers: SmallVec<[(HeaderName, HeaderValue); 2]>,
}

struct UntilExp;

impl moka::Expiry<String, Arc<Verified>> for UntilExp {
    fn expire_after_create(
        &self,
        _key: &String,
        v: &Arc<Verified>,
        _now: Instant,
    ) -> Option<Duration> {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let left = v.exp.map_or(MAX_REMEMBERED, |exp| {
            Duration::from_secs(exp.saturating_sub(wall))
        });
        Some(left.min(MAX_REMEMBERED))
    }
}

/// A route's verified tokens.
#[derive(Clone)]
pub struct TokenCache(Cache<String, Arc<Verified>>);

impl std::fmt::Debug for TokenCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenCache")
            .field("entries", &self.0.entry_count())
            .finish()
    }
}

impl TokenCache {
    /// A cache holding at most `bytes` of tokens and what they say.
    pub fn new(bytes: u64) -> TokenCache {
        TokenCache(
            Cache::builder()
                .max_capacity(bytes)
                .weigher(|k: &String, v: &Arc<Verified>| {
                    let size = k.len()
                        + 160
                        + v.headers
                            .iter()
                            .map(|(n, v)| n.as_str().len() + v.len())
                            .sum::<usize>();
                    u32::try_from(size).unwrap_or(u32::MAX)
                })
                .expire_after(UntilExp)
                .build(),
        )
    }

    /// What `token` said when it was verified, if remembered.
    pub fn get(&self, token: &str) -> Option<Arc<Verified>> {
        self.0.get(token)
    }

    /// Remembers a verified token.
    pub fn put(&self, token: &str, v: Arc<Verified>) {
        self.0.insert(token.to_string(), v);
    }
}
