//! Phase 6 of the request path: the answer counted in the metrics and the usage history,
//! and its access log record made. A request whose answer never started is counted and
//! logged too: the client went away (an HTTP/1.1 connection closed, an HTTP/2 stream reset)
//! or the server cut it at the end of a drain, while the request waited for a lease, the
//! upstream or the cache. As nginx does, it is logged with status 499 (client closed
//! request), under its route and consumer, for the time it ran: an operator sees the
//! clients that gave up on a slow upstream.

use super::ctx::Ctx;
use super::logged_head::Head;
use super::state::Gateway;
use crate::cache;
use crate::exchange::REASONS;
use crate::observe::access_log::AccessLog;
use crate::observe::logged::Pending;
use crate::observe::record::Record;
use crate::observe::trace::Spans;
use crate::snapshot::Snapshot;
use crate::upstream::AnsweredBy;
use http::{HeaderValue, Method};
use smallvec::SmallVec;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// The `consumer` label of callers by token that no list names (no name has a space).
const UNLISTED: &str = "unlisted callers";

/// nginx's status for a request whose client closed the connection before its answer.
const CLIENT_CLOSED: u16 = 499;

/// A request on its way to its answer, with what it is counted and logged with: dropped
/// before [`Unanswered::answered`] (its future dropped: the client gone, the connection
/// cut), it counts and logs the request as a 499 (a 500 if its handling panicked).
pub(super) struct Unanswered<'g, 's> {
    gw: &'g Gateway,
    snap: &'s Arc<Snapshot>,
    answered: &'s AnsweredBy,
    /// The request's context, for the phases.
    pub(super) ctx: Ctx<'s>,
    method: Method,
    /// What the access log and the span keep of the request head, when either is on.
    pub(super) head: Option<Head>,
    /// When the request arrived, for the usage history.
    pub(super) wall_ns: Option<u64>,
    /// The access log, when on.
    pub(super) log: Option<Arc<AccessLog>>,
    /// The span exporter, when the request is sampled.
    pub(super) spans: Option<Arc<Spans>>,
    /// Counted and logged already.
    done: bool,
}

impl<'g, 's> Unanswered<'g, 's> {
    /// The request of `ctx` and `method`, served on `snap` (the snapshot `ctx` borrows), its
    /// target noted in `answered`. Built where it stays: it is part of the request's future.
    #[inline]
    pub(super) fn new(
        gw: &'g Gateway,
        snap: &'s Arc<Snapshot>,
        answered: &'s AnsweredBy,
        ctx: Ctx<'s>,
        method: Method,
    ) -> Self {
        Unanswered {
            gw,
            snap,
            answered,
            ctx,
            method,
            head: None,
            wall_ns: None,
            log: None,
            spans: None,
            done: false,
        }
    }

    /// Phase 6 for the answer with `status` (and the cache's `Cache-Status`): counts it in
    /// the metrics and the usage history (under the second the request arrived), now; and,
    /// when there is an access log or a span, makes what queues its record once the body
    /// has been sent, given the request's snapshot and the target that answered.
    // The record is finished by a closure that owns what it took from the guard, so that
    // the snapshot the context borrows can then move into it: its type says just that.
    pub(super) fn answered(
        &mut self,
        status: u16,
        cache_status: Option<&HeaderValue>,
    ) -> Option<impl FnOnce(Arc<Snapshot>, &AnsweredBy) -> Pending + use<>> {
        self.done = true;
        let gw = self.gw;
        let method = std::mem::take(&mut self.method);
        let ctx = &mut self.ctx;
        let snap = ctx.snap;
        gw.metrics.response(status);
        let stats = ctx.route.map_or(gw.metrics.unrouted(), |r| &r.stats);
        stats.record(&method, status, ctx.start.elapsed().as_secs_f64());
        if let Some(reason) = ctx.refusal {
            gw.metrics.refusal(reason);
        }
        let consumer_index = ctx.admitted.consumer;
        let consumer = consumer_index.map(|c| snap.consumer_name(c));
        if snap.config.metrics.per_consumer {
            if let (Some(i), Some(c)) = (consumer_index, consumer) {
                // Callers by token that no list names (on `anonymous_plan` or a plan
                // claim) share one series: their names come from tokens, not from the
                // config, and each reload starts a new table of them.
                let listed = i < snap.config.consumers.len() || snap.roster.get(c).is_some();
                gw.metrics
                    .consumer(if listed { c } else { UNLISTED }, status);
            }
        }
        if let (Some(a), Some(wall)) = (&gw.analytics, self.wall_ns) {
            a.count(
                wall / 1_000_000_000,
                consumer_index
                    .zip(consumer)
                    .map(|(i, name)| (snap.consumer_identity(i), name)),
                ctx.route.map_or(&snap.anonymous, |r| &r.name),
                status,
            );
        }
        let mut head = self.head.take()?;
        if let (Some(span), Some(route)) = (head.span.as_mut(), ctx.route) {
            span.route_path = Some(route.template.clone());
        }
        let cache = ctx
            .route
            .filter(|r| r.cfg.cache.is_some())
            .and(cache_status)
            // The gateway's member alone, in bytes of its own: an upstream's value is a
            // slice of that answer's whole head, and a record may wait in the log's queue.
            .and_then(|v| HeaderValue::from_bytes(cache::own_status(v)).ok());
        let route = ctx.route.map(|r| r.name.clone());
        let (start, upstream_ns, refusal) = (ctx.start, ctx.upstream_ns, ctx.refusal);
        let request_id = SmallVec::from_slice(ctx.request_id.as_bytes());
        let (limit, trace) = (ctx.limit.take(), ctx.trace.take());
        let client = head
            .client
            .take()
            .unwrap_or_else(|| ctx.conn.peer_ip.clone());
        let (log, spans) = (self.log.take(), self.spans.take());
        Some(move |snap: Arc<Snapshot>, answered: &AnsweredBy| {
            let target = answered.target.lock().take();
            Pending {
                rec: Box::new(Record {
                    start,
                    request_id,
                    client,
                    method,
                    uri: head.uri,
                    snap,
                    route,
                    consumer: consumer_index,
                    status,
                    // Declared, else counted as read (a chunked body).
                    bytes_in: head.bytes_in.or_else(|| answered.body_read()),
                    bytes_out: 0,
                    duration: Duration::ZERO,
                    // Only where a target was tried: a request refused or timed out before
                    // one was picked (a body that never came, no healthy target) spent no
                    // time upstream.
                    upstream_ns: upstream_ns.filter(|_| target.is_some()),
                    target,
                    refusal: refusal.and_then(|i| REASONS.get(i).copied()),
                    limit,
                    cache,
                    trace,
                    span_head: head.span,
                    retries: answered.retries.load(Ordering::Relaxed),
                }),
                log,
                spans,
            }
        })
    }
}

impl Drop for Unanswered<'_, '_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // A request whose handling panicked is the gateway's failure, not the client's.
        let status = if std::thread::panicking() {
            500
        } else {
            CLIENT_CLOSED
        };
        tracing::debug!(
            request_id = ?self.ctx.request_id,
            status,
            "the request ended before its answer: the client left or the connection was cut"
        );
        if let Some(pending) = self.answered(status, None) {
            pending(self.snap.clone(), self.answered).finish();
        }
    }
}
