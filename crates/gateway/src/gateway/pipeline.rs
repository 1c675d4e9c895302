//! The request path, one phase after another, in the order they run (the phases of
//! Pingora's `ProxyHttp`, called statically):
//!
//! 1. [`request_filter`](Gateway::request_filter): the request head made safe (inbound),
//!    the route, then the policies (method, CORS preflight, auth, authz, limits). A
//!    refusal, or a preflight's answer, ends the request here.
//! 2. [`upstream_peer`](Ctx::upstream_peer): the route's upstream and how the request is
//!    rewritten for the hop.
//! 3. [`proxy`](Gateway::proxy): an upgrade, the cache, or a plain forward.
//! 4. [`fail_to_proxy`](Gateway::fail_to_proxy): a refusal, whichever phase made it,
//!    becomes its answer (one mapping: `response::refuse`).
//! 5. [`response_filter`](Ctx::response_filter): what every answer owes the client, once:
//!    the RateLimit headers of an admitted request, CORS, the request id.
//! 6. [`logging`](super::logging): metrics, usage history and the access log line, once
//!    the answer is here or, for a request dropped before it (the client gone, a drain
//!    over), as a 499.
//!
//! One [`Ctx`] carries a request through them all, held by the guard phase 6 counts from.

use super::ctx::Ctx;
use super::fetch::{share_for, UpFetch};
use super::logged_head::Head;
use super::logging::Unanswered;
use super::state::Gateway;
use crate::cache::{self, Ask};
use crate::exchange::{ConnInfo, Parts, Refusal, UpstreamWork};
use crate::inbound;
use crate::listener::RequestBody;
use crate::observe::logged::Logged;
use crate::observe::request_id::{self, X_REQUEST_ID};
use crate::observe::trace::RequestTrace;
use crate::policy::limits::{self, Attempt, Limited};
use crate::policy::{self, cors, Verdict};
use crate::response::{refuse, Body};
use crate::route;
use crate::snapshot::Route;
use crate::upstream::{self, AnsweredBy, Hop, PooledBody};
use http::{HeaderValue, Method, Response};
use http_body_util::Either;
use hyper::body::Body as _;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// What the request filter made of a request it did not refuse.
enum Filtered {
    /// It goes on upstream.
    Forward,
    /// Answered here (a CORS preflight).
    Answer(Box<Response<Body>>),
    /// A shared limit's lease is on its way: the limits are checked again when it lands.
    Leasing,
}

/// The longest a request waits for a shared limit's lease. The request starts a round at
/// once, so the wait is one Redis round trip when Redis answers; a round that fails (its
/// commands time out after 1 s) tells the limits Redis is down, and the request is then
/// decided as `on_redis_down` says. This bound is a backstop past that.
fn lease_wait(sync_interval: Duration) -> Duration {
    Duration::from_secs(1) + (sync_interval * 2).min(Duration::from_secs(1))
}

impl Gateway {
    /// Handles one request on the snapshot current when it arrived, phase by phase: gives
    /// it an id, answers it, counts it in the metrics and the usage history, and logs it
    /// once its body has been sent.
    pub async fn serve(
        &self,
        mut parts: Parts,
        body: RequestBody,
        conn: &Arc<ConnInfo>,
    ) -> Response<Logged<Body>> {
        let snap = self.snapshot.load_full();
        let answered = AnsweredBy::default();
        let (id, id_bits) = request_id::pick(
            &parts.headers,
            conn.trusted || conn.listener.trust_request_id,
        );
        let h2 = parts.version == http::Version::HTTP_2;
        // From here the request is counted and logged even if it never gets its answer.
        let ctx = Ctx::new(&snap, conn, id);
        let mut open = Unanswered::new(self, &snap, &answered, ctx, parts.method.clone());
        let log = self.access_log.load_full();
        // Without `tracing:` nothing is loaded; with it, a guard, not a clone: only a
        // sampled request keeps the exporter.
        let tracing = snap.config.tracing.is_some();
        open.spans = tracing.then(|| self.spans.load()).and_then(|g| {
            let s = g.as_ref()?;
            let trace = s.begin(
                &parts.headers,
                conn.trusted || conn.listener.trust_trace_context,
                id_bits,
            );
            let sampled = trace.sampled;
            open.ctx.trace = Some(trace);
            sampled.then(|| s.clone())
        });
        let sampled = open.spans.is_some();
        if log.is_some() || sampled {
            open.head = Some(Head::of(&parts, conn, log.is_some(), sampled));
            open.ctx.note_target = Some(&answered);
        }
        open.log = log;
        open.wall_ns = self.analytics.is_some().then(|| self.clock.wall_nanos());
        let ctx = &mut open.ctx;
        // A body declared larger than the listener takes (its `Content-Length`, as the
        // body knows it before any of it is read).
        let too_large = body.size_hint().lower() > conn.listener.max_body_bytes;
        let mut filtered = self.request_filter(ctx, &mut parts, too_large);
        if let Err(Refusal::KeysComing { .. }) = filtered {
            filtered = Box::pin(self.after_keys(ctx, &mut parts, filtered)).await;
        }
        if matches!(filtered, Ok(Filtered::Leasing)) {
            filtered = self.after_lease(ctx, &mut parts).await;
        }
        let mut resp = match filtered {
            Ok(Filtered::Forward) => match self.proxy(ctx, parts, body).await {
                Ok(resp) => resp,
                Err(r) => self.fail_to_proxy(ctx, r),
            },
            Ok(Filtered::Answer(answer)) => *answer,
            // `after_lease` ends in one of the others.
            Ok(Filtered::Leasing) => self.fail_to_proxy(ctx, Refusal::LimitStoreDown),
            Err(r) => self.fail_to_proxy(ctx, r),
        };
        ctx.response_filter(&mut resp);
        resp.headers_mut()
            .insert(X_REQUEST_ID, ctx.request_id.clone());
        // For HTTP/2's reset balance only: an extension map costs an allocation.
        if h2 && ctx.upstream_ns.is_some() {
            resp.extensions_mut().insert(UpstreamWork);
        }
        let status = resp.status().as_u16();
        let line = open.answered(status, resp.headers().get(cache::CACHE_STATUS));
        drop(open);
        // The request's own reference to its snapshot moves into its log record: nothing
        // is counted or copied for it.
        let pending = line.map(|line| line(snap, &answered));
        resp.map(|b| Logged::new(b, pending))
    }

