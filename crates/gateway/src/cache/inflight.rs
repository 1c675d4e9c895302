//! The cache's state: the store, and the requests on their way upstream for a key (one
//! goes, the others wait for it); what a purge or an unsafe method removes.

use super::answer::{own_status, CACHE_STATUS};
use super::key::{host_of, keyed_url, uri_key, url_of, Ask, Key};
use super::store::Store;
use crate::exchange::{Parts, Refusal};
use crate::upstream::PooledBody;
use http::header::{self, HeaderMap};
use http::Response;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::watch;
use tokio::time::Instant;

/// The cache: the store and the requests on their way upstream for a key.
pub struct Cache {
    /// Stored responses.
    pub store: Store,
    pub(super) inflight: Arc<Mutex<HashMap<String, watch::Receiver<Outcome>>>>,
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache").field("store", &self.store).finish()
    }
}

/// The first request for a key; its drop lets the others waiting for the key go on.
pub(super) struct Leader {
    pub(super) key: String,
    pub(super) inflight: Arc<Mutex<HashMap<String, watch::Receiver<Outcome>>>>,
    pub(super) done: watch::Sender<Outcome>,
}

impl Leader {
    /// Tells the waiting requests that the upstream failed (so that they may be served
    /// stale within `stale-if-error`, or go upstream together, instead of trying it one
    /// after the other).
    pub(super) fn failed(&self) {
        self.done.send_replace(Outcome::Failed);
    }

    /// Tells the waiting requests to go upstream themselves, together: the answer, not
    /// stored, is no use to them, and another of them leading would fare no better.
    pub(super) fn pass(&self) {
        self.done.send_replace(Outcome::Pass);
    }
}

/// What the waiting requests learn of the request they waited for. A leader gone without
/// a word (its answer stored, or cut off) lets them look again, and one of them lead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    /// No word.
    Pending,
    /// The upstream failed.
    Failed,
    /// Go upstream, each.
    Pass,
}

impl Drop for Leader {
    fn drop(&mut self) {
        self.inflight.lock().remove(&self.key);
    }
}

/// Takes one from a gauge when dropped.
struct Countdown<'a>(&'a std::sync::atomic::AtomicU64);

impl Drop for Countdown<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a request whose key has no usable entry does ([`Cache::turn`]).
pub(super) enum Turn {
    /// Waits for the request on its way upstream for the key.
    Wait(watch::Receiver<Outcome>),
    /// Goes upstream itself, as the key's leader or not.
    Go(Option<Leader>),
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

/// The path and query a `Location` or `Content-Location` names on `host`, resolved
/// against the request's path as a client resolves it (RFC 3986 §5.2, by the `url` crate:
/// `xr`, `../xr`, `//host/xr`, `http://host/xr`) and normalized as a request's path is;
/// `None` for another host or what no request could name.
pub(crate) fn resolve(base: &str, loc: &str, host: &str) -> Option<(String, Option<String>)> {
    let to = url::Url::parse(&format!("http://{host}{base}"))
        .ok()?
        .join(loc)
        .ok()?;
    let same_host = to.host_str().is_some_and(|h| h.eq_ignore_ascii_case(host));
    if !matches!(to.scheme(), "http" | "https") || !same_host {
        return None;
    }
    let path = to.path();
    let path = crate::inbound::normalize_path(path)
        .ok()?
        .unwrap_or_else(|| path.to_string());
    Some((path, to.query().map(str::to_string)))
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
            if let Some((path, query)) = resolve(req.uri.path(), loc, &host) {
                let target = url_of(&path, query.as_deref(), ask);
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

    /// Waits (until `deadline` at most) for the request gone upstream for the same key;
    /// what it said.
    pub(super) async fn wait_for(
        &self,
        mut rx: watch::Receiver<Outcome>,
        deadline: Instant,
    ) -> Outcome {
        let waiting = &self.store.metrics.waiting;
        waiting.fetch_add(1, Ordering::Relaxed);
        // Counted down however the wait ends, a client gone meanwhile included.
        let _done = Countdown(waiting);
        let _ = tokio::time::timeout_at(deadline, rx.changed()).await;
        let said = *rx.borrow();
        said
    }

    /// What a request for `flight` does, decided under one lock so that of the requests
    /// let go together exactly one goes upstream: wait for the one already on its way
    /// (while `may_wait`), or go itself as the leader (whose answer is what the requests
    /// that come meanwhile wait for).
    pub(super) fn turn(&self, flight: &str, may_wait: bool) -> Turn {
        let mut map = self.inflight.lock();
        if let Some(rx) = map.get(flight) {
            return if may_wait {
                Turn::Wait(rx.clone())
            } else {
                Turn::Go(None)
            };
        }
        let (tx, rx) = watch::channel(Outcome::Pending);
        map.insert(flight.to_string(), rx);
        Turn::Go(Some(Leader {
            key: flight.to_string(),
            inflight: self.inflight.clone(),
            done: tx,
        }))
    }

    /// Registers the request as the one going upstream for `flight`.
    pub(super) fn lead(&self, flight: String) -> Option<Leader> {
        let mut map = self.inflight.lock();
        if map.contains_key(&flight) {
            return None;
        }
        let (tx, rx) = watch::channel(Outcome::Pending);
        map.insert(flight.clone(), rx);
        Some(Leader {
            key: flight,
            inflight: self.inflight.clone(),
            done: tx,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::resolve;

    #[test]
    fn a_location_is_resolved_against_the_request_as_a_client_would() {
        let r = |loc| resolve("/o/w-X", loc, "gw.test");
        let path = |p: &str| Some((p.to_string(), None));
        assert_eq!(r("xr9-X"), path("/o/xr9-X"));
        assert_eq!(r("../xr2-X"), path("/xr2-X"));
        assert_eq!(r("./a/./b/../c"), path("/o/a/c"));
        assert_eq!(r("//gw.test/o/xr4-X"), path("/o/xr4-X"));
        assert_eq!(r("//GW.TEST:8080/o/x"), path("/o/x"));
        assert_eq!(r("http://gw.test"), path("/"));
        assert_eq!(r("HTTPS://user@gw.test/a%2Db"), path("/a-b"));
        assert_eq!(r("/o/xr7%2DX#frag"), path("/o/xr7-X"));
        assert_eq!(r("/a/.."), path("/"));
        assert_eq!(r("/a/b/."), path("/a/b/"));
        assert_eq!(
            r("x?q=1"),
            Some(("/o/x".to_string(), Some("q=1".to_string())))
        );
        assert_eq!(r("//other.test/o/x"), None);
        assert_eq!(r("http://other.test/o/x"), None);
        assert_eq!(r("ftp://gw.test/o/x"), None);
        assert_eq!(r("/a%2Fb"), None, "no request names it");
    }
}
