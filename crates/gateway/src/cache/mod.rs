//! The response cache, after every policy (a hit is counted against the consumer's limits
//! like a proxied call and never reaches a caller the route refuses):
//!
//! - fresh entry: answered here (`Age`, `Cache-Status: tollgate; hit; ttl=N`), 304 to a
//!   client whose `If-None-Match` / `If-Modified-Since` it satisfies, HEAD from a stored GET;
//! - stale within `stale-while-revalidate`: answered stale, refreshed once in the background;
//! - stale otherwise: revalidated with the stored validators (a 304 refreshes the entry) by
//!   one request while the others for the key wait for it; when the upstream fails or
//!   answers 5xx within `stale-if-error`, answered stale (the waiting ones too);
//! - miss: concurrent requests for one key wait for the first one's answer (bounded by the
//!   upstream's `response_timeout`) and are served from it, or go upstream themselves if it
//!   was not stored; the first streams its answer to its client and stores a copy at its end.
//!
//! With `shared: false` every consumer has entries of its own; with `shared: true`, one
//! entry serves every consumer the route allows, except responses that vary by consumer
//! (`Vary` on the consumer header). Only the consumer's name is part of a key, never its key.

pub mod control;
pub mod store;

use crate::clock::Clock;
use crate::response::{full, Body, Refusal};
use crate::upstream::{Collector, PooledBody};
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Method, Response, StatusCode};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use store::{Born, Entry, Store, Varies};
use tokio::sync::watch;
use tollgate_config::{KeyQuery, RouteCacheConfig};

/// `Cache-Status` (RFC 9211).
pub const CACHE_STATUS: HeaderName = HeaderName::from_static("cache-status");

/// The cache: the store and the requests on their way upstream for a key.
pub struct Cache {
    /// Stored responses.
    pub store: Store,
    inflight: Arc<Mutex<HashMap<String, watch::Receiver<bool>>>>,
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache").field("store", &self.store).finish()
    }
}

/// The first request for a key; its drop lets the others waiting for the key go on.
struct Leader {
    key: String,
    inflight: Arc<Mutex<HashMap<String, watch::Receiver<bool>>>>,
    done: watch::Sender<bool>,
}

impl Leader {
    /// Tells the waiting requests that the upstream failed (so that they may be served
    /// stale within `stale-if-error` instead of trying it one after the other).
    fn failed(&self) {
        self.done.send_replace(true);
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        self.inflight.lock().remove(&self.key);
    }
}

/// The `Cache-Status` of a request sent straight upstream because the last answer for its
/// key could not be stored.
pub const PASS_STATUS: &str = "tollgate; fwd=uri-miss";

/// A request's key, built once: the URI key (route, host, path and keyed query), then the
/// variant without varying headers. The URI key and the URL are slices of it.
#[derive(Debug)]
pub struct Key {
    plain: String,
    url_start: usize,
    uri_len: usize,
}

impl Key {
    /// The key of the request `parts` asks on its route.
    pub fn of(ask: &Ask<'_>, parts: &Parts) -> Key {
        let mut plain = String::with_capacity(128);
        plain.push_str(ask.route);
        plain.push('\u{0}');
        host_into(parts, &mut plain);
        plain.push('\u{0}');
        let url_start = plain.len();
        url_into(parts.uri.path(), parts.uri.query(), ask, &mut plain);
        let uri_len = plain.len();
        variant_into(ask, &ask.cfg.key_headers, &parts.headers, &mut plain);
        Key {
            plain,
            url_start,
            uri_len,
        }
    }
}

/// What the cache needs of a request and its route.
pub struct Ask<'a> {
    /// The route's caching.
    pub cfg: &'a RouteCacheConfig,
    /// The route's name (part of every key).
    pub route: &'a str,
    /// The authenticated consumer's name.
    pub consumer: Option<&'a str>,
    /// The query parameters that carried the API key: never part of a key.
    pub credentials: &'a [String],
    /// Longest wait for another request's answer to the same key.
    pub wait: Duration,
    /// The gateway's clock, nanoseconds (monotonic).
    pub now_ns: u64,
    /// The gateway's clock: wall time, for `Date` and `Expires`, is read from it only when
    /// an answer is judged for storing (most requests are hits or never-stored misses).
    pub clock: &'a Arc<dyn Clock>,
}

