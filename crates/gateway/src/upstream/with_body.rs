//! Requests with a body (or a method that may carry one) on hyper's pooled HTTP/1.1
//! client: the body read whole up to 64 KiB (replayable) or streamed and watched for the
//! client's faults, and replayed only when that is safe (see the module above).

use super::body::UpBody;
use super::body::{self, BodyWatch, Received};
use super::headers;
use super::pool::PooledBody;
use super::target::{is_idempotent, log_failure, unasked_switch, Hop, Tries, Upstream};
use crate::exchange::Refusal;
use crate::listener::RequestBody;
use bytes::Bytes;
use http::header;
use http::uri::PathAndQuery;
use http::{Method, Request, Response, Uri, Version};
use hyper::body::Body as _;
use std::error::Error as StdError;
use std::future::Future;
use std::time::Duration;

enum Failure {
    /// The connection closed or reset around the write; only idempotent requests may be
    /// replayed.
    Stale,
    /// Anything else: the backend broke the exchange.
    Other,
}

fn classify(e: &hyper::Error) -> Failure {
    if e.is_incomplete_message() || e.is_canceled() {
        return Failure::Stale;
    }
    let mut src: Option<&(dyn StdError + 'static)> = e.source();
    while let Some(s) = src {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::*;
            // A backend that closes a kept-alive connection with our request unread resets it.
            if matches!(io.kind(), ConnectionReset | BrokenPipe | UnexpectedEof) {
                return Failure::Stale;
            }
        }
        src = s.source();
    }
    Failure::Other
}

/// Forwards a request with a body (or a method that may carry one) on hyper's client.
pub(super) async fn forward_hyper(
    up: &Upstream,
    method: Method,
    pq: PathAndQuery,
    mut headers: http::HeaderMap,
    body: RequestBody,
    hop: Hop<'_>,
) -> Result<Response<PooledBody>, Refusal> {
    body::check_declared(&headers, hop.max_body)?;
    // A body read whole can be sent again; a streaming one is watched for the client's faults.
    // A whole body stays counted as held (HTTP/2's `max_request_buffer`) until this
    // function is done with it (it is kept to be sent again).
    let (mut body, whole, watch, _held) = if body.is_end_stream() {
        // No body to stream: send none (and drop a stray `Content-Length: 0`).
        (
            Some(UpBody::empty()),
            Some(Vec::new()),
            None,
            Default::default(),
        )
    } else {
        match body::receive(body, hop.max_body, hop.body_timeout, hop.stream_body).await? {
            Received::Whole(chunks, held) => {
                (Some(UpBody::whole(&chunks)), Some(chunks), None, held)
            }
            Received::Streaming(b, w) => (Some(b), None, Some(w), Default::default()),
        }
    };

    let mut last = Refusal::Upstream("no target");
    let mut last_target = None;
    let mut req: Option<Request<UpBody>> = None;
    let mut tries = Tries::new(up);
    while tries.next() {
        if tries.retried() {
            up.stats.retries.inc();
        }
        let target = match up.pick(last_target.is_some()) {
            Ok((_, t)) => t,
            Err(none) => {
                last = none.unwrap_or(last);
                break;
            }
        };
        last_target = Some(target);
        let mut r = match req.take() {
            Some(r) => r,
            None => {
                let Some(b) = body.take() else { break };
                let mut r = Request::new(b);
                *r.method_mut() = method.clone();
                *r.uri_mut() = Uri::from(pq.clone());
                *r.version_mut() = Version::HTTP_11;
                *r.headers_mut() = std::mem::take(&mut headers);
                r
            }
        };
        if !hop.preserve_host {
            r.headers_mut().insert(header::HOST, target.host.clone());
        }

        let (mut tx, reused) = match target.hyper_conn(up).await {
            Ok(c) => c,
            Err(e) => {
                last = tries.no_conn(up, hop.route, target, e)?;
                // Nothing was sent: the request can go to the next target.
                req = Some(r);
                continue;
            }
        };
        if !reused {
            tries.spend_new();
        }
        match tokio::time::timeout(up.cfg.connect_timeout, tx.ready()).await {
            Ok(Ok(())) => {}
            // Closed while idle, or never became ready: nothing was sent.
            _ => {
                req = Some(r);
                continue;
            }
        }
        // Kept for a replay: only idempotent requests whose body was read whole, and only
        // when a kept-alive connection closes under them (the backend closed it while idle).
        let replay = match (&whole, reused && is_idempotent(&method)) {
            (Some(chunks), true) => Some(clone_head(&r, chunks)),
            _ => None,
        };
        let sent = await_head(
            tx.try_send_request(r),
            watch.as_deref(),
            up.cfg.response_timeout,
            hop.body_timeout,
        )
        .await;
        let mut err = match sent {
            Err(refusal) => {
                if matches!(refusal, Refusal::UpstreamTimeout) {
                    up.outcome(target, false);
                }
                log_failure(up, hop.route, target, &refusal);
                return Err(refusal);
            }
            Ok(Ok(resp)) if resp.status() == http::StatusCode::SWITCHING_PROTOCOLS => {
                // Its connection is not reused: it was handed over to another protocol.
                return Err(unasked_switch(up, hop.route, target));
            }
            Ok(Ok(mut resp)) => {
                up.outcome(target, !resp.status().is_server_error());
                let stale_length = headers::rewrite_response(resp.headers_mut());
                let pool = (!stale_length).then(|| target.pool.clone());
                let read_timeout = up.cfg.read_timeout;
                if let Some(n) = hop.note_target {
                    let _ = n.set(target.name.clone());
                }
                return Ok(resp.map(|b| PooledBody::new(b, tx, pool, read_timeout)));
            }
            Ok(Err(e)) => e,
        };
        if let Some(fault) = watch.as_ref().and_then(|w| w.fault()) {
            return Err(fault.refusal());
        }
        if let Some(unsent) = err.take_message() {
            // The connection failed before the request was written: safe to send again.
            req = Some(unsent);
            continue;
        }
        let err = err.into_error();
        match classify(&err) {
            Failure::Stale if replay.is_some() => {
                tracing::debug!(upstream = %up.cfg.name, error = %err, "connection closed under the request; replaying");
                last = Refusal::Upstream("connection closed");
                req = replay;
            }
            Failure::Stale | Failure::Other => {
                up.outcome(target, false);
                let refusal = Refusal::Upstream("connection reset or closed");
                log_failure(up, hop.route, target, &refusal);
                tracing::debug!(upstream = %up.cfg.name, error = %err, "upstream failed");
                return Err(refusal);
            }
        }
    }
    if let Some(t) = last_target {
        log_failure(up, hop.route, t, &last);
    }
    Err(last)
}

