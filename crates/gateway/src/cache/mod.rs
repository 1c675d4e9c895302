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
use smallvec::SmallVec;
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
    /// The request may neither be answered from the cache nor stored: it names a keyed
    /// query parameter in two spellings, or asks for `no-store`.
    bypass: bool,
}

impl Key {
    /// The key of the request `parts` asks on its route.
    pub fn of(ask: &Ask<'_>, parts: &Parts) -> Key {
        let mut plain = String::with_capacity(128);
        plain.push_str(ask.route);
        plain.push('\u{0}');
        authority_into(ask, &parts.headers, &mut plain);
        plain.push('\u{0}');
        let url_start = plain.len();
        let ambiguous = url_into(parts.uri.path(), parts.uri.query(), ask, &mut plain);
        let uri_len = plain.len();
        variant_into(ask, &ask.cfg.key_headers, &parts.headers, &mut plain);
        Key {
            plain,
            url_start,
            uri_len,
            bypass: ambiguous || asks_no_store(&parts.headers),
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
    /// The client's address, as `X-Forwarded-For` sends it upstream.
    pub peer: &'a HeaderValue,
    /// The client is a trusted proxy: its `X-Forwarded-*` headers go upstream.
    pub trusted: bool,
    /// The client came over TLS (`X-Forwarded-Proto: https`).
    pub https: bool,
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
/// every method not defined as safe, unknown ones (`M-SEARCH`, a client's `PURGE`) among
/// them. Purging by name is an admin action; a client's `PURGE` only invalidates its URI,
/// as any unsafe request does.
pub fn is_unsafe(m: &Method) -> bool {
    !matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}

/// Whether the client asked that nothing of this exchange be stored (`no-store`): its
/// answer is neither stored nor taken as the key's, and it is not answered from the store.
fn asks_no_store(req: &HeaderMap) -> bool {
    req.get_all(header::CACHE_CONTROL).iter().any(|v| {
        v.to_str().is_ok_and(|v| {
            v.split(',')
                .any(|d| d.trim().eq_ignore_ascii_case("no-store"))
        })
    })
}

/// Whether the request asks for a part of an answer or sets a precondition the cache does
/// not judge itself (`Range` on a miss, `If-Match`, `If-Unmodified-Since`, `If-Range`):
/// such a request goes upstream as it is, and what it gets is never stored nor decides
/// anything for the key.
fn shapes_its_answer(req: &HeaderMap) -> bool {
    req.contains_key(header::RANGE)
        || req.contains_key(header::IF_MATCH)
        || req.contains_key(header::IF_UNMODIFIED_SINCE)
        || req.contains_key(header::IF_RANGE)
}

const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Appends what the upstream is told of the request's scheme and host, lower case: the
/// scheme (`X-Forwarded-Proto`), the `Host` as sent, port included, and a trusted proxy's
/// `X-Forwarded-Host`. Two requests the upstream could answer differently never share a key.
fn authority_into(ask: &Ask<'_>, req: &HeaderMap, out: &mut String) {
    let start = out.len();
    if ask.trusted && req.contains_key(X_FORWARDED_PROTO) {
        store::header_for_key(req, &X_FORWARDED_PROTO, out);
    } else {
        out.push_str(if ask.https { "https" } else { "http" });
    }
    out.push('\u{0}');
    store::header_for_key(req, &header::HOST, out);
    if ask.trusted && req.contains_key(X_FORWARDED_HOST) {
        out.push('\u{0}');
        store::header_for_key(req, &X_FORWARDED_HOST, out);
    }
    out[start..].make_ascii_lowercase();
}

/// Appends the value of `name` as the upstream receives it (for `Vary`): the
/// `X-Forwarded-*` headers the gateway sets, the ones it drops from untrusted clients as
/// empty, any other as the client sent it.
fn sent_for_key(ask: &Ask<'_>, req: &HeaderMap, name: &HeaderName, out: &mut String) {
    let n = name.as_str();
    if n == "x-forwarded-for" {
        if ask.trusted && req.contains_key(name) {
            store::header_for_key(req, name, out);
            out.push_str(", ");
        }
        out.push_str(&String::from_utf8_lossy(ask.peer.as_bytes()));
    } else if n == "x-forwarded-proto" && !(ask.trusted && req.contains_key(name)) {
        out.push_str(if ask.https { "https" } else { "http" });
    } else if n == "x-forwarded-host" && !(ask.trusted && req.contains_key(name)) {
        store::header_for_key(req, &header::HOST, out);
    } else if !ask.trusted && crate::upstream::forwarding_header(n) {
        // Dropped on the way upstream.
    } else {
        store::header_for_key(req, name, out);
    }
}

/// Appends what [`variant_key`] adds to a URI key.
fn variant_into(ask: &Ask<'_>, varies: &[HeaderName], req: &HeaderMap, k: &mut String) {
    k.push('\u{0}');
    if !ask.cfg.shared {
        k.push_str(ask.consumer.unwrap_or(""));
    }
    for name in varies {
        k.push('\u{0}');
        sent_for_key(ask, req, name, k);
    }
}

/// The request's host, lower case, without port and trailing dot: what purges match.
fn host_of(parts: &Parts) -> String {
    let host = parts
        .headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map_or("", crate::inbound::host_only);
    host.to_ascii_lowercase()
}

/// Path + the query parameters the route keys on (credentials left out).
fn url_of(path: &str, query: Option<&str>, ask: &Ask<'_>) -> String {
    let mut url = String::with_capacity(path.len() + 32);
    url_into(path, query, ask, &mut url);
    url
}

/// Appends [`url_of`]; true when the query names a keyed parameter in more than one
/// spelling (`page` and `%70age`, `PAGE`, `page[]`): backends differ on which one they
/// read, so such a request must not share an entry with any other.
///
/// Parameters are matched as backends read their names ([`crate::query`]) and kept with
/// the separator before them, so `a=1;page=2` and `a=1&page=2` are keyed apart.
fn url_into(path: &str, query: Option<&str>, ask: &Ask<'_>, url: &mut String) -> bool {
    url.push_str(path);
    let Some(q) = query else { return false };
    let mut ambiguous = false;
    // The first raw spelling seen of each keyed name.
    let mut spelled: SmallVec<[(usize, &str); 4]> = SmallVec::new();
    for (_, sep, raw, pair) in crate::query::pieces(q) {
        if pair.is_empty() {
            continue;
        }
        let name = crate::query::param_name(raw);
        if ask
            .credentials
            .iter()
            .any(|c| crate::query::same_param(&name, c))
        {
            continue;
        }
        let keep = match &ask.cfg.key_query {
            KeyQuery::All => true,
            KeyQuery::None => false,
            KeyQuery::Only(names) => {
                match names
                    .iter()
                    .position(|n| crate::query::same_param(&name, n))
                {
                    Some(i) => {
                        match spelled.iter().find(|(j, _)| *j == i) {
                            Some((_, first)) => ambiguous |= *first != raw,
                            None => spelled.push((i, raw)),
                        }
                        true
                    }
                    None => false,
                }
            }
        };
        if keep {
            let first = url.len() == path.len();
            url.push(if first { '?' } else { char::from(sep) });
            url.push_str(pair);
        }
    }
    ambiguous
}

/// The key of everything stored for one URI of one route: the route, what the upstream
/// is told of scheme and host ([`authority_into`]), and `url`.
fn uri_key(ask: &Ask<'_>, req: &HeaderMap, url: &str) -> String {
    let mut k = String::with_capacity(ask.route.len() + url.len() + 32);
    k.push_str(ask.route);
    k.push('\u{0}');
    authority_into(ask, req, &mut k);
    k.push('\u{0}');
    k.push_str(url);
    k
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

/// The part of a `len`-byte body a `Range` asks for (RFC 9110 §14): `Some(Ok(range))` for
/// one satisfiable byte range, `Some(Err(()))` when it cannot be satisfied, `None` when the
/// whole answer is given instead (no range, several ranges, another unit, or a form not
/// read here).
fn byte_range(req: &HeaderMap, len: usize) -> Option<Result<std::ops::Range<usize>, ()>> {
    let v = req.get(header::RANGE)?.to_str().ok()?.trim();
    let spec = v.strip_prefix("bytes=")?.trim();
    if spec.contains(',') {
        return None;
    }
    let (first, last) = spec.split_once('-')?;
    let (first, last) = (first.trim(), last.trim());
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let num = |s: &str| {
        s.parse::<u64>()
            .ok()
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX))
    };
    if first.is_empty() {
        // A suffix: the last N bytes.
        if !digits(last) {
            return None;
        }
        let n = num(last)?;
        if n == 0 || len == 0 {
            return Some(Err(()));
        }
        return Some(Ok(len.saturating_sub(n)..len));
    }
    if !digits(first) || !(last.is_empty() || digits(last)) {
        return None;
    }
    let start = num(first)?;
    let end = if last.is_empty() {
        usize::MAX
    } else {
        num(last)?
    };
    if end < start {
        return None;
    }
    if start >= len {
        return Some(Err(()));
    }
    Some(Ok(start..end.min(len - 1) + 1))
}

/// Whether `If-Range` lets a range of `e` be served (RFC 9110 §13.1.5): its strong
/// entity tag or its exact `Last-Modified` date.
fn if_range_holds(req: &HeaderMap, e: &Entry) -> bool {
    let Some(v) = req.get(header::IF_RANGE) else {
        return true;
    };
    let v = v.as_bytes();
    if v.starts_with(b"\"") {
        return e
            .headers
            .get(header::ETAG)
            .is_some_and(|t| t.as_bytes() == v);
    }
    if v.starts_with(b"W/") {
        return false;
    }
    e.headers
        .get(header::LAST_MODIFIED)
        .is_some_and(|t| t.as_bytes() == v)
}

/// The answer for `req` from `e`: whole, HEAD, 304 to a satisfied conditional request,
/// or a byte range of a stored whole answer (206, or 416 past its end), as Varnish does.
fn answer(e: &Entry, req: &Parts, now_ns: u64, status: String) -> Response<Body> {
    let not_mod = e.status == StatusCode::OK && not_modified(&req.headers, e);
    let range = (e.status == StatusCode::OK && req.method == Method::GET && !not_mod)
        .then(|| byte_range(&req.headers, e.body.len()))
        .flatten()
        .filter(|_| if_range_holds(&req.headers, e));
    let (code, body) = if not_mod {
        (StatusCode::NOT_MODIFIED, Bytes::new())
    } else if req.method == Method::HEAD {
        (e.status, Bytes::new())
    } else {
        match &range {
            Some(Ok(r)) => (StatusCode::PARTIAL_CONTENT, e.body.slice(r.clone())),
            Some(Err(())) => (StatusCode::RANGE_NOT_SATISFIABLE, Bytes::new()),
            None => (e.status, e.body.clone()),
        }
    };
    let len = if req.method == Method::HEAD {
        e.body.len()
    } else {
        body.len()
    };
    let mut r = Response::new(full(body));
    *r.status_mut() = code;
    let h = r.headers_mut();
    *h = e.headers.clone();
    if not_mod {
        h.remove(header::CONTENT_LENGTH);
    } else {
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    }
    match &range {
        Some(Ok(r)) => {
            let v = format!("bytes {}-{}/{}", r.start, r.end - 1, e.body.len());
            if let Ok(v) = HeaderValue::from_str(&v) {
                h.insert(header::CONTENT_RANGE, v);
            }
        }
        Some(Err(())) => {
            if let Ok(v) = HeaderValue::from_str(&format!("bytes */{}", e.body.len())) {
                h.insert(header::CONTENT_RANGE, v);
            }
        }
        None => {}
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

/// How the flights of background refreshes begin.
const REFRESH: &str = "refresh\u{0}";

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
            if parts.method == Method::HEAD || shapes_its_answer(&parts.headers) {
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
            // The whole answer, whatever the client has: it is stored for every client,
            // and a 200 answers a conditional request too (as Varnish fetches a miss).
            let mut parts = parts;
            parts.headers.remove(header::IF_NONE_MATCH);
            parts.headers.remove(header::IF_MODIFIED_SINCE);
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
            // Only what the upstream answered decides for the key: not an answer shaped by
            // the client's own credentials.
            if stored {
                self.store.cacheable_again(flight);
            } else if !sent.headers.contains_key(header::AUTHORIZATION) {
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
        resp: Response<PooledBody>,
        leader: Option<Leader>,
        stored_status: &'static str,
        passed_status: &'static str,
    ) -> (Response<Body>, bool) {
        // An invalidation of the URI since the request left keeps its answer out.
        let storable = born.unchanged().then(|| self.storable(ask, sent, &resp));
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
                // An answer that turns out too large to keep marks its key to pass, as any
                // other answer that could not be stored.
                let pass = leader
                    .as_ref()
                    .map(|l| l.key.clone())
                    .filter(|k| !k.starts_with(REFRESH));
                let on_large = {
                    let cache = self.clone();
                    move || {
                        if let Some(k) = pass {
                            cache.store.mark_uncacheable(&k, stored_ns);
                        }
                    }
                };
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
                })
                .on_too_large(on_large);
                // The copy fills at the upstream's pace, whatever this client reads: the
                // requests waiting for it are answered when it is stored.
                let resp = resp.map(|mut body| {
                    body.collect_into(collector);
                    body.read_ahead()
                });
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

    /// A GET for the whole answer: the client's conditionals and range left out.
    fn whole(parts: &Parts) -> Parts {
        let mut p = copy_parts(parts);
        p.method = Method::GET;
        for name in [
            header::IF_NONE_MATCH,
            header::IF_MODIFIED_SINCE,
            header::IF_MATCH,
            header::IF_UNMODIFIED_SINCE,
            header::IF_RANGE,
            header::RANGE,
        ] {
            p.headers.remove(name);
        }
        p
    }

    /// The request that asks the upstream whether `e` is still good.
    fn conditional(parts: &Parts, e: &Entry) -> Parts {
        let mut p = Self::whole(parts);
        if let Some(etag) = e.headers.get(header::ETAG) {
            p.headers.insert(header::IF_NONE_MATCH, etag.clone());
        }
        if let Some(lm) = e.headers.get(header::LAST_MODIFIED) {
            p.headers.insert(header::IF_MODIFIED_SINCE, lm.clone());
        }
        p
    }

    /// `e` refreshed by a 304: its headers updated from the 304's (RFC 9111 §3.2, §4.3.4),
    /// except those that describe the stored body itself (`Content-Length`,
    /// `Content-Encoding`, `Content-Range`, `Content-MD5`) and `Age`; `born` is the URI's
    /// state when the revalidation left.
    fn refreshed(
        &self,
        ask: &Ask<'_>,
        e: &Entry,
        not_modified: &HeaderMap,
        born: Born,
    ) -> Option<Entry> {
        let mut headers = e.headers.clone();
        for name in not_modified.keys() {
            let kept = *name == header::CONTENT_LENGTH
                || *name == header::AGE
                || *name == header::CONTENT_ENCODING
                || *name == header::CONTENT_RANGE
                || name.as_str() == "content-md5";
            if kept {
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
            born,
        })
    }

    /// Whether a 304 names another representation than `e` by its `ETag` (RFC 9111
    /// §4.3.4): then it refreshes nothing, and the whole answer is asked for.
    fn names_another(e: &Entry, not_modified: &HeaderMap) -> bool {
        match not_modified.get(header::ETAG) {
            None => false,
            Some(new) => e.headers.get(header::ETAG) != Some(new),
        }
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
            Self::whole(&parts)
        };
        let now = ask.now_ns;
        let stale_ok =
            !e.fresh.stale_if_error.is_zero() && e.stale_within(now, e.fresh.stale_if_error);
        let born = self.store.born(uri);
        let mut fetched = up.fetch(copy_parts(&sent)).await;
        let (sent, fetched) = match fetched {
            Ok(r)
                if r.status() == StatusCode::NOT_MODIFIED
                    && Self::names_another(&e, r.headers()) =>
            {
                let whole = Self::whole(&parts);
                fetched = up.fetch(copy_parts(&whole)).await;
                (whole, fetched)
            }
            other => (sent, other),
        };
        match fetched {
            Ok(resp) if resp.status() == StatusCode::NOT_MODIFIED && has_validators => {
                m.revalidated.fetch_add(1, Ordering::Relaxed);
                let status = "tollgate; fwd=stale; fwd-status=304".to_string();
                match self.refreshed(ask, &e, resp.headers(), born) {
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
                        (uri, born),
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
        let flight = format!("{REFRESH}{uri}\u{0}{}", ask.consumer.unwrap_or(""));
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
        let (peer, trusted, https) = (ask.peer.clone(), ask.trusted, ask.https);
        let born = self.store.born(&uri);
        tokio::spawn(async move {
            let ask = Ask {
                cfg: &cfg,
                route: &route,
                consumer: consumer.as_deref(),
                credentials: &credentials,
                wait: Duration::ZERO,
                now_ns,
                clock: &clock,
                peer: &peer,
                trusted,
                https,
            };
            let Ok(resp) = up.fetch(copy_parts(&sent)).await else {
                return;
            };
            if resp.status() == StatusCode::NOT_MODIFIED {
                if Self::names_another(&e, resp.headers()) {
                    // Left for the next request to fetch whole.
                    return;
                }
                if let Some(fresh) = cache.refreshed(&ask, &e, resp.headers(), born) {
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
                (&uri, born),
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
