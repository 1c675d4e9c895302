//! The context one request carries through the phases of the request path: what it is,
//! what each phase learned of it, and the small steps that read it (the hop upstream, what
//! every answer owes the client).

use super::fetch::{nanos, went_upstream};
use crate::exchange::{ConnInfo, Parts, Refusal};
use crate::observe::request_id::X_REQUEST_ID;
use crate::observe::trace::RequestTrace;
use crate::policy::{self, cors, Admitted};
use crate::response::Body;
use crate::snapshot::{Route, Snapshot};
use crate::upstream::{AnsweredBy, Hop};
use http::{HeaderValue, Response};
use std::sync::Arc;
use std::time::Instant;

/// One request on its way through the phases: what it is, and what it did so far, for the
/// phases after it and for the access log, the metrics and the usage history. It borrows
/// from the request's pinned snapshot.
pub(crate) struct Ctx<'s> {
    /// The snapshot the request is served on.
    pub(super) snap: &'s Snapshot,
    /// The client connection.
    pub(super) conn: &'s Arc<ConnInfo>,
    /// When the request head was handed over.
    pub(super) start: Instant,
    /// `X-Request-Id`: the client's, when trusted, or a new one.
    pub(super) request_id: HeaderValue,
    /// The route, once one matched (or the one a 405 was meant for).
    pub(super) route: Option<&'s Route>,
    /// The upgrade the client asked for, read before the hop-by-hop headers go.
    pub(super) upgrade: Option<HeaderValue>,
    /// The request is a CORS preflight.
    pub(super) preflight: bool,
    /// The request's allowed CORS origin, on a route that does CORS.
    pub(super) origin: Option<HeaderValue>,
    /// What the policies learned: the consumer (by index in the snapshot, set as soon as
    /// it is known, so that a later refusal is counted under it) and its limits' standing.
    pub(super) admitted: Admitted,
    /// Why the gateway answered itself, if it did ([`REASONS`](crate::exchange::REASONS) index).
    pub(super) refusal: Option<usize>,
    /// The limit that refused, for a 429.
    pub(super) limit: Option<Arc<str>>,
    /// Time waiting for the upstream's response head, when the request went upstream.
    pub(super) upstream_ns: Option<u64>,
    /// Where the upstream target that answered is noted, when the access log or the
    /// request's span wants it.
    pub(super) note_target: Option<&'s AnsweredBy>,
    /// The request's trace, when tracing is on.
    pub(super) trace: Option<RequestTrace>,
}

impl<'s> Ctx<'s> {
    /// A context for a request that arrived now on `conn`, served on `snap`.
    pub(super) fn new(
        snap: &'s Snapshot,
        conn: &'s Arc<ConnInfo>,
        request_id: HeaderValue,
    ) -> Self {
        Ctx {
            snap,
            conn,
            start: Instant::now(),
            request_id,
            route: None,
            upgrade: None,
            preflight: false,
            origin: None,
            admitted: Admitted::default(),
            refusal: None,
            limit: None,
            upstream_ns: None,
            note_target: None,
            trace: None,
        }
    }

    /// What an admitted request carries upstream from the gateway: its id, its trace.
    pub(super) fn going_on(&self, parts: &mut Parts) {
        parts.headers.insert(X_REQUEST_ID, self.request_id.clone());
        if let Some(t) = &self.trace {
            t.prepare(&mut parts.headers);
        }
    }

    /// Phase 2: how the request goes to `route`'s upstream.
    pub(super) fn upstream_peer(&self, route: &'s Route) -> Hop<'s> {
        let conn = self.conn;
        Hop {
            peer_ip: &conn.peer_ip,
            trusted: conn.trusted,
            https: conn.listener.tls.is_some(),
            strip_prefix: route.strip.as_ref(),
            preserve_host: route.cfg.preserve_host,
            max_body: conn.listener.max_body_bytes,
            body_timeout: conn.listener.body_timeout,
            stream_body: !route.cfg.request_buffering,
            route: &route.cfg.name,
            note_target: self.note_target,
            traceparent: self.trace.as_ref().map(RequestTrace::traceparent),
        }
    }

    /// Notes the wait for an upstream's answer, here and in the route's histogram (only
    /// when a request went to a target: see [`went_upstream`]).
    pub(super) fn upstream_took<T>(
        &mut self,
        route: &Route,
        since: Instant,
        outcome: &Result<T, Refusal>,
    ) {
        let ns = nanos(since);
        self.upstream_ns = Some(ns);
        if went_upstream(outcome) {
            route.stats.upstream(ns as f64 / 1e9);
        }
    }

    /// Phase 5: what every answer owes the client, added once. An answer that came from
    /// upstream (or the cache) for an admitted request carries its RateLimit headers; every
    /// answer after routing carries CORS, a preflight's own aside.
    pub(super) fn response_filter(&self, resp: &mut Response<Body>) {
        let Some(route) = self.route else {
            return;
        };
        if self.refusal.is_none() {
            policy::decorate(route, &self.admitted, resp.headers_mut());
        }
        match (&self.origin, &route.cfg.cors, self.preflight) {
            (Some(origin), Some(c), false) => cors::decorate(c, origin.clone(), resp.headers_mut()),
            (None, Some(c), false) => cors::vary_origin(c, resp.headers_mut()),
            _ => {}
        }
    }
}
