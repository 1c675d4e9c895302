//! Forwarding on the alternative client (`https://` and `h2` upstreams): a request whose
//! body can be sent again moves on to the next target when a connection cannot be opened.

use super::alt::{connect_failure, AltClient, CONNECT_TIMED_OUT};
use super::body::{check_declared, receive, Received, UpBody};
use super::headers::{coded_answer, rewrite_response};
use super::hop::Hop;
use super::response_body::PooledBody;
use super::target::{
    coded, log_failure, log_failure_because, unasked_switch, Failed, IdIn, Upstream,
};

/// Forwards a request on the upstream's [`AltClient`]. A request whose body can be sent
/// again (none, or read whole) moves on to the next target when a connection cannot be
/// opened; the client itself replays requests a pooled connection closed under.
pub(super) async fn forward(
    up: &Upstream,
    alt: &AltClient,
    method: http::Method,
    pq: http::uri::PathAndQuery,
    mut headers: http::HeaderMap,
    body: Option<crate::listener::RequestBody>,
    hop: &Hop<'_>,
) -> Result<http::Response<PooledBody>, crate::exchange::Refusal> {
    use crate::exchange::Refusal;
    use http::header;
    use hyper::body::Body as _;

    check_declared(&headers, hop.max_body)?;
    hop.put_traceparent(&mut headers);
    // A whole body stays counted as held (HTTP/2's `max_request_buffer`) until this
    // function is done with it.
    let (mut streaming, whole, _held) = match body {
        Some(b) if !b.is_end_stream() => {
            let note = hop.note_target;
            match receive(b, hop.max_body, hop.body_timeout, hop.stream_body).await? {
                Received::Whole(chunks, held, len) => {
                    if let Some(n) = note {
                        n.body_whole(len);
                    }
                    (None, Some(chunks), held)
                }
                Received::Streaming(b, w) => {
                    if let Some(n) = note {
                        n.body_streaming(&w);
                    }
                    (Some(b), None, Default::default())
                }
            }
        }
        _ => (None, Some(Vec::new()), Default::default()),
    };
    let h2 = alt.client_h2();
    if h2 {
        // gRPC servers want to know trailers are welcome; TE is hop-by-hop, so say it anew.
        let grpc = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/grpc"));
        if grpc {
            headers.insert(header::TE, http::HeaderValue::from_static("trailers"));
        }
    }
    let client_host = headers.get(header::HOST).cloned();
    let said = hop.at(IdIn::Map(&headers));
    let mut last = Refusal::Upstream("no target");
    // The last target that could not be connected to, and why, logged once every target
    // has been tried.
    let mut unreached = None;
    let mut failed = Failed::default();
    for attempt in 0..up.targets.len().max(1) {
        let (at, target) = match up.pick(said, attempt > 0, failed) {
            Ok(picked) => picked,
            Err(none) => {
                last = none.unwrap_or(last);
                break;
            }
        };
        if let Some(n) = hop.note_target {
            n.tried(&target.name);
        }
        let body = match (&whole, streaming.take()) {
            (Some(chunks), _) => UpBody::whole(chunks),
            (None, Some(b)) => b,
            (None, None) => break,
        };
        // HTTP/2 asks for the client's host in `:authority`; HTTP/1.1 in `Host`, kept in
        // `headers`. The connection goes to the target either way (the client is pinned).
        // Past the hosts an upstream keeps connections apart for, the target's authority,
        // with the client's `Host` kept as a header.
        let mut host = None;
        let own = client_host
            .as_ref()
            .filter(|_| hop.preserve_host && h2)
            .and_then(|h| h.to_str().ok())
            .filter(|h| {
                host = alt.room_for(h);
                host.is_some()
            });
        let authority = own.unwrap_or(&target.name);
        let Some(uri) = alt.uri(authority, &pq) else {
            return Err(Refusal::BadRequest("invalid request target"));
        };
        let mut req = http::Request::new(body);
        *req.method_mut() = method.clone();
        *req.uri_mut() = uri;
        let mut h = headers.clone();
        // A client without a `Host` (HTTP/1.0) has none to keep: the target's then.
        let keep = hop.preserve_host && client_host.is_some();
        if h2 && (own.is_some() || !keep) {
            // HTTP/2 names the host in `:authority`.
            h.remove(header::HOST);
        } else if !keep {
            h.insert(header::HOST, target.host.clone());
        }
        *req.headers_mut() = h;
        match tokio::time::timeout(up.cfg.response_timeout, alt.send(at, req, host)).await {
            Err(_) => {
                up.outcome(target, false);
                log_failure(up, said, target, &Refusal::UpstreamTimeout);
                return Err(Refusal::UpstreamTimeout);
            }
            Ok(Ok((resp, _))) if resp.status() == http::StatusCode::SWITCHING_PROTOCOLS => {
                return Err(unasked_switch(up, said, target));
            }
            Ok(Ok((resp, _))) if resp.status().as_u16() >= 600 => {
                // No status a client could read (RFC 9110 §15: 100 to 599).
                up.outcome(target, false);
                let r = Refusal::Upstream("invalid status");
                log_failure(up, said, target, &r);
                return Err(r);
            }
            Ok(Ok((resp, _))) if coded_answer(&method, resp.status(), resp.headers()) => {
                up.outcome(target, !resp.status().is_server_error());
                return Err(coded(up, said, target));
            }
            Ok(Ok((mut resp, slot))) => {
                up.outcome(target, !resp.status().is_server_error());
                rewrite_response(resp.headers_mut());
                let read_timeout = up.cfg.read_timeout;
                return Ok(resp.map(|b| PooledBody::plain(b, read_timeout).on_lane(slot)));
            }
            Ok(Err(e)) => {
                up.outcome(target, false);
                tracing::debug!(upstream = %up.cfg.name, target = %target.name, error = ?e, "request failed");
                let mut cause = None;
                if e.is_connect() {
                    up.stats.connect_errors.inc();
                    let (detail, why) = connect_failure(&e);
                    // No connection within `connect_timeout` is a 504, as to a plain
                    // target (and as nginx answers it, in the TLS handshake too).
                    last = if detail == CONNECT_TIMED_OUT {
                        Refusal::UpstreamTimeout
                    } else {
                        Refusal::Upstream(detail)
                    };
                    if whole.is_some() {
                        up.stats.retries.inc();
                        if let Some(n) = hop.note_target {
                            n.retried();
                        }
                        unreached = Some((target, why));
                        failed.add(at);
                        continue;
                    }
                    cause = Some(why);
                } else {
                    last = Refusal::Upstream("connection reset or closed");
                }
                log_failure_because(up, said, target, &last, cause.as_deref());
                return Err(last);
            }
        }
    }
    if let Some((target, why)) = unreached {
        log_failure_because(up, said, target, &last, Some(&why));
    }
    Err(last)
}
