//! A request the cache may answer: a hit, a stale entry, or a miss, in that order.

use super::answer::{self, answer};
use super::fill::{Miss, PASS_STATUS};
use super::inflight::{Cache, Fetch, Outcome, Turn};
use super::key::{asks, has_credentials, shapes_its_answer, variant_key, Ask, Key};
use crate::exchange::{Fields, Parts, Refusal};
use crate::response::Body;
use http::header;
use http::{Method, Response, StatusCode};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::time::Instant;

impl Cache {
    /// Answers a GET or HEAD from the cache, or through the way upstream `up` makes (only
    /// when it is needed: a hit makes none) and stores what may be stored.
    pub async fn serve<F: Fetch>(
        self: &Arc<Self>,
        ask: Ask<'_>,
        key: Key,
        parts: Parts,
        up: impl FnOnce() -> Arc<F>,
    ) -> Result<Response<Body>, Refusal> {
        let plain = key.plain;
        let uri = &plain[..key.uri_len];
        let url = &plain[key.url_start..key.uri_len];
        let m = &self.store.metrics;
        let mut w = Waiting::default();
        loop {
            // Checked again after waiting for another request's answer, which may have
            // found its answer could not be stored.
            if w.waited
                .as_deref()
                .is_some_and(|k| self.store.is_uncacheable(k, ask.now_ns))
            {
                if asks(&parts.headers, "only-if-cached") {
                    return Ok(answer::only_if_cached());
                }
                return self.straight_upstream(&*up(), parts, PASS_STATUS).await;
            }
            // The key without varying headers first: most responses vary on nothing. A
            // stale one of a URI whose answers have varied since is passed over: the
            // variants stored after it are the URI's answers now.
            let (entry, miss, vary_key) = match self.store.get(&plain) {
                Some(e) if e.is_fresh(ask.now_ns) || self.store.varies(uri).is_none() => {
                    (Some(e), Miss::Other, None)
                }
                _ => match self.store.varies(uri) {
                    Some(v) => {
                        let key = variant_key(uri, &ask, &v, &parts.headers);
                        (self.store.get(&key), Miss::Vary, Some(key))
                    }
                    None => (None, Miss::Uri, None),
                },
            };
            if let Some(e) = &entry {
                let now = ask.now_ns;
                if e.is_fresh(now) {
                    let counter = if w.collapsed { &m.coalesced } else { &m.hits };
                    counter.fetch_add(1, Ordering::Relaxed);
                    let status = if w.collapsed {
                        format!("tollgate; fwd={}; collapsed", miss.as_str())
                    } else {
                        format!("tollgate; hit; ttl={}", e.ttl(now))
                    };
                    return Ok(answer(e, &parts, now, status));
                }
                if e.stale_within(now, e.fresh.stale_while_revalidate) {
                    m.stale.fetch_add(1, Ordering::Relaxed);
                    self.refresh_in_background(&ask, uri, url, &parts, e, up());
                    let status = format!("tollgate; hit; ttl={}", e.ttl(now));
                    return Ok(answer(e, &parts, now, status));
                }
                let stale_ok = !e.fresh.stale_if_error.is_zero()
                    && e.stale_within(now, e.fresh.stale_if_error);
                if w.upstream_failed && stale_ok {
                    m.stale.fetch_add(1, Ordering::Relaxed);
                    let status = "tollgate; fwd=stale; collapsed".to_string();
                    return Ok(answer(e, &parts, now, status));
                }
            }
            // From here the upstream is needed: for a stale entry, one request asks it and
            // the others wait for its answer; for a miss, they wait for a request already
            // on its way upstream for the key. Of a URI known to vary, the key is the
            // variant's: another variant's miss is not this one's answer, and its answer
            // being private says nothing of this.
            if asks(&parts.headers, "only-if-cached") {
                return Ok(answer::only_if_cached());
            }
            // Requests with credentials wait for and lead one another only: an answer to
            // credentials may be theirs alone (read here: a hit does not pay for it).
            let credentials = has_credentials(&parts.headers);
            let flight = flight_of(vary_key.as_deref().unwrap_or(&plain), credentials);
            // The last answer for the flight (the variant's key, or credentials' own)
            // could not be stored: its requests go straight upstream a while, without
            // waiting for one another (the URI's own mark was read before the cache).
            if self.store.is_uncacheable(&flight, ask.now_ns) {
                return self.straight_upstream(&*up(), parts, PASS_STATUS).await;
            }
            if let Some(e) = entry {
                match self.turn(&flight, w.may_wait()) {
                    Turn::Wait(rx) => w.on(self, rx, flight, ask.wait).await,
                    Turn::Go(leader) => {
                        return self
                            .revalidate(&ask, (uri, url), parts, e, up(), leader)
                            .await;
                    }
                }
                continue;
            }
            if shapes_its_answer(&parts.headers) {
                return self
                    .straight_upstream(&*up(), parts, miss.status(false))
                    .await;
            }
            let leader = match self.turn(&flight, w.may_wait()) {
                Turn::Wait(rx) => {
                    w.on(self, rx, flight, ask.wait).await;
                    continue;
                }
                Turn::Go(leader) => leader,
            };
            m.misses.fetch_add(1, Ordering::Relaxed);
            // The whole answer, whatever the client asked: it is stored for every client,
            // and a 200 answers a conditional request, a HEAD and a range too (as nginx
            // and Varnish fetch a miss: a GET, without the client's range).
            let mut parts = parts;
            // A range's request as the client sent it, should the answer not be kept.
            let ranged = parts
                .headers
                .contains_key(header::RANGE)
                .then(|| parts.copy());
            let mut asked = Fields::default();
            for name in [
                header::IF_NONE_MATCH,
                header::IF_MODIFIED_SINCE,
                header::RANGE,
                header::IF_RANGE,
            ] {
                if let Some(v) = parts.headers.remove(&name) {
                    asked.insert(name, v);
                }
            }
            let get = parts.method == Method::GET;
            parts.method = Method::GET;
            let sent = parts.copy();
            let born = self.store.born(uri);
            let up = up();
            let resp = match up.fetch(parts).await {
                Ok(r) => r,
                Err(e) => {
                    // The waiting ones go upstream together, or are served stale.
                    if let Some(l) = &leader {
                        l.failed();
                    }
                    return Err(e);
                }
            };
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
            // Only what the upstream answered decides for the key (requests with
            // credentials have a flight, and so a marker, of their own).
            if stored {
                self.store.cacheable_again(&flight);
            } else {
                self.store.mark_uncacheable(&flight, ask.now_ns);
                // A whole answer that will not be kept is not read through to the part
                // a client asked for (a byte at the end of a large file would cost the
                // whole file): its range goes upstream as it asked, as the requests that
                // follow for the key go (as nginx's `proxy_cache_max_range_offset` sends
                // such ranges).
                if let Some(ranged) = ranged.filter(|_| resp.status() == StatusCode::OK) {
                    drop(resp);
                    // One miss, counted above.
                    let resp = up.fetch(ranged).await?;
                    let resp = resp.map(http_body_util::Either::Left);
                    return Ok(answer::with_status(resp, miss.status(false)));
                }
            }
            // A client whose conditional the answer satisfies gets its 304; the answer
            // is stored all the same (its fill does not need this client).
            if stored
                && resp.status() == StatusCode::OK
                && answer::satisfied(&asked, resp.headers())
            {
                return Ok(answer::not_modified_from(&resp));
            }
            if get && asked.contains_key(header::RANGE) {
                return Ok(answer::part_of(resp, &asked));
            }
            return Ok(resp);
        }
    }
}

