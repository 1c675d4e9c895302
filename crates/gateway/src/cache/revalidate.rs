//! A stale entry: revalidated with its validators by one request while the others wait,
//! or refreshed in the background within `stale-while-revalidate`; served stale within
//! `stale-if-error`.

use super::answer::{self, answer};
use super::control;
use super::fill::{REFRESH, STALE_PASSED, STALE_STORED};
use super::inflight::{Cache, Fetch, Leader};
use super::key::{has_credentials, variant_key, varies_of, Ask};
use super::store::{self, Born, Entry};
use crate::exchange::{Parts, Refusal};
use crate::response::Body;
use http::header::{self, HeaderMap};
use http::{Method, Response, StatusCode};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

impl Cache {
    /// The request that asks the upstream whether `e` is still good.
    pub(super) fn conditional(parts: &Parts, e: &Entry) -> Parts {
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
    pub(super) fn refreshed(
        &self,
        ask: &Ask<'_>,
        e: &Entry,
        not_modified: &HeaderMap,
        born: Born,
        authorized: bool,
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
        // A 304 without `Date` is dated when it arrived (RFC 9110 §6.6.1): the stored
        // `Date` is the first answer's, and kept it would age the refreshed entry from then.
        if !not_modified.contains_key(header::DATE) {
            if let Ok(v) = header::HeaderValue::from_str(&httpdate::fmt_http_date(ask.wall())) {
                headers.insert(header::DATE, v);
            }
        }
        // A 304 to a request with `Authorization` refreshes what others are served only
        // where an answer to such a request may be stored (RFC 9111 §3.5): its headers
        // may be that caller's.
        let fresh = control::storable(
            &Method::GET,
            e.status,
            &HeaderMap::new(),
            &headers,
            authorized,
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
    /// `ETag` (RFC 9111 §4.3.4), nor when it sets a cookie (one client's session must not
    /// reach the others through the stored headers), nor when its `Vary` names other
    /// headers than the stored answer's (the refreshed entry would be filed under another
    /// key: `Vary: X-Consumer` kept one consumer's answer apart, another `Vary` would
    /// share it): then the whole answer is asked for, and judged as any answer is.
    pub(super) fn refreshes(&self, e: &Entry, not_modified: &HeaderMap) -> bool {
        let another = not_modified
            .get(header::ETAG)
            .is_some_and(|new| e.headers.get(header::ETAG) != Some(new));
        let other_vary = not_modified.contains_key(header::VARY)
            && vary_names(not_modified) != vary_names(&e.headers);
        !another && !other_vary && !not_modified.contains_key(header::SET_COOKIE)
    }

    /// A stale entry: asked about upstream, served again after a 304, served stale when
    /// the upstream fails within `stale-if-error`, replaced otherwise.
    pub(super) async fn revalidate<F: Fetch>(
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
        let fetched = up.fetch(sent.copy()).await;
        // Whether the request that got the answer was conditional: a 304 to one that was
        // not (the whole answer asked for again) refreshes nothing, as Varnish refuses
        // it; it is passed on as any answer is, and not stored.
        let (sent, fetched, conditional) = match fetched {
            Ok(r) if r.status() == StatusCode::NOT_MODIFIED && !self.refreshes(&e, r.headers()) => {
                // Its body holds a place among the connection's upstream streams.
                drop(r);
                let whole = Self::whole(&parts);
                let fetched = up.fetch(whole.copy()).await;
                (whole, fetched, false)
            }
            other => (sent, other, has_validators),
        };
        match fetched {
            Ok(resp) if resp.status() == StatusCode::NOT_MODIFIED && conditional => {
                m.revalidated.fetch_add(1, Ordering::Relaxed);
                let status = "tollgate; fwd=stale; fwd-status=304".to_string();
                let authorized = has_credentials(&parts.headers);
                match self.refreshed(ask, &e, resp.headers(), born, authorized) {
                    Some(fresh) => {
                        let varies = varies_of(ask.cfg, &fresh.headers);
                        let key = variant_key(uri, ask, &varies, &parts.headers);
                        let r = answer(&fresh, &parts, now, status);
                        self.store.put(varies, key, fresh);
                        Ok(r)
                    }
                    None => {
                        // Not refreshed (a 304 to credentials that is not theirs to share,
                        // or one saying `no-store`): the waiting ones ask for themselves.
                        if let Some(l) = &leader {
                            l.pass();
                        }
                        Ok(answer(&e, &parts, now, status))
                    }
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
                // The whole GET was asked for, whatever the client asked (a HEAD, a range):
                // stored for every client, and shaped for this one.
                let (resp, _) = self.store_on_the_way(
                    ask,
                    (uri, born),
                    url.to_string(),
                    &sent,
                    resp,
                    leader,
                    STALE_STORED,
                    STALE_PASSED,
                );
                if parts.method == Method::GET && parts.headers.contains_key(header::RANGE) {
                    return Ok(answer::part_of(resp, &parts.headers));
                }
                Ok(resp)
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
            Err(refusal) => {
                // The waiting ones go upstream together, not one after the other.
                if let Some(l) = &leader {
                    l.failed();
                }
                Err(refusal)
            }
        }
    }

    /// Starts one background refresh of a stale entry (none if one is already running).
    pub(super) fn refresh_in_background<F: Fetch>(
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
            let Ok(resp) = up.fetch(sent.copy()).await else {
                return;
            };
            if resp.status() == StatusCode::NOT_MODIFIED {
                let conditional = e.headers.contains_key(header::ETAG)
                    || e.headers.contains_key(header::LAST_MODIFIED);
                if !conditional || !cache.refreshes(&e, resp.headers()) {
                    // Left for the next request to fetch whole.
                    return;
                }
                let authorized = has_credentials(&sent.headers);
                if let Some(fresh) = cache.refreshed(&ask, &e, resp.headers(), born, authorized) {
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

/// The header names a `Vary` lists, lower-cased and sorted: two spellings of one list
/// compare equal.
fn vary_names(h: &HeaderMap) -> Vec<String> {
    let mut names: Vec<String> = h
        .get_all(header::VARY)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("\u{0}").split(','))
        .map(|n| n.trim().to_ascii_lowercase())
        .filter(|n| !n.is_empty())
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}
