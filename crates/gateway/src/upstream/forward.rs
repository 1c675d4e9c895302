//! The way a request goes upstream: every HTTP/1.1 request on the lean client, over one
//! pool of connections per target, through one retry driver ([`send`]); `https://` and
//! `h2` upstreams on the alternative client. An idempotent request without a body is the
//! hot path, inline; a body's reading and sending are boxed, so that every request's
//! future stays the size the hot path needs.
//!
//! Retries: a request whose head was not written whole goes to the next connection or
//! target, whatever its method. When a backend's close of a kept-alive connection races
//! the request, an idempotent request without a body or with one read whole is sent again
//! on another connection. A new connection that fails is not retried on the same target.
//! A non-idempotent request, and a streaming body, are never sent twice.

use super::body::{self, BodyWatch, Received, UpBody};
use super::h1::{self, H1Error};
use super::h1_request::{frame_request, Framing, Outgoing, SendError};
use super::headers;
use super::hop::{for_hop, is_idempotent, Hop, HopRequest};
use super::response_body::PooledBody;
use super::target::{coded, log_failure, unasked_switch, Failed, IdIn, Tries, Upstream};
use super::via_alt;
use crate::exchange::{Parts, Refusal};
use crate::listener::RequestBody;
use bytes::Bytes;
use http::{Method, Response};
use hyper::body::Body as _;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// Sends a request without a body (GET or HEAD, for the cache) on the lean client.
pub async fn fetch(
    up: &Upstream,
    parts: Parts,
    hop: Hop<'_>,
) -> Result<Response<PooledBody>, Refusal> {
    let req = for_hop(parts, &hop);
    if let Some(alt) = &up.alt {
        let (method, pq, headers) = req.into_map(&hop);
        return Box::pin(via_alt::forward(up, alt, method, pq, headers, None, &hop)).await;
    }
    send(up, req, &hop, Load::Empty).await
}

/// Sends the request to `up` and returns its response head with the body streaming.
pub async fn forward(
    up: &Upstream,
    parts: Parts,
    body: RequestBody,
    hop: Hop<'_>,
) -> Result<Response<PooledBody>, Refusal> {
    let req = for_hop(parts, &hop);
    // The lean path inline; the others boxed, so that every request's future (moved into
    // hyper's connection at each request) stays the size the lean path needs.
    if let Some(alt) = &up.alt {
        let (method, pq, headers) = req.into_map(&hop);
        return Box::pin(via_alt::forward(
            up,
            alt,
            method,
            pq,
            headers,
            Some(body),
            &hop,
        ))
        .await;
    }
    if body.is_end_stream()
        && matches!(
            req.method,
            Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS
        )
    {
        return send(up, req, &hop, Load::Empty).await;
    }
    Box::pin(forward_body(up, req, body, hop)).await
}

/// What goes up with a request's head.
enum Load {
    /// No body.
    Empty,
    /// A body read whole: it can be sent again. The guard keeps it counted as held (HTTP/2's
    /// `max_request_buffer`) until the request is done with it.
    Whole {
        chunks: Vec<Bytes>,
        _held: crate::listener::body::Held,
    },
    /// A body streaming from the client, watched for its faults; sent once (taken when its
    /// head has gone). Boxed: the hot path's future carries a `Load` too.
    Streaming(Box<(Option<UpBody>, Arc<BodyWatch>)>),
}

/// A request that has (or may have) a body: read up to [`body::BUFFER`] first (or
/// streamed at once), then sent on the lean client.
async fn forward_body(
    up: &Upstream,
    req: HopRequest,
    incoming: RequestBody,
    hop: Hop<'_>,
) -> Result<Response<PooledBody>, Refusal> {
    body::check_declared(&req.headers, hop.max_body)?;
    let load = if incoming.is_end_stream() {
        Load::Empty
    } else {
        let note = hop.note_target;
        match body::receive(incoming, hop.max_body, hop.body_timeout, hop.stream_body).await? {
            Received::Whole(chunks, held, len) => {
                if let Some(n) = note {
                    n.body_whole(len);
                }
                Load::Whole {
                    chunks,
                    _held: held,
                }
            }
            Received::Streaming(b, w) => {
                if let Some(n) = note {
                    n.body_streaming(&w);
                }
                Load::Streaming(Box::new((Some(b), w)))
            }
        }
    };
    send(up, req, &hop, load).await
}