    /// Phase 1: makes the request head safe, finds the route and runs the policies.
    /// `Err`: refused.
    fn request_filter<'s>(
        &self,
        ctx: &mut Ctx<'s>,
        parts: &mut Parts,
        too_large: bool,
    ) -> Result<Filtered, Refusal> {
        // Read before `prepare` strips the hop-by-hop headers that ask for it.
        ctx.upgrade = inbound::upgrade_asked(parts);
        inbound::prepare(&ctx.snap.owned, parts)?;
        ctx.preflight = cors::is_preflight(parts);
        let route = match route::find(ctx.snap, parts, ctx.preflight) {
            Ok(r) => r,
            Err((r, meant)) => {
                // A refusal of the route meant (405) carries its CORS headers, so that a
                // script can read it.
                ctx.origin = meant.and_then(|m| policy::cors_origin(m, parts));
                ctx.route = meant;
                return Err(r);
            }
        };
        ctx.route = Some(route);
        ctx.origin = policy::cors_origin(route, parts);
        // A body declared larger than the listener takes is refused before a policy counts
        // the request, as nginx's `client_max_body_size` and Kong's size limit come before
        // their rate limits; under the consumer its credential names, as Kong logs it.
        if too_large {
            ctx.admitted.consumer = policy::identify(
                ctx.snap,
                route,
                parts,
                self.clock.as_ref(),
                ctx.conn.client_names.as_deref(),
            );
            return Err(Refusal::PayloadTooLarge);
        }
        self.policies(ctx, parts, route)
    }

    /// Phase 1's policies, on the route found.
    fn policies<'s>(
        &self,
        ctx: &mut Ctx<'s>,
        parts: &mut Parts,
        route: &'s crate::snapshot::Route,
    ) -> Result<Filtered, Refusal> {
        match policy::run(
            ctx.snap,
            route,
            parts,
            self.clock.as_ref(),
            ctx.conn.client_names.as_deref(),
            &mut ctx.admitted.consumer,
        )? {
            Verdict::Answer(r) => Ok(Filtered::Answer(r)),
            Verdict::Forward(admitted) => {
                ctx.admitted = admitted;
                ctx.going_on(parts);
                Ok(Filtered::Forward)
            }
            Verdict::Leasing(admitted) => {
                ctx.admitted = admitted;
                Ok(Filtered::Leasing)
            }
        }
    }

    /// Phase 1 again for a request whose token named a key its set lacked, once the fetch
    /// of the set it waited for has ended: the policies run once more (a key still unknown
    /// is refused then, as the next fetch is at least 10 s away).
    async fn after_keys(
        &self,
        ctx: &mut Ctx<'_>,
        parts: &mut Parts,
        filtered: Result<Filtered, Refusal>,
    ) -> Result<Filtered, Refusal> {
        let (Some(route), Err(Refusal::KeysComing { seen, why })) = (ctx.route, filtered) else {
            return Err(Refusal::NoRoute);
        };
        let Some(jwt) = &route.jwt else {
            return Err(Refusal::InvalidToken(why));
        };
        jwt.keys.fetched_since(seen).await;
        match self.policies(ctx, parts, route) {
            Err(Refusal::KeysComing { why, .. }) => Err(Refusal::InvalidToken(why)),
            other => other,
        }
    }

    /// Phase 1's end for a request a shared limit could not count yet: waits for the
    /// round it started (bounded by [`lease_wait`]) and checks the limits again as each part
    /// of a round settles. A lease that does not come in time is a 429 with a short `Retry-After`.
    async fn after_lease(&self, ctx: &mut Ctx<'_>, parts: &mut Parts) -> Result<Filtered, Refusal> {
        let (Some(route), Some(consumer)) = (ctx.route, ctx.admitted.consumer) else {
            return Err(Refusal::NoRoute);
        };
        let cluster = self.cluster();
        let mut rounds = cluster.map(|c| c.answers());
        let wait = cluster.map_or(Duration::ZERO, |c| lease_wait(c.cfg.sync_interval));
        let until = tokio::time::Instant::now() + wait;
        // Checked once more at once: an answer that landed before the watch was taken up
        // would not wake it.
        let mut first = true;
        loop {
            let landed = match rounds.as_mut() {
                Some(_) if first => true,
                Some(r) => matches!(
                    tokio::time::timeout_at(until, r.changed()).await,
                    Ok(Ok(()))
                ),
                None => false,
            };
            first = false;
            let may_wait = landed && tokio::time::Instant::now() < until;
            let slot = ctx.admitted.plan_slot;
            let clock = self.clock.as_ref();
            let attempt = Attempt::Again { may_wait };
            if let Limited::Admitted(s) =
                limits::check(ctx.snap, route, consumer, slot, clock, attempt)?
            {
                ctx.admitted.standing = s;
                ctx.going_on(parts);
                return Ok(Filtered::Forward);
            }
        }
    }

    /// Phase 3: the answer from upstream: through an upgraded connection, the cache, or a
    /// plain forward.
    async fn proxy(
        &self,
        ctx: &mut Ctx<'_>,
        mut parts: Parts,
        body: RequestBody,
    ) -> Result<Response<Body>, Refusal> {
        let Some(route) = ctx.route else {
            return Err(Refusal::NoRoute);
        };
        let hop = ctx.upstream_peer(route);
        if let (true, Some(protocol)) = (route.cfg.websocket, ctx.upgrade.take()) {
            if let Some(client) = parts.extensions.remove::<crate::listener::h1::OnUpgrade>() {
                let ask = upstream::UpgradeAsk {
                    protocol,
                    client,
                    metrics: self.metrics.clone(),
                    hold: ctx.conn.clone(),
                };
                let t = Instant::now();
                let resp = Box::pin(upstream::upgrade(&route.upstream, parts, ask, hop)).await;
                ctx.upstream_took(route, t, &resp);
                return Ok(resp?.map(Either::Left));
            }
        }
        let Some(cc) = &route.cfg.cache else {
            let sent = Gateway::may_invalidate(ctx.snap, &parts.method).then(|| parts.copy());
            let resp = forward_timed(ctx, route, parts, body, hop).await?;
            if let (Some(sent), true) = (sent, written(&resp)) {
                self.invalidate_writes(ctx.snap, ctx.conn, &sent, resp.headers());
            }
            return Ok(resp.map(Either::Left));
        };
        let snap = ctx.snap;
        let ask = Ask {
            cfg: cc,
            route: &route.cfg.name,
            consumer: ctx.admitted.consumer.map(|c| snap.consumer_name(c)),
            credentials: route.cfg.auth.as_ref().map_or(&[], |a| a.query.as_slice()),
            wait: route.upstream.cfg.response_timeout,
            now_ns: self.clock.now_nanos(),
            clock: &self.clock,
            peer: &ctx.conn.peer_ip,
            trusted: ctx.conn.trusted,
            https: ctx.conn.listener.tls.is_some(),
        };
        let overridden = cache::overrides_method(&parts.headers);
        // A GET or HEAD the cache will not answer (a bypass, a key that passes) goes
        // upstream, which a client asking `only-if-cached` does not want.
        let not_cached = || {
            matches!(parts.method, Method::GET | Method::HEAD)
                && cache::only_if_cached(&parts.headers)
        };
        if !(matches!(parts.method, Method::GET | Method::HEAD)
            && body.is_end_stream()
            && !overridden)
        {
            if not_cached() {
                return Ok(cache::not_cached());
            }
            // One taken upstream as an unsafe method the route takes may have changed the
            // resource: its success invalidates the URI as that method's does.
            let writes = cache::is_unsafe(&parts.method)
                || (overridden
                    && cache::overrides_to_unsafe(&parts.headers, |m| {
                        policy::method::allows(route, m, false)
                    }));
            let sent = writes.then(|| parts.copy());
            // RFC 9211: forwarded for its method, or (a GET or HEAD with a body, or one
            // asking to be taken as another method) not handled by the cache at all.
            let status = if matches!(parts.method, Method::GET | Method::HEAD) {
                "tollgate; fwd=bypass"
            } else {
                "tollgate; fwd=method"
            };
            let mut resp = forward_timed(ctx, route, parts, body, hop).await?;
            if let (Some(sent), true) = (sent, written(&resp)) {
                self.invalidate_writes(ctx.snap, ctx.conn, &sent, resp.headers());
            }
            cache::forwarded(resp.headers_mut(), status);
            return Ok(resp.map(Either::Left));
        }
        let key = cache::Key::of(&ask, &parts);
        if self.cache.passes(&key, ask.now_ns) {
            if not_cached() {
                return Ok(cache::not_cached());
            }
            // Nothing to look up or store: the plain path, as without a cache.
            let mut resp = forward_timed(ctx, route, parts, body, hop)
                .await?
                .map(Either::Left);
            cache::forwarded(resp.headers_mut(), cache::PASS_STATUS);
            return Ok(resp);
        }
        // The cache's way upstream, made only when a request needs it (a hit does not).
        let fetch = OnceLock::new();
        let conn = ctx.conn;
        let traceparent = ctx.trace.as_ref().map(RequestTrace::traceparent);
        let make = || {
            fetch
                .get_or_init(|| Arc::new(UpFetch::new(route, conn, traceparent)))
                .clone()
        };
        let resp = Box::pin(self.cache.serve(ask, key, parts, make)).await;
        // The request's own fetch, if it made one and it was answered from it (or failed).
        let went = resp.as_ref().map_or(true, cache::went_upstream);
        if let (true, Some(f)) = (went, fetch.get()) {
            if resp.is_ok() {
                ctx.upstream_ns = Some(f.took_ns.load(Ordering::Relaxed));
            }
            if let Some(n) = ctx.note_target {
                n.take_from(&f.answered);
            }
        }
        resp
    }

    /// Phase 4: a refusal, from whichever phase, noted and made into its answer.
    fn fail_to_proxy(&self, ctx: &mut Ctx<'_>, r: Refusal) -> Response<Body> {
        ctx.refusal = Some(r.reason_index());
        if let Refusal::RateLimited { limit, .. } = &r {
            ctx.limit = Some(limit.clone());
        }
        refuse(r, &ctx.request_id)
    }
}

