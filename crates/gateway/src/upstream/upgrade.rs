//! Upgraded connections (WebSocket and the like): the request goes to a target on a
//! connection of its own; when the target answers 101, the client's connection and the
//! target's are joined both ways until either side closes or neither sends for the
//! upstream's `read_timeout`.

use super::body::UpBody;
use super::headers;
use super::hop::{for_hop, Hop};
use super::response_body::PooledBody;
use super::target::{log_failure, Failed, Upstream};
use crate::exchange::{Parts, Refusal};
use crate::listener::h1::OnUpgrade;
use crate::observe::metrics::Metrics;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// What an upgrade needs beyond the request: the protocol asked for, the client side's
/// connection once the listener hands it over, and the metrics that count joined connections.
pub struct UpgradeAsk {
    /// The client's `Upgrade` value (`websocket`).
    pub protocol: HeaderValue,
    /// The client's connection, after the 101 has been sent.
    pub client: OnUpgrade,
    /// Where joined connections are counted.
    pub metrics: Arc<Metrics>,
    /// Kept while the connections are joined: it holds the client connection's place under
    /// the listener's `max_connections`.
    pub hold: Arc<crate::exchange::ConnInfo>,
}

/// Sends an upgrade request to a target. A 101 answer is passed to the client and the two
/// connections are joined; any other answer is passed on as an ordinary response.
pub async fn upgrade(
    up: &Upstream,
    parts: Parts,
    ask: UpgradeAsk,
    hop: Hop<'_>,
) -> Result<Response<PooledBody>, Refusal> {
    let (method, pq, mut h) = for_hop(parts, &hop).into_map(&hop);
    let id = h.get("x-request-id").cloned();
    let said = hop.at(super::target::IdIn::Value(id.as_ref()));
    let client = up
        .upgrade_client()
        .ok_or(Refusal::Upstream("no client for upgrades"))?;
    let (at, target) = up
        .pick(said, false, Failed::default())
        .map_err(|none| none.unwrap_or(Refusal::NoHealthyTarget))?;
    let uri = client
        .uri(&target.name, &pq)
        .ok_or(Refusal::BadRequest("invalid request target"))?;
    // A client without a `Host` (HTTP/1.0) has none to keep: the target's then.
    if !hop.preserve_host || !h.contains_key(header::HOST) {
        h.insert(header::HOST, target.host.clone());
    }
    hop.put_traceparent(&mut h);
    // The request goes without a body (the listener takes no upgrade asked with one), so
    // without a length: a `Content-Length` with no body behind it would make the target read
    // the start of the next request on this connection (a check, another upgrade) as this
    // one's body.
    h.remove(header::CONTENT_LENGTH);
    h.remove(header::TRANSFER_ENCODING);
    h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    h.insert(header::UPGRADE, ask.protocol.clone());
    let mut req = Request::new(UpBody::empty());
    let method_asked = method.clone();
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.headers_mut() = h;
    if let Some(n) = hop.note_target {
        n.tried(&target.name);
    }
    let mut resp =
        match tokio::time::timeout(up.cfg.response_timeout, client.send(at, req, None)).await {
            Err(_) => {
                up.outcome(target, false);
                log_failure(up, said, target, &Refusal::UpstreamTimeout);
                return Err(Refusal::UpstreamTimeout);
            }
            Ok(Err(e)) => {
                up.outcome(target, false);
                if e.is_connect() {
                    up.stats.connect_errors.inc();
                }
                let refusal = Refusal::Upstream("upgrade request failed");
                log_failure(up, said, target, &refusal);
                tracing::debug!(upstream = %up.cfg.name, error = %e, "upgrade failed");
                return Err(refusal);
            }
            // HTTP/1.1: the lane's count is not used.
            Ok(Ok((r, _))) => r,
        };
    up.outcome(target, !resp.status().is_server_error());
    let read_timeout = up.cfg.read_timeout;
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        // Declined: an ordinary answer, under the same rule as on every other client.
        if headers::coded_answer(&method_asked, resp.status(), resp.headers()) {
            return Err(super::target::coded(up, said, target));
        }
        headers::rewrite_response(resp.headers_mut());
        return Ok(resp.map(|b| PooledBody::plain(b, read_timeout)));
    }
    // A 101 must name the protocol it switches to (RFC 9110 §15.2.2), and only the one asked
    // for is joined, as Envoy does: a backend path that can be made to answer a bare 101
    // would otherwise open a raw tunnel to the backend past every route's policies.
    let protocol = match resp.headers().get(header::UPGRADE) {
        Some(p) if same_protocol(p, &ask.protocol) => p.clone(),
        _ => {
            let refusal = Refusal::Upstream("upstream switched to a protocol not asked for");
            log_failure(up, said, target, &refusal);
            return Err(refusal);
        }
    };
    let theirs = hyper::upgrade::on(&mut resp);
    headers::rewrite_response(resp.headers_mut());
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    resp.headers_mut().insert(header::UPGRADE, protocol);
    let metrics = ask.metrics;
    let ours = ask.client;
    let hold = ask.hold;
    tokio::spawn(async move {
        let (c, u) = match tokio::join!(ours, theirs) {
            (Ok(c), Ok(u)) => (c, u),
            (c, u) => {
                let c = c.err().map(|e| e.to_string());
                let u = u.err().map(|e| e.to_string());
                tracing::debug!(client = ?c, upstream = ?u, "upgrade not completed");
                return;
            }
        };
        metrics.upgrades.inc();
        metrics.upgrades_open.inc();
        join(c, TokioIo::new(u), read_timeout).await;
        metrics.upgrades_open.dec();
        drop(hold);
    });
    Ok(resp.map(|b| PooledBody::plain(b, read_timeout)))
}