impl Ask<'_> {
    /// Wall time now.
    fn wall(&self) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_nanos(self.clock.wall_nanos())
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

/// Whether this request's answer came from the upstream just now (a miss, a pass, or a
/// stale entry revalidated in line), by its `Cache-Status`; coalesced answers did not.
pub fn went_upstream<B>(resp: &http::Response<B>) -> bool {
    resp.headers().get(CACHE_STATUS).is_some_and(|v| {
        let v = v.as_bytes();
        let has = |n: &[u8]| v.windows(n.len()).any(|w| w == n);
        has(b"fwd=") && !has(b"collapsed")
    })
}

/// Whether the method's success invalidates what is stored for its URI (RFC 9111 §4.4):
/// POST, PUT, DELETE and PATCH. Other methods (a client's `PURGE` among them) never touch
/// the cache: purging is an admin action.
pub fn is_unsafe(m: &Method) -> bool {
    matches!(
        *m,
        Method::POST | Method::PUT | Method::DELETE | Method::PATCH
    )
}

/// Appends the request's host, lower case, without port and trailing dot.
fn host_into(parts: &Parts, out: &mut String) {
    let host = parts
        .headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map_or("", crate::inbound::host_only);
    let start = out.len();
    out.push_str(host);
    out[start..].make_ascii_lowercase();
}

/// Appends what [`variant_key`] adds to a URI key.
fn variant_into(ask: &Ask<'_>, varies: &[HeaderName], req: &HeaderMap, k: &mut String) {
    k.push('\u{0}');
    if !ask.cfg.shared {
        k.push_str(ask.consumer.unwrap_or(""));
    }
    for name in varies {
        k.push('\u{0}');
        store::header_for_key(req, name, k);
    }
}

/// The request's host, lower case, without port and trailing dot.
fn host_of(parts: &Parts) -> String {
    let mut host = String::new();
    host_into(parts, &mut host);
    host
}

/// Path + the query parameters the route keys on (credentials left out).
fn url_of(path: &str, query: Option<&str>, ask: &Ask<'_>) -> String {
    let mut url = String::with_capacity(path.len() + 32);
    url_into(path, query, ask, &mut url);
    url
}

/// Appends [`url_of`].
fn url_into(path: &str, query: Option<&str>, ask: &Ask<'_>, url: &mut String) {
    url.push_str(path);
    let Some(q) = query else { return };
    let mut sep = '?';
    // Byte loops: the pieces are short, and `str` searchers cost more than they save.
    let mut rest = q;
    loop {
        let end = rest.bytes().position(|b| b == b'&').unwrap_or(rest.len());
        let pair = &rest[..end];
        let name = pair
            .bytes()
            .position(|b| b == b'=')
            .map_or(pair, |i| &pair[..i]);
        let keep = match &ask.cfg.key_query {
            KeyQuery::All => true,
            KeyQuery::None => false,
            KeyQuery::Only(names) => names.iter().any(|n| n == name),
        } && !ask.credentials.iter().any(|c| c.eq_ignore_ascii_case(name));
        if keep && !pair.is_empty() {
            url.push(sep);
            url.push_str(pair);
            sep = '&';
        }
        if end == rest.len() {
            return;
        }
        rest = &rest[end + 1..];
    }
}

/// The key of everything stored for one URI of one route and host.
fn uri_key(route: &str, host: &str, url: &str) -> String {
    format!("{route}\u{0}{host}\u{0}{url}")
}

/// The key of one variant: the consumer (unless shared) and the request headers it varies on.
fn variant_key(uri: &str, ask: &Ask<'_>, varies: &[HeaderName], req: &HeaderMap) -> String {
    let mut k = String::with_capacity(uri.len() + 64);
    k.push_str(uri);
    variant_into(ask, varies, req, &mut k);
    k
}

