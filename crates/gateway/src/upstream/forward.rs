//! The way a request goes upstream: the lean HTTP/1.1 client for an idempotent request
//! without a body (the hot path, inline), hyper's HTTP/1.1 client for one with a body, and
//! the alternative client for `https://` and `h2` upstreams (both boxed, so that every
//! request's future stays the size the lean path needs).

use super::h1;
use super::headers;
use super::pool::PooledBody;
use super::target::{for_hop, log_failure, unasked_switch, Hop, Tries, Upstream};
use super::{via_alt, with_body};
use crate::exchange::Refusal;
use crate::listener::RequestBody;
use http::header;
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{Method, Response};
use hyper::body::Body as _;

/// Sends a request without a body (GET or HEAD, for the cache) on the lean client.
pub async fn fetch(
    up: &Upstream,
    parts: Parts,
    hop: Hop<'_>,
) -> Result<Response<PooledBody>, Refusal> {
    let (method, pq, headers) = for_hop(parts, &hop);
    if let Some(alt) = &up.alt {
        return Box::pin(via_alt::forward(up, alt, method, pq, headers, None, &hop)).await;
    }
    forward_lean(up, &method, &pq, headers, &hop).await
}

/// Sends the request to `up` and returns its response head with the body streaming.
pub async fn forward(
    up: &Upstream,
    parts: Parts,
    body: RequestBody,
    hop: Hop<'_>,
) -> Result<Response<PooledBody>, Refusal> {
    let (method, pq, headers) = for_hop(parts, &hop);
    // The lean path inline; the others boxed, so that every request's future (moved into
    // hyper's connection at each request) stays the size the lean path needs.
    if let Some(alt) = &up.alt {
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
            method,
            Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS
        )
    {
        return forward_lean(up, &method, &pq, headers, &hop).await;
    }
    Box::pin(with_body::forward_hyper(up, method, pq, headers, body, hop)).await
}

/// The hot path: an idempotent request without a body, on the lean client. Its head is
/// encoded once per target and can be sent again as it is, so a connection found closed
/// (before or during the exchange) costs a replay, never an error.
async fn forward_lean(
    up: &Upstream,
    method: &Method,
    pq: &PathAndQuery,
    mut headers: http::HeaderMap,
    hop: &Hop<'_>,
) -> Result<Response<PooledBody>, Refusal> {
    let mut last = Refusal::Upstream("no target");
    let mut last_target = None;
    let mut head = Vec::with_capacity(512);
    let mut encoded_for: Option<usize> = None;
    let mut fresh_failures = 0;
    let mut tries = Tries::new(up);
    while tries.next() {
        if tries.retried() {
            up.stats.retries.inc();
        }
        let (key, target) = match up.pick(last_target.is_some()) {
            Ok(t) => t,
            Err(none) => {
                last = none.unwrap_or(last);
                break;
            }
        };
        last_target = Some(target);
        if encoded_for != Some(key) {
            if !hop.preserve_host {
                headers.insert(header::HOST, target.host.clone());
            }
            h1::encode_head(method, pq.as_str(), &headers, &mut head);
            encoded_for = Some(key);
        }
        let (conn, reused) = match target.raw_conn(up).await {
            Ok(c) => c,
            Err(e) => {
                last = tries.no_conn(up, hop.route, target, e)?;
                continue;
            }
        };
        if !reused {
            tries.spend_new();
        }
        match tokio::time::timeout(up.cfg.response_timeout, conn.exchange(&head, method)).await {
            Err(_) => {
                up.outcome(target, false);
                log_failure(up, hop.route, target, &Refusal::UpstreamTimeout);
                return Err(Refusal::UpstreamTimeout);
            }
            Ok(Ok((h, body))) => {
                up.outcome(target, !h.status.is_server_error());
                let body = body.with_pool(target.raw.clone());
                let mut resp = Response::new(PooledBody::raw(body, up.cfg.read_timeout));
                *resp.status_mut() = h.status;
                *resp.headers_mut() = h.headers;
                headers::rewrite_response(resp.headers_mut());
                if let Some(n) = hop.note_target {
                    let _ = n.set(target.name.clone());
                }
                return Ok(resp);
            }
            Ok(Err(h1::H1Error::Closed(e))) => {
                tracing::debug!(upstream = %up.cfg.name, reused, error = %e, "connection closed under the request");
                last = Refusal::Upstream("connection reset or closed");
                // A kept-alive connection closed by the backend while idle is replayed; a
                // new connection that fails moves on to another target, never the same one.
                if !reused {
                    up.outcome(target, false);
                    fresh_failures += 1;
                    if fresh_failures >= up.targets.len() {
                        break;
                    }
                }
            }
            Ok(Err(h1::H1Error::Malformed)) => {
                up.outcome(target, false);
                let refusal = Refusal::Upstream("malformed or truncated response");
                log_failure(up, hop.route, target, &refusal);
                return Err(refusal);
            }
            Ok(Err(h1::H1Error::Switched)) => return Err(unasked_switch(up, hop.route, target)),
        }
    }
    if let Some(t) = last_target {
        log_failure(up, hop.route, t, &last);
    }
    Err(last)
}