/// How a request has waited for other requests' fetches of its key.
#[derive(Default)]
struct Waiting {
    /// It waited at least once.
    collapsed: bool,
    /// The flight it last waited for.
    waited: Option<String>,
    /// The request it waited for found the upstream failing.
    upstream_failed: bool,
    /// Waiting ends here, one `ask.wait` after it began, however many requests it waits
    /// for in turn (as nginx's `proxy_cache_lock_timeout`): when the answer it waited for
    /// is no use to it (another variant's, one cut off), the waiting requests choose one
    /// of them to go upstream next.
    deadline: Option<Instant>,
    /// The request waited for said to go upstream without waiting again: it failed, or
    /// its answer serves none of them and another's would fare no better (one to
    /// credentials not stored, a 304 that could not refresh).
    released: bool,
}

impl Waiting {
    fn may_wait(&self) -> bool {
        !self.released && self.deadline.is_none_or(|d| Instant::now() < d)
    }

    /// Waits for the request on its way upstream for `flight` (`rx`), at most `wait`
    /// after the first wait began, and notes what it said.
    async fn on(
        &mut self,
        cache: &Cache,
        rx: tokio::sync::watch::Receiver<Outcome>,
        flight: String,
        wait: std::time::Duration,
    ) {
        let until = *self.deadline.get_or_insert_with(|| Instant::now() + wait);
        let said = cache.wait_for(rx, until).await;
        self.upstream_failed = said == Outcome::Failed;
        self.released |= said != Outcome::Pending;
        self.collapsed = true;
        self.waited = Some(flight);
    }
}

/// The flight of a key: requests with credentials have one of their own.
fn flight_of(key: &str, credentials: bool) -> String {
    if credentials {
        format!("{key}\u{0}credentials")
    } else {
        key.to_string()
    }
}