/// Waits for the response head. While the body streams, a stall of `body_timeout` ends
/// the wait (408 when the client stopped sending, 504 when the upstream stopped reading);
/// once it has ended, the upstream has `response_timeout` to answer.
async fn await_head<F: Future>(
    fut: F,
    watch: Option<&BodyWatch>,
    response_timeout: Duration,
    body_timeout: Duration,
) -> Result<F::Output, Refusal> {
    tokio::pin!(fut);
    if let Some(w) = watch {
        loop {
            let stall_at = w.last_moved() + body_timeout;
            tokio::select! {
                out = &mut fut => return Ok(out),
                _ = w.finished() => break,
                _ = tokio::time::sleep_until(stall_at) => {
                    if w.last_moved() + body_timeout <= tokio::time::Instant::now() {
                        return Err(if w.waiting_on_client() {
                            Refusal::RequestTimeout
                        } else {
                            Refusal::UpstreamTimeout
                        });
                    }
                }
            }
        }
    }
    tokio::time::timeout(response_timeout, fut)
        .await
        .map_err(|_| Refusal::UpstreamTimeout)
}

/// A copy of a request whose body was read whole, for a replay.
fn clone_head(r: &Request<UpBody>, chunks: &[Bytes]) -> Request<UpBody> {
    let mut c = Request::new(UpBody::whole(chunks));
    *c.method_mut() = r.method().clone();
    *c.uri_mut() = r.uri().clone();
    *c.version_mut() = r.version();
    *c.headers_mut() = r.headers().clone();
    c
}
