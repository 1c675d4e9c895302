//! A miss's way: the answer streams to its client and a copy is stored at its end when
//! it may be; what the upstream's answer says of the key when it may not.

use super::answer::with_status;
use super::control;
use super::inflight::{Cache, Fetch, Leader};
use super::key::{has_credentials, host_of, variant_key, varies_of, Ask};
use super::store::{self, Born, Entry};
use crate::exchange::{Parts, Refusal};
use crate::response::Body;
use crate::upstream::{Collector, PooledBody};
use http::header::{self};
use http::{Method, Response};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The `Cache-Status` of a request sent straight upstream because the last answer for its
/// key could not be stored.
pub const PASS_STATUS: &str = "tollgate; fwd=uri-miss";

/// How the stored entry (if any) was found wanting.
#[derive(Clone, Copy)]
pub(super) enum Miss {
    /// Nothing stored for the URI.
    Uri,
    /// The URI, but not for this request's varying headers.
    Vary,
    /// Nothing usable (another consumer's, or stale with nothing to revalidate with).
    Other,
}

impl Miss {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Miss::Uri => "uri-miss",
            Miss::Vary => "vary-miss",
            Miss::Other => "miss",
        }
    }

    /// The `Cache-Status` of the upstream's answer, stored or not.
    pub(super) fn status(self, stored: bool) -> &'static str {
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
pub(super) const REFRESH: &str = "refresh\u{0}";

/// The `Cache-Status` of a stale entry's replacement, stored or not.
pub(super) const STALE_STORED: &str = "tollgate; fwd=stale; stored";
pub(super) const STALE_PASSED: &str = "tollgate; fwd=stale";

impl Cache {
    /// A miss that neither waits nor stores: `up`'s answer as it comes, with `status`.
    pub(super) async fn straight_upstream<F: Fetch>(
        &self,
        up: &F,
        parts: Parts,
        status: &'static str,
    ) -> Result<Response<Body>, Refusal> {
        self.store.metrics.misses.fetch_add(1, Ordering::Relaxed);
        let resp = up.fetch(parts).await?;
        Ok(with_status(resp.map(http_body_util::Either::Left), status))
    }

    /// The upstream's answer to a miss, streamed to the client; a copy is stored at its end
    /// when it may be. The leader (if any) is let go once the copy is stored or dropped.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn store_on_the_way(
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
                // `stored` is said only of an answer whose length is known to fit: one of
                // unknown length may yet turn out too large (then it is not kept).
                let sized = resp.headers().contains_key(header::CONTENT_LENGTH)
                    || matches!(resp.status().as_u16(), 204 | 304);
                let status = if sized { stored_status } else { passed_status };
                let r = with_status(resp.map(http_body_util::Either::Left), status);
                (r, true)
            }
            None => {
                // Said before the waiting ones are let go: an answer the upstream made
                // unstorable sends them all upstream at once (hit-for-pass), one to
                // credentials (theirs too: they share its flight) as well; one cut off
                // by an invalidation lets one of them fetch again.
                if let Some(l) = &leader {
                    if born.unchanged() && !l.key.starts_with(REFRESH) {
                        // Answers to credentials mark their own flight only.
                        self.store.mark_uncacheable(&l.key, ask.now_ns);
                    }
                    if has_credentials(&sent.headers) {
                        l.pass();
                    }
                }
                drop(leader);
                let r = with_status(resp.map(http_body_util::Either::Left), passed_status);
                (r, false)
            }
        }
    }

    /// Whether the response to `sent` may be stored, and its freshness.
    pub(super) fn storable(
        &self,
        ask: &Ask<'_>,
        sent: &Parts,
        resp: &Response<PooledBody>,
    ) -> Option<control::Freshness> {
        let h = resp.headers();
        // A cookie is one client's session: never stored, on any route (as nginx and
        // Varnish do by default). One key may serve many end users, and a route without
        // keys shares its entries with every caller.
        if h.contains_key(header::SET_COOKIE) || h.contains_key("set-cookie2") {
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
            // Credentials for a proxy on the way are credentials too (RFC 9111 §3.5).
            has_credentials(&sent.headers),
            ask.cfg.default_ttl,
            ask.wall(),
        )
    }

    /// A GET for the whole answer: the client's conditionals and range left out.
    pub(super) fn whole(parts: &Parts) -> Parts {
        let mut p = parts.copy();
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
}
