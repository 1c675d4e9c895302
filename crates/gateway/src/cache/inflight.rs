//! The cache's state: the store, and the requests on their way upstream for a key (one
//! goes, the others wait for it); what a purge or an unsafe method removes.

use super::answer::{own_status, CACHE_STATUS};
use super::key::{host_of, keyed_url, uri_key, url_of, Ask, Key};
use super::store::Store;
use crate::exchange::{Parts, Refusal};
use crate::upstream::PooledBody;
use http::header::{self, HeaderMap};
use http::{Method, Response};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// The cache: the store and the requests on their way upstream for a key.
pub struct Cache {
    /// Stored responses.
    pub store: Store,
    pub(super) inflight: Arc<Mutex<HashMap<String, watch::Receiver<bool>>>>,
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache").field("store", &self.store).finish()
    }
}

/// The first request for a key; its drop lets the others waiting for the key go on.
pub(super) struct Leader {
    pub(super) key: String,
    pub(super) inflight: Arc<Mutex<HashMap<String, watch::Receiver<bool>>>>,
    pub(super) done: watch::Sender<bool>,
}

impl Leader {
    /// Tells the waiting requests that the upstream failed (so that they may be served
    /// stale within `stale-if-error` instead of trying it one after the other).
    pub(super) fn failed(&self) {
        self.done.send_replace(true);
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        self.inflight.lock().remove(&self.key);
    }
}

/// Sends a request upstream for the cache (a GET or HEAD without a body).
pub trait Fetch: Send + Sync + 'static {
    /// The upstream's answer.
    fn fetch(
        &self,
        parts: Parts,
    ) -> impl Future<Output = Result<Response<PooledBody>, Refusal>> + Send;
}

/// How one route keys its URLs: what a purge by URL needs to find that route's entries
/// whatever else the URL it names holds (the API key, parameters the route does not key).
pub struct Keying<'a> {
    /// The route's name: the first part of its keys.
    pub route: &'a str,
    /// Its caching (which query parameters it keys).
    pub cfg: &'a tollgate_config::RouteCacheConfig,
    /// The query parameters that carry its API key.
    pub credentials: &'a [String],
}

/// What a purge removes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Purge {
    /// Everything.
    All,
    /// The entries of one URL (`http://host/path?query`), or of one path on every host.
    Url(String),
    /// The entries whose path starts with this.
    Prefix(String),
    /// The entries tagged with this surrogate key.
    Tag(String),
}

/// Whether this request's answer came from the upstream just now (a miss, a pass, or a
/// stale entry revalidated in line), by its `Cache-Status`; coalesced answers did not.
pub fn went_upstream<B>(resp: &http::Response<B>) -> bool {
    resp.headers().get(CACHE_STATUS).is_some_and(|v| {
        let v = own_status(v);
        let has = |n: &[u8]| v.windows(n.len()).any(|w| w == n);
        has(b"fwd=") && !has(b"collapsed")
    })
}

/// Whether the method's success invalidates what is stored for its URI (RFC 9111 §4.4):
/// every method not defined as safe, unknown ones (`M-SEARCH`, a client's `PURGE`) among
/// them. Purging by name is an admin action; a client's `PURGE` only invalidates its URI,
/// as any unsafe request does.
pub fn is_unsafe(m: &Method) -> bool {
    !matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}

impl Cache {
    /// A cache of at most `max_size` bytes keeping responses up to `max_object` bytes.
    pub fn new(max_size: u64, max_object: u64) -> Arc<Cache> {
        Arc::new(Cache {
            store: Store::new(max_size, max_object),
            inflight: Arc::default(),
        })
    }