/// Forwards a request to the route's upstream, noting how long the upstream took. Boxed: a
/// request's future is moved into place whole (into hyper's connection, or its HTTP/2
/// stream), and a refused request should not pay to move the largest branch it never takes.
fn forward_timed<'a, 's: 'a>(
    ctx: &'a mut Ctx<'s>,
    route: &'s Route,
    parts: Parts,
    body: RequestBody,
    hop: Hop<'a>,
) -> Pin<Box<dyn Future<Output = Result<Response<PooledBody>, Refusal>> + Send + 'a>> {
    Box::pin(async move {
        let share = share_for(ctx.conn, parts.version, &route.upstream).await?;
        let t = Instant::now();
        let resp = upstream::forward(&route.upstream, parts, body, hop).await;
        ctx.upstream_took(route, t, &resp);
        resp.map(|r| r.map(|b| b.holding(share)))
    })
}

impl crate::listener::Handler for Gateway {
    type Body = Logged<Body>;

    fn serve(
        &self,
        req: Parts,
        body: RequestBody,
        conn: &Arc<ConnInfo>,
    ) -> impl Future<Output = Response<Logged<Body>>> + Send {
        Gateway::serve(self, req, body, conn)
    }

    fn tls_for(&self, address: std::net::SocketAddr) -> Option<Arc<rustls::ServerConfig>> {
        Gateway::tls_for(self, address)
    }

    fn refused_unread(
        &self,
        refused: crate::listener::h1::head::Refused,
        asked_head: bool,
        request_line: &[u8],
        conn: &Arc<ConnInfo>,
    ) -> Option<HeaderValue> {
        Some(self.note_unread(refused, asked_head, request_line, conn))
    }

    fn opened(&self) {
        self.metrics.connections_total.inc();
        self.metrics.connections_open.inc();
    }

    fn closed(&self) {
        self.metrics.connections_open.dec();
    }

    fn tls_failed(&self) {
        self.metrics.tls_failures.inc();
    }
}

/// Whether an unsafe request's answer says it was carried out (2xx, 3xx): then what the
/// cache holds for its URI is out of date.
fn written<B>(resp: &Response<B>) -> bool {
    resp.status().is_success() || resp.status().is_redirection()
}
