//! Upgraded connections (WebSocket and the like): the request goes to a target on a
//! connection of its own; when the target answers 101, the client's connection and the
//! target's are joined both ways until either side closes or neither sends for the
//! upstream's `read_timeout`.

use super::body::UpBody;
use super::{for_hop, headers, Hop, PooledBody, Upstream};
use crate::observe::metrics::Metrics;
use crate::response::Refusal;
use http::header::{self, HeaderValue};
use http::request::Parts;
use http::{Request, Response, StatusCode};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// What an upgrade needs beyond the request: the protocol asked for, the client side's
/// connection once hyper hands it over, and the metrics that count joined connections.
pub struct UpgradeAsk {
    /// The client's `Upgrade` value (`websocket`).
    pub protocol: HeaderValue,
    /// The client's connection, after the 101 has been sent.
    pub client: OnUpgrade,
    /// Where joined connections are counted.
    pub metrics: Arc<Metrics>,
    /// Kept while the connections are joined: it holds the client connection's place under
    /// the listener's `max_connections`.
    pub hold: Arc<crate::listener::ConnInfo>,
}

/// Sends an upgrade request to a target. A 101 answer is passed to the client and the two
/// connections are joined; any other answer is passed on as an ordinary response.
pub async fn upgrade(
    up: &Upstream,
    parts: Parts,
    ask: UpgradeAsk,
    hop: Hop<'_>,
) -> Result<Response<PooledBody>, Refusal> {
    let (method, pq, mut h) = for_hop(parts, &hop);
    let client = up
        .upgrade_client()
        .ok_or(Refusal::Upstream("no client for upgrades"))?;
    let (_, target) = up
        .pick(false)
        .map_err(|none| none.unwrap_or(Refusal::NoHealthyTarget))?;
    let uri = client
        .uri(&target.name, &pq)
        .ok_or(Refusal::BadRequest("invalid request target"))?;
    if !hop.preserve_host {
        h.insert(header::HOST, target.host.clone());
    }
    h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    h.insert(header::UPGRADE, ask.protocol.clone());
    let mut req = Request::new(UpBody::empty());
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.headers_mut() = h;
    let mut resp = match tokio::time::timeout(up.cfg.response_timeout, client.send(req)).await {
        Err(_) => {
            up.outcome(target, false);
            super::log_failure(up, hop.route, target, &Refusal::UpstreamTimeout);
            return Err(Refusal::UpstreamTimeout);
        }
        Ok(Err(e)) => {
            up.outcome(target, false);
            if e.is_connect() {
                up.stats.connect_errors.inc();
            }
            let refusal = Refusal::Upstream("upgrade request failed");
            super::log_failure(up, hop.route, target, &refusal);
            tracing::debug!(upstream = %up.cfg.name, error = %e, "upgrade failed");
            return Err(refusal);
        }
        Ok(Ok(r)) => r,
    };
    up.outcome(target, !resp.status().is_server_error());
    if let Some(n) = hop.note_target {
        let _ = n.set(target.name.clone());
    }
    let read_timeout = up.cfg.read_timeout;
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        headers::rewrite_response(resp.headers_mut());
        return Ok(resp.map(|b| PooledBody::plain(b, read_timeout)));
    }
    let theirs = hyper::upgrade::on(&mut resp);
    let protocol = resp
        .headers()
        .get(header::UPGRADE)
        .cloned()
        .unwrap_or(ask.protocol);
    headers::rewrite_response(resp.headers_mut());
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    resp.headers_mut().insert(header::UPGRADE, protocol);
    let metrics = ask.metrics;
    let ours = ask.client;
    let hold = ask.hold;
    tokio::spawn(async move {
        let (c, u) = match tokio::try_join!(ours, theirs) {
            Ok(both) => both,
            Err(e) => {
                tracing::debug!("upgrade not completed: {e}");
                return;
            }
        };
        metrics.upgrades.inc();
        metrics.upgrades_open.inc();
        join(TokioIo::new(c), TokioIo::new(u), read_timeout).await;
        metrics.upgrades_open.dec();
        drop(hold);
    });
    Ok(resp.map(|b| PooledBody::plain(b, read_timeout)))
}

/// Copies both ways until both sides have closed (a side's end of input is passed on as a
/// half-close), either fails, or nothing moves for `idle`.
async fn join<A, B>(a: A, b: B, idle: Duration)
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let (mut ar, mut aw) = tokio::io::split(a);
    let (mut br, mut bw) = tokio::io::split(b);
    let mut abuf = vec![0u8; 16 * 1024];
    let mut bbuf = vec![0u8; 16 * 1024];
    let (mut a_open, mut b_open) = (true, true);
    while a_open || b_open {
        tokio::select! {
            r = ar.read(&mut abuf), if a_open => match r {
                Ok(0) | Err(_) => {
                    a_open = false;
                    let _ = bw.shutdown().await;
                }
                Ok(n) => {
                    if bw.write_all(&abuf[..n]).await.is_err() {
                        return;
                    }
                }
            },
            r = br.read(&mut bbuf), if b_open => match r {
                Ok(0) | Err(_) => {
                    b_open = false;
                    let _ = aw.shutdown().await;
                }
                Ok(n) => {
                    if aw.write_all(&bbuf[..n]).await.is_err() {
                        return;
                    }
                }
            },
            _ = tokio::time::sleep(idle) => return,
        }
    }
}
