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

pub(crate) mod answer;
pub mod control;
mod key;
pub use answer::CACHE_STATUS;
mod report;
pub mod store;

use answer::{answer, with_status};
use key::{host_of, shapes_its_answer, uri_key, url_of, variant_key, varies_of};
pub use key::{Ask, Key};

use crate::exchange::Refusal;
use crate::response::Body;
use crate::upstream::{Collector, PooledBody};
use http::header::{self, HeaderMap};
use http::request::Parts;
use http::{Method, Response, StatusCode};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use store::{Born, Entry, Store};
use tokio::sync::watch;

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

/// A copy of a request head.
pub fn copy_parts(p: &Parts) -> Parts {
    let mut r = http::Request::new(());
    *r.method_mut() = p.method.clone();
    *r.uri_mut() = p.uri.clone();
    *r.version_mut() = p.version;
    *r.headers_mut() = p.headers.clone();
    r.into_parts().0
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
            let mut conditional = HeaderMap::new();
            for name in [header::IF_NONE_MATCH, header::IF_MODIFIED_SINCE] {
                if let Some(v) = parts.headers.remove(&name) {
                    conditional.insert(name, v);
                }
            }
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
            // A client whose conditional the answer satisfies gets its 304; the answer
            // is stored all the same (its fill does not need this client).
            if stored
                && resp.status() == StatusCode::OK
                && !conditional.is_empty()
                && answer::satisfied(&conditional, resp.headers())
            {
                return Ok(answer::not_modified_from(&resp, miss.status(true)));
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
                    let (cache, clock) = (self.clone(), ask.clock.clone());
                    // Marked from when it is found out, which a slow answer can make late.
                    move || {
                        if let Some(k) = pass {
                            cache.store.mark_uncacheable(&k, clock.now_nanos());
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

    /// Whether a 304 may refresh `e`. Not when it names another representation by its
    /// `ETag` (RFC 9111 §4.3.4), nor when on a shared route it sets a cookie (one client's
    /// session must not reach the others through the stored headers): then the whole answer
    /// is asked for, and judged as any answer is.
    fn refreshes(&self, ask: &Ask<'_>, e: &Entry, not_modified: &HeaderMap) -> bool {
        let another = not_modified
            .get(header::ETAG)
            .is_some_and(|new| e.headers.get(header::ETAG) != Some(new));
        let cookie = ask.cfg.shared && not_modified.contains_key(header::SET_COOKIE);
        !another && !cookie
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
        let fetched = up.fetch(copy_parts(&sent)).await;
        let (sent, fetched) = match fetched {
            Ok(r)
                if r.status() == StatusCode::NOT_MODIFIED
                    && !self.refreshes(ask, &e, r.headers()) =>
            {
                // Its body holds a place among the connection's upstream streams.
                drop(r);
                let whole = Self::whole(&parts);
                let fetched = up.fetch(copy_parts(&whole)).await;
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
                if !cache.refreshes(&ask, &e, resp.headers()) {
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