/// The retry driver: tries the request on the upstream's targets, round-robin, on
/// connections from their pools, until one answers or the budget ([`Tries`]) is spent.
/// The head is encoded once per target and can be sent again as it is.
async fn send(
    up: &Upstream,
    req: HopRequest,
    hop: &Hop<'_>,
    mut load: Load,
) -> Result<Response<PooledBody>, Refusal> {
    let HopRequest {
        method,
        pq,
        mut headers,
        forwarding,
    } = req;
    let method = &method;
    let framing = match &mut load {
        // As it came: nothing to frame.
        Load::Empty => Framing::Length,
        Load::Whole { chunks, .. } => frame_request(&mut headers, &Outgoing::Whole(chunks)),
        Load::Streaming(_) => frame_request(&mut headers, &Outgoing::Streaming),
    };
    // Sent again after a close that raced it: only what is idempotent and whole.
    let replayable = is_idempotent(method) && !matches!(load, Load::Streaming(..));
    let said = hop.at(IdIn::Fields(&headers));
    let mut last = Refusal::Upstream("no target");
    let mut last_target = None;
    let mut head = Vec::with_capacity(512);
    let mut encoded_for: Option<usize> = None;
    let mut fresh_failures = 0;
    let mut failed = Failed::default();
    let mut tries = Tries::new(up);
    while tries.next() {
        if tries.retried() {
            up.stats.retries.inc();
            if let Some(n) = hop.note_target {
                n.retried();
            }
        }
        let (key, target) = match up.pick(said, last_target.is_some(), failed) {
            Ok(t) => t,
            Err(none) => {
                last = none.unwrap_or(last);
                break;
            }
        };
        last_target = Some(target);
        if let Some(n) = hop.note_target {
            n.tried(&target.name);
        }
        if encoded_for != Some(key) {
            let added = h1::Added {
                // A client without a `Host` (HTTP/1.0) has none to keep: the target's.
                host: (!hop.preserve_host || !headers.contains_key(http::header::HOST))
                    .then_some(&target.host),
                set: &forwarding,
                traceparent: hop.traceparent.as_ref(),
            };
            h1::encode_head(method, pq.as_str(), &headers, &added, &mut head);
            encoded_for = Some(key);
        }
        let (conn, reused) = match target.conn(up).await {
            Ok(c) => c,
            Err(e) => {
                last = tries.no_conn(up, said, target, e)?;
                failed.add(key);
                continue;
            }
        };
        if !reused {
            tries.spend_new();
        }
        let wait = up.cfg.response_timeout;
        let answered = match &mut load {
            Load::Empty => Ok(conn.exchange_whole(&head, head.len(), method, wait).await),
            Load::Whole { chunks, .. } => {
                // Head and body in one write.
                let len: usize = chunks.iter().map(Bytes::len).sum();
                let mut all = Vec::with_capacity(head.len() + len);
                all.extend_from_slice(&head);
                for c in chunks.iter() {
                    all.extend_from_slice(c);
                }
                let sent = conn.exchange_whole(&all, head.len(), method, wait);
                Ok(Box::pin(sent).await)
            }
            Load::Streaming(s) => {
                let (b, watch) = &mut **s;
                let sent = conn.exchange(&head, method, b, framing);
                Box::pin(await_head(sent, watch.as_ref(), wait, hop.body_timeout)).await
            }
        };
        let failure = match answered {
            Err(refusal) => {
                if matches!(refusal, Refusal::UpstreamTimeout) {
                    up.outcome(target, false);
                }
                log_failure(up, said, target, &refusal);
                return Err(refusal);
            }
            Ok(Ok((h, body))) => {
                up.outcome(target, !h.status.is_server_error());
                let body = body.with_pool(target.pool.clone());
                let mut resp = Response::new(PooledBody::raw(body, up.cfg.read_timeout));
                *resp.status_mut() = h.status;
                *resp.headers_mut() = h.headers;
                if !h.plain {
                    headers::rewrite_response(resp.headers_mut());
                }
                return Ok(resp);
            }
            Ok(Err(e)) => e,
        };
        if let Load::Streaming(s) = &load {
            if let Some(fault) = s.1.fault() {
                return Err(fault.refusal());
            }
        }
        let (unsent, e) = match failure {
            SendError::Body(fault) => return Err(fault.0.refusal()),
            SendError::Unsent(e) => (true, e),
            SendError::H1(H1Error::Closed(e)) => (false, e),
            SendError::H1(H1Error::Malformed) => {
                up.outcome(target, false);
                let refusal = Refusal::Upstream("malformed or truncated response");
                log_failure(up, said, target, &refusal);
                return Err(refusal);
            }
            SendError::H1(H1Error::Switched) => return Err(unasked_switch(up, said, target)),
            SendError::H1(H1Error::Coded) => return Err(coded(up, said, target)),
            SendError::TimedOut => {
                up.outcome(target, false);
                let refusal = Refusal::UpstreamTimeout;
                log_failure(up, said, target, &refusal);
                return Err(refusal);
            }
        };
        tracing::debug!(upstream = %up.cfg.name, reused, unsent, error = %e, "connection closed under the request");
        last = Refusal::Upstream("connection reset or closed");
        if !unsent && !replayable {
            up.outcome(target, false);
            log_failure(up, said, target, &last);
            return Err(last);
        }
        // A kept-alive connection closed by the backend while idle is replayed; a new
        // connection that fails moves on to another target, never the same one.
        if !reused {
            up.outcome(target, false);
            failed.add(key);
            fresh_failures += 1;
            if fresh_failures >= up.targets.len() {
                break;
            }
        }
    }
    if let Some(t) = last_target {
        log_failure(up, said, t, &last);
    }
    Err(last)
}

/// The exchange within the upstream's `response_timeout`.
async fn timed<T>(wait: Duration, exchange: impl Future<Output = T>) -> Result<T, Refusal> {
    tokio::time::timeout(wait, exchange)
        .await
        .map_err(|_| Refusal::UpstreamTimeout)
}

/// Waits for the response head of a streaming body. While the body streams, a stall of
/// `body_timeout` ends the wait (408 when the client stopped sending, 504 when the upstream
/// stopped reading); once it has ended, the upstream has `response_timeout` to answer.
async fn await_head<F: Future>(
    fut: F,
    watch: &BodyWatch,
    response_timeout: Duration,
    body_timeout: Duration,
) -> Result<F::Output, Refusal> {
    tokio::pin!(fut);
    loop {
        let stall_at = watch.last_moved() + body_timeout;
        tokio::select! {
            out = &mut fut => return Ok(out),
            _ = watch.finished() => break,
            _ = tokio::time::sleep_until(stall_at) => {
                if watch.last_moved() + body_timeout <= tokio::time::Instant::now() {
                    return Err(if watch.waiting_on_client() {
                        Refusal::RequestTimeout
                    } else {
                        Refusal::UpstreamTimeout
                    });
                }
            }
        }
    }
    timed(response_timeout, fut).await
}