/// Whether a 101's `Upgrade` names the protocol asked for: the first tokens agree, in any
/// case.
fn same_protocol(answered: &HeaderValue, asked: &HeaderValue) -> bool {
    let first = |v: &HeaderValue| {
        v.to_str()
            .ok()
            .and_then(|s| s.split(',').next())
            .map(|s| s.trim().to_ascii_lowercase())
    };
    matches!((first(answered), first(asked)), (Some(a), Some(b)) if a == b && !a.is_empty())
}

/// Copies both ways until both sides have closed (a side's end of input is passed on as a
/// half-close), either fails, or nothing moves either way for `idle`. The two directions
/// run at once: a side that is slow to read never holds up the other direction.
async fn join<A, B>(a: A, b: B, idle: Duration)
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let (ar, aw) = tokio::io::split(a);
    let (br, bw) = tokio::io::split(b);
    let start = tokio::time::Instant::now();
    // When bytes last moved either way, in ms since `start`.
    let moved = AtomicU64::new(0);
    let both = async {
        tokio::try_join!(
            one_way(ar, bw, start, &moved),
            one_way(br, aw, start, &moved)
        )
    };
    let quiet = async {
        loop {
            let last = start + Duration::from_millis(moved.load(Ordering::Relaxed));
            if last + idle <= tokio::time::Instant::now() {
                return;
            }
            tokio::time::sleep_until(last + idle).await;
        }
    };
    tokio::select! {
        _ = both => {}
        _ = quiet => {}
    }
}

/// Copies `from` into `to` until `from` ends or fails to read (then half-closes `to`),
/// noting in `moved` when bytes last went through. A failed write ends it, and the join.
async fn one_way<R, W>(
    mut from: R,
    mut to: W,
    start: tokio::time::Instant,
    moved: &AtomicU64,
) -> std::io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = from.read(&mut buf).await.unwrap_or(0);
        if n == 0 {
            let _ = to.shutdown().await;
            return Ok(());
        }
        to.write_all(&buf[..n]).await?;
        let ms = u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
        moved.store(ms, Ordering::Relaxed);
    }
}