    /// After a successful unsafe request (RFC 9111 §4.4): drops what is stored for its URI
    /// and for the URIs its `Location` and `Content-Location` name on the same host.
    pub fn invalidate(&self, ask: &Ask<'_>, req: &Parts, resp: &HeaderMap) {
        let host = host_of(req);
        let url = url_of(req.uri.path(), req.uri.query(), ask);
        self.store.invalidate_uri(&uri_key(ask, &req.headers, &url));
        for name in [header::LOCATION, header::CONTENT_LOCATION] {
            let Some(loc) = resp.get(&name).and_then(|v| v.to_str().ok()) else {
                continue;
            };
            let Ok(u) = loc.parse::<http::Uri>() else {
                continue;
            };
            let same_host = u.host().is_none_or(|h| h.eq_ignore_ascii_case(&host));
            if same_host && u.path().starts_with('/') {
                let target = url_of(u.path(), u.query(), ask);
                self.store
                    .invalidate_uri(&uri_key(ask, &req.headers, &target));
            }
        }
    }

    /// Whether the request goes straight upstream, as on a route without a cache, with
    /// [`PASS_STATUS`]: the last answer for `key` could not be stored, a few seconds ago at
    /// most (Varnish's hit-for-pass), or the request itself may not use the cache
    /// (`no-store`, a keyed parameter in two spellings). Counted as a miss.
    pub fn passes(&self, key: &Key, now_ns: u64) -> bool {
        let pass = key.bypass || self.store.is_uncacheable(&key.plain, now_ns);
        if pass {
            self.store.metrics.misses.fetch_add(1, Ordering::Relaxed);
        }
        pass
    }

    /// Removes what a purge names: `url` (`http://host/path?query`, or a path for every
    /// host), a path `prefix`, a surrogate-key `tag`, or everything. Returns how many.
    /// A URL finds the entries it names as written, and on each of `routes` as that route
    /// keys it: the API key's and unkeyed parameters left out, as a request's key leaves them.
    pub fn purge(&self, what: Purge, routes: &[Keying<'_>]) -> u64 {
        match what {
            Purge::All => self.store.purge_all(),
            Purge::Tag(t) => self.store.purge_where(move |_, e| e.tags.contains(&t)),
            Purge::Prefix(p) => self.store.purge_where(move |_, e| e.path.starts_with(&p)),
            Purge::Url(u) => {
                let parsed = u.parse::<http::Uri>().ok();
                let (host, path) = match &parsed {
                    Some(uri) if uri.host().is_some() => (
                        uri.host().map(str::to_ascii_lowercase),
                        uri.path_and_query()
                            .map_or("/".to_string(), |p| p.to_string()),
                    ),
                    _ => (None, u.clone()),
                };
                // Each route's form of the URL, beside its route's name and separator.
                let keyed: Vec<(String, String)> = parsed
                    .as_ref()
                    .map(|uri| {
                        let p = if uri.path().is_empty() {
                            "/"
                        } else {
                            uri.path()
                        };
                        routes
                            .iter()
                            .map(|r| {
                                let url = keyed_url(p, uri.query(), r.cfg, r.credentials);
                                (format!("{}\u{0}", r.route), url)
                            })
                            .filter(|(_, url)| *url != path)
                            .collect()
                    })
                    .unwrap_or_default();
                self.store.purge_where(move |k, e| {
                    host.as_ref().is_none_or(|h| *h == e.host)
                        && (e.path == path
                            || keyed
                                .iter()
                                .any(|(r, url)| e.path == *url && k.starts_with(r.as_str())))
                })
            }
        }
    }

    /// Waits (at most `wait`) for the request gone upstream for the same key; whether it
    /// found the upstream failing.
    pub(super) async fn wait_for(mut rx: watch::Receiver<bool>, wait: Duration) -> bool {
        let _ = tokio::time::timeout(wait, rx.changed()).await;
        let failed = *rx.borrow();
        failed
    }

    /// Registers the request as the one going upstream for `flight`.
    pub(super) fn lead(&self, flight: String) -> Option<Leader> {
        let mut map = self.inflight.lock();
        if map.contains_key(&flight) {
            return None;
        }
        let (tx, rx) = watch::channel(false);
        map.insert(flight.clone(), rx);
        Some(Leader {
            key: flight,
            inflight: self.inflight.clone(),
            done: tx,
        })
    }
}