/// What a response varies on: the route's key headers and its `Vary` list.
fn varies_of(cfg: &RouteCacheConfig, resp: &HeaderMap) -> Varies {
    let mut names: Vec<HeaderName> = cfg.key_headers.clone();
    for v in resp.get_all(header::VARY) {
        for n in v.to_str().unwrap_or("").split(',') {
            if let Ok(n) = HeaderName::from_bytes(n.trim().to_ascii_lowercase().as_bytes()) {
                if !names.contains(&n) {
                    names.push(n);
                }
            }
        }
    }
    names.into()
}

/// A copy of a request head.
pub fn copy_parts(p: &Parts) -> Parts {
    let mut r = http::Request::new(());
    *r.method_mut() = p.method.clone();
    *r.uri_mut() = p.uri.clone();
    *r.version_mut() = p.version;
    *r.headers_mut() = p.headers.clone();
    r.into_parts().0
}

fn etag_matches(inm: &str, etag: &str) -> bool {
    let weak = |t: &str| t.trim().trim_start_matches("W/").to_string();
    inm.split(',')
        .any(|t| t.trim() == "*" || weak(t) == weak(etag))
}

/// Whether the client's conditional request is satisfied by `e` (RFC 9110 §13.2.2).
fn not_modified(req: &HeaderMap, e: &Entry) -> bool {
    if let Some(inm) = req.get(header::IF_NONE_MATCH).and_then(|v| v.to_str().ok()) {
        return e
            .headers
            .get(header::ETAG)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|etag| etag_matches(inm, etag));
    }
    let since = req
        .get(header::IF_MODIFIED_SINCE)
        .and_then(|v| httpdate::parse_http_date(v.to_str().ok()?).ok());
    let modified = e
        .headers
        .get(header::LAST_MODIFIED)
        .and_then(|v| httpdate::parse_http_date(v.to_str().ok()?).ok());
    matches!((since, modified), (Some(s), Some(m)) if m <= s)
}

/// The answer for `req` from `e`: whole, HEAD, or 304 to a satisfied conditional request.
fn answer(e: &Entry, req: &Parts, now_ns: u64, status: String) -> Response<Body> {
    let not_mod = e.status == StatusCode::OK && not_modified(&req.headers, e);
    let (code, body) = if not_mod {
        (StatusCode::NOT_MODIFIED, Bytes::new())
    } else if req.method == Method::HEAD {
        (e.status, Bytes::new())
    } else {
        (e.status, e.body.clone())
    };
    let mut r = Response::new(full(body));
    *r.status_mut() = code;
    let h = r.headers_mut();
    *h = e.headers.clone();
    if not_mod {
        h.remove(header::CONTENT_LENGTH);
    } else {
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(e.body.len()));
    }
    h.insert(header::AGE, HeaderValue::from(e.age(now_ns).as_secs()));
    if let Ok(v) = HeaderValue::from_str(&status) {
        h.insert(CACHE_STATUS, v);
    }
    r
}

fn with_status(mut r: Response<Body>, status: &'static str) -> Response<Body> {
    r.headers_mut()
        .insert(CACHE_STATUS, HeaderValue::from_static(status));
    r
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

/// How the stored entry (if any) was found wanting.
#[derive(Clone, Copy)]
enum Miss {
    /// Nothing stored for the URI.
    Uri,
    /// The URI, but not for this request's varying headers.
    Vary,
    /// Nothing usable (another consumer's, or stale with nothing to revalidate with).
    Other,
}

impl Miss {
    fn as_str(self) -> &'static str {
        match self {
            Miss::Uri => "uri-miss",
            Miss::Vary => "vary-miss",
            Miss::Other => "miss",
        }
    }

    /// The `Cache-Status` of the upstream's answer, stored or not.
    fn status(self, stored: bool) -> &'static str {
        match (self, stored) {
            (Miss::Uri, true) => "tollgate; fwd=uri-miss; stored",
            (Miss::Uri, false) => "tollgate; fwd=uri-miss",
            (Miss::Vary, true) => "tollgate; fwd=vary-miss; stored",
            (Miss::Vary, false) => "tollgate; fwd=vary-miss",
            (Miss::Other, true) => "tollgate; fwd=miss; stored",
            (Miss::Other, false) => "tollgate; fwd=miss",
        }
    }
}

/// The `Cache-Status` of a stale entry's replacement, stored or not.
const STALE_STORED: &str = "tollgate; fwd=stale; stored";
const STALE_PASSED: &str = "tollgate; fwd=stale";

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
        self.store.invalidate_uri(&uri_key(ask.route, &host, &url));
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
                    .invalidate_uri(&uri_key(ask.route, &host, &target));
            }
        }
    }

    /// Whether the last answer for `key` could not be stored, a few seconds ago at most
    /// (Varnish's hit-for-pass): then the request goes straight upstream, as on a route
    /// without a cache, with [`PASS_STATUS`]. Counted as a miss.
    pub fn passes(&self, key: &Key, now_ns: u64) -> bool {
        let pass = self.store.is_uncacheable(&key.plain, now_ns);
        if pass {
            self.store.metrics.misses.fetch_add(1, Ordering::Relaxed);
        }
        pass
    }

    /// A miss that neither waits nor stores: `up`'s answer as it comes, with `status`.
    async fn straight_upstream<F: Fetch>(
        &self,
        up: &F,
        parts: Parts,
        status: &'static str,
    ) -> Result<Response<Body>, Refusal> {
        self.store.metrics.misses.fetch_add(1, Ordering::Relaxed);
        let resp = up.fetch(parts).await?;
        Ok(with_status(resp.map(http_body_util::Either::Left), status))
    }

    /// Answers a GET or HEAD from the cache, or through `up` and stores what may be stored.
    pub async fn serve<F: Fetch>(
        self: &Arc<Self>,
        ask: Ask<'_>,
        key: Key,
        parts: Parts,
        up: Arc<F>,
    ) -> Result<Response<Body>, Refusal> {
        let plain = key.plain;
        let uri = &plain[..key.uri_len];
        let url = &plain[key.url_start..key.uri_len];
        let m = &self.store.metrics;
        let mut collapsed = false;
        // The request this one waited for found the upstream failing.
        let mut upstream_failed = false;
        loop {
            // Checked again after waiting for another request's answer, which may have
            // found its answer could not be stored.
            if collapsed && self.store.is_uncacheable(&plain, ask.now_ns) {
                return self.straight_upstream(&*up, parts, PASS_STATUS).await;
            }
            // The key without varying headers first: most responses vary on nothing.
            let (entry, miss, vary_key) = match self.store.get(&plain) {
                Some(e) => (Some(e), Miss::Other, None),
                None => match self.store.varies(uri) {
                    Some(v) => {
                        let key = variant_key(uri, &ask, &v, &parts.headers);
                        (self.store.get(&key), Miss::Vary, Some(key))
                    }
                    None => (None, Miss::Uri, None),
                },
            };
            if let Some(e) = entry {
                let now = ask.now_ns;
                if e.is_fresh(now) {
                    let counter = if collapsed { &m.coalesced } else { &m.hits };
                    counter.fetch_add(1, Ordering::Relaxed);
                    let status = if collapsed {
                        format!("tollgate; fwd={}; collapsed", miss.as_str())
                    } else {
                        format!("tollgate; hit; ttl={}", e.ttl(now))
                    };
                    return Ok(answer(&e, &parts, now, status));
                }
                if e.stale_within(now, e.fresh.stale_while_revalidate) {
                    m.stale.fetch_add(1, Ordering::Relaxed);
                    self.refresh_in_background(&ask, uri, url, &parts, &e, up);
                    let status = format!("tollgate; hit; ttl={}", e.ttl(now));
                    return Ok(answer(&e, &parts, now, status));
                }
                let stale_ok = !e.fresh.stale_if_error.is_zero()
                    && e.stale_within(now, e.fresh.stale_if_error);
                if upstream_failed && stale_ok {
                    m.stale.fetch_add(1, Ordering::Relaxed);
                    let status = "tollgate; fwd=stale; collapsed".to_string();
                    return Ok(answer(&e, &parts, now, status));
                }
                // Stale: one request asks the upstream, the others wait for its answer.
                let flight = vary_key.as_deref().unwrap_or(&plain);
                let waiting = self.inflight.lock().get(flight).cloned();
                if let (Some(rx), false) = (waiting, collapsed) {
                    upstream_failed = Self::wait_for(rx, ask.wait).await;
                    collapsed = true;
                    continue;
                }
                let leader = self.lead(flight.to_string());
                return self
                    .revalidate(&ask, (uri, url), parts, e, up, leader)
                    .await;
            }
            // A miss: wait for a request already on its way upstream for this key, once.
            let flight = plain.as_str();
            if parts.method == Method::HEAD {
                return self
                    .straight_upstream(&*up, parts, miss.status(false))
                    .await;
            }
            let waiting = self.inflight.lock().get(flight).cloned();
            match waiting {
                Some(rx) if !collapsed => {
                    upstream_failed = Self::wait_for(rx, ask.wait).await;
                    collapsed = true;
                    continue;
                }
                _ => {}
            }
            let leader = self.lead(flight.to_string());
            m.misses.fetch_add(1, Ordering::Relaxed);
            let sent = copy_parts(&parts);
            let born = self.store.born(uri);
            let resp = up.fetch(parts).await?;
            let (resp, stored) = self.store_on_the_way(
                &ask,
                (uri, born),
                url.to_string(),
                &sent,
                resp,
                leader,
                miss.status(true),
                miss.status(false),
            );
            if stored {
                self.store.cacheable_again(flight);
            } else {
                self.store.mark_uncacheable(flight, ask.now_ns);
            }
            return Ok(resp);
        }
    }

    /// Removes what a purge names: `url` (`http://host/path?query`, or a path for every
    /// host), a path `prefix`, a surrogate-key `tag`, or everything. Returns how many.
    pub fn purge(&self, what: Purge) -> u64 {
        match what {
            Purge::All => self.store.purge_all(),
            Purge::Tag(t) => self.store.purge_where(move |_, e| e.tags.contains(&t)),
            Purge::Prefix(p) => self.store.purge_where(move |_, e| e.path.starts_with(&p)),
            Purge::Url(u) => {
                let (host, path) = match u.parse::<http::Uri>() {
                    Ok(uri) if uri.host().is_some() => (
                        uri.host().map(str::to_ascii_lowercase),
                        uri.path_and_query()
                            .map_or("/".to_string(), |p| p.to_string()),
                    ),
                    _ => (None, u),
                };
                self.store.purge_where(move |_, e| {
                    e.path == path && host.as_ref().is_none_or(|h| *h == e.host)
                })
            }
        }
    }

    /// Waits (at most `wait`) for the request gone upstream for the same key; whether it
    /// found the upstream failing.
    async fn wait_for(mut rx: watch::Receiver<bool>, wait: Duration) -> bool {
        let _ = tokio::time::timeout(wait, rx.changed()).await;
        let failed = *rx.borrow();
        failed
    }

    /// Registers the request as the one going upstream for `flight`.
    fn lead(&self, flight: String) -> Option<Leader> {
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

    /// The upstream's answer to a miss, streamed to the client; a copy is stored at its end
    /// when it may be. The leader (if any) is let go once the copy is stored or dropped.
    #[allow(clippy::too_many_arguments)]
    fn store_on_the_way(
        self: &Arc<Self>,
        ask: &Ask<'_>,
        (uri, born): (&str, Born),
        url: String,
        sent: &Parts,
        mut resp: Response<PooledBody>,
        leader: Option<Leader>,
        stored_status: &'static str,
        passed_status: &'static str,
    ) -> (Response<Body>, bool) {
        // An invalidation of the URI since the request left keeps its answer out.
        let storable = born.current().then(|| self.storable(ask, sent, &resp));
        match storable.flatten() {
            Some(fresh) => {
                let varies = varies_of(ask.cfg, resp.headers());
                let key = variant_key(uri, ask, &varies, &sent.headers);
                let mut headers = resp.headers().clone();
                headers.remove(header::AGE);
                let status = resp.status();
                let tags = store::tags(&headers);
                let stored_ns = ask.now_ns;
                let host = host_of(sent);
                let cache = self.clone();
                let collector = Collector::new(self.store.max_object, move |body| {
                    cache.store.put(
                        varies,
                        key,
                        Entry {
                            status,
                            headers,
                            body,
                            fresh,
                            stored_ns,
                            host,
                            path: url,
                            tags,
                            born,
                        },
                    );
                    drop(leader);
                });
                resp.body_mut().collect_into(collector);
                let r = with_status(resp.map(http_body_util::Either::Left), stored_status);
                (r, true)
            }
            None => {
                drop(leader);
                let r = with_status(resp.map(http_body_util::Either::Left), passed_status);
                (r, false)
            }
        }
    }

    /// Whether the response to `sent` may be stored, and its freshness.
    fn storable(
        &self,
        ask: &Ask<'_>,
        sent: &Parts,
        resp: &Response<PooledBody>,
    ) -> Option<control::Freshness> {
        let h = resp.headers();
        if ask.cfg.shared && h.contains_key(header::SET_COOKIE) {
            return None;
        }
        let too_big = h
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
            .is_some_and(|n| n > self.store.max_object);
        if too_big {
            return None;
        }
        control::storable(
            &Method::GET,
            resp.status(),
            &sent.headers,
            h,
            sent.headers.contains_key(header::AUTHORIZATION),
            ask.cfg.default_ttl,
            ask.wall(),
        )
    }

    /// The request that asks the upstream whether `e` is still good.
    fn conditional(parts: &Parts, e: &Entry) -> Parts {
        let mut p = copy_parts(parts);
        p.method = Method::GET;
        p.headers.remove(header::IF_NONE_MATCH);
        p.headers.remove(header::IF_MODIFIED_SINCE);
        if let Some(etag) = e.headers.get(header::ETAG) {
            p.headers.insert(header::IF_NONE_MATCH, etag.clone());
        }
        if let Some(lm) = e.headers.get(header::LAST_MODIFIED) {
            p.headers.insert(header::IF_MODIFIED_SINCE, lm.clone());
        }
        p
    }

    /// `e` refreshed by a 304: its headers updated from the 304's (RFC 9111 §4.3.4).
    fn refreshed(&self, ask: &Ask<'_>, e: &Entry, not_modified: &HeaderMap) -> Option<Entry> {
        let mut headers = e.headers.clone();
        for name in not_modified.keys() {
            if *name == header::CONTENT_LENGTH || *name == header::AGE {
                continue;
            }
            headers.remove(name);
            for v in not_modified.get_all(name) {
                headers.append(name.clone(), v.clone());
            }
        }
        let fresh = control::storable(
            &Method::GET,
            e.status,
            &HeaderMap::new(),
            &headers,
            false,
            ask.cfg.default_ttl,
            ask.wall(),
        )?;
        Some(Entry {
            status: e.status,
            tags: store::tags(&headers),
            headers,
            body: e.body.clone(),
            fresh,
            stored_ns: ask.now_ns,
            host: e.host.clone(),
            path: e.path.clone(),
            born: e.born.clone(),
        })
    }

    /// A stale entry: asked about upstream, served again after a 304, served stale when
    /// the upstream fails within `stale-if-error`, replaced otherwise.
    async fn revalidate<F: Fetch>(
        self: &Arc<Self>,
        ask: &Ask<'_>,
        (uri, url): (&str, &str),
        parts: Parts,
        e: Arc<Entry>,
        up: Arc<F>,
        leader: Option<Leader>,
    ) -> Result<Response<Body>, Refusal> {
        let m = &self.store.metrics;
        let has_validators =
            e.headers.contains_key(header::ETAG) || e.headers.contains_key(header::LAST_MODIFIED);
        let sent = if has_validators {
            Self::conditional(&parts, &e)
        } else {
            let mut p = copy_parts(&parts);
            p.method = Method::GET;
            p
        };
        let now = ask.now_ns;
        let stale_ok =
            !e.fresh.stale_if_error.is_zero() && e.stale_within(now, e.fresh.stale_if_error);
        match up.fetch(copy_parts(&sent)).await {
            Ok(resp) if resp.status() == StatusCode::NOT_MODIFIED && has_validators => {
                m.revalidated.fetch_add(1, Ordering::Relaxed);
                let status = "tollgate; fwd=stale; fwd-status=304".to_string();
                match self.refreshed(ask, &e, resp.headers()) {
                    Some(fresh) => {
                        let varies = varies_of(ask.cfg, &fresh.headers);
                        let key = variant_key(uri, ask, &varies, &parts.headers);
                        let r = answer(&fresh, &parts, now, status);
                        self.store.put(varies, key, fresh);
                        Ok(r)
                    }
                    None => Ok(answer(&e, &parts, now, status)),
                }
            }
            Ok(resp) if resp.status().is_server_error() && stale_ok => {
                if let Some(l) = &leader {
                    l.failed();
                }
                m.stale.fetch_add(1, Ordering::Relaxed);
                let status = format!("tollgate; fwd=stale; fwd-status={}", resp.status().as_u16());
                Ok(answer(&e, &parts, now, status))
            }
            Ok(resp) => {
                m.misses.fetch_add(1, Ordering::Relaxed);
                if parts.method == Method::HEAD {
                    return Ok(with_status(
                        resp.map(http_body_util::Either::Left),
                        STALE_PASSED,
                    ));
                }
                Ok(self
                    .store_on_the_way(
                        ask,
                        (uri, e.born.clone()),
                        url.to_string(),
                        &sent,
                        resp,
                        leader,
                        STALE_STORED,
                        STALE_PASSED,
                    )
                    .0)
            }
            Err(refusal) if stale_ok => {
                if let Some(l) = &leader {
                    l.failed();
                }
                m.stale.fetch_add(1, Ordering::Relaxed);
                let code = match refusal {
                    Refusal::UpstreamTimeout => 504,
                    Refusal::UpstreamBusy => 503,
                    _ => 502,
                };
                let status = format!("tollgate; fwd=stale; fwd-status={code}");
                Ok(answer(&e, &parts, now, status))
            }
            Err(refusal) => Err(refusal),
        }
    }

    /// Starts one background refresh of a stale entry (none if one is already running).
    fn refresh_in_background<F: Fetch>(
        self: &Arc<Self>,
        ask: &Ask<'_>,
        uri: &str,
        url: &str,
        parts: &Parts,
        e: &Arc<Entry>,
        up: Arc<F>,
    ) {
        let flight = format!("refresh\u{0}{uri}\u{0}{}", ask.consumer.unwrap_or(""));
        let Some(leader) = self.lead(flight) else {
            return;
        };
        let sent = Self::conditional(parts, e);
        let cfg = ask.cfg.clone();
        let (route, consumer) = (ask.route.to_string(), ask.consumer.map(str::to_string));
        let credentials = ask.credentials.to_vec();
        let (uri, url, e, cache) = (uri.to_string(), url.to_string(), e.clone(), self.clone());
        let now_ns = ask.now_ns;
        let clock = ask.clock.clone();
        tokio::spawn(async move {
            let ask = Ask {
                cfg: &cfg,
                route: &route,
                consumer: consumer.as_deref(),
                credentials: &credentials,
                wait: Duration::ZERO,
                now_ns,
                clock: &clock,
            };
            let Ok(resp) = up.fetch(copy_parts(&sent)).await else {
                return;
            };
            if resp.status() == StatusCode::NOT_MODIFIED {
                if let Some(fresh) = cache.refreshed(&ask, &e, resp.headers()) {
                    let varies = varies_of(&cfg, &fresh.headers);
                    let key = variant_key(&uri, &ask, &varies, &sent.headers);
                    cache.store.put(varies, key, fresh);
                    cache
                        .store
                        .metrics
                        .revalidated
                        .fetch_add(1, Ordering::Relaxed);
                }
                return;
            }
            let (resp, _) = cache.store_on_the_way(
                &ask,
                (&uri, e.born.clone()),
                url,
                &sent,
                resp,
                Some(leader),
                STALE_STORED,
                STALE_PASSED,
            );
            // Nobody reads this answer: read it here so that its copy is stored.
            let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
        });
    }
}
